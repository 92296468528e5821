"""`dynaspec eval`: the dev protocol on a tiny target, exactness per slice, parts and merge."""

from __future__ import annotations

from dynaspec.evaluation import evaluate as ev


def test_evaluate_parts_merge(tiny_spec_stack, monkeypatch):
    spec = tiny_spec_stack
    items = [{"id": "a", "text": "Hello", "slice": "english"}, {"id": "b", "text": "def f():", "slice": "code"},
             {"id": "c", "text": "Hola amigo", "slice": "non-english"}]
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: items[:n])
    whole = ev.evaluate([str(spec)], prompts=3, max_new_tokens=10, progress=False)
    parts = [ev.evaluate([str(spec)], prompts=3, max_new_tokens=10, progress=False, part=(k, 2)) for k in (0, 1)]
    merged = ev.merge(parts)
    for report in (whole, merged):
        spec_fig = report["stacks"]["spec"]
        assert set(spec_fig) == {"overall", "english", "code", "non-english"}
        assert spec_fig["overall"]["exact"] and spec_fig["overall"]["prompts"] == 3
        assert report["stacks"]["baseline"]["overall"]["mean_accepted_length"] == 0.0
    assert merged["stacks"]["spec"]["overall"]["mean_accepted_length"] == whole["stacks"]["spec"]["overall"][
        "mean_accepted_length"]  # greedy acceptance is deterministic
    assert "| spec | overall | 3 | yes |" in ev.format_table(whole)


def test_merge_refuses_parts_of_different_runs(tiny_spec_stack, monkeypatch, tmp_path):
    """Parts that ran other stacks or another protocol, a file that is not a report and a missing
    one are refused with a clear message (by ``merge`` and by ``dynaspec eval --merge``)."""
    import copy
    import json
    import subprocess
    import sys

    import pytest

    from dynaspec.errors import InputError

    items = [{"id": "a", "text": "Hello", "slice": "english"}, {"id": "b", "text": "def f():", "slice": "code"}]
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: items[:n])
    parts = [ev.evaluate([str(tiny_spec_stack)], prompts=2, max_new_tokens=6, progress=False, part=(k, 2))
             for k in (0, 1)]
    longer = copy.deepcopy(parts[1])
    longer["protocol"]["max_new_tokens"] = 64
    renamed = copy.deepcopy(parts[1])
    renamed["rows"]["other"] = renamed["rows"].pop("spec")
    for bad, message in (([parts[0], longer], "another protocol"), ([parts[0], renamed], "same stacks"),
                         ([parts[0], {"stacks": {}}], "part 2 is not"), ([], "nothing to merge")):
        with pytest.raises(InputError, match=message):
            ev.merge(bad)
    assert ev.merge(parts)["protocol"]["prompts"] == 2
    good = tmp_path / "p0.json"
    good.write_text(json.dumps(parts[0]))
    (tmp_path / "junk.json").write_text("not json")
    for other, message in ((tmp_path / "missing.json", "no report at"), (tmp_path / "junk.json", "is not a JSON report")):
        done = subprocess.run([sys.executable, "-m", "dynaspec", "eval", "--merge", str(good), str(other)],
                              capture_output=True, text=True)
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_evaluate_train_split_takes_train_prompts_from_the_offset(tiny_spec_stack, monkeypatch):
    from dynaspec.training import data

    train = [{"id": f"t{k}", "text": f"prompt {k}", "slice": "english"} for k in range(10)]
    monkeypatch.setattr(data, "training_prompts", lambda max_chars: iter(train))
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: (_ for _ in ()).throw(
        AssertionError("tuning must not read dev prompts")))
    report = ev.evaluate([str(tiny_spec_stack)], prompts=2, max_new_tokens=6, progress=False, split="train",
                         train_offset=7)
    assert [r["id"] for r in report["rows"]["spec"]] == ["t7", "t8"]
    assert report["protocol"]["split"] == "train" and report["protocol"]["train_offset"] == 7


