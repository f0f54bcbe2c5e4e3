"""The tile functions, layouts and constants of the Gluon decode stage 1s: ``gluon_decode`` (the warps that
compute also copy the next tile) and ``gluon_decode_ws`` (a producer warpgroup copies, the consumers compute)
run the same arithmetic on a 128-token tile in shared memory, from these.

The Triton kernel (``triton_kernels.decode_stage1``) is limited by instruction issue: Triton builds the
tensor-core operands of the int8 tiles through shared memory and duplicated registers. Here every
layout is chosen so that the bytes a thread loads are the bytes its tensor-core fragment needs:

* **QK** runs with tokens as the MMA rows: ``logits^T [tokens, heads] = K [tokens, channels] x q^T``,
  so eight query heads fill the ``n8`` side exactly. Each thread loads 8 contiguous code bytes per
  (token, channel group) and the channel order inside a group is relabelled (a permutation applied to
  K and q alike, which a dot product ignores) so that those bytes are its fragment's ``k`` slots.
* **Dither.** K's ``xi = alpha_c`` (docs/THEORY.md, section 1) costs no per-token work: it enters once per
  split as ``sum_c q_c alpha_c`` per (head, group), the QK MMAs' start value.
* **PV** runs as ``out^T [channels, heads] = V^T [channels, tokens] x p^T`` in halves of 16 tokens and
  64 channels: ldmatrix's transposed form reads V's codes as 16-bit pairs of channels, so that each register
  holds one pair of tokens t and t + 1, the pairing an ``f16x2`` operand needs; one asm block per two tokens of
  two groups expands the bytes by ``prmt`` and scales them into ``s * code``, exact in fp16 (V's scales have 4
  significant bits), and the output channels are relabelled (undone at the store).
* **Warps are independent**: each owns 32 tokens of every 128-token tile with its own running max, sums and output
  accumulator; the four are merged once per split, with the same algebra as the split merge of stage 2. q's
  operands stay in registers where the loop has room for them; its dither offsets and the sigma^2 operand wait in
  shared memory. The weights' sum stays per thread too; an out-of-range slot poisons the row after the loop (a
  running maximum).
* **The certificate** (THEORY.md section 3) on the same tile: ``sigma^2`` per token and head from one tf32 MMA of
  the tile's scales with an operand built from q's norms (``_sigma_sq``); the radius is ``u = chat sigma`` with
  ``chat = c + kappa`` one number per split. A thread's four tokens of a warp's 32 (positions ``t``, ``t + 8``,
  ``t + 16``, ``t + 24`` of a 32-token block) are one *cell*: per tile and head it adds ``chat sqrt(W M)`` to
  ``U`` and ``chat^2 h(chat sqrt(largest sigma^2)) M`` to ``B`` (``_cell_sums``; ``W``, ``M`` the sums of ``p``
  and ``p sigma^2``), ``A1 = B + U``: a square root and one ``h`` per thread and head, no exponential per token.
  Only the row's first and last tiles of 128 (``is_end_tile``) take an argmax: there each warp's first argmax of
  its 32 tokens (its block's *singleton*) leaves its cell's ``W`` and ``M`` and either replaces the warp's *held*
  token (a strictly larger logit) or is folded into the rest sums with its exact terms ``p u``, ``p g(u)``. The
  held token's logit, ``u`` and ``g`` are kept per warp and head apart from the running max, which the tiles
  between the ends move. The rest sums stay per thread and are reduced over the lanes once per split, where the
  warps' held tokens meet (``store_split``).

A kernel runs, per split: ``query_operands`` and ``loop_start``; per tile, with its codes and scales in shared
memory (K's in one ``K_ROWS_SHARED`` buffer or one ``ROW_MAJOR`` buffer per channel group, read in ``K_GROUP``'s
placement; V's in ``V_LOAD``'s, in ``V_SHARED`` buffers), ``tile_tokens``, ``qk_tile``, ``softmax_tile``,
``tile_argmax`` (with the certificate, on an end tile) and ``tile_sigma_sq`` (with the certificate), ``pv_tokens``
on each 16-token half, ``v_dither_tile`` (a dithered V) and ``tile_certificate`` (``certificate_end_tile`` or
``certificate_tile``); then ``store_split``.

Values are those of the Triton kernel (docs/KERNELS.md, "Exactness"): the MMAs take ``-code``, exact in fp16,
and start from ``sum(q_g alpha_g)``, so that they compute the negated logit part ``-q_g . (code_g - alpha_g)`` up
to float32 sums (``_neg_codes``); the softmax scale is negated to match, and the loop keeps
logits in base-2 units (one ``ex2`` per weight). The output takes ``s * code``, exact in fp16, against ``2**14 p``
split into ``p_hi + p_mid``. The outputs are the stage-1
partials of the Triton kernel, so its stage 2 merges them. Supported: fp16 and bf16 queries (bf16 scaled per
head into fp16, ``_q_scale``), head_dim 128, channel groups of 32, 8-bit dithers, V rounded to nearest or
dithered (``V_DITHER``: the output less ``alpha_c W_g + Z_g``, ``_dither_sums``), no
outlier channels, fewer than 2**29 (slot, KV head) rows (``supports`` says; everything else runs the Triton
kernel); 64-bit code offsets for pools of 2**31 code bytes (``OFFSETS_64``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# Scalar and elementwise helpers are plain Triton functions, shared with the Triton kernel.
from witcert.kernels.triton_kernels import (
    END_TILE,
    g_of,
    inf_where_nan,
    mul_nonneg,
    slot_dither,
    slot_word,
    weighted,
)

NUM_WARPS = 4
# Per warp and tile: 32 tokens; per program: 8 query heads of one KV head.
TOKENS = gl.constexpr(32)
BLOCK_N = gl.constexpr(NUM_WARPS * 32)
HEADS = gl.constexpr(8)
HEAD_DIM = gl.constexpr(128)
GROUP_SIZE = gl.constexpr(32)

_FP32_INF = gl.constexpr(float("inf"))
_MIN_NORMAL = gl.constexpr(2.0**-126)  # float32's (and tf32's) smallest normal value
# The loop keeps its logits, maxima and shifts in base-2 units (the softmax scale times log2(e)), so that a
# weight is one ex2; the stored max and LSE go back to natural units. The scale is negated: the QK MMAs
# compute the negated logits (_qk_group).
_NEG_LOG2E = gl.constexpr(-1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)
# Triton 3.9 renamed Gluon's CTA barrier and its asynchronous copy (``async_load``: the kernels' copies to shared
# memory).
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
async_load = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
# Triton 3.9 made the view of a shared buffer as another dtype public (3.6: ``_reinterpret``, same arguments).
if not hasattr(gl.shared_memory_descriptor, "reinterpret"):
    gl.shared_memory_descriptor.reinterpret = gl.shared_memory_descriptor._reinterpret


_P_SCALE = gl.constexpr(16384.0)

# mma.sync m16n8k16, batched over the warps: [warp, rows, cols], each warp its own batch entry.
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
_OP_A = gl.constexpr(gl.DotOperandLayout(0, _MMA, 2))
_OP_B = gl.constexpr(gl.DotOperandLayout(1, _MMA, 2))
TOKEN_ROW = gl.constexpr(gl.SliceLayout(2, _MMA))  # [warp, token] beside the [warp, token, head] logits
_HEAD_ROW = gl.constexpr(gl.SliceLayout(1, _MMA))  # [warp, head]: per-warp softmax state
# K codes of one channel group, [warp, token, 32 channels]: a thread holds channels 8 j + (0..7) of its tokens
# (j = lane % 4), 8 contiguous bytes.
K_GROUP = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 8, 0], [0, 16, 0]],
        lane_bases=[[0, 0, 8], [0, 0, 16], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[4, 32, 32],
    )
)
# K codes of a tile as gluon_decode copies them, [group, warp, token, 32 channels]: the 16 lanes of a half-warp
# copy one token's whole 128-byte row, 8 bytes each, so that an instruction gathers 2 rows from the pool. Copied by
# group, 32 bytes of each of 8 tokens, it gathers 8 rows: 4 times the L1 wavefronts (docs/KERNELS.md).
K_ROWS = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 2, 0], [0, 0, 4, 0], [0, 0, 8, 0], [0, 0, 16, 0]],
        lane_bases=[[0, 0, 0, 8], [0, 0, 0, 16], [1, 0, 0, 0], [2, 0, 0, 0], [0, 0, 1, 0]],
        warp_bases=[[0, 1, 0, 0], [0, 2, 0, 0]],
        block_bases=[],
        shape=[4, 4, 32, 32],
    )
)
# Their buffer: a token's row of 128 bytes with group g at 32-byte place g ^ (t % 4), so that the copy's writes (2
# rows) and QK's reads of one group (8 tokens) each spread over all the banks.
K_ROWS_SHARED = gl.constexpr(
    gl.SharedLinearLayout(
        offset_bases=[
            [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 0, 8], [0, 0, 0, 16], [1, 0, 0, 0], [2, 0, 0, 0],
            [1, 0, 1, 0], [2, 0, 2, 0], [0, 0, 4, 0], [0, 0, 8, 0], [0, 0, 16, 0], [0, 1, 0, 0], [0, 2, 0, 0],
        ]
    )
)  # fmt: skip


def _with_unit_dim(layout: gl.constexpr) -> gl.constexpr:
    """``layout`` (a ``DistributedLinearLayout``) with a leading dimension of size 1 that no element moves along."""
    inner = layout.value

    def lead(bases: list[list[int]]) -> list[list[int]]:
        return [[0, *basis] for basis in bases]

    return gl.constexpr(
        gl.DistributedLinearLayout(
            reg_bases=lead(inner.reg_bases),
            lane_bases=lead(inner.lane_bases),
            warp_bases=lead(inner.warp_bases),
            block_bases=lead(inner.block_bases),
            shape=[1, *inner.shape],
        )
    )


# K_GROUP as the load of one group's [1, warp, token, 32] slice of that buffer (Triton 3.6 views a linear shared
# layout by slices only, not by index or reshape).
_K_GROUP_SLICE = _with_unit_dim(K_GROUP)
# V codes of 16 tokens per warp and half the channels, [warp, token, 64], as copied: index c is channel
# 16 (c // 8) + 8 half + c % 8, so a thread copies 8 contiguous bytes per token.
V_LOAD = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[4, 16, 64],
    )
)
# The same codes read as 16-bit pairs of indices, [warp, token, 32]: element j holds indices 2 j and 2 j + 1.
# _V_FRAGMENT is the placement of ldmatrix's transposed 8x8 16-bit matrices: a thread's register holds pair j of
# tokens t and t + 1 (t = 2 (lane % 4), plus 8), j = lane // 4 + 8 g, which is all the pairing the f16x2 operands
# need, and pair j's channels lie in group g. Registers in the order token, group's bit 0, token's bit 3, group's
# bit 1: one _v_split takes two tokens of two groups.
_V_FRAGMENT = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 0, 8], [0, 8, 0], [0, 0, 16]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[4, 16, 32],
    )
)
# V's scales as 32-bit words (a token's groups 2 w and 2 w + 1), [warp, token, w, group bit 0, 8], broadcast over
# the last two to _V_FRAGMENT's j = 8 (2 w + bit) + r; a thread's words, first in its registers, are 16 contiguous
# bytes a token pair (one load).
_V_WORDS5 = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0, 0], [0, 1, 0, 0, 0], [0, 8, 0, 0, 0], [0, 0, 0, 1, 0]],
        lane_bases=[[0, 2, 0, 0, 0], [0, 4, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4]],
        warp_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]],
        block_bases=[],
        shape=[4, 16, 2, 2, 8],
    )
)
_V_WORDS = gl.constexpr(gl.SliceLayout(3, gl.SliceLayout(4, _V_WORDS5)))
# A dithered V's scales read once more for the dither's sums, [4 half + warp, token, group], placed as the logits'
# rows hold token 32 warp + 16 half + t (_K_SCALES for V's buffer), so that no layout change follows the read.
_V_SCALES_ROWS = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0], [4, 0, 0]],
        lane_bases=[[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[8, 16, 4],
    )
)
# A dithered V's per-slot dither, one token per lane: [warp, token], lane bits 0-1 the token's bits 3-4, so that
# the four lanes of a quad hold the four tokens each of them needs in the logits' rows.
_SLOT_LANES = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[],
        lane_bases=[[0, 8], [0, 16], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[1, 0], [2, 0]],
        block_bases=[],
        shape=[4, 32],
    )
)
# A warp's 16 tokens of weights, [warp, token, head], as the logits hold them (an MMA accumulator: token rows r and
# r + 8, heads 2 c and 2 c + 1), named so that _transposed_blocks' registers are in this order whatever the
# softmax's reshapes leave.
_P_ROWS = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 8, 0]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[4, 16, 8],
    )
)
# sigma^2 as a tf32 MMA (_sigma_sq): operands [warp, token, k] x [warp, k, head], and the K scales read with
# the tokens and groups of the A operand (token rows 8 apart in registers, the group on the lane's low bits).
_RADIUS_A = gl.constexpr(gl.DotOperandLayout(0, _MMA, 1))
_RADIUS_B = gl.constexpr(gl.DotOperandLayout(1, _MMA, 1))
_RADIUS_SCALES = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [16, 0]],
        lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[32, 0], [64, 0]],
        block_bases=[],
        shape=[128, 4],
    )
)
# q^T of one group, [warp (broadcast), 32 channels, 8 heads], as loaded (then relabelled like K).
_Q_LOAD = gl.constexpr(gl.BlockedLayout([1, 1, 1], [1, 4, 8], [4, 1, 1], [2, 1, 0]))
_NORMS_SHARED = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
# The tile's codes and scales wait in shared memory, where a kernel's asynchronous copies put them. K codes:
# K_ROWS_SHARED (gluon_decode), or one buffer per group, [warp, token, 32 channels], row-major, so that the 4 lanes
# of one token row read 32 contiguous bytes (gluon_decode_ws). V: [warp, token, 64] with the offset bits ordered so
# that the 16 lanes of a half-warp (tokens 2, 4; channels 8, 16) read 128 contiguous bytes.
ROW_MAJOR = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
ROW_MAJOR_2D = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
# K scales of a tile, [token (32 warp + t), group], read with the tokens placed as in the logits' rows and
# a token's four groups (8 bytes) in one thread.
_K_SCALES = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[32, 0], [64, 0]],
        block_bases=[],
        shape=[128, 4],
    )
)
# V codes of a tile half: V_LOAD's [warp, token, 64] placed so that the 16 lanes of a half-warp copy 128 contiguous
# bytes, and each token's indices 16 i .. 16 i + 15 are one 16-byte row of an ldmatrix. V_PAIRS_SHARED is the same
# buffer as 16-bit pairs of indices (_V_FRAGMENT's [warp, token, 32]).
V_SHARED = gl.constexpr(
    gl.SharedLinearLayout(
        offset_bases=[
            [0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 2, 0], [0, 4, 0], [0, 0, 32], [0, 1, 0],
            [0, 8, 0], [1, 0, 0], [2, 0, 0],
        ]
    )
)  # fmt: skip
V_PAIRS_SHARED = gl.constexpr(
    gl.SharedLinearLayout(
        offset_bases=[
            [0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 1, 0], [0, 8, 0],
            [1, 0, 0], [2, 0, 0],
        ]
    )
)  # fmt: skip


def supports(
    *, q_dtype: object, head_dim: int, group_size: int, dither_bits: int, v_dither: bool, outliers: int, rows: int
) -> bool:
    """Whether this kernel covers a decode call on a pool of ``rows`` (slot, KV head) rows (everything else runs
    the Triton kernel). Rows and the scales' element offsets (``rows * 4``) are 32-bit; only the codes' byte
    offsets widen (``OFFSETS_64``), so pools of 2**29 rows or more take the Triton kernel."""
    import torch

    return (
        q_dtype in (torch.float16, torch.bfloat16)
        and head_dim == HEAD_DIM
        and group_size == GROUP_SIZE
        and dither_bits == 8
        and outliers == 0
        and rows * (HEAD_DIM // GROUP_SIZE) < 2**31
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
def _q_scale(q_ptrs, q_mask):
    """Per ``[warp, head]``, the power of two ``2**k`` that puts a bf16 query's largest magnitude in
    ``[2**13, 2**14)``: there ``2**k q`` is exact in fp16 down to ``2**-27`` of that magnitude (fp16's
    normal range), far below what float32 sums of the products keep, and ``2**k q code`` stays finite.
    A zero, subnormal or non-finite maximum keeps its exponent field clamped (the result only matters
    for finite, nonzero queries)."""
    amax = gl.max(gl.abs(gl.load(q_ptrs, mask=q_mask, other=0.0).to(gl.float32)), axis=1)
    for g in gl.static_range(1, HEAD_DIM // GROUP_SIZE):
        q_g = gl.load(q_ptrs + g * GROUP_SIZE, mask=q_mask, other=0.0).to(gl.float32)
        amax = gl.maximum(amax, gl.max(gl.abs(q_g), axis=1))
    biased = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    # 2**(13 - e) for amax in [2**e, 2**(e + 1)): biased exponent 127 + 13 - (biased - 127).
    return (gl.minimum(gl.maximum(267 - biased, 1), 254) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _q_group(q_ptrs, q_mask, g: gl.constexpr, q_scale):
    """Group ``g`` of q^T: the relabelled fp16 MMA operand ``q_scale q_g`` (a bf16 query, ``_q_scale``; an
    fp16 one as is, ``q_scale`` unused), ``|q_g|_2^2`` of the query itself, per ``[warp, head]``, and the operand
    in float32 ``[warp, channel, head]`` (laid out as loaded, channels not relabelled)."""
    q_g = gl.load(q_ptrs + g * GROUP_SIZE, mask=q_mask, other=0.0)
    q32 = q_g.to(gl.float32)
    if q_g.dtype == gl.bfloat16:
        operand = (q32 * q_scale[:, None, :]).to(gl.float16)
    else:
        operand = q_g
    operand32 = operand.to(gl.float32)
    return (
        gl.convert_layout(_relabel_group(operand, 1), _OP_B),
        gl.sum(q32 * q32, axis=1),
        operand32,
    )


@gluon.jit
def _tf32_hi(x):
    """``x`` with its low 13 mantissa bits cleared: exact in tf32, and ``x - hi`` is exact in float32."""
    return (x.to(gl.uint32, bitcast=True) & 0xFFFFE000).to(gl.float32, bitcast=True)


@gluon.jit
def _sigma_operand(groups, sigma_coef):
    """The tf32 MMA operand ``[warp, k, head]`` that turns a token's scales into its ``sigma^2``.

    Row ``k = 4 d + g`` meets the token's ``(hi, hi, lo, s_g)[d]`` (``_sigma_sq``; ``s_g^2 = hi + lo``).
    ``a_g = sm^2 |q_g|^2 / 12`` enters as ``(a_hi, a_lo, a_hi, 0)``, so that the products are
    ``hi a_hi + hi a_lo + lo a_hi``: within 2**-21 of the float32 value.
    """
    layout: gl.constexpr = _Q_LOAD
    k = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))[None, :, None]
    sigma = gl.zeros([4, 16, 8], gl.float32, layout)
    for g in gl.static_range(4):
        a = (groups[g][1] * sigma_coef)[:, None, :]
        # sm^2 |q_g|^2 / 12 can overflow float32 (bf16 queries near 2**62 and beyond): the reference's radius is
        # then +inf for every token. The split would make it NaN (inf - inf, and 0 * inf against an exact s_g^2),
        # so that head's infinity goes in at d = 3, where it meets s_g > 0 alone: +inf, at no cost in the loop.
        overflow = a == _FP32_INF
        a = gl.where(overflow, 0.0, a)
        a_hi = _tf32_hi(a)
        sigma = gl.where((k == g) | (k == 8 + g), a_hi, sigma)
        sigma = gl.where(k == 4 + g, a - a_hi, sigma)
        sigma = gl.where((k == 12 + g) & overflow, _FP32_INF, sigma)
    return sigma


@gluon.jit
def _sigma_sq(tile_scales, sigma_op):
    """``sigma^2 = sm^2 sum_g |q_g|^2 s_g^2 / 12`` per ``[warp, token, head]`` of the tile (the logits' layout), from
    one tf32 product of the tokens' scales with ``_sigma_operand``: exact products, float32 sums."""
    # A zero scale (an all-zero group) enters as 2**-126: an overflowed head's infinite operand row
    # (``_sigma_operand``) would meet it as 0 * inf, NaN, where the reference's radius is +inf. Elsewhere that row
    # is 0, and the square of 2**-126 flushes to 0. (A NaN scale, a NaN key written unvalidated, becomes 2**-126
    # here too; its logit stays NaN and poisons the row.)
    s = gl.maximum(gl.reshape(tile_scales.load(_RADIUS_SCALES).to(gl.float32), [4, 32, 4]), _MIN_NORMAL)
    s2 = s * s  # exact: an fp16 scale squared has at most 22 significant bits
    hi = _tf32_hi(s2)
    # [warp, token, g, i, o] -> k = 8 o + 4 i + g: (hi, hi, lo, s)[2 o + i].
    parts = gl.join(gl.join(hi, hi), gl.join(s2 - hi, s))
    scales = gl.convert_layout(gl.reshape(gl.permute(parts, [0, 1, 4, 3, 2]), [4, 32, 16]), _RADIUS_A)
    zero = gl.zeros([4, 32, 8], gl.float32, _MMA)
    return mma_v2(scales, sigma_op.load(_RADIUS_B), zero, input_precision="tf32")


@gluon.jit
def _exp2(x):
    """``2**x`` for the softmax weights (``x <= 0``, or -inf; the loop's logits are in base-2 units):
    ``ex2.approx.ftz``, which ``gl.exp2`` also runs, without the guard it adds for subnormal results. A
    weight below 2**-126 of the max becomes 0: it changes the output by less than 2**-110 relative, and
    every certificate term it enters is a weighted non-negative term (an infinite factor still makes +inf,
    ``weighted``)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


# The accumulator's registers alternate between the thread's two heads (its MMA columns 2 t and 2 t + 1), so
# inputs $32 and $33 are the alphas of both: the branch skips only where neither head's max moved.
_RESCALE_ASM = gl.constexpr(
    "{\n.reg .pred p;\nsetp.eq.f32 p, $32, 0f3F800000;\nsetp.eq.and.f32 p, $33, 0f3F800000, p;\n"
    "@p bra SKIP${:uid};\n" + "\n".join(f"mul.f32 ${i}, ${i}, ${32 + i};" for i in range(16)) + "\nSKIP${:uid}:\n}"
)
_RESCALE_CONSTRAINTS = gl.constexpr("=r," * 16 + ",".join(str(i) for i in range(16)) + "," + "r," * 15 + "r")


@gluon.jit
def _rescaled(acc, alpha):
    """``acc * alpha``, skipped by a branch where the thread's two heads' ``alpha`` are both 1 (their max did not
    move, as in most tiles of a long context): ``x * 1 = x``, so the bits are the same either way, and the 16
    multiplications are not issued."""
    return gl.inline_asm_elementwise(
        _RESCALE_ASM, _RESCALE_CONSTRAINTS, [acc, alpha], dtype=gl.float32, is_pure=True, pack=16
    )


@gluon.jit
def _neg_codes(codes):
    """Four stored codes -> fp16 ``-code``, two ``f16x2``: the stored byte ``code + 128`` (``pool.encode_codes``)
    under the fp16 exponent byte 0x64 is ``1152 + code``, and ``1152`` minus it is exact. With these the MMAs
    compute ``-(q_g . code_g)`` plus their start value (``_qk_group``)."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 offset;
        mov.b32 offset, 0x64806480;
        prmt.b32 $0, $2, 0x64646464, 0x4140;
        prmt.b32 $1, $2, 0x64646464, 0x4342;
        sub.rn.f16x2 $0, offset, $0;
        sub.rn.f16x2 $1, offset, $1;
        }
        """,
        "=r,=r,r",
        [codes],
        dtype=gl.float16,
        is_pure=True,
        pack=4,
    )


def _v_split_asm() -> str:
    """PTX of ``_v_split``: for the pack's group ``g`` = 0, then 1, the tokens' scales paired from their words ``$6,
    $7`` (low halves for group 0, high for 1), and the bytes of codes register ``$4 + g`` expanded into ``1152 +
    code``, less 1152, times the scale: ``s * code`` (outputs ``$0 + g`` even, ``$2 + g`` odd)."""
    groups = "".join(
        f"prmt.b32 s, $6, $7, {selector};\n"
        f"prmt.b32 even, ${4 + g}, 0x64646464, 0x4240;\n"
        f"prmt.b32 odd, ${4 + g}, 0x64646464, 0x4341;\n"
        "add.rn.f16x2 even, even, offset;\nadd.rn.f16x2 odd, odd, offset;\n"
        f"mul.rn.f16x2 ${g}, even, s;\nmul.rn.f16x2 ${2 + g}, odd, s;\n"
        for g, selector in ((0, "0x5410"), (1, "0x7632"))
    )
    return "{\n.reg .b32 even, odd, offset, s;\nmov.b32 offset, 0xE480E480;\n" + groups + "}"


_V_SPLIT_ASM = gl.constexpr(_v_split_asm())


@gluon.jit
def _v_split(pairs, words):
    """Two tokens t, t + 1 of two groups' index pairs (``_V_FRAGMENT``'s registers: pair j of both tokens, token
    t in the low half, for group 2 w and then 2 w + 1) and the tokens' scale words (``_V_WORDS5``: token t's and
    t + 1's groups 2 w, 2 w + 1) -> ``(even, odd)``, ``f16x2`` words (token t, token t + 1) of ``s * code`` for
    index 2 j (even) and 2 j + 1 (odd).

    One ``prmt`` a channel puts the two tokens' bytes under the fp16 exponent byte 0x64 (``1152 + code``,
    ``_neg_codes``) and one subtraction takes 1152 off (exact); one ``prmt`` a group pairs the tokens' scales.
    The product is exact: V's scales have 4 significant bits and a code at most 7, so ``s * code`` has at most 11
    on the 2**-24 grid (``reference.V_SCALE_SIGNIFICANT_BITS``).
    """
    return gl.inline_asm_elementwise(
        _V_SPLIT_ASM,
        "=r,=r,=r,=r,r,r,r,r,r,r",
        [pairs, words],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _v_operand(even, odd):
    """``_v_split``'s even and odd halves ``[warp, token, 32]`` -> ``V^T [warp, MMA row, token]``, the operand
    ``_OP_A``: row ``16 M + 8 e + r`` holds index ``2 (8 M + r) + e``, which is where ``_V_FRAGMENT`` already put
    it (no data moves)."""
    x = gl.reshape(gl.join(even, odd), [4, 16, 4, 8, 2])  # [warp, token, M, r, e]
    x = gl.reshape(gl.permute(x, [0, 2, 4, 3, 1]), [4, 64, 16])
    return gl.convert_layout(x, _OP_A)


@gluon.jit
def _transposed_blocks(x):
    """fp16 ``[warp, 16 tokens, 8 heads]`` in ``_P_ROWS`` (a thread: token rows ``r`` and ``r + 8``, heads ``2 c`` and
    ``2 c + 1``) -> each 8x8 block transposed by ``movmatrix``: element ``(8 b + i, j)`` out is ``(8 b + j,
    i)`` in (``_p_operand`` relabels it back)."""
    return gl.inline_asm_elementwise(
        "movmatrix.sync.aligned.m8n8.trans.b16 $0, $2;\nmovmatrix.sync.aligned.m8n8.trans.b16 $1, $3;",
        "=r,=r,r,r",
        [x],
        dtype=gl.float16,
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _p_operand(x):
    """fp16 weights ``[warp, 16 tokens, 8 heads]`` in the logits' layout -> the PV operand ``p^T`` (``_OP_B``): the
    tokens go from the rows' lanes to the k slots, the heads from the k slots to the lanes, which is a transpose of
    each 8x8 block of 16-bit values (``_transposed_blocks``), one ``movmatrix`` a register instead of shuffles."""
    y = gl.reshape(_transposed_blocks(x), [4, 2, 8, 8])
    return gl.convert_layout(gl.reshape(gl.permute(y, [0, 1, 3, 2]), [4, 16, 8]), _OP_B)


@gluon.jit
def program_heads(KV_GROUP: gl.constexpr):
    """This program's batch row, split, KV head and first query head within the KV head's group: the grid is
    (rows, blocks of ``HEADS`` query heads, splits), and a KV head's group may take several blocks."""
    head_block = gl.program_id(1)
    blocks_per_kv_head: gl.constexpr = (KV_GROUP + HEADS - 1) // HEADS
    kv_head = head_block // blocks_per_kv_head
    first_local = (head_block % blocks_per_kv_head) * HEADS
    return gl.program_id(0), gl.program_id(2), kv_head, first_local


