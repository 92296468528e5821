"""``dynaspec bench``: compare stacks side by side on Spec-Bench-format questions.

Input: Spec-Bench question files (JSON Lines with ``question_id``, ``category``, ``turns`` and an
optional ``reference``) or HumanEval files (``task_id``, ``prompt``; reported as ``code``). With no
file, a small built-in set written for this project is used. The MT-Bench categories are pooled
and reported as ``multi-turn conversation``.

Run: the ``baseline`` stack and every requested stack answer the same questions in one process,
interleaved question by question (so machine noise hits all alike). A second turn is asked after
the first turn and the stack's own first answer. Every greedy stack must reproduce the baseline's
tokens exactly; a mismatch is a failure in the results and the exit status.

Output in DIR: one Spec-Bench answer file per stack (``<stack>.jsonl``: ``choices[0]`` with
``turns``, ``new_tokens``, ``wall_time``, ``accept_lengths``, so Spec-Bench's ``speed.py`` reads
it), ``results.json``, ``results.md`` and three PNG plots. Answer files are appended line by line
and flushed, so a rerun with the same DIR skips what finished and Ctrl-C loses nothing finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs

from dynaspec.errors import ConfigError, InputError

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
MULTI_TURN = "multi-turn conversation"


@attrs.frozen
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


def report_category(category: str) -> str:
    return MULTI_TURN if category in MT_BENCH else category


def parse_questions(path: str | Path | None) -> list[Question]:
    """Questions from a Spec-Bench or HumanEval JSONL file (the built-in set when ``path`` is None)."""
    if path is None:
        text = resources.files("dynaspec").joinpath("bench_questions.jsonl").read_text(encoding="utf-8")
        name = "built-in questions"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError(f"question file not found: {path}") from None
        name = str(path)
    out: list[Question] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{name}, line {lineno}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{name}, line {lineno}: expected a JSON object")
        if "task_id" in obj and "prompt" in obj:  # HumanEval
            if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                raise InputError(f"{name}, line {lineno}: 'prompt' must be a non-empty string")
            out.append(Question(str(obj["task_id"]), "code", (obj["prompt"],)))
            continue
        missing = [k for k in ("question_id", "category", "turns") if k not in obj]
        if missing:
            raise InputError(f"{name}, line {lineno}: missing field(s) {', '.join(missing)} "
                             "(Spec-Bench: question_id, category, turns; HumanEval: task_id, prompt)")
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise InputError(f"{name}, line {lineno}: 'turns' must be a non-empty list of non-empty strings")
        out.append(Question(str(obj["question_id"]), str(obj["category"]), tuple(turns)))
    if not out:
        raise InputError(f"{name}: no questions")
    ids = [q.question_id for q in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InputError(f"{name}: question_id {dup!r} appears more than once")
    return out


def select(questions: Sequence[Question], limit_per_category: int | None) -> list[Question]:
    if not limit_per_category:
        return list(questions)
    seen: dict[str, int] = defaultdict(int)
    out = []
    for q in questions:
        if seen[q.category] < limit_per_category:
            seen[q.category] += 1
            out.append(q)
    return out


def _read_answers(path: Path) -> dict[str, dict[str, Any]]:
    """Finished answers by question id; a torn last line (a crash mid-write) is ignored."""
    out: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return out
    text = path.read_text(encoding="utf-8")
    good = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[str(obj["question_id"])] = obj
        good.append(line)
    clean = "".join(line + "\n" for line in good)
    if clean != text:  # drop the torn line so later appends start on a fresh line
        from dynaspec.runtime.files import atomic_write

        atomic_write(path, lambda p: Path(p).write_text(clean, encoding="utf-8"))
    return out


def _append(path: Path, obj: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def answer(engine, question: Question, *, max_new_tokens: int, temperature: float, seed: int,
           prompt_format) -> dict[str, Any]:
    """All turns of one question; the Spec-Bench answer record (plus token ids and shortlist sizes)."""
    from dynaspec.evaluation.degenerate import repeat_fraction
    from dynaspec.evaluation.evaluate import result_row

    context = ""
    turns, new_tokens, wall, accept, ids, depth_sizes = [], [], [], [], [], defaultdict(list)
    rows = []
    for k, turn in enumerate(question.turns):
        context = prompt_format(turn) if k == 0 else f"{context}{turns[-1]}\n{prompt_format(turn)}"
        result = engine.generate(context, max_new_tokens=max_new_tokens, temperature=temperature,
                                 seed=seed + k)
        s = result.stats
        turns.append(result.text)
        new_tokens.append(s.new_tokens)
        wall.append(s.wall_time)
        accept.extend(s.accepted_lengths)
        ids.append(result.token_ids)
        rows.append({**result_row(s), "repeat_fraction": repeat_fraction(result.prompt_ids, result.token_ids)})
        for depth, sizes in s.shortlist_sizes.items():
            depth_sizes[str(depth)].extend(sizes)
    return {"question_id": question.question_id, "category": question.category,
            "answer_id": f"{engine.stack.name}-{question.question_id}", "model_id": engine.stack.name,
            "choices": [{"index": 0, "turns": turns, "new_tokens": new_tokens, "wall_time": wall,
                         "accept_lengths": accept}],
            "tstamp": time.time(), "token_ids": ids, "turn_stats": rows,
            "shortlist_per_depth": {d: sum(v) / len(v) for d, v in depth_sizes.items() if v}}


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Of one question's repeated answers by one stack, the run whose total time is the median (the
    lower middle one for an even count), with every run's turn times beside it
    (``repeat_wall_times``) and whether all the runs gave the same tokens (``repeats_identical``:
    greedy runs must)."""
    if len(runs) == 1:
        return runs[0]
    by_time = sorted(runs, key=lambda r: sum(r["choices"][0]["wall_time"]))
    return {**by_time[(len(by_time) - 1) // 2],
            "repeat_wall_times": [r["choices"][0]["wall_time"] for r in runs],
            "repeats_identical": all(r["token_ids"] == runs[0]["token_ids"] for r in runs)}


def run(stack_refs: Sequence[str], questions: Sequence[Question], out: Path, *, max_new_tokens: int = 64,
        temperature: float = 0.0, seed: int = 0, progress: bool = True, target=None,
        overrides: dict[str, Any] | None = None, repeat: int = 1) -> dict[str, Any]:
    """Answer every question with the baselines and the stacks (interleaved), then summarise.
    ``repeat``: each question is answered that many times by every stack, interleaved (A B A B),
    and the run of median time is kept (:func:`median_run`): a short answer takes a second, and
    one slow moment of a shared machine moves its figure by a third."""
    from tqdm import tqdm

    if repeat < 1:
        raise ConfigError(f"repeat {repeat}: at least 1")
    from dynaspec.evaluation.cost_model import read_bandwidth, weight_bytes
    from dynaspec.evaluation.evaluate import build_engines

    out.mkdir(parents=True, exist_ok=True)
    engines, reference_of = build_engines(stack_refs, overrides, target)
    bandwidth = read_bandwidth()
    files = {name: out / f"{name}.jsonl" for name in engines}
    done = {name: _read_answers(path) for name, path in files.items()}
    todo = [(q, name) for q in questions for name in engines if q.question_id not in done[name]]
    bar = tqdm(total=len(todo) * repeat, desc="bench", unit="answer", file=sys.stderr, disable=not progress)
    try:
        for q in questions:
            pending = [name for name in engines if q.question_id not in done[name]]
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in pending}
            for _ in range(repeat):
                for name in pending:
                    engine = engines[name]
                    runs[name].append(answer(engine, q, max_new_tokens=max_new_tokens, temperature=temperature,
                                             seed=seed, prompt_format=engine.target.format_prompt))
                    if repeat == 1:  # written at once: an interrupted run keeps it
                        _append(files[name], runs[name][0])
                        done[name][q.question_id] = runs[name][0]
                    bar.update(1)
            for name in pending if repeat > 1 else ():
                done[name][q.question_id] = median_run(runs[name])
                _append(files[name], done[name][q.question_id])
    finally:
        bar.close()
    records = {name: [done[name][q.question_id] for q in questions] for name in engines}
    results = summarise(records, greedy=temperature == 0, reference_of=reference_of)
    results["setup"] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "repeat": repeat,
                        "questions": len(questions), "stacks": list(engines), "baselines": reference_of}
    weights = {n: weight_bytes(e.target) for n, e in engines.items()}
    results["machine"] = {"read_bandwidth": bandwidth, "weight_bytes": weights}
    results["cost"] = cost_of(records, reference_of, bandwidth, weights)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    plots(results, out)
    return results


