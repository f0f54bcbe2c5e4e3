"""Copy-only kernels on the KV pool's paged layout: which memory mechanism reaches the copy bandwidth.

Every kernel here reads exactly what the int8 decode stage 1 reads for one layer (per (row, KV head, split)
program: the K and V code rows of its tokens, 128 bytes each, their fp16 group scales, 8 bytes each, and the
slot indices) and does nothing with it but a wrapping int32 sum, which the host checks against torch. So its
time is the memory pipeline's alone. The mechanisms:

* ``ldg_128`` / ``ldg_256``: Triton, 128 or 256 tokens a loop iteration loaded into registers by 16-byte loads
  (Triton 3.6 and 3.9 do not pipeline these loads: no ``cp.async`` in the PTX);
* ``cpasync``: Gluon, every thread copies its own 16-byte pieces with ``cp.async`` into a ring of ``STAGES`` tiles
  and reads them back after ``wait_group`` (the current decode kernel's mechanism, with 16-byte copies instead of
  8 and a deeper ring);
* ``ws_cpasync``: warp-specialised, one producer warp copies with ``cp.async`` and signals a full-barrier per stage
  (``cp.async.mbarrier.arrive.noinc``); four consumer warps wait on it, read, and free the stage (empty-barrier);
* ``ws_tma_page``: warp-specialised, the producer issues Hopper TMA copies (``cp.async.bulk.tensor``), one box of
  16 slots per page and side (codes ``[16, 128 B]`` of one head; scales ``[16, 32 B]``, all four heads' scales of
  a slot, the 32-byte sector DRAM reads anyway), completing on the stage's barrier by transaction count; pools
  of 16-slot pages only (the page's slots must be consecutive, as SGLang allocates them);
* ``ws_tma_token``: the same with one TMA box per token (any slot order: page size 1).

Splits (``--waves``) set how many programs each SM gets: at small batch the (row, KV head) units alone leave
most SMs idle, and split-KV partitioning fills them. The ceiling is a device-to-device copy (``torch``, bytes
read plus bytes written over time, as the decode benchmark counts it); ``read_sum`` is a read-only reduction
(``torch.sum`` over float32), for scale.
Each family of mechanisms runs in a process of its own (``--isolate``), so that one that faults on the device
(a misaligned TMA box, say) or hangs costs only its own rows.

Run on the GPU: ``python bench/lab/copy_mechanisms.py --output bench/results/copy_mechanisms_h200.json``.
Without a GPU, ``--compile-only`` compiles every Gluon variant for sm_90 (Triton 3.6 or 3.9, whichever is on
the path) and prints its shared memory and spills.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

HEAD_DIM = 128
GROUPS = 4
WORDS = HEAD_DIM // 4  # int32 words of one token's codes for one head
SCALE_WORDS = GROUPS * 2 // 4  # int32 words of its four fp16 scales
BLOCK = 128  # tokens per tile, as the decode stage 1
PAGE = 16
NUM_WARPS = 4
# Triton 3.9 renamed these.
_async_load = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

# Consumers read a [128, 32] int32 tile 16 bytes a thread, a warp four rows of 128 bytes.
_TILE = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))
_SCALES = gl.constexpr(gl.BlockedLayout([1, 2], [32, 1], [4, 1], [1, 0]))  # [128, 2]: one token a thread
_TMA_SCALES = gl.constexpr(gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0]))  # [128, 8]: all heads' scales
# The producer warp's copies: the same tile, 16 bytes a lane, four rows per instruction.
# Triton pads a warp-specialised kernel to whole warpgroups (setmaxnreg acts per warpgroup), so the cp.async producer
# takes the four warps of one: 16 bytes a lane, 16 rows per instruction.
_PRODUCER_TILE = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))
_PRODUCER_SCALES = gl.constexpr(gl.BlockedLayout([1, 2], [32, 1], [4, 1], [1, 0]))
# The TMA producer is one warp (one elected thread issues); per-token boxes put their scales with cp.async, a token
# per lane, since a TMA box must land 128-byte aligned and a token's scales are 32 bytes.
_LANE_SCALES = gl.constexpr(gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0]))
_PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
_BARRIER = gl.constexpr(mbarrier.MBarrierLayout())
_TMA_CODES = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
_TMA_SCALE_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=32, rank=2))
# One-row boxes cannot land in a swizzled buffer (Gluon slices no swizzle pattern): per-token TMA writes plain rows.
_TMA_ROWS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


@triton.jit
def _split(KvStart, KvLen, row, split, num_splits):
    """``(kv_start, lo, hi)``: split ``split`` of the row's tokens, in whole tiles."""
    kv_start = tl.load(KvStart + row)
    seq_len = tl.load(KvLen + row)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), 128) * 128
    lo = split * split_len
    return kv_start, lo, tl.minimum(lo + split_len, seq_len)


