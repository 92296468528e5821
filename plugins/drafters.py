"""Built-in drafters: ``trained``, ``eagle``, ``ngram``, ``corpus`` and ``composite`` (see
:mod:`dynaspec.runtime.drafters` for what a drafter component builds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from dynaspec.errors import ConfigError
from dynaspec.runtime.drafters import (
    CompositeSource,
    CorpusSource,
    DrafterContext,
    NeuralSource,
    NGramSource,
)
from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import fraction, is_text, param, positive_int, size_param
from dynaspec.runtime.registry import Component


@attrs.frozen
class ModelParams:
    artifact: str = param(help="the drafter: a built-in artifact name (the target's name), a folder, or a "
                               "Hub id", check=is_text, rule="must be a non-empty string")
    context: int | None = param(None, help="at its first draft of a generation, the drafter reads only the "
                                           "text's last this many positions, then every new one (a long "
                                           "prompt's pass through Qwen's drafter costs about 50 ms per 300 "
                                           "positions on one core, two plain steps); default: all of it", unit="positions",
                                check=lambda v: v is None or positive_int(v), rule="must be an integer >= 1")


def _load(artifact: str, ctx: DrafterContext, *, eagle_only: bool):
    """The drafter model at ``artifact`` for the context's target: the one the caller gave, or one
    already loaded by another engine of this process, or loaded now."""
    from dynaspec.runtime.drafter import check_drafter_shape
    from dynaspec.runtime.targets import load_drafter

    if ctx.model is not None:  # loaded by the caller: loading checks the rest
        check_drafter_shape(ctx.model.cfg, ctx.target.fingerprint(), what=f"drafter '{artifact}'")
        where = next(ctx.model.parameters()).device
        if where.type != ctx.target.device.type:
            from dynaspec.errors import ConfigError

            raise ConfigError(f"the drafter given for '{artifact}' is on {where}, its target on "
                              f"{ctx.target.device}: move it first (drafter.to({str(ctx.target.device)!r}))")
        return ctx.model
    key = ("drafter", artifact)
    if key not in ctx.models:
        ctx.models[key] = load_drafter(artifact, ctx.target, eagle_only=eagle_only)
    return ctx.models[key]


def _trained(params: ModelParams, ctx: DrafterContext) -> NeuralSource:
    return NeuralSource(_load(params.artifact, ctx, eagle_only=False), ctx, context=params.context)


def _eagle(params: ModelParams, ctx: DrafterContext) -> NeuralSource:
    return NeuralSource(_load(params.artifact, ctx, eagle_only=True), ctx, context=params.context)


def _optional_size(value) -> bool:
    return value is None or positive_int(value)


@attrs.frozen
class NGramParams:
    min_ngram: int = size_param(2, "the shortest suffix of the text that is looked up", unit="tokens")
    max_ngram: int = size_param(4, "the longest suffix looked up (longer matches are tried first)",
                                unit="tokens")
    tokens: int | None = param(None, help="the most tokens proposed per cycle (default: the stack's "
                                          "draft.depth)", unit="tokens", check=_optional_size,
                               rule="must be an integer >= 1")


def _ngram(params: NGramParams, ctx: DrafterContext) -> NGramSource:
    return NGramSource(min_ngram=params.min_ngram, max_ngram=params.max_ngram,
                       tokens=params.tokens or ctx.draft.depth)


@attrs.frozen
class CorpusParams:
    artifact: str | None = param(None, help="the corpus of the target's own answers (see `dynaspec build-corpus`): "
                                            "a built-in artifact name or a folder; default: the target's built-in one",
                                 check=lambda v: v is None or is_text(v), rule="must be a non-empty string")
    min_count: int = size_param(2, "the fewest times the proposed token must have followed the n-gram in the corpus",
                                unit="times")
    min_share: float = param(0.5, help="the least share of the n-gram's occurrences the proposed token must have "
                                       "followed it in", check=fraction, rule="must be a number in (0, 1]")
    tokens: int | None = param(None, help="the most tokens proposed per cycle (default: the stack's draft.depth)",
                               unit="tokens", check=_optional_size, rule="must be an integer >= 1")


def _corpus(params: CorpusParams, ctx: DrafterContext) -> CorpusSource:
    from dynaspec.runtime.corpus import CorpusTable
    from dynaspec.runtime.targets import resolve_artifact

    ref = params.artifact or ctx.target.name
    try:
        path = resolve_artifact(ref)
    except ConfigError:
        raise ConfigError(f"drafter 'corpus': no corpus '{ref}'" + (
            "" if params.artifact else f" (target '{ref}' ships none; build one with `dynaspec build-corpus` "
                                       "and name it with artifact = \"FOLDER\")")) from None
    key = ("corpus", str(path))
    if key not in ctx.models:
        ctx.models[key] = CorpusTable.load(path, ctx.target.fingerprint())[0]
    return CorpusSource(ctx.models[key], tokens=params.tokens or ctx.draft.depth, min_count=params.min_count,
                        min_share=params.min_share)


def _drafter_list(value) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) >= 2
            and all(is_text(v) or (isinstance(v, Mapping) and is_text(v.get("name"))) for v in value))


@attrs.frozen
class CompositeParams:
    drafters: list = param(help="the drafters, in order of preference: names (a trained drafter's artifact "
                                "works as a name) or tables with a name and parameters",
                           check=_drafter_list, rule="must be a list of at least two drafter names or tables")
    merge: bool | None = param(None, help="in a greedy tree stack: true merges every drafter's tree into one "
                                          "(the default there); false lets the first drafter that proposes "
                                          "draft the cycle, as in a chain stack (so prompt lookup's chain where "
                                          "the text repeats, the trained drafter's tree elsewhere, and a tree no "
                                          "larger than the largest drafter's)",
                               check=lambda v: v is None or isinstance(v, bool), rule="must be true or false")


def _composite(params: CompositeParams, ctx: DrafterContext) -> CompositeSource:
    parts = list(params.drafters)  # checked by CompositeParams: two or more names or tables
    if any(isinstance(p, Mapping) and p.get("name") == "composite" or p == "composite" for p in parts):
        raise ConfigError("drafter 'composite': a composite cannot contain another composite")
    merge = ctx.draft.mode == "tree" if params.merge is None else params.merge and ctx.draft.mode == "tree"
    return CompositeSource([ctx.build(p) for p in parts], merge=merge)


@hookimpl
def dynaspec_drafters():
    return [
        Component("trained", _trained, "an EAGLE-style drafter trained by `dynaspec prepare` (or a published "
                  "EAGLE-1/2/3 checkpoint), drafting through the stack's shortlister", params=ModelParams),
        Component("eagle", _eagle, "a published EAGLE-1/2/3 checkpoint (folder or Hub id)", params=ModelParams),
        Component("ngram", _ngram, "prompt lookup: the continuation of the text's last n tokens where they "
                  "occurred before, in the prompt or the output; no model", params=NGramParams),
        Component("corpus", _corpus, "retrieval from the target's own answers to train prompts: the tokens it "
                  "most often wrote after the text's last 2 to 4 tokens, where it mostly did; no model",
                  params=CorpusParams),
        Component("composite", _composite, "several drafters: the first that proposes drafts a chain cycle; "
                  "in a greedy tree stack their trees merge", params=CompositeParams),
    ]