@gluon.jit
def slot_row(slots, num_slots, NUM_KV_HEADS: gl.constexpr, kv_head):
    """Row ``slot * H_kv + kv_head`` of ``slots``, an out-of-range slot clamped to a real one (it weighs nothing).
    32-bit (``supports`` asks for fewer than 2**29 rows); the copies widen the byte offsets where the pool's
    codes reach 2**31 bytes (``OFFSETS_64``)."""
    slot = gl.minimum(slots.to(gl.uint32), (num_slots - 1).to(gl.uint32))
    return slot.to(gl.int32) * NUM_KV_HEADS + kv_head


@gluon.jit
def _k_group_scales(k_scales):
    """A tile's K scales from shared memory: four ``[warp, token]`` fp32 tensors laid out as the logits' rows."""
    return _by_group(gl.reshape(k_scales.load(_K_SCALES).to(gl.float32), [4, 32, 4]))


@gluon.jit
def _by_group(scales):
    """``[warp, token, group]`` scales -> four ``[warp, token]`` tensors, one per group, in the logits' rows."""
    both = gl.reshape(scales, [4, 32, 2, 2])
    even, odd = gl.split(both)  # groups 0, 2 and 1, 3
    g0, g2 = gl.split(even)
    g1, g3 = gl.split(odd)
    return (
        gl.convert_layout(g0, TOKEN_ROW),
        gl.convert_layout(g1, TOKEN_ROW),
        gl.convert_layout(g2, TOKEN_ROW),
        gl.convert_layout(g3, TOKEN_ROW),
    )


