"""Typed component parameters.

A component declares its parameters as a frozen attrs class whose fields are made with
:func:`param`, and names that class in ``Component(..., params=TheClass)``. The registry then turns
the stack's table (``[scheduler] name = "fixed"  budget = 64  unit = "clusters"``) into an instance
before the factory sees it: unknown names, missing required values and invalid values are refused
with one message that names the component, the field, the value, the rule and the unit.

A component without a ``params`` class gets the raw dict, as before.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

from dynaspec.errors import ConfigError

#: the units a budget can be counted in; a scheduler says which one its numbers are in and the
#: engine refuses a shortlister that counts in another (see ``Engine._check_budget_units``)
BUDGET_UNITS = ("tokens", "clusters")


def param(default: Any = attrs.NOTHING, *, help: str, unit: str | None = None,
          check: Callable[[Any], bool] | None = None, rule: str = "",
          converter: Callable[[Any], Any] | None = None) -> Any:
    """One parameter: its default (none = required), what it means, its unit, and a check with the
    rule it enforces (shown when the check fails)."""
    return attrs.field(default=default, converter=converter,
                       metadata={"help": help, "unit": unit, "check": check, "rule": rule})


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any) -> bool:
    return is_int(value) and value >= 1


def non_negative_int(value: Any) -> bool:
    return is_int(value) and value >= 0


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fraction(value: Any) -> bool:
    """A number in (0, 1]."""
    return is_number(value) and 0 < value <= 1


def is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def budget_unit(value: Any) -> bool:
    return value in BUDGET_UNITS


def describe(cls: type) -> str:
    """``name (unit, default D): help`` for each parameter, one per line."""
    lines = []
    for f in attrs.fields(cls):
        meta = f.metadata
        bits = [meta.get("unit")] if meta.get("unit") else []
        bits.append("required" if f.default is attrs.NOTHING else f"default {f.default!r}")
        lines.append(f"{f.name} ({', '.join(bits)}): {meta.get('help', '')}")
    return "\n".join(lines)


def parse(kind: str, name: str, cls: type, values: Mapping[str, Any]) -> Any:
    """``values`` as an instance of the parameter class ``cls`` of component ``name`` of ``kind``."""
    fields = {f.name: f for f in attrs.fields(cls)}
    what = f"{kind} '{name}'"
    unknown = sorted(set(values) - set(fields))
    if unknown:
        takes = ", ".join(fields) or "no parameters"
        raise ConfigError(f"{what} has no parameter {', '.join(map(repr, unknown))}; it takes: {takes}")
    missing = [n for n, f in fields.items() if f.default is attrs.NOTHING and n not in values]
    if missing:
        helps = "; ".join(f"{n}: {fields[n].metadata.get('help', '')}" for n in missing)
        raise ConfigError(f"{what} needs {', '.join(map(repr, missing))} ({helps})")
    for key, value in values.items():
        meta = fields[key].metadata
        check = meta.get("check")
        if check is not None and not check(value):
            unit = f", in {meta['unit']}" if meta.get("unit") else ""
            raise ConfigError(f"{kind}.{key} = {value!r} is invalid for {what}: {meta.get('rule') or 'bad value'}"
                              f"{unit} ({meta.get('help', '')})")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # a converter or validator of the class itself
        raise ConfigError(f"{what}: {exc}") from None


@attrs.frozen
class NoParams:
    """The parameter class of a component that takes none: any parameter is refused by name."""


def size_param(default: int, help: str, unit: str | None = None) -> Any:
    """A size (a budget, a count): an integer >= 1."""
    return param(default, help=help, unit=unit, check=positive_int, rule="must be an integer >= 1")


def unit_param(default: str) -> Any:
    """The unit a scheduler's budget counts in."""
    return param(default, help="what the budget counts: tokens, or clusters for the router",
                 check=budget_unit, rule="must be 'tokens' or 'clusters'")
