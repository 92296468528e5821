"""The speculative decoding engine.

One cycle: the drafter catches up on the target's true features, grows a draft tree (per depth:
budget -> shortlist -> head GEMM over the shortlist -> children), the target scores the whole tree
in one pass with a tree attention mask, the verifier accepts a path plus one bonus token, and both
KV caches keep exactly the committed tokens.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterator, Mapping, Sequence

import attrs
import torch

from dynaspec.errors import ConfigError, InputError
from dynaspec.runtime import numerics
from dynaspec.runtime.config import StackConfig
from dynaspec.runtime.drafter import Drafter
from dynaspec.runtime.drafters import DrafterContext, DraftSource, build_drafter, grow_within
from dynaspec.runtime.gate import CostPlanner, DepthControl, DraftGate, PlainCost
from dynaspec.runtime.protocols import DecodeParams, ShortlisterCapabilities, capabilities
from dynaspec.runtime.q8 import argmax
from dynaspec.runtime.q8 import huge_pages as move_to_huge_pages
from dynaspec.runtime.registry import Registry, default_registry
from dynaspec.runtime.stats import GenerationStats
from dynaspec.runtime.target import TargetPass
from dynaspec.runtime.tree import DraftTree
from dynaspec.runtime.types import BuildContext

#: prompts longer than this are prefilled in chunks of PREFILL_CHUNK tokens, with a progress bar
LONG_PROMPT = 2048
PREFILL_CHUNK = 1024


@attrs.frozen(eq=False)
class GenerationResult:
    """Output of :meth:`Engine.generate`."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats
    stack: str

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "stack": self.stack,
                **self.stats.to_dict()}


class PathLogits:
    """Full-vocabulary target logits of tree nodes, computed in batches on first access.

    Verification walks one path. A miss at node ``n`` computes ``n`` and the line below it that the
    drafter put first (its first child, that child's first child, ...) in one product, so a chain
    reads the (|V| x d) head once per cycle, and a tree pays again only where verification leaves
    the drafter's favourite line."""

    def __init__(self, target, hidden: torch.Tensor, tree: DraftTree, *, strict: bool = True) -> None:
        self.target, self.hidden, self.tree, self._rows, self.strict = target, hidden, tree, {}, strict
        #: head products computed (one per line), for the statistics
        self.products = 0

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def prefill(self, line: Sequence[int], logits: torch.Tensor) -> None:
        """The logits of ``line``, computed elsewhere (in a head product shared with other
        generations, see ``TargetModel.forward_many``): one product, as :meth:`__getitem__` would."""
        self._rows.update(zip(line, logits))
        self.products += 1

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self._rows:
            line = self.tree.first_line(node)
            index = torch.tensor(line, device=self.hidden.device)
            logits = self.target.logits(self.hidden.index_select(0, index), strict=self.strict)
            self._rows.update(zip(line, logits))
            self.products += 1
        return self._rows[node]


def _load_target(config: StackConfig, dtype: torch.dtype, device: torch.device, registry: Registry):
    """``(target, image)``: the stack's target, mapped from its saved image where there is one (see
    :mod:`dynaspec.runtime.image`), else loaded in full and cast; ``image`` is ``(folder,
    source id)`` where an image should be saved once the target is set up, else None."""
    from dynaspec.runtime import image as images
    from dynaspec.runtime.quantized import resolve_weights
    from dynaspec.runtime.targets import load_target

    source_id = None
    if images.enabled() and config.target in registry.names("target"):
        source_id = getattr(registry.get("target", config.target), "image_id", None)
        source_id = source_id() if callable(source_id) else source_id
    if source_id is None:
        return load_target(config.target, registry=registry).to(dtype=dtype, device=device), None
    # the weights setting auto resolves to depends on the target (its auto_weights): an image per
    # setting asked for, auto included, keyed by what auto meant when it was saved
    folder = images.image_dir(config.target, str(source_id), dtype, config.weights, device)
    found = images.find_image(folder)
    if found is not None and (config.weights != "auto" or
                              found.weights == resolve_weights("auto", device, found.auto_weights)):
        return found, None
    return load_target(config.target, registry=registry).to(dtype=dtype, device=device), (folder, str(source_id))