@gluon.jit
def pv_tokens(acc0, acc1, weights, v_tiles, v_scales):
    """``acc += V^T p^T`` over 16 tokens per warp (``v_tiles``: their codes, the two channel halves;
    ``v_scales``: their scales), the channels in two halves (``acc0``: channels with bit 3 clear, ``acc1``:
    set), V as ``s * code`` (exact in fp16) and ``2**14 p`` as ``p_hi + p_mid``: two fp16 MMAs per half. The codes
    are read by ldmatrix's transposed form (``_V_FRAGMENT``), which pairs the tokens."""
    words = v_scales.reinterpret(gl.int32, [4, 16, 2], ROW_MAJOR).load(_V_WORDS)
    words = gl.reshape(words[:, :, :, None, None].broadcast_to(4, 16, 2, 2, 8), [4, 16, 32])
    words = gl.convert_layout(words, _V_FRAGMENT)
    weights = gl.convert_layout(weights, _P_ROWS)
    p_hi = weights.to(gl.float16)
    p_mid = (weights - p_hi.to(gl.float32)).to(gl.float16)
    p_hi = _p_operand(p_hi)
    p_mid = _p_operand(p_mid)
    for half in gl.static_range(2):
        pairs = v_tiles[half].reinterpret(gl.int16, [4, 16, 32], V_PAIRS_SHARED).load(_V_FRAGMENT)
        even, odd = _v_split(pairs, words)
        v = _v_operand(even, odd)
        if half == 0:
            acc0 = mma_v2(v, p_hi, acc0)
            acc0 = mma_v2(v, p_mid, acc0)
        else:
            acc1 = mma_v2(v, p_hi, acc1)
            acc1 = mma_v2(v, p_mid, acc1)
    return acc0, acc1


