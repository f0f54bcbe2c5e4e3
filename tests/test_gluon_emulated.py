"""The Gluon decode stage 1 against the reference on CPU, run in Triton's interpreter with its layouts dropped and
its inline PTX emulated (tests/gluon_emulation.py). The GPU runs the same cases compiled (test_kernels_gpu.py).
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import ptx_subset  # noqa: E402
from gluon_emulation import _h_of, _neg_codes, _transposed_blocks, _v_split, emulated, linear_coordinate  # noqa: E402
from kernel_cases import (  # noqa: E402
    assert_matches_oracle,
    far_token_case,
    filled_pool,
    float32_logit_tolerance,
    interpreter_only,
    non_finite_token_readers,
    oracle,
    overflowing_query_case,
    radius_straddling_case,
    relative_error,
)

import witcert.kernels  # noqa: E402
from witcert.kernels import attention, decode_attention, gluon_decode, gluon_tiles, reference  # noqa: E402

pytestmark = interpreter_only("the GPU runs the Gluon kernel compiled: test_kernels_gpu.py")

DELTA = reference.delta_step(28, 28)


@pytest.fixture
def run_gluon(monkeypatch):
    """Decode's stage 1 is the emulated Gluon kernel wherever it covers the call."""
    monkeypatch.setattr(witcert.kernels, "gluon_decode", emulated(gluon_decode))
    monkeypatch.setattr(attention, "_runs_gluon", lambda q, pool, kv_indices: attention.gluon_covers(q.dtype, pool))


