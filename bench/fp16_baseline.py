"""The benchmark's fp16 baseline: the decode kernels' split-KV structure over an unquantized paged cache.

``bench_kernels.py``'s ``fp16_kernel`` variant: one stage 1 per (row, block of query heads, split) over an fp16 or
bf16 cache ``[slots, H_kv, D]``, merged by the product's stage 2 (``triton_kernels.decode_stage2`` without the
certificate). It is not part of the package: it exists to be measured against. No test runs it; the benchmark
checks it against exact attention before timing it (``check_against_exact_attention``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from witcert.kernels import reference
from witcert.kernels.attention import default_num_kv_splits
from witcert.kernels.launch import LAUNCH
from witcert.kernels.triton_kernels import FP32_INF, decode_stage2, split_range

# decode_stage2 takes pointers to six per-split certificate partials and two certificate outputs (the certificate and
# its accumulators); without the certificate it stores none of them, so the LSE buffers stand in.
_STAGE2_PARTIALS, _STAGE2_STATS = 6, 2


@triton.jit
def decode_stage1_fp16(
    Q,
    KCache,
    VCache,
    KvStart,
    KvEnd,
    KvIndices,
    PartOut,
    PartLse,
    stride_qb,
    stride_qh,
    sm_scale,
    NUM_KV_HEADS: tl.constexpr,
    KV_GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """The baseline: the same split-KV structure over an fp16/bf16 paged cache ``[slots, H_kv, D]``."""
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    blocks_per_kv_head: tl.constexpr = (KV_GROUP + BLOCK_H - 1) // BLOCK_H
    kv_head = head_block // blocks_per_kv_head
    local_heads = (head_block % blocks_per_kv_head) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = local_heads < KV_GROUP
    heads = kv_head * KV_GROUP + local_heads
    num_q_heads = NUM_KV_HEADS * KV_GROUP
    kv_start, _, lo, hi, _ = split_range(KvStart, KvEnd, row, split, 2**31 - 1, NUM_SPLITS, BLOCK_N)
    channels = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + channels[None, :], mask=head_ok[:, None], other=0.0)
    running_max = tl.full((BLOCK_H,), -FP32_INF, tl.float32)
    running_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        token_ok = offs < hi
        slots = tl.load(KvIndices + kv_start + offs, mask=token_ok, other=0).to(tl.int64)
        base = slots * NUM_KV_HEADS + kv_head
        k = tl.load(KCache + base[:, None] * HEAD_DIM + channels[None, :], mask=token_ok[:, None], other=0.0)
        logits = tl.dot(q, tl.trans(k)) * sm_scale
        logits = tl.where(token_ok[None, :], logits, -FP32_INF)
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        alpha = tl.exp(running_max - new_max)
        weights = tl.exp(logits - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(weights, axis=1)
        v = tl.load(VCache + base[:, None] * HEAD_DIM + channels[None, :], mask=token_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v)
        running_max = new_max
    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
    part_row = (row * num_q_heads + heads) * NUM_SPLITS + split
    tl.store(PartOut + part_row[:, None] * HEAD_DIM + channels[None, :], acc / safe_sum[:, None], mask=head_ok[:, None])
    lse = tl.where(running_sum == 0, -FP32_INF, running_max + tl.log(safe_sum))
    tl.store(PartLse + part_row, lse, mask=head_ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_attention_fp16(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode of ``q`` ``[B, H_q, D]`` over the paged ``k_cache``, ``v_cache`` ``[slots, H_kv, D]`` (one dtype, fp16
    or bf16), softmax scale ``1 / sqrt(D)``. Returns ``(out, lse)``; ``out`` float32 unless given."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError("q must be [B, H_q, D] and k_cache, v_cache the same [slots, H_kv, D]")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError("q, k_cache and v_cache must share one dtype, float16 or bfloat16")
    rows, num_q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    kv_group = num_q_heads // kv_heads
    block_h = max(16, _pow2(kv_group))
    head_blocks = kv_heads * -(-kv_group // block_h)
    splits = num_kv_splits if num_kv_splits is not None else default_num_kv_splits(rows * head_blocks, q.device)
    sm_scale = reference.softmax_scale(None, head_dim)
    if out is None:
        out = torch.empty(rows, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    part_out = torch.empty(rows, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(rows, num_q_heads, splits, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, num_q_heads, dtype=torch.float32, device=q.device)
    decode_stage1_fp16[(rows, head_blocks, splits)](
        q,
        k_cache,
        v_cache,
        kv_indptr[:-1],
        kv_indptr[1:],
        kv_indices,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        sm_scale,
        NUM_KV_HEADS=kv_heads,
        KV_GROUP=kv_group,
        BLOCK_H=block_h,
        BLOCK_N=LAUNCH.block_n,
        HEAD_DIM=head_dim,
        NUM_SPLITS=splits,
        num_warps=LAUNCH.num_warps,
        num_stages=LAUNCH.num_stages,
    )
    decode_stage2[(rows, num_q_heads)](
        part_out,
        part_lse,
        *(part_lse,) * _STAGE2_PARTIALS,
        out,
        lse,
        *(lse,) * _STAGE2_STATS,
        out.stride(0),
        out.stride(1),
        1.0,
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=splits,
        SPLITS_PAD=max(2, _pow2(splits)),
        CERTIFICATE=False,
    )
    return out, lse


def check_against_exact_attention(device: torch.device | str = "cuda") -> float:
    """The baseline's largest relative output error against float32 attention on two rows (8000 and 100 tokens, 28
    query heads on 4 KV heads); raises ``AssertionError`` above 2e-3 (weights are rounded to fp16 before PV, as in
    any fp16 kernel)."""
    generator = torch.Generator().manual_seed(5)
    k_cache = torch.randn(9000, 4, 128, generator=generator).half().to(device)
    v_cache = torch.randn(9000, 4, 128, generator=generator).half().to(device)
    indptr = torch.tensor([0, 8000, 8100], device=device)
    slots = torch.randperm(9000, generator=generator)[:8100].to(device)
    q = torch.randn(2, 28, 128, generator=generator).half().to(device)
    out, _ = decode_attention_fp16(q, k_cache, v_cache, indptr, slots)
    worst = 0.0
    for row in range(2):
        row_slots = slots[indptr[row] : indptr[row + 1]]
        k = k_cache[row_slots].float().repeat_interleave(7, dim=1)
        v = v_cache[row_slots].float().repeat_interleave(7, dim=1)
        probs = (torch.einsum("hd,shd->hs", q[row].float(), k) / math.sqrt(128)).softmax(-1)
        expected = torch.einsum("hs,shd->hd", probs, v)
        worst = max(worst, float((out[row] - expected).norm() / expected.norm()))
    assert worst < 2e-3, f"the fp16 baseline is off exact attention by {worst:.2e}"
    return worst