@gluon.jit
def _v_group_scales(v_scales):
    """A tile's V scales from shared memory (``[4 half + warp, token, group]``, as copied): four ``[warp, token]``
    fp32 tensors laid out as the logits' rows (token ``16 half + t`` of each warp)."""
    both = gl.reshape(v_scales.load(_V_SCALES_ROWS).to(gl.float32), [2, 4, 16, 4])
    return _by_group(gl.reshape(gl.permute(both, [1, 0, 2, 3]), [4, 32, 4]))


@gluon.jit
def _dither_sums(sums, weights, v_scales, beta, rest_alpha):
    """A dithered V's two sums per (head, group), rescaled to the tile's max and with its tokens added, per thread
    over its own tokens: ``W_g = sum_t p_t s_{t,g}`` (``sums[g]``) and ``Z_g = sum_t p_t s_{t,g} beta_t``
    (``sums[4 + g]``). The output subtracts ``alpha_c W_g + Z_g`` (``_store_out``)."""
    scales = _v_group_scales(v_scales)
    weight_sums = ()
    beta_sums = ()
    for g in gl.static_range(4):
        scaled = weights * scales[g][:, :, None]
        weight_sums = weight_sums + (sums[g] * rest_alpha + _thread_sum(scaled),)
        beta_sums = beta_sums + (sums[4 + g] * rest_alpha + _thread_sum(scaled * beta[:, :, None]),)
    return weight_sums + beta_sums


