"""The ``fixed`` scheduler: the same budget at every draft depth."""

from __future__ import annotations

import attrs

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import size_param, unit_param
from dynaspec.runtime.registry import Component


@attrs.frozen
class FixedParams:
    budget: int = size_param(32768, "shortlist size at every draft depth")
    unit: str = unit_param("tokens")


class FixedBudget:
    """``budget`` at every depth, in ``unit`` (tokens or clusters)."""

    def __init__(self, budget: int, unit: str = "tokens") -> None:
        self.value, self.unit = budget, unit

    def budget(self, *, depth: int, scores=None) -> int:
        return self.value


def _fixed(params: FixedParams, ctx) -> FixedBudget:
    return FixedBudget(params.budget, params.unit)


@hookimpl
def dynaspec_schedulers():
    return [Component("fixed", _fixed, "the same budget at every draft depth", params=FixedParams)]
