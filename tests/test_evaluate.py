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
