"""Built-in verifiers: ``greedy`` and lossless speculative ``sampling``.

Both verify on the target's full-vocabulary logits, so the output is exactly the target's: greedy
output is token-for-token the target's greedy decoding, sampled output has the target's
distribution (temperature and top-p applied to the target as in plain sampling).
"""

from __future__ import annotations

import attrs
import torch

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import NoParams, is_number, param
from dynaspec.runtime.protocols import DecodeParams
from dynaspec.runtime.q8 import argmax
from dynaspec.runtime.registry import Component
from dynaspec.runtime.tree import DraftTree


def sampling_distribution(logits: torch.Tensor, params: DecodeParams) -> torch.Tensor:
    """Probabilities after temperature and top-p (nucleus: the smallest set of most likely tokens
    whose mass reaches ``top_p``), over the last dimension."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class GreedyVerifier:
    """Accept a drafted token while it equals the target's argmax."""

    prunes = True
    argmax_first_token = True

    def first_token(self, logits, params, generator) -> int:
        return argmax(logits)

    def propose(self, logits, k, params, generator):
        k = min(k, logits.shape[-1])
        idx = logits.topk(k, dim=-1).indices
        # log_softmax is one fused kernel where logsumexp is several: a draft step runs after the
        # target's pass, with cold caches, where each kernel costs several times what it does hot
        logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, idx)
        return idx, logq, None

    def verify(self, tree: DraftTree, logits, params, generator):
        path, node = [], 0
        while True:
            best = argmax(logits[node])
            match = [c for c in tree.children.get(node, []) if tree.tokens[c] == best]
            if not match:
                return path, best
            node = match[0]
            path.append(node)


class SamplingVerifier:
    """Lossless speculative sampling with recursive rejection over tree siblings.

    Children of a node are drawn *without replacement* from the draft distribution q (Gumbel
    top-k). Sibling ``c`` is accepted with probability ``min(1, p(c)/q(c))``; on rejection the
    target distribution becomes the residual ``norm(max(p - q, 0))`` and q loses ``c`` and is
    renormalised (exactly the distribution the next sibling was drawn from). If every sibling is
    rejected the bonus token is drawn from the final residual. Each stage is a standard
    speculative-sampling step, so the committed token has the target's distribution.
    """

    prunes = False

    def first_token(self, logits, params, generator) -> int:
        return int(torch.multinomial(sampling_distribution(logits, params), 1, generator=generator))

    def propose(self, logits, k, params, generator):
        q = sampling_distribution(logits, params)
        gumbel = -torch.log(-torch.log(
            torch.rand(q.shape, generator=generator, device=q.device).clamp_(1e-20, 1.0 - 1e-7)))
        keys = torch.log(q) + gumbel  # -inf where q == 0: never drawn
        k = min(k, int((q > 0).sum(-1).min()))
        _, idx = keys.topk(k, dim=-1)
        return idx, torch.log(q.gather(-1, idx)), q

    def verify(self, tree: DraftTree, logits, params, generator):
        path, node = [], 0
        while True:
            p = sampling_distribution(logits[node], params)
            vocab = p.shape[-1]
            kids = tree.children.get(node, [])
            accepted = None
            if kids:
                ids, q_short = tree.draft_probs[node]
                q = q_short.float() if ids is None else torch.zeros(vocab, device=p.device).index_put_(
                    (ids,), q_short.float())
                for child in kids:
                    token = tree.tokens[child]
                    ratio = p[token] / q[token]
                    if torch.rand((), generator=generator, device=p.device) < ratio:
                        accepted = child
                        break
                    residual = (p - q).clamp_(min=0.0)
                    total = residual.sum()
                    p = residual / total if total > 0 else p
                    q = q.clone()
                    q[token] = 0.0
                    q_total = q.sum()
                    if q_total <= 0:
                        break
                    q = q / q_total
            if accepted is None:
                return path, int(torch.multinomial(p, 1, generator=generator))
            path.append(accepted)
            node = accepted


def _greedy(params: NoParams, ctx):
    return GreedyVerifier()


def _sampling(params: NoParams, ctx):
    return SamplingVerifier()


@attrs.frozen
class AutoParams:
    temperature: float = param(0.0, help="the generation's temperature (the engine sets it per generation)",
                               check=lambda v: is_number(v) and v >= 0, rule="must be a number >= 0")


def _auto(params: AutoParams, ctx):
    return GreedyVerifier() if params.temperature == 0 else SamplingVerifier()


@hookimpl
def dynaspec_verifiers():
    return [
        Component("auto", _auto, "greedy at temperature 0, lossless sampling above (the default)",
                  params=AutoParams),
        Component("greedy", _greedy, "accept while the draft equals the target argmax", params=NoParams),
        Component("sampling", _sampling,
                  "lossless speculative sampling, recursive rejection over siblings", params=NoParams),
    ]
