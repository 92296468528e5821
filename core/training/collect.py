"""``dynaspec train-drafter --stage collect``: the target's features on train prompts, as shards.

For each train prompt (the first human turn, in the target's own prompt format) a shard holds
either the target's own greedy continuation (``source="generated"``: the text the drafter meets at
inference) or the conversation's own first answer with the target's greedy next token stored as the
teacher (``source="raw"``: one prefill pass, several times cheaper per position), together with the
target's normed features over the whole sequence. Shards (:mod:`dynaspec.training.shards`) are
written atomically and skipped when present, so an interrupted collection resumes.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.files import atomic_write
from dynaspec.runtime.prompt import format_prompt
from dynaspec.runtime.target import TargetModel
from dynaspec.training import distributed
from dynaspec.training.shards import shard_path


def _turn_items(split: str, turns: str):
    """The prompt items collection reads: first human turns, or (``turns="later"``, train only)
    the later turns standing alone (:func:`dynaspec.training.data.later_turn_prompts`)."""
    from dynaspec.training.data import dev_protocol_prompts, later_turn_prompts, training_prompts

    if turns == "later":
        if split != "train":
            raise ConfigError("later turns are collected on the train split only")
        return later_turn_prompts()
    if turns != "first":
        raise ConfigError(f"turns must be 'first' or 'later', got {turns!r}")
    return training_prompts() if split == "train" else dev_protocol_prompts(n=1 << 30)


def _prompt_batches(tokenizer, start: int, count: int, max_prompt_tokens: int,
                    split: str = "train", slice_name: str | None = None,
                    fmt: Callable[[str], str] = format_prompt, turns: str = "first") -> list[tuple[str, list[int]]]:
    """(id, ids) of ``fmt(human turn)`` (``fmt``: the target's prompt format)."""
    source = _turn_items(split, turns)
    if slice_name is not None:
        source = (item for item in source if item["slice"] == slice_name)
    items = []
    for k, item in enumerate(source):
        if k < start:
            continue
        if k >= start + count:
            break
        ids = tokenizer(fmt(item["text"]))["input_ids"][:max_prompt_tokens]
        items.append((item["id"], ids))
    return items


def _raw_pairs(split: str, turns: str):
    """(id, human turn, its answer, slice) for raw collection."""
    from dynaspec.training.data import conversation_slice, first_answer, first_human_turn, load_split

    if turns != "first":
        yield from ((i["id"], i["text"], (i["answer"] or "").strip(), i["slice"]) for i in _turn_items(split, turns))
        return
    for conv in load_split(split):
        yield (conv["id"], (first_human_turn(conv) or "").strip(), (first_answer(conv) or "").strip(),
               conversation_slice(conv))


def _raw_batches(tokenizer, start: int, count: int, max_tokens: int, split: str = "train",
                 slice_name: str | None = None, fmt: Callable[[str], str] = format_prompt,
                 turns: str = "first") -> list[tuple[str, list[int], int]]:
    """(id, ids, prompt length) of ``fmt(human turn) + " " + its answer`` (the conversation's own
    answer, not the target's), cut to ``max_tokens`` tokens."""
    items, k = [], 0
    for conv_id, human, reply, slice_ in _raw_pairs(split, turns):
        if not human or not reply or (slice_name is not None and slice_ != slice_name):
            continue
        if k >= start + count:
            break
        if k >= start:
            prompt = fmt(human[:1500])
            ids = tokenizer(prompt + " " + reply)["input_ids"][:max_tokens]
            items.append((conv_id, ids, min(len(tokenizer(prompt)["input_ids"]), len(ids))))
        k += 1
    return items


@torch.inference_mode()
def _teacher(target: TargetModel, feats: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The target's greedy next token after every position (argmax of its full logits)."""
    return torch.cat([target.logits(feats[i:i + chunk].to(target.dtype)).argmax(-1) for i in range(0, len(feats), chunk)])


@torch.inference_mode()
def _generate(target: TargetModel, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
              seed: int = 0) -> list[list[int]]:
    """Greedy continuations of a batch of prompts (left-padded), cut at EOS; with ``temperature``
    above 0, continuations sampled from the target's full distribution at that temperature (no top-k
    or top-p), reproducibly from ``seed``."""
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    sampling = {"do_sample": False} if temperature <= 0 else \
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    # generate's prefill hands the LM head the last position of each row as a strided view
    # [B, 1, d]; torch multiplies such a view by copying the whole head once per row (24 s of a
    # 34 s prefill of 16 Qwen prompts in bfloat16). A contiguous copy of the view is the same input.
    head = target.model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    try:
        with torch.random.fork_rng():  # the caller's random state is left as it was
            torch.manual_seed(seed)
            out = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                        pad_token_id=pad, **sampling)
    finally:
        hook.remove()
    eos = set(target.eos_token_ids)
    conts = []
    for row in range(len(prompts)):
        cont = out[row, width:].tolist()
        for i, tok in enumerate(cont):
            if tok in eos:
                cont = cont[: i + 1]
                break
        conts.append(cont)
    return conts


@torch.inference_mode()
def _generate_lean(target: TargetModel, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
                   seed: int = 0, layers: tuple[int, ...] = ()) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """What :func:`_generate` gives, and the features, through the lean forward: every prompt is
    prefilled alone, then all the sequences step together, one token each per pass of the target
    (:meth:`TargetModel.forward_many`, in groups of the row counts its probe covered), so one read of
    the weights serves every sequence, and a finished one leaves the batch (no padding). The last
    token of each continuation is run too, so that the features cover every position, as a pass
    over the whole sequence would. Returns, per prompt, ``(continuation, hidden [T, d], inputs of
    layers [T, len(layers) * d] or None)`` over the prompt and its continuation (cut after EOS).
    With ``temperature`` above 0 the tokens are drawn from the target's full distribution at that
    temperature, reproducibly from ``seed``."""
    from dynaspec.runtime.target import TargetPass

    asked = tuple(layers) or None
    eos = set(target.eos_token_ids)
    generator = torch.Generator().manual_seed(seed)

    def choose(logits: torch.Tensor) -> int:
        if temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    caches, conts, hidden, lower, logits = [], [], [], [], []
    for ids in prompts:
        cache = target.new_cache(len(ids) + new_tokens + 1)
        out = target.forward(torch.tensor(ids), torch.arange(len(ids)), cache, layers=asked)
        h, low = out if asked else (out, None)
        caches.append(cache)
        hidden.append([h])
        lower.append([low])
        logits.append(target.logits(h[-1:])[0])
        conts.append([])
    active = list(range(len(prompts)))
    while active:
        for i in active:
            conts[i].append(choose(logits[i]))
        # the tokens just chosen are run (their features); those that end a sequence need no logits
        ends = {i for i in active if conts[i][-1] in eos or len(conts[i]) == new_tokens}
        passes = [TargetPass(ids=torch.tensor(conts[i][-1:]), positions=torch.tensor([len(prompts[i]) + len(conts[i]) - 1]),
                             cache=caches[i], layers=asked, head=None if i in ends else [0]) for i in active]
        target.forward_many(passes)
        for i, p in zip(active, passes):
            h, low = p.output() if asked else (p.output(), None)
            hidden[i].append(h)
            lower[i].append(low)
            if i not in ends:
                logits[i] = (p.logits if p.logits is not None else target.logits(h))[0]
        active = [i for i in active if i not in ends]
    return [(conts[i], torch.cat(hidden[i]), torch.cat(lower[i]) if asked else None) for i in range(len(prompts))]


def batched_generation(target: TargetModel) -> bool:
    """Whether collection generates through :func:`_generate_lean`: the target runs the lean
    forward and its probe allowed passes of several sequences (see :func:`set_up_target`)."""
    return target.forward_kind == "lean" and target.max_pass_rows > 1


def set_up_target(target: TargetModel, weights: str = "auto") -> str:
    """Make ``target`` ready to collect: compute from ``weights`` (``auto``: what its default stacks
    compute from, so the drafter learns the continuations and features it will meet) and run the
    numerics probe, which lets generation run several sequences in one pass. Returns the weights
    setting used. Call it after the target's final cast."""
    from dynaspec.runtime import numerics, q8
    from dynaspec.runtime.quantized import resolve_weights

    used = resolve_weights(weights, target.device, target.auto_weights)
    if target.forward_kind == "lean":  # the generic forward computes from the dtype's weights only
        target.use_weights(used)
    numerics.probe(target)
    if target.device.type == "cpu":  # its int8 weights on huge pages, as an engine's
        q8.huge_pages()
    return target.weights


def sampling_kind(temperature: float, source: str, seed: int = 0) -> str:
    """What shards record as their ``sampling``: ``greedy`` at temperature 0, else the temperature
    and seed; refuses a negative temperature, and sampling for anything but generated text."""
    if temperature < 0 or (temperature > 0 and source != "generated"):
        raise ConfigError(f"temperature {temperature:g}: sampled continuations need --source generated and a "
                          "temperature above 0 (0 is greedy)")
    return "greedy" if temperature == 0 else f"temperature {temperature:g}, seed {seed}"


def _check_same_kind(work: Path, kind: dict[str, str]) -> None:
    """Refuse to add shards of another kind (split, slice, source, turns, sampling) to a folder:
    resuming with other settings would mix two kinds of data under one folder's name."""
    from dynaspec.training.shards import shard_kind, shard_paths

    for path in shard_paths(work)[:1]:
        recorded = shard_kind(path)
        have = {key: recorded[key] for key in kind}
        if have != kind:
            diff = ", ".join(f"{k}={have[k]} (asked: {kind[k]})" for k in kind if have[k] != kind[k])
            raise ConfigError(f"{work} already holds shards collected with {diff}; collect into another "
                              "folder (the train stage reads several)")


def _check_first_prompt(work: Path, first_prompt: int) -> None:
    """Refuse to extend a folder whose shards start at another prompt: its shard ``i`` covers the
    prompts from ``first_prompt + i * shard_size``, so two offsets in one folder would overlap."""
    from dynaspec.training.shards import shard_metadata, shard_paths

    for path in shard_paths(work)[:1]:
        have = int(shard_metadata(path).get("first_prompt", "0"))
        if have != first_prompt:
            raise ConfigError(f"{work} holds shards from prompt {have} on (asked: --first-prompt {first_prompt}); "
                              "collect into another folder (the train stage reads several)")


def collect(target: TargetModel, work: Path, *, prompts: int, shard_size: int = 32, batch: int = 16,
            new_tokens: int = 96, max_prompt_tokens: int = 384, worker: int = 0,
            workers: int = 1, split: str = "train", slice_name: str | None = None,
            source: str = "generated", turns: str = "first", temperature: float = 0.0,
            seed: int = 0, feature_layers: tuple[int, ...] | None = None,
            first_prompt: int = 0) -> list[Path]:
    """Write shards ``work/shard-NNNNN.safetensors`` covering the first ``prompts`` prompts of
    ``split`` (only those of one slice of it with ``slice_name``), or with ``first_prompt`` the
    ``prompts`` after the first ``first_prompt`` of them (new prompts for a drafter already trained on
    the first ones; a folder holds one such range).

    Generation: where the target runs the lean forward and its probe allows passes of several
    sequences (:func:`set_up_target`), a shard's prompts step together, one token each per pass, and
    the features come from those same passes (:func:`_generate_lean`; about 6 times the rate of the
    Hugging Face path on one core). Otherwise Hugging Face ``generate`` runs in batches of ``batch``
    prompts of similar length (a shard's prompts sorted by length: a batch is padded to its longest
    prompt, and padding costs a prefill as much as text does), then a pass over each sequence.

    ``source="generated"``: prompt + the target's own greedy continuation (``new_tokens``; costs a
    target step per token). ``source="raw"``: prompt + the conversation's own first answer, up to
    ``max_prompt_tokens + new_tokens`` tokens, in one prefill pass (no generation); such shards also
    store ``teacher``, the target's greedy next token at every position, since the text's next token
    is not the target's choice.

    ``turns="later"``: the prompts are the second and later human turns of train conversations,
    each standing alone (:func:`dynaspec.training.data.later_turn_prompts`), instead of the first.

    ``temperature`` above 0 (``source="generated"`` only): the continuations are sampled at that
    temperature instead of greedy, a new set of them for each ``seed``; such shards store
    ``teacher`` too, since a sampled token is not always the target's greedy choice. Several seeds
    give several continuations of the same prompts, one folder each.

    ``feature_layers`` (a drafter's fused-feature layers, as given to its training): the inputs
    of those target layers below the last are written beside each shard in the same pass
    (``layers-A-B/``), so that training does not run the target over the shards a second time.

    ``workers`` processes can share the work: worker ``w`` makes the shards ``i`` with
    ``i % workers == w``. Under ``torchrun`` each process is one such worker, and all of them
    return once every shard is written."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from dynaspec.training.drafter import lower_layers, write_layer_inputs

    lower = lower_layers(target, feature_layers)
    lean = source == "generated" and batched_generation(target)
    rank, world = distributed.join()
    if world > 1 and workers == 1:
        worker, workers = rank, world
    sampling = sampling_kind(temperature, source, seed)
    if first_prompt < 0:
        raise ConfigError(f"first prompt {first_prompt}: must be >= 0")
    work.mkdir(parents=True, exist_ok=True)
    _check_same_kind(work, {"split": split, "slice": slice_name or "all", "source": source, "turns": turns,
                            "sampling": sampling})
    _check_first_prompt(work, first_prompt)
    n_shards = math.ceil(prompts / shard_size)
    paths = []
    bar = tqdm(total=n_shards, desc="collect", unit="shard", file=sys.stderr, disable=rank != 0)
    for index in range(n_shards):
        path = shard_path(work, index)
        paths.append(path)
        if path.exists() or index % workers != worker:
            bar.update(1)
            continue
        count = min(shard_size, prompts - index * shard_size)
        started = time.time()
        made = None  # the lean generation's (continuation, features, layer inputs) per sequence
        start = first_prompt + index * shard_size
        if source == "raw":
            raw = _raw_batches(target.tokenizer, start, count, max_prompt_tokens + new_tokens,
                               split, slice_name, fmt=target.format_prompt, turns=turns)
            items = [(i, ids) for i, ids, _ in raw]
            seqs, prompt_lens = [ids for _, ids in items], [plen for _, _, plen in raw]
        else:
            items = _prompt_batches(target.tokenizer, start, count, max_prompt_tokens, split,
                                    slice_name, fmt=target.format_prompt, turns=turns)
            items.sort(key=lambda item: len(item[1]))  # stable: batches of similar length pad little
            prompt_lens = [len(ids) for _, ids in items]
            if lean:  # one batch: finished sequences leave it, nothing is padded
                draw_seed = (seed * 1_000_003 + index) * 1_000
                made = _generate_lean(target, [ids for _, ids in items], new_tokens, temperature, draw_seed, lower)
                conts = [cont for cont, _, _ in made]
            else:
                conts = []
                for b in range(0, len(items), batch):
                    chunk = [ids for _, ids in items[b:b + batch]]
                    draw_seed = (seed * 1_000_003 + index) * 1_000 + b  # per shard and batch: resumable
                    conts += _generate(target, chunk, new_tokens, temperature, draw_seed)
            seqs = [ids + cont for (_, ids), cont in zip(items, conts)]
        if not items:
            paths.pop()
            break  # the split (or slice) has fewer prompts than asked for
        # the fused features' layer inputs come with the same pass, not a second one later
        if made is not None:
            outs = [(h, low) if lower else h for _, h, low in made]
        else:
            outs = [target.forward(torch.tensor(s), torch.arange(len(s)), target.new_cache(), layers=lower or None)
                    for s in seqs]
        if lower:
            write_layer_inputs(target, path, lower, [inputs for _, inputs in outs])
            outs = [hidden for hidden, _ in outs]
        feats = outs
        extra = {}
        if source == "raw" or temperature > 0:
            extra["teacher"] = torch.cat([_teacher(target, f) for f in feats]).to(torch.int32)
        feats = [f.to(torch.bfloat16) for f in feats]
        offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
        tensors = {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                   "offsets": offsets.to(torch.int64), "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
                   "features": torch.cat(feats).contiguous(), **extra}
        meta = {"ids": json.dumps([i for i, _ in items]), "target": json.dumps(target.fingerprint()),
                "split": split, "slice": slice_name or "all", "source": source, "turns": turns, "sampling": sampling,
                "new_tokens": str(new_tokens), "first_prompt": str(first_prompt),
                "dtype": str(target.dtype).removeprefix("torch."), "weights": target.weights, "seconds": f"{time.time() - started:.3f}"}
        atomic_write(path, lambda p, t=tensors, m=meta: save_file(t, str(p), metadata=m))
        bar.update(1)
        bar.set_postfix(positions=int(offsets[-1]))
    bar.close()
    distributed.barrier(world)
    return [p for p in paths if p.exists()]  # another worker may have found the end of the split
