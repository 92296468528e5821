"""``dynaspec prepare``: everything a DynaSpec stack needs for a new target, in one resumable command.

Stages, in order, each written into the output folder ``DIR``:

1. ``collect``: target features on train prompts, in the target's own prompt format (``DIR/work``);
2. ``drafter``: the EAGLE-style drafter trained on them (``DIR/drafter``), unless one is given;
3. ``frequency``: the frequency list of the collected text (``DIR/frequency``);
4. ``corpus``: the ``corpus`` drafter's table of the target's own answers (``DIR/corpus``);
5. ``clusters``: spherical k-means of the LM-head rows (``DIR/clusters``);
6. ``router``: the router over those clusters, fed the drafter's features (``DIR/router``);
7. ``stack``: ``DIR/stack.toml``, the default stack's settings on these artifacts (paths relative to
   the folder, so it can be moved whole).

``DIR/prepare.json`` (the manifest) records every artifact, its fingerprint, the data, and the
command and wall time of each stage. It is rewritten atomically after each stage, into what another
prepare process on the same folder recorded meanwhile (the collection in the background and the
drafter stage beside it keep both their records). A rerun skips the finished stages; an
interrupted stage resumes where it stopped (shards already collected are kept, the drafter resumes
from its checkpoint); ``--redo STAGE`` runs one stage again.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs

from dynaspec.errors import ConfigError
from dynaspec.runtime.files import atomic_write

STAGES = ("collect", "drafter", "frequency", "corpus", "clusters", "router", "stack")
MANIFEST = "prepare.json"
#: the lock under which a process updates the manifest (see _record_stage)
LOCK = ".prepare.json.lock"
FORMAT = "dynaspec-prepare/1"


@attrs.frozen
class PrepareBudget:
    """How much work each stage does; the defaults fit a 2-core CPU in a few hours for a
    sub-billion-parameter target."""

    prompts: int = 2048            # train prompts collected
    first_prompt: int = 0          # ... after the first this many (new prompts for an --init drafter)
    #: which human turns are the prompts: ``first`` (the dev protocol's kind), or ``later``, the second
    #: and later turns of train conversations, each standing alone (new text once the first turns are
    #: all collected)
    turns: str = attrs.field(default="first", validator=attrs.validators.in_(("first", "later")))
    #: generated: prompt + the target's own greedy continuation (what it drafts against; the better
    #: drafter, docs/history.md "more raw text alone makes a worse drafter"); raw: prompt + the
    #: conversation's own answer in one prefill (cheaper, worse)
    source: str = "generated"
    shard_size: int = 64
    new_tokens: int | None = None  # generated: tokens generated (None: 96); raw: answer tokens kept (None: 256)
    steps: int = 1000              # drafter optimiser steps
    batch_positions: int = 2048
    #: draft steps the drafter is trained over per position, each after the first fed its own
    #: predicted features (what deeper draft steps read); 4 drafted Qwen's later positions better
    #: than 2 in session 25 (offline 1.924 against 1.895 after 250 steps from one drafter), each
    #: step costing 1.6 times as much
    unroll: int = 2
    drafter_width: int | None = None  # the drafter's MLP width; None: the target's
    #: target layers the drafter reads beside the final hidden state (fused features): ``"auto"``
    #: a low and a middle one (layer L // 8 and L // 2 of L: 2 and 9 for Gemma 3 270M, 3 and 12 for
    #: Qwen2.5-0.5B; fused layers made Gemma's drafter F better than E); None or (): none
    feature_layers: tuple[int, ...] | str | None = attrs.field(
        default="auto", converter=lambda v: v if v == "auto" else (None if not v else tuple(int(i) for i in v)))
    clusters: int | None = None    # None: min(1024, vocabulary / 16)
    kmeans_iterations: int = 25
    router_epochs: int = 3
    router_width: int = 1024
    #: the target's dtype while preparing; ``auto``: bfloat16 where the CPU computes it natively
    #: (collection's prefills and generation run 2-3x faster there), else float32
    dtype: str = "auto"
    #: the weights the target computes from while collecting (``auto``: what its default stacks
    #: compute from, so the drafter learns the continuations and features it meets at inference)
    weights: str = "auto"
    #: the drafter's training products: ``bfloat16`` (autocast, float32 weights and losses),
    #: ``float32``, or ``auto`` (bfloat16 where the device computes it natively)
    precision: str = "auto"
    #: where the drafter's loss is read: ``answer``, the positions whose next token is the target's
    #: own continuation (what it drafts at inference); ``all``, the prompts' positions too
    loss_on: str = attrs.field(default="answer", validator=attrs.validators.in_(("answer", "all")))
    #: sampled continuations of the same prompts, at ``temperature``, one folder per seed
    #: (``work-sampled-0``, ...), that the drafter trains on beside the greedy ones (more text that
    #: the target itself writes, without new prompts; the target's greedy next token is the teacher)
    sampled: int = 0
    temperature: float = 0.7
    #: an RMS norm on the drafter's token embedding (``DrafterConfig.embed_norm``; an ``--init``
    #: drafter without one gets it at gains that keep its function)
    embed_norm: bool = False


def auto_feature_layers(count: int) -> tuple[int, ...]:
    """The fused-feature layers ``prepare`` reads by default for a target of ``count`` layers: a
    low one and a middle one (``count // 8`` and ``count // 2``)."""
    return tuple(sorted({count // 8, count // 2} & set(range(count))))


def _read_manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); remove it to start over") from None
    if data.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a dynaspec prepare manifest")
    return data


def _write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    atomic_write(out / MANIFEST, lambda p: Path(p).write_text(json.dumps(manifest, indent=2, sort_keys=True)))


def _record_stage(out: Path, mine: dict[str, Any], name: str, entry: dict[str, Any] | None) -> dict[str, Any]:
    """Record stage ``name``'s ``entry`` (None: take the stage out, for a redo) and this run's budget
    into the manifest as it is on disk now, under a lock, and return the result. Two prepare
    processes may share a folder (the collection in the background, the drafter stage beside it):
    each records its own stages into what the other wrote meanwhile, instead of writing back the copy
    it read at its start. ``mine``: this run's manifest, used when the file does not exist yet."""
    from filelock import FileLock

    with FileLock(str(out / LOCK)):
        manifest = _read_manifest(out) or mine
        manifest["budget"] = mine["budget"]  # the latest run's
        if entry is None:
            manifest["stages"].pop(name, None)
        else:
            manifest["stages"][name] = entry
        _write_manifest(out, manifest)
    return manifest


def _described(folder: Path) -> dict[str, Any]:
    """A collected folder as the manifest records it: its data, shards and collection time."""
    from dynaspec.training.shards import describe_shards, shard_paths

    described = describe_shards(shard_paths(folder))
    return {key: described[key] for key in ("data", "shards", "collect_seconds", "timed_shards")}


def _digest(path: Path) -> str:
    """sha256 over the files of an artifact folder (names and contents), to record what was built."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file()):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _stack_toml(target_ref: str, drafter: str, clusters: int, command: str) -> str:
    k_max = min(128, clusters)
    return (f"# written by `{command}`\n"
            f'name = "prepared"\n'
            f'description = "the default stack on the artifacts prepared in this folder"\n'
            f'base = "default"\n'
            f"target = {json.dumps(target_ref)}\n"
            f"[drafter]\n"
            f'name = "composite"\n'
            f"drafters = [{{name = \"ngram\", tokens = 7}}, {{name = \"corpus\", artifact = \"./corpus\"}}, "
            f"{json.dumps(drafter)}]\n"
            f"[shortlister]\n"
            f'name = "dynaspec"\n'
            f'clusters = "./clusters"\n'
            f'router = "./router"\n'
            f"[scheduler]\n"
            f'name = "confidence"\n'
            f"k_max = {k_max}\n"
            f"k_min = {min(4, k_max)}\n"
            f"mass = 0.95\n")


def _shard_fingerprint(path: Path) -> dict[str, Any] | None:
    """The target fingerprint a collected shard records (None: it records none)."""
    from dynaspec.training.shards import shard_metadata

    recorded = shard_metadata(path).get("target")
    return json.loads(recorded) if recorded else None


def more_data_folders(folders: Sequence[str | Path], fingerprint: dict[str, Any], out: Path) -> list[Path]:
    """The collections of other prepare folders (``--more-data``): each folder's ``work`` and
    ``work-sampled-*`` shard folders, in that order (a collection still running, without its
    manifest yet, is checked by the target its shards record). Refuses a folder that is not a
    prepare folder, one prepared for another target, one with no collected shards, and this run's
    own folder."""
    from dynaspec.training.shards import shard_paths

    found: list[Path] = []
    for folder in map(Path, folders):
        if folder.resolve() == out.resolve():
            raise ConfigError(f"--more-data {folder}: that is --out itself (its collection is always used)")
        manifest = _read_manifest(folder)
        works = [folder / "work", *sorted(folder.glob("work-sampled-*"))]
        works = [w for w in works if shard_paths(w)]
        if not manifest and not works:
            raise ConfigError(f"--more-data {folder}: no {MANIFEST} there (give folders that `dynaspec prepare` "
                              "collected into)")
        # a collection still running has no manifest yet: its shards say which target made them
        recorded = manifest.get("fingerprint") if manifest else _shard_fingerprint(shard_paths(works[0])[0])
        if recorded != fingerprint:
            name = manifest.get("target") if manifest else "another target"
            raise ConfigError(f"--more-data {folder} was prepared for target {name!r}, whose "
                              "weights differ from this target's: its features would teach the drafter another model")
        if not works:
            raise ConfigError(f"--more-data {folder}: no collected shards in its work folders")
        found.extend(works)
    return found


def prepare(target_ref: str, out: Path, *, budget: PrepareBudget = PrepareBudget(),
            drafter: str | None = None, redo: tuple[str, ...] = (), only: tuple[str, ...] = (),
            command: str = "", seed: int = 0, init: str | None = None,
            more_data: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Run the stages of ``dynaspec prepare`` for ``target_ref`` into ``out``; returns the manifest.
    ``init``: a drafter (built-in name or folder) the drafter stage starts from instead of random
    weights; ``drafter``: one used as it is, with no training. ``more_data``: other prepare folders
    of the same target whose collections the drafter, frequency, corpus and router stages read beside this
    folder's own (first and later turns, collections of several runs or machines), see
    :func:`more_data_folders`."""
    from dynaspec.runtime.numerics import resolve_dtype
    from dynaspec.runtime.targets import load_target, resolve_artifact
    from dynaspec.training import collect as collect_mod
    from dynaspec.training import distributed
    from dynaspec.training import drafter as drafter_training
    from dynaspec.training.router import build_router
    from dynaspec.training.shards import shard_paths
    from dynaspec.training.vocabulary import build_clusters, build_corpus, build_frequency_list

    for name in (*redo, *only):
        if name not in STAGES:
            raise ConfigError(f"unknown stage {name!r}: one of {', '.join(STAGES)}")
    if Path(target_ref).is_dir():
        target_ref = str(Path(target_ref).resolve())
    manifest = _read_manifest(out)
    target = load_target(target_ref)
    fingerprint = target.fingerprint()  # of the weights as loaded, before the cast below
    if manifest and manifest.get("fingerprint") != fingerprint:
        raise ConfigError(f"{out} was prepared for target {manifest.get('target')!r}, not {target_ref!r}: "
                          "use another --out")
    if budget.clusters is None:
        budget = attrs.evolve(budget, clusters=min(1024, max(2, target.vocab_size // 16)))
    if budget.new_tokens is None:
        budget = attrs.evolve(budget, new_tokens=96 if budget.source == "generated" else 256)
    if budget.feature_layers == "auto":
        budget = attrs.evolve(budget, feature_layers=auto_feature_layers(len(target.decoder.layers)))
    if budget.clusters > target.vocab_size:
        raise ConfigError(f"--clusters {budget.clusters} exceeds the target's vocabulary ({target.vocab_size})")
    out.mkdir(parents=True, exist_ok=True)  # only once every check has passed
    target.to(dtype=resolve_dtype(budget.dtype, target.device))
    collect_mod.set_up_target(target, budget.weights)  # batched generation through the lean forward
    manifest = manifest or {"format": FORMAT, "target": target_ref, "fingerprint": fingerprint, "stages": {}}
    manifest["budget"] = json.loads(json.dumps(attrs.asdict(budget)))  # the latest run's, as JSON keeps it
    work = out / "work"
    drafter_dir = Path(resolve_artifact(drafter)) if drafter else out / "drafter"

    sampled_work = [out / f"work-sampled-{seed_}" for seed_ in range(budget.sampled)]
    extra_work = more_data_folders(more_data, fingerprint, out)

    def greedy_work() -> list[Path]:
        """The collections of the target's greedy continuations that hold shards, this folder's and
        the --more-data ones (what the frequency list, the corpus and the router read; sampled
        continuations are the drafter's alone)."""
        return [f for f in (work, *extra_work) if f.name == "work" and shard_paths(f)]

    def collect() -> dict[str, Any]:
        collect_mod.collect(target, work, prompts=budget.prompts, shard_size=budget.shard_size,
                            new_tokens=budget.new_tokens, source=budget.source,
                            feature_layers=budget.feature_layers, first_prompt=budget.first_prompt,
                            turns=budget.turns)
        # the stage's "seconds" are this run's; a collection resumed over several runs is timed by
        # its shards ("collect_seconds" over "timed_shards" of them)
        record = {"outputs": ["work"], **_described(work)}
        for seed_, folder in enumerate(sampled_work):  # the same prompts, sampled continuations
            collect_mod.collect(target, folder, prompts=budget.prompts, shard_size=budget.shard_size,
                                new_tokens=budget.new_tokens, source="generated", temperature=budget.temperature,
                                seed=seed_, feature_layers=budget.feature_layers, first_prompt=budget.first_prompt,
                                turns=budget.turns)
            record["outputs"].append(folder.name)
            record.setdefault("sampled", []).append({"folder": folder.name, **_described(folder)})
        return record

    def train_drafter() -> dict[str, Any]:
        if drafter:  # a given drafter is checked against the target and used as it is
            from dynaspec.runtime.targets import load_drafter

            load_drafter(str(drafter_dir), target)
            return {"outputs": [str(drafter_dir)], "given": True}
        folders = [work, *(f for f in sampled_work if shard_paths(f)), *extra_work]
        # folder names as the command gave them (relative where it did): no machine paths
        names = [f.name for f in (work, *sampled_work) if f in folders] + [
            str(Path(name) / f.name) for name in more_data for f in extra_work if f.parent == Path(name)]
        provenance: dict[str, Any] = {"command": command, "target": target_ref,
                                      "work": names if len(folders) > 1 else "work"}
        if start is not None:
            provenance["init"] = {"drafter": Path(init).name, "training": start.meta.get("training")}
        drafter_training.train(target, folders, drafter_dir, steps=budget.steps,
                               batch_positions=budget.batch_positions, seed=seed,
                               intermediate_size=budget.drafter_width,
                               feature_layers=None if start else budget.feature_layers,
                               provenance=provenance, init=start, loss_on=budget.loss_on,
                               precision=budget.precision, unroll=budget.unroll, embed_norm=budget.embed_norm)
        return {"outputs": ["drafter"]}

    def frequency() -> dict[str, Any]:
        works = [str(w) for w in greedy_work()] or [str(work)]  # none: the error names this folder's
        build_frequency_list(target, "generated", out / "frequency", work=works, command=command)
        return {"outputs": ["frequency"]}

    def corpus() -> dict[str, Any]:
        _, counts = build_corpus(target, greedy_work(), out / "corpus",
                                 command=command)
        return {"outputs": ["corpus"], **counts}

    def clusters() -> dict[str, Any]:
        _, log = build_clusters(target, out / "clusters", clusters=budget.clusters,
                                iterations=budget.kmeans_iterations, seed=seed, command=command)
        return {"outputs": ["clusters"], "cluster_sizes": [log["min_size"], log["max_size"]]}

    def router() -> dict[str, Any]:
        stats = build_router(target, [str(w) for w in greedy_work()], str(out / "clusters"),
                             out / "router",
                             drafter_ref=str(drafter_dir), width=budget.router_width,
                             epochs=budget.router_epochs, command=command)
        return {"outputs": ["router"], "held_out_recall": stats["held_out_recall"]}

    def stack() -> dict[str, Any]:
        given = str(drafter_dir) if drafter and Path(drafter).exists() else drafter
        text = _stack_toml(target_ref, given or "./drafter", budget.clusters, command)
        atomic_write(out / "stack.toml", lambda p: Path(p).write_text(text))
        return {"outputs": ["stack.toml"]}

    start = None  # the drafter to start from, loaded before --redo drafter clears ./drafter
    if init:
        from dynaspec.runtime.targets import load_drafter

        start = load_drafter(init, target)
        if "training" not in start.meta:
            raise ConfigError(f"--init {init}: not a drafter that dynaspec trained (no training record)")
        if budget.drafter_width is not None and budget.drafter_width < start.cfg.intermediate_size:
            raise ConfigError(f"--drafter-width {budget.drafter_width} is narrower than the --init drafter's "
                              f"{start.cfg.intermediate_size}: a drafter can be widened, not narrowed")

    rank, world = distributed.join()
    # under torchrun the collection, the drafter and the router are shared by the processes; the
    # cheap single-process stages and the manifest are rank 0's, the others wait for them
    shared = {"collect", "drafter", "router"}
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "collect": collect, "drafter": train_drafter, "frequency": frequency, "corpus": corpus,
        "clusters": clusters, "router": router, "stack": stack}
    for name in STAGES:
        if only and name not in only:
            continue
        done = manifest["stages"].get(name, {}).get("finished")
        if done and name not in redo:
            if rank == 0:
                print(f"dynaspec prepare: {name}: done earlier ({done}), skipped", file=sys.stderr)
            continue
        if rank == 0 and done and name in redo:
            # a redo starts afresh once; the stage leaves the manifest, so rerunning the same command
            # after an interruption resumes the redo (the drafter from its checkpoint) instead
            if name in ("frequency", "corpus", "clusters", "router"):
                shutil.rmtree(out / name, ignore_errors=True)
            if name == "drafter" and not drafter:
                shutil.rmtree(work / f"ckpt-{drafter_dir.name}", ignore_errors=True)
                shutil.rmtree(drafter_dir, ignore_errors=True)
            manifest = _record_stage(out, manifest, name, None)
        distributed.barrier(world)
        if rank == 0:
            print(f"dynaspec prepare: {name} ...", file=sys.stderr, flush=True)
        started = time.time()
        record = runs[name]() if rank == 0 or name in shared else None
        distributed.barrier(world)
        if rank == 0:
            digests = {o: _digest(out / o) for o in record["outputs"]
                       if not o.startswith("work") and (out / o).exists()}  # collected shards: not hashed
            manifest = _record_stage(out, manifest, name, {
                **record, "sha256": digests, "command": command, "seconds": round(time.time() - started, 1),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return manifest
