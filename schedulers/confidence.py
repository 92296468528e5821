"""The ``confidence`` scheduler (beyond the paper): the cluster budget follows the router's
certainty instead of depth alone.

At each step it keeps the fewest top-scored clusters whose router probability mass reaches
``mass`` (taking the largest such count over the rows of the step), clipped to
``[k_min, k_max]``, and never more than the position-aware budget ``k_max // ((t + 1) * 2)`` allows
at depths ``t >= 2``. Without router scores (another shortlister) it falls back to that
position-aware budget.

``mass`` may also be a list, one value per draft depth (the last one serves every deeper step): a
miss at depth ``t`` loses every later token of the chain too, so early depths are worth more mass.
"""

from __future__ import annotations

import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.config import require_positive_int
from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.registry import Component


class ConfidenceBudget:
    def __init__(self, k_max: int, k_min: int, masses: list[float]) -> None:
        self.k_max, self.k_min = k_max, k_min
        self.masses = tuple(masses)  # one per depth; the last serves every deeper step

    @property
    def mass(self) -> float | tuple[float, ...]:
        return self.masses[0] if len(self.masses) == 1 else self.masses

    def mass_at(self, depth: int) -> float:
        return self.masses[min(depth, len(self.masses) - 1)]

    def _cap(self, depth: int) -> int:
        return self.k_max if depth <= 1 else max(1, self.k_max // ((depth + 1) * 2))

    def budget(self, *, depth: int, scores: torch.Tensor | None = None) -> int:
        cap = self._cap(depth)
        if scores is None:
            return cap
        probs = scores.float().sort(dim=-1, descending=True).values.cumsum(-1)
        needed = int((probs < self.mass_at(depth)).sum(-1).max()) + 1
        return max(min(self.k_min, cap), min(needed, cap))


def _confidence(params, ctx):
    params = dict(params)
    k_max = params.pop("k_max", 128)
    k_min = params.pop("k_min", 4)
    mass = params.pop("mass", 0.95)
    if params:
        raise ConfigError(f"scheduler 'confidence' has no parameter(s) {sorted(params)}; "
                          "it takes 'k_max', 'k_min' and 'mass'")
    require_positive_int("scheduler.k_max", k_max)
    require_positive_int("scheduler.k_min", k_min)
    masses = mass if isinstance(mass, list) else [mass]
    if not masses or not all(isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m <= 1
                             for m in masses):
        raise ConfigError(f"scheduler.mass = {mass!r} is invalid: must be a number (or a list of "
                          "numbers, one per draft depth) with 0 < mass <= 1")
    return ConfidenceBudget(k_max, k_min, [float(m) for m in masses])


@hookimpl
def dynaspec_schedulers():
    return [Component("confidence", _confidence,
                      "fewest clusters holding `mass` of the router's probability, capped by depth")]