@triton.jit
def _ldg_kernel(
    KCodes, VCodes, KScales, VScales, KvStart, KvLen, KvIndices, Out, num_splits,
    H: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    row, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_start, lo, hi = _split(KvStart, KvLen, row, split, num_splits)
    tok = tl.arange(0, TOKENS)
    words = tl.arange(0, 32)[None, :]
    acc = tl.zeros([TOKENS, 32], tl.int32)
    acc_s = tl.zeros([TOKENS, 2], tl.int32)
    for start in range(lo, hi, TOKENS):
        live = (start + tok) < hi
        slots = tl.load(KvIndices + kv_start + start + tok, mask=live, other=0)
        rows = (slots * H + head)[:, None]
        acc += tl.load(KCodes + rows * 32 + words, mask=live[:, None], other=0)
        acc += tl.load(VCodes + rows * 32 + words, mask=live[:, None], other=0)
        scale_words = rows * 2 + tl.arange(0, 2)[None, :]
        acc_s += tl.load(KScales + scale_words, mask=live[:, None], other=0)
        acc_s += tl.load(VScales + scale_words, mask=live[:, None], other=0)
    total = tl.sum(tl.sum(acc, axis=1), axis=0) + tl.sum(tl.sum(acc_s, axis=1), axis=0)
    tl.store(Out + (row * H + head) * num_splits + split, total)


@gluon.jit
def _split_g(KvStart, KvLen, row, split, num_splits):
    kv_start = gl.load(KvStart + row)
    seq_len = gl.load(KvLen + row)
    split_len = gl.cdiv(gl.cdiv(seq_len, num_splits), 128) * 128
    lo = split * split_len
    return kv_start, lo, gl.minimum(lo + split_len, seq_len)


@gluon.jit
def _issue_cpasync(ring_k, ring_v, ring_ks, ring_vs, stage, KCodes, VCodes, KScales, VScales, KvIndices, kv_start,
                   start, hi, head, H: gl.constexpr, TILE: gl.constexpr, SCALES: gl.constexpr):  # fmt: skip
    """Copy one tile (codes ``TILE``, scales ``SCALES`` layouts) into ring stage ``stage`` with cp.async;
    tokens past ``hi`` read the last one (clamped: real memory, masked by the consumer)."""
    tok = gl.arange(0, 128, layout=gl.SliceLayout(1, TILE))
    slots = gl.load(KvIndices + kv_start + gl.minimum(start + tok, hi - 1))
    rows = (slots * H + head)[:, None] * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, TILE))[None, :]
    _async_load(ring_k.index(stage), KCodes + rows)
    _async_load(ring_v.index(stage), VCodes + rows)
    tok_s = gl.arange(0, 128, layout=gl.SliceLayout(1, SCALES))
    slots_s = gl.load(KvIndices + kv_start + gl.minimum(start + tok_s, hi - 1))
    words = (slots_s * H + head)[:, None] * 2 + gl.arange(0, 2, layout=gl.SliceLayout(0, SCALES))[None, :]
    _async_load(ring_ks.index(stage), KScales + words)
    _async_load(ring_vs.index(stage), VScales + words)


@gluon.jit
def _tile_sum(ring_k, ring_v, ring_ks, ring_vs, stage, start, hi, acc, acc_s, SCALES: gl.constexpr):
    """Add stage ``stage``'s tokens before ``hi`` to the consumer's sums."""
    tok = start + gl.arange(0, 128, layout=gl.SliceLayout(1, _TILE))[:, None]
    codes = ring_k.index(stage).load(_TILE) + ring_v.index(stage).load(_TILE)
    acc += gl.where(tok < hi, codes, 0)
    tok_s = start + gl.arange(0, 128, layout=gl.SliceLayout(1, SCALES))[:, None]
    scales = ring_ks.index(stage).load(SCALES) + ring_vs.index(stage).load(SCALES)
    acc_s += gl.where(tok_s < hi, scales, 0)
    return acc, acc_s


