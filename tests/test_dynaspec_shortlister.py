"""Spherical k-means clusters, the router, and the `dynaspec` shortlister on a tiny target."""

from __future__ import annotations

import pytest
import torch

from conftest import builtin_registry, make_engine, reference_greedy, target, trained_drafter
from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.shortlisters import router as router_mod
from dynaspec.shortlisters.clusters import load_clusters, save_clusters, spherical_kmeans
from dynaspec.shortlisters.router import ClusterLayout
from dynaspec.training import collect as dc
from dynaspec.training import drafter as dt
from dynaspec.training.router import train_router


def test_spherical_kmeans_recovers_planted_directions():
    gen = torch.Generator().manual_seed(0)
    centers = torch.nn.functional.normalize(torch.randn(6, 16, generator=gen), dim=1)
    truth = torch.arange(300) % 6
    rows = centers[truth] * (1 + torch.rand(300, 1, generator=gen) * 5)  # lengths do not matter
    rows = rows + 0.05 * torch.randn(300, 16, generator=gen)
    labels, cents, log = spherical_kmeans(rows, 6, seed=1, progress=False)
    # same partition up to renaming
    pairs = {(int(a), int(b)) for a, b in zip(truth, labels)}
    assert len(pairs) == 6 and log["min_size"] == 50
    assert torch.allclose(cents.norm(dim=1), torch.ones(6), atol=1e-5)
    again, _, _ = spherical_kmeans(rows, 6, seed=1, progress=False)
    assert torch.equal(labels, again)  # fixed seed, deterministic


def test_empty_clusters_are_repaired():
    rows = torch.cat([torch.eye(4)[:1].repeat(10, 1), torch.eye(4)[1:2].repeat(10, 1)])
    labels, _, log = spherical_kmeans(rows, 5, progress=False)  # 5 clusters, 2 distinct directions
    assert torch.bincount(labels, minlength=5).min() >= 1 and log["min_size"] >= 1
    with pytest.raises(ConfigError, match="clusters = 0 is invalid"):
        spherical_kmeans(rows, 0, progress=False)


def test_layout_spans_and_special_tokens():
    assignment = torch.tensor([2, 0, 1, 0, 2, 1, 1, 0])
    layout = ClusterLayout(assignment, 3, special=(4,))
    assert layout.order[0].item() == 4 and sorted(layout.order.tolist()) == list(range(8))
    sl = layout.shortlist([0, 1])
    assert sorted(sl.token_ids.tolist()) == [1, 2, 3, 4, 5, 6, 7]
    # special span [0,1) then clusters 0 and 1, adjacent: one merged span
    assert sl.spans == ((0, 7),)
    assert layout.order[0:7].tolist() == sl.token_ids.tolist()
    sl2 = layout.shortlist([2])
    assert sl2.spans == ((0, 1), (7, 8)) and sorted(sl2.token_ids.tolist()) == [0, 4]


