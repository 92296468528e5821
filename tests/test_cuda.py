"""On a CUDA GPU: the Triton kernels compiled for the GPU (not interpreted) against torch at the
built-in targets' head shapes, and greedy exactness of the engine with the target on the GPU for
each draft-head backend. Every test skips where no CUDA GPU is visible (CI's machines)."""

from __future__ import annotations

import pytest
import torch

from dynaspec.plugins.torch_backend import TorchBackend
from dynaspec.runtime.types import Shortlist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("shape", [(262144, 640), (151936, 896)], ids=["gemma3-head", "qwen2.5-head"])
@pytest.mark.parametrize("rows", [1, 6, 16])
def test_compiled_triton_kernel_matches_torch_at_head_shapes(shape, rows):
    pytest.importorskip("triton")
    from dynaspec.plugins.triton_backend import TritonBackend

    vocab, d = shape
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(vocab, d, generator=gen) * d ** -0.5).to("cuda", torch.bfloat16)
    hidden = torch.randn(rows, d, generator=gen).cuda()
    backend, ref = TritonBackend(weight), TorchBackend(weight)
    perm = torch.randperm(vocab, generator=gen).cuda()
    for shortlist in [Shortlist.full(), Shortlist(perm[:16384]), Shortlist(perm[:1000].sort().values),
                      Shortlist(perm[:1])]:
        got, want = backend.logits(hidden, shortlist), ref.logits(hidden, shortlist).float()
        assert got.shape == want.shape and got.device.type == "cuda"
        assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)
        best, token, lse = backend.max_logit(hidden, shortlist)
        ids = torch.arange(vocab, device="cuda") if shortlist.token_ids is None else shortlist.token_ids
        # the kernel's maximum is the reference's maximum (to bf16 product rounding), and its token
        # scores that maximum in the reference: an argmax up to ties closer than the rounding
        assert torch.allclose(best, want.max(-1).values, atol=2e-2, rtol=2e-2)
        position = (ids.view(1, -1) == token.view(-1, 1)).float().argmax(-1)
        assert torch.equal(ids[position], token)
        picked = want.gather(1, position.view(-1, 1)).squeeze(1)
        assert torch.all(want.max(-1).values - picked <= 2e-2)
        assert torch.allclose(lse, torch.logsumexp(want, -1), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_engine_on_the_gpu_is_exact_or_says_why_not(backend, mode):
    """A chain requires exact output: on a GPU whose float32 products change with the number of
    rows computed together (the H200's cuBLAS did for the tiny target's lean products), the engine
    refuses the stack and names those products; run with ``exact = "observed"`` it must still give
    plain decoding's tokens on these prompts. A tree is "observed" by default."""
    if backend == "triton":
        pytest.importorskip("triton")
    import copy

    from conftest import builtin_registry, trained_drafter
    from dynaspec.errors import ConfigError
    from dynaspec.plugins.tiny import tiny_target
    from dynaspec.runtime.config import stack_from_mapping
    from dynaspec.runtime.engine import Engine

    target = tiny_target("llama").to(dtype=torch.float32, device=torch.device("cuda"))
    draft = {"mode": "chain", "depth": 3} if mode == "chain" else {"mode": "tree", "depth": 3, "topk": 2,
                                                                    "total_tokens": 6}
    fields = {"name": "gpu", "target": "tiny-llama", "drafter": "in-memory", "backend": backend,
              "device": "cuda", "dtype": "float32", "draft": draft}
    drafter = copy.deepcopy(trained_drafter("llama")).to("cuda")
    try:
        engine = Engine.from_stack(stack_from_mapping(fields), target=target, drafter=drafter,
                                   registry=builtin_registry())
    except ConfigError as refused:
        assert mode == "chain" and "depend on how many are computed together" in str(refused)
        engine = Engine.from_stack(stack_from_mapping({**fields, "exact": "observed"}), target=target,
                                   drafter=drafter, registry=builtin_registry())
    plain = Engine.from_stack(stack_from_mapping({"name": "plain", "target": "tiny-llama", "device": "cuda",
                                                  "dtype": "float32"}), target=target, registry=builtin_registry())
    gen = torch.Generator().manual_seed(0)
    accepted = 0.0
    for _ in range(4):
        prompt = torch.randint(3, 99, (6,), generator=gen).tolist()
        got = engine.generate(prompt, max_new_tokens=24)
        want = plain.generate(prompt, max_new_tokens=24).token_ids
        assert got.token_ids == want
        hf = target.model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False)
        assert want == hf[0, len(prompt):].tolist()
        accepted += got.stats.mean_accepted_length
    assert accepted / 4 > 1.0  # the drafter was used and some drafts were accepted
    if backend == "triton":
        assert engine.backend.calls > 0