@gluon.jit
def _cpasync_kernel(
    KCodes, VCodes, KScales, VScales, KvStart, KvLen, KvIndices, Out, num_splits,
    H: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    row, head, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    kv_start, lo, hi = _split_g(KvStart, KvLen, row, split, num_splits)
    ring_k = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 32], _PLAIN)
    ring_v = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 32], _PLAIN)
    ring_ks = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 2], _PLAIN)
    ring_vs = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 2], _PLAIN)
    for s in gl.static_range(STAGES - 1):
        _issue_cpasync(ring_k, ring_v, ring_ks, ring_vs, s, KCodes, VCodes, KScales, VScales, KvIndices, kv_start,
                       lo + s * 128, hi, head, H, _TILE, _SCALES)  # fmt: skip
        async_copy.commit_group()
    acc = gl.zeros([128, 32], gl.int32, _TILE)
    acc_s = gl.zeros([128, 2], gl.int32, _SCALES)
    stage = 0
    for start in range(lo, hi, 128):
        async_copy.wait_group(STAGES - 2)
        acc, acc_s = _tile_sum(ring_k, ring_v, ring_ks, ring_vs, stage, start, hi, acc, acc_s, _SCALES)
        ahead = (stage + STAGES - 1) % STAGES
        _issue_cpasync(ring_k, ring_v, ring_ks, ring_vs, ahead, KCodes, VCodes, KScales, VScales, KvIndices, kv_start,
                       start + (STAGES - 1) * 128, hi, head, H, _TILE, _SCALES)  # fmt: skip
        async_copy.commit_group()
        stage = (stage + 1) % STAGES
    async_copy.wait_group(0)
    total = gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(gl.sum(acc_s, axis=1), axis=0)
    gl.store(Out + (row * H + head) * num_splits + split, total)


@gluon.jit
def _consumer(ring_k, ring_v, ring_ks, ring_vs, full, empty, lo, hi, Out, out_index, STAGES: gl.constexpr):
    """Four warps: wait for each stage, sum it, free it."""
    acc = gl.zeros([128, 32], gl.int32, _TILE)
    acc_s = gl.zeros([128, 2], gl.int32, _SCALES)
    stage = 0
    phase = 0
    for start in range(lo, hi, 128):
        mbarrier.wait(full.index(stage), phase)
        acc, acc_s = _tile_sum(ring_k, ring_v, ring_ks, ring_vs, stage, start, hi, acc, acc_s, _SCALES)
        mbarrier.arrive(empty.index(stage), count=1)
        stage += 1
        if stage == STAGES:
            stage = 0
            phase ^= 1
    total = gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(gl.sum(acc_s, axis=1), axis=0)
    gl.store(Out + out_index, total)


@gluon.jit
def _consumer_tma(ring_k, ring_v, ring_ks, ring_vs, full, empty, lo, hi, head, Out, out_index, STAGES: gl.constexpr):
    """As ``_consumer``, for stages filled by TMA: the scales arrive as all heads' (``[128, 8]``)."""
    acc = gl.zeros([128, 32], gl.int32, _TILE)
    acc_s = gl.zeros([128, 8], gl.int32, _TMA_SCALES)
    stage = 0
    phase = 0
    mine = gl.arange(0, 8, layout=gl.SliceLayout(0, _TMA_SCALES))[None, :] // 2 == head
    for start in range(lo, hi, 128):
        mbarrier.wait(full.index(stage), phase)
        tok = start + gl.arange(0, 128, layout=gl.SliceLayout(1, _TILE))[:, None]
        codes = ring_k.index(stage).load(_TILE) + ring_v.index(stage).load(_TILE)
        acc += gl.where(tok < hi, codes, 0)
        tok_s = start + gl.arange(0, 128, layout=gl.SliceLayout(1, _TMA_SCALES))[:, None]
        scales = ring_ks.index(stage).load(_TMA_SCALES) + ring_vs.index(stage).load(_TMA_SCALES)
        acc_s += gl.where((tok_s < hi) & mine, scales, 0)
        mbarrier.arrive(empty.index(stage), count=1)
        stage += 1
        if stage == STAGES:
            stage = 0
            phase ^= 1
    total = gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(gl.sum(acc_s, axis=1), axis=0)
    gl.store(Out + out_index, total)


