"""The ``fixed`` scheduler: the same budget at every draft depth."""

from __future__ import annotations

from dynaspec.errors import ConfigError
from dynaspec.runtime.config import require_positive_int
from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.registry import Component


class FixedBudget:
    """``budget`` at every depth (tokens or clusters, in the shortlister's unit)."""

    def __init__(self, budget: int) -> None:
        self.value = budget

    def budget(self, *, depth: int, scores=None) -> int:
        return self.value


def _fixed(params, ctx):
    params = dict(params)
    budget = params.pop("budget", 32768)
    if params:
        raise ConfigError(f"scheduler 'fixed' has no parameter(s) {sorted(params)}; it takes 'budget'")
    return FixedBudget(require_positive_int("scheduler.budget", budget))


@hookimpl
def dynaspec_schedulers():
    return [Component("fixed", _fixed, "the same budget at every draft depth")]
