"""Triton kernel: gather stored tokens from the pool and dequantize them into a dense K or V tensor.

``x_hat = s * (code - xi)`` in float32 with outlier channels restored, rounded once to the output dtype:
bit-identical to ``reference.QuantizedKV.dequantize()`` followed by ``.to(dtype)``. Extend without the
certificate on a GPU (``extend_sdpa``) reads its keys and values from here. Covers every pool: 8-, 16- and
24-bit dithers, dithered or nearest sides, outlier channels.
Imported lazily, like ``triton_kernels``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from witcert.kernels.triton_kernels import FP32_INF, by_channel, dither_rows, stored_code_values, token_head_rows


@triton.jit
def gather_dequantize(
    Slots,
    Codes,
    Scales,
    OutlierValues,
    OutlierIndex,
    Out,
    codes_side,
    scales_side,
    outliers_side,
    out_side,
    num_tokens,
    num_slots,
    seed,
    layer,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DITHER_BITS: tl.constexpr,
    DITHER_K: tl.constexpr,
    DITHER_V: tl.constexpr,
    HAS_OUTLIERS: tl.constexpr,
    NUM_OUTLIERS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Both sides in one launch (one host call less per layer): programs ``(block, 0)`` gather K, ``(block,
    1)`` V, each side's tensors ``*_side`` elements after K's. The two bodies differ in compile-time
    parameters (the stream's kind bit, whether the side is dithered), hence the branch."""
    if tl.program_id(1) == 0:
        _gather_side(
            Slots, Codes, Scales, OutlierValues, OutlierIndex, Out, num_tokens, num_slots, seed, layer,
            NUM_KV_HEADS, HEADS_PAD, 0, HEAD_DIM, GROUP_SIZE, DITHER_BITS, DITHER_K, HAS_OUTLIERS, NUM_OUTLIERS,
            BLOCK_T,
        )  # fmt: skip
    else:
        _gather_side(
            Slots, Codes + codes_side, Scales + scales_side, OutlierValues + outliers_side, OutlierIndex,
            Out + out_side, num_tokens, num_slots, seed, layer, NUM_KV_HEADS, HEADS_PAD, 1, HEAD_DIM, GROUP_SIZE,
            DITHER_BITS, DITHER_V, HAS_OUTLIERS, NUM_OUTLIERS, BLOCK_T,
        )  # fmt: skip


@triton.jit
def _gather_side(
    Slots,
    Codes,
    Scales,
    OutlierValues,
    OutlierIndex,
    Out,
    num_tokens,
    num_slots,
    seed,
    layer,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KIND_BIT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DITHER_BITS: tl.constexpr,
    DITHER: tl.constexpr,
    HAS_OUTLIERS: tl.constexpr,
    NUM_OUTLIERS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """``Out[t, h] = x_hat(Slots[t], h)`` for ``BLOCK_T`` tokens and all their KV heads (rows ``(token,
    head)``, head fastest, as the write kernel's). A slot outside ``[0, num_slots)`` reads nothing and
    writes NaN: unvalidated input gives a visibly wrong row, never a fault or a plausible one."""
    rows: tl.constexpr = BLOCK_T * HEADS_PAD
    num_groups: tl.constexpr = HEAD_DIM // GROUP_SIZE
    tokens, head, row_ok, slots = token_head_rows(Slots, num_tokens, NUM_KV_HEADS, HEADS_PAD, BLOCK_T)
    slot_ok = (slots >= 0) & (slots < num_slots)
    slots = tl.where(row_ok & slot_ok, slots, 0)
    head = tl.where(row_ok, head, 0)
    slot_base = slots * NUM_KV_HEADS + head
    channels = tl.arange(0, HEAD_DIM)
    codes = tl.load(Codes + slot_base[:, None] * HEAD_DIM + channels[None, :], mask=row_ok[:, None], other=0)
    groups = tl.arange(0, num_groups)
    scales = tl.load(Scales + slot_base[:, None] * num_groups + groups[None, :], mask=row_ok[:, None], other=0.0)
    value = stored_code_values(codes)
    if DITHER:
        head_word = tl.arange(0, HEADS_PAD).to(tl.uint32)[:, None] | tl.full((), KIND_BIT << 31, tl.uint32)
        # Only V (kind bit 1) has a per-slot part.
        value = value - dither_rows(
            seed, slots, layer, head_word, rows, HEADS_PAD, HEAD_DIM, DITHER_BITS, KIND_BIT == 1
        )
    x_hat = by_channel(scales.to(tl.float32), rows, num_groups, GROUP_SIZE) * value
    if HAS_OUTLIERS:
        outlier = tl.load(OutlierIndex + head[:, None] * HEAD_DIM + channels[None, :])
        exact = tl.load(
            OutlierValues + slot_base[:, None] * NUM_OUTLIERS + tl.where(outlier >= 0, outlier, 0),
            mask=row_ok[:, None] & (outlier >= 0),
            other=0.0,
        )
        x_hat = tl.where(outlier >= 0, exact.to(tl.float32), x_hat)
    x_hat = tl.where(slot_ok[:, None], x_hat, FP32_INF - FP32_INF)
    out = Out + (tokens.to(tl.int64) * NUM_KV_HEADS + head)[:, None] * HEAD_DIM + channels[None, :]
    if Out.dtype.element_ty == tl.bfloat16:
        # Round to nearest even by bits: Triton's interpreter truncates a float32 -> bf16 conversion. The
        # rounded value is a bf16 one, so the conversion below is exact either way.
        bits = x_hat.to(tl.uint32, bitcast=True)
        x_hat = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out, x_hat.to(Out.dtype.element_ty), mask=row_ok[:, None])