@gluon.jit
def _qk_group(
    logits, k_tiles, scale, q_ops, q_alpha_sums, g: gl.constexpr, Q_IN_REGISTERS: gl.constexpr,
    K_SLICES: gl.constexpr,
):  # fmt: skip
    """Channel group ``g`` of the tile: one MMA of ``-code`` with q, started from the dither's share
    ``sum(q_g alpha_g)`` (``q_alpha_sums``, per head), so that it computes ``-q_g . (code_g - alpha_g)``; scaled
    by ``scale`` into the negated logits (the softmax scale undoes the sign)."""
    if K_SLICES:
        codes = gl.reshape(k_tiles[g].load(_K_GROUP_SLICE), [4, 32, 32])
    else:
        codes = k_tiles[g].load(K_GROUP)
    code_op = gl.convert_layout(_relabel_group(_neg_codes(codes), 2), _OP_A)
    q_alpha = q_alpha_sums.index(g).load(_HEAD_ROW)
    start = q_alpha[:, None, :].broadcast_to(4, 32, 8)
    if Q_IN_REGISTERS:
        q_op = q_ops[g]
    else:
        q_op = q_ops[g].load(_OP_B)
    part = mma_v2(code_op, q_op, start)
    return logits + part * scale[:, :, None]


@gluon.jit
def _thread_sum(x):
    """``[warp, token, head]`` (logits' layout) summed over the four tokens each thread holds (token bits 3
    and 4 are register bits): ``[warp, token % 8, head]``, no lane exchange."""
    return gl.sum(gl.reshape(x, [4, 4, 8, 8]), axis=1)


@gluon.jit
def _thread_max(slots):
    """``[warp, token]`` (the logits' token layout) reduced to its maximum over the four tokens each thread
    holds: ``[warp, token % 8]``, one register a thread, no lane exchange."""
    return gl.max(gl.reshape(slots, [4, 4, 8]), axis=1)


def _h_asm() -> str:
    """PTX of ``_h_of`` for a thread's two arguments ``$2, $3`` into ``$0, $1``: ``g_of``'s series without its factor
    ``x^2`` (Horner, fp32 constants 1/720, 1/120, 1/24, 1/6, 1/2) for both; past the branch, which a thread takes
    when both are below 1/4, ``(exp(x) - 1 - x) rcp(max(x^2, 1/16))`` (``ex2.approx.ftz`` of ``x log2 e``,
    ``rcp.approx.ftz``; a NaN read as +inf) replaces it where ``x >= 1/4``."""
    series = "".join(
        f"fma.rn.f32 ${i}, ${2 + i}, 0f3AB60B61, 0f3C088889;\n"
        f"fma.rn.f32 ${i}, ${i}, ${2 + i}, 0f3D2AAAAB;\n"
        f"fma.rn.f32 ${i}, ${i}, ${2 + i}, 0f3E2AAAAB;\n"
        f"fma.rn.f32 ${i}, ${i}, ${2 + i}, 0f3F000000;\n"
        for i in range(2)
    )
    quotient = "".join(
        f"mul.rn.f32 t, ${2 + i}, 0f3FB8AA3B;\n"
        "ex2.approx.ftz.f32 t, t;\n"
        "sub.rn.f32 t, t, 0f3F800000;\n"
        f"sub.rn.f32 t, t, ${2 + i};\n"
        f"mul.rn.f32 d, ${2 + i}, ${2 + i};\n"
        "max.f32 d, d, 0f3D800000;\n"
        "rcp.approx.ftz.f32 d, d;\n"
        "mul.rn.f32 t, t, d;\n"
        "testp.notanumber.f32 nan, t;\n"
        "@nan mov.b32 t, 0f7F800000;\n"
        f"setp.ge.f32 big, ${2 + i}, 0f3E800000;\n"
        f"@big mov.b32 ${i}, t;\n"
        for i in range(2)
    )
    return (
        "{\n.reg .pred small, big, nan;\n.reg .b32 t, d, m;\n"
        + series
        + "max.f32 m, $2, $3;\nsetp.lt.f32 small, m, 0f3E800000;\n"
        + "@small bra SERIES${:uid};\n"
        + quotient
        + "SERIES${:uid}:\n}"
    )


_H_ASM = gl.constexpr(_h_asm())