@gluon.jit
def _producer_cpasync(ring_k, ring_v, ring_ks, ring_vs, full, empty, KCodes, VCodes, KScales, VScales, KvIndices,
                      kv_start, lo, hi, head, H: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One warpgroup: fill each free stage with cp.async; the stage's full-barrier completes when its copies land."""
    stage = 0
    phase = 0
    for start in range(lo, hi, 128):
        mbarrier.wait(empty.index(stage), phase ^ 1)
        _issue_cpasync(ring_k, ring_v, ring_ks, ring_vs, stage, KCodes, VCodes, KScales, VScales, KvIndices, kv_start,
                       start, hi, head, H, _PRODUCER_TILE, _PRODUCER_SCALES)  # fmt: skip
        async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
        stage += 1
        if stage == STAGES:
            stage = 0
            phase ^= 1


@gluon.jit
def _ws_cpasync_kernel(
    KCodes, VCodes, KScales, VScales, KvStart, KvLen, KvIndices, Out, num_splits,
    H: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    row, head, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    kv_start, lo, hi = _split_g(KvStart, KvLen, row, split, num_splits)
    ring_k = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 32], _PLAIN)
    ring_v = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 32], _PLAIN)
    ring_ks = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 2], _PLAIN)
    ring_vs = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 2], _PLAIN)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _BARRIER)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _BARRIER)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=128)  # one noinc arrival per producer thread
        mbarrier.init(empty.index(s), count=1)
    out_index = (row * H + head) * num_splits + split
    gl.warp_specialize(
        [
            (_consumer, (ring_k, ring_v, ring_ks, ring_vs, full, empty, lo, hi, Out, out_index, STAGES)),
            (_producer_cpasync, (ring_k, ring_v, ring_ks, ring_vs, full, empty, KCodes, VCodes, KScales, VScales,
                                 KvIndices, kv_start, lo, hi, head, H, STAGES)),
        ],
        [4],
        [40],
    )  # fmt: skip


@gluon.jit
def _producer_tma_page(ring_k, ring_v, ring_ks, ring_vs, full, empty, k_desc, v_desc, ks_desc, vs_desc, KvIndices,
                       kv_start, lo, hi, head, STAGES: gl.constexpr):  # fmt: skip
    """One warp: per free stage, eight pages of 16 consecutive slots, four TMA boxes each."""
    stage = 0
    phase = 0
    tile_bytes: gl.constexpr = 128 * (2 * 32 + 2 * 8) * 4
    for start in range(lo, hi, 128):
        mbarrier.wait(empty.index(stage), phase ^ 1)
        bar = full.index(stage)
        mbarrier.expect(bar, tile_bytes)
        for p in gl.static_range(8):
            slot = gl.load(KvIndices + kv_start + gl.minimum(start + 16 * p, hi - 1))
            _tma_load(k_desc, [slot, head * 32], bar, ring_k.index(stage).slice(16 * p, 16))
            _tma_load(v_desc, [slot, head * 32], bar, ring_v.index(stage).slice(16 * p, 16))
            _tma_load(ks_desc, [slot, 0], bar, ring_ks.index(stage).slice(16 * p, 16))
            _tma_load(vs_desc, [slot, 0], bar, ring_vs.index(stage).slice(16 * p, 16))
        stage += 1
        if stage == STAGES:
            stage = 0
            phase ^= 1


