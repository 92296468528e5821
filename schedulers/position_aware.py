"""The ``position-aware`` scheduler of the DynaSpec paper: wide early, narrow deep.

``k(t) = k_max`` for draft depths ``t`` in {0, 1} and ``floor(k_max / ((t + 1) * 2))`` for ``t >= 2``,
never below 1. Early draft tokens are the likeliest to be accepted, so they get the widest
shortlist.
"""

from __future__ import annotations

from dynaspec.errors import ConfigError
from dynaspec.runtime.config import require_positive_int
from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.registry import Component


class PositionAware:
    """Budget ``k_max`` at depths 0 and 1, then ``k_max // ((t + 1) * 2)``."""

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max

    def budget(self, *, depth: int, scores=None) -> int:
        if depth <= 1:
            return self.k_max
        return max(1, self.k_max // ((depth + 1) * 2))


def _position_aware(params, ctx):
    params = dict(params)
    k_max = params.pop("k_max", params.pop("budget", 32768))
    if params:
        raise ConfigError(f"scheduler 'position-aware' has no parameter(s) {sorted(params)}; it takes 'k_max'")
    return PositionAware(require_positive_int("scheduler.k_max", k_max))


@hookimpl
def dynaspec_schedulers():
    return [Component("position-aware", _position_aware,
                      "k_max at depths 0-1, then k_max // ((t+1)*2) (DynaSpec paper)")]
