"""Triton kernels of the ``triton`` backend (imported only when the backend runs)."""

import triton
import triton.language as tl


@triton.jit
def _gathered_tile(h_ptr, w_ptr, ids_ptr, R, N, D, stride_h, stride_w,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   IEEE: tl.constexpr):
    """Logits of this program's tile: rows ``BLOCK_R`` of hidden x ``BLOCK_N`` gathered head rows,
    one ``tl.dot`` per ``BLOCK_D`` slice (tensor cores; inputs in the weight's dtype, float32
    accumulation). ``IEEE``: the inputs go to float32 and the product stays out of TF32 (float32
    weights, and Triton's CPU interpreter, whose bfloat16 dot is wrong; a bfloat16 product is exact
    in float32, so only the order of the sums differs)."""
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_n = offs_n < N
    mask_r = offs_r < R
    rows = tl.load(ids_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        w = tl.load(w_ptr + rows[:, None] * stride_w + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        h = tl.load(h_ptr + offs_r[:, None] * stride_h + offs_d[None, :],
                    mask=mask_r[:, None] & mask_d[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(h, tl.trans(w))
    return acc, offs_r, offs_n, mask_r, mask_n


@triton.jit
def gather_gemm(h_ptr, w_ptr, ids_ptr, out_ptr, R, N, D, stride_h, stride_w, stride_o,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    acc, offs_r, offs_n, mask_r, mask_n = _gathered_tile(h_ptr, w_ptr, ids_ptr, R, N, D, stride_h, stride_w,
                                                         BLOCK_R, BLOCK_N, BLOCK_D, IEEE)
    tl.store(out_ptr + offs_r[:, None] * stride_o + offs_n[None, :], acc,
             mask=mask_r[:, None] & mask_n[None, :])


@triton.jit
def gather_gemm_max(h_ptr, w_ptr, ids_ptr, max_ptr, arg_ptr, lse_ptr, R, N, D, stride_h, stride_w,
                    n_blocks, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    IEEE: tl.constexpr):
    """Epilogue variant: per (row, block) the max logit, its column and the block's log-sum-exp."""
    acc, offs_r, offs_n, mask_r, mask_n = _gathered_tile(h_ptr, w_ptr, ids_ptr, R, N, D, stride_h, stride_w,
                                                         BLOCK_R, BLOCK_N, BLOCK_D, IEEE)
    acc = tl.where(mask_n[None, :], acc, float("-inf"))
    block_max = tl.max(acc, axis=1)
    block_arg = tl.argmax(acc, axis=1) + tl.program_id(0) * BLOCK_N
    block_sum = tl.sum(tl.exp(acc - block_max[:, None]), axis=1)
    out = offs_r * n_blocks + tl.program_id(0)
    tl.store(max_ptr + out, block_max, mask=mask_r)
    tl.store(arg_ptr + out, block_arg, mask=mask_r)
    tl.store(lse_ptr + out, tl.log(block_sum) + block_max, mask=mask_r)
