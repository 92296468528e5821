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

import attrs
import torch

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import fraction, param, size_param, unit_param
from dynaspec.runtime.registry import Component


def _masses(value) -> bool:
    return fraction(value) or (isinstance(value, list) and bool(value) and all(map(fraction, value)))


@attrs.frozen
class ConfidenceParams:
    k_max: int = size_param(128, "most clusters at draft depths 0 and 1 (fewer deeper)")
    k_min: int = size_param(4, "fewest clusters at any depth")
    mass: float | list = param(0.95, help="router probability mass to cover (one number, or one per depth)",
                               check=_masses, rule="must be a number (or a list of numbers, one per draft "
                               "depth) with 0 < mass <= 1")
    unit: str = unit_param("clusters")


class ConfidenceBudget:
    def __init__(self, k_max: int, k_min: int, masses: list[float], unit: str = "clusters") -> None:
        self.k_max, self.k_min, self.unit = k_max, k_min, unit
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


def _confidence(params: ConfidenceParams, ctx) -> ConfidenceBudget:
    masses = params.mass if isinstance(params.mass, list) else [params.mass]
    return ConfidenceBudget(params.k_max, params.k_min, [float(m) for m in masses], params.unit)


@hookimpl
def dynaspec_schedulers():
    return [Component("confidence", _confidence,
                      "fewest clusters holding `mass` of the router's probability, capped by depth",
                      params=ConfidenceParams)]