def test_context_tokens_join_the_shortlist_once():
    """The context tokens the chosen clusters and the always-on tokens miss form a tail after the
    spans: each id once, the spans unchanged."""
    assignment = torch.tensor([2, 0, 1, 0, 2, 1, 1, 0, 2, 1])
    layout = ClusterLayout(assignment, 3, special=(4,))
    plain = layout.shortlist([0])
    sl = layout.shortlist([0], context=torch.tensor([9, 4, 3, 0, 9, 2, 1]))
    # cluster 0 = {1, 3, 7}, special {4}; from the context 9, 0 and 2 are missing (each once)
    assert sl.spans == plain.spans and sl.span_length == plain.token_ids.numel() == 4
    assert sl.token_ids[:4].tolist() == plain.token_ids.tolist()
    assert sorted(sl.token_ids[4:].tolist()) == [0, 2, 9]
    assert len(set(sl.token_ids.tolist())) == sl.token_ids.numel() == 7
    assert layout.shortlist([0, 1, 2], context=torch.tensor([0, 5, 9])).token_ids.numel() == 10
    assert torch.equal(layout.shortlist([2], context=torch.tensor([], dtype=torch.long)).token_ids,
                       layout.shortlist([2]).token_ids)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Clusters + router for the tiny Llama target, from collected tiny shards."""
    root = tmp_path_factory.mktemp("dynaspec")
    tgt = target("llama")
    texts = [f"Tell me about item number {i} and why it matters." for i in range(12)]

    def prompt_batches(tokenizer, start, count, max_prompt_tokens, split="train", slice_name=None, fmt=None, turns="first"):
        return [(f"t{k}", tokenizer(texts[k])["input_ids"]) for k in range(start, min(start + count, len(texts)))]

    mp = pytest.MonkeyPatch()
    mp.setattr(dc, "_prompt_batches", prompt_batches)
    paths = dc.collect(tgt, root / "work", prompts=12, shard_size=4, batch=4, new_tokens=40)
    mp.undo()
    assignment, cents, _ = spherical_kmeans(tgt.lm_head_weight, 8, progress=False)
    save_clusters(root / "clusters", assignment, cents, {"target": tgt.fingerprint()})
    stats = train_router(paths, tgt.embed, assignment, 8, tgt.hidden_size, drafter=trained_drafter("llama"),
                         out=root / "router", fingerprint=tgt.fingerprint(), width=64, epochs=30,
                         lr=5e-3, batch=64)
    return root, stats


def test_router_learns_something(artifacts):
    _, stats = artifacts
    recall = {int(k): v for k, v in stats["held_out_recall"].items()}
    assert recall[1] > 1 / 8 + 0.1  # better than chance over 8 clusters
    assert recall[8] == 1.0 and all(recall[a] <= recall[b] for a, b in zip(sorted(recall), sorted(recall)[1:]))


@pytest.mark.parametrize("scheduler", [{"name": "fixed", "budget": 2, "unit": "clusters"},
                                       {"name": "position-aware", "k_max": 4, "unit": "clusters"}])
@pytest.mark.parametrize("per_row", [False, True])
def test_dynaspec_stack_is_exact(artifacts, scheduler, per_row):
    root, _ = artifacts
    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(),
                         shortlister={"name": "dynaspec", "clusters": str(root / "clusters"),
                                      "router": str(root / "router"), "per_row": per_row},
                         scheduler=scheduler, draft={"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 10})
    for prompt in ([5, 6, 7, 8], [30, 31, 9]):
        result = engine.generate(prompt, max_new_tokens=30)
        assert result.token_ids == reference_greedy("llama", prompt, 30)
    assert 0 < result.stats.mean_shortlist_size < 128


def test_the_router_computes_on_the_targets_int8_kernel(artifacts):
    """With the target on int8 weights the router's two layers run on the same kernel as the
    drafter's (a quarter of float32's bytes a step); its shortlists change a little, the output
    never: it is the plain decoding of the same weights, and float weights keep the float router."""
    from dynaspec.plugins.tiny import tiny_target
    from dynaspec.runtime import q8
    from dynaspec.runtime.config import stack_from_mapping
    from dynaspec.runtime.engine import Engine

    if q8.available() is not None:
        pytest.skip("the int8 kernel does not build here")
    root, _ = artifacts
    shortlister = {"name": "dynaspec", "clusters": str(root / "clusters"), "router": str(root / "router")}
    registry = builtin_registry()
    for weights, kernel in (("int8", True), ("dtype", False)):
        tgt = tiny_target("llama")
        stack = {"name": "r", "target": "tiny-llama", "weights": weights, "drafter": "in-memory",
                 "shortlister": shortlister, "scheduler": {"name": "fixed", "budget": 2, "unit": "clusters"},
                 "draft": {"mode": "chain", "depth": 4}}
        engine = Engine(stack_from_mapping(stack), tgt, trained_drafter("llama"), registry=registry)
        router = engine.shortlister.router
        assert isinstance(router.inp.forward, q8.Int8WeightLinear) == kernel
        assert isinstance(router.out.forward, q8.Int8WeightLinear) == kernel
        plain = Engine(stack_from_mapping({"name": "p", "target": "tiny-llama", "weights": weights}), tgt,
                       registry=registry)
        for prompt in ([5, 6, 7, 8], [30, 31, 9]):
            result = engine.generate(prompt, max_new_tokens=24)
            assert result.token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
            assert 0 < result.stats.mean_shortlist_size < 128


@pytest.mark.parametrize("draft", [{"mode": "chain", "depth": 5},
                                   {"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 10}])
def test_router_overlap_on_a_thread_changes_nothing_but_where_the_router_runs(artifacts, draft):
    """draft.router_overlap = "thread" proposes each shortlist on a worker thread while the draft
    decoder layer runs: the output, the shortlists per depth and the acceptance are unchanged."""
    import threading

    root, _ = artifacts
    runs = {}
    for overlap in ("off", "thread"):
        engine = make_engine("llama", trained_drafter("llama"), builtin_registry(),
                             shortlister={"name": "dynaspec", "clusters": str(root / "clusters"),
                                          "router": str(root / "router")},
                             scheduler={"name": "confidence", "k_max": 6, "mass": 0.9, "k_min": 1},
                             draft={**draft, "router_overlap": overlap})
        threads = set()
        propose = engine.shortlister.propose

        def recording(step, scheduler, propose=propose, threads=threads):
            threads.add(threading.current_thread().name)
            assert not torch.is_grad_enabled()
            return propose(step, scheduler)

        engine.shortlister.propose = recording
        results = [engine.generate(p, max_new_tokens=30) for p in ([5, 6, 7, 8], [30, 31, 9])]
        runs[overlap] = (results, threads)
    (plain, plain_threads), (overlapped, worker_threads) = runs["off"], runs["thread"]
    assert plain_threads == {threading.current_thread().name}
    assert worker_threads and all(name.startswith("dynaspec-router") for name in worker_threads)
    for prompt, a, b in zip(([5, 6, 7, 8], [30, 31, 9]), plain, overlapped):
        assert b.token_ids == a.token_ids == reference_greedy("llama", prompt, 30)
        assert b.stats.accepted_lengths == a.stats.accepted_lengths
        assert b.stats.shortlist_sizes == a.stats.shortlist_sizes


def test_router_overlap_rejects_unknown_modes():
    with pytest.raises(ConfigError, match="router_overlap"):
        make_engine("llama", trained_drafter("llama"), builtin_registry(),
                    draft={"mode": "chain", "depth": 3, "router_overlap": "stream"})


def test_artifacts_for_another_target_are_refused(artifacts):
    root, _ = artifacts
    with pytest.raises(ArtifactMismatchError):
        load_clusters(root / "clusters", target("gemma3").fingerprint())
    with pytest.raises(ArtifactMismatchError):
        router_mod.Router.load(root / "router", target("gemma3").fingerprint())


class _Fixed:
    """A shortlister that always proposes the same ids."""

    def __init__(self, ids):
        self.ids = ids

    def propose(self, step, scheduler):
        from dynaspec.runtime.types import Shortlist

        return Shortlist(self.ids)


def test_eval_shortlist_reports_recall(artifacts, tmp_path, monkeypatch):
    from dynaspec.evaluation import shortlist as shortlist_eval

    root, _ = artifacts
    monkeypatch.setattr("dynaspec.training.data.load_conversations", lambda: [])
    tgt, drafter = target("llama"), trained_drafter("llama")
    registry = builtin_registry()
    full = registry.build("shortlister", "full", {}, None)
    everything = _Fixed(torch.arange(tgt.vocab_size))  # explicit ids: recall is counted, not assumed
    nothing = _Fixed(torch.tensor([2]))  # <unk>: never the next token of the tiny target's text
    engine = make_engine("llama", drafter, registry, shortlister={
        "name": "dynaspec", "clusters": str(root / "clusters"), "router": str(root / "router")},
        scheduler={"name": "position-aware", "k_max": 4, "unit": "clusters"})
    shards = sorted((root / "work").glob("shard-*.safetensors"))
    report = shortlist_eval.evaluate_shortlisters(
        shards, tgt, drafter, {"full": (full, engine.scheduler), "dyn": (engine.shortlister, engine.scheduler),
                               "everything": (everything, engine.scheduler), "nothing": (nothing, engine.scheduler)},
        depth=3)
    assert report["everything"]["overall"]["mean_recall"] == 1.0
    assert report["nothing"]["overall"]["mean_recall"] == 0.0
    dyn = report["dyn"]["overall"]["per_depth"]
    assert 0 < dyn[0]["recall"] <= 1 and dyn[0]["size"] < 128 and dyn[2]["size"] < dyn[0]["size"]
    shortlist_eval.plot_report(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000
    assert "| dyn | overall |" in shortlist_eval.format_report(report)


def test_confidence_scheduler(registry):
    sched = registry.build("scheduler", "confidence", {"k_max": 8, "k_min": 2, "mass": 0.9}, None)
    peaked = torch.tensor([[0.95, 0.03, 0.01, 0.01]])
    flat = torch.full((1, 16), 1 / 16)
    assert sched.budget(depth=0, scores=peaked) == 2  # k_min
    assert sched.budget(depth=0, scores=flat) == 8  # capped at k_max
    assert sched.budget(depth=3, scores=flat) == 1  # position-aware cap 8 // 8
    assert sched.budget(depth=0) == 8
    with pytest.raises(ConfigError, match="mass = 1.5"):
        registry.build("scheduler", "confidence", {"mass": 1.5}, None)


def test_confidence_mass_per_depth(registry):
    """A list gives one mass per depth; the last serves every deeper step."""
    sched = registry.build("scheduler", "confidence", {"k_max": 64, "k_min": 1, "mass": [0.99, 0.8, 0.5]}, None)
    scores = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]])  # cumulative 0.5 0.75 0.875 0.9375 1 (exact)
    assert [sched.budget(depth=t, scores=scores) for t in range(5)] == [5, 3, 1, 1, 1]
    assert sched.mass == (0.99, 0.8, 0.5)
    single = registry.build("scheduler", "confidence", {"k_max": 64, "k_min": 1, "mass": 0.8}, None)
    assert [single.budget(depth=t, scores=scores) for t in range(2)] == [3, 3] and single.mass == 0.8
    for bad in ([], [0.9, 0.0], [0.9, "x"], [True]):
        with pytest.raises(ConfigError, match="one per draft depth"):
            registry.build("scheduler", "confidence", {"mass": bad}, None)


def test_hybrid_stack_is_exact_and_keeps_its_core(artifacts, tmp_path):
    from dynaspec.shortlisters.frequency import save_frequency

    root, _ = artifacts
    tgt = target("llama")
    counts = torch.arange(tgt.vocab_size, 0, -1)  # token 0 most frequent, then 1, 2, ...
    save_frequency(tmp_path, counts, {"target": tgt.fingerprint()})
    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(), shortlister={
        "name": "hybrid", "clusters": str(root / "clusters"), "router": str(root / "router"),
        "frequency": str(tmp_path), "core": 10}, scheduler={"name": "confidence", "k_max": 3, "mass": 0.8},
        draft={"mode": "tree", "depth": 3, "topk": 2, "total_tokens": 6})
    prompt = [11, 12, 13]
    assert engine.generate(prompt, max_new_tokens=20).token_ids == reference_greedy("llama", prompt, 20)
    sl = engine.shortlister.layout.shortlist([])
    assert set(range(10)) <= set(sl.token_ids.tolist())


@pytest.mark.parametrize("draft", [{"mode": "chain", "depth": 5},
                                   {"mode": "tree", "depth": 4, "topk": 3, "total_tokens": 10}])
def test_context_tokens_in_the_shortlist_keep_greedy_exact(artifacts, draft):
    root, _ = artifacts
    stacks = {}
    for context in (0, 16):
        stacks[context] = make_engine("llama", trained_drafter("llama"), builtin_registry(), shortlister={
            "name": "dynaspec", "clusters": str(root / "clusters"), "router": str(root / "router"),
            "context": context}, scheduler={"name": "fixed", "budget": 1, "unit": "clusters"}, draft=draft)
    for prompt in ([5, 6, 7, 8], [30, 31, 9]):
        ref = reference_greedy("llama", prompt, 30)
        with_ctx, without = (stacks[c].generate(prompt, max_new_tokens=30) for c in (16, 0))
        assert with_ctx.token_ids == without.token_ids == ref
        # the context adds tokens (the prompt's, at least) that one cluster does not hold
        assert with_ctx.stats.mean_shortlist_size > without.stats.mean_shortlist_size
    with pytest.raises(ConfigError, match="context = -1 is invalid"):
        make_engine("llama", trained_drafter("llama"), builtin_registry(), shortlister={
            "name": "dynaspec", "clusters": str(root / "clusters"), "router": str(root / "router"),
            "context": -1})


def test_eval_shortlist_cli_reads_several_shard_folders(artifacts, tmp_path, monkeypatch):
    import json
    import shutil

    from dynaspec.cli import main

    root, _ = artifacts
    monkeypatch.setattr("dynaspec.training.data.load_conversations", lambda: [])
    trained_drafter("llama").save(tmp_path / "drafter")
    stack = tmp_path / "dyn.toml"
    stack.write_text(f'name = "dyn"\ntarget = "tiny-llama"\ndrafter = "{tmp_path / "drafter"}"\n'
                     f'[shortlister]\nname = "dynaspec"\nclusters = "{root / "clusters"}"\n'
                     f'router = "{root / "router"}"\n[scheduler]\nname = "fixed"\nbudget = 2\nunit = "clusters"\n')
    shards = sorted((root / "work").glob("shard-*.safetensors"))
    for k, folder in enumerate(("a", "b")):
        (tmp_path / folder).mkdir()
        shutil.copy(shards[k], tmp_path / folder / shards[k].name)
    assert main(["eval-shortlist", "--stacks", str(stack), "--work", str(tmp_path / "a"), str(tmp_path / "b"),
                 "--depth", "2", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "shortlist_eval.json").read_text())
    one = report["dyn"]["overall"]["per_depth"]["0"]["positions"]
    assert main(["eval-shortlist", "--stacks", str(stack), "--work", str(tmp_path / "a"), "--depth", "2",
                 "--out", str(tmp_path / "out1")]) == 0
    single = json.loads((tmp_path / "out1" / "shortlist_eval.json").read_text())
    assert single["dyn"]["overall"]["per_depth"]["0"]["positions"] < one
    assert main(["eval-shortlist", "--stacks", str(stack), "--work", str(tmp_path / "none"),
                 "--out", str(tmp_path / "o")]) == 2


def test_recall_with_a_core_class_counts_core_tokens_as_found():
    from dynaspec.training.router import recall_at

    logits = torch.tensor([[3.0, 2.0, 1.0, 9.0], [1.0, 2.0, 3.0, 0.0], [0.0, 1.0, 2.0, 5.0]])
    labels = torch.tensor([1, 0, 3])  # cluster 1 (rank 2), cluster 0 (rank 3), in the core
    # the core class is always on and takes none of the k places
    got = recall_at(logits, labels, [1, 2, 3], core_index=3)
    assert got == pytest.approx({1: 1 / 3, 2: 2 / 3, 3: 1.0})
    # without a core class the fourth output is a cluster competing for the k places
    assert recall_at(logits, labels, [1, 2, 3], core_index=None) == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1.0})


def _varied_shards(folder, tgt, n_shards=4, per_shard=8, length=24):
    """Shards whose next tokens vary (the tiny target's own continuations repeat one token): each
    sequence follows x -> (5x + 3) mod |V| from a random start, with the target's real features."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    paths = []
    for k in range(n_shards):
        seqs = []
        for _ in range(per_shard):
            x = [int(torch.randint(tgt.vocab_size, (1,), generator=gen))]
            for _ in range(length - 1):
                x.append((5 * x[-1] + 3) % tgt.vocab_size)
            seqs.append(x)
        feats = [tgt.forward(torch.tensor(x), torch.arange(length), tgt.new_cache()) for x in seqs]
        tensors = {"tokens": torch.tensor(seqs, dtype=torch.int32).flatten(),
                   "offsets": torch.arange(per_shard + 1, dtype=torch.int64) * length,
                   "prompt_lens": torch.full((per_shard,), 2, dtype=torch.int32),
                   "features": torch.cat(feats).to(torch.bfloat16).contiguous()}
        paths.append(folder / f"shard-{k:05d}.safetensors")
        save_file(tensors, str(paths[-1]), metadata={"split": "train", "source": "generated"})
    return paths


@pytest.fixture(scope="module")
def core_router(artifacts, tmp_path_factory):
    """A router trained for the hybrid with the 12 most frequent next tokens always on."""
    from dynaspec.shortlisters.frequency import load_frequency, save_frequency
    from dynaspec.training.router import router_examples

    root, _ = artifacts
    out = tmp_path_factory.mktemp("core")
    tgt = target("llama")
    paths = _varied_shards(out / "work", tgt)
    identity = torch.arange(tgt.vocab_size)  # "clusters" of one token: labels are the next tokens
    nxt = torch.cat([router_examples(dt.load_shard(p), tgt.embed, identity, None)[2] for p in paths])
    save_frequency(out / "freq", torch.bincount(nxt, minlength=tgt.vocab_size), {"target": tgt.fingerprint()})
    core = load_frequency(out / "freq", tgt.fingerprint())[0][:12]
    assignment = load_clusters(root / "clusters", tgt.fingerprint())["assignment"].long()
    stats = train_router(paths, tgt.embed, assignment, 8, tgt.hidden_size, drafter=trained_drafter("llama"),
                         out=out / "router", fingerprint=tgt.fingerprint(), width=64, epochs=30, lr=5e-3,
                         batch=64, core_ids=core, special_ids=tgt.special_token_ids)
    return out, stats, assignment, core


def test_core_aware_router_has_a_core_class_and_learns(core_router, artifacts):
    from dynaspec.shortlisters.router import Router
    from dynaspec.training.router import router_examples

    out, stats, assignment, core = core_router
    tgt = target("llama")
    router, meta = Router.load(out / "router", tgt.fingerprint())
    assert router.cfg.core_class and router.out.out_features == 9 and meta["core"]["size"] == 12
    shards = [dt.load_shard(p) for p in sorted((out / "work").glob("shard-*.safetensors"))]
    in_core = torch.zeros(tgt.vocab_size, dtype=torch.bool)
    in_core[core] = True
    plain = torch.cat([router_examples(s, tgt.embed, assignment, None)[2] for s in shards])
    labels = torch.cat([router_examples(s, tgt.embed, assignment, None, in_core)[2] for s in shards])
    core_rows = labels == 8
    assert core_rows.any() and (~core_rows).any()  # both kinds occur in the tiny continuations
    assert torch.equal(labels[~core_rows], plain[~core_rows])
    recall = {int(k): v for k, v in stats["held_out_recall"].items()}
    # the next token is a function of the current one: far better than the core share + 1 cluster in 8
    chance = float(core_rows.float().mean()) + float((~core_rows).float().mean()) / 8
    assert recall[8] == 1.0 and recall[1] > chance + 0.1


@pytest.mark.parametrize("draft", [{"mode": "chain", "depth": 5},
                                   {"mode": "tree", "depth": 3, "topk": 2, "total_tokens": 6}])
def test_hybrid_with_a_core_aware_router_is_exact(core_router, artifacts, draft):
    root, _ = artifacts
    out = core_router[0]
    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(), shortlister={
        "name": "hybrid", "clusters": str(root / "clusters"), "router": str(out / "router"),
        "frequency": str(out / "freq"), "core": 12}, scheduler={"name": "confidence", "k_max": 3, "mass": 0.8},
        draft=draft)
    for prompt in ([11, 12, 13], [5, 6, 7, 8]):
        result = engine.generate(prompt, max_new_tokens=24)
        assert result.token_ids == reference_greedy("llama", prompt, 24)
    # all 9 slots: the 8 clusters and the core slot, which is dropped (it is no cluster) -> the vocabulary
    from dynaspec.runtime.types import DraftStep

    tgt = target("llama")
    shortlister, tokens = engine.shortlister, torch.tensor([11, 12])
    assert shortlister.core_index == 8
    step = DraftStep(depth=0, tokens=tokens, token_embeddings=tgt.embed(tokens),
                     prev_hidden=torch.randn(2, tgt.hidden_size))
    every = builtin_registry().build("scheduler", "fixed", {"budget": 9}, None)
    assert sorted(shortlister.propose(step, every).token_ids.tolist()) == list(range(tgt.vocab_size))