@gluon.jit
def _producer_tma_token(ring_k, ring_v, ring_ks, ring_vs, full, empty, k_desc, v_desc, KScales, VScales, KvIndices,
                        kv_start, lo, hi, head, STAGES: gl.constexpr):  # fmt: skip
    """One warp: per free stage, a TMA box per token and side for the codes (any slot order), and the scales of all
    heads by cp.async, a token per lane (the stage's barrier counts the expect and the 32 lanes' arrivals)."""
    stage = 0
    phase = 0
    code_bytes: gl.constexpr = 128 * 2 * 32 * 4
    lane = gl.arange(0, 32, layout=gl.SliceLayout(1, _LANE_SCALES))
    word = gl.arange(0, 8, layout=gl.SliceLayout(0, _LANE_SCALES))[None, :]
    for start in range(lo, hi, 128):
        mbarrier.wait(empty.index(stage), phase ^ 1)
        bar = full.index(stage)
        mbarrier.expect(bar, code_bytes)
        for chunk in gl.static_range(0, 128, 32):
            lane_slots = gl.load(KvIndices + kv_start + gl.minimum(start + chunk + lane, hi - 1))
            scale_words = lane_slots[:, None] * 8 + word
            _async_load(ring_ks.index(stage).slice(chunk, 32), KScales + scale_words)
            _async_load(ring_vs.index(stage).slice(chunk, 32), VScales + scale_words)
            for t in gl.static_range(32):
                slot = gl.load(KvIndices + kv_start + gl.minimum(start + chunk + t, hi - 1))
                _tma_load(k_desc, [slot, head * 32], bar, ring_k.index(stage).slice(chunk + t, 1))
                _tma_load(v_desc, [slot, head * 32], bar, ring_v.index(stage).slice(chunk + t, 1))
        async_copy.mbarrier_arrive(bar, increment_count=False)
        stage += 1
        if stage == STAGES:
            stage = 0
            phase ^= 1


@gluon.jit
def _ws_tma_kernel(
    k_desc, v_desc, ks_desc, vs_desc, KScales, VScales, KvStart, KvLen, KvIndices, Out, num_splits,
    H: gl.constexpr, STAGES: gl.constexpr, PER_TOKEN: gl.constexpr,
):  # fmt: skip
    row, head, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    kv_start, lo, hi = _split_g(KvStart, KvLen, row, split, num_splits)
    codes_layout: gl.constexpr = _TMA_ROWS if PER_TOKEN else _TMA_CODES
    scales_layout: gl.constexpr = _PLAIN if PER_TOKEN else _TMA_SCALE_LAYOUT
    ring_k = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 32], codes_layout)
    ring_v = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 32], codes_layout)
    ring_ks = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 8], scales_layout)
    ring_vs = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 8], scales_layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _BARRIER)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _BARRIER)
    for s in gl.static_range(STAGES):
        # The producer's expect (an arrival) and the bytes; per token also its 32 lanes' cp.async arrivals.
        mbarrier.init(full.index(s), count=33 if PER_TOKEN else 1)
        mbarrier.init(empty.index(s), count=1)
    out_index = (row * H + head) * num_splits + split
    consumer_args = (ring_k, ring_v, ring_ks, ring_vs, full, empty, lo, hi, head, Out, out_index, STAGES)
    if PER_TOKEN:
        producer_args = (ring_k, ring_v, ring_ks, ring_vs, full, empty, k_desc, v_desc, KScales, VScales, KvIndices,
                         kv_start, lo, hi, head, STAGES)  # fmt: skip
        gl.warp_specialize([(_consumer_tma, consumer_args), (_producer_tma_token, producer_args)], [1], [40])
    else:
        producer_args = (ring_k, ring_v, ring_ks, ring_vs, full, empty, k_desc, v_desc, ks_desc, vs_desc, KvIndices,
                         kv_start, lo, hi, head, STAGES)  # fmt: skip
        gl.warp_specialize([(_consumer_tma, consumer_args), (_producer_tma_page, producer_args)], [1], [40])


# name -> (kernel, constexprs, pages it handles)
MECHANISMS = {
    "ldg_128": (_ldg_kernel, dict(TOKENS=128, num_warps=4, num_stages=1), (1, 16)),
    "ldg_256": (_ldg_kernel, dict(TOKENS=256, num_warps=8, num_stages=1), (1, 16)),
    "cpasync_2": (_cpasync_kernel, dict(STAGES=2, num_warps=4), (1, 16)),
    "cpasync_4": (_cpasync_kernel, dict(STAGES=4, num_warps=4), (1, 16)),
    # Warp-specialised kernels get a register cap: uncapped, Triton raises the consumers to 256 registers (one
    # program per SM).
    "ws_cpasync_2": (_ws_cpasync_kernel, dict(STAGES=2, num_warps=4, maxnreg=80), (1, 16)),
    "ws_cpasync_4": (_ws_cpasync_kernel, dict(STAGES=4, num_warps=4, maxnreg=80), (1, 16)),
    "ws_tma_page_2": (_ws_tma_kernel, dict(STAGES=2, PER_TOKEN=False, num_warps=4, maxnreg=80), (16,)),
    "ws_tma_page_4": (_ws_tma_kernel, dict(STAGES=4, PER_TOKEN=False, num_warps=4, maxnreg=80), (16,)),
    "ws_tma_token_2": (_ws_tma_kernel, dict(STAGES=2, PER_TOKEN=True, num_warps=4, maxnreg=80), (1, 16)),
    "ws_tma_token_4": (_ws_tma_kernel, dict(STAGES=4, PER_TOKEN=True, num_warps=4, maxnreg=80), (1, 16)),
}