def _query(rows: int, heads: int, seed: int = 7, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(rows, heads, 128, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(
    ("kv_heads", "group", "page_size", "dtype", "splits", "v_dither"),
    [
        (4, 7, 1, torch.float16, None, False),
        (2, 7, 16, torch.bfloat16, 3, True),
        (2, 1, 16, torch.float16, 2, False),
        (1, 12, 1, torch.float16, 2, False),
    ],
    ids=["qwen-shape-page1", "gqa7-page16-bf16-vdither", "mha-page16", "two-head-blocks"],
)  # fmt: skip
def test_emulated_gluon_decode_matches_reference(run_gluon, kv_heads, group, page_size, dtype, splits, v_dither):
    lengths = [1, 700, 0, 129]
    pool, indptr, slots = filled_pool(lengths, kv_heads=kv_heads, page_size=page_size, v_dither=v_dither, dtype=dtype)
    q = _query(len(lengths), kv_heads * group, dtype=dtype)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=splits)
    assert result.path == "gluon-gpu"
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def peak_between_ends_case() -> tuple[witcert.kernels.KVPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows (1000 and 300 tokens, one KV head of 7 query heads, V rounded) whose largest logit sits between the
    row's end tiles: every query head is the key of token 300 (row 0) or 200 (row 1) times 0.15 to 1.05, plus noise.
    The reference holds apart an end tile's token there, not the argmax, and leaves the argmax in its cell. Returns
    (pool, indptr, slots, q)."""
    pool, indptr, slots = filled_pool([1000, 300], kv_heads=1, v_dither=False)
    generator = torch.Generator().manual_seed(5)
    rows = []
    for row, peak in ((0, 300), (1, 200)):
        key = pool.dequantize(1, slots[int(indptr[row]) + peak].reshape(1), "k")[0, 0].float()  # [D]
        strength = torch.linspace(0.15, 1.05, 7)[:, None]
        rows.append(strength * key + 0.3 * torch.randn(7, 128, generator=generator))
    return pool, indptr, slots, torch.stack(rows).half()


@pytest.mark.parametrize("splits", [1, 4], ids=["one-split", "splits-without-end-tiles"])
def test_emulated_gluon_holds_an_end_tiles_token_where_the_peak_lies_between_the_ends(run_gluon, splits):
    """With one split the tiles between the ends move each warp's running max past its held token, which stays;
    with four, the splits around the peak (row 0: tokens 256-511 and 512-767; row 1: 128-255) hold no token
    (``PartMax`` -inf) and stage 2 takes the held token from another split."""
    pool, indptr, slots, q = peak_between_ends_case()
    for row, peak in ((0, 300), (1, 200)):
        expected = oracle(q[row], pool, 1, slots[int(indptr[row]) : int(indptr[row + 1])], delta=DELTA)
        sharp = expected.probs.argmax(-1) == peak
        assert sharp.sum() >= 4, "the peak is not the argmax of most heads"
        # There the held token is not the argmax: an end tile's token of smaller weight.
        assert torch.all(expected.accumulators.p_max[sharp] < expected.probs[sharp, peak])
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=splits)
    assert result.path == "gluon-gpu"
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_emulated_gluon_radii_on_both_sides_of_a_quarter_match_reference(run_gluon):
    pool, indptr, slots, q = radius_straddling_case("cpu", DELTA)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA)
    assert result.path == "gluon-gpu"
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_emulated_gluon_without_certificate_gives_the_same_output(run_gluon):
    pool, indptr, slots = filled_pool([200, 5], kv_heads=2, v_dither=False)
    q = _query(2, 14)
    with_cert = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2)
    without = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2, certificate=False)
    assert without.path == "gluon-gpu" and without.certificate is None
    assert torch.equal(with_cert.out, without.out) and torch.equal(with_cert.lse, without.lse)


def test_emulated_gluon_leaves_skipped_pairs_out_like_the_reference(run_gluon):
    lengths = [300, 40]
    pool, indptr, slots = filled_pool(lengths, kv_heads=2, v_dither=False)
    q = _query(2, 14)
    skip = torch.rand(pool.num_slots, 2, generator=torch.Generator().manual_seed(11)) < 0.3
    skip[slots[:128], 1] = True  # row 0, KV head 1: a whole first tile skipped before live tokens
    skip[slots[300:], 0] = True  # row 1, KV head 0: every token skipped
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2, skip=skip)
    assert result.path == "gluon-gpu"
    for row in range(2):
        row_slots = slots[int(indptr[row]) : int(indptr[row + 1])]
        expected = oracle(q[row], pool, 1, row_slots, delta=DELTA, skip=skip)
        assert relative_error(result.out[row], expected.out) <= 1e-5
        torch.testing.assert_close(result.certificate[row], expected.certificate, rtol=1e-4, atol=0.0)
    assert torch.all(result.out[1, :7] == 0) and torch.all(result.lse[1, :7] == -math.inf)
    assert torch.all(result.certificate[1, :7] == 0)


def test_emulated_gluon_poisons_a_row_with_an_out_of_range_slot(run_gluon):
    pool, indptr, slots = filled_pool([100, 150], kv_heads=1, v_dither=False)
    bad = slots.clone()
    bad[120] = 2**30
    result = decode_attention(_query(2, 7), pool, 1, indptr, bad, delta_step=DELTA, num_kv_splits=2, validate=False)
    assert result.path == "gluon-gpu"
    assert torch.isnan(result.certificate[1]).all() and torch.isfinite(result.certificate[0]).all()


def test_emulated_gluon_counts_an_overflowing_radius_where_its_weight_underflows(run_gluon):
    pool, indptr, slots, q = far_token_case()
    expected = oracle(q[0], pool, 1, slots, delta=DELTA)
    assert expected.probs[0, 17] == 0 and torch.isinf(expected.certificate).all()
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA)
    assert result.path == "gluon-gpu"
    assert torch.isposinf(result.certificate[0]).all()
    assert relative_error(result.out[0], expected.out) < 1e-5


@pytest.mark.parametrize("zero_groups", [False, True], ids=["random-keys", "zero-groups"])
def test_emulated_gluon_gives_an_infinite_certificate_where_the_radius_overflows(run_gluon, zero_groups):
    pool, indptr, slots, q, sm_scale = overflowing_query_case(zero_groups=zero_groups)
    result = decode_attention(q, pool, 1, indptr, slots, sm_scale=sm_scale, delta_step=DELTA)
    assert result.path == "gluon-gpu"
    for row in range(2):
        row_slots = slots[indptr[row] : indptr[row + 1]]
        expected = oracle(q[row], pool, 1, row_slots, delta=DELTA, sm_scale=sm_scale)
        assert torch.isposinf(result.certificate[row]).all(), result.certificate[row]
        tolerance = float32_logit_tolerance(expected, pool.dequantize(1, row_slots, "v"))
        assert relative_error(result.out[row], expected.out) < tolerance


@pytest.mark.parametrize("side", ["k", "v"])
def test_emulated_gluon_poisons_only_the_readers_of_a_nan(run_gluon, side):
    """The NaN is written unvalidated by the write kernel (a NaN scale; the reference refuses to quantize it)."""
    assert non_finite_token_readers("cpu", math.nan, side, delta=DELTA) == "gluon-gpu"


@pytest.mark.parametrize("magnitude", [1e5, 1e-6])
def test_emulated_gluon_rescales_bf16_queries_outside_the_fp16_range(run_gluon, magnitude):
    pool, indptr, slots = filled_pool([300, 40], kv_heads=1, v_dither=False, dtype=torch.bfloat16)
    q = (_query(2, 7, dtype=torch.float32) * magnitude).to(torch.bfloat16)
    sm_scale = 1.0 / (magnitude * math.sqrt(128))
    result = decode_attention(q, pool, 1, indptr, slots, sm_scale=sm_scale, delta_step=DELTA, num_kv_splits=2)
    assert result.path == "gluon-gpu"
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA, sm_scale=sm_scale)


# --- the emulation's asm blocks against their PTX ------------------------------------------------------------


def test_neg_codes_ptx_gives_minus_each_stored_code_as_emulated():
    """Every stored byte in each of the four positions of a word: element i of the two f16x2 out is ``-code``
    of byte i, as ``gluon_emulation._neg_codes`` computes."""
    asm = gluon_tiles._neg_codes.fn.__code__.co_consts
    text = next(c for c in asm if isinstance(c, str) and "prmt" in c)
    for base in range(256):
        stored = np.array([(base + 67 * i) % 256 for i in range(4)], dtype=np.uint8)
        out = ptx_subset.run(text, {"$2": int(stored.view(np.uint32)[0])})
        values = np.concatenate([ptx_subset.halves(out["$0"]), ptx_subset.halves(out["$1"])])
        np.testing.assert_array_equal(values, _neg_codes(stored).astype(np.float64))


def test_h_ptx_matches_the_emulation_and_the_reference_on_both_sides_of_its_branch():
    """``_h_of``'s asm on pairs of arguments (one thread's two heads): both below 1/4 (the branch skips the
    exponential), one on each side, both above, up to where ``g`` overflows and ``x = +inf``. Each result is within
    1e-6 of ``gluon_emulation._h_of`` (the PTX reader takes ``ex2`` and ``rcp`` as exact, as the emulation does) and
    within 1e-5 of ``reference.h_of`` in float32; +inf where the reference's is, never NaN."""
    text = gluon_tiles._H_ASM.value
    small = [0.0, 1e-30, 1e-3, 0.05, 0.2, 0.2499]
    large = [0.25, 0.3, 1.0, 7.5, 40.0, 88.0, 89.0, 1e10, 1e19, 1e20, 3e38, math.inf]
    pairs = [(a, b) for a in small for b in small[::2]] + [(a, b) for a in small + large for b in large]
    pairs += [(b, a) for a, b in pairs]
    for pair in pairs:
        x = np.array(pair, dtype=np.float32)
        out = ptx_subset.run(text, {f"${2 + i}": int(x.view(np.uint32)[i]) for i in range(2)})
        got = np.array([ptx_subset.f32(out[f"${i}"]) for i in range(2)], dtype=np.float32)
        np.testing.assert_allclose(got, _h_of(x), rtol=1e-6, atol=0.0, err_msg=str(pair))  # fma: one rounding
        expected = reference.h_of(torch.from_numpy(x)).numpy()
        assert not np.isnan(got).any(), pair
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=0.0, err_msg=str(pair))