def test_evaluate_one_slice(tiny_spec_stack, monkeypatch):
    items = [{"id": "a", "text": "Hello", "slice": "english"}, {"id": "b", "text": "def f():", "slice": "code"},
             {"id": "c", "text": "Hola amigo", "slice": "non-english"}, {"id": "d", "text": "x = 1", "slice": "code"}]
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: items[:n])
    report = ev.evaluate([str(tiny_spec_stack)], prompts=5, max_new_tokens=4, progress=False, slice_name="code")
    assert [r["id"] for r in report["rows"]["spec"]] == ["b", "d"]
    assert set(report["stacks"]["spec"]) == {"overall", "code"} and report["protocol"]["slice"] == "code"


def test_cost_model_accounts_for_every_millisecond(tiny_spec_stack, monkeypatch):
    """The per-cycle split (draft, body, head, bookkeeping, other) adds up to the measured wall
    time, a verification is priced in the baseline's own plain steps, and the bound is above
    what was reached."""
    from dynaspec.evaluation.cost_model import format_cost_table

    items = [{"id": "a", "text": "Hello there", "slice": "english"}, {"id": "b", "text": "def f():", "slice": "code"}]
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: items[:n])
    report = ev.evaluate([str(tiny_spec_stack)], prompts=2, max_new_tokens=12, progress=False)
    rows = report["rows"]["spec"]
    cost = report["cost"]["spec"]
    cycles = sum(len(r["accepted"]) for r in rows)
    wall = sum(r["wall"] - r["times"]["prefill"] for r in rows)
    assert abs(sum(cost["ms_per_cycle"].values()) * cycles / 1e3 - wall) < 1e-6
    plain = sorted(t for r in report["rows"]["baseline"] for t in r["verify_times"])
    mine = sorted(t for r in rows for t in r["verify_times"])
    assert len(mine) == cycles and len(plain) == sum(r["new_tokens"] - 1 for r in report["rows"]["baseline"])
    assert cost["verify_in_plain_steps"] > 0 and cost["tokens_per_cycle"] >= 1
    # a plain step costs exactly one plain step, and commits one token
    assert report["cost"]["baseline"]["verify_in_plain_steps"] == 1.0
    assert report["cost"]["baseline"]["tokens_per_cycle"] == 1.0
    assert 0 < cost["fraction_of_bound"] < 1 and report["machine"]["read_bandwidth"] > 1e8
    table = format_cost_table(report["cost"], bandwidth=report["machine"]["read_bandwidth"],
                              weights=report["machine"]["weight_bytes"])
    assert "| spec |" in table and "| baseline | 1.00 |" in table


def test_each_dtype_gets_its_own_baseline(tiny_spec_stack, tmp_path, monkeypatch):
    """Exactness and speed are always measured against plain decoding in the stack's own dtype."""
    items = [{"id": "a", "text": "Hello", "slice": "english"}]
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: items[:n])
    bf16 = tmp_path / "bf16.toml"
    bf16.write_text(f'name = "spec-bf16"\nbase = "{tiny_spec_stack}"\ndtype = "bfloat16"\n')
    report = ev.evaluate([str(tiny_spec_stack), str(bf16)], prompts=1, max_new_tokens=6, progress=False)
    assert report["baselines"] == {"baseline-bfloat16-cpu": "baseline-bfloat16-cpu",
                                   "baseline-float32-cpu": "baseline-float32-cpu",
                                   "spec": "baseline-float32-cpu", "spec-bf16": "baseline-bfloat16-cpu"}
    assert report["stacks"]["spec-bf16"]["overall"]["exact"] and report["stacks"]["spec"]["overall"]["exact"]


def test_sampled_eval_reports_speed_without_a_token_check(tiny_spec_stack, monkeypatch):
    """At a temperature the outputs are draws, not compared token for token: exact is None and the
    table says so; each prompt's seed is the same in every stack and in every part."""
    items = [{"id": "a", "text": "Hello", "slice": "english"}, {"id": "b", "text": "Bye", "slice": "english"}]
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: items[:n])
    whole = ev.evaluate([str(tiny_spec_stack)], prompts=2, max_new_tokens=8, progress=False,
                        temperature=0.7, seed=3)
    assert whole["stacks"]["spec"]["overall"]["exact"] is None
    assert "(sampled)" in ev.format_table(whole) and whole["protocol"]["temperature"] == 0.7
    second = ev.evaluate([str(tiny_spec_stack)], prompts=2, max_new_tokens=8, progress=False,
                         temperature=0.7, seed=3, part=(1, 2))
    # the same prompt sampled with the same seed: the same draws, whether run whole or in parts
    assert second["rows"]["baseline"][0]["token_ids"] == whole["rows"]["baseline"][1]["token_ids"]
    assert second["rows"]["spec"][0]["token_ids"] == whole["rows"]["spec"][1]["token_ids"]


