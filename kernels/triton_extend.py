"""Triton kernel: tiled extend (prefill over a quantized prefix), with or without the certificate.

Each program takes ``BLOCK_M`` new tokens of one sequence with the ``KV_GROUP`` query heads of one KV
head, ``BLOCK_M * BLOCK_H`` rows of the dots, and one split of the keys they see (causal: new token ``i``
of a sequence with prefix ``P`` sees keys ``0 .. P + i``). A K/V tile is dequantized once for all those
rows, where the per-row path (``decode_stage1``, one query token per row) reads the whole prefix again for
every new token. The operands are the decode kernels' (``triton_kernels``), exact in fp16 or bf16 with fp32
accumulation, so the output matches the float32 reference as decode's does. Splits merge in
``decode_stage2``, the query tokens being its rows.

With the certificate, each row (a new token and a head) gets decode's accumulators over the keys it sees,
with its own length in the radius multiplier and its own end tiles (where its singletons and held token lie),
and stage 2 evaluates them. Covered: 8-bit dithers, V rounded to nearest, no outlier channels
(``attention.extend_attention`` sends everything else to the per-row path).
Imported lazily, like ``triton_kernels``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from witcert.kernels.triton_kernels import (
    FP32_INF,
    P_SCALE,
    add_sigma_terms,
    certificate_tile,
    channel_dither_term,
    end_tile_start,
    live_sigma_sq,
    pv_nearest,
    qk_group,
    softmax_tile,
    store_certificate_partials,
    tile_slots,
)


@triton.jit
def extend_stage1(
    Q,
    KCodes,
    KScales,
    VCodes,
    VScales,
    KAlpha,
    QoIndptr,
    KvIndptr,
    KvIndices,
    BlockSequence,
    BlockFirst,
    PartOut,
    PartLse,
    PartMax,
    PartA1,
    PartB,
    PartURest,
    PartPRest,
    PartU,
    num_sequences,
    num_slots,
    num_kv_indices,
    stride_qt,
    stride_qh,
    sm_scale,
    log_two_over_delta,
    kappa,
    NUM_KV_HEADS: tl.constexpr,
    KV_GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    OFFSETS_64: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CERTIFICATE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One (query block, KV head, split): dequantize each K/V tile once for the block's rows, online softmax,
    and with ``CERTIFICATE`` each row's certificate accumulators (decode's, with the row's own length)."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    sequence = tl.load(BlockSequence + block)
    if sequence >= num_sequences:  # the grid is sized from shapes; its last programs may have no block
        return
    first = tl.load(BlockFirst + block)
    qo_start = tl.load(QoIndptr + sequence)
    new_tokens = tl.load(QoIndptr + sequence + 1) - qo_start
    kv_start = tl.load(KvIndptr + sequence)
    kv_len = tl.load(KvIndptr + sequence + 1) - kv_start
    prefix = kv_len - new_tokens
    # A malformed sequence (more new tokens than slots, indices past the end) is poisoned, never read.
    sequence_ok = (new_tokens >= 0) & (prefix >= 0) & (kv_start >= 0) & (kv_start + kv_len <= num_kv_indices)
    num_groups: tl.constexpr = HEAD_DIM // GROUP_SIZE
    ROWS: tl.constexpr = BLOCK_M * BLOCK_H

    rows = tl.arange(0, ROWS)
    token = first + rows // BLOCK_H  # new-token index within the sequence
    local_head = rows % BLOCK_H
    row_ok = (token < new_tokens) & (local_head < KV_GROUP)
    head = kv_head * KV_GROUP + local_head
    # Keys visible to each row (causal), and to the block's last row: the range this program splits.
    row_limit = prefix + token + 1
    limit = tl.where(sequence_ok, prefix + tl.minimum(first + BLOCK_M, new_tokens), 0)
    split_len = tl.cdiv(tl.cdiv(limit, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, limit)

    channels = tl.arange(0, HEAD_DIM)
    groups = tl.arange(0, num_groups)
    q_rows = Q + (qo_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
    running_max = tl.full((ROWS,), -FP32_INF, tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    # The certificate: each row's radius multiplier chat = c + kappa, c from the row's own length (THEORY.md
    # section 2), and its own end tiles, where its singletons lie: the rows' lengths differ, so a mask per row says
    # which tokens are its end tokens (certificate_tile skips the argmaxes only on a tile that holds no row's end
    # token). Then the rest sums over tokens other than the one held apart, and that token's logit, u and g.
    tail = tl.sqrt(2.0 * (tl.log(tl.maximum(row_limit, 1).to(tl.float32)) + log_two_over_delta))
    chat = tail + kappa
    last_start = end_tile_start(row_limit)[:, None]
    # The block's first row has the shortest length: a tile past its last start holds no row's end tokens.
    earliest_last_start = end_tile_start(prefix + first + 1)
    sigma_coef = sm_scale * sm_scale / 12.0
    b_rest = tl.zeros((ROWS,), tl.float32)
    u_rest = tl.zeros((ROWS,), tl.float32)
    w_rest = tl.zeros((ROWS,), tl.float32)
    held_logit = tl.full((ROWS,), -FP32_INF, tl.float32)
    u_held = tl.zeros((ROWS,), tl.float32)
    g_held = tl.zeros((ROWS,), tl.float32)
    slots_ok = sequence_ok
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        slots, token_ok, in_range = tile_slots(KvIndices, kv_start, offs, hi, num_slots, OFFSETS_64)
        slots_ok = slots_ok & in_range
        base = slots * NUM_KV_HEADS + kv_head
        logits = tl.zeros((ROWS, BLOCK_N), tl.float32)
        sigma_sq = tl.zeros((ROWS, BLOCK_N), tl.float32)
        k_scales = tl.load(KScales + base[:, None] * num_groups + groups[None, :]).to(tl.float32)  # [N, NG]
        for g in tl.static_range(num_groups):
            group_channels = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
            codes_g = tl.load(KCodes + base[:, None] * HEAD_DIM + group_channels[None, :])
            alpha_g = tl.load(KAlpha + kv_head * HEAD_DIM + group_channels)
            q_g = tl.load(q_rows + group_channels[None, :], mask=row_ok[:, None], other=0.0)
            part = qk_group(q_g, codes_g, channel_dither_term(q_g, alpha_g), ROWS, BLOCK_N, INTERPRETED)
            scale_g = tl.sum(tl.where(groups[None, :] == g, k_scales, 0.0), axis=1)
            logits += part * scale_g[None, :]
            if CERTIFICATE:
                sigma_sq = add_sigma_terms(sigma_sq, q_g.to(tl.float32), scale_g, sigma_coef)
        visible = token_ok[None, :] & (offs[None, :] < row_limit[:, None])
        logits = tl.where(visible, logits * sm_scale, -FP32_INF)

        new_max, shift, alpha, weights, running_sum = softmax_tile(logits, running_max, running_sum)
        if CERTIFICATE:
            b_rest, u_rest, w_rest, held_logit, u_held, g_held = certificate_tile(
                logits, weights, live_sigma_sq(sigma_sq, visible), chat, start, last_start, earliest_last_start,
                shift, alpha, b_rest, u_rest, w_rest, held_logit, u_held, g_held, BLOCK_N, INTERPRETED,
            )  # fmt: skip

        v_codes = tl.load(VCodes + base[:, None] * HEAD_DIM + channels[None, :])
        v_scales = tl.load(VScales + base[:, None] * num_groups + groups[None, :])
        acc = pv_nearest(acc, weights, alpha, v_codes, v_scales, BLOCK_N, num_groups, GROUP_SIZE, HEAD_DIM, INTERPRETED)
        running_max = new_max

    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
    poison = tl.where(slots_ok, 0.0, (FP32_INF - FP32_INF))
    num_q_heads = NUM_KV_HEADS * KV_GROUP
    part_row = ((qo_start + token) * num_q_heads + head) * NUM_SPLITS + split
    out = acc * (1.0 / P_SCALE) / safe_sum[:, None] + poison
    tl.store(PartOut + part_row[:, None] * HEAD_DIM + channels[None, :], out, mask=row_ok[:, None])
    lse = tl.where(running_sum == 0, -FP32_INF, running_max + tl.log(safe_sum)) + poison
    tl.store(PartLse + part_row, lse, mask=row_ok)
    if CERTIFICATE:
        store_certificate_partials(
            PartMax, PartA1, PartB, PartURest, PartPRest, PartU, part_row, row_ok, held_logit, safe_sum, poison,
            b_rest, u_rest, w_rest, u_held,
        )  # fmt: skip
