"""Decode stage 1, warp-specialised: a producer warpgroup keeps a ring of tiles in shared memory full, and four
consumer warps compute on it.

The arithmetic is ``gluon_decode``'s: both run ``gluon_tiles``'s tile functions (the same operands, the same
exactness, the same partials for stage 2); what changes is who moves the bytes. In ``gluon_decode`` the four
warps that do the math also issue every copy of the next tile, wait for it (``cp.async.wait_group``) and meet at
four CTA barriers per tile. Here:

* a **producer** partition (one warpgroup of 4 warps at ``PRODUCER_REGS`` registers: Triton pads a
  warp-specialised kernel to whole warpgroups, since ``setmaxnreg`` acts per warpgroup) copies each tile's K and
  V codes and scales with ``cp.async`` into stage ``i % STAGES`` of a ring, in exactly the shared-memory layouts
  the consumers read, and signals the stage's *full* barrier when they land (``cp.async.mbarrier.arrive.noinc``,
  one arrival per producer thread); it waits on the stage's *empty* barrier before refilling it;
* the **consumers** (the default partition, the kernel's ``NUM_WARPS``) wait on *full*, run QK, the softmax,
  PV and the certificate on the stage, and free it (*empty*, one arrival after the four warps are done).

So the copies of tiles ``i + 1 .. i + STAGES - 1`` are in flight while tile ``i``'s certificate runs, and the
consumers issue no copy instruction. The cost is registers: the producer warpgroup takes ``128 *
PRODUCER_REGS`` of them per program, which the consumers give up (``maxnreg``: the kernel's cap over all its 8
warps; Triton raises the consumers' share with ``setmaxnreg``).

Why a ``cp.async`` producer and not TMA: the decode call addresses tokens by slot, in any order (SGLang's page
size 1), and a TMA box per 128-byte token row is one instruction per token and side from one thread
(``bench/lab/copy_mechanisms.py`` measures both); ``cp.async`` takes each lane's own address. Coverage as
``gluon_tiles.supports``, on Hopper (``setmaxnreg`` and the mbarriers: compute capability 9.0). Off by default
(``LAUNCH.gluon_ws``): docs/KERNELS.md, "Warp-specialised stage 1", has its measurements.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from witcert.kernels.gluon_tiles import (
    BLOCK_N,
    GROUP_SIZE,
    HEAD_DIM,
    ROW_MAJOR,
    ROW_MAJOR_2D,
    TOKEN_ROW,
    TOKENS,
    V_SHARED,
    async_load,
    end_tile_argmax,
    is_end_tile,
    loop_start,
    program_heads,
    pv_tokens,
    qk_tile,
    query_operands,
    slot_row,
    softmax_tile,
    store_split,
    tile_certificate,
    tile_sigma_sq,
    tile_tokens,
    v_dither_tile,
)
from witcert.kernels.triton_kernels import split_range

STAGES = gl.constexpr(2)
PRODUCER_WARPS = gl.constexpr(4)
PRODUCER_REGS = gl.constexpr(24)
_BARRIER = gl.constexpr(mbarrier.MBarrierLayout())
# The producer's copies, 16 bytes a thread where the consumers' buffers hold 16 contiguous bytes: K codes of one
# group ``[warp, token, 32]`` (a token row's 32 bytes are contiguous in the pool and in the buffer), two per thread.
_P_K = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 16, 2], [4, 1, 1], [2, 1, 0]))
# V codes ``[warp, token, 64]``: index ``c`` is channel ``16 (c // 8) + 8 half + c % 8`` (``gluon_tiles.V_LOAD``),
# so 8 contiguous bytes, four per thread.
_P_V = gl.constexpr(gl.BlockedLayout([1, 1, 8], [1, 4, 8], [4, 1, 1], [2, 1, 0]))
# Scales, a token's four groups (8 bytes) per thread: K ``[token, group]``, V ``[4 half + warp, token, group]``.
_P_KS = gl.constexpr(gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0]))
_P_VS = gl.constexpr(gl.BlockedLayout([1, 1, 4], [2, 16, 1], [4, 1, 1], [2, 1, 0]))


@gluon.jit
def _produce(k_ring, v_ring, ks_ring, vs_ring, full, empty, KCodes, KScales, VCodes, VScales, KvIndices, kv_start, lo,
             hi, num_slots, kv_head, NUM_KV_HEADS: gl.constexpr, OFFSETS_64: gl.constexpr):  # fmt: skip
    """Fill ring stage ``i % STAGES`` with tile ``i``'s codes and scales once the consumers freed it; tokens past
    ``hi`` are zero-filled, an out-of-range slot reads a real one (``slot_row``: the consumers poison its row)."""
    k_tok = (
        gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _P_K)))[:, None] * TOKENS
        + gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _P_K)))[None, :]
    )[:, :, None]
    k_chan = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _P_K)))[None, None, :]
    # V buffer 2 part + half holds tokens 32 warp + 16 part + t.
    v_tok = (
        gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _P_V)))[:, None] * TOKENS
        + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _P_V)))[None, :]
    )[:, :, None]
    v_index = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, _P_V)))[None, None, :]
    v_chan = 16 * (v_index // 8) + v_index % 8
    ks_tok = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _P_KS))[:, None]
    ks_group = gl.arange(0, 4, layout=gl.SliceLayout(0, _P_KS))[None, :]
    vs_hw = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, _P_VS)))[:, None, None]
    vs_tok = (
        (vs_hw % 4) * TOKENS
        + (vs_hw // 4) * 16
        + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _P_VS)))[None, :, None]
    )
    vs_group = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _P_VS)))[None, None, :]
    offset_ty: gl.constexpr = gl.int64 if OFFSETS_64 else gl.int32
    stage = 0
    phase = 0
    for start in range(lo, hi, BLOCK_N):
        mbarrier.wait(empty.index(stage), phase ^ 1)
        rows = slot_row(gl.load(KvIndices + kv_start + gl.minimum(start + k_tok, hi - 1)), num_slots, NUM_KV_HEADS,
                         kv_head)  # fmt: skip
        live = (start + k_tok < hi) & (k_chan >= 0)
        for g in gl.static_range(4):
            async_load(k_ring.index(4 * stage + g), KCodes + rows.to(offset_ty) * HEAD_DIM + g * GROUP_SIZE + k_chan,
                        mask=live)  # fmt: skip
        for part in gl.static_range(2):
            offs = start + 16 * part + v_tok
            rows = slot_row(gl.load(KvIndices + kv_start + gl.minimum(offs, hi - 1)), num_slots, NUM_KV_HEADS,
                             kv_head)  # fmt: skip
            live = (offs < hi) & (v_chan >= 0)
            for half in gl.static_range(2):
                async_load(v_ring.index(4 * stage + 2 * part + half),
                            VCodes + rows.to(offset_ty) * HEAD_DIM + v_chan + 8 * half, mask=live)  # fmt: skip
        offs = start + ks_tok
        rows = slot_row(gl.load(KvIndices + kv_start + gl.minimum(offs, hi - 1)), num_slots, NUM_KV_HEADS, kv_head)
        async_load(ks_ring.index(stage), KScales + rows * 4 + ks_group, mask=(offs < hi) & (ks_group >= 0))
        offs = start + vs_tok
        rows = slot_row(gl.load(KvIndices + kv_start + gl.minimum(offs, hi - 1)), num_slots, NUM_KV_HEADS, kv_head)
        async_load(vs_ring.index(stage), VScales + rows * 4 + vs_group, mask=(offs < hi) & (vs_group >= 0))
        async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
        stage += 1
        if stage == STAGES:
            stage = 0
            phase ^= 1


@gluon.jit
def _consume(
    k_ring, v_ring, ks_ring, vs_ring, full, empty, q_ops, q_alpha_sums, sigma_op, logit_scale, chat, KvIndices, Skip,
    kv_start, lo, hi, seq_len, num_slots, kv_head, seed, layer, NUM_KV_HEADS: gl.constexpr, CERTIFICATE: gl.constexpr,
    V_DITHER: gl.constexpr, HAS_SKIP: gl.constexpr,
):  # fmt: skip
    """``gluon_decode``'s token loop on the ring: the loop state after the split's last tile."""
    warp_t = gl.arange(0, 4, layout=gl.SliceLayout(1, TOKEN_ROW))[:, None] * TOKENS
    tok_t = warp_t + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, TOKEN_ROW))[None, :]  # [4, 32]

    running_max, acc0, acc1, running_sum, rest, held, slot_max, fold_row = loop_start()
    max_slot = (num_slots - 1).to(gl.uint32)
    dither_sums = (running_sum,) * 8  # a dithered V's sums (v_dither_tile; unused otherwise)

    slots = gl.load(KvIndices + kv_start + gl.minimum(lo + tok_t, hi - 1))
    stage = 0
    phase = 0
    for start in range(lo, hi, BLOCK_N):
        offs = start + tok_t
        in_split = offs < hi
        next_slots = gl.load(KvIndices + kv_start + gl.minimum(offs + BLOCK_N, hi - 1))
        token_ok, slot_max = tile_tokens(slots, in_split, slot_max, max_slot, Skip, kv_head, NUM_KV_HEADS, HAS_SKIP)

        mbarrier.wait(full.index(stage), phase)
        k_tiles = (k_ring.index(4 * stage), k_ring.index(4 * stage + 1), k_ring.index(4 * stage + 2),
                   k_ring.index(4 * stage + 3))  # fmt: skip
        tile_scales = ks_ring.index(stage)
        logits = qk_tile(k_tiles, tile_scales, q_ops, q_alpha_sums, False, False)
        logits, tile_max, new_max, shift, rest_alpha, weights, running_sum, first, second, acc0, acc1 = softmax_tile(
            logits, token_ok, logit_scale, running_max, running_sum, acc0, acc1
        )
        # The certificate's singletons and held token come from the row's first and last tiles alone.
        end_tile = is_end_tile(start, seq_len)
        if CERTIFICATE:
            tile_arg = end_tile_argmax(end_tile, logits, tile_max)
        tile_v_scales = vs_ring.index(stage)
        acc0, acc1 = pv_tokens(acc0, acc1, first, (v_ring.index(4 * stage), v_ring.index(4 * stage + 1)),
                               tile_v_scales.slice(0, 4))  # fmt: skip
        acc0, acc1 = pv_tokens(acc0, acc1, second, (v_ring.index(4 * stage + 2), v_ring.index(4 * stage + 3)),
                               tile_v_scales.slice(4, 4))  # fmt: skip
        if V_DITHER:
            dither_sums = v_dither_tile(dither_sums, KvIndices, kv_start, start, hi, max_slot, seed, layer, kv_head,
                                        weights, tile_v_scales, rest_alpha)  # fmt: skip

        if CERTIFICATE:
            sigma_sq = tile_sigma_sq(tile_scales, sigma_op, token_ok)
            rest, held = tile_certificate(
                end_tile, tile_arg, tile_max, shift, rest_alpha, weights, sigma_sq, chat, fold_row, rest, held
            )
        # The stage is free once the four warps have read it (the arrive waits for them).
        mbarrier.arrive(empty.index(stage), count=1)

        running_max = new_max
        slots = next_slots
        stage += 1
        if stage == STAGES:
            stage = 0
            phase ^= 1
    return (acc0, acc1, running_max, running_sum) + rest + held + (slot_max,) + dither_sums


@gluon.jit
def decode_stage1_ws(
    Q, KCodes, KScales, VCodes, VScales, KAlpha, VAlpha, KvStart, KvEnd, KvIndices, Skip,
    PartOut, PartLse, PartMax, PartA1, PartB, PartURest, PartPRest, PartU,
    num_slots, num_kv_indices, stride_qb, stride_qh, sm_scale, log_two_over_delta, kappa, seed, layer,
    NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, CERTIFICATE: gl.constexpr, V_DITHER: gl.constexpr,
    HAS_SKIP: gl.constexpr, OFFSETS_64: gl.constexpr, NUM_SPLITS: gl.constexpr,
):  # fmt: skip
    """One (row, block of 8 query heads, split): the outputs of ``gluon_decode.decode_stage1_gluon``."""
    row, split, kv_head, first_local = program_heads(KV_GROUP)

    kv_start, row_ok, lo, hi, seq_len = split_range(KvStart, KvEnd, row, split, num_kv_indices, NUM_SPLITS, BLOCK_N)

    # q's MMA operands in shared memory (Q_IN_REGISTERS false): the consumers' registers have no room for them.
    q_ops, q_alpha_sums, sigma_op, logit_scale, chat = query_operands(
        Q, KAlpha, row, stride_qb, stride_qh, kv_head, first_local, KV_GROUP, sm_scale, kappa, seq_len,
        log_two_over_delta, CERTIFICATE, False,
    )  # fmt: skip

    # The ring: per stage the four K group buffers, the four V buffers (gluon_decode's layouts) and the scales.
    k_ring = gl.allocate_shared_memory(gl.uint8, [4 * STAGES, 4, 32, 32], ROW_MAJOR)
    v_ring = gl.allocate_shared_memory(gl.uint8, [4 * STAGES, 4, 16, 64], V_SHARED)
    ks_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, 4], ROW_MAJOR_2D)
    vs_ring = gl.allocate_shared_memory(gl.float16, [STAGES, 8, 16, 4], ROW_MAJOR)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _BARRIER)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _BARRIER)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=32 * PRODUCER_WARPS)  # one cp.async arrival per producer thread
        mbarrier.init(empty.index(s), count=1)
    state = gl.warp_specialize(
        [
            (_consume, (k_ring, v_ring, ks_ring, vs_ring, full, empty, q_ops, q_alpha_sums, sigma_op, logit_scale,
                        chat, KvIndices, Skip, kv_start, lo, hi, seq_len, num_slots, kv_head, seed, layer, NUM_KV_HEADS,
                        CERTIFICATE, V_DITHER, HAS_SKIP)),
            (_produce, (k_ring, v_ring, ks_ring, vs_ring, full, empty, KCodes, KScales, VCodes, VScales, KvIndices,
                        kv_start, lo, hi, num_slots, kv_head, NUM_KV_HEADS, OFFSETS_64)),
        ],
        [PRODUCER_WARPS],
        [PRODUCER_REGS],
    )  # fmt: skip
    (
        acc0,
        acc1,
        running_max,
        running_sum,
        b_rest,
        u_rest,
        w_rest,
        held_z,
        u_max,
        g_max,
        slot_max,
        d0,
        d1,
        d2,
        d3,
        d4,
        d5,
        d6,
        d7,
    ) = state
    dither_sums = (d0, d1, d2, d3, d4, d5, d6, d7)

    store_split(
        acc0, acc1, running_max, running_sum, (b_rest, u_rest, w_rest), (held_z, u_max, g_max), slot_max, dither_sums,
        row_ok, num_slots, row, split, kv_head, first_local, VAlpha, PartOut, PartLse, PartMax, PartA1, PartB,
        PartURest, PartPRest, PartU, NUM_KV_HEADS, KV_GROUP, NUM_SPLITS, CERTIFICATE, V_DITHER,
    )  # fmt: skip
