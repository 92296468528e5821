"""The ``position-aware`` scheduler of the DynaSpec paper: wide early, narrow deep.

``k(t) = k_max`` for draft depths ``t`` in {0, 1} and ``floor(k_max / ((t + 1) * 2))`` for ``t >= 2``,
never below 1. Early draft tokens are the likeliest to be accepted, so they get the widest
shortlist.
"""

from __future__ import annotations

import attrs

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import size_param, unit_param
from dynaspec.runtime.registry import Component
from dynaspec.schedulers.fixed import FixedBudget


@attrs.frozen
class PositionAwareParams:
    k_max: int = size_param(32768, "shortlist size at draft depths 0 and 1")
    unit: str = unit_param("tokens")


class PositionAware(FixedBudget):
    """Budget ``k_max`` at depths 0 and 1, then ``k_max // ((t + 1) * 2)``, in ``unit``."""

    @property
    def k_max(self) -> int:
        return self.value

    def budget(self, *, depth: int, scores=None) -> int:
        return self.value if depth <= 1 else max(1, self.value // ((depth + 1) * 2))


def _position_aware(params: PositionAwareParams, ctx) -> PositionAware:
    return PositionAware(params.k_max, params.unit)


@hookimpl
def dynaspec_schedulers():
    return [Component("position-aware", _position_aware,
                      "k_max at depths 0-1, then k_max // ((t+1)*2) (DynaSpec paper)",
                      params=PositionAwareParams)]