@gluon.jit
def _h_of(x):
    """``h(x) = g(x) / x^2`` (``reference.h_of``) for ``x >= 0``, as ``g_of(x, FAST_EXP=True) / x^2`` with the
    exponential behind a branch (``_h_asm``): a thread whose two arguments are below 1/4, as they are where
    certificates are small, runs ``g_of``'s series without its factor ``x^2`` alone (truncation below 4e-7 relative;
    no ``x^2`` that could underflow into a division). From 1/4 on, ``(exp(x) - 1 - x) / x^2`` by ``ex2.approx.ftz``
    and ``rcp.approx.ftz`` (relative error below 1e-5 there; past ``x^2 = 2**126`` the reciprocal flushes to 0
    where ``g`` is +inf already). ``+inf`` where ``g`` overflows (``inf / x^2``, and at ``x = +inf`` ``(inf - inf)
    * 0``, read as +inf), never NaN."""
    return gl.inline_asm_elementwise(_H_ASM, "=r,=r,r,r", [x], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _cell_sums(cell_weights, sigma_sq, chat):
    """One tile's ``(B, U, W)`` terms per thread and head (``[warp, token % 8, head]``): a thread's four tokens of its
    warp's 32 are a cell (THEORY.md section 3, "Where the sums are taken"), and with ``W`` and ``M`` the sums of
    ``cell_weights`` and ``cell_weights sigma^2`` over them, ``U = chat sqrt(W M)`` bounds ``sum p u`` and ``B =
    chat^2 h(chat sqrt(largest sigma^2)) M`` bounds ``sum p g(u)`` (``u = chat sigma``). ``cell_weights`` is 0 at a
    singleton, whose ``sigma^2`` still counts in the largest. A NaN from ``0 * inf`` in ``B`` reads as +inf; in
    ``U`` it is read so after the loop (``store_split``)."""
    tile_w = _thread_sum(cell_weights)
    tile_m = _thread_sum(cell_weights * sigma_sq)
    largest = gl.max(gl.reshape(sigma_sq, [4, 4, 8, 8]), axis=1)
    tile_b = inf_where_nan((chat * chat) * _h_of(chat * gl.sqrt(largest)) * tile_m)
    return tile_b, chat * gl.sqrt(tile_w * tile_m), tile_w


@gluon.jit
def _rescaled_fold(rescaled, tile, fold_row, fold):
    """A per-thread rest sum after a tile: the old one ``rescaled`` to the new max, plus the tile's terms and,
    on lane row 0, the singleton folded back (the tile's, or the warp's held token that it replaced)."""
    return (
        rescaled
        + tile
        + gl.where(fold_row, gl.convert_layout(fold, gl.SliceLayout(1, rescaled.type.layout))[:, None, :], 0.0)
    )


@gluon.jit
def _store_out(
    PartOut, acc, warp_weight, total, poison, part_heads, split, num_heads, NUM_SPLITS: gl.constexpr,
    half: gl.constexpr, V_DITHER: gl.constexpr, v_alpha_ptr, dither_sums,
):  # fmt: skip
    """The four warps' output of one channel half, merged and normalised, into the split's partial row; with a
    dithered V, less ``alpha_c W_g + Z_g`` (``dither_sums``: the four ``W_g``, then the four ``Z_g``, per head;
    ``v_alpha_ptr``: the KV head's ``alpha``)."""
    out = gl.sum(acc * warp_weight[:, None, :], axis=0)  # [64, 8]
    out_l: gl.constexpr = out.type.layout
    mma_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))[:, None]
    heads = gl.arange(0, 8, layout=gl.SliceLayout(0, out_l))[None, :]
    # MMA row m = 16 M + 8 e + r of channel half h holds index c = 2 (8 M + r) + e (_v_operand), channel
    # 16 (c // 8) + 8 h + c % 8 (V_LOAD).
    index = 2 * (8 * (mma_rows // 16) + mma_rows % 8) + (mma_rows // 8) % 2
    channels = 16 * (index // 8) + 8 * half + index % 8
    total = gl.convert_layout(total, gl.SliceLayout(0, out_l))[None, :]
    out = out * (1.0 / _P_SCALE)
    if V_DITHER:
        group = channels // GROUP_SIZE
        per_head: gl.constexpr = gl.SliceLayout(0, out_l)
        weight_sum = gl.zeros([64, 8], gl.float32, out_l)
        beta_sum = gl.zeros([64, 8], gl.float32, out_l)
        for g in gl.static_range(4):
            weight_sum = gl.where(group == g, gl.convert_layout(dither_sums[g], per_head)[None, :], weight_sum)
            beta_sum = gl.where(group == g, gl.convert_layout(dither_sums[4 + g], per_head)[None, :], beta_sum)
        out = out - (gl.load(v_alpha_ptr + channels) * weight_sum + beta_sum)
    gl.store(
        PartOut + ((part_heads + heads) * NUM_SPLITS + split) * HEAD_DIM + channels,
        out / total + poison,
        mask=heads < num_heads,
    )


@gluon.jit
def loop_start():
    """The token loop's state before the first tile: per warp the running max and output accumulators; per thread
    over its own tokens (``_thread_sum``, reduced over the lanes once per split) the sum of the weights and the
    rest sums of B, U and P (every token but the warp's held one; A1 = B + U), folded singletons going to lane row
    0 (``fold_row``); per warp and head the held token's logit (``-inf``: none yet), u and g; the running maximum of
    the slots."""
    running_max = gl.full([4, 8], -_FP32_INF, gl.float32, _HEAD_ROW)
    acc0 = gl.zeros([4, 64, 8], gl.float32, _MMA)
    acc1 = gl.zeros([4, 64, 8], gl.float32, _MMA)
    running_sum = _thread_sum(gl.zeros([4, 32, 8], gl.float32, _MMA))
    rest_l: gl.constexpr = running_sum.type.layout
    fold_row = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, rest_l)))[None, :, None] == 0
    u_max = gl.zeros([4, 8], gl.float32, _HEAD_ROW)
    slot_max = _thread_max(gl.zeros([4, 32], gl.uint32, TOKEN_ROW))
    held = (running_max, u_max, u_max)
    return running_max, acc0, acc1, running_sum, (running_sum, running_sum, running_sum), held, slot_max, fold_row


@gluon.jit
def tile_tokens(slots, in_split, slot_max, max_slot, Skip, kv_head, NUM_KV_HEADS: gl.constexpr,
                HAS_SKIP: gl.constexpr):  # fmt: skip
    """The tile's live tokens (``[warp, token]``: in the split and not skipped) and the running maximum of the
    slots. The tile's tokens were read clamped rather than masked: a token past the end or out of range reads a
    real slot (codes and scales are finite). One past the end weighs nothing (``in_split``); one out of range
    (negative ones are past 2**31 as unsigned) poisons the row after the loop (``slot_max``), so the tile needs
    no mask for it."""
    slot_max = gl.maximum(slot_max, _thread_max(slots.to(gl.uint32)))
    token_ok = in_split
    safe_slots = gl.minimum(slots.to(gl.uint32), max_slot)
    if HAS_SKIP:
        base = safe_slots.to(gl.int32) * NUM_KV_HEADS + kv_head  # Skip has one byte per row: 32 bits suffice
        token_ok = token_ok & (gl.load(Skip + base, mask=token_ok, other=1) == 0)
    return token_ok, slot_max


@gluon.jit
def qk_tile(k_tiles, tile_scales, q_ops, q_alpha_sums, Q_IN_REGISTERS: gl.constexpr, K_SLICES: gl.constexpr):
    """A tile's negated logits before the softmax scale, ``[warp, token, head]``, from its codes (``k_tiles``: the
    four groups' ``[1, warp, token, 32]`` slices of a ``K_ROWS_SHARED`` buffer where ``K_SLICES``, else four group
    buffers) and scales in shared memory; q's operands ``q_ops`` in registers or in shared memory
    (``Q_IN_REGISTERS``, as ``query_operands`` made them)."""
    group_scales = _k_group_scales(tile_scales)
    logits = gl.zeros([4, 32, 8], gl.float32, _MMA)
    for g in gl.static_range(4):
        logits = _qk_group(logits, k_tiles, group_scales[g], q_ops, q_alpha_sums, g, Q_IN_REGISTERS, K_SLICES)
    return logits


@gluon.jit
def softmax_tile(logits, token_ok, logit_scale, running_max, running_sum, acc0, acc1):
    """The online softmax over one tile: its scaled logits (``-inf`` where a token is not live), their max per warp
    and head, the new running max and its finite shift, the old frame's weight ``alpha`` on the rest sums' layout
    (``rest_alpha``), the weights, the running sum with the tile's weights, the weights as PV's two
    16-token halves (``2**14 p``), and the output accumulators rescaled to the new max."""
    logits = gl.where(token_ok[:, :, None], logits * logit_scale, -_FP32_INF)
    tile_max = gl.max(logits, axis=1)
    new_max = gl.maximum(running_max, tile_max)
    shift = gl.where(new_max == -_FP32_INF, 0.0, new_max)
    alpha = _exp2(running_max - shift)
    weights = _exp2(logits - shift[:, None, :])
    rest_alpha = gl.convert_layout(alpha, gl.SliceLayout(1, running_sum.type.layout))[:, None, :]
    running_sum = running_sum * rest_alpha + _thread_sum(weights)
    # PV in two halves of 16 tokens per warp (token bit 4 of the logits is a register bit).
    halves = gl.permute(gl.reshape(weights * _P_SCALE, [4, 2, 16, 8]), [0, 2, 3, 1])
    first, second = gl.split(halves)
    acc0 = _rescaled(acc0, alpha[:, None, :].broadcast_to(4, 64, 8))
    acc1 = _rescaled(acc1, alpha[:, None, :].broadcast_to(4, 64, 8))
    return logits, tile_max, new_max, shift, rest_alpha, weights, running_sum, first, second, acc0, acc1


