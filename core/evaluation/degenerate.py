"""How degenerate an output is: the share of its 4-grams that repeat text seen before.

An echo of the question or a loop of invented turns is easy to draft, so speed-ups measured on
such outputs flatter a drafter. Every ``eval`` and ``bench`` report therefore says how many of its
outputs are degenerate: for an output of tokens ``y`` after a prompt ``x``, the fraction of the
output's 4-grams (those ending inside the output) that occurred earlier in ``x + y``. An output
with ``DEGENERATE_AT`` or more of them repeated counts as degenerate; an output too short to hold
a 4-gram counts as not.
"""

from __future__ import annotations

from typing import Sequence

NGRAM = 4
DEGENERATE_AT = 0.5


def repeat_fraction(prompt_ids: Sequence[int], output_ids: Sequence[int], n: int = NGRAM) -> float:
    """The fraction of the output's ``n``-grams that occurred earlier in prompt + output (0 when
    the output holds none)."""
    text = [int(t) for t in prompt_ids] + [int(t) for t in output_ids]
    first = max(len(prompt_ids), n - 1)  # the first index at which an output n-gram can end
    seen = {tuple(text[i - n + 1:i + 1]) for i in range(n - 1, first)}
    total = repeated = 0
    for end in range(first, len(text)):
        gram = tuple(text[end - n + 1:end + 1])
        total += 1
        repeated += gram in seen
        seen.add(gram)
    return repeated / total if total else 0.0


def is_degenerate(fraction: float) -> bool:
    return fraction >= DEGENERATE_AT
