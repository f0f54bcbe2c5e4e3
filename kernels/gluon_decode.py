"""Decode stage 1 in Gluon (Triton's layout-explicit dialect): the int8 path with hand-placed operands, its
codes and scales copied one tile ahead by the warps that compute on them.

The tile's arithmetic (operands built where a thread's bytes are its tensor-core fragment, exact values, the
online softmax, PV and the certificate) is ``gluon_tiles``'s, which the warp-specialised form
(``gluon_decode_ws``) shares; its docstring gives the design. What this kernel adds is the memory pipeline:
tile i + 1's K (codes, scales) and V are copied to shared memory by ``cp.async`` while tile i is computed, K's
during tile i's softmax, PV and certificate and V's during tile i + 1's QK; the membar analysis adds four CTA
barriers per tile, which also make each tile's bytes, copied by other lanes than read them, visible. K's copy
gathers whole 128-byte token rows (``K_ROWS``): an instruction reads 2 rows of the pool, where copying by channel
group reads 32 bytes of each of 8.

Compiled on the GPU only: Gluon has no interpreter, so the contract tests run it compiled on the H200; CI runs it
in Triton's interpreter with its layouts dropped and its asm blocks emulated (``tests/gluon_emulation.py``, whose
emulation of the operand asm is checked against the PTX text), and checks its compiled token loop
(``tests/test_kernels_sass.py``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from witcert.kernels.gluon_tiles import (
    BLOCK_N,
    GROUP_SIZE,
    HEAD_DIM,
    K_ROWS,
    K_ROWS_SHARED,
    ROW_MAJOR,
    ROW_MAJOR_2D,
    TOKEN_ROW,
    TOKENS,
    V_LOAD,
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

# The scale copies give each lane one token's four groups (one 8-byte copy, no lane copying what another
# does): K [token, group], V [4 half + warp, token, group].
_K_SCALES_COPY = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]],
        lane_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
        warp_bases=[[32, 0], [64, 0]],
        block_bases=[],
        shape=[128, 4],
    )
)
_V_SCALES_COPY = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [4, 0, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[8, 16, 4],
    )
)


@gluon.jit
def _token_base(KvIndices, kv_start, offs, hi, num_slots, NUM_KV_HEADS: gl.constexpr, kv_head):
    """Row ``slot * H_kv + kv_head`` of the tokens at ``offs``: clamped, not masked, so that a token past
    the end or out of range reads a real slot (finite codes and scales) and weighs nothing."""
    slots = gl.load(KvIndices + kv_start + gl.minimum(offs, hi - 1))
    return slot_row(slots, num_slots, NUM_KV_HEADS, kv_head)


@gluon.jit
def _copy_k(k_rows, KCodes, base, offs, hi, OFFSETS_64: gl.constexpr):
    """Start copying the K codes of one tile's tokens (``base``, ``offs``: ``[warp, token]``) to ``k_rows``
    (``[group, warp, token, 32]``, ``K_ROWS_SHARED``), a token's row per half-warp; tokens past ``hi`` are
    zero-filled."""
    tokens_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, K_ROWS))
    k_base = gl.convert_layout(base, tokens_layout)
    live = (gl.convert_layout(offs, tokens_layout) < hi)[None, :, :, None].broadcast_to(4, 4, 32, 32)
    group = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, K_ROWS))))
    chan = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, K_ROWS))))
    rows = (
        k_base[None, :, :, None].to(gl.int64 if OFFSETS_64 else gl.int32) * HEAD_DIM
        + group[:, None, None, None] * GROUP_SIZE
        + chan[None, None, None, :]
    )
    async_load(k_rows, KCodes + rows, mask=live)


@gluon.jit
def _copy_scales(scales, Scales, rows, offs, hi, groups):
    """Start copying the four group scales of the tokens at ``offs`` (pool rows ``rows``, one token per lane)
    to ``scales``; ``groups`` is ``0..3`` laid out beside them. Tokens past ``hi`` are zero-filled."""
    live = gl.expand_dims(offs < hi, -1) & (groups >= 0)
    async_load(scales, Scales + gl.expand_dims(rows, -1) * 4 + groups, mask=live)


@gluon.jit
def _copy_v(v_tiles, VCodes, bases, offs, hi, OFFSETS_64: gl.constexpr):
    """Start copying the V codes of one tile (``offs``: the first 16 tokens of each warp, ``[warp, 16]``;
    ``bases``: the rows of those and of the next 16) to ``v_tiles``: (tokens 0-15, channels of bit 3 clear),
    (0-15, set), (16-31, clear), (16-31, set)."""
    index = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_LOAD)))[None, None, :]
    for part in gl.static_range(2):
        rows = (
            bases[part][:, :, None].to(gl.int64 if OFFSETS_64 else gl.int32) * HEAD_DIM + 16 * (index // 8) + index % 8
        )
        live = ((offs + 16 * part) < hi)[:, :, None].broadcast_to(4, 16, 64)
        for half in gl.static_range(2):
            async_load(v_tiles[2 * part + half], VCodes + rows + 8 * half, mask=live)


@gluon.jit
def decode_stage1_gluon(
    Q, KCodes, KScales, VCodes, VScales, KAlpha, VAlpha, KvStart, KvEnd, KvIndices, Skip,
    PartOut, PartLse, PartMax, PartA1, PartB, PartURest, PartPRest, PartU,
    num_slots, num_kv_indices, stride_qb, stride_qh, sm_scale, log_two_over_delta, kappa, seed, layer,
    NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, CERTIFICATE: gl.constexpr, V_DITHER: gl.constexpr,
    HAS_SKIP: gl.constexpr, OFFSETS_64: gl.constexpr, NUM_SPLITS: gl.constexpr,
):  # fmt: skip
    """One (row, block of 8 query heads, split): the outputs of ``triton_kernels.decode_stage1``."""
    # q's MMA operands stay in registers (16 a thread) where the loop fits them without a spill: reading them from
    # shared memory every tile made the kernel 3-4% slower with its reads in the L2 (docs/KERNELS.md). The certified
    # loop with a dithered V has no room for them (17 spill stores a tile, Triton 3.6); with bf16 queries it would
    # spill none with Triton 3.6 but 5 with 3.9 (not timed).
    Q_IN_REGISTERS: gl.constexpr = not (CERTIFICATE and (V_DITHER or Q.dtype.element_ty == gl.bfloat16))
    row, split, kv_head, first_local = program_heads(KV_GROUP)

    kv_start, row_ok, lo, hi, seq_len = split_range(KvStart, KvEnd, row, split, num_kv_indices, NUM_SPLITS, BLOCK_N)

    q_ops, q_alpha_sums, sigma_op, logit_scale, chat = query_operands(
        Q, KAlpha, row, stride_qb, stride_qh, kv_head, first_local, KV_GROUP, sm_scale, kappa, seq_len,
        log_two_over_delta, CERTIFICATE, Q_IN_REGISTERS,
    )  # fmt: skip

    # Index tensors of each layout the loop loads through.
    warp_t = gl.arange(0, 4, layout=gl.SliceLayout(1, TOKEN_ROW))[:, None] * TOKENS
    tok_t = warp_t + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, TOKEN_ROW))[None, :]  # [4, 32]
    v_tok_l: gl.constexpr = gl.SliceLayout(2, V_LOAD)
    tok_v = (
        gl.arange(0, 4, layout=gl.SliceLayout(1, v_tok_l))[:, None] * TOKENS
        + gl.arange(0, 16, layout=gl.SliceLayout(0, v_tok_l))[None, :]
    )

    running_max, acc0, acc1, running_sum, rest, held, slot_max, fold_row = loop_start()
    max_slot = (num_slots - 1).to(gl.uint32)
    dither_sums = (running_sum,) * 8  # a dithered V's sums (v_dither_tile; unused otherwise)

    # Codes in shared memory, one tile ahead: tile i + 1's K is copied while tile i's softmax, PV and
    # certificate run, and its V while tile i + 1's QK runs. Copies are committed in the order K(0), V(0),
    # K(1), V(1), ..., so waiting until one group is left in flight completes the older of the two.
    # K in one buffer, each group read through a slice; V in separate buffers: the membar analysis would order
    # copies into one buffer's parts by barriers.
    k_rows = gl.allocate_shared_memory(gl.uint8, [4, 4, 32, 32], K_ROWS_SHARED)
    k_tiles = (k_rows.slice(0, 1), k_rows.slice(1, 1), k_rows.slice(2, 1), k_rows.slice(3, 1))
    v_tiles = (
        gl.allocate_shared_memory(gl.uint8, [4, 16, 64], V_SHARED),
        gl.allocate_shared_memory(gl.uint8, [4, 16, 64], V_SHARED),
        gl.allocate_shared_memory(gl.uint8, [4, 16, 64], V_SHARED),
        gl.allocate_shared_memory(gl.uint8, [4, 16, 64], V_SHARED),
    )
    # K's scales double-buffered: the certificate reads tile i's while tile i + 1's are copied.
    k_scales = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, 4], ROW_MAJOR_2D)
    v_scales = gl.allocate_shared_memory(gl.float16, [8, 16, 4], ROW_MAJOR)
    # The scale copies' tokens (one per lane) and groups: K [128]; V [4 half + warp, 16], token 32 warp +
    # 16 half + t.
    tok_ks = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _K_SCALES_COPY))
    groups_ks = gl.arange(0, 4, layout=gl.SliceLayout(0, _K_SCALES_COPY))[None, :]
    vs_l: gl.constexpr = gl.SliceLayout(2, _V_SCALES_COPY)
    half_warp = gl.arange(0, 8, layout=gl.SliceLayout(1, vs_l))[:, None]
    tok_vs = (
        (half_warp % 4) * TOKENS + (half_warp // 4) * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, vs_l))[None, :]
    )
    groups_vs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _V_SCALES_COPY)))[None, None, :]
    slots = gl.load(KvIndices + kv_start + gl.minimum(lo + tok_t, hi - 1))
    _copy_k(k_rows, KCodes, slot_row(slots, num_slots, NUM_KV_HEADS, kv_head), lo + tok_t, hi, OFFSETS_64)
    rows = _token_base(KvIndices, kv_start, lo + tok_ks, hi, num_slots, NUM_KV_HEADS, kv_head)
    _copy_scales(k_scales.index(0), KScales, rows, lo + tok_ks, hi, groups_ks)
    async_copy.commit_group()
    v_bases = (
        _token_base(KvIndices, kv_start, lo + tok_v, hi, num_slots, NUM_KV_HEADS, kv_head),
        _token_base(KvIndices, kv_start, lo + 16 + tok_v, hi, num_slots, NUM_KV_HEADS, kv_head),
    )
    _copy_v(v_tiles, VCodes, v_bases, lo + tok_v, hi, OFFSETS_64)
    rows = _token_base(KvIndices, kv_start, lo + tok_vs, hi, num_slots, NUM_KV_HEADS, kv_head)
    _copy_scales(v_scales, VScales, rows, lo + tok_vs, hi, groups_vs)
    async_copy.commit_group()
    stage = 0
    for start in range(lo, hi, BLOCK_N):
        offs = start + tok_t
        in_split = offs < hi
        # The next tile's rows, for its copies (loaded now, used after this tile's QK and PV).
        next_slots = gl.load(KvIndices + kv_start + gl.minimum(offs + BLOCK_N, hi - 1))
        next_v = start + BLOCK_N + tok_v
        next_base = slot_row(next_slots, num_slots, NUM_KV_HEADS, kv_head)
        # V's rows are K's, redistributed (tokens 0-15 and 16-31 of each warp) within the warp.
        v_halves = gl.split(gl.permute(gl.reshape(next_base, [4, 2, 16]), [0, 2, 1]))
        next_v_bases = (gl.convert_layout(v_halves[0], v_tok_l), gl.convert_layout(v_halves[1], v_tok_l))
        next_k_scale_rows = _token_base(
            KvIndices, kv_start, start + BLOCK_N + tok_ks, hi, num_slots, NUM_KV_HEADS, kv_head
        )
        next_v_scale_rows = _token_base(
            KvIndices, kv_start, start + BLOCK_N + tok_vs, hi, num_slots, NUM_KV_HEADS, kv_head
        )
        token_ok, slot_max = tile_tokens(slots, in_split, slot_max, max_slot, Skip, kv_head, NUM_KV_HEADS, HAS_SKIP)

        async_copy.wait_group(1)  # this tile's K
        tile_scales = k_scales.index(stage)
        logits = qk_tile(k_tiles, tile_scales, q_ops, q_alpha_sums, Q_IN_REGISTERS, True)
        _copy_k(k_rows, KCodes, next_base, offs + BLOCK_N, hi, OFFSETS_64)
        _copy_scales(k_scales.index(1 - stage), KScales, next_k_scale_rows, start + BLOCK_N + tok_ks, hi, groups_ks)
        async_copy.commit_group()
        logits, tile_max, new_max, shift, rest_alpha, weights, running_sum, first, second, acc0, acc1 = softmax_tile(
            logits, token_ok, logit_scale, running_max, running_sum, acc0, acc1
        )
        # The certificate's singletons and held token come from the row's first and last tiles alone.
        end_tile = is_end_tile(start, seq_len)
        if CERTIFICATE:
            tile_arg = end_tile_argmax(end_tile, logits, tile_max)
        async_copy.wait_group(1)  # this tile's V
        # With V rounded, sigma^2 beside PV's MMAs, which the scheduler interleaves with it (placed after PV, it runs
        # alone); with V dithered, after PV, where it was 1-5% faster on an H100 (docs/KERNELS.md, "The radius beside
        # PV").
        if CERTIFICATE and not V_DITHER:
            sigma_sq = tile_sigma_sq(tile_scales, sigma_op, token_ok)
        acc0, acc1 = pv_tokens(acc0, acc1, first, (v_tiles[0], v_tiles[1]), v_scales.slice(0, 4))
        acc0, acc1 = pv_tokens(acc0, acc1, second, (v_tiles[2], v_tiles[3]), v_scales.slice(4, 4))
        if V_DITHER:
            dither_sums = v_dither_tile(dither_sums, KvIndices, kv_start, start, hi, max_slot, seed, layer, kv_head,
                                        weights, v_scales, rest_alpha)  # fmt: skip
        _copy_v(v_tiles, VCodes, next_v_bases, next_v, hi, OFFSETS_64)
        _copy_scales(v_scales, VScales, next_v_scale_rows, start + BLOCK_N + tok_vs, hi, groups_vs)
        async_copy.commit_group()

        # The rest of the certificate after PV, so that none of V's registers is live through it.
        if CERTIFICATE:
            if V_DITHER:
                sigma_sq = tile_sigma_sq(tile_scales, sigma_op, token_ok)
            rest, held = tile_certificate(
                end_tile, tile_arg, tile_max, shift, rest_alpha, weights, sigma_sq, chat, fold_row, rest, held
            )

        running_max = new_max
        slots = next_slots
        stage = 1 - stage
    async_copy.wait_group(0)  # the copies of the tile past the end (all masked) before the memory is freed

    store_split(
        acc0, acc1, running_max, running_sum, rest, held, slot_max, dither_sums, row_ok, num_slots, row, split, kv_head,
        first_local, VAlpha, PartOut, PartLse, PartMax, PartA1, PartB, PartURest, PartPRest, PartU, NUM_KV_HEADS,
        KV_GROUP, NUM_SPLITS, CERTIFICATE, V_DITHER,
    )  # fmt: skip