class Case:
    """One decode call's memory: a one-layer pool of ``batch * context`` slots in the pool's layout (codes
    ``[slot, head, 128]`` bytes, scales ``[slot, head, 4]`` fp16, per side), random bytes, and ``kv_indices``
    in page order ``page`` (1: a random permutation of slots; 16: of 16-slot pages, each page's slots in order)."""

    def __init__(self, batch: int, context: int, page: int, heads: int = 4, seed: int = 0) -> None:
        from witcert.kernels import KVPool

        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.batch, self.context, self.page, self.heads = batch, context, page, heads
        tokens = batch * context
        self.pool = KVPool(tokens, 1, heads, HEAD_DIM, page_size=page, device="cuda")
        self.pool.codes.view(torch.int32).random_(generator=generator)
        self.pool.scales.view(torch.int16).random_(generator=generator)
        pages = torch.randperm(tokens // page, device="cuda", generator=generator)
        self.kv_indices = (pages[:, None] * page + torch.arange(page, device="cuda")).flatten().to(torch.int32)
        self.kv_start = torch.arange(batch, device="cuda", dtype=torch.int32) * context
        self.kv_len = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        self.k_words = self.pool.codes[0, 0].view(tokens, heads * WORDS * 4).view(torch.int32)  # [slot, 32 H]
        self.v_words = self.pool.codes[0, 1].view(tokens, heads * WORDS * 4).view(torch.int32)
        self.ks_words = self.pool.scales[0, 0].view(tokens, heads * GROUPS).view(torch.int32)  # [slot, 2 H]
        self.vs_words = self.pool.scales[0, 1].view(tokens, heads * GROUPS).view(torch.int32)
        self.bytes = tokens * heads * 2 * (HEAD_DIM + 2 * GROUPS) + tokens * 4

    def expected(self) -> torch.Tensor:
        """``[batch, heads]`` wrapping int32 sums of every word a row's programs read, as int64 mod 2**32."""
        sums = torch.zeros(self.batch, self.heads, dtype=torch.int64, device="cuda")
        for row in range(self.batch):
            slots = self.kv_indices[row * self.context : (row + 1) * self.context].long()
            for words, per_head in (
                (self.k_words, WORDS),
                (self.v_words, WORDS),
                (self.ks_words, 2),
                (self.vs_words, 2),
            ):
                picked = words[slots].view(-1, self.heads, per_head)
                sums[row] += picked.sum(dim=(0, 2), dtype=torch.int64)
        return sums % 2**32

    def descriptors(self, per_token: bool) -> tuple:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        rows = 1 if per_token else PAGE
        codes = gl.NVMMASharedLayout(swizzle_byte_width=0 if per_token else 128, element_bitwidth=32, rank=2)
        scales = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=32, rank=2)
        return (
            TensorDescriptor.from_tensor(self.k_words, [rows, WORDS], codes),
            TensorDescriptor.from_tensor(self.v_words, [rows, WORDS], codes),
            TensorDescriptor.from_tensor(self.ks_words, [PAGE, 2 * self.heads], scales),
            TensorDescriptor.from_tensor(self.vs_words, [PAGE, 2 * self.heads], scales),
        )


def launch(name: str, case: Case, splits: int, out: torch.Tensor):
    kernel, options, _ = MECHANISMS[name]
    grid = (case.batch, case.heads, splits)
    tail = (case.kv_start, case.kv_len, case.kv_indices, out, splits)
    if kernel is _ws_tma_kernel:
        memory = (*case.descriptors(options["PER_TOKEN"]), case.ks_words, case.vs_words)
    else:
        memory = (case.k_words, case.v_words, case.ks_words, case.vs_words)
    return kernel[grid](*memory, *tail, H=case.heads, **options)


