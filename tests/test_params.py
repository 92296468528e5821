"""Typed component parameters: every built-in component declares a parameter class, and the
registry refuses unknown, missing and invalid values with the field, the value and the unit."""

from __future__ import annotations

import attrs
import pytest

from conftest import builtin_registry
from dynaspec import Component, hookimpl
from dynaspec.errors import ConfigError
from dynaspec.runtime.params import NoParams, describe, param, positive_int


def test_every_builtin_component_declares_its_parameters():
    registry = builtin_registry()
    for kind in ("shortlister", "scheduler", "backend", "verifier", "target"):
        for name in registry.names(kind):
            params = registry.get(kind, name).params
            assert params is not None and attrs.has(params), f"{kind} '{name}' has no parameter class"


@pytest.mark.parametrize(("kind", "name", "values", "message"), [
    ("scheduler", "fixed", {"budget": 0},
     r"scheduler.budget = 0 is invalid for scheduler 'fixed': must be an integer >= 1"),
    ("scheduler", "fixed", {"budget": "64"}, r"scheduler.budget = '64' is invalid"),
    ("scheduler", "fixed", {"unit": "words"},
     r"scheduler.unit = 'words' is invalid for scheduler 'fixed': must be 'tokens' or 'clusters'"),
    ("scheduler", "position-aware", {"kmax": 5}, r"scheduler 'position-aware' has no parameter 'kmax'; "
     r"it takes: k_max, unit"),
    ("scheduler", "confidence", {"mass": [0.9, 1.5]}, r"scheduler.mass = \[0.9, 1.5\] is invalid"),
    ("scheduler", "confidence", {"k_min": -1}, r"scheduler.k_min = -1 is invalid"),
    ("shortlister", "frequency", {}, r"shortlister 'frequency' needs 'path'"),
    ("shortlister", "frequency", {"path": "x", "context": -3},
     r"shortlister.context = -3 is invalid for shortlister 'frequency': must be an integer >= 0, in tokens"),
    ("shortlister", "dynaspec", {"clusters": "c"}, r"shortlister 'dynaspec' needs 'router'"),
    ("shortlister", "full", {"k": 3}, r"shortlister 'full' has no parameter 'k'; it takes: no parameters"),
    ("backend", "torch", {"fast": True}, r"backend 'torch' has no parameter 'fast'"),
    ("backend", "triton", {"block_n": 48}, r"backend.block_n = 48 is invalid for backend 'triton': must be a "
     r"power of two >= 16, in rows"),
    ("verifier", "greedy", {"temperature": 1.0}, r"verifier 'greedy' has no parameter 'temperature'"),
    ("target", "tiny-llama", {"seed": 1}, r"target 'tiny-llama' has no parameter 'seed'"),
])
def test_bad_parameters_name_the_field_value_and_unit(kind, name, values, message):
    with pytest.raises(ConfigError, match=message):
        builtin_registry().build(kind, name, values, None)


def test_parameters_arrive_typed_with_their_defaults():
    registry = builtin_registry()
    fixed = registry.build("scheduler", "fixed", {"budget": 9, "unit": "clusters"}, None)
    assert (fixed.budget(depth=4), fixed.unit) == (9, "clusters")
    assert registry.build("scheduler", "position-aware", {}, None).unit == "tokens"
    assert registry.build("scheduler", "confidence", {}, None).unit == "clusters"


def test_describe_lists_units_defaults_and_help():
    from dynaspec.schedulers.fixed import FixedParams

    text = describe(FixedParams)
    assert "budget (default 32768): shortlist size" in text
    assert "unit (default 'tokens')" in text


class _Plugin:
    """A third-party scheduler with a typed parameter, and one without a parameter class."""

    @attrs.frozen
    class Params:
        width: int = param(help="how wide", unit="tokens", check=positive_int, rule="must be >= 1")

    class Budget:
        def __init__(self, width):
            self.width = width

        def budget(self, *, depth, scores=None):
            return self.width

    @hookimpl
    def dynaspec_schedulers(self):
        return [Component("typed", lambda p, ctx: self.Budget(p.width), params=self.Params),
                Component("untyped", lambda p, ctx: self.Budget(p["width"]))]


def test_third_party_parameters_typed_or_raw():
    registry = builtin_registry(_Plugin())
    assert registry.build("scheduler", "typed", {"width": 3}, None).budget(depth=0) == 3
    with pytest.raises(ConfigError, match=r"scheduler.width = 0 is invalid for scheduler 'typed': must be >= 1, "
                       r"in tokens \(how wide\)"):
        registry.build("scheduler", "typed", {"width": 0}, None)
    assert registry.build("scheduler", "untyped", {"width": 5}, None).budget(depth=0) == 5
    assert attrs.has(NoParams) and not attrs.fields(NoParams)
