"""`dynaspec eval`: the dev protocol on a tiny target, exactness per slice, parts and merge."""

from __future__ import annotations

from dynaspec import evaluate as ev


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


def test_evaluate_train_split_takes_train_prompts_from_the_offset(tiny_spec_stack, monkeypatch):
    from dynaspec import data

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