def programs_per_sm(compiled, threads: int) -> int:
    """Resident programs per SM: registers (64k, allocated per warp in units of 256) and shared memory (228 KB,
    1 KB reserved per block)."""
    regs = max(1, compiled.n_regs)
    by_regs = 65536 // (math.ceil(regs * 32 / 256) * 256 * (threads // 32))
    by_smem = (228 * 1024) // (compiled.metadata.shared + 1024) if compiled.metadata.shared else 32
    return max(1, min(by_regs, by_smem, 32))


def ceilings() -> tuple[float, float]:
    """TB/s of a 2 GiB device-to-device copy (read plus written) and of a read-only sum over it."""
    from triton.testing import do_bench

    src = torch.empty(2**29, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    read_ms = do_bench(lambda: torch.sum(src), rep=200, return_mode="median")
    nbytes = src.numel() * 4
    return 2 * nbytes / (copy_ms * 1e-3) / 1e12, nbytes / (read_ms * 1e-3) / 1e12


def run(args: argparse.Namespace) -> dict:
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_tbps, read_tbps = ceilings()
    results = {
        "method": __doc__,
        "device": torch.cuda.get_device_name(0),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "copy_tbps": copy_tbps,
        "read_sum_tbps": read_tbps,
        "rows": [],
    }
    print(f"copy {results['copy_tbps']:.2f} TB/s, read-only sum {results['read_sum_tbps']:.2f} TB/s", flush=True)
    for batch, context in args.shapes:
        for page in args.pages:
            case = Case(batch, context, page)
            expected = case.expected()
            units = batch * case.heads
            tiles = -(-context // BLOCK)
            for name in args.mechanisms:
                if page not in MECHANISMS[name][2]:
                    continue
                out = torch.empty(units * 2 * tiles, dtype=torch.int32, device="cuda")
                try:
                    compiled = launch(name, case, 1, out)
                    threads = 32 * compiled.metadata.num_warps  # warp-specialised: all partitions, padded
                    per_sm = programs_per_sm(compiled, threads)
                    fill = min(tiles, max(1, math.ceil(per_sm * sms / units)))
                    for splits in sorted({fill, min(tiles, 2 * fill)} | ({1} if args.single_split else set())):
                        out.fill_(-1)
                        launch(name, case, splits, out)
                        got = out[: units * splits].view(batch, case.heads, splits).long().sum(-1) % 2**32
                        correct = bool(torch.equal(got, expected))
                        ms = do_bench(
                            lambda name=name, case=case, splits=splits, out=out: launch(name, case, splits, out),
                            rep=100,
                            return_mode="median",
                        )
                        tbps = case.bytes / (ms * 1e-3) / 1e12
                        row = dict(
                            mechanism=name, batch=batch, context=context, page=page, splits=splits,
                            programs_per_sm=per_sm, registers=compiled.n_regs, shared=compiled.metadata.shared,
                            correct=correct, ms=ms, tbps=tbps, of_copy=tbps / results["copy_tbps"],
                        )  # fmt: skip
                        results["rows"].append(row)
                        print(
                            f"B={batch} S={context} page={page} {name:15s} splits={splits:3d} per_sm={per_sm} "
                            f"regs={compiled.n_regs} smem={compiled.metadata.shared} ok={correct} {ms:.4f} ms "
                            f"{tbps:.2f} TB/s ({100 * tbps / results['copy_tbps']:.0f}% of copy)",
                            flush=True,
                        )
                except Exception as error:  # a mechanism that fails to compile or run is a result, not a crash
                    results["rows"].append(dict(mechanism=name, batch=batch, context=context, page=page,
                                                error=f"{type(error).__name__}: {str(error)[:300]}"))  # fmt: skip
                    print(f"B={batch} S={context} page={page} {name}: {type(error).__name__}: {error}", flush=True)
                if args.output:
                    args.output.write_text(json.dumps(results, indent=1))
            del case
            torch.cuda.empty_cache()
    return results


FAMILIES = (("ldg_", "cpasync_"), ("ws_cpasync_",), ("ws_tma_page_",), ("ws_tma_token_",))


def run_isolated(args: argparse.Namespace) -> dict:
    """``run`` once per family of mechanisms, each in a child process with a time limit; rows merged."""
    import subprocess
    import tempfile

    merged: dict = {}
    for family in FAMILIES:
        names = [name for name in args.mechanisms if name.startswith(family)]
        if not names:
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as part:
            command = [sys.executable, __file__, "--mechanisms", *names, "--output", part.name, "--pages",
                       *map(str, args.pages), "--shapes", *(f"{b}x{s}" for b, s in args.shapes)]  # fmt: skip
            if args.single_split:
                command.append("--single-split")
            try:
                subprocess.run(command, timeout=args.child_timeout, check=False)
            except subprocess.TimeoutExpired:
                print(f"{names}: stopped after {args.child_timeout} s (a hang)", flush=True)
            text = Path(part.name).read_text()
        if not text:
            merged.setdefault("rows", []).extend(dict(mechanism=name, error="no result") for name in names)
            continue
        result = json.loads(text)
        rows = merged.get("rows", []) + result.pop("rows")
        merged.update(result, rows=rows)
        if args.output:
            args.output.write_text(json.dumps(merged, indent=1))
    return merged


def compile_only() -> None:
    """Compile each variant for sm_90 here (no GPU): shared memory, spills."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    memory = ("KCodes", "VCodes", "KScales", "VScales")
    descs = ("k_desc", "v_desc", "ks_desc", "vs_desc")
    for name, (kernel, options, _) in MECHANISMS.items():
        options = dict(options)
        warps = options.pop("num_warps")
        stages = options.pop("num_stages", None)
        maxnreg = options.pop("maxnreg", None)
        constants = dict(options, H=4)
        signature = {}
        for arg in kernel.arg_names:
            if arg in constants:
                signature[arg] = "constexpr"
            elif arg in memory or arg in ("KvStart", "KvLen", "KvIndices", "Out", "KScales", "VScales"):
                signature[arg] = "*i32"
            elif arg in descs:
                per_token = constants.get("PER_TOKEN") and arg in ("k_desc", "v_desc")
                rows = 1 if per_token else PAGE
                cols, swizzle = (WORDS, 128) if arg in ("k_desc", "v_desc") else (8, 32)
                swizzle = 0 if per_token else swizzle
                signature[arg] = (
                    f"tensordesc<i32[{rows}, {cols}],NVMMASharedLayout(swizzle_byte_width={swizzle}, "
                    "element_bitwidth=32, rank=2, transposed=False, fp4_padded=False, cga_layout=[])>"
                )
            else:
                signature[arg] = "i32"
        index = kernel.arg_names.index
        source_type = ASTSource if kernel is _ldg_kernel else GluonASTSource
        source = source_type(
            fn=kernel,
            signature=signature,
            constexprs={(index(k),): v for k, v in constants.items()},
            attrs={(index(k),): [["tt.divisibility", 16]] for k in signature if signature[k] == "*i32"},
        )
        compile_options = {"num_warps": warps, **({"num_stages": stages} if stages else {})}
        if maxnreg:
            compile_options["maxnreg"] = maxnreg
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=compile_options)
            ptx = compiled.asm["ptx"]
            copies = ptx.count("cp.async.cg") + ptx.count("cp.async.ca")
            print(
                f"{name:15s} shared {compiled.metadata.shared:6d} B; ptx: cp.async {copies}, "
                f"bulk tensor {ptx.count('cp.async.bulk.tensor')}, setmaxnreg {ptx.count('setmaxnreg')}"
            )
        except Exception as error:
            print(f"{name:15s} FAILED: {type(error).__name__}: {str(error)[-600:]}")
            sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 here, no GPU")
    parser.add_argument("--mechanisms", nargs="+", choices=list(MECHANISMS), default=list(MECHANISMS))
    parser.add_argument("--shapes", nargs="+", type=lambda s: tuple(int(x) for x in s.split("x")),
                        default=[(32, 16384), (8, 65536), (8, 16384)], help="BxS, e.g. 32x16384")  # fmt: skip
    parser.add_argument("--pages", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--single-split", action="store_true", help="also time one split per (row, head)")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--isolate", action="store_true", help="each family of mechanisms in a child process")
    parser.add_argument("--child-timeout", type=int, default=150)
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    results = run_isolated(args) if args.isolate else run(args)
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
