"""Triton kernels: the dithered write and split-KV decode with the certificate fused in.

Imported lazily by ``witcert.kernels.attention`` and ``witcert.kernels.pool``: ``triton.jit`` decides
at decoration time whether it compiles or interprets (``TRITON_INTERPRET=1``), so this module must
be imported only once the caller has settled that.

Exactness (docs/KERNELS.md): every dot product runs on operands that are exact in the 16-bit input
type, with fp32 accumulation, so the kernel reproduces the float32 reference up to float32 rounding:

* ``q_g . k_hat_g = s_g (q_g . code_g - q_g . alpha_g)`` one channel group at a time (K's dither is
  ``alpha_c`` alone): ``code`` in [-127, 127] is exact in fp16 and bf16 and ``q_g . alpha_g`` one float32
  sum per row; the group scale multiplies whole columns of the ``[H, N]`` partial logits.
* Output with V rounded to nearest: ``s * code`` exact in fp16 (V's scales have 4 significant bits) and
  ``2**14 p~`` split into fp16 ``p_hi + p_mid``, two fp16 dots. With V dithered: the fp32 weight ``p~_t s_t`` split into
  three bf16 terms, batched over the groups against the exact bf16 codes, and the dither's share
  ``alpha_c sum_t w_t + sum_t w_t beta_t`` subtracted per group.

Codes arrive as the pool stores them, bytes ``code + 128`` (``pool.encode_codes``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from witcert.kernels import reference

# 1.5 * 2**23: adding it rounds a float32 |y| < 2**22 to the nearest integer, ties to even (exactly
# torch.round), and leaves that integer in the sum's low mantissa bits (the write kernel's codes).
_ROUND_MAGIC = tl.constexpr(12582912.0)
FP32_INF = tl.constexpr(float("inf"))
# Weights p~ <= 1 scaled by 2**14 before their fp16 split (nearest-V output path).
P_SCALE = tl.constexpr(16384.0)
# NaN is written inline as inf - inf: a NaN global never equals itself, which Triton reads as a changed global.

# Where the certificate's sums are taken together (reference.CELL_BLOCK, CELL_STRIDE, END_TILE): a cell is the
# tokens r, r + 8, r + 16, r + 24 of a 32-token block (from the row's start), and the token held apart is found
# among the row's first and last tiles of 128 tokens alone.
CELL_BLOCK = tl.constexpr(reference.CELL_BLOCK)
CELL_STRIDE = tl.constexpr(reference.CELL_STRIDE)
END_TILE = tl.constexpr(reference.END_TILE)


# Counter word 1 of a Philox call: the per-slot part of the dither or a block of its per-channel part
# (reference.SLOT_PART, reference.CHANNEL_PART).
_SLOT_PART = tl.constexpr(0)
_CHANNEL_PART = tl.constexpr(1)


@triton.jit
def _channel_words(seed, call0, layer, head_word, HEADS: tl.constexpr, NCALLS: tl.constexpr):
    """Philox words ``[HEADS, NCALLS * 4]`` (uint32) of the per-channel part, calls ``call0`` on, in
    call * 4 + word order. ``head_word`` (KV head | kind bit) is ``[HEADS, 1]``."""
    c0 = tl.broadcast_to((call0 + tl.arange(0, NCALLS)).to(tl.uint32)[None, :], (HEADS, NCALLS))
    # Broadcast through int32 zeros (works whether Triton passed a scalar as constexpr or tensor).
    c1 = (tl.zeros((HEADS, NCALLS), tl.int32) + _CHANNEL_PART).to(tl.uint32)
    c2 = (tl.zeros((HEADS, NCALLS), tl.int32) + layer).to(tl.uint32)
    c3 = (tl.zeros((HEADS, NCALLS), tl.int32) + head_word).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
    # join(join(w0, w2), join(w1, w3))[..., x, y] = w_{2x + y}: the flattened order is call * 4 + word.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (HEADS, NCALLS * 4))


@triton.jit
def _unit_fields(words, N: tl.constexpr, NCALLS: tl.constexpr, DITHER_BITS: tl.constexpr):
    """``1 + j / 2**b`` (float32, exact) for the 8- or 16-bit fields ``j`` of Philox ``words``, in the order of
    ``reference.channel_address`` (fields count from the word's most significant bits).

    Built by bits rather than int -> float conversions: each field shifted to the top of the mantissa
    under the exponent of 1.0 (``0x3F800000``). A difference of two floats in [1, 2) is exact
    (Sterbenz), so a dither then takes one subtraction of a constant in [1, 2).
    """
    mantissa: tl.constexpr = ((1 << DITHER_BITS) - 1) << (23 - DITHER_BITS)
    # Field i of a word has its top bit at 31 - i b: a shift by 9 - i b puts it at bit 22.
    if DITHER_BITS == 8:
        f0 = (words >> 9) & mantissa
        f1 = (words >> 1) & mantissa
        f2 = (words << 7) & mantissa
        f3 = (words << 15) & mantissa
        fields = tl.reshape(tl.join(tl.join(f0, f2), tl.join(f1, f3)), (N, NCALLS * 16))
    else:
        fields = tl.reshape(tl.join((words >> 9) & mantissa, (words << 7) & mantissa), (N, NCALLS * 8))
    return (fields | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def channel_dither(seed, call0, layer, head_word, HEADS: tl.constexpr, NCALLS: tl.constexpr, DITHER_BITS: tl.constexpr):
    """The per-channel part ``alpha = (j + 1/2) / 2**b - 1/2`` ``[HEADS, NCALLS * C]`` (float32; exact for 8 and 16
    bits, the nearest float32 for 24) of the channels served by calls ``call0 ..``, bit-identical to
    ``reference.channel_dither_values``."""
    words = _channel_words(seed, call0, layer, head_word, HEADS, NCALLS)
    if DITHER_BITS == 24:
        # 1 + j / 2**24 does not fit float32's 23 mantissa bits: convert the odd integer 2j + 1 - 2**24
        # (below 2**24 in magnitude, so exact) and scale it by a power of two.
        fields = (words >> 8).to(tl.int32)
        alpha = (2 * fields + 1 - (1 << 24)).to(tl.float32) * (0.5 / (1 << 24))
    else:
        # alpha = (1 + j / 2**b) - (3/2 - 2**-(b + 1)), exact (_unit_fields).
        alpha = _unit_fields(words, HEADS, NCALLS, DITHER_BITS) - (1.5 - 0.5 / (1 << DITHER_BITS))
    return alpha


@triton.jit
def slot_word(seed, slots, layer, head_word):
    """Word 0 of each slot's Philox call (the per-slot part), any shape of ``slots``; ``head_word`` broadcasts."""
    c0 = slots.to(tl.uint32)
    zeros = slots.to(tl.int32) * 0  # in slots' layout: the Gluon stage 1 calls this too
    w0, _, _, _ = tl.philox(
        seed, c0, (zeros + _SLOT_PART).to(tl.uint32), (zeros + layer).to(tl.uint32), (zeros + head_word).to(tl.uint32)
    )
    return w0


@triton.jit
def slot_dither(word, DITHER_BITS: tl.constexpr):
    """The per-slot part ``beta = (m + 1/2) / 2**B - 1/2`` (float32, exact), ``m`` the top ``B = min(b, 16)`` bits
    of ``word``: ``1 + m / 2**B`` built by bits, minus ``3/2 - 2**-(B+1)`` (Sterbenz). Bit-identical to
    ``reference.slot_dither_values``."""
    bits: tl.constexpr = 16 if DITHER_BITS > 16 else DITHER_BITS
    mantissa: tl.constexpr = ((1 << bits) - 1) << (23 - bits)
    return (((word >> 9) & mantissa) | 0x3F800000).to(tl.float32, bitcast=True) - (1.5 - 0.5 / (1 << bits))


@triton.jit
def _dither_values_kernel(
    Slots,
    Xi,
    num_tokens,
    seed,
    layer,
    head_word,
    HEAD_DIM: tl.constexpr,
    DITHER_BITS: tl.constexpr,
    SLOT_PART: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Store the dither ``xi`` ``[N, HEAD_DIM]`` the write and gather kernels use for one head
    (``dither_rows``), to check it against the reference."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    slots = tl.load(Slots + tokens, mask=token_ok, other=0)
    # Through int32 zeros: Triton passes a head word of 0 or 1 as a constexpr, one past 2**31 as uint32.
    head_words = (tl.zeros((1, 1), tl.int32) + head_word).to(tl.uint32)
    xi = dither_rows(seed, slots, layer, head_words, BLOCK_T, 1, HEAD_DIM, DITHER_BITS, SLOT_PART)
    channels = tl.arange(0, HEAD_DIM)
    tl.store(Xi + tokens[:, None] * HEAD_DIM + channels[None, :], xi, mask=token_ok[:, None])


@triton.jit
def g_of(u, FAST_EXP: tl.constexpr = False):
    """``g(u) = expm1(u) - u`` for ``u >= 0`` without cancellation (both decode kernels and stage 2).

    Below 1/4 the series to ``u**6 / 720`` (positive terms, Horner's form, one fused multiply-add a term;
    truncation below 4e-7 relative); from 1/4 on, ``exp(u) - 1 - u`` (relative error below 1e-5 there). Both
    sit far inside the 2**-10 evaluation slack the certificate is multiplied by
    (``reference.CERTIFICATE_EVAL_SLACK``). ``FAST_EXP`` (compiled code only) takes ``ex2.approx.ftz`` as
    is: ``exp(u) >= 1`` here, so flushing subnormal results changes nothing, and the guard ``tl.exp`` adds
    for them is wasted.
    """
    series = u * (1.0 / 720.0) + 1.0 / 120.0
    series = series * u + 1.0 / 24.0
    series = series * u + 1.0 / 6.0
    series = series * u + 0.5
    u_sq = u * u
    series = series * u_sq
    small = u < 0.25
    if FAST_EXP:
        exp_u = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [u * 1.4426950408889634], dtype=tl.float32, is_pure=True,
            pack=1,
        )  # fmt: skip
    else:
        exp_u = tl.exp(u)
    big = (exp_u - 1.0) - u
    # At u = +inf, big is inf - inf = NaN and the maximum (which ignores a NaN) is u**2 / 2 = +inf; at finite
    # u >= 1/4, g(u) > 1.08 u**2 / 2, far above big's rounding, so the maximum is big.
    return tl.where(small, series, tl.maximum(big, 0.5 * u_sq))


@triton.jit
def h_of(x, FAST_EXP: tl.constexpr = False):
    """``h(x) = g(x) / x**2`` for ``x >= 0`` (``reference.h_of``): increasing, 1/2 at 0, +inf where ``g`` overflows.

    Below 0.05 the series ``1/2 + x/6 + x**2/24 + x**3/120 + x**4/720`` (Horner's form; truncation below 2e-10
    relative), so that ``x**2`` never underflows into the division; from 0.05 on ``g_of(x) / x**2``, within
    ``g_of``'s error. Where ``g`` overflows (``x`` above 88, or +inf) the quotient would be ``inf / x**2`` or
    ``inf / inf``: +inf, never NaN. ``FAST_EXP`` as in ``g_of``."""
    series = x * (1.0 / 720.0) + 1.0 / 120.0
    series = series * x + 1.0 / 24.0
    series = series * x + 1.0 / 6.0
    series = series * x + 0.5
    small = x < 0.05
    safe = tl.where(small, 1.0, x)
    g = g_of(safe, FAST_EXP)
    return tl.where(small, series, tl.where(g == FP32_INF, g, g / (safe * safe)))


@triton.jit
def expm1_and_g(u):
    """``(expm1(u), g(u))`` for ``u >= 0``: ``expm1 = g + u``, a sum of non-negative terms."""
    g = g_of(u)
    return g + u, g


@triton.jit
def mul_nonneg(a, b):
    """Product of non-negative bounds; an infinite factor gives +inf, never NaN (as the reference)."""
    return tl.where((a == FP32_INF) | (b == FP32_INF), FP32_INF, a * b)


@triton.jit
def weighted(weight, x):
    """``mul_nonneg(weight, x)`` for a softmax weight (finite, in [0, 1]) and a bound ``x >= 0``, with one
    comparison less: only ``x`` can be infinite, and then so is the product, also where the weight
    underflowed to 0."""
    return tl.where(x == FP32_INF, x, weight * x)


@triton.jit
def inf_where_nan(total):
    """A sum of non-negative weighted terms is NaN only through ``0 * inf``: a weight that underflowed to 0
    next to an overflowed factor. That term is +inf, as in the reference (``mul_nonneg``): its token's true
    logit may lie above the max. One test per sum instead of one per term (``weighted``)."""
    return tl.where(total == total, total, FP32_INF)


@triton.jit
def split_range(KvStart, KvEnd, row, split, num_kv_indices, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(kv_start, row_ok, lo, hi, seq_len)``: the row's first index, split ``split``'s token range
    ``[lo, hi)`` and the row's length. The row's indices are ``[KvStart[row], KvEnd[row])``: for decode,
    ``kv_indptr[:-1]`` and ``kv_indptr[1:]``, two views, so that no kernel runs before this one to take lengths.

    A malformed row (an end before its start, or indices past the end) gets ``row_ok`` false and length 0: it
    is poisoned with NaN, never read. Splits are whole tiles of ``BLOCK_N`` tokens.
    """
    kv_start = tl.load(KvStart + row)
    kv_end = tl.load(KvEnd + row)
    row_ok = (kv_end >= kv_start) & (kv_start >= 0) & (kv_end <= num_kv_indices)
    seq_len = tl.where(row_ok, kv_end - kv_start, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    return kv_start, row_ok, lo, tl.minimum(lo + split_len, seq_len), seq_len


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    """The combine of one three-operand sum: the operands share its lane exchanges and barriers."""
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _cell_combine(w0, m0, l0, w1, m1, l1):
    """The combine of a cell's ``(W, M, largest)``: two sums and a maximum."""
    return w0 + w1, m0 + m1, tl.maximum(l0, l1)


@triton.jit
def softmax_tile(logits, running_max, running_sum):
    """One tile of the online softmax over axis 1: ``(new_max, shift, alpha, weights, running_sum)``,
    the weights ``exp(logits - shift)`` and ``alpha`` rescaling what came before. A row that has seen no
    live token yet (all masked or skipped) keeps its max at -inf and shifts by 0, so it adds nothing."""
    tile_max = tl.max(logits, axis=1)
    new_max = tl.maximum(running_max, tile_max)
    shift = tl.where(new_max == -FP32_INF, 0.0, new_max)
    alpha = tl.exp(running_max - shift)
    weights = tl.exp(logits - shift[:, None])
    return new_max, shift, alpha, weights, running_sum * alpha + tl.sum(weights, axis=1)


@triton.jit
def add_sigma_terms(sigma_sq, q_g, scale_g, sigma_coef):
    """``sigma^2`` of the radius ``[rows, N]`` (THEORY.md section 2) plus one channel group's term
    ``sm^2 |q_g|^2 s_g^2 / 12`` (``q_g`` float32, exact channels zeroed)."""
    # The coefficient goes on q's per-row sums (loop-invariant, hoisted), not on every token.
    q_sq = tl.sum(q_g * q_g, axis=1) * sigma_coef
    return sigma_sq + q_sq[:, None] * (scale_g * scale_g)[None, :]


@triton.jit
def live_sigma_sq(sigma_sq, live):
    """``sigma^2`` where ``live``, 0 elsewhere (a token not read has no radius). A term is NaN through
    ``0 * inf``: a zero group scale (an all-zero key group) against a query whose ``|q_g|^2`` overflowed float32.
    The reference's sigma is then +inf (``mul_nonneg``), and so is this one. (A NaN scale, a NaN key written
    unvalidated, also gives +inf here; its logit is NaN, which poisons the row's output and sums anyway.)"""
    return tl.where(live, inf_where_nan(sigma_sq), 0.0)


@triton.jit
def end_tile_start(num_tokens):
    """The first position of the last tile of ``END_TILE`` of a row of ``num_tokens`` (>= 1) tokens:
    ``((S - 1) // END_TILE) * END_TILE``. A row's end tokens are the positions below ``END_TILE`` and from
    there on (``reference.end_tokens``)."""
    return (tl.maximum(num_tokens - 1, 0) // END_TILE) * END_TILE


@triton.jit
def cell_sums(weights, moments, sigma_sq, chat, N: tl.constexpr, INTERPRETED: tl.constexpr):
    """``(U, B, P)`` of one tile's cells (THEORY.md section 3), per row: ``U = chat sum sqrt(W M)``, ``B = chat^2
    sum h(chat sqrt(largest)) M`` and ``P = sum W`` over the cells, ``W`` and ``M`` the sums of ``weights`` and
    ``moments`` (``p sigma^2``) over a cell's tokens and ``largest`` its largest ``sigma^2``.

    A token ``j = 8 i + r`` of a 32-token block is in cell ``r``: the ``[rows, N]`` tile as ``[rows, N / 32, 4, 8]``,
    summed over the axis of 4. ``sum p u <= sqrt(W sum p u^2)`` (Cauchy-Schwarz over the cell's tokens) and
    ``g(u) = h(u) u^2 <= h(u_cell) u^2`` (``h`` increasing) bound the cell's terms of ``U`` and ``B``. A NaN from
    ``0 * inf`` (a weight that underflowed beside an overflowed radius) reads as +inf, as in the reference."""
    ROWS: tl.constexpr = weights.shape[0]
    BLOCKS: tl.constexpr = N // CELL_BLOCK
    FAST_EXP: tl.constexpr = not INTERPRETED
    shape: tl.constexpr = (ROWS, BLOCKS, CELL_BLOCK // CELL_STRIDE, CELL_STRIDE)
    cell_w = tl.reshape(weights, shape)
    cell_m = tl.reshape(moments, shape)
    cell_l = tl.reshape(sigma_sq, shape)
    if INTERPRETED:
        # The interpreter runs a reduction's combine function once per element in Python: plain reductions.
        cell_w, cell_m, cell_l = tl.sum(cell_w, axis=2), tl.sum(cell_m, axis=2), tl.max(cell_l, axis=2)
    else:
        cell_w, cell_m, cell_l = tl.reduce((cell_w, cell_m, cell_l), 2, _cell_combine)
    u_cells = tl.reshape(tl.sqrt(cell_w * cell_m), (ROWS, BLOCKS * CELL_STRIDE))
    largest = chat[:, None, None] * tl.sqrt(cell_l)
    b_cells = tl.reshape(h_of(largest, FAST_EXP) * cell_m, (ROWS, BLOCKS * CELL_STRIDE))
    w_cells = tl.reshape(cell_w, (ROWS, BLOCKS * CELL_STRIDE))
    if INTERPRETED:
        tile_u, tile_b, tile_w = tl.sum(u_cells, axis=1), tl.sum(b_cells, axis=1), tl.sum(w_cells, axis=1)
    else:
        tile_u, tile_b, tile_w = tl.reduce((u_cells, b_cells, w_cells), 1, _add3)
    return inf_where_nan(chat * tile_u), inf_where_nan((chat * chat) * tile_b), tile_w


@triton.jit
def end_singletons(
    logits, sigma_sq, ends, chat, shift, held_logit, u_held, g_held, N: tl.constexpr, INTERPRETED: tl.constexpr
):  # fmt: skip
    """The singletons of one tile: in each 32-token block of the end tokens (``ends``), the first argmax by logit,
    whose terms are exact (THEORY.md section 3). Returns ``(singleton, U, B, P, held_logit, u_held, g_held)``: the
    ``[rows, N]`` mask of the singletons, the terms ``p u``, ``p g(u)`` and ``p`` that join the rest sums, and the
    token held apart after the tile.

    The held token is the first argmax among the singletons: the tile's first block argmax replaces it only on a
    strictly larger logit (first-argmax semantics, since tiles come in sequence order), and then the token held
    so far joins the rest sums; otherwise that block argmax does. Every other singleton joins them. A block with
    no live token has weight 0 and sigma 0: it adds nothing and is never held (its max is -inf)."""
    FAST_EXP: tl.constexpr = not INTERPRETED
    # Block by block, in sequence order, on the [rows, N] tile itself: masks and row reductions, no reshape. (Built
    # as [rows, blocks, 32] and reshaped back, the mask came out empty for rows 8-11 of a 16-row tile compiled for
    # sm_90 by Triton 3.6, where the interpreter had it right.)
    columns = tl.arange(0, N)[None, :]
    singleton = tl.zeros(logits.shape, tl.int1)
    single_u = tl.zeros(held_logit.shape, tl.float32)
    single_b = tl.zeros(held_logit.shape, tl.float32)
    single_w = tl.zeros(held_logit.shape, tl.float32)
    for block in tl.static_range(N // CELL_BLOCK):
        in_block = (columns >= block * CELL_BLOCK) & (columns < (block + 1) * CELL_BLOCK)
        candidates = tl.where(in_block & ends, logits, -FP32_INF)
        block_max = tl.max(candidates, axis=1)
        # The first argmax, from the max already reduced: one integer min instead of an argmax pair.
        first = tl.min(tl.where(candidates == block_max[:, None], columns, N), axis=1)
        is_single = (columns == first[:, None]) & (block_max > -FP32_INF)[:, None]
        singleton = singleton | is_single
        w_block = tl.exp(block_max - shift)
        u_block = chat * tl.sqrt(tl.sum(tl.where(is_single, sigma_sq, 0.0), axis=1))
        g_block = g_of(u_block, FAST_EXP)
        # The loser joins the rest sums: the token held so far (weight 0 while none is held) or this block's.
        moved = block_max > held_logit
        w_old = tl.exp(held_logit - shift)
        single_u += tl.where(moved, weighted(w_old, u_held), weighted(w_block, u_block))
        single_b += tl.where(moved, weighted(w_old, g_held), weighted(w_block, g_block))
        single_w += tl.where(moved, w_old, w_block)
        held_logit = tl.where(moved, block_max, held_logit)
        u_held = tl.where(moved, u_block, u_held)
        g_held = tl.where(moved, g_block, g_held)
    return singleton, inf_where_nan(single_u), inf_where_nan(single_b), single_w, held_logit, u_held, g_held


@triton.jit
def certificate_tile(
    logits, weights, sigma_sq, chat, start, last_start, earliest_last_start, shift, alpha, b_rest, u_rest, w_rest,
    held_logit, u_held, g_held, N: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """The certificate's running state ``(B_rest, U_rest, P_rest, held_logit, u_held, g_held)`` per row after one
    tile of ``N`` tokens at positions ``start ..`` of the row (THEORY.md section 3): the rest sums (weights relative
    to the running max, rescaled by ``alpha``) and the token held apart, with its own logit (the running max moves
    on tiles between the ends, the held token does not).

    ``sigma_sq`` is 0 where a token is not live (``live_sigma_sq``), ``chat = c + kappa`` per row. ``last_start``:
    each row's ``end_tile_start`` (a scalar where the rows share their length, else ``[rows, 1]``), and
    ``earliest_last_start`` the smallest of them. A tile with no end token in any row takes no argmax at all:
    its tokens all sit in cells. In one with end tokens the first argmax of each 32-token block of them is a
    singleton (``end_singletons``), left out of its cell."""
    tl.static_assert(N // CELL_BLOCK * CELL_BLOCK == N, "a tile holds whole 32-token blocks")
    singleton = tl.zeros(logits.shape, tl.int1)
    b_rest = weighted(alpha, b_rest)
    u_rest = weighted(alpha, u_rest)
    w_rest = w_rest * alpha
    if (start < END_TILE) | (start + N > earliest_last_start):
        positions = start + tl.arange(0, N)[None, :]
        ends = (positions < END_TILE) | (positions >= last_start)
        singleton, single_u, single_b, single_w, held_logit, u_held, g_held = end_singletons(
            logits, sigma_sq, ends, chat, shift, held_logit, u_held, g_held, N, INTERPRETED
        )
        b_rest += single_b
        u_rest += single_u
        w_rest += single_w
    # The product is masked, not the weight: a singleton's 0 * inf is no cell's term.
    moments = tl.where(singleton, 0.0, weights * sigma_sq)
    cell_weights = tl.where(singleton, 0.0, weights)
    tile_u, tile_b, tile_w = cell_sums(cell_weights, moments, sigma_sq, chat, N, INTERPRETED)
    return b_rest + tile_b, u_rest + tile_u, w_rest + tile_w, held_logit, u_held, g_held


@triton.jit
def store_certificate_partials(
    PartMax, PartA1, PartB, PartURest, PartPRest, PartU, part_row, mask, held_logit, safe_sum, poison, b_rest,
    u_rest, w_rest, u_held,
):  # fmt: skip
    """A split's certificate partials for stage 2: the logit of the token it holds apart (-inf where it holds
    none), ``A1_rest = B_rest + U_rest``, ``B_rest``, ``U_rest`` and ``P_rest`` normalised by the split's sum of
    weights, and ``u`` at its held token (0 where none)."""
    tl.store(PartMax + part_row, held_logit + poison, mask=mask)
    tl.store(PartA1 + part_row, (b_rest + u_rest) / safe_sum + poison, mask=mask)
    tl.store(PartB + part_row, b_rest / safe_sum + poison, mask=mask)
    tl.store(PartURest + part_row, u_rest / safe_sum + poison, mask=mask)
    tl.store(PartPRest + part_row, w_rest / safe_sum + poison, mask=mask)
    tl.store(PartU + part_row, u_held + poison, mask=mask)


@triton.jit
def by_channel(per_group, N: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """``[N, NG]`` -> ``[N, NG * G]``: each group's value over its channels."""
    return tl.reshape(tl.broadcast_to(per_group[:, :, None], (N, NUM_GROUPS, GROUP_SIZE)), (N, NUM_GROUPS * GROUP_SIZE))


@triton.jit
def token_head_rows(Slots, num_tokens, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program's rows ``(token, head)`` over ``BLOCK_T`` tokens, head fastest: ``(tokens, head, row_ok,
    slots)``, the slots (int64) as loaded, 0 where ``row_ok`` is false (past the end or a padding head)."""
    row = tl.arange(0, BLOCK_T * HEADS_PAD)
    tokens = tl.program_id(0) * BLOCK_T + row // HEADS_PAD
    head = row % HEADS_PAD
    row_ok = (tokens < num_tokens) & (head < NUM_KV_HEADS)
    return tokens, head, row_ok, tl.load(Slots + tokens, mask=row_ok, other=0).to(tl.int64)


@triton.jit
def dither_rows(
    seed, slots, layer, head_word, ROWS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    DITHER_BITS: tl.constexpr, SLOT_PART: tl.constexpr,
):  # fmt: skip
    """``xi = alpha + beta`` (``SLOT_PART``, V) or ``alpha`` (K) ``[ROWS, HEAD_DIM]`` (float32) of rows ``(slot,
    head)``, bit-identical to ``reference.dither_values``: what the write kernel adds and the gather kernel
    subtracts.

    Rows come head fastest in runs of ``HEADS`` (``token_head_rows``), and ``head_word`` ``[HEADS, 1]`` is each
    head's ``kv_head | kind << 31``: the per-channel part is computed once per head and repeated over the
    tokens. The sum is exact for 8 and 16 bits; at 24 bits ``alpha + beta`` is
    the odd integer ``2j + 1 + 2**8 (2m + 1) - 2**25`` (below 2**25 in magnitude) over ``2**25``, converted once:
    the nearest float32, as the reference rounds the exact sum (``alpha`` alone, ``2j + 1 - 2**24``, is exact).
    """
    per_call: tl.constexpr = 4 * (32 // DITHER_BITS)
    ncalls: tl.constexpr = HEAD_DIM // per_call
    tokens: tl.constexpr = ROWS // HEADS
    if SLOT_PART:
        row_heads = tl.reshape(tl.broadcast_to(tl.reshape(head_word, (1, HEADS)), (tokens, HEADS)), (ROWS,))
        word = slot_word(seed, slots, layer, row_heads)
    if DITHER_BITS == 24:
        j = (_channel_words(seed, 0, layer, head_word, HEADS, ncalls) >> 8).to(tl.int32)
        j_rows = tl.reshape(tl.broadcast_to(j[None, :, :], (tokens, HEADS, HEAD_DIM)), (ROWS, HEAD_DIM))
        if SLOT_PART:
            m = (word >> 16).to(tl.int32)
            xi = (2 * j_rows + (1 + 256 - (1 << 25)) + (m << 9)[:, None]).to(tl.float32) * (1.0 / (1 << 25))
        else:
            xi = (2 * j_rows + (1 - (1 << 24))).to(tl.float32) * (1.0 / (1 << 25))
    else:
        alpha = channel_dither(seed, 0, layer, head_word, HEADS, ncalls, DITHER_BITS)
        xi = tl.reshape(tl.broadcast_to(alpha[None, :, :], (tokens, HEADS, HEAD_DIM)), (ROWS, HEAD_DIM))
        if SLOT_PART:
            xi = xi + slot_dither(word, DITHER_BITS)[:, None]
    return xi


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def write_kernel(
    X,
    Slots,
    Codes,
    Scales,
    OutlierValues,
    OutlierIndex,
    OutlierChannels,
    num_tokens,
    num_slots,
    stride_xn,
    stride_xh,
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
    OUTLIERS_PAD: tl.constexpr,
    NUM_OUTLIERS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Quantize ``BLOCK_T`` tokens, all their KV heads, into their slots, bit-identical to ``reference.quantize``.

    Rows are (token, head) pairs with the head fastest: a slot's heads are adjacent in the pool, so one
    program writes each slot's codes as one run of ``H_kv * HEAD_DIM`` bytes and its scales as one run
    of ``H_kv * groups`` fp16 (a whole 32-byte sector at 4 heads); a program per head wrote 8-byte
    pieces of that sector from programs far apart in time.

    No division per element: the scale comes from ``amax * RN(1 / 126.5)`` and one step up, ``x / s``
    is Markstein's corrected product with ``RN(1 / s)`` (one reciprocal per group), 8- and 16-bit dithers
    are built by bits (``_unit_fields``), and the code is the low byte of ``x / s + xi + 1.5 * 2**23``.
    Why each step is exact: the comments below and docs/KERNELS.md ("Exactness").
    """
    rows: tl.constexpr = BLOCK_T * HEADS_PAD
    num_groups: tl.constexpr = HEAD_DIM // GROUP_SIZE
    tokens, head, row_ok, slots = token_head_rows(Slots, num_tokens, NUM_KV_HEADS, HEADS_PAD, BLOCK_T)
    # An out-of-range slot is skipped, never written: unvalidated input cannot corrupt the pool.
    row_ok = row_ok & (slots >= 0) & (slots < num_slots)
    slots = tl.where(row_ok, slots, 0)
    head = tl.where(row_ok, head, 0)
    channels = tl.arange(0, HEAD_DIM)
    x_row = X + tokens.to(tl.int64) * stride_xn + head * stride_xh
    x = tl.load(x_row[:, None] + channels[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    magnitude = tl.abs(x)
    if HAS_OUTLIERS:
        is_outlier = tl.load(OutlierIndex + head[:, None] * HEAD_DIM + channels[None, :]) >= 0
        magnitude = tl.where(is_outlier, 0.0, magnitude)
    # A NaN makes its group's amax, and so its scale, NaN (tl.max would skip it, as max.f32 does): every reader
    # of the token then sees NaN, never finite codes standing in for it. (An inf already gives an inf scale.)
    grouped = tl.reshape(magnitude, (rows, num_groups, GROUP_SIZE))
    if INTERPRETED:
        # The interpreter runs a reduction's combine function once per element in Python: a plain max, then NaN
        # where the group holds one.
        has_nan = tl.max((grouped != grouped).to(tl.int32), axis=2) > 0
        amax = tl.where(has_nan, FP32_INF - FP32_INF, tl.max(grouped, axis=2))
    else:
        amax = tl.reduce(grouped, 2, _max_propagating_nan)
    # The smallest fp16 s with s * 126.5 >= amax, the reference's scale (s * 126.5 is exact). amax times
    # RN(1 / 126.5) is within two fp32 ulps of amax / 126.5, so its fp16 rounding is s or the fp16 value
    # below it, never above: one step up while too small gives s (checked for every fp16 and bf16 amax).
    scale = (amax * (1.0 / 126.5)).to(tl.float16)
    too_small = scale.to(tl.float32) * 126.5 < amax
    scale = tl.where(too_small, (scale.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True), scale)
    if KIND_BIT == 1:
        # V's scales keep 4 significant bits (reference.V_SCALE_SIGNIFICANT_BITS): in float32, where fp16's
        # subnormals are normal, the next multiple of 2**20 in the bits (it carries into the exponent); the result
        # is a multiple of 2**-24, exact in fp16. NaN and inf (a non-finite group, written unvalidated) stay.
        wide = scale.to(tl.float32)
        bits = wide.to(tl.uint32, bitcast=True)
        coarse = ((bits + 0xFFFFF) & 0xFFF00000).to(tl.float32, bitcast=True).to(tl.float16)
        scale = tl.where(tl.abs(wide) < FP32_INF, coarse, scale)
    scale32 = scale.to(tl.float32)
    # An all-zero group (s = 0) divides by 1 instead: its x are all +-0, and the reference's quotient 0
    # gives the same codes as a signed zero.
    safe_scale = tl.where(scale32 > 0, scale32, 1.0)
    # r = RN(1 / s) once per group, without div_rn and its slow path: Triton's fp32 "/" is within 2 ulps,
    # and one Newton step with an fma residual takes any guess within 8 ulps to RN(1 / s) (checked for
    # every fp16 s).
    guess = 1.0 / safe_scale
    reciprocal = tl.fma(tl.fma(-safe_scale, guess, 1.0), guess, guess)
    # x / s rounded to nearest without a division per element (Markstein's corrected product): q0 = RN(x r)
    # is within 1.5 ulps of x / s, the fma gives the remainder x - q0 s exactly, and RN(q0 + remainder r)
    # is RN(x / s). Checked exhaustively: every fp16 s with every fp16 or bf16 x. The one exception is
    # underflow: for a bf16 x so tiny that the remainder is subnormal the quotient can be an ulp off, but
    # then |x / s| < 2**-102, far too small to move the rounding of x / s + xi (or of x / s alone).
    channel_reciprocal = by_channel(reciprocal, rows, num_groups, GROUP_SIZE)
    first = x * channel_reciprocal
    # The scale negated per group, not the product per element (a negated product costs a second multiply).
    remainder = tl.fma(first, by_channel(-safe_scale, rows, num_groups, GROUP_SIZE), x)
    scaled = tl.fma(remainder, channel_reciprocal, first)
    if DITHER:
        head_word = tl.arange(0, HEADS_PAD).to(tl.uint32)[:, None] | tl.full((), KIND_BIT << 31, tl.uint32)
        # Only V (kind bit 1) has a per-slot part.
        scaled = scaled + dither_rows(
            seed, slots, layer, head_word, rows, HEADS_PAD, HEAD_DIM, DITHER_BITS, KIND_BIT == 1
        )
    # |scaled| < 127: the rounded sum is 1.5 * 2**23 + 128 + code (128 is even: ties round as without it),
    # whose bits are 0x4B400000 + 128 + code, so their low byte is the stored byte code + 128 (pool.encode_codes):
    # no subtraction, no float -> int conversion.
    codes = (scaled + (_ROUND_MAGIC + 128.0)).to(tl.int32, bitcast=True)
    if HAS_OUTLIERS:
        codes = tl.where(is_outlier, 128, codes)
    slot_base = slots * NUM_KV_HEADS + head
    tl.store(Codes + slot_base[:, None] * HEAD_DIM + channels[None, :], codes.to(tl.uint8), mask=row_ok[:, None])
    groups = tl.arange(0, num_groups)
    tl.store(Scales + slot_base[:, None] * num_groups + groups[None, :], scale, mask=row_ok[:, None])
    if HAS_OUTLIERS:
        index = tl.arange(0, OUTLIERS_PAD)
        index_ok = row_ok[:, None] & (index < NUM_OUTLIERS)[None, :]
        outlier_channel = tl.load(
            OutlierChannels + head[:, None] * NUM_OUTLIERS + index[None, :], mask=index_ok, other=0
        )
        values = tl.load(x_row[:, None] + outlier_channel, mask=index_ok)
        tl.store(OutlierValues + slot_base[:, None] * NUM_OUTLIERS + index[None, :], values, mask=index_ok)


@triton.jit
def _dot16(a, b, acc, INTERPRETED: tl.constexpr):
    """``acc + a @ b`` for exact 16-bit operands, fp32 accumulation.

    Triton 3.9's interpreter multiplies bf16 operands as their raw uint16 bits, so there the operands
    are widened to fp32 first: products of 16-bit values are exact in fp32, so the result is the same.
    """
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    return tl.dot(a, b, acc=acc)


@triton.jit
def _code_operand(codes, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """The stored codes (bytes ``code + 128``, ``pool.encode_codes``) as exact ``dtype`` values of ``code``.

    fp16 by bit pattern: the byte ``code + 128`` zero-extended under ``0x6400`` is the fp16 ``1152 + code``
    (ulp 1 on [1024, 2048)), and subtracting 1152 in fp16 is exact. Compiled, four codes take two ``prmt``
    (the byte under the exponent byte ``0x64``) and two ``f16x2`` subtractions.
    """
    if dtype == tl.float16:
        if INTERPRETED:
            return (codes.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
        return tl.inline_asm_elementwise(
            """
            {
            .reg .b32 offset;
            mov.b32 offset, 0xE480E480;
            prmt.b32 $0, $2, 0x64646464, 0x4140;
            prmt.b32 $1, $2, 0x64646464, 0x4342;
            add.rn.f16x2 $0, $0, offset;
            add.rn.f16x2 $1, $1, offset;
            }
            """,
            "=r,=r,r",
            [codes],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )
    return stored_code_values(codes).to(dtype)


@triton.jit
def stored_code_values(codes):
    """The stored bytes ``code + 128`` as float32 ``code`` (exact)."""
    return (codes.to(tl.int32) - 128).to(tl.float32)


@triton.jit
def _by_group(x, N: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """``[N, NG * G]`` -> ``[NG, N, G]``: one batch entry per channel group, for the batched PV dot."""
    return tl.permute(tl.reshape(x, (N, NUM_GROUPS, GROUP_SIZE)), (1, 0, 2))


@triton.jit
def _split_bf16(w):
    """``w = hi + mid + lo`` exactly to 24 bits, each term a bf16 (the wide exponent avoids underflow)."""
    # Truncating to the top 16 bits (a mask, no conversion round trip) keeps 8 significant bits per term:
    # 24 = 8 + 8 + 8, so every term and every difference is exact and each final bf16 conversion is too.
    hi = (w.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    rest = w - hi
    mid = (rest.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    lo = rest - mid
    return hi.to(tl.bfloat16), mid.to(tl.bfloat16), lo.to(tl.bfloat16)


@triton.jit
def tile_slots(KvIndices, kv_start, offs, hi, num_slots, OFFSETS_64: tl.constexpr):
    """A tile's slots ``kv_indices[kv_start + offs]``, as ``(slots, token_ok, in_range)``.

    Tokens at or past ``hi`` and out-of-range slots read slot 0 and get ``token_ok`` false, so the K/V loads
    that follow need no mask (codes and scales are finite); ``in_range`` is false when some token before
    ``hi`` has an out-of-range slot, for the caller to poison its rows. 32-bit element offsets where the
    pool is small enough (fewer address instructions).
    """
    token_ok = offs < hi
    slots = tl.load(KvIndices + kv_start + offs, mask=token_ok, other=0).to(tl.int64 if OFFSETS_64 else tl.int32)
    slot_in_range = (slots >= 0) & (slots < num_slots)
    in_range = tl.sum((token_ok & ~slot_in_range).to(tl.int32), axis=0) == 0
    token_ok = token_ok & slot_in_range
    return tl.where(token_ok, slots, 0), token_ok, in_range


@triton.jit
def channel_dither_term(q_g, alpha_g):
    """K's dither share of one group's logits, per query row: ``sum_c q_c alpha_c`` in float32 (fp16/bf16 times
    ``alpha`` is exact in float32; the sum rounds as the reference's does)."""
    return tl.sum(q_g.to(tl.float32) * alpha_g[None, :], axis=1)


@triton.jit
def qk_group(q_g, codes_g, q_alpha, ROWS: tl.constexpr, N: tl.constexpr, INTERPRETED: tl.constexpr):
    """``q_g . (code_g - alpha_g)`` for ``ROWS`` query rows and ``N`` tokens: ``q_g . code_g`` as one dot on exact
    operands (fp32 accumulation), minus the dither's share ``sum(q_g alpha_g)`` (K's dither is ``alpha_c`` alone,
    so that share is one number per row). The group scale is the caller's."""
    q_dtype: tl.constexpr = q_g.dtype
    part = _dot16(
        q_g, tl.trans(_code_operand(codes_g, q_dtype, INTERPRETED)), tl.zeros((ROWS, N), tl.float32), INTERPRETED
    )
    return part - q_alpha[:, None]


@triton.jit
def pv_nearest(
    acc, weights, alpha, v_codes, v_scales, N: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """``acc * alpha + 2**14 sum_t p_t v_hat_t`` for V rounded to nearest (``v_hat = s * code``).

    V's scales have 4 significant bits (``reference.V_SCALE_SIGNIFICANT_BITS``), so ``s * code`` (a code of 7 bits)
    is exact in fp16, and ``2**14 p`` (at most 2**14, so no overflow, and far from fp16's underflow for every weight
    that matters) is ``p_hi + p_mid`` to 22 bits: two fp16 dots, no per-group weights, plain ``[rows, N] x [N, D]``.
    """
    channel_scale = tl.reshape(tl.broadcast_to(v_scales[:, :, None], (N, NUM_GROUPS, GROUP_SIZE)), (N, HEAD_DIM))
    v_hat = _code_operand(v_codes, tl.float16, INTERPRETED) * channel_scale
    scaled = weights * P_SCALE
    p_hi = scaled.to(tl.float16)
    p_mid = (scaled - p_hi.to(tl.float32)).to(tl.float16)
    acc = acc * alpha[:, None]
    acc = _dot16(p_hi, v_hat, acc, INTERPRETED)
    return _dot16(p_mid, v_hat, acc, INTERPRETED)


@triton.jit
def decode_stage1(
    Q,
    KCodes,
    KScales,
    KOutliers,
    VCodes,
    VScales,
    VOutliers,
    KAlpha,
    VAlpha,
    OutlierIndex,
    OutlierChannels,
    KvStart,
    KvEnd,
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
    kappa,
    seed,
    layer,
    NUM_KV_HEADS: tl.constexpr,
    KV_GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DITHER_BITS: tl.constexpr,
    V_DITHER: tl.constexpr,
    HAS_OUTLIERS: tl.constexpr,
    OUTLIERS_PAD: tl.constexpr,
    NUM_OUTLIERS: tl.constexpr,
    CERTIFICATE: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    OFFSETS_64: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One (row, head block, split): dequantize, online softmax, output and certificate accumulators."""
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    blocks_per_kv_head: tl.constexpr = (KV_GROUP + BLOCK_H - 1) // BLOCK_H
    num_groups: tl.constexpr = HEAD_DIM // GROUP_SIZE
    kv_head = head_block // blocks_per_kv_head
    local_heads = (head_block % blocks_per_kv_head) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = local_heads < KV_GROUP
    heads = kv_head * KV_GROUP + local_heads
    num_q_heads = NUM_KV_HEADS * KV_GROUP

    kv_start, row_ok, lo, hi, seq_len = split_range(KvStart, KvEnd, row, split, num_kv_indices, NUM_SPLITS, BLOCK_N)

    channels = tl.arange(0, HEAD_DIM)
    groups = tl.arange(0, num_groups)
    if HAS_OUTLIERS:
        outlier_slot = tl.load(OutlierIndex + kv_head * HEAD_DIM + channels)
        exact_channel = outlier_slot >= 0
        outlier_index = tl.arange(0, OUTLIERS_PAD)
        outlier_ok = outlier_index < NUM_OUTLIERS
        outlier_channel = tl.load(OutlierChannels + kv_head * NUM_OUTLIERS + outlier_index, mask=outlier_ok, other=0)
        q_outliers = tl.load(
            Q + row * stride_qb + heads[:, None] * stride_qh + outlier_channel[None, :],
            mask=head_ok[:, None] & outlier_ok[None, :],
            other=0.0,
        )
    # The radius is chat sigma, chat = c + kappa: the dither's bias is at most kappa sigma (Cauchy-Schwarz over the
    # groups, THEORY.md section 2). The row's end tiles hold its singletons.
    tail = tl.sqrt(2.0 * (tl.log(tl.maximum(seq_len, 1).to(tl.float32)) + log_two_over_delta))
    chat = tl.zeros((BLOCK_H,), tl.float32) + (tail + kappa)
    last_start = end_tile_start(seq_len)
    sigma_coef = sm_scale * sm_scale / 12.0

    running_max = tl.full((BLOCK_H,), -FP32_INF, tl.float32)
    running_sum = tl.zeros((BLOCK_H,), tl.float32)
    if V_DITHER:
        acc = tl.zeros((num_groups, BLOCK_H, GROUP_SIZE), tl.float32)
    else:
        acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    # The rest sums over t != m, each of non-negative terms (weights relative to the running max); A1 = B + U.
    b_rest = tl.zeros((BLOCK_H,), tl.float32)
    u_rest = tl.zeros((BLOCK_H,), tl.float32)
    w_rest = tl.zeros((BLOCK_H,), tl.float32)
    # The token m held apart: its logit (-inf while none is held), u and g (kept, not recomputed per tile).
    held_logit = tl.full((BLOCK_H,), -FP32_INF, tl.float32)
    u_held = tl.zeros((BLOCK_H,), tl.float32)
    g_held = tl.zeros((BLOCK_H,), tl.float32)
    slots_ok = row_ok
    if HAS_OUTLIERS:
        acc_outliers = tl.zeros((BLOCK_H, OUTLIERS_PAD), tl.float32)

    # V's per-slot dither: counter word 3 is kv_head | kind << 31, built in uint32 (1 << 31 does not fit int32).
    v_head_word = kv_head.to(tl.uint32) | tl.full((), 1 << 31, tl.uint32)
    if V_DITHER:
        v_alpha = tl.reshape(tl.load(VAlpha + kv_head * HEAD_DIM + channels), (num_groups, 1, GROUP_SIZE))
        # Exact channels carry no dither: neither part of xi applies to them.
        v_dithered = tl.full((num_groups, 1, GROUP_SIZE), 1.0, tl.float32)
        if HAS_OUTLIERS:
            v_dithered = tl.reshape(tl.where(exact_channel, 0.0, 1.0), (num_groups, 1, GROUP_SIZE))
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        # A masked-off token reads slot 0 and gets logit -inf, radius 0 and weight 0.
        slots, token_ok, in_range = tile_slots(KvIndices, kv_start, offs, hi, num_slots, OFFSETS_64)
        slots_ok = slots_ok & in_range
        base = slots * NUM_KV_HEADS + kv_head
        if HAS_SKIP:
            token_ok = token_ok & (tl.load(Skip + base, mask=token_ok, other=1) == 0)
        # QK one channel group at a time, [BLOCK_H, G] x [G, N] dots: the group scale multiplies whole
        # columns, so nothing is reduced across lanes, and the radius accumulates on the same [H, N] layout.
        logits = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
        sigma_sq = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
        k_scales = tl.load(KScales + base[:, None] * num_groups + groups[None, :]).to(tl.float32)  # [N, NG]
        for g in tl.static_range(num_groups):
            group_channels = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
            codes_g = tl.load(KCodes + base[:, None] * HEAD_DIM + group_channels[None, :])
            alpha_g = tl.load(KAlpha + kv_head * HEAD_DIM + group_channels)
            q_g = tl.load(
                Q + row * stride_qb + heads[:, None] * stride_qh + group_channels[None, :],
                mask=head_ok[:, None],
                other=0.0,
            )
            if HAS_OUTLIERS:
                # Exact channels carry no dither (their codes are 0).
                exact_g = tl.load(OutlierIndex + kv_head * HEAD_DIM + group_channels) >= 0
                q_alpha = channel_dither_term(tl.where(exact_g[None, :], 0.0, q_g), alpha_g)
            else:
                q_alpha = channel_dither_term(q_g, alpha_g)
            part = qk_group(q_g, codes_g, q_alpha, BLOCK_H, BLOCK_N, INTERPRETED)
            scale_g = tl.sum(tl.where(groups[None, :] == g, k_scales, 0.0), axis=1)
            logits += part * scale_g[None, :]
            if CERTIFICATE:
                radius_q_g = q_g.to(tl.float32)
                if HAS_OUTLIERS:
                    radius_q_g = tl.where(exact_g[None, :], 0.0, radius_q_g)
                sigma_sq = add_sigma_terms(sigma_sq, radius_q_g, scale_g, sigma_coef)
        logits = logits * sm_scale
        if HAS_OUTLIERS:
            k_exact = tl.load(
                KOutliers + base[:, None] * NUM_OUTLIERS + outlier_index[None, :],
                mask=token_ok[:, None] & outlier_ok[None, :],
                other=0.0,
            )
            # fp16/bf16 products are exact in fp32; few channels, so no dot.
            exact_part = tl.sum(q_outliers.to(tl.float32)[:, None, :] * k_exact.to(tl.float32)[None, :, :], axis=2)
            logits += exact_part * sm_scale
        logits = tl.where(token_ok[None, :], logits, -FP32_INF)

        new_max, shift, alpha, weights, running_sum = softmax_tile(logits, running_max, running_sum)

        if CERTIFICATE:
            b_rest, u_rest, w_rest, held_logit, u_held, g_held = certificate_tile(
                logits, weights, live_sigma_sq(sigma_sq, token_ok[None, :]), chat, start, last_start, last_start,
                shift, alpha, b_rest, u_rest, w_rest, held_logit, u_held, g_held, BLOCK_N, INTERPRETED,
            )  # fmt: skip

        v_codes = tl.load(VCodes + base[:, None] * HEAD_DIM + channels[None, :])
        v_scales = tl.load(VScales + base[:, None] * num_groups + groups[None, :])
        if V_DITHER:
            # Output: sum_t p_t s_t (code_t - xi_t), one batched dot over the groups: [NG, H, N] weights
            # (p~ times the group's scale, split into three exact bf16 terms) by [NG, N, G] operands.
            group_weights = weights[None, :, :] * tl.trans(v_scales.to(tl.float32))[:, None, :]
            w_hi, w_mid, w_lo = _split_bf16(group_weights)
            acc = acc * alpha[None, :, None]
            # code -> fp32 -> bf16: exact, and Triton's interpreter mis-converts integers -> bf16 directly.
            v_operand = _by_group(stored_code_values(v_codes).to(tl.bfloat16), BLOCK_N, num_groups, GROUP_SIZE)
            acc = _dot16(w_hi, v_operand, acc, INTERPRETED)
            acc = _dot16(w_mid, v_operand, acc, INTERPRETED)
            acc = _dot16(w_lo, v_operand, acc, INTERPRETED)
            # The dither: sum_t w_t (-alpha_c - beta_t) = -alpha_c sum_t w_t - sum_t w_t beta_t, per group and head.
            v_beta = slot_dither(slot_word(seed, slots, layer, v_head_word), DITHER_BITS)
            weight_sum = tl.sum(group_weights, axis=2)[:, :, None]
            beta_sum = tl.sum(group_weights * v_beta[None, None, :], axis=2)[:, :, None]
            acc = acc - (v_alpha * weight_sum + beta_sum) * v_dithered
        else:
            acc = pv_nearest(
                acc, weights, alpha, v_codes, v_scales, BLOCK_N, num_groups, GROUP_SIZE, HEAD_DIM, INTERPRETED
            )
        if HAS_OUTLIERS:
            v_exact = tl.load(
                VOutliers + base[:, None] * NUM_OUTLIERS + outlier_index[None, :],
                mask=token_ok[:, None] & outlier_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc_outliers = acc_outliers * alpha[:, None] + tl.sum(weights[:, :, None] * v_exact[None, :, :], axis=1)
        running_max = new_max

    if V_DITHER:
        out = tl.reshape(tl.permute(acc, (1, 0, 2)), (BLOCK_H, HEAD_DIM))
    else:
        out = acc * (1.0 / P_SCALE)
    if HAS_OUTLIERS:
        one_hot = (outlier_channel[:, None] == channels[None, :]) & outlier_ok[:, None]  # [M, D]
        out += tl.sum(tl.where(one_hot[None, :, :], acc_outliers[:, :, None], 0.0), axis=1)
    safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
    poison = tl.where(slots_ok, 0.0, (FP32_INF - FP32_INF))
    part_row = (row * num_q_heads + heads) * NUM_SPLITS + split
    tl.store(
        PartOut + part_row[:, None] * HEAD_DIM + channels[None, :],
        out / safe_sum[:, None] + poison,
        mask=head_ok[:, None],
    )
    empty = running_sum == 0
    tl.store(PartLse + part_row, tl.where(empty, -FP32_INF, running_max + tl.log(safe_sum)) + poison, mask=head_ok)
    if CERTIFICATE:
        store_certificate_partials(
            PartMax, PartA1, PartB, PartURest, PartPRest, PartU, part_row, head_ok, held_logit, safe_sum, poison,
            b_rest, u_rest, w_rest, u_held,
        )  # fmt: skip


@triton.jit
def _first_max(logit_a, index_a, u_a, logit_b, index_b, u_b):
    """The larger logit with its index and u, the lower index on ties (the first split's)."""
    take_a = (logit_a > logit_b) | ((logit_a == logit_b) & (index_a < index_b))
    return tl.where(take_a, logit_a, logit_b), tl.where(take_a, index_a, index_b), tl.where(take_a, u_a, u_b)


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def merge_weights(lse, AXIS: tl.constexpr):
    """``(has_tokens, LSE, norm, weight_sum, live)`` of the splits' LSEs along ``AXIS`` (-inf where a split is
    masked off): whether any split read a token, the row's LSE (-inf where none did), each split's share
    ``exp(lse_s - LSE)``, the sum of the weights and which splits read a token. A NaN split LSE (a poisoned split)
    makes the sum and the LSE NaN, and the callers poison the row from the sum."""
    total = tl.max(lse, axis=AXIS)
    has_tokens = total > -FP32_INF
    safe_total = tl.where(has_tokens, total, 0.0)
    weight = tl.where(lse > -FP32_INF, tl.exp(lse - tl.expand_dims(safe_total, AXIS)), 0.0)
    weight = tl.where(lse != lse, (FP32_INF - FP32_INF), weight)
    weight_sum = tl.sum(weight, axis=AXIS)
    global_lse = tl.where(has_tokens, safe_total + tl.log(tl.where(has_tokens, weight_sum, 1.0)), -FP32_INF)
    global_lse = tl.where(weight_sum != weight_sum, (FP32_INF - FP32_INF), global_lse)
    norm = tl.where(tl.expand_dims(has_tokens, AXIS), weight / tl.expand_dims(weight_sum, AXIS), 0.0)
    return has_tokens, global_lse, norm, weight_sum, lse > -FP32_INF


@triton.jit
def load_split_certificates(PartMax, PartA1, PartB, PartURest, PartPRest, PartU, part, split_ok):
    """The splits' certificate partials at ``part`` (``store_certificate_partials``' six), in that order."""
    return (
        tl.load(PartMax + part, mask=split_ok, other=-FP32_INF),
        tl.load(PartA1 + part, mask=split_ok, other=0.0),
        tl.load(PartB + part, mask=split_ok, other=0.0),
        tl.load(PartURest + part, mask=split_ok, other=0.0),
        tl.load(PartPRest + part, mask=split_ok, other=0.0),
        tl.load(PartU + part, mask=split_ok, other=0.0),
    )


@triton.jit
def merge_split_certificates(partials, norm, live, splits, lse_or_0, AXIS: tl.constexpr):
    """A row's accumulators ``(A1, B, U_rest, P_rest, p_max, u_max)`` from its splits' ``partials``
    (``load_split_certificates``) along ``AXIS``.

    The row's held token is the live splits' held token of largest logit, the first split's on ties (``splits``:
    each split's index); the losing splits' held tokens join the rest sums with their exact terms, and a split that
    holds none (logit -inf, u 0) adds its rest sums alone. ``norm``: each split's share ``exp(lse_s - LSE)``, which
    turns its within-split normalisation into the row's; ``lse_or_0``: the row's LSE, 0 where it has no token."""
    split_max, a1_parts, b_parts, u_rest_parts, p_rest_parts, u_parts = partials
    # The held token's logit, split and u in one reduction.
    max_logit, winner, u_max = tl.reduce(
        (tl.where(live, split_max, -FP32_INF), splits, tl.where(live, u_parts, 0.0)), AXIS, _first_max
    )
    loser = live & (splits != tl.expand_dims(winner, AXIS))
    # p~ of each split's held token: exp(held_s - LSE), 0 where the split holds none (held_s = -inf).
    p_arg = tl.where(live, tl.exp(split_max - tl.expand_dims(lse_or_0, AXIS)), 0.0)
    p_max = tl.where(max_logit > -FP32_INF, tl.exp(max_logit - lse_or_0), 0.0)
    expm1_parts, g_parts = expm1_and_g(u_parts)
    # Each sum takes the live splits' rest sums and the losing splits' held tokens together.
    a1, b, u_rest, p_rest = tl.reduce(
        (
            tl.where(live, mul_nonneg(norm, a1_parts), 0.0) + tl.where(loser, mul_nonneg(p_arg, expm1_parts), 0.0),
            tl.where(live, mul_nonneg(norm, b_parts), 0.0) + tl.where(loser, mul_nonneg(p_arg, g_parts), 0.0),
            tl.where(live, mul_nonneg(norm, u_rest_parts), 0.0) + tl.where(loser, mul_nonneg(p_arg, u_parts), 0.0),
            tl.where(live, norm * p_rest_parts, 0.0) + tl.where(loser, p_arg, 0.0),
        ),
        AXIS,
        _add4,
    )
    return a1, b, u_rest, p_rest, p_max, u_max


@triton.jit
def certificate_bound(a1, b, u_rest, p_rest, p_max, u_max):
    """``min(T1, T4, P, PA)`` of the accumulators, before the evaluation slack
    (``reference.certificate_from_accumulators``)."""
    e_m = tl.exp(u_max)
    expm1_m, g_m = expm1_and_g(u_max)
    t1 = a1 + mul_nonneg(p_max, expm1_m)
    b_total = b + mul_nonneg(p_max, g_m)
    t4 = mul_nonneg(e_m, a1) + mul_nonneg(expm1_m, p_rest)
    pa_inner = mul_nonneg(e_m, b) + mul_nonneg(expm1_m, u_rest) + mul_nonneg(g_m, p_rest)
    return tl.minimum(tl.minimum(t1, t4), tl.minimum(tl.sqrt(b_total / 2.0), tl.sqrt(pa_inner / 2.0)))


@triton.jit
def store_merged_certificate(
    Certificate, Accumulators, index, field, mask, partials, splits, merged, eval_slack, AXIS: tl.constexpr
):  # fmt: skip
    """Evaluate a row's certificate from its splits' ``partials`` along ``AXIS`` and store it at ``index`` with the
    six accumulators, one ``field`` (rows x heads) apart (``mask``: which, or None for all). ``merged``:
    ``merge_weights``' result; where its sum of weights is NaN (a poisoned split) every value stored is NaN."""
    has_tokens, global_lse, norm, weight_sum, live = merged
    accumulators = merge_split_certificates(partials, norm, live, splits, tl.where(has_tokens, global_lse, 0.0), AXIS)
    poison = tl.where(weight_sum != weight_sum, (FP32_INF - FP32_INF), 0.0)
    bound = tl.where(has_tokens, certificate_bound(*accumulators) * eval_slack, 0.0)
    tl.store(Certificate + index, bound + poison, mask=mask)
    for position in tl.static_range(6):
        tl.store(Accumulators + position * field + index, accumulators[position] + poison, mask=mask)


@triton.jit
def decode_stage2(
    PartOut,
    PartLse,
    PartMax,
    PartA1,
    PartB,
    PartURest,
    PartPRest,
    PartU,
    Out,
    Lse,
    Certificate,
    Accumulators,
    stride_ob,
    stride_oh,
    eval_slack,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CERTIFICATE: tl.constexpr,
):
    """Merge the splits with LSE weights; evaluate the certificate like ``reference.certificate_from_accumulators``.

    The token held for the row is the first argmax among all the row's singletons, as in
    ``reference.accumulate_certificate`` (``merge_split_certificates``).

    ``Accumulators`` is ``[6, rows, NUM_Q_HEADS]``: ``CertificateAccumulators``' fields in order, one block (the grid's
    rows are its rows), so that the host passes one tensor, not six views."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    part = (row * NUM_Q_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(PartLse + part, mask=split_ok, other=-FP32_INF)
    merged = merge_weights(lse, 0)
    _, global_lse, norm, weight_sum, _ = merged
    channels = tl.arange(0, HEAD_DIM)
    parts = tl.load(PartOut + part[:, None] * HEAD_DIM + channels[None, :], mask=(norm > 0)[:, None], other=0.0)
    out = tl.sum(tl.where((norm > 0)[:, None], norm[:, None] * parts, 0.0), axis=0)
    out = out + tl.where(weight_sum == weight_sum, 0.0, (FP32_INF - FP32_INF))
    tl.store(Out + row * stride_ob + head * stride_oh + channels, out.to(Out.dtype.element_ty))
    tl.store(Lse + row * NUM_Q_HEADS + head, global_lse)
    if CERTIFICATE:
        partials = load_split_certificates(PartMax, PartA1, PartB, PartURest, PartPRest, PartU, part, split_ok)
        store_merged_certificate(
            Certificate, Accumulators, row * NUM_Q_HEADS + head, tl.num_programs(0) * NUM_Q_HEADS, None, partials,
            splits, merged, eval_slack, 0,
        )  # fmt: skip