@gluon.jit
def v_dither_tile(sums, KvIndices, kv_start, start, hi, max_slot, seed, layer, kv_head, weights, v_scales, rest_alpha):
    """A dithered V's sums (``_dither_sums``) after the tile at ``start``: ``beta_t`` from one Philox call per token
    (counter word 3 ``kv_head | 1 << 31``) in a layout of one token per lane, then moved to the logits' rows."""
    tok_lanes = (
        gl.arange(0, 4, layout=gl.SliceLayout(1, _SLOT_LANES))[:, None] * TOKENS
        + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, _SLOT_LANES))[None, :]
    )
    lane_slots = gl.load(KvIndices + kv_start + gl.minimum(start + tok_lanes, hi - 1))
    lane_slots = gl.minimum(lane_slots.to(gl.uint32), max_slot)
    v_beta = slot_dither(slot_word(seed, lane_slots, layer, kv_head.to(gl.uint32) | (1 << 31)), 8)
    v_beta = gl.convert_layout(v_beta, TOKEN_ROW)
    return _dither_sums(sums, weights, v_scales, v_beta, rest_alpha)


@gluon.jit
def is_end_tile(start, seq_len):
    """Whether the tile at ``start`` (a multiple of 128 from the row's start, as splits are) holds end tokens
    (``reference.end_tokens``): positions below 128 or from ``((seq_len - 1) // 128) * 128`` on. One scalar for
    the whole program: a branch every thread takes alike."""
    return (start < END_TILE) | (start + BLOCK_N > (seq_len - 1) // END_TILE * END_TILE)


@gluon.jit
def end_tile_argmax(end_tile, logits, tile_max):
    """``tile_argmax`` on an end tile (``is_end_tile``); between the end tiles, which take no argmax, ``TOKENS``
    (past every token: ``tile_certificate`` does not read it there)."""
    if end_tile:
        tile_arg = tile_argmax(logits, tile_max)
    else:
        tile_arg = gl.zeros_like(tile_max).to(gl.int32) + TOKENS
    return tile_arg


@gluon.jit
def tile_argmax(logits, tile_max):
    """Per ``[warp, head]``, the first of the warp's 32 tokens whose logit is its max: its 32-token block's
    singleton, on an end tile. Found before PV, so that the logits are not live through it. A warp with no live
    token gets its first token, whose weight and ``sigma`` are 0."""
    return gl.min(gl.where(logits == tile_max[:, None, :], _token_index(), TOKENS), axis=1)


@gluon.jit
def _token_index():
    """Each ``[warp, token, head]`` element's token within its warp's 32, in the logits' layout."""
    index = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, TOKEN_ROW))[None, :, None].broadcast_to(4, 32, 8)
    return gl.convert_layout(index, _MMA)


@gluon.jit
def tile_sigma_sq(tile_scales, sigma_op, token_ok):
    """The tile's ``sigma^2`` (``_sigma_sq``) per ``[warp, token, head]``, 0 where a token is not live."""
    return gl.where(token_ok[:, :, None], _sigma_sq(tile_scales, sigma_op), 0.0)


@gluon.jit
def certificate_tile(rest_alpha, weights, sigma_sq, chat, rest):
    """A tile between the row's end tiles: the rest sums ``(B, U, P)`` rescaled to the new max with every token in
    its cell (``_cell_sums``). No argmax: the held token stays as it is."""
    b_rest, u_rest, w_rest = rest
    tile_b, tile_u, tile_w = _cell_sums(weights, sigma_sq, chat)
    return weighted(rest_alpha, b_rest) + tile_b, u_rest * rest_alpha + tile_u, w_rest * rest_alpha + tile_w


@gluon.jit
def certificate_end_tile(tile_arg, tile_max, shift, rest_alpha, weights, sigma_sq, chat, fold_row, rest, held):
    """An end tile: each warp's singleton (``tile_argmax``) out of its cell, the rest sums ``(B, U, P)`` rescaled to
    the new max with the cells' terms (``_cell_sums``), and the held token ``(logit, u, g)`` per warp and head.
    The singleton replaces the held token where its logit is strictly larger (so the first of equal ones stays);
    the one of the two that is not held is folded into the rest sums with its exact terms ``p``, ``p u``, ``p
    g(u)``, its weight ``p`` in the tile's frame (0 where the warp held none, or the tile had no live token)."""
    b_rest, u_rest, w_rest = rest
    held_z, u_max, g_max = held
    is_arg = _token_index() == tile_arg[:, None, :]
    u_arg = chat * gl.sqrt(gl.sum(gl.where(is_arg, sigma_sq, 0.0), axis=1))
    g_arg = g_of(u_arg, True)
    tile_b, tile_u, tile_w = _cell_sums(gl.where(is_arg, 0.0, weights), sigma_sq, chat)
    moved = tile_max > held_z
    fold_w = _exp2(gl.where(moved, held_z, tile_max) - shift)
    fold_b = weighted(fold_w, gl.where(moved, g_max, g_arg))
    fold_u = fold_w * gl.where(moved, u_max, u_arg)
    b_rest = _rescaled_fold(weighted(rest_alpha, b_rest), tile_b, fold_row, fold_b)
    u_rest = _rescaled_fold(u_rest * rest_alpha, tile_u, fold_row, fold_u)
    w_rest = _rescaled_fold(w_rest * rest_alpha, tile_w, fold_row, fold_w)
    held = (gl.where(moved, tile_max, held_z), gl.where(moved, u_arg, u_max), gl.where(moved, g_arg, g_max))
    return (b_rest, u_rest, w_rest), held


@gluon.jit
def tile_certificate(end_tile, tile_arg, tile_max, shift, rest_alpha, weights, sigma_sq, chat, fold_row, rest, held):
    """The certificate's state ``(rest, held)`` after a tile: ``certificate_end_tile`` on the row's end tiles,
    ``certificate_tile`` between them (``end_tile``, a scalar: the whole program takes one side)."""
    if end_tile:
        rest, held = certificate_end_tile(tile_arg, tile_max, shift, rest_alpha, weights, sigma_sq, chat, fold_row,
                                          rest, held)  # fmt: skip
    else:
        rest = certificate_tile(rest_alpha, weights, sigma_sq, chat, rest)
    return rest, held