def test_each_target_gets_its_own_baseline(tiny_spec_stack, tmp_path, monkeypatch):
    """Stacks on different targets are each measured against plain decoding of their own target,
    with the prompt in that target's own format."""
    items = [{"id": "a", "text": "Hello", "slice": "english"}]
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: items[:n])
    gemma = tmp_path / "gemma.toml"
    gemma.write_text('name = "plain-gemma"\ntarget = "tiny-gemma3"\ndrafter = "none"\ndtype = "float32"\n')
    report = ev.evaluate([str(tiny_spec_stack), str(gemma)], prompts=1, max_new_tokens=6, progress=False)
    assert report["baselines"] == {"baseline-tiny-gemma3-float32-cpu": "baseline-tiny-gemma3-float32-cpu",
                                   "baseline-tiny-llama-float32-cpu": "baseline-tiny-llama-float32-cpu",
                                   "plain-gemma": "baseline-tiny-gemma3-float32-cpu",
                                   "spec": "baseline-tiny-llama-float32-cpu"}
    rows = report["rows"]
    assert rows["plain-gemma"][0]["token_ids"] == rows["baseline-tiny-gemma3-float32-cpu"][0]["token_ids"]
    assert rows["plain-gemma"][0]["token_ids"] != rows["baseline-tiny-llama-float32-cpu"][0]["token_ids"]
    assert report["stacks"]["spec"]["overall"]["exact"] and report["stacks"]["plain-gemma"]["overall"]["exact"]


def test_repeat_fraction_counts_output_4grams_seen_before():
    import pytest

    from dynaspec.evaluation.degenerate import is_degenerate, repeat_fraction

    # an echo of the prompt: every output 4-gram occurred in the prompt
    assert repeat_fraction([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5]) == pytest.approx(2 / 5)
    assert repeat_fraction([9, 9, 1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(5 / 8)
    # fresh text repeats nothing; a loop of the output's own text does
    assert repeat_fraction([1, 2, 3], [4, 5, 6, 7, 8]) == 0.0
    loop = [7, 8, 9] * 10
    assert repeat_fraction([1], loop) > 0.8 and is_degenerate(repeat_fraction([1], loop))
    assert repeat_fraction([1, 2], []) == 0.0 and not is_degenerate(0.49)


def test_each_weights_setting_gets_its_own_baseline(tiny_spec_stack, tmp_path, monkeypatch):
    """A stack is exact against plain decoding on its own weights: `--weights` (an override of every
    stack) reaches the baseline too, and stacks on different weights get a baseline each."""
    engines, reference_of = ev.build_engines([str(tiny_spec_stack)], {"weights": "float16"})
    assert reference_of == {"baseline": "baseline", "spec": "baseline"}
    assert engines["baseline"].target.weights == engines["spec"].target.weights == "float16"
    other = tmp_path / "f16.toml"
    other.write_text(f'name = "spec-f16"\nbase = "{tiny_spec_stack}"\nweights = "float16"\n')
    engines, reference_of = ev.build_engines([str(tiny_spec_stack), str(other)], None)
    assert reference_of == {"baseline-float32-cpu-auto": "baseline-float32-cpu-auto",
                            "baseline-float32-cpu-float16": "baseline-float32-cpu-float16",
                            "spec": "baseline-float32-cpu-auto", "spec-f16": "baseline-float32-cpu-float16"}
    assert engines["baseline-float32-cpu-float16"].target.weights == "float16"
    assert engines["baseline-float32-cpu-auto"].target is engines["spec"].target
    items = [{"id": "a", "text": "Hello", "slice": "english"}]
    monkeypatch.setattr(ev, "dev_protocol_prompts", lambda n, max_chars: items[:n])
    report = ev.evaluate([str(tiny_spec_stack), str(other)], prompts=1, max_new_tokens=6, progress=False)
    assert report["stacks"]["spec-f16"]["overall"]["exact"] and report["stacks"]["spec"]["overall"]["exact"]
