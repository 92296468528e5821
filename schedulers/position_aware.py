"""The ``position-aware`` scheduler of the DynaSpec paper: wide early, narrow deep.

``k(t) = k_max`` for draft depths ``t`` in {0, 1} and ``floor(k_max / ((t + 1) * 2))`` for ``t >= 2``,
never below 1. Early draft tokens are the likeliest to be accepted, so they get the widest
shortlist.
"""

from __future__ import annotations

import attrs

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import budget_unit, param, positive_int
from dynaspec.runtime.registry import Component


@attrs.frozen
class PositionAwareParams:
    k_max: int = param(32768, help="shortlist size at draft depths 0 and 1", check=positive_int,
                       rule="must be an integer >= 1")
    unit: str = param("tokens", help="what `k_max` counts: tokens, or clusters for the router",
                      check=budget_unit, rule="must be 'tokens' or 'clusters'")


class PositionAware:
    """Budget ``k_max`` at depths 0 and 1, then ``k_max // ((t + 1) * 2)``, in ``unit``."""

    def __init__(self, k_max: int, unit: str = "tokens") -> None:
        self.k_max, self.unit = k_max, unit

    def budget(self, *, depth: int, scores=None) -> int:
        if depth <= 1:
            return self.k_max
        return max(1, self.k_max // ((depth + 1) * 2))


def _position_aware(params: PositionAwareParams, ctx) -> PositionAware:
    return PositionAware(params.k_max, params.unit)


@hookimpl
def dynaspec_schedulers():
    return [Component("position-aware", _position_aware,
                      "k_max at depths 0-1, then k_max // ((t+1)*2) (DynaSpec paper)",
                      params=PositionAwareParams)]
