"""A corpus of the target's own answers, as n-gram continuations (the ``corpus`` drafter's artifact).

Small targets answer in set phrases: "Here's a Python function that", "I hope this helps!", the
same import lines and loop headers. A one-layer drafter catches some of them; a table of what the
target itself wrote after each n-gram, counted over its greedy answers to train prompts, catches
the rest for the price of a dictionary lookup (retrieval drafting, as REST and vLLM's suffix
decoding do it; here from a static table that ``dynaspec prepare`` builds and the package ships).

The table keeps, for every n-gram of the answers (n from ``sizes``) seen at least ``min_count``
times, the token that most often followed it, how often it did, and how often the n-gram occurred.
An n-gram ending in the prompt counts only where the token after it is the answer's: the tail of
the prompt format is context for an answer's first words, never something to propose.

:meth:`CorpusTable.propose` drafts a chain: at each step the longest n-gram of the text's end found
in the table decides, and only where its token followed it at least ``min_count`` times and at
least ``min_share`` of the time; a longest n-gram that the table holds but that fails these stops
the chain (a shorter one would speak for a context the longer one already says is ambiguous).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.artifacts import read_artifact, write_artifact

FORMAT = "dynaspec-corpus/1"
FILE = "corpus.safetensors"


class CorpusTable:
    """For each n-gram size: n-gram (a tuple of ids) -> (the likeliest next id, its count, the
    n-gram's count)."""

    def __init__(self, tables: dict[int, dict[tuple[int, ...], tuple[int, int, int]]]) -> None:
        if not tables:
            raise ConfigError("a corpus table needs at least one n-gram size")
        self.tables = tables
        self.sizes = tuple(sorted(tables, reverse=True))  # longest first

    @classmethod
    def count(cls, answers: Iterable[tuple[Sequence[int], Sequence[int]]], sizes: Sequence[int] = (2, 3, 4),
              min_count: int = 2) -> "CorpusTable":
        """Count the table from ``(prompt, answer)`` id sequences: n-grams whose next token is an
        answer token (the last ``max(sizes)`` prompt tokens may start them)."""
        sizes = tuple(sorted(set(int(n) for n in sizes)))
        if not sizes or sizes[0] < 1:
            raise ConfigError(f"n-gram sizes must be integers >= 1, got {list(sizes)}")
        counts: dict[int, defaultdict] = {n: defaultdict(Counter) for n in sizes}
        longest = sizes[-1]
        for prompt, answer in answers:
            text = [int(t) for t in prompt[-longest:]] + [int(t) for t in answer]
            first = len(text) - len(answer)  # index of the answer's first token
            for i in range(first, len(text)):
                for n in sizes:
                    if i >= n:
                        counts[n][tuple(text[i - n:i])][text[i]] += 1
        tables = {}
        for n, table in counts.items():
            kept = {}
            for gram, nexts in table.items():
                total = sum(nexts.values())
                if total >= min_count:
                    token, hits = nexts.most_common(1)[0]
                    kept[gram] = (token, hits, total)
            tables[n] = kept
        return cls(tables)

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def propose(self, text: Sequence[int], limit: int, *, min_count: int, min_share: float) -> list[int]:
        """The chain of at most ``limit`` tokens the table drafts after ``text`` (see the module)."""
        out: list[int] = []
        context = list(text[-self.sizes[0]:])
        while len(out) < limit:
            entry = None
            for n in self.sizes:
                if len(context) >= n:
                    entry = self.tables[n].get(tuple(context[-n:]))
                    if entry is not None:
                        break
            if entry is None:
                break
            token, hits, total = entry
            if hits < min_count or hits < min_share * total:
                break
            out.append(token)
            context = (context + [token])[-self.sizes[0]:]
        return out

    # -- persistence -------------------------------------------------------------------------------
    def save(self, path: str | Path, info: dict[str, Any]) -> Path:
        """Write the table (per size: the n-grams [N, n] int32, and the next id, its count and the
        n-gram's count, [N] int32 each) with ``info`` (provenance, the target's fingerprint)."""
        tensors = {}
        for n, table in self.tables.items():
            grams = sorted(table)
            tensors[f"grams_{n}"] = torch.tensor(grams, dtype=torch.int32).reshape(len(grams), n)
            rows = torch.tensor([table[g] for g in grams], dtype=torch.int32).reshape(len(grams), 3)
            tensors[f"next_{n}"], tensors[f"hits_{n}"], tensors[f"total_{n}"] = rows.unbind(1)
        return write_artifact(path, FILE, FORMAT, tensors, {**info, "sizes": sorted(self.tables),
                                                             "entries": len(self)})

    @classmethod
    def load(cls, path: str | Path, fingerprint: dict[str, Any] | None) -> tuple["CorpusTable", dict[str, Any]]:
        """The table at ``path`` and its info; refuses a table built for another target."""
        tensors, info, _ = read_artifact(path, FILE, FORMAT, what="corpus", fingerprint=fingerprint)
        tables = {}
        for n in info.get("sizes", []):
            grams = tensors[f"grams_{n}"].tolist()
            rows = zip(tensors[f"next_{n}"].tolist(), tensors[f"hits_{n}"].tolist(), tensors[f"total_{n}"].tolist())
            tables[int(n)] = dict(zip(map(tuple, grams), rows))
        return cls(tables), info

