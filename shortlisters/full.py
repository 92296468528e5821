"""The ``full`` shortlister: no shortlist, the draft head scores the whole vocabulary."""

from __future__ import annotations

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import NoParams
from dynaspec.runtime.registry import Component
from dynaspec.runtime.types import Shortlist


class FullVocabulary:
    """Always the full vocabulary (EAGLE's draft head)."""

    budget_unit = "tokens"

    def propose(self, step, scheduler) -> Shortlist:
        return Shortlist.full()


def _full(params: NoParams, ctx) -> FullVocabulary:
    return FullVocabulary()


@hookimpl
def dynaspec_shortlisters():
    return [Component("full", _full, "the whole vocabulary (EAGLE)", params=NoParams)]