def test_v_split_ptx_matches_the_emulation_in_the_layouts_register_order():
    """The V operand asm on one pack of ``_V_FRAGMENT`` (register bits: the next token, then the next group): two
    tokens' index pairs in two groups and the tokens' scale words. Its four ``f16x2`` outputs equal
    ``gluon_emulation._v_split``, and for V's scales (4 significant bits, as the pool stores them) they are ``s *
    code`` exactly, for both bytes of both tokens in both groups, for scales up to 512 (``|s code| <= 65504`` for
    every code) including subnormal ones."""
    assert gluon_tiles._V_FRAGMENT.value.reg_bases[:2] == [[0, 1, 0], [0, 0, 8]]
    text = gluon_tiles._V_SPLIT_ASM.value
    generator = np.random.default_rng(5)
    largest = int(np.float16(512.0).view(np.uint16))
    for trial in range(2000):
        stored = generator.integers(1, 256, size=(2, 2, 2), dtype=np.uint8)  # [group, token, index]: codes +-127
        # Every fourth trial: the smallest subnormal scale and the largest subnormal one of 4 significant bits.
        scale_bits = np.array([[1, 0x380], [0x380, 1]], dtype=np.uint16)
        if trial % 4:
            scale_bits = generator.integers(1, largest + 1, size=(2, 2), dtype=np.uint16)  # [token, group]
        stored_scales = reference.fp16_scale_rounded_up(
            torch.from_numpy(scale_bits.view(np.float16).astype(np.float32)) * reference.SCALE_DIVISOR,
            reference.V_SCALE_SIGNIFICANT_BITS,
        )
        scale_bits = stored_scales.numpy().view(np.uint16)
        scales = scale_bits.view(np.float16)
        words = scale_bits.astype(np.uint32)[:, 0] | (scale_bits.astype(np.uint32)[:, 1] << 16)  # per token
        # Register i of the codes: group i, token t's two bytes in the low half (little-endian); the words of the
        # pack's four elements: token t, t + 1, t, t + 1.
        inputs = {f"${4 + g}": int(stored[g].reshape(-1).view(np.uint32)[0]) for g in range(2)}
        inputs.update({f"${6 + i}": int(words[i % 2]) for i in range(4)})
        out = ptx_subset.run(text, inputs)
        # Output k's registers: group 0, group 1; each (token t, token t + 1).
        got = [np.stack([ptx_subset.halves(out[f"${2 * k + g}"]) for g in range(2)]) for k in range(2)]
        # The emulation on [group as the j bit of 8, token, index pair]: j = 0 (group 0) and j = 8 (group 1).
        pairs = np.zeros((2, 16), dtype=np.int16)
        pairs[:, [0, 8]] = stored.view(np.int16)[..., 0].T  # [token, j]
        expected = _v_split(pairs, np.repeat(words.astype(np.int64)[:, None], 16, axis=1))
        for k in range(2):
            np.testing.assert_array_equal(got[k], expected[k][:, [0, 8]].T.astype(np.float64))
        even, odd = got
        source = (stored.astype(np.float64) - 128.0) * scales.astype(np.float64).T[:, :, None]
        np.testing.assert_array_equal(even, source[..., 0])
        np.testing.assert_array_equal(odd, source[..., 1])


