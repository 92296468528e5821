"""The ``fixed`` scheduler: the same budget at every draft depth."""

from __future__ import annotations

import attrs

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import budget_unit, param, positive_int
from dynaspec.runtime.registry import Component


@attrs.frozen
class FixedParams:
    budget: int = param(32768, help="shortlist size at every draft depth", check=positive_int,
                        rule="must be an integer >= 1")
    unit: str = param("tokens", help="what `budget` counts: tokens, or clusters for the router",
                      check=budget_unit, rule="must be 'tokens' or 'clusters'")


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