@gluon.jit
def store_split(
    acc0, acc1, running_max, running_sum, rest, held, slot_max, dither_sums, row_ok, num_slots, row, split, kv_head,
    first_local, VAlpha, PartOut, PartLse, PartMax, PartA1, PartB, PartURest, PartPRest, PartU,
    NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, NUM_SPLITS: gl.constexpr, CERTIFICATE: gl.constexpr,
    V_DITHER: gl.constexpr,
):  # fmt: skip
    """The split's partials from the token loop's state: the four warps merged (the stage-2 algebra, with each
    warp's max in place of its LSE, and its held token's logit in place of a split's), the row poisoned where a
    slot was out of range. ``PartMax`` is the split's held token's logit (``-inf`` where no warp held one: a split
    with no end tile), ``PartU`` its ``u``."""
    max_slot = (num_slots - 1).to(gl.uint32)
    num_q_heads = NUM_KV_HEADS * KV_GROUP
    running_sum = gl.convert_layout(gl.sum(running_sum, axis=1), _HEAD_ROW)
    top = gl.max(running_max, axis=0)  # [8]
    top_shift = gl.where(top == -_FP32_INF, 0.0, top)
    warp_weight = gl.exp2(running_max - top_shift[None, :])  # [4, 8]
    total = gl.sum(running_sum * warp_weight, axis=0)
    safe_sum = gl.where(total > 0, total, 1.0)
    slots_ok = row_ok & (gl.max(gl.max(slot_max, axis=1), axis=0) <= max_slot)
    poison = gl.where(slots_ok, 0.0, (_FP32_INF - _FP32_INF))
    part_heads = row * num_q_heads + kv_head * KV_GROUP + first_local
    v_alpha_ptr = VAlpha + kv_head * HEAD_DIM
    if V_DITHER:
        # Each thread's sums over its lanes, then over the warps in the split's frame: per group and head.
        head_sums = ()
        for i in gl.static_range(8):
            lanes = gl.convert_layout(gl.sum(dither_sums[i], axis=1), _HEAD_ROW)
            head_sums = head_sums + (gl.sum(lanes * warp_weight, axis=0),)
    else:
        head_sums = ()
    local_heads = KV_GROUP - first_local
    _store_out(
        PartOut, acc0, warp_weight, safe_sum, poison, part_heads, split, local_heads, NUM_SPLITS, 0, V_DITHER,
        v_alpha_ptr, head_sums,
    )  # fmt: skip
    _store_out(
        PartOut, acc1, warp_weight, safe_sum, poison, part_heads, split, local_heads, NUM_SPLITS, 1, V_DITHER,
        v_alpha_ptr, head_sums,
    )  # fmt: skip
    heads_l: gl.constexpr = total.type.layout
    local = first_local + gl.arange(0, 8, layout=heads_l)
    head_ok = local < KV_GROUP
    part_row = (row * num_q_heads + kv_head * KV_GROUP + local) * NUM_SPLITS + split
    empty = total == 0
    gl.store(PartLse + part_row, gl.where(empty, -_FP32_INF, top * _LN2 + gl.log(safe_sum)) + poison, mask=head_ok)
    if CERTIFICATE:
        b_rest, u_rest, w_rest = rest
        held_z, u_max, g_max = held
        # The split's held token: the first warp's of the largest held logit. A warp that held none (-inf) neither
        # wins nor adds anything: its held weight is 0, its u and g are 0.
        held_top = gl.max(held_z, axis=0)  # [8]
        warp_index = gl.arange(0, 4, layout=gl.SliceLayout(1, _HEAD_ROW))[:, None]
        winner = gl.min(gl.where((held_z == held_top[None, :]) & (held_z > -_FP32_INF), warp_index, 4), axis=0)
        loser = warp_index != winner[None, :]
        # The other warps' held tokens join the rest sums with their exact terms, weighted in the split's frame.
        held_weight = gl.exp2(held_z - top_shift[None, :])  # [4, 8]
        b_rest = gl.convert_layout(gl.sum(b_rest, axis=1), _HEAD_ROW)
        # U_rest's terms take no `0 * inf` rule in the loop (it would spill): a weight that underflowed beside a
        # radius that overflowed makes the sum NaN, and a NaN stays NaN through every later scaling and sum,
        # so it is read here as the reference's +inf (``mul_nonneg``).
        u_rest = inf_where_nan(gl.convert_layout(gl.sum(u_rest, axis=1), _HEAD_ROW))
        w_rest = gl.convert_layout(gl.sum(w_rest, axis=1), _HEAD_ROW)
        b = gl.sum(mul_nonneg(warp_weight, b_rest) + gl.where(loser, weighted(held_weight, g_max), 0.0), axis=0)
        u = gl.sum(weighted(warp_weight, u_rest) + gl.where(loser, weighted(held_weight, u_max), 0.0), axis=0)
        p = gl.sum(warp_weight * w_rest + gl.where(loser, held_weight, 0.0), axis=0)
        u_top = gl.sum(gl.where(loser, 0.0, u_max), axis=0)
        gl.store(PartMax + part_row, held_top * _LN2 + poison, mask=head_ok)
        gl.store(PartA1 + part_row, (b + u) / safe_sum + poison, mask=head_ok)
        gl.store(PartB + part_row, b / safe_sum + poison, mask=head_ok)
        gl.store(PartURest + part_row, u / safe_sum + poison, mask=head_ok)
        gl.store(PartPRest + part_row, p / safe_sum + poison, mask=head_ok)
        gl.store(PartU + part_row, u_top + poison, mask=head_ok)


@gluon.jit
def query_operands(
    Q, KAlpha, row, stride_qb, stride_qh, kv_head, first_local, KV_GROUP: gl.constexpr, sm_scale, kappa, seq_len,
    log_two_over_delta, CERTIFICATE: gl.constexpr, Q_IN_REGISTERS: gl.constexpr,
):  # fmt: skip
    """What the token loop needs of the query: q^T per channel group relabelled like K (``q_ops``, MMA operands in
    registers, or in shared memory where ``Q_IN_REGISTERS`` is false), the dither's share per (head, group) and the
    ``sigma^2`` operand in shared memory, the logits' scale and the radius multiplier ``chat = c + kappa`` (THEORY.md
    section 2: ``c`` the tail multiplier of the row's ``seq_len`` tokens, ``kappa`` the bias multiplier the host
    computes, ``reference.bias_multiplier``)."""
    # q^T per channel group, relabelled like K, and its sums (the dither's offset, the sigma^2 operand).
    q_chan = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _Q_LOAD)))
    q_head = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _Q_LOAD)))
    q_local = first_local + q_head
    q_ptrs = Q + row * stride_qb + (kv_head * KV_GROUP + q_local)[None, None, :] * stride_qh + q_chan[None, :, None]
    q_mask = (q_local < KV_GROUP)[None, None, :] & (q_chan < 32)[None, :, None]
    q_ptrs = q_ptrs.broadcast_to(4, 32, 8)
    q_mask = q_mask.broadcast_to(4, 32, 8)
    # A bf16 query enters the MMAs as fp16, scaled per head by a power of two (undone with the softmax scale).
    if Q.dtype.element_ty == gl.bfloat16:
        q_scale = _q_scale(q_ptrs, q_mask)
        logit_scale = gl.convert_layout(sm_scale * _NEG_LOG2E / q_scale, _HEAD_ROW)[:, None, :]
    else:
        q_scale = gl.full([4, 8], 1.0, gl.float32, gl.SliceLayout(1, _Q_LOAD))
        logit_scale = sm_scale * _NEG_LOG2E
    g0 = _q_group(q_ptrs, q_mask, 0, q_scale)
    g1 = _q_group(q_ptrs, q_mask, 1, q_scale)
    g2 = _q_group(q_ptrs, q_mask, 2, q_scale)
    g3 = _q_group(q_ptrs, q_mask, 3, q_scale)
    # q^T's operands (16 registers a thread) stay in registers through the loop where it has room for them (see
    # Q_IN_REGISTERS in gluon_decode), else wait in shared memory and are read by ldmatrix each tile. The dither's
    # share of each group (sum(q_g alpha_g) over the operand, _qk_group) and the sigma^2 operand wait in shared
    # memory, read once per tile.
    if Q_IN_REGISTERS:
        q_ops = (g0[0], g1[0], g2[0], g3[0])
    else:
        q_ops = (
            gl.allocate_shared_memory(gl.float16, [4, 32, 8], ROW_MAJOR, g0[0]),
            gl.allocate_shared_memory(gl.float16, [4, 32, 8], ROW_MAJOR, g1[0]),
            gl.allocate_shared_memory(gl.float16, [4, 32, 8], ROW_MAJOR, g2[0]),
            gl.allocate_shared_memory(gl.float16, [4, 32, 8], ROW_MAJOR, g3[0]),
        )
    q_alpha_sums = gl.allocate_shared_memory(gl.float32, [4, 4, 8], _NORMS_SHARED)
    alpha_ptrs = KAlpha + kv_head * HEAD_DIM + q_chan
    for g in gl.static_range(4):
        alpha_g = gl.load(alpha_ptrs + g * GROUP_SIZE)[None, :, None]
        operand = (g0, g1, g2, g3)[g][2]
        q_alpha_sums.index(g).store(gl.sum(operand * alpha_g, axis=1))
    sigma_op = gl.allocate_shared_memory(gl.float32, [4, 16, 8], ROW_MAJOR)
    if CERTIFICATE:
        sigma_op.store(_sigma_operand((g0, g1, g2, g3), sm_scale * sm_scale / 12.0))
    _barrier()

    tail = gl.sqrt(2.0 * (gl.log(gl.maximum(seq_len, 1).to(gl.float32)) + log_two_over_delta))
    return q_ops, q_alpha_sums, sigma_op, logit_scale, tail + kappa