class Engine:
    """A target, an optional drafter and the components of a stack, assembled once."""

    def __init__(self, stack: StackConfig, target, drafter: Drafter | None = None, *,
                 registry: Registry | None = None, models: dict | None = None,
                 huge_pages: bool = True) -> None:
        """``drafter``: a drafter model already loaded, used by the stack's trained drafter instead of
        its artifact; ``models``: drafter models shared with other engines (see :meth:`from_stacks`);
        ``huge_pages``: move the int8 weights into memory on huge pages (:func:`q8.huge_pages`):
        every later step reads them faster, for a move that costs as much as a few hundred steps
        gain (docs/results.md, session 42), so worth it for an engine that will run long."""
        self.target = target
        self.registry = registry or default_registry()
        # the numerics are set up here whoever built the target: the guarantee is never skipped
        numerics.set_up(target, stack)
        draft = stack.draft
        if "auto" in (draft.mode, draft.planner):  # what suits a machine whose tree rows cost about one
            cheap = numerics.cheap_rows(target)
            if draft.mode == "auto":  # a tree there, else the chain
                draft = attrs.evolve(draft, mode="tree") if cheap else draft.as_chain()
            if draft.planner == "auto":  # the whole tree while drafting pays there, else the best depth
                draft = attrs.evolve(draft, planner="cost-gate" if cheap else "cost")
            stack = attrs.evolve(stack, draft=draft)
        self.stack = stack
        self.ctx = BuildContext(
            vocab_size=target.vocab_size, hidden_size=target.hidden_size,
            lm_head_weight=target.lm_head_weight, special_token_ids=target.special_token_ids,
            target_fingerprint=target.fingerprint(), device=target.device,
            tokenizer=target.tokenizer, resolve_artifact=_resolve_artifact, weights=target.weights)
        # "required": the probed kernels, padded where that is what makes them invariant;
        # "observed": the same without padding (a plain step then costs one row, not several)
        self.strict = stack.exact == "required"
        build = self.registry.build
        self.shortlister = build("shortlister", stack.shortlister.name, stack.shortlister.kwargs, self.ctx)
        self.scheduler = build("scheduler", stack.scheduler.name, stack.scheduler.kwargs, self.ctx)
        self._declared = capabilities(self.shortlister)
        self._check_budget_units(self._declared)
        self._backends: dict[int, Any] = {}
        #: the GEMM backend of the drafter's head (None until a drafter with a head asks for it)
        self.backend = None
        #: what drafts (None: plain decoding) and its neural model, if it has one
        self.source: DraftSource | None = None
        if stack.drafter is not None:
            dctx = DrafterContext(target=target, draft=stack.draft, shortlister=self.shortlister,
                                  scheduler=self.scheduler, backend_for=self._backend_for,
                                  build=lambda ref: build_drafter(ref, dctx, self.registry),
                                  model=drafter, models=models if models is not None else {})
            self.source = build_drafter(stack.drafter, dctx, self.registry)
        self.drafter = self.source.model if self.source is not None else None
        #: whether speculative output equals plain decoding by construction, and why (or why not)
        self.exactness, self.exactness_reason = self._exactness()
        if self.exactness != "guaranteed" and stack.exact == "required":
            raise ConfigError(f"stack '{stack.name}' requires exact output, which is not guaranteed here: "
                              f"{self.exactness_reason}; set exact = \"observed\" to run it anyway")
        self._verifiers: dict[str, Any] = {}
        self.verifier_for(stack.decode.temperature)  # fail early on a bad verifier
        #: the plain step's measured time on this machine (for ``draft.adaptive``)
        self.plain_cost = PlainCost()
        # the int8 weights every step streams, moved once into memory on huge pages
        if target.device.type == "cpu" and huge_pages:
            move_to_huge_pages()

    @property
    def whole_depth(self) -> bool:
        """Whether the cost planner drafts the stack's whole depth while drafting pays
        (``planner = "cost-gate"``, which ``"auto"`` becomes where a tree's rows cost about one)
        rather than the depth its cost model expects the most of."""
        return self.stack.draft.planner == "cost-gate"

    def _backend_for(self, head_weight: torch.Tensor | None):
        """The stack's GEMM backend over the target's LM head (``None``) or a drafter's own head:
        built once per head. The backend reads the shortlister's declared head layout, handed over
        in its own context; a drafter's own head (EAGLE-3) has no such layout."""
        key = id(head_weight) if head_weight is not None else 0
        if key not in self._backends:
            if head_weight is not None:
                ctx = attrs.evolve(self.ctx, lm_head_weight=head_weight, vocab_size=int(head_weight.shape[0]),
                                   head_layout=None)
            else:
                ctx = attrs.evolve(self.ctx, head_layout=self._declared.head_layout)
            ref = self.stack.backend
            self._backends[key] = self.registry.build("backend", ref.name, ref.kwargs, ctx)
            self.backend = self.backend or self._backends[key]
        return self._backends[key]

    def _exactness(self) -> tuple[str, str]:
        """``("guaranteed" | "not guaranteed", reason)`` (:func:`dynaspec.runtime.numerics.verdict`)."""
        return numerics.verdict(self.target, self.source, strict=self.strict)

    def _check_budget_units(self, declared: ShortlisterCapabilities) -> None:
        """A scheduler's budget must be in the shortlister's unit (tokens, or clusters for the
        router): a scheduler that says its unit (``unit = "tokens"``) is refused with a shortlister
        that counts another, and a budget beyond what the shortlister has is refused rather than
        silently clamped (32,768 "tokens" would select every one of 1,024 clusters)."""
        scheduler_unit = getattr(self.scheduler, "unit", None)
        if scheduler_unit and declared.budget_unit and scheduler_unit != declared.budget_unit:
            raise ConfigError(
                f"scheduler '{self.stack.scheduler.name}' counts its budget in {scheduler_unit}, but "
                f"shortlister '{self.stack.shortlister.name}' counts in {declared.budget_unit}: set "
                f"scheduler.unit = \"{declared.budget_unit}\" and a budget in {declared.budget_unit}")
        limit = declared.budget_limit
        if limit is None:
            return
        widest = int(self.scheduler.budget(depth=0))  # without scores: the cap at the widest depth
        if widest > limit:
            unit = declared.budget_unit or "units"
            raise ConfigError(
                f"scheduler '{self.stack.scheduler.name}' gives a budget of {widest:,} at draft depth 0, "
                f"but shortlister '{self.stack.shortlister.name}' counts its budget in {unit} and has "
                f"{limit:,}: set the scheduler's budget (or k_max) to at most {limit:,}")

    @classmethod
    def from_stack(cls, stack: str | StackConfig = "default", *,
                   overrides: Mapping[str, Any] | None = None, registry: Registry | None = None,
                   target=None, drafter: Drafter | None = None, models: dict | None = None,
                   huge_pages: bool = True) -> "Engine":
        """Resolve a stack (built-in name, plugin name or TOML file), load its target (unless given)
        and build its drafter and components (``drafter``: a drafter model already loaded;
        ``models``: drafter models shared with other engines; ``huge_pages``: see :class:`Engine`)."""
        from dynaspec.runtime.numerics import stack_dtype
        from dynaspec.runtime.stacks import resolve_stack
        from dynaspec.runtime.target import check_device

        registry = registry or default_registry()
        config = resolve_stack(stack, overrides=overrides, registry=registry)
        check_device(config.device)
        dtype, device = stack_dtype(config), torch.device(config.device)
        image = None  # where the set-up target's image is saved after this first full load
        if target is None:
            target, image = _load_target(config, dtype, device, registry)
        elif target.dtype != dtype or target.device.type != device.type:
            raise ConfigError(f"stack '{config.name}' runs its target in {config.dtype} on "
                              f"{config.device}, but the target given is {target.dtype} on "
                              f"{target.device}: load one target per dtype and device")
        if config.drafter is None:
            drafter = None  # plain decoding, even when a caller shares one stack's drafter with all
        engine = cls(config, target, drafter, registry=registry, models=models, huge_pages=huge_pages)
        if image is not None:
            from dynaspec.runtime.image import save_image

            save_image(target, image[0], source_id=image[1])
        return engine

    @classmethod
    def from_stacks(cls, stacks: Sequence[str | StackConfig], *,
                    overrides: Mapping[str, Any] | None = None, registry: Registry | None = None,
                    target=None) -> list["Engine"]:
        """Engines for several stacks that share what they can: one loaded target per target, dtype
        and device, and one drafter per drafter artifact on each. ``target`` (optional, already
        loaded) serves the stacks whose dtype and device it has."""
        from dynaspec.runtime.numerics import stack_dtype
        from dynaspec.runtime.stacks import resolve_stack

        registry = registry or default_registry()
        targets, models, engines = {}, {}, []
        given = {(target.dtype, target.device.type): target} if target is not None else {}
        for ref in stacks:
            config = resolve_stack(ref, overrides=overrides, registry=registry)
            placed = (stack_dtype(config), torch.device(config.device).type)
            key = (config.target, *placed, config.weights)
            engine = cls.from_stack(config, registry=registry, target=targets.get(key) or given.get(placed),
                                    models=models.setdefault(key, {}))
            targets[key] = engine.target
            engines.append(engine)
        return engines

    def verifier_for(self, temperature: float):
        """The verifier for a generation at ``temperature`` (``auto``: greedy at 0, else sampling)."""
        name = self.stack.verifier.name
        if name == "greedy" and temperature > 0:
            raise ConfigError(f"decode.temperature = {temperature} is invalid with the greedy "
                              "verifier: use temperature 0 or the 'sampling' verifier")
        params = dict(self.stack.verifier.kwargs)
        key = name
        if name == "auto":
            key = "greedy" if temperature == 0 else "sampling"
            params["temperature"] = temperature
        if key not in self._verifiers:
            self._verifiers[key] = self.registry.build("verifier", name, params, self.ctx)
        return self._verifiers[key]

    # -- public API -------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int] | torch.Tensor, *,
                 max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] = ()) -> GenerationResult:
        """Generate a continuation; returns text, ids and statistics. Generation ends at EOS, at
        ``max_new_tokens``, or once the text contains one of ``stop`` (the text is cut before it)."""
        prompt_ids, run = self._start(prompt, max_new_tokens, temperature, top_p, seed)
        stats = GenerationStats()
        new: list[int] = []
        text = ""
        hit = False
        start = time.perf_counter()
        for chunk in self._solo(run(stats)):
            new.extend(chunk)
            if stop:
                text, hit = _cut_at_stop(self.decode(new), stop)
                if hit:
                    break
        stats.wall_time = time.perf_counter() - start
        stats.new_tokens = len(new)
        stats.finish_reason = self._finish_reason(new, hit)
        return GenerationResult(text if stop else self.decode(new), new, prompt_ids, stats, self.stack.name)

    def _finish_reason(self, new: Sequence[int], hit_stop: bool) -> str:
        """"stop" when a stop text, EOS or end of turn ended the generation, else "length"."""
        return "stop" if hit_stop or (new and new[-1] in set(self.target.eos_token_ids)) else "length"

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, *, stats: GenerationStats | None = None,
               stop: Sequence[str] = (), **kwargs) -> Iterator[str]:
        """Yield the continuation as text pieces while it is generated (see :meth:`generate`)."""
        return self._solo(self.stream_passes(prompt, stats=stats, stop=stop, **kwargs))

    def stream_passes(self, prompt: str | Sequence[int] | torch.Tensor, *, stats: GenerationStats | None = None,
                      stop: Sequence[str] = (), control: DepthControl | None = None,
                      **kwargs) -> Iterator["str | TargetPass"]:
        """:meth:`stream`, handing each plain step or verification of the target to the caller as a
        :class:`~dynaspec.runtime.target.TargetPass` to run, alone or with other generations'
        (:meth:`TargetModel.forward_many`), before taking the next item: text pieces and passes.
        The prefill runs inside. This is how a server verifies several requests in one pass;
        ``control`` lets it set each cycle's draft depth (see :class:`DepthControl`)."""
        _, run = self._start(prompt, kwargs.get("max_new_tokens"), kwargs.get("temperature"),
                             kwargs.get("top_p"), kwargs.get("seed"))
        stats = stats if stats is not None else GenerationStats()
        new: list[int] = []
        text = ""
        # hold back as many characters as a stop text could still be growing into
        hold = max((len(s) for s in stop), default=1) - 1
        start = time.perf_counter()
        for chunk in run(stats, control):
            if isinstance(chunk, TargetPass):
                yield chunk
                continue
            new.extend(chunk)
            stats.new_tokens = len(new)
            stats.wall_time = time.perf_counter() - start
            full, hit = _cut_at_stop(self.decode(new), stop)
            ready = full if hit else full[:len(full) - hold] if hold else full
            if len(ready) > len(text) and not ready.endswith("\ufffd"):
                yield ready[len(text):]
                text = ready
            if hit:
                stats.finish_reason = "stop"
                return
        stats.finish_reason = self._finish_reason(new, False)
        full = self.decode(new)
        if len(full) > len(text):
            yield full[len(text):]

    def encode(self, prompt: str) -> list[int]:
        if self.target.tokenizer is None:
            raise InputError(f"target '{self.target.name}' has no tokenizer: pass token ids")
        return list(self.target.tokenizer(prompt)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        tok = self.target.tokenizer
        return tok.decode(list(ids), skip_special_tokens=True) if tok is not None else ""

    # -- the loops --------------------------------------------------------------------------------
    def _solo(self, items: Iterator) -> Iterator:
        """Run the target passes a loop hands over (see :meth:`stream_passes`) at once, one by one;
        pass everything else through: a generation alone."""
        for item in items:
            if isinstance(item, TargetPass):
                start = time.perf_counter()
                self.target.forward_many([item], strict=self.strict)
                item.seconds = time.perf_counter() - start
            else:
                yield item

    def _start(self, prompt, max_new_tokens, temperature, top_p, seed):
        decode = self.stack.decode
        params = DecodeParams(
            temperature=decode.temperature if temperature is None else float(temperature),
            top_p=decode.top_p if top_p is None else float(top_p))
        # validate through the config class so errors name the field
        max_new = decode.max_new_tokens if max_new_tokens is None else max_new_tokens
        attrs.evolve(decode, temperature=params.temperature, top_p=params.top_p, max_new_tokens=max_new)
        seed = decode.seed if seed is None else seed
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("the prompt is empty")
            ids = self.encode(prompt)
        else:
            ids = [int(i) for i in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        if not ids:
            raise InputError("the prompt is empty")
        if any(i < 0 or i >= self.target.vocab_size for i in ids):
            raise InputError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        extra = self.source.max_depth + 1 if self.source is not None else 0
        if len(ids) + max_new + extra > self.target.max_positions:
            raise InputError(
                f"prompt of {len(ids)} tokens + {max_new} new tokens exceeds the target's context "
                f"of {self.target.max_positions} positions")
        verifier = self.verifier_for(params.temperature)
        generator = torch.Generator(device=self.target.device).manual_seed(0 if seed is None else int(seed))

        def run(stats, control=None):
            stats.exactness, stats.exactness_reason = self.exactness, self.exactness_reason
            if self.source is None:
                return self._plain(ids, max_new, params, verifier, generator, stats)
            return self._speculate(ids, max_new, params, verifier, generator, stats, control)

        return ids, run

    def _finish(self, chunk: list[int], produced: int, max_new: int) -> tuple[list[int], bool]:
        """Cut a committed chunk at EOS and at the token limit; say whether to stop."""
        eos = set(self.target.eos_token_ids)
        for i, tok in enumerate(chunk):
            if tok in eos:
                chunk = chunk[: i + 1]
                break
        chunk = chunk[: max_new - produced]
        done = produced + len(chunk) >= max_new or (bool(chunk) and chunk[-1] in eos)
        return chunk, done

    def _prefill(self, ids: torch.Tensor, cache, layers=None):
        """The target over the prompt: one pass, or for a long prompt passes of ``PREFILL_CHUNK``
        tokens with a progress bar on stderr (plain and speculative decoding prefill alike).
        With ``layers``, also the fused inputs of those layers (see ``TargetModel.forward``)."""
        n, device = ids.numel(), ids.device
        if n <= LONG_PROMPT:
            return self.target.forward(ids, torch.arange(n, device=device), cache, layers=layers)
        from tqdm import tqdm

        parts = []
        with tqdm(total=n, desc="prefill", unit="token", file=sys.stderr, leave=False) as bar:
            for start in range(0, n, PREFILL_CHUNK):
                end = min(start + PREFILL_CHUNK, n)
                parts.append(self.target.forward(ids[start:end], torch.arange(start, end, device=device), cache,
                                                 layers=layers))
                bar.update(end - start)
        if layers is None:
            return torch.cat(parts)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def _first_token(self, hidden, verifier, params, generator, logits: torch.Tensor | None = None) -> int:
        """The token after one row ``hidden`` [1, d] (a plain step, or the prompt's last row);
        ``logits``: its logits computed already (a shared head product)."""
        if getattr(verifier, "argmax_first_token", False):
            if logits is not None:  # the probed head's row: greedy_token's argmax, as it would compute it
                return argmax(logits[0])
            return self.target.greedy_token(hidden, strict=self.strict)
        if logits is None:
            logits = self.target.logits(hidden, strict=self.strict)
        return verifier.first_token(logits[0], params, generator)

    @torch.inference_mode()
    def _plain(self, ids, max_new, params, verifier, generator, stats) -> Iterator[list[int]]:
        """Plain decoding with the target alone (the ``baseline`` stack)."""
        target, device = self.target, self.target.device
        cache = target.new_cache(len(ids) + max_new + 1)
        with stats.timed("prefill"):
            hidden = self._prefill(torch.tensor(ids, device=device), cache)
            token = self._first_token(hidden[-1:], verifier, params, generator)
        produced, pos = 0, len(ids)
        while True:
            chunk, done = self._finish([token], produced, max_new)
            produced += len(chunk)
            yield chunk
            if done:
                return
            with stats.verification():
                step = TargetPass(torch.tensor([token], device=device), torch.tensor([pos], device=device), cache,
                                  head=[0])
                yield step  # the caller runs it (alone, or with other generations' passes)
                stats.times["target_body"] += step.seconds
                hidden = step.output()
                with stats.timed("verify_head"):
                    token = self._first_token(hidden, verifier, params, generator, step.logits)
            pos += 1

    def _head_rows(self, tree: DraftTree, chain: bool) -> list[int]:
        """The nodes whose logits the verification pass computes up front: a chain's line, or every
        node of a tree within the rows the probe covers (one head product costs about as much for
        a few rows as for one, and a miss would read the whole head again); a larger tree's first
        line (see :class:`PathLogits`)."""
        if chain or len(tree) > getattr(self.target, "probed_rows", 0):
            return tree.first_line()
        return list(range(len(tree)))

    @torch.inference_mode()
    def _speculate(self, ids, max_new, params, verifier, generator, stats,
                   control: DepthControl | None = None) -> Iterator[list[int]]:
        """Speculative decoding. Invariant at the top of each cycle: ``tokens[:n]`` are committed,
        the target's cache holds all but the last of them (the root), and ``features[p]`` is the
        target's feature at position p < n - 1 (kept for drafters that read features). Every
        buffer is allocated once, for the whole generation."""
        target, device, source = self.target, self.target.device, self.source
        # room for the prompt, the output, one cycle's overshoot of max_new and one draft tree
        capacity = len(ids) + max_new + source.max_depth + source.max_tokens + 2
        cache = target.new_cache(capacity)
        session = source.start(capacity)
        tokens = torch.empty(capacity, dtype=torch.long, device=device)
        # the drafter's features: the target's last hidden states, or for a drafter that fuses
        # several target layers (EAGLE-3) the inputs of those layers side by side
        layers = source.feature_layers if source.needs_features else None
        width = target.hidden_size * (len(layers) if layers else 1)
        features = (torch.empty(capacity, width, dtype=target.dtype, device=device) if source.needs_features
                    else None)
        with stats.timed("prefill"):
            tokens[:len(ids)] = torch.tensor(ids, device=device)
            hidden = self._prefill(tokens[:len(ids)], cache, layers)
            if layers:
                hidden, fed = hidden
            else:
                fed = hidden
            if features is not None:
                features[:len(ids)] = fed
            first = self._first_token(hidden[len(ids) - 1:len(ids)], verifier, params, generator)
        tokens[len(ids)] = first
        n = len(ids) + 1
        chunk, done = self._finish([first], 0, max_new)
        produced = len(chunk)
        yield chunk
        gate = planner = None
        if self.stack.draft.adaptive and self.stack.draft.planner != "rate":  # the cost model's planners
            planner = CostPlanner(self.plain_cost, self.stack.draft.planner_prior, whole_depth=self.whole_depth)
        elif self.stack.draft.adaptive:
            gate = DraftGate(self.plain_cost)
        while not done:
            root_pos = n - 1
            started = time.perf_counter()
            limit = control.limit if control is not None else None
            if planner is not None:
                cap = planner.cap(source.max_depth)
                if hasattr(session, "costly_cap"):
                    session.costly_cap = cap  # prompt lookup still proposes, uncut
                elif cap is not None:
                    limit = cap if limit is None else min(limit, cap)
            draft_seconds = 0.0
            if limit != 0 and (gate is None or gate.draft_now()):
                # a batch's planner grants draft positions, each a row of the shared pass: a tree's
                # siblings would be rows it did not grant, so a granted request drafts its first
                # line alone (greedy: any line is exact), and a plugin's tree is cut to it
                granted = control is not None and control.limit is not None and verifier.prunes
                tree = grow_within(session, tokens, features, n, params, verifier, generator, stats, limit,
                                   chain=granted)
                if granted:
                    tree = tree.line()
                draft_seconds = time.perf_counter() - started
            else:
                tree = DraftTree.with_root(int(tokens[root_pos]))
            with stats.verification():
                drafted = len(tree) > 1  # else nothing drafted: the cycle is one plain step
                chain = tree.is_chain  # a root alone is one plain step's row
                step = TargetPass(torch.tensor(tree.tokens, device=device),
                                  root_pos + 1 + torch.tensor(tree.depths, device=device), cache,
                                  tree_mask=None if chain else tree.attention_mask(device),
                                  chain=chain and drafted, layers=layers,
                                  head=self._head_rows(tree, chain))
                yield step  # the caller runs it (alone, or with other generations' passes)
                stats.times["target_body"] += step.seconds
                hidden = step.output()
                hidden, fed = hidden if layers else (hidden, hidden)
                with stats.timed("verify_head"):
                    if drafted:
                        logits = PathLogits(target, hidden, tree, strict=self.strict)
                        if step.logits is not None:
                            logits.prefill(step.head, step.logits)
                        path, bonus = verifier.verify(tree, logits, params, generator)
                        stats.verify_products += logits.products
                        reached = max(tree.depths) + 1
                        stats.record_acceptance(reached, len(path))
                        if control is not None:
                            control.record(reached, len(path))
                    else:  # plain decoding's own head (the certified greedy token)
                        path, bonus = [], self._first_token(hidden, verifier, params, generator, step.logits)
                        stats.plain_cycles += 1
            with stats.timed("bookkeeping"):
                keep = [0, *path]
                target.keep(cache, root_pos, keep)
                if features is not None:
                    features[root_pos:root_pos + len(keep)] = fed[keep]
                committed = [tree.tokens[node] for node in path] + [bonus]
                tokens[n:n + len(committed)] = torch.tensor(committed, device=device)
                n += len(committed)
            if gate is not None:
                gate.record(drafted=drafted, tokens=len(committed), seconds=time.perf_counter() - started,
                            verify_seconds=stats.verify_times[-1])
            if planner is not None:
                planner.record(drafted=drafted, seconds=time.perf_counter() - started,
                               verify_seconds=stats.verify_times[-1], rows=len(tree),
                               draft_seconds=draft_seconds, reached=reached if drafted else 0,
                               accepted=len(path),
                               costly=getattr(session, "last_costly", source.model is not None))
            chunk, done = self._finish(committed, produced, max_new)
            stats.accepted_lengths.append(len(chunk))  # what this cycle added to the output
            produced += len(chunk)
            yield chunk

def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string in it, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _resolve_artifact(ref: str) -> str:
    from dynaspec.runtime.targets import resolve_artifact

    return str(resolve_artifact(ref))
