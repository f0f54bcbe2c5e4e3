"""Decode stage 1 in Gluon (Triton's layout-explicit dialect): the int8 path with hand-placed operands.

The Triton kernel (``triton_kernels._decode_stage1``) is limited by instruction issue: Triton builds the
tensor-core operands of the int8 tiles through shared memory and duplicated registers. Here every
layout is chosen so that the bytes a thread loads are the bytes its tensor-core fragment needs:

* **QK** runs with tokens as the MMA rows: ``logits^T [tokens, heads] = K [tokens, channels] x q^T``,
  so eight query heads fill the ``n8`` side exactly. Each thread loads 8 contiguous code bytes per
  (token, channel group) and the channel order inside a group is relabelled (a permutation applied to
  K and q alike, which a dot product ignores) so that those bytes are its fragment's ``k`` slots.
* **Dither.** A thread's 8 channels of a group sit in one half of one Philox call (16 channels per
  call), and two lanes share each call: each lane computes two calls per token and swaps the halves
  it does not need with its neighbour (``shfl.bfly 1``), so no call is computed twice.
* **PV** runs as ``out^T [channels, heads] = V^T [channels, tokens] x p^T``: a thread loads 16
  contiguous V bytes per token, pairs of tokens are interleaved by ``prmt`` into ``f16x2`` registers,
  and the output channels are relabelled (undone at the store).
* **Warps are independent**: each owns 32 tokens of every 128-token tile with its own running max,
  sums and output accumulator; the four are merged once per split, with the same algebra as the
  split merge of stage 2, so the token loop has no barrier.

Values are those of the Triton kernel (docs/KERNELS.md, "Exactness"): codes and ``(128 - j) / 256``
are exact in fp16 (the remaining ``-1/512`` of ``-xi`` enters as ``-sum(q_g) / 512``, the accumulator's
initial value), and the output uses the exact ``v_hi + v_lo`` split of ``s * code`` with ``2**14 p``
split into ``p_hi + p_mid``. The outputs are the stage-1 partials of the Triton kernel, so its stage 2
merges them. Supported: fp16 queries, head_dim 128, channel groups of 32, 8-bit dithers, V rounded
to nearest, no outlier channels (``supports`` says; everything else runs the Triton kernel). Compiled
on the GPU only: Gluon has no interpreter, so the contract tests run it on the H200.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

NUM_WARPS = 4
# Per warp and tile: 32 tokens; per program: 8 query heads of one KV head.
TOKENS = gl.constexpr(32)
BLOCK_N = gl.constexpr(NUM_WARPS * 32)
HEADS = gl.constexpr(8)
HEAD_DIM = gl.constexpr(128)
GROUP_SIZE = gl.constexpr(32)

_FP32_INF = gl.constexpr(float("inf"))
_P_SCALE = gl.constexpr(16384.0)

# mma.sync m16n8k16, batched over the warps: [warp, rows, cols], each warp its own batch entry.
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
_OP_A = gl.constexpr(gl.DotOperandLayout(0, _MMA, 2))
_OP_B = gl.constexpr(gl.DotOperandLayout(1, _MMA, 2))
_TOKEN_ROW = gl.constexpr(gl.SliceLayout(2, _MMA))  # [warp, token] beside the [warp, token, head] logits
_HEAD_ROW = gl.constexpr(gl.SliceLayout(1, _MMA))  # [warp, head]: per-warp softmax state
# K codes of one channel group, [warp, token, 32 channels] viewed as [warp, token, j, a, e4]: a thread
# holds channels 8 j + 4 a + (0..3) of its tokens (j = lane % 4), 8 contiguous bytes.
_K_GROUP5 = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 8, 0, 0, 0], [0, 16, 0, 0, 0]],
        lane_bases=[[0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 4, 0, 0, 0]],
        warp_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]],
        block_bases=[],
        shape=[4, 32, 4, 2, 4],
    )
)
_K_GROUP = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 8, 0], [0, 16, 0]],
        lane_bases=[[0, 0, 8], [0, 0, 16], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[4, 32, 32],
    )
)
# Philox words, [warp, token, j]: one (token, lane column) per element.
_WORDS = gl.constexpr(gl.SliceLayout(3, gl.SliceLayout(4, _K_GROUP5)))
# V codes [warp, token, 128 channels]: 16 contiguous bytes per (thread, token); _V_PAIRS is the same
# registers reordered so that tokens t and t + 1 are neighbours for the pairing asm.
_V_LOAD = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0], [0, 16, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[4, 32, 128],
    )
)
_V_PAIRS = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 0, 4], [0, 0, 8], [0, 8, 0], [0, 16, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[4, 32, 128],
    )
)
# q^T of one group, [warp (broadcast), 32 channels, 8 heads], as loaded (then relabelled like K).
_Q_LOAD = gl.constexpr(gl.BlockedLayout([1, 1, 1], [1, 4, 8], [4, 1, 1], [2, 1, 0]))


def supports(
    *, q_dtype: object, head_dim: int, group_size: int, dither_bits: int, v_dither: bool, outliers: int
) -> bool:
    """Whether this kernel covers a decode call (everything else runs the Triton kernel)."""
    import torch

    return (
        q_dtype == torch.float16
        and head_dim == HEAD_DIM
        and group_size == GROUP_SIZE
        and dither_bits == 8
        and not v_dither
        and outliers == 0
    )


@gluon.jit
def _relabel_group(x, axis: gl.constexpr):
    """Group channel ``c = 16 j1 + 8 j0 + 4 a + 2 h + e`` -> MMA slot ``16 a + 8 h + 4 j1 + 2 j0 + e``."""
    if axis == 2:
        x = gl.reshape(gl.permute(gl.reshape(x, [4, 32, 2, 2, 2, 2, 2]), [0, 1, 4, 5, 2, 3, 6]), [4, 32, 32])
    else:
        x = gl.reshape(gl.permute(gl.reshape(x, [4, 2, 2, 2, 2, 2, 8]), [0, 3, 4, 1, 2, 5, 6]), [4, 32, 8])
    return x


@gluon.jit
def _q_group(q_ptrs, q_mask, g: gl.constexpr):
    """Group ``g`` of q^T: the relabelled MMA operand, ``-sum / 512``, the squared and absolute norms."""
    q_g = gl.load(q_ptrs + g * GROUP_SIZE, mask=q_mask, other=0.0)
    q32 = q_g.to(gl.float32)
    return (
        gl.convert_layout(_relabel_group(q_g, 1), _OP_B),
        gl.convert_layout(gl.sum(q32, axis=1) * (-1.0 / 512.0), _HEAD_ROW),
        gl.convert_layout(gl.sum(q32 * q32, axis=1), _HEAD_ROW),
        gl.convert_layout(gl.sum(gl.abs(q32), axis=1), _HEAD_ROW),
    )


@gluon.jit
def _expm1_and_g(u):
    """``(expm1(u), expm1(u) - u)`` for ``u >= 0``, as ``triton_kernels._expm1_and_g`` (same series)."""
    series = u * (1.0 / 479001600.0)
    series = (series + 1.0 / 39916800.0) * u
    series = (series + 1.0 / 3628800.0) * u
    series = (series + 1.0 / 362880.0) * u
    series = (series + 1.0 / 40320.0) * u
    series = (series + 1.0 / 5040.0) * u
    series = (series + 1.0 / 720.0) * u
    series = (series + 1.0 / 120.0) * u
    series = (series + 1.0 / 24.0) * u
    series = (series + 1.0 / 6.0) * u
    series = (series + 0.5) * u * u
    small = u < 1.0
    big_expm1 = gl.exp(gl.where(small, 0.0, u)) - 1.0
    expm1 = gl.where(small, series + u, big_expm1)
    g = gl.where(small, series, gl.where(u == _FP32_INF, _FP32_INF, big_expm1 - u))
    return expm1, g


@gluon.jit
def _mul_nonneg(a, b):
    return gl.where((a == _FP32_INF) | (b == _FP32_INF), _FP32_INF, a * b)


@gluon.jit
def _philox(k0, k1, c0, c1, c2, c3):
    """Philox4x32-10 (Random123) with key ``(k0, k1)``, the block function ``tl.philox`` runs."""
    for _ in gl.static_range(10):
        prev0 = c0
        prev2 = c2
        c0 = gl.umulhi(prev2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = gl.umulhi(prev0, 0xD2511F53) ^ c3 ^ k1
        c1 = prev2 * 0xCD9E8D57
        c3 = prev0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@gluon.jit
def _swap_with_neighbour(x):
    """The value lane ``l ^ 1`` holds (all 32 lanes take part)."""
    return gl.inline_asm_elementwise(
        "shfl.sync.bfly.b32 $0, $1, 1, 0x1f, -1;", "=r,r", [x], dtype=gl.uint32, is_pure=True, pack=1
    )


@gluon.jit
def _k_operands(codes, words):
    """Four codes and their word -> fp16 ``code`` and ``(128 - j) / 256`` for the word's four dither bytes.

    ``code ^ 0x80`` under the fp16 exponent byte 0x64 is ``1152 + code``; a dither byte ``j`` under 0x44
    is ``4 + j / 256``. Both subtractions are exact. Fields count from the word's most significant byte.
    """
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 biased, offset, half;
        xor.b32 biased, $4, 0x80808080;
        mov.b32 offset, 0xE480E480;
        mov.b32 half, 0x44804480;
        prmt.b32 $0, biased, 0x64646464, 0x4140;
        prmt.b32 $1, biased, 0x64646464, 0x4342;
        add.rn.f16x2 $0, $0, offset;
        add.rn.f16x2 $1, $1, offset;
        prmt.b32 $2, $5, 0x44444444, 0x4243;
        prmt.b32 $3, $5, 0x44444444, 0x4041;
        sub.rn.f16x2 $2, half, $2;
        sub.rn.f16x2 $3, half, $3;
        }
        """,
        "=r,=r,=r,=r,r,r,r,r,r",
        [codes, words],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _v_pairs(codes):
    """Tokens ``t, t + 1`` x channels ``c .. c + 3`` -> four ``f16x2`` (token t, token t + 1) per channel.

    Element ``i`` of the eight in comes from token ``i // 4``, channel ``i % 4``; element ``i`` out is
    token ``i % 2``, channel ``i // 2`` (the caller relabels).
    """
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 a, b, lo, hi, offset;
        xor.b32 a, $4, 0x80808080;
        xor.b32 b, $5, 0x80808080;
        mov.b32 offset, 0xE480E480;
        prmt.b32 lo, a, b, 0x5140;
        prmt.b32 hi, a, b, 0x7362;
        prmt.b32 $0, lo, 0x64646464, 0x4140;
        prmt.b32 $1, lo, 0x64646464, 0x4342;
        prmt.b32 $2, hi, 0x64646464, 0x4140;
        prmt.b32 $3, hi, 0x64646464, 0x4342;
        add.rn.f16x2 $0, $0, offset;
        add.rn.f16x2 $1, $1, offset;
        add.rn.f16x2 $2, $2, offset;
        add.rn.f16x2 $3, $3, offset;
        }
        """,
        "=r,=r,=r,=r,r,r",
        [codes],
        dtype=gl.float16,
        is_pure=True,
        pack=8,
    )


@gluon.jit
def _decode_stage1_gluon(
    Q,
    KCodes,
    KScales,
    VCodes,
    VScales,
    KvStart,
    KvLen,
    KvIndices,
    Skip,
    PartOut,
    PartLse,
    PartMax,
    PartA1,
    PartB,
    PartURest,
    PartPRest,
    PartU,
    num_slots,
    num_kv_indices,
    stride_qb,
    stride_qh,
    sm_scale,
    log_two_over_delta,
    beta,
    seed_lo,
    seed_hi,
    layer,
    NUM_KV_HEADS: gl.constexpr,
    KV_GROUP: gl.constexpr,
    CERTIFICATE: gl.constexpr,
    HAS_SKIP: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
):
    """One (row, block of 8 query heads, split): the outputs of ``triton_kernels._decode_stage1``."""
    row = gl.program_id(0)
    head_block = gl.program_id(1)
    split = gl.program_id(2)
    blocks_per_kv_head: gl.constexpr = (KV_GROUP + HEADS - 1) // HEADS
    kv_head = head_block // blocks_per_kv_head
    first_local = (head_block % blocks_per_kv_head) * HEADS
    num_q_heads = NUM_KV_HEADS * KV_GROUP

    kv_start = gl.load(KvStart + row)
    seq_len = gl.load(KvLen + row)
    row_ok = (seq_len >= 0) & (kv_start >= 0) & (kv_start + seq_len <= num_kv_indices)
    seq_len = gl.where(row_ok, seq_len, 0)
    split_len = gl.cdiv(gl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = gl.minimum(lo + split_len, seq_len)

    # q^T per channel group, relabelled like K; its norms (radius) and -sum/512 (the dither's offset).
    q_chan = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _Q_LOAD)))
    q_head = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _Q_LOAD)))
    q_local = first_local + q_head
    q_ptrs = Q + row * stride_qb + (kv_head * KV_GROUP + q_local)[None, None, :] * stride_qh + q_chan[None, :, None]
    q_mask = (q_local < KV_GROUP)[None, None, :] & (q_chan < 32)[None, :, None]
    q_ptrs = q_ptrs.broadcast_to(4, 32, 8)
    q_mask = q_mask.broadcast_to(4, 32, 8)
    g0 = _q_group(q_ptrs, q_mask, 0)
    g1 = _q_group(q_ptrs, q_mask, 1)
    g2 = _q_group(q_ptrs, q_mask, 2)
    g3 = _q_group(q_ptrs, q_mask, 3)
    q_ops = (g0[0], g1[0], g2[0], g3[0])
    q_offset = (g0[1], g1[1], g2[1], g3[1])
    q_sq = (g0[2], g1[2], g2[2], g3[2])
    q_abs = (g0[3], g1[3], g2[3], g3[3])

    tail = gl.sqrt(2.0 * (gl.log(gl.maximum(seq_len, 1).to(gl.float32)) + log_two_over_delta))
    sigma_coef = sm_scale * sm_scale / 12.0
    bias_coef = sm_scale * beta

    # Index tensors of each layout the loop loads through.
    warp_t = gl.arange(0, 4, layout=gl.SliceLayout(1, _TOKEN_ROW))[:, None] * TOKENS
    tok_t = warp_t + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, _TOKEN_ROW))[None, :]  # [4, 32]
    words_l: gl.constexpr = gl.SliceLayout(2, _WORDS)
    tok_w = (
        gl.arange(0, 4, layout=gl.SliceLayout(1, words_l))[:, None] * TOKENS
        + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, words_l))[None, :]
    )
    lane_j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _WORDS)))[None, None, :]
    j_odd = (lane_j & 1) == 1
    call_a = (2 * (lane_j & 1) + (lane_j >> 1)).to(gl.uint32)
    k_tok_l: gl.constexpr = gl.SliceLayout(2, _K_GROUP)
    tok_k = (
        gl.arange(0, 4, layout=gl.SliceLayout(1, k_tok_l))[:, None] * TOKENS
        + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, k_tok_l))[None, :]
    )
    chan_k = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _K_GROUP)))[None, None, :]
    v_tok_l: gl.constexpr = gl.SliceLayout(2, _V_LOAD)
    tok_v = (
        gl.arange(0, 4, layout=gl.SliceLayout(1, v_tok_l))[:, None] * TOKENS
        + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, v_tok_l))[None, :]
    )
    chan_v = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, _V_LOAD)))[None, None, :]

    running_max = gl.full([4, 8], -_FP32_INF, gl.float32, _HEAD_ROW)
    running_sum = gl.zeros([4, 8], gl.float32, _HEAD_ROW)
    acc = gl.zeros([4, 128, 8], gl.float32, _MMA)
    a1_rest = gl.zeros([4, 8], gl.float32, _HEAD_ROW)
    b_rest = gl.zeros([4, 8], gl.float32, _HEAD_ROW)
    u_rest = gl.zeros([4, 8], gl.float32, _HEAD_ROW)
    w_rest = gl.zeros([4, 8], gl.float32, _HEAD_ROW)
    u_max = gl.zeros([4, 8], gl.float32, _HEAD_ROW)
    bad_slots = gl.zeros([4, 32], gl.int32, _TOKEN_ROW)

    head_word = kv_head.to(gl.uint32)
    # to_tensor: Triton passes an integer argument equal to 1 as a constant.
    layer_word = gl.to_tensor(layer).to(gl.uint32)
    key_lo = gl.to_tensor(seed_lo).to(gl.uint32)
    key_hi = gl.to_tensor(seed_hi).to(gl.uint32)
    for start in range(lo, hi, BLOCK_N):
        # The tile's tokens in each layout (the index loads hit L1 after the first).
        offs = start + tok_t
        in_split = offs < hi
        slots = gl.load(KvIndices + kv_start + offs, mask=in_split, other=0)
        in_range = (slots >= 0) & (slots < num_slots)
        bad_slots += (in_split & ~in_range).to(gl.int32)
        token_ok = in_split & in_range
        base = gl.where(token_ok, slots, 0) * NUM_KV_HEADS + kv_head
        if HAS_SKIP:
            token_ok = token_ok & (gl.load(Skip + base, mask=token_ok, other=1) == 0)

        offs_k = start + tok_k
        slots_k = gl.load(KvIndices + kv_start + offs_k, mask=offs_k < hi, other=0)
        slots_k = gl.where((slots_k >= 0) & (slots_k < num_slots), slots_k, 0)
        k_rows = (slots_k * NUM_KV_HEADS + kv_head)[:, :, None] * HEAD_DIM + chan_k

        offs_w = start + tok_w
        slots_w = gl.load(KvIndices + kv_start + offs_w, mask=offs_w < hi, other=0)
        slots_w = gl.where((slots_w >= 0) & (slots_w < num_slots), slots_w, 0).to(gl.uint32)
        c0 = slots_w[:, :, None].broadcast_to(4, 32, 4)
        c2 = gl.zeros([4, 32, 4], gl.uint32, _WORDS) + layer_word
        c3 = gl.zeros([4, 32, 4], gl.uint32, _WORDS) + head_word
        # Calls 2 j0 + j1 (group j0) and + 4 (group j0 + 2); the neighbour computes the other two.
        a0, a1, a2, a3 = _philox(key_lo, key_hi, c0, call_a.broadcast_to(4, 32, 4), c2, c3)
        b0, b1, b2, b3 = _philox(key_lo, key_hi, c0, (call_a + 4).broadcast_to(4, 32, 4), c2, c3)
        # A lane with j0 keeps words 2 j0, 2 j0 + 1 of each call and sends the other two.
        mine_a_lo = gl.where(j_odd, a2, a0)
        mine_a_hi = gl.where(j_odd, a3, a1)
        mine_b_lo = gl.where(j_odd, b2, b0)
        mine_b_hi = gl.where(j_odd, b3, b1)
        got_a_lo = _swap_with_neighbour(gl.where(j_odd, a0, a2))
        got_a_hi = _swap_with_neighbour(gl.where(j_odd, a1, a3))
        got_b_lo = _swap_with_neighbour(gl.where(j_odd, b0, b2))
        got_b_hi = _swap_with_neighbour(gl.where(j_odd, b1, b3))

        logits = gl.zeros([4, 32, 8], gl.float32, _MMA)
        sigma_sq = gl.zeros([4, 32, 8], gl.float32, _MMA)
        bias = gl.zeros([4, 32, 8], gl.float32, _MMA)
        for g in gl.static_range(4):
            if g % 2 == 0:
                own = ~j_odd
            else:
                own = j_odd
            if g < 2:
                word_lo = gl.where(own, mine_a_lo, got_a_lo)
                word_hi = gl.where(own, mine_a_hi, got_a_hi)
            else:
                word_lo = gl.where(own, mine_b_lo, got_b_lo)
                word_hi = gl.where(own, mine_b_hi, got_b_hi)
            words = gl.convert_layout(gl.join(word_lo, word_hi), gl.SliceLayout(4, _K_GROUP5))
            words = gl.reshape(words[:, :, :, :, None].broadcast_to(4, 32, 4, 2, 4), [4, 32, 32])
            words = gl.convert_layout(words, _K_GROUP)
            codes = gl.load(KCodes + k_rows + g * GROUP_SIZE)
            code_op, dither_op = _k_operands(codes, words)
            code_op = gl.convert_layout(_relabel_group(code_op, 2), _OP_A)
            dither_op = gl.convert_layout(_relabel_group(dither_op, 2), _OP_A)
            start_value = q_offset[g][:, None, :].broadcast_to(4, 32, 8)
            part = mma_v2(code_op, q_ops[g], start_value)
            part = mma_v2(dither_op, q_ops[g], part)
            scale_g = gl.load(KScales + base * 4 + g).to(gl.float32)[:, :, None]
            logits += part * scale_g
            if CERTIFICATE:
                sigma_sq += q_sq[g][:, None, :] * (scale_g * scale_g)
                bias += q_abs[g][:, None, :] * scale_g
        logits = gl.where(token_ok[:, :, None], logits * sm_scale, -_FP32_INF)

        tile_max = gl.max(logits, axis=1)
        new_max = gl.maximum(running_max, tile_max)
        shift = gl.where(new_max == -_FP32_INF, 0.0, new_max)
        alpha = gl.exp(running_max - shift)
        weights = gl.exp(logits - shift[:, None, :])
        running_sum = running_sum * alpha + gl.sum(weights, axis=1)

        if CERTIFICATE:
            radius = gl.where(token_ok[:, :, None], tail * gl.sqrt(sigma_sq * sigma_coef) + bias * bias_coef, 0.0)
            expm1_u, g_u = _expm1_and_g(radius)
            index = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, _TOKEN_ROW))[None, :, None].broadcast_to(4, 32, 8)
            index = gl.convert_layout(index, _MMA)
            tile_arg = gl.min(gl.where(logits == tile_max[:, None, :], index, TOKENS), axis=1)
            is_arg = index == tile_arg[:, None, :]
            u_arg = gl.sum(gl.where(is_arg, radius, 0.0), axis=1)
            expm1_arg, g_arg = _expm1_and_g(u_arg)
            rest = (~is_arg) & token_ok[:, :, None] & (weights > 0)
            tile_a1 = gl.sum(gl.where(rest, weights * expm1_u, 0.0), axis=1)
            tile_b = gl.sum(gl.where(rest, weights * g_u, 0.0), axis=1)
            tile_u = gl.sum(gl.where(rest, weights * radius, 0.0), axis=1)
            tile_w = gl.sum(gl.where(rest, weights, 0.0), axis=1)
            weight_arg = gl.exp(tile_max - shift)
            expm1_old, g_old = _expm1_and_g(u_max)
            moved = tile_max > running_max
            a1_rest = (
                _mul_nonneg(a1_rest, alpha)
                + tile_a1
                + gl.where(moved, _mul_nonneg(alpha, expm1_old), _mul_nonneg(weight_arg, expm1_arg))
            )
            b_rest = (
                _mul_nonneg(b_rest, alpha)
                + tile_b
                + gl.where(moved, _mul_nonneg(alpha, g_old), _mul_nonneg(weight_arg, g_arg))
            )
            u_rest = (
                _mul_nonneg(u_rest, alpha)
                + tile_u
                + gl.where(moved, _mul_nonneg(alpha, u_max), _mul_nonneg(weight_arg, u_arg))
            )
            w_rest = w_rest * alpha + tile_w + gl.where(moved, alpha, weight_arg)
            u_max = gl.where(moved, u_arg, u_max)

        # PV: V^T [channels, tokens] as v_hi + v_lo = s * code, weights 2**14 p as p_hi + p_mid.
        offs_v = start + tok_v
        slots_v = gl.load(KvIndices + kv_start + offs_v, mask=offs_v < hi, other=0)
        base_v = gl.where((slots_v >= 0) & (slots_v < num_slots), slots_v, 0) * NUM_KV_HEADS + kv_head
        v_codes = gl.load(VCodes + base_v[:, :, None] * HEAD_DIM + chan_v)
        pairs = _v_pairs(gl.convert_layout(v_codes, _V_PAIRS))
        # Element (token label 2T + x, channel label 4C + 2y + z) holds token 2T + z, channel 4C + 2x + y.
        pairs = gl.permute(gl.reshape(pairs, [4, 16, 2, 32, 2, 2]), [0, 1, 5, 3, 2, 4])
        v = gl.reshape(pairs, [4, 32, 4, 32])
        v_scale_l: gl.constexpr = gl.SliceLayout(3, v.type.layout)
        v_tok_s: gl.constexpr = gl.SliceLayout(2, v_scale_l)
        offs_s = start + (
            gl.arange(0, 4, layout=gl.SliceLayout(1, v_tok_s))[:, None] * TOKENS
            + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, v_tok_s))[None, :]
        )
        slots_s = gl.load(KvIndices + kv_start + offs_s, mask=offs_s < hi, other=0)
        base_s = gl.where((slots_s >= 0) & (slots_s < num_slots), slots_s, 0) * NUM_KV_HEADS + kv_head
        v_groups = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, v_scale_l)))[None, None, :]
        v_scale = gl.load(VScales + base_s[:, :, None] * 4 + v_groups)[:, :, :, None]
        v_hi = v * v_scale
        v_lo = gl.fma(v, v_scale, -v_hi)
        # Channel c -> MMA row 8 (c % 16) + c // 16, then [warp, channels, tokens].
        v_hi = gl.permute(
            gl.reshape(gl.permute(gl.reshape(v_hi, [4, 32, 8, 16]), [0, 1, 3, 2]), [4, 32, 128]), [0, 2, 1]
        )
        v_lo = gl.permute(
            gl.reshape(gl.permute(gl.reshape(v_lo, [4, 32, 8, 16]), [0, 1, 3, 2]), [4, 32, 128]), [0, 2, 1]
        )
        v_hi = gl.convert_layout(v_hi, _OP_A)
        v_lo = gl.convert_layout(v_lo, _OP_A)
        scaled = gl.convert_layout(weights * _P_SCALE, _OP_B)
        p_hi = scaled.to(gl.float16)
        p_mid = (scaled - p_hi.to(gl.float32)).to(gl.float16)
        acc = acc * alpha[:, None, :]
        acc = mma_v2(v_hi, p_hi, acc)
        acc = mma_v2(v_lo, p_hi, acc)
        acc = mma_v2(v_hi, p_mid, acc)
        running_max = new_max

    # Merge the four warps (the stage-2 algebra, with each warp's max in place of its LSE).
    top = gl.max(running_max, axis=0)  # [8]
    top_shift = gl.where(top == -_FP32_INF, 0.0, top)
    warp_weight = gl.exp(running_max - top_shift[None, :])  # [4, 8]
    total = gl.sum(running_sum * warp_weight, axis=0)
    safe_sum = gl.where(total > 0, total, 1.0)
    out = gl.sum(acc * gl.convert_layout(warp_weight, _HEAD_ROW)[:, None, :], axis=0)  # [128, 8]
    slots_ok = row_ok & (gl.sum(gl.sum(bad_slots, axis=1), axis=0) == 0)
    poison = gl.where(slots_ok, 0.0, (_FP32_INF - _FP32_INF))

    out_l: gl.constexpr = out.type.layout
    out_rows = gl.arange(0, 128, layout=gl.SliceLayout(1, out_l))
    out_heads = gl.arange(0, 8, layout=gl.SliceLayout(0, out_l))
    out_local = first_local + out_heads
    out_part = ((row * num_q_heads + kv_head * KV_GROUP + out_local) * NUM_SPLITS + split)[None, :]
    # MMA row m holds channel 16 (m % 8) + m // 8.
    out_chan = (16 * (out_rows % 8) + out_rows // 8)[:, None]
    out_sum = gl.convert_layout(safe_sum, gl.SliceLayout(0, out_l))
    gl.store(
        PartOut + out_part * HEAD_DIM + out_chan,
        out * (1.0 / _P_SCALE) / out_sum[None, :] + poison,
        mask=(out_local < KV_GROUP)[None, :],
    )
    heads_l: gl.constexpr = total.type.layout
    local = first_local + gl.arange(0, 8, layout=heads_l)
    head_ok = local < KV_GROUP
    part_row = (row * num_q_heads + kv_head * KV_GROUP + local) * NUM_SPLITS + split
    empty = total == 0
    gl.store(PartLse + part_row, gl.where(empty, -_FP32_INF, top + gl.log(safe_sum)) + poison, mask=head_ok)
    if CERTIFICATE:
        live = running_sum > 0
        warp_index = gl.arange(0, 4, layout=gl.SliceLayout(1, _HEAD_ROW))[:, None]
        winner = gl.min(gl.where(live & (running_max == top[None, :]), warp_index, 4), axis=0)
        loser = live & (warp_index != winner[None, :])
        expm1_w, g_w = _expm1_and_g(u_max)
        a1 = gl.sum(_mul_nonneg(warp_weight, a1_rest) + gl.where(loser, _mul_nonneg(warp_weight, expm1_w), 0.0), axis=0)
        b = gl.sum(_mul_nonneg(warp_weight, b_rest) + gl.where(loser, _mul_nonneg(warp_weight, g_w), 0.0), axis=0)
        u = gl.sum(_mul_nonneg(warp_weight, u_rest) + gl.where(loser, _mul_nonneg(warp_weight, u_max), 0.0), axis=0)
        p = gl.sum(warp_weight * w_rest + gl.where(loser, warp_weight, 0.0), axis=0)
        u_top = gl.sum(gl.where(warp_index == winner[None, :], u_max, 0.0), axis=0)
        gl.store(PartMax + part_row, top + poison, mask=head_ok)
        gl.store(PartA1 + part_row, a1 / safe_sum + poison, mask=head_ok)
        gl.store(PartB + part_row, b / safe_sum + poison, mask=head_ok)
        gl.store(PartURest + part_row, u / safe_sum + poison, mask=head_ok)
        gl.store(PartPRest + part_row, p / safe_sum + poison, mask=head_ok)
        gl.store(PartU + part_row, u_top + poison, mask=head_ok)
