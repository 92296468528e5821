"""Hook specifications of dynaspec.

A plugin contributes *named components* through these registration hooks. They run once, when the
plugin manager builds its component registry; the decode loop never dispatches through pluggy.

The four component families map onto the four steps of a speculative cycle:

* **propose shortlist** — shortlisters (``dynaspec_shortlisters``): which vocabulary rows the draft
  head scores at a draft step.
* **schedule budget** — schedulers (``dynaspec_schedulers``): how large the shortlist may be at draft
  depth ``t``.
* **draft-head matmul** — GEMM backends (``dynaspec_backends``): drafter hidden states times the
  shortlisted rows of the LM head.
* **verify** — verifiers (``dynaspec_verifiers``): accept or reject drafted tokens against the target's
  full-vocabulary logits.

What proposes the draft is a component too: drafters (``dynaspec_drafters``), a trained model
drafting through the four steps above, or a method with no model at all (prompt lookup).

Plugins may also ship named stacks (``dynaspec_stacks``) and target models (``dynaspec_targets``).

Each hook takes no arguments (arguments may be added later, never removed or renamed) and returns a
list of :class:`dynaspec.runtime.registry.Component` (or stack specs), or ``None`` to decline.

A plugin author needs one import::

    from dynaspec import hookimpl, Component

    @hookimpl
    def dynaspec_shortlisters():
        return [Component("my-list", MyShortlister, "what it does")]
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "dynaspec"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def dynaspec_shortlisters():  # type: ignore[empty-body]
    """Return shortlister components (``propose shortlist``), or None to decline.

    A shortlister factory is called as ``factory(params: dict, ctx: BuildContext)`` and returns an
    object with ``propose(step: DraftStep, scheduler) -> Shortlist``.
    """


@hookspec
def dynaspec_schedulers():  # type: ignore[empty-body]
    """Return budget scheduler components (``schedule budget``), or None to decline.

    A scheduler factory is called as ``factory(params: dict, ctx: BuildContext)`` and returns an
    object with ``budget(*, depth: int, scores=None) -> int``.
    """


@hookspec
def dynaspec_backends():  # type: ignore[empty-body]
    """Return draft-head GEMM backend components (``draft-head matmul``), or None to decline.

    A backend factory is called as ``factory(params: dict, ctx: BuildContext)`` and returns an object
    with ``logits(hidden: Tensor[R, d], shortlist: Shortlist) -> Tensor[R, n]``.
    """


@hookspec
def dynaspec_verifiers():  # type: ignore[empty-body]
    """Return verifier components (``verify``), or None to decline.

    A verifier factory is called as ``factory(params: dict, ctx: BuildContext)``; see
    :class:`dynaspec.runtime.protocols.Verifier` for the object it returns.
    """


@hookspec
def dynaspec_drafters():  # type: ignore[empty-body]
    """Return drafter components, or None to decline.

    A drafter factory is called as ``factory(params, ctx: DrafterContext)`` and returns a
    :class:`dynaspec.runtime.drafters.DraftSource`: what the engine keeps for it, how large its
    trees get, and ``start(capacity)`` giving a session whose ``grow(...)`` drafts one tree a cycle.
    """


@hookspec
def dynaspec_stacks():  # type: ignore[empty-body]
    """Return named stacks as ``{name: mapping}`` (the same fields as a stack TOML file), or None."""


@hookspec
def dynaspec_targets():  # type: ignore[empty-body]
    """Return target components, or None to decline.

    A target factory is called as ``factory(params: dict, ctx: None)`` and returns a
    :class:`dynaspec.runtime.target.TargetModel` (any Hugging Face causal LM wrapped with its tokenizer).
    A stack names it in its ``target`` field.
    """
