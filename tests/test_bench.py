"""`dynaspec bench`: question parsing, interleaved runs, resumption, exactness check, outputs."""

from __future__ import annotations

import json

import pytest

from dynaspec.errors import InputError
from dynaspec.evaluation import bench


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_builtin_set_covers_the_categories():
    qs = bench.parse_questions(None)
    cats = {bench.report_category(q.category) for q in qs}
    assert {"multi-turn conversation", "translation", "summarization", "qa", "math_reasoning", "rag",
            "code"} <= cats
    assert any(len(q.turns) == 2 for q in qs)
    assert len(bench.select(qs, 1)) == len({q.category for q in qs})


def test_humaneval_and_specbench_lines(tmp_path):
    path = _write(tmp_path / "q.jsonl", [
        json.dumps({"question_id": 81, "category": "writing", "turns": ["a", "b"], "reference": ["x"]}),
        json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"})])
    qs = bench.parse_questions(path)
    assert qs[0].question_id == "81" and qs[0].turns == ("a", "b")
    assert qs[1].category == "code"


@pytest.mark.parametrize("lines,message", [
    (["{not json"], "line 1: not JSON"),
    ([json.dumps({"question_id": 1, "turns": ["a"]})], "line 1: missing field(s) category"),
    ([json.dumps({"question_id": 1, "category": "qa", "turns": []})], "line 1: 'turns' must be"),
    (["", json.dumps([1, 2])], "line 2: expected a JSON object"),
    ([""], "no questions"),
    ([json.dumps({"question_id": 1, "category": "qa", "turns": ["a"]})] * 2, "appears more than once"),
])
def test_bad_files_name_the_line(tmp_path, lines, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bench.parse_questions(_write(tmp_path / "bad.jsonl", lines))
    with pytest.raises(InputError, match="not found"):
        bench.parse_questions(tmp_path / "missing.jsonl")


def test_run_resume_and_outputs(tiny_spec_stack, tmp_path):
    spec = tiny_spec_stack
    qs = [bench.Question("a", "writing", ("Hi there", "And then?")), bench.Question("b", "qa", ("Why?",))]
    out = tmp_path / "out"
    results = bench.run([str(spec)], qs, out, max_new_tokens=8, progress=False)
    assert results["exact"] and set(results["stacks"]) == {"baseline", "spec"}
    overall = results["stacks"]["spec"]["overall"]
    for key in ("mean_accepted_length", "mean_shortlist_size", "tokens_per_second", "speedup", "prompts",
                "new_tokens", "exact", "shortlist_size_per_depth"):
        assert key in overall
    assert set(results["stacks"]["spec"]) == {"multi-turn conversation", "qa", "overall"}
    lines = (out / "spec.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    choice = record["choices"][0]
    assert len(choice["turns"]) == 2 and len(choice["new_tokens"]) == 2 and len(choice["wall_time"]) == 2
    assert all(isinstance(a, int) for a in choice["accept_lengths"])
    for name in ("results.json", "results.md", "accepted_length_per_category.png",
                 "accepted_length_vs_shortlist.png", "shortlist_size_per_depth.png"):
        assert (out / name).stat().st_size > 0
    # resumption: a finished answer is not redone; a torn last line is ignored and redone
    with (out / "spec.jsonl").open("w") as fh:
        fh.write(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    bench.run([str(spec)], qs, out, max_new_tokens=8, progress=False)
    again = [json.loads(x) for x in (out / "spec.jsonl").read_text().splitlines() if x.strip().endswith("}")]
    assert [r["question_id"] for r in again] == ["a", "b"] and again[0]["tstamp"] == record["tstamp"]


def test_mismatch_is_reported():
    recs = {"baseline": [{"question_id": "a", "category": "qa", "token_ids": [[1, 2]],
                          "choices": [{"new_tokens": [2], "wall_time": [1.0], "accept_lengths": []}]}],
            "spec": [{"question_id": "a", "category": "qa", "token_ids": [[1, 3]],
                      "choices": [{"new_tokens": [2], "wall_time": [0.5], "accept_lengths": [2]}]}]}
    results = bench.summarise(recs, greedy=True)
    assert not results["exact"] and not results["stacks"]["spec"]["overall"]["exact"]
    assert results["stacks"]["spec"]["overall"]["speedup"] == pytest.approx(2.0)
    assert "MISMATCH" in bench.markdown(results)


def test_repeat_keeps_each_answers_median_run_and_checks_the_repeats(tiny_spec_stack, tmp_path):
    qs = [bench.Question("a", "qa", ("Hi there",)), bench.Question("b", "qa", ("Why?",))]
    results = bench.run([str(tiny_spec_stack)], qs, tmp_path / "out", max_new_tokens=8, progress=False, repeat=3)
    assert results["exact"] and results["setup"]["repeat"] == 3
    for name in ("baseline", "spec"):
        records = [json.loads(x) for x in (tmp_path / "out" / f"{name}.jsonl").read_text().splitlines()]
        assert [r["question_id"] for r in records] == ["a", "b"]  # one record a question, not three
        for r in records:
            times = [sum(t) for t in r["repeat_wall_times"]]
            assert len(times) == 3 and r["repeats_identical"]
            assert sum(r["choices"][0]["wall_time"]) == sorted(times)[1]  # the median run's own times
    with pytest.raises(bench.ConfigError, match="repeat 0"):
        bench.run([str(tiny_spec_stack)], qs, tmp_path / "bad", max_new_tokens=8, progress=False, repeat=0)


def test_median_run_and_repeats_that_differ_are_not_exact():
    def rec(ids, wall):
        return {"question_id": "a", "category": "qa", "token_ids": [ids],
                "choices": [{"new_tokens": [len(ids)], "wall_time": [wall], "accept_lengths": [1]}]}

    chosen = bench.median_run([rec([1, 2], 3.0), rec([1, 2], 1.0), rec([1, 2], 2.0), rec([1, 2], 9.0)])
    assert chosen["choices"][0]["wall_time"] == [2.0] and chosen["repeats_identical"]
    base = bench.median_run([rec([1, 2], 1.0), rec([1, 2], 1.2)])
    differs = bench.median_run([rec([1, 2], 0.5), rec([1, 3], 0.6)])
    assert not differs["repeats_identical"]
    results = bench.summarise({"baseline": [base], "spec": [differs]}, greedy=True)
    assert not results["exact"] and results["stacks"]["spec"]["overall"]["speedup"] == pytest.approx(2.0)