def test_core_aware_router_is_refused_without_its_core(core_router, artifacts):
    root, _ = artifacts
    out = core_router[0]
    with pytest.raises(ConfigError, match="trained for the hybrid shortlister with a 12-token"):
        make_engine("llama", trained_drafter("llama"), builtin_registry(),
                    shortlister={"name": "dynaspec", "clusters": str(root / "clusters"), "router": str(out / "router")},
                    scheduler={"name": "fixed", "budget": 2, "unit": "clusters"})
    with pytest.raises(ConfigError, match="same 'frequency' list and 'core' size"):
        make_engine("llama", trained_drafter("llama"), builtin_registry(), shortlister={
            "name": "hybrid", "clusters": str(root / "clusters"), "router": str(out / "router"),
            "frequency": str(out / "freq"), "core": 5}, scheduler={"name": "fixed", "budget": 2, "unit": "clusters"})


def test_eval_shortlist_simulates_chain_acceptance(artifacts, tmp_path, monkeypatch):
    """Greedy speculative decoding of each continuation replayed offline (each draft the drafter's
    favourite in the shortlist; a cycle keeps its leading right drafts plus the target's token):
    checked against a direct loop for the full vocabulary, and near 1 for a special-tokens-only
    shortlist."""
    from dynaspec.evaluation import shortlist as shortlist_eval
    from dynaspec.shortlisters.frequency import FrequencyShortlister

    monkeypatch.setattr("dynaspec.training.data.load_conversations", lambda: [])
    tgt, drafter = target("llama"), trained_drafter("llama")
    # the tiny target's own continuations (which its drafter gets right) and varied ones (mostly not)
    paths = [*sorted((artifacts[0] / "work").glob("shard-*.safetensors"))[:1],
             *_varied_shards(tmp_path / "work", tgt, n_shards=2, per_shard=4, length=16)]
    registry = builtin_registry()
    full = registry.build("shortlister", "full", {}, None)
    fixed1 = registry.build("scheduler", "fixed", {"budget": 1}, None)
    tiny = FrequencyShortlister(torch.arange(tgt.vocab_size), tuple(tgt.special_token_ids), tgt.vocab_size)
    depth = 3
    report = shortlist_eval.evaluate_shortlisters(paths, tgt, drafter, {"full": (full, fixed1), "one": (tiny, fixed1)},
                                                  depth=depth)
    total, cycles = 0, 0
    for path in paths:
        shard = dt.load_shard(path)
        offs = shard["offsets"].tolist()
        for k, plen in enumerate(shard["prompt_lens"].tolist()):
            seq, feats = shard["tokens"][offs[k]:offs[k + 1]].long(), shard["features"][offs[k]:offs[k + 1]]
            levels = shortlist_eval.unrolled_features(drafter, tgt.embed(seq).float(), feats, depth)
            start, last = max(plen - 1, 1), seq.numel() - 2  # the last position with a next token
            while start + depth - 1 <= last:
                a = 0
                while a < depth and int(tgt.logits(levels[a + 1][start + a][None]).argmax()) == int(seq[start + a + 1]):
                    a += 1
                total, cycles, start = total + 1 + a, cycles + 1, start + 1 + a
    got = report["full"]["overall"]
    assert got["cycles"] == cycles and got["chain_accepted_length"] == pytest.approx(total / cycles)
    assert 1.5 < got["chain_accepted_length"] < depth + 0.5  # the drafter is right often, not always
    assert report["one"]["overall"]["chain_accepted_length"] < 1.1
    assert "replayed accepted length" in shortlist_eval.format_report(report)