def _aggregate(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    records = list(records)
    accepted = [a for r in records for a in r["choices"][0]["accept_lengths"]]
    tokens = sum(sum(r["choices"][0]["new_tokens"]) for r in records)
    wall = sum(sum(r["choices"][0]["wall_time"]) for r in records)
    per_depth: dict[str, list[float]] = defaultdict(list)
    for r in records:
        for d, v in r.get("shortlist_per_depth", {}).items():
            per_depth[d].append(v)
    depth_means = {d: sum(v) / len(v) for d, v in sorted(per_depth.items(), key=lambda kv: int(kv[0]))}
    from dynaspec.evaluation.degenerate import is_degenerate
    from dynaspec.evaluation.evaluate import acceptance_per_position

    turns = [t for r in records for t in r.get("turn_stats", []) if "repeat_fraction" in t]
    return {"prompts": len(records), "new_tokens": tokens,
            # answers (turns) repeating half their 4-grams or more (dynaspec.evaluation.degenerate)
            "degenerate": sum(is_degenerate(t["repeat_fraction"]) for t in turns), "answers": len(turns),
            "mean_accepted_length": sum(accepted) / len(accepted) if accepted else 1.0,
            "acceptance_per_position": acceptance_per_position(t for r in records for t in r.get("turn_stats", [])),
            "tokens_per_second": tokens / wall if wall else 0.0,
            "mean_shortlist_size": sum(depth_means.values()) / len(depth_means) if depth_means else 0.0,
            "shortlist_size_per_depth": depth_means}


def cost_of(records: dict[str, list[dict[str, Any]]], reference_of: dict[str, str], bandwidth: float,
            weights: dict[str, int]) -> dict[str, Any]:
    """The cost model of every stack (:mod:`dynaspec.evaluation.cost_model`), from answers that kept their
    per-turn statistics (answers written by older versions lack them and are left out)."""
    from dynaspec.evaluation.cost_model import cost_figures

    turns = {n: [t for r in recs for t in r.get("turn_stats", [])] for n, recs in records.items()}
    return {n: cost_figures(turns[n], turns[reference_of[n]], bandwidth=bandwidth, weights=weights[n])
            for n in records if turns[n] and turns[reference_of[n]]}


def summarise(records: dict[str, list[dict[str, Any]]], *, greedy: bool,
              reference_of: dict[str, str] | None = None) -> dict[str, Any]:
    reference_of = reference_of or {name: "baseline" for name in records}
    out: dict[str, Any] = {"stacks": {}, "greedy": greedy}
    for name, recs in records.items():
        base = {r["question_id"]: r for r in records[reference_of[name]]}
        groups: dict[str, list] = defaultdict(list)
        for r in recs:
            groups[report_category(r["category"])].append(r)
        per_cat = {}
        for cat, rs in sorted(groups.items()) + [("overall", recs)]:
            agg = _aggregate(rs)
            base_agg = _aggregate(base[r["question_id"]] for r in rs)
            agg["speedup"] = (agg["tokens_per_second"] / base_agg["tokens_per_second"]
                              if base_agg["tokens_per_second"] else 0.0)
            # sampled outputs are not compared token for token (None: not checked)
            # (and every repeat of an answer gave the same tokens, the baseline's too)
            agg["exact"] = all(r["token_ids"] == base[r["question_id"]]["token_ids"] and
                               r.get("repeats_identical", True) and
                               base[r["question_id"]].get("repeats_identical", True) for r in rs) if greedy else None
            per_cat[cat] = agg
        out["stacks"][name] = per_cat
    out["exact"] = all(c["exact"] is not False for s in out["stacks"].values() for c in s.values())
    out["checked"] = greedy and len(records) > len(set(reference_of.values()))
    return out


def _median_note(results: dict[str, Any]) -> str:
    repeat = results.get("setup", {}).get("repeat", 1)
    return f", each answer the median of {repeat} runs" if repeat > 1 else ""


def markdown(results: dict[str, Any]) -> str:
    stacks = results["stacks"]
    cats = sorted({c for s in stacks.values() for c in s if c != "overall"}) + ["overall"]
    lines = []
    for title, key, fmt in (("Mean accepted length", "mean_accepted_length", "{:.2f}"),
                            ("Mean shortlist size (tokens)", "mean_shortlist_size", "{:,.0f}"),
                            ("Speed-up against baseline (tokens/s ratio)" + _median_note(results), "speedup", "{:.2f}x")):
        lines += [f"### {title}", "", "| stack | " + " | ".join(cats) + " |",
                  "|---|" + "---|" * len(cats)]
        for name, per in stacks.items():
            cells = [fmt.format(per[c][key]) if c in per else "-" for c in cats]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    from dynaspec.runtime.stats import format_acceptance

    lines += ["### Degenerate answers", "",
              "Answers (turns) at least half of whose 4-grams repeat earlier text of the prompt or the answer "
              "(dynaspec.evaluation.degenerate): easy to draft, so speed on them flatters a drafter.", "",
              "| stack | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for name, per in stacks.items():
        cells = [f"{per[c].get('degenerate', '-')}/{per[c].get('answers', '-')}" if c in per else "-" for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += ["### Acceptance per draft position (overall)", "",
              "For each draft position, the fraction of the drafts reaching it whose token there was accepted.", "",
              "| stack | acceptance per draft position |", "|---|---|"]
    lines += [f"| {name} | {format_acceptance(per['overall'].get('acceptance_per_position', ()))} |"
              for name, per in stacks.items()]
    lines.append("")
    bad = [name for name, per in stacks.items() if per["overall"]["exact"] is False]
    if bad:
        lines.append(f"Exactness: MISMATCH against the baseline: {', '.join(bad)}")
    elif results.get("checked", results.get("greedy", True)):
        lines.append("Exactness: every speculative stack reproduced its baseline token for token.")
    else:
        lines.append("Exactness: not checked token for token (sampling: each stack keeps the target's "
                     "distribution, not its draws)." if not results.get("greedy", True) else
                     "Exactness: no speculative stack ran, nothing to check.")
    if results.get("cost"):
        from dynaspec.evaluation.cost_model import format_cost_table

        machine = results["machine"]
        lines += ["", "### Where the time goes", "",
                  format_cost_table(results["cost"], bandwidth=machine["read_bandwidth"],
                                    weights=machine["weight_bytes"])]
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out: Path) -> None:
    from dynaspec.evaluation.plots import figure

    stacks = results["stacks"]
    cats = sorted({c for s in stacks.values() for c in s if c != "overall"})
    with figure(out / "accepted_length_per_category.png", size=(8, 4), xlabel="",
                ylabel="mean accepted length", legend=True, dpi=110) as ax:
        width = 0.8 / max(len(stacks), 1)
        for i, (name, per) in enumerate(stacks.items()):
            ax.bar([j + i * width for j in range(len(cats))],
                   [per.get(c, {}).get("mean_accepted_length", 0) for c in cats], width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=20, fontsize=8)
    with figure(out / "accepted_length_vs_shortlist.png", xlabel="average shortlist size (tokens)",
                ylabel="mean accepted length", xlog=True, dpi=110) as ax:
        for name, per in stacks.items():
            o = per["overall"]
            if o["mean_shortlist_size"]:
                ax.scatter([o["mean_shortlist_size"]], [o["mean_accepted_length"]])
                ax.annotate(name, (o["mean_shortlist_size"], o["mean_accepted_length"]), fontsize=8)
    with figure(out / "shortlist_size_per_depth.png", xlabel="draft depth",
                ylabel="average shortlist size (tokens)", legend=True, dpi=110) as ax:
        for name, per in stacks.items():
            depth = per["overall"]["shortlist_size_per_depth"]
            if depth:
                ax.plot([int(d) for d in depth], list(depth.values()), marker="o", label=name)
