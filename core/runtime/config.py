"""Stack configuration: frozen, validated attrs classes, read from TOML files or built-in names.

A stack names its target, drafter, shortlister, scheduler, GEMM backend, verifier and decoding
parameters. File layout::

    name = "my-stack"
    base = "eagle"              # optional: start from another stack (built-in name or file)
    target = "gemma3-270m"
    drafter = "gemma3-270m"     # a trained drafter (built-in artifact name or directory), a drafter
                                # component's name ("ngram"), or "none" for plain decoding; or a
    # [drafter] table: name = "composite"  drafters = ["ngram", "gemma3-270m"]

    [shortlister]               # every key but `name` is a parameter of the component
    name = "full"
    [scheduler]
    name = "fixed"
    [backend]
    name = "torch"
    [verifier]
    name = "auto"               # greedy at temperature 0, lossless sampling above
    [draft]
    mode = "tree"               # or "chain"
    depth = 6
    topk = 10
    total_tokens = 60
    router_overlap = "off"      # or "thread": route the next step beside the draft decoder layer
    [decode]
    temperature = 0.0
    top_p = 1.0
    max_new_tokens = 128
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Mapping

import attrs

from dynaspec.errors import ConfigError

#: ``draft.planner`` values (see :class:`DraftConfig`)
PLANNERS = ("rate", "cost", "cost-gate", "auto")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _frozen_params(value: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(dict(value or {}).items()))


def _check(field: str, ok: bool, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{field} = {value!r} is invalid: {rule}")


@attrs.frozen
class ComponentRef:
    """A component chosen by name, with its parameters."""

    name: str
    params: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_frozen_params)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.kwargs}


def _positive_int(field: str):
    def validate(_inst, attribute, value):
        _check(f"{field}.{attribute.name}", isinstance(value, int) and not isinstance(value, bool)
               and value >= 1, value, "must be an integer >= 1")
    return validate


@attrs.frozen
class DraftConfig:
    """Shape of the draft: a chain of ``depth`` tokens, or an EAGLE-2 dynamic tree, or "auto": the
    tree where the target verifies the tree's rows for about the cost of one (its quantised kernel
    on AMX tiles, :func:`dynaspec.runtime.numerics.cheap_rows`), else the chain of ``depth`` (the
    engine decides, once it has set up its target)."""

    mode: str = attrs.field(default="tree")
    depth: int = attrs.field(default=6, validator=_positive_int("draft"))
    topk: int = attrs.field(default=10, validator=_positive_int("draft"))
    total_tokens: int = attrs.field(default=60, validator=_positive_int("draft"))
    #: "thread" computes the router (which reads only E(x_t) and the previous feature) on a worker
    #: thread while the draft decoder layer runs, instead of after it. It pays only where a core is
    #: idle during the draft step (e.g. one torch thread per process on a multi-core machine).
    router_overlap: str = attrs.field(default="off")
    #: Stop drafting deeper once the drafter's likeliest line (the product of its draft
    #: probabilities from the root) falls below this; 0 always drafts ``depth`` steps. A tree
    #: (greedy) also verifies, beside its first line, only the nodes at least this likely.
    min_confidence: float = attrs.field(default=0.0, converter=float)
    #: Decode plainly while drafting does not pay: the engine measures, as it goes, the tokens per
    #: second of its drafted cycles and of plain steps on this machine, falls back to plain steps
    #: when drafting is slower, and drafts again now and then to see whether it pays again (see
    #: :class:`dynaspec.runtime.gate.DraftGate`). Output is the same either way.
    adaptive: bool = attrs.field(default=False)
    #: How ``adaptive`` decides: "rate" drafts or not by comparing the drafted cycles' measured
    #: tokens per second with plain steps'; "cost" also chooses each cycle's depth, from the
    #: measured costs of a draft step, a verification by rows and a plain step against this
    #: generation's acceptance per draft position (:class:`dynaspec.runtime.gate.CostPlanner`);
    #: "cost-gate" decides from the same cost model whether to draft, and drafts the stack's whole
    #: depth and tree when it does (where a verification's rows cost next to nothing, as on AMX
    #: tiles, deeper drafts earned more than the model's chain of expected tokens foresaw: 1.81x
    #: against 1.72x on 48 train prompts, about even on dev; session 43); "auto" is "cost-gate"
    #: where the target verifies a tree's rows for about the cost of one
    #: (:func:`dynaspec.runtime.numerics.cheap_rows`, where ``mode = "auto"`` drafts a tree), else
    #: "cost".
    planner: str = attrs.field(default="rate")
    #: For the cost model's planners ("cost", "cost-gate", "auto"): how many drafted cycles the
    #: engine's earlier generations weigh in a new generation's acceptance per position (more: a
    #: generation unlike the earlier ones takes more failed cycles to stop drafting; less: fewer
    #: cycles of evidence stop it).
    planner_prior: float = attrs.field(default=2.0, converter=float)

    @planner_prior.validator
    def _planner_prior(self, _attribute, value):
        _check("draft.planner_prior", math.isfinite(value) and value > 0, value, "must be > 0")

    @planner.validator
    def _planner(self, _attribute, value):
        _check("draft.planner", value in PLANNERS, value, "must be one of " + ", ".join(map(repr, PLANNERS)))

    @adaptive.validator
    def _adaptive(self, _attribute, value):
        _check("draft.adaptive", isinstance(value, bool), value, "must be true or false")

    @min_confidence.validator
    def _min_confidence(self, _attribute, value):
        _check("draft.min_confidence", 0.0 <= value < 1.0, value, "must satisfy 0 <= value < 1")

    @mode.validator
    def _mode(self, _attribute, value):
        _check("draft.mode", value in ("chain", "tree", "auto"), value, "must be 'chain', 'tree' or 'auto'")

    def as_chain(self) -> "DraftConfig":
        """The chain of ``depth`` this draft stands for (one token a step, ``depth`` in all)."""
        return attrs.evolve(self, mode="chain", topk=1, total_tokens=self.depth)

    @router_overlap.validator
    def _router_overlap(self, _attribute, value):
        _check("draft.router_overlap", value in ("off", "thread"), value, "must be 'off' or 'thread'")


@attrs.frozen
class DecodeConfig:
    """Decoding parameters; temperature 0 means greedy."""

    temperature: float = attrs.field(default=0.0, converter=float)
    top_p: float = attrs.field(default=1.0, converter=float)
    max_new_tokens: int = attrs.field(default=128, validator=_positive_int("decode"))
    seed: int | None = None

    @temperature.validator
    def _temperature(self, _attribute, value):
        _check("decode.temperature", math.isfinite(value) and value >= 0, value, "must be >= 0")

    @top_p.validator
    def _top_p(self, _attribute, value):
        _check("decode.top_p", 0 < value <= 1, value, "must satisfy 0 < top_p <= 1")


def _drafter(value: Any) -> ComponentRef | None:
    """A stack's drafter: None for plain decoding ("none", empty), else a component reference. A
    plain string is a drafter component's name or, where no component has that name, the trained
    drafter at that artifact (see :func:`dynaspec.runtime.drafters.drafter_component`)."""
    if value is None or (isinstance(value, str) and value in ("", "none")):
        return None
    ref = _component(value)
    return None if ref.name == "none" else ref


def _component(value: Any) -> ComponentRef:
    if isinstance(value, ComponentRef):
        return value
    if isinstance(value, str):
        return ComponentRef(value)
    if isinstance(value, Mapping):
        value = dict(value)
        name = value.pop("name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"component table {value!r} needs a 'name'")
        return ComponentRef(name, value)
    raise ConfigError(f"a component must be a name or a table, not {value!r}")


@attrs.frozen
class StackConfig:
    """A complete, validated stack."""

    name: str
    target: str
    drafter: ComponentRef | None = attrs.field(default=None, converter=_drafter)
    shortlister: ComponentRef = attrs.field(default=ComponentRef("full"), converter=_component)
    scheduler: ComponentRef = attrs.field(default=ComponentRef("fixed"), converter=_component)
    backend: ComponentRef = attrs.field(default=ComponentRef("torch"), converter=_component)
    verifier: ComponentRef = attrs.field(default=ComponentRef("auto"), converter=_component)
    draft: DraftConfig = attrs.field(factory=DraftConfig)
    decode: DecodeConfig = attrs.field(factory=DecodeConfig)
    description: str = ""
    #: The target's (and drafter's) dtype: "float32", "bfloat16", or "auto": bfloat16 where the
    #: hardware computes it natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX) and the
    #: output is verified bit for bit (plain decoding and chains), else float32 (see ``target_dtype``).
    dtype: str = attrs.field(default="auto")
    #: Where the target, the drafter and every tensor of the engine live: "cpu", "cuda", "cuda:1", ...
    device: str = attrs.field(default="cpu")
    #: "required": speculative output must equal plain decoding by construction (the numerics probe
    #: found, or padded to, products whose rows do not depend on the row count, and the draft is a
    #: chain, or a tree on a target with a lean forward); a stack that is not guaranteed is refused.
    #: "observed": run it anyway; its output is compared with plain decoding (eval, bench) and its
    #: statistics say whether it is guaranteed. A stack file that does not say is "required" for a
    #: chain and "observed" for a tree (guaranteed on the lean forward within the probed rows).
    exact: str = attrs.field(default="required")
    #: Which weights the target computes from (its lean forward and LM head): "dtype" (the target
    #: dtype's own), "float16" (2 bytes a weight), "int8-head" (float16 body, int8 LM head with
    #: 7-bit activations), "int8" (1 byte a weight everywhere, activations in the dtype; this
    #: project's kernel, compiled at first use), "w8a8" (the same weights, each activation row as
    #: int8 with a scale of its own: the fastest products on a CPU with AVX-512 VNNI, at some
    #: quality cost, see docs/results.md), or "auto": the fastest of these whose quality was
    #: measured within bounds for this target (its ``auto_weights``; "dtype" where nobody measured,
    #: or where no kernel for it runs).
    #: Speculative output equals plain decoding with the same weights; see dynaspec.runtime.quantized.
    weights: str = attrs.field(default="auto")

    @weights.validator
    def _weights(self, _attribute, value):
        _check("weights", value in WEIGHTS_CHOICES, value, f"must be one of {', '.join(WEIGHTS_CHOICES)}")

    @dtype.validator
    def _dtype(self, _attribute, value):
        _check("dtype", value in DTYPE_CHOICES, value, f"must be one of {', '.join(DTYPE_CHOICES)}")

    @exact.validator
    def _exact(self, _attribute, value):
        _check("exact", value in EXACT_CHOICES, value, f"must be one of {', '.join(EXACT_CHOICES)}")

    @device.validator
    def _device(self, _attribute, value):
        _check("device", isinstance(value, str) and value.split(":")[0] in ("cpu", "cuda"), value,
               "must be 'cpu' or 'cuda[:index]'")

    @property
    def drafter_label(self) -> str:
        """The drafter as one short string: ``none``, its name, or ``name(key=value, ...)``."""
        if self.drafter is None:
            return "none"
        if not self.drafter.params:
            return self.drafter.name
        return f"{self.drafter.name}({', '.join(f'{k}={v!r}' for k, v in self.drafter.params)})"

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def verifier_name(self) -> str:
        """The verifier actually used: ``auto`` picks greedy at temperature 0, sampling above."""
        if self.verifier.name == "auto":
            return "greedy" if self.decode.temperature == 0 else "sampling"
        return self.verifier.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "target": self.target,
            "drafter": ("none" if self.drafter is None else self.drafter.name if not self.drafter.params
                        else self.drafter.to_dict()),
            "shortlister": self.shortlister.to_dict(),
            "scheduler": self.scheduler.to_dict(),
            "backend": self.backend.to_dict(),
            "verifier": self.verifier.to_dict(),
            "draft": attrs.asdict(self.draft),
            "decode": {k: v for k, v in attrs.asdict(self.decode).items() if v is not None},
            "dtype": self.dtype,
            "device": self.device,
            "exact": self.exact,
            "weights": self.weights,
        }

    def with_overrides(self, overrides: Mapping[str, Any]) -> "StackConfig":
        """A copy with dotted fields replaced, e.g. ``{"draft.depth": 5, "backend": "torch"}``."""
        data = self.to_dict()
        for key, value in overrides.items():
            _assign(data, key, value)
        return stack_from_mapping(data)


_TOP_FIELDS = {"name", "description", "target", "drafter", "shortlister", "scheduler", "backend",
               "verifier", "draft", "decode", "base", "dtype", "device", "exact", "weights"}
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
#: see StackConfig.weights and dynaspec.runtime.quantized
WEIGHTS_CHOICES = ("auto", "dtype", "float16", "int8-head", "int8", "w8a8")
EXACT_CHOICES = ("required", "observed")
_COMPONENT_FIELDS = {"shortlister", "scheduler", "backend", "verifier", "drafter"}


def _assign(data: dict[str, Any], dotted: str, value: Any) -> None:
    head, _, rest = dotted.partition(".")
    if head not in _TOP_FIELDS - {"base"}:
        raise ConfigError(f"unknown stack field '{dotted}'; fields: {', '.join(sorted(_TOP_FIELDS))}")
    if not rest:
        if head in _COMPONENT_FIELDS and isinstance(value, str):
            # a new component name drops the old component's parameters
            value = {"name": value}
        data[head] = value
        return
    if head not in _COMPONENT_FIELDS | {"draft", "decode"}:
        raise ConfigError(f"stack field '{head}' has no sub-field '{rest}'")
    current = data.get(head)
    if head == "drafter" and current in (None, "", "none"):
        raise ConfigError(f"cannot set '{dotted}': the stack has no drafter (set drafter = NAME first)")
    table = {"name": current} if isinstance(current, str) else dict(current or {})
    table[rest] = value
    data[head] = table


def stack_from_mapping(data: Mapping[str, Any], *, source: str = "stack") -> StackConfig:
    """Validate a mapping (parsed TOML) into a :class:`StackConfig`."""
    data = dict(data)
    unknown = set(data) - _TOP_FIELDS
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {', '.join(sorted(unknown))}; "
                          f"fields: {', '.join(sorted(_TOP_FIELDS))}")
    for key in ("name", "target"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ConfigError(f"{source}: '{key}' must be a non-empty string")
    drafter = _drafter(data.get("drafter"))
    tables = {}
    for key, cls in (("draft", DraftConfig), ("decode", DecodeConfig)):
        table = dict(data.get(key) or {})
        known = {a.name for a in attrs.fields(cls)}
        if set(table) - known:
            raise ConfigError(f"{source}: unknown field(s) "
                              f"{', '.join(f'{key}.{k}' for k in sorted(set(table) - known))}; "
                              f"{key} fields: {', '.join(sorted(known))}")
        tables[key] = cls(**table)
    draft, decode = tables["draft"], tables["decode"]
    if draft.mode == "chain":
        draft = draft.as_chain()
    if "exact" not in data:  # a chain is required to be exact; a tree is where the target's forward allows
        # ("auto" drafts a tree only where the guarantee covers it)
        data["exact"] = ("required" if draft.mode in ("chain", "auto") or draft.topk == 1 or drafter is None
                         else "observed")
    return StackConfig(
        name=data["name"], target=data["target"], drafter=drafter,
        description=str(data.get("description", "")),
        draft=draft, decode=decode,
        **{k: data[k] for k in ("dtype", "device", "exact", "weights") if k in data},
        **{k: data[k] for k in _COMPONENT_FIELDS - {"drafter"} if k in data},
    )


def merge(base: Mapping[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """Child fields over base fields; tables merge one level deep (a new component name resets).
    The description is the child's own: a stack built on a base is another stack."""
    out = {k: v for k, v in base.items() if k != "description"}
    for key, value in child.items():
        if key == "base":
            continue
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            if key in _COMPONENT_FIELDS and value.get("name", out[key].get("name")) != out[key].get("name"):
                out[key] = dict(value)
            else:
                out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"stack file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
