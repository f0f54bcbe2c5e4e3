"""Extend without the certificate on PyTorch's SDPA (cuDNN or FlashAttention), over K/V gathered from the pool.

The tiled extend kernel (``triton_extend``) keeps every operand exact and computes on the CUDA cores what
FlashAttention leaves to the tensor cores; on the H200 it takes 4.6-8.9x the time of fp16 SDPA
(docs/KERNELS.md, Extend). Prefill needs no certificate (the SGLang backend asks for none), so this path
trades the exactness for speed instead: ``KVPool.gather`` dequantizes every key and value the batch's
sequences see into dense tensors of the query's dtype (``x_hat`` rounded once), and
``torch.nn.functional.scaled_dot_product_attention`` attends to them, causal with each sequence's queries
aligned to the end of its keys: one batched call per run of consecutive sequences of equal shape
(``extend_bounds.equal_runs``; a batch of equal prompts is one call). It computes the same attention over the
same dequantized values, rounded as any fp16 or bf16 attention is (``x_hat`` to the query dtype, the weights
before PV): the H200 test holds it within 4e-3 (fp16) and 2e-2 (bf16) relative of the float32 reference, where
the exact kernels reach 1e-5. No LSE comes back.

Each SDPA call costs host time (about 0.05 ms; 64 mixed prompts of about 128 tokens, one call each: 3.9 ms on
the H200), so a batch of more than ``LAUNCH.extend_sdpa_max_calls`` (3) runs goes to FlashAttention 2's varlen
kernel in one call instead (``torch.nn.attention.varlen.varlen_attn``; on PyTorch 2.11, whose ``varlen_attn``
has no ``enable_gqa``, the aten op under it, which takes fewer KV heads than query heads). For one long
sequence varlen is the slower (a 16k-token prompt 6.1 against 3.5 ms): cuDNN's kernel is faster there.

Runs on CUDA devices of compute capability 8.0 or newer, queries in the pool's dtype (fp16 or bf16),
head_dim up to 256, where one sequence's gathered K and V fit ``LAUNCH.extend_sdpa_max_bytes``; ``covers`` and
``fits`` decide.
An fp16 key within 1% of fp16's largest value can dequantize past it (``x_hat`` reaches ``127.5 s`` with
``s >= amax / 126.5``); it then becomes inf and the rows that see it NaN, where the exact kernels, which
keep logits in float32, still compute them.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from witcert.kernels.extend_bounds import EqualRun, ExtendBounds
from witcert.kernels.launch import LAUNCH
from witcert.kernels.pool import KVPool

try:
    from torch.nn.attention import varlen as _varlen
except ImportError:  # PyTorch before 2.9
    _varlen = None


class Chunk(NamedTuple):
    """Consecutive sequences of the batch with their gathered K/V: the offsets on the host (counted from the
    chunk's first row and key) and on the device."""

    keys: torch.Tensor
    values: torch.Tensor
    bounds: ExtendBounds
    indptrs: tuple[torch.Tensor, torch.Tensor]


def covers(q: torch.Tensor, pool: KVPool) -> bool:
    """Whether extend without the certificate can take this path (``LAUNCH.extend_sdpa`` and the limits above;
    ``fits`` then checks the longest sequence)."""
    if not LAUNCH.extend_sdpa or q.device.type != "cuda" or q.shape[0] == 0:
        return False
    # The model's own dtype only: a bf16 pool's values can exceed fp16's range.
    if q.dtype != pool.dtype or q.shape[2] > 256 or q.shape[2] % 8:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 8


def key_bytes(q: torch.Tensor, pool: KVPool) -> int:
    """Bytes of one gathered key and its value, all KV heads, in q's dtype."""
    return 2 * pool.kv_heads * pool.head_dim * q.element_size()


def fits(q: torch.Tensor, pool: KVPool, bounds: ExtendBounds) -> bool:
    """Whether the longest sequence's gathered K/V fit ``LAUNCH.extend_sdpa_max_bytes`` (a batch is gathered in
    chunks of ``LAUNCH.extend_sdpa_chunk_bytes``, but one sequence at once)."""
    return bounds.longest[1] * key_bytes(q, pool) <= LAUNCH.extend_sdpa_max_bytes


def attend(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    bounds: ExtendBounds,
    indptrs: tuple[torch.Tensor, torch.Tensor],
    kv_indices: torch.Tensor,
    *,
    sm_scale: float,
) -> torch.Tensor:
    """``out`` ``[T, H_q, D]`` in q's dtype. ``bounds`` are the offsets on the host, checked against this call
    by ``extend_attention`` (the attention kernels trust them); ``indptrs`` the same offsets on the device. A
    slot out of the pool's range makes the rows that see it NaN (``KVPool.gather``).

    The K/V of consecutive sequences are gathered at most ``LAUNCH.extend_sdpa_chunk_bytes`` at a time
    (``bounds.chunks``; one chunk in all but large batches), which bounds the transient memory the engine's
    planner does not know about. In a chunk, consecutive sequences with the same numbers of new and seen
    tokens share one batched SDPA call (``bounds.runs``); more than ``LAUNCH.extend_sdpa_max_calls`` such runs
    take one FlashAttention 2 varlen call instead, where this PyTorch has it."""
    q = q if q.stride(2) == 1 else q.contiguous()
    chunks = bounds.chunks(max(1, LAUNCH.extend_sdpa_chunk_bytes // key_bytes(q, pool)))
    if len(chunks) == 1:
        keys, values = pool.gather(layer, kv_indices, q.dtype, validate=False)
        return _attend_chunk(q, Chunk(keys, values, bounds, indptrs), sm_scale)
    out = torch.empty_like(q)
    for first, end in chunks:
        part = bounds.part(first, end)
        q_lo, kv_lo = bounds.qo_indptr[first], bounds.kv_indptr[first]
        rows = slice(q_lo, q_lo + part.qo_indptr[-1])
        keys, values = pool.gather(layer, kv_indices[kv_lo : kv_lo + part.kv_indptr[-1]], q.dtype, validate=False)
        part_indptrs = tuple(x[first : end + 1] - x[first] for x in indptrs)
        out[rows] = _attend_chunk(q[rows], Chunk(keys, values, part, part_indptrs), sm_scale)
    return out


def _attend_chunk(q: torch.Tensor, chunk: Chunk, scale: float) -> torch.Tensor:
    """The chunk's attention: per run, or varlen."""
    runs = chunk.bounds.runs
    if len(runs) > LAUNCH.extend_sdpa_max_calls and _varlen is not None:
        return _attend_varlen(q, chunk, scale)
    if len(runs) == 1 and runs[0].count * runs[0].new == q.shape[0]:
        return _attend_run(q, chunk, runs[0], scale)  # the whole batch: SDPA's output, not a copy
    out = torch.empty_like(q)
    for run in runs:
        out[run.q_start : run.q_start + run.count * run.new] = _attend_run(q, chunk, run, scale)
    return out


def _attend_run(q: torch.Tensor, chunk: Chunk, run: EqualRun, scale: float) -> torch.Tensor:
    """The run's rows of ``out``, ``[count * new, H_q, D]``, from one batched SDPA call."""
    q_rows = slice(run.q_start, run.q_start + run.count * run.new)
    kv_rows = slice(run.kv_start, run.kv_start + run.count * run.seen)
    # New token i of n sees the first S - n + i + 1 keys: the causal mask aligned bottom-right, which is the
    # plain causal mask when the sequence has no prefix.
    mask = {"is_causal": True} if run.new == run.seen else {"attn_mask": causal_lower_right(run.new, run.seen)}
    attended = F.scaled_dot_product_attention(
        _batched(q[q_rows], run.count),
        _batched(chunk.keys[kv_rows], run.count),
        _batched(chunk.values[kv_rows], run.count),
        scale=scale,
        enable_gqa=True,
        **mask,
    )
    return attended.transpose(1, 2).reshape(-1, *q.shape[1:])


def _batched(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``[count * n, H, D]`` rows of ``count`` sequences as SDPA's ``[count, H, n, D]`` (a view)."""
    return rows.unflatten(0, (count, -1)).transpose(1, 2)


def _attend_varlen(q: torch.Tensor, chunk: Chunk, scale: float) -> torch.Tensor:
    """The whole chunk in one FlashAttention 2 varlen call (causal aligned bottom-right), which costs less than
    one SDPA call per run once there are many of them."""
    keys, values = chunk.keys, chunk.values
    qo_indptr, kv_indptr = (x.to(torch.int32) for x in chunk.indptrs)
    lengths = chunk.bounds.longest
    if "enable_gqa" in _VARLEN_PARAMETERS or q.shape[1] == keys.shape[1]:
        gqa = {"enable_gqa": True} if "enable_gqa" in _VARLEN_PARAMETERS else {}
        return _varlen.varlen_attn(q, keys, values, qo_indptr, kv_indptr, *lengths, scale=scale, **_CAUSAL, **gqa)
    # PyTorch 2.11's varlen_attn has no enable_gqa, though the FlashAttention 2 op under it takes fewer KV heads
    # than query heads: call that op, rather than repeat K and V per query head (0.12 of 0.30 ms at 64 prompts
    # of about 128 tokens on the H200, bench/results/extend_sdpa_profile_h200.txt).
    return torch.ops.aten._flash_attention_forward(
        q, keys, values, qo_indptr, kv_indptr, *lengths, 0.0, True, False, scale=scale
    )[0]


_VARLEN_PARAMETERS = inspect.signature(_varlen.varlen_attn).parameters if _varlen is not None else {}
# PyTorch 2.11 names the causal mask by its window; older releases take is_causal.
_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else {"is_causal": True}
