"""``dynaspec generate``: a continuation of one prompt with a stack, streamed to standard output.

Imports only the runtime (never training or evaluation), and checks every input before the model
loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dynaspec.cli.common import command, overrides, positive_int
from dynaspec.errors import InputError

#: the fewest tokens a generation may run for its int8 weights to be moved onto huge pages first:
#: the move costs about 1.7 s on the Xeon AMX machine and saves about 7 ms a target pass, so it pays
#: from some 250 passes on (a drafting stack makes about one pass per two tokens); session 42's
#: 128-token answers ran 1.7 s faster without it, 512-token ones as fast either way
HUGE_PAGES_MIN_TOKENS = 512


def register(sub) -> None:
    gen = command(sub, cmd_generate, "generate", placement=True,
        help="generate a continuation of a prompt with a stack")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt text ('-' reads standard input; or use --prompt-file)")
    gen.add_argument("--prompt-file", metavar="PATH", default=None,
                     help="read the prompt from this UTF-8 file (long prompts exceed the shell's limit)")
    fmt = gen.add_mutually_exclusive_group()
    fmt.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the target's prompt format as one user message; the default for "
                     "an instruction-tuned target (the embedded Qwen2.5-Coder: its chat template, and the answer "
                     "ends at its end-of-turn token). For a base model such as gemma3-270m the wrapper is "
                     "'User: ...\nAssistant:' (the format its drafter was trained on) and the answer ends "
                     "where it would invent the next 'User:' turn")
    fmt.add_argument("--raw", action="store_true",
                     help="pass the prompt to the target as it is, to be continued; the default for a base "
                     "model (gemma3-270m, which completes text rather than answering)")
    gen.add_argument("--stack", default="default", help="stack name or TOML file (default: %(default)s)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                     help="tokens to generate, >= 1 (default: the stack's decode.max_new_tokens, 128 "
                     "for the built-in stacks)")
    gen.add_argument("--temperature", type=float, default=None, metavar="T",
                     help="0 = greedy, exactly the target's greedy output; above 0 samples with the "
                     "target's distribution (default: the stack's, 0 for the built-in stacks)")
    gen.add_argument("--top-p", type=float, default=None, metavar="P",
                     help="nucleus sampling mass, 0 < P <= 1 (default: the stack's, 1.0)")
    gen.add_argument("--seed", type=int, default=None, metavar="S", help="seed for sampling (default 0)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when the output contains TEXT (cut before it); repeatable")
    gen.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a stack field")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")


def _decode_utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"the prompt from {where} is not UTF-8 text (byte {exc.start}: "
                         f"{data[exc.start:exc.start + 1]!r})") from None


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, standard input ('-') or --prompt-file; checked to be
    non-empty UTF-8 text before any model is loaded."""
    if args.prompt_file is not None and args.prompt is not None:
        raise InputError("give the prompt as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            data = Path(args.prompt_file).read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror}") from None
        prompt = _decode_utf8(data, args.prompt_file)
    elif args.prompt == "-":
        prompt = _decode_utf8(sys.stdin.buffer.read(), "standard input")
    elif args.prompt is None:
        raise InputError("no prompt: give it as an argument, '-' for standard input, or --prompt-file")
    else:
        prompt = args.prompt
    if not prompt.strip():
        raise InputError("the prompt is empty")
    return prompt


def wraps_prompt(args: argparse.Namespace, target) -> bool:
    """Whether the prompt goes to ``target`` wrapped in its prompt format as one user message:
    asked for with --chat, refused with --raw, else for instruction-tuned targets only (a base
    model continues the text it is given)."""
    return args.chat or (not args.raw and not target.base_model)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a continuation with speculative decoding. Prints the text, then one statistics
    line on stderr (or one JSON object with --json)."""
    import attrs

    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.registry import default_registry
    from dynaspec.runtime.stacks import resolve_stack
    from dynaspec.runtime.stats import GenerationStats

    # everything that can be checked is checked before the model loads (10-30 s)
    prompt = _read_prompt(args)
    changes = overrides(args)
    if args.seed is not None:
        changes["decode.seed"] = args.seed
    registry = default_registry()
    stack = resolve_stack(args.stack, overrides=changes, registry=registry)
    registry.check_stack(stack)
    decode = attrs.evolve(stack.decode, **{k: v for k, v in (("temperature", args.temperature),
                                                             ("top_p", args.top_p),
                                                             ("max_new_tokens", args.max_new_tokens))
                                           if v is not None})
    if any(not s for s in args.stop):
        raise InputError("--stop needs a non-empty text")
    for plugin in registry.plugins:  # never silent: what a broken plugin provides is missing
        if plugin.error:
            print(f"dynaspec: warning: plugin {plugin.label} failed to load ({plugin.error}); whatever it "
                  "provides is missing", file=sys.stderr)
    # one answer: its weights stay where they are unless it may run long enough to repay the move
    engine = Engine.from_stack(stack, registry=registry, huge_pages=decode.max_new_tokens >= HUGE_PAGES_MIN_TOKENS)
    # the stack as run: its name, and the fields --set changed
    label = stack.name + (f" with {', '.join(args.set)}" if args.set else "")
    stop = list(args.stop)
    if wraps_prompt(args, engine.target):
        prompt = engine.target.format_prompt(prompt)
        # a base model's answer ends where it would start inventing the user's next turn
        stop += [s for s in engine.target.turn_stops if s not in stop]
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, seed=args.seed, stop=stop)
    if args.json:
        result = engine.generate(prompt, **kwargs)
        print(json.dumps({**result.to_json(), "drafter": stack.drafter_label, "weights": engine.target.weights,
                          "set": list(args.set or [])},
                         ensure_ascii=False))
        return 0
    stats = GenerationStats()
    for piece in engine.stream(prompt, stats=stats, **kwargs):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    from dynaspec.runtime.stats import format_acceptance

    shortlist = (f"{stats.mean_shortlist_size:,.0f}" if stats.shortlist_size_per_depth else "-")
    print(f"[{label}] {stats.new_tokens} new tokens, {stats.cycles} cycles, "
          f"mean accepted length {stats.mean_accepted_length:.2f}, mean shortlist {shortlist}, "
          f"{stats.tokens_per_second:.1f} tokens/s, weights {engine.target.weights}", file=sys.stderr)
    if stats.drafted_at:
        print(f"[{label}] acceptance per draft position: {format_acceptance(stats.acceptance_per_position)}",
              file=sys.stderr)
    if stats.exactness != "guaranteed":  # one line, so that a mismatch is never silent
        print(f"[{label}] output equal to plain decoding is not guaranteed: {stats.exactness_reason}",
              file=sys.stderr)
    return 0