@pytest.mark.parametrize("shortlister", ["dynaspec", "hybrid"])
def test_routed_shortlists_create_no_tensor_off_the_target_device(artifacts, tmp_path, shortlister):
    """Assembled and run with the default device set to ``meta`` (see test_device_clean): the
    router, the cluster layout and the context tail all live on the target's device."""
    from dynaspec.shortlisters.frequency import save_frequency

    root, _ = artifacts
    tgt = target("llama")
    save_frequency(tmp_path, torch.arange(tgt.vocab_size, 0, -1), {"target": tgt.fingerprint()})
    params = {"name": shortlister, "clusters": str(root / "clusters"), "router": str(root / "router"),
              "context": 16, **({"frequency": str(tmp_path), "core": 10} if shortlister == "hybrid" else {})}
    drafter, prompt = trained_drafter("llama"), [5, 6, 7, 8]
    with torch.device("meta"):
        engine = make_engine("llama", drafter, builtin_registry(), shortlister=params, backend="torch-blocked",
                             scheduler={"name": "confidence", "k_max": 3, "mass": 0.8},
                             draft={"mode": "chain", "depth": 4})
        result = engine.generate(prompt, max_new_tokens=20)
    assert result.token_ids == reference_greedy("llama", prompt, 20)


def test_a_budget_in_the_wrong_unit_is_refused(artifacts):
    """The router's budget counts clusters: the fixed scheduler's default of 32,768 (tokens, for a
    frequency list) would select every cluster, so it is refused with the limit, not clamped."""
    root, _ = artifacts
    params = {"name": "dynaspec", "clusters": str(root / "clusters"), "router": str(root / "router")}
    with pytest.raises(ConfigError, match=r"scheduler 'fixed' counts its budget in tokens, but shortlister "
                       r"'dynaspec' counts in clusters: set scheduler.unit = \"clusters\""):
        make_engine("llama", trained_drafter("llama"), builtin_registry(), shortlister=params,
                    scheduler={"name": "fixed"})
    with pytest.raises(ConfigError, match=r"gives a budget of 32,768 at draft depth 0, but shortlister "
                       r"'dynaspec' counts its budget in clusters and has \d+"):
        make_engine("llama", trained_drafter("llama"), builtin_registry(), shortlister=params,
                    scheduler={"name": "fixed", "unit": "clusters"})
    engine = make_engine("llama", trained_drafter("llama"), builtin_registry(), shortlister=params,
                         scheduler={"name": "fixed", "budget": 2, "unit": "clusters"})
    assert engine.shortlister.budget_unit == "clusters"