def _element(layout: object, lane: int, register: int) -> tuple[int, ...]:
    """The ``[token, head]`` a lane's register holds in a warp's part of a ``[warp, token, head]`` linear layout."""
    by_lane, by_register = linear_coordinate(layout.lane_bases, lane), linear_coordinate(layout.reg_bases, register)
    return tuple(a ^ b for a, b in zip(by_lane, by_register, strict=True))[1:]


def test_transposed_blocks_movmatrix_matches_the_emulation_in_the_layouts_register_order():
    """``movmatrix.m8n8.trans.b16`` on the registers ``_P_ROWS`` gives a lane (PTX: lane i holds row i / 4, columns
    2 (i % 4) and 2 (i % 4) + 1 of an 8x8 matrix, the pack's two registers the blocks of rows 0-7 and 8-15), as
    the PTX ISA defines it, puts in each register what ``gluon_emulation._transposed_blocks`` says the element there
    holds."""
    layout = gluon_tiles._P_ROWS.value
    x = np.random.default_rng(3).standard_normal((1, 16, 8)).astype(np.float16)
    expected = _transposed_blocks(x)[0]
    for block in range(2):
        # The source matrix as the lanes hold it: register 2 block + e of lane i is row i // 4, column 2 (i % 4) + e.
        matrix = np.zeros((8, 8), dtype=np.float16)
        for lane in range(32):
            for e in range(2):
                token, head = _element(layout, lane, 2 * block + e)
                assert (token % 8, head, token // 8) == (lane // 4, 2 * (lane % 4) + e, block)
                matrix[lane // 4, 2 * (lane % 4) + e] = x[0, token, head]
        # After movmatrix.trans the same register of lane i holds the transposed matrix's element there.
        for lane in range(32):
            for e in range(2):
                token, head = _element(layout, lane, 2 * block + e)
                assert matrix.T[lane // 4, 2 * (lane % 4) + e] == expected[token, head]
