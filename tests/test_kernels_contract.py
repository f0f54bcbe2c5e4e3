"""Kernel contract tests on CPU: the Triton kernels in the interpreter against the reference oracle.

Shapes are small and blocks big (the interpreter costs per program launched, not per element).
The same contracts run at larger shapes on the GPU in test_kernels_gpu.py.
"""

from __future__ import annotations

import math
import os

# Must precede the first import of the Triton kernels (triton.jit reads it at decoration time).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_cases import (  # noqa: E402
    assert_matches_oracle,
    extend_oracle,
    far_token_case,
    filled_pool,
    float32_logit_tolerance,
    interpreter_only,
    non_finite_token_readers,
    oracle,
    overflowing_extend_certificates,
    overflowing_query_case,
    paged_slots,
    relative_error,
)

from witcert.kernels import (  # noqa: E402
    ExtendBounds,
    KVPool,
    attention,
    decode_attention,
    extend_attention,
    reference,
)
from witcert.kernels.attention import wave_splits  # noqa: E402
from witcert.kernels.launch import LaunchConfig  # noqa: E402
from witcert.kernels.pool import decode_codes, encode_codes  # noqa: E402

pytestmark = interpreter_only("GPU runs are in test_kernels_gpu.py")

DELTA = reference.delta_step(28, 28)


def _query(rows: int, heads: int, head_dim: int = 128, seed: int = 7, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads, head_dim, generator=generator) * scale).half()


# --- write ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dither_bits", "outliers", "v_dither", "kv_heads"),
    [(8, False, True, 2), (8, True, False, 3), (16, True, True, 2), (24, False, True, 3)],
)
def test_write_is_bit_identical_to_reference(dither_bits, outliers, v_dither, kv_heads):
    generator = torch.Generator().manual_seed(dither_bits)
    head_dim, tokens = 64, 45
    # Each head its own outlier pairs: the kernel writes every head of a token in one program.
    pairs = ([3, 17], [0, 30], [9, 10])[:kv_heads]
    channels = torch.stack([reference.rope_pair_channels(p, head_dim) for p in pairs]) if outliers else None
    pool = KVPool(
        96, 2, kv_heads, head_dim, group_size=16, outlier_channels=channels, seed=2**40 + 5,
        dither_bits=dither_bits, v_dither=v_dither, device="cpu",
    )  # fmt: skip
    slots = torch.randperm(96, generator=generator)[:tokens]
    k = (torch.randn(tokens, kv_heads, head_dim, generator=generator) * 3).half()
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).half()
    k[0] = 0.0  # an all-zero token: scale 0, codes 0
    pool.write(1, slots, k, v)
    for side, (kind, x) in enumerate((("k", k), ("v", v))):
        expected = reference.quantize(
            x, seed=pool.seed, layer=1, slots=slots, kind=kind, group_size=16, outlier_channels=channels,
            dither_bits=dither_bits, dither=kind == "k" or v_dither,
        )  # fmt: skip
        assert torch.equal(pool.scales[1, side, slots], expected.scales)
        assert torch.equal(pool.codes[1, side, slots], encode_codes(expected.codes))
        assert torch.equal(pool.outlier_values[1, side, slots], expected.outlier_values)
        # Nothing clipped: every code within [-127, 127] and every error within s/2.
        assert int(decode_codes(pool.codes[1, side, slots]).abs().max()) <= 127
        error = (pool.dequantize(1, slots, kind) - x.float()).abs()
        assert bool((error <= pool.quantized(1, slots, kind).channel_scales() / 2).all())
    untouched = torch.ones(96, dtype=torch.bool)
    untouched[slots] = False
    assert not pool.codes[1, :, untouched].any() and not pool.codes[0].any()


def test_codes_are_stored_as_code_plus_128():
    """The pool stores each int8 code as the byte ``code + 128`` (the read kernels' fp16 construction needs no
    ``xor``); ``decode_codes`` inverts ``encode_codes`` on every byte."""
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    stored = encode_codes(codes)
    assert stored.dtype == torch.uint8
    assert torch.equal(stored.to(torch.int16), codes.to(torch.int16) + 128)
    assert torch.equal(decode_codes(stored), codes)


def _assert_write_matches_reference(pool: KVPool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    pool.write(0, slots, k, v)
    for side, (kind, x) in enumerate((("k", k), ("v", v))):
        expected = reference.quantize(
            x, seed=pool.seed, layer=0, slots=slots, kind=kind, group_size=pool.group_size,
            dither_bits=pool.dither_bits, dither=pool.dithered(kind),
        )  # fmt: skip
        assert torch.equal(pool.scales[0, side, slots], expected.scales), kind
        assert torch.equal(pool.codes[0, side, slots], encode_codes(expected.codes)), kind


@pytest.mark.parametrize("dither_bits", [8, 16, 24])
def test_write_is_bit_identical_on_rounding_ties_and_extreme_values(dither_bits):
    # The write kernel divides by a reciprocal and builds dithers and codes by bits (docs/KERNELS.md, "Write"):
    # here a quotient one ulp off, or ties rounded other than to even, change codes.
    generator = torch.Generator().manual_seed(dither_bits)
    tokens, kv_heads, head_dim, group = 24, 2, 128, 32
    group_shape = (tokens, kv_heads, head_dim // group, 1)
    slots = torch.randperm(64, generator=generator)[:tokens]
    pool = KVPool(64, 1, kv_heads, head_dim, group_size=group, seed=77, dither_bits=dither_bits, device="cpu")
    assert not pool.v_dither

    def integers(low: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=generator).double()

    def grouped(x: torch.Tensor) -> torch.Tensor:
        exact = x.reshape(tokens, kv_heads, head_dim).half()
        assert torch.equal(exact.double(), x.reshape(exact.shape))
        return exact

    # V, rounded to nearest: x / s = k + 1/2 exactly, with s = m 2**e (m in 5..7, fp16 subnormals up to 448)
    # pinned by a first channel 126.5 s. RN(1 / s) is inexact for such s, so RN(x RN(1 / s)) is often a
    # tie's neighbour: only the corrected quotient rounds every tie to the reference's even code.
    scale = integers(5, 8, group_shape) * 2.0 ** integers(-23, 7, group_shape)
    v = (integers(-127, 127, group_shape[:3] + (group,)) + 0.5) * scale
    v[..., :1] = 126.5 * scale
    v = grouped(v)
    # K, dithered: x / s + xi = k + 1/2 exactly for 8-bit dithers (s = 2**e pinned the same way, |k| <= 3),
    # within fp16's rounding of it for 16 and 24 bits.
    xi = reference.dither_values(
        seed=pool.seed, layer=0, slots=slots, num_kv_heads=kv_heads, head_dim=head_dim, kind="k",
        dither_bits=dither_bits, dtype=torch.float64,
    )  # fmt: skip
    power = 2.0 ** integers(-14, 9, group_shape)
    k = (integers(-3, 3, group_shape[:3] + (group,)) + 0.5 - xi.reshape(group_shape[:3] + (group,))) * power
    k[..., :1] = 126.5 * power
    k = grouped(k) if dither_bits == 8 else k.reshape(tokens, kv_heads, head_dim).half()
    # Extremes: fp16's largest values, subnormals down to 2**-24 alone and among normal values, signed zeros.
    k[0] = 65504.0 * torch.sign(k[0].float())
    k[1] = integers(-1023, 1024, (kv_heads, head_dim)) * 2.0**-24
    k[2, :, ::2] = k[1, :, ::2]
    k[3] = -0.0
    _assert_write_matches_reference(pool, slots, k, v)
    codes = decode_codes(pool.codes[0, :, slots])
    assert not (codes[1].reshape(-1, group)[:, 1:] % 2).any()  # V: every tie went to the even code
    if dither_bits == 8:
        assert not (codes[0, 4:].reshape(-1, group)[:, 1:] % 2).any()

    # bf16 from the smallest normal, 2**-126, to 7.7e6 (V's largest 4-bit scale covers 7.77e6), V dithered.
    # Next to large values the tiny ones make the corrected quotient's remainder underflow: the quotient can be an
    # ulp off, at |x / s| < 2**-102, which leaves every code as it is. (The interpreter converts bf16 subnormals
    # wrongly, so none here.)
    wide = KVPool(64, 1, kv_heads, head_dim, group_size=group, seed=78, dither_bits=dither_bits, v_dither=True,
                  dtype=torch.bfloat16, device="cpu")  # fmt: skip
    exponents = (integers(-126, 23, group_shape) - 130 * integers(0, 2, group_shape[:3] + (group,))).clamp(-126)
    x = (1 + integers(0, 128, exponents.shape) / 128) * 2.0**exponents * (2 * integers(0, 2, exponents.shape) - 1)
    x = x.clamp(-7.7e6, 7.7e6).reshape(tokens, kv_heads, head_dim).bfloat16()
    _assert_write_matches_reference(wide, slots, x, x.flip(0))


@pytest.mark.parametrize("dither_bits", [8, 16, 24])
def test_regenerated_dither_is_bit_identical_to_reference(dither_bits):
    """The write and gather kernels' ``xi`` and the decode kernels' per-channel table equal the reference's."""
    pool = KVPool(4096, 3, 3, 64, group_size=16, seed=2**63 + 11, dither_bits=dither_bits, device="cpu")
    slots = torch.tensor([0, 1, 77, 4095, 2048, 1023])
    for side, kind in enumerate(("k", "v")):
        expected = reference.dither_values(
            seed=pool.seed, layer=2, slots=slots, num_kv_heads=3, head_dim=64, kind=kind, dither_bits=dither_bits
        )
        for head in range(3):
            assert torch.equal(pool.dither(2, slots, kind, head), expected[:, head])
        alpha = reference.channel_dither_fields(
            seed=pool.seed, layer=2, num_kv_heads=3, head_dim=64, kind=kind, dither_bits=dither_bits
        )
        assert torch.equal(
            pool.channel_dither[2, side], reference.channel_dither_values(alpha, dither_bits, torch.float32)
        )
    # K and V streams differ.
    assert not torch.equal(pool.dither(2, slots, "k", 0), pool.dither(2, slots, "v", 0))


def test_bytes_per_token_counts_codes_scales_and_outliers():
    pool = KVPool(16, 28, 4, 128, outlier_channels=reference.rope_pair_channels([0, 5], 128), device="cpu")
    assert pool.bytes_per_token == 28 * 2 * 4 * (128 + 2 * 4 + 2 * 4)
    assert pool.bytes_per_token == 28 * 2 * 4 * pool.quantized(0, torch.tensor([0]), "k").bytes_per_token_head


# --- decode --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_heads", "group", "page_size", "v_dither", "splits"),
    [(2, 7, 1, True, 3), (2, 7, 16, False, 4), (2, 1, 16, True, 2)],
    ids=["gqa7-page1-vdither", "gqa7-page16-vnearest", "mha-page16"],
)
def test_decode_matches_reference(kv_heads, group, page_size, v_dither, splits):
    lengths = [150, 1, 0, 37]
    pool, indptr, slots = filled_pool(lengths, kv_heads=kv_heads, page_size=page_size, v_dither=v_dither)
    q = _query(len(lengths), kv_heads * group)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=splits)
    assert result.path == "triton-interpreter"
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_decode_matches_reference_at_gemma_3s_head_dim_256():
    """Gemma 3 270M's shape (4 query heads on 1 KV head, head dim 256: 8 groups of 32) on the Triton kernel."""
    lengths = [300, 5]
    pool, indptr, slots = filled_pool(lengths, kv_heads=1, head_dim=256, v_dither=False)
    q = _query(len(lengths), 4, head_dim=256)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2)
    assert result.path == "triton-interpreter"
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_decode_with_outlier_channels_matches_reference():
    channels = reference.rope_pair_channels([2, 40], 128)
    lengths = [90, 20]
    pool, indptr, slots = filled_pool(lengths, kv_heads=2, outlier_channels=channels)
    q = _query(2, 4)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2)
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


@pytest.mark.parametrize("splits", [1, 3])
def test_skipped_pairs_are_left_out_like_the_reference(splits):
    lengths = [150, 40]
    pool, indptr, slots = filled_pool(lengths, kv_heads=2)
    q = _query(2, 14)
    generator = torch.Generator().manual_seed(11)
    skip = torch.rand(pool.num_slots, 2, generator=generator) < 0.3
    skip[slots[:128], 1] = True  # row 0, KV head 1: a whole first tile skipped before live tokens
    skip[slots[150:], 0] = True  # row 1, KV head 0: every token skipped
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=splits, skip=skip)
    for row in range(2):
        row_slots = slots[int(indptr[row]) : int(indptr[row + 1])]
        expected = oracle(q[row], pool, 1, row_slots, delta=DELTA, skip=skip)
        assert relative_error(result.out[row], expected.out) <= 1e-5
        torch.testing.assert_close(result.lse[row], expected.lse, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(result.certificate[row], expected.certificate, rtol=1e-4, atol=0.0)
    # A head with nothing left reads like an empty sequence.
    assert torch.all(result.out[1, :7] == 0) and torch.all(result.lse[1, :7] == -math.inf)
    assert torch.all(result.certificate[1, :7] == 0)


def test_skipping_a_token_for_every_head_equals_removing_it():
    pool, indptr, slots = filled_pool([60], kv_heads=2)
    q = _query(1, 4)
    skip = torch.zeros(pool.num_slots, 2, dtype=torch.bool)
    skip[slots[::3]] = True
    kept = slots[(torch.arange(60) % 3) != 0]
    skipped = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2, skip=skip)
    removed = decode_attention(q, pool, 1, torch.tensor([0, kept.numel()], dtype=torch.int32), kept,
                               delta_step=DELTA, num_kv_splits=2)  # fmt: skip
    assert relative_error(skipped.out[0], removed.out[0]) <= 1e-6
    torch.testing.assert_close(skipped.lse, removed.lse, rtol=1e-6, atol=1e-6)
    # The union bound still counts the 60 tokens of the row, not the 40 read: never a smaller radius.
    assert torch.all(skipped.certificate >= removed.certificate)


def test_skip_must_be_a_bool_mask_over_slots_and_kv_heads():
    pool, indptr, slots = filled_pool([10], kv_heads=2)
    q = _query(1, 4)
    for bad in (torch.zeros(pool.num_slots, 2, dtype=torch.uint8), torch.zeros(pool.num_slots, 3, dtype=torch.bool)):
        with pytest.raises(ValueError, match="skip must be"):
            decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, skip=bad)


def test_certificate_is_inf_where_the_reference_overflows_never_nan():
    lengths = [40, 30]
    pool, indptr, slots = filled_pool(lengths, kv_heads=1, key_scale=2000.0)
    q = _query(2, 2, scale=300.0)
    q[1] = q[1] / 3000.0  # the second row stays finite
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2)
    first = oracle(q[0], pool, 1, slots[:40], delta=DELTA)
    assert torch.isinf(first.certificate).all()
    assert torch.isinf(result.certificate[0]).all() and (result.certificate[0] > 0).all()
    assert torch.isfinite(result.certificate[1]).all()
    assert not torch.isnan(result.certificate).any() and not torch.isnan(result.out).any()
    second = oracle(q[1], pool, 1, slots[40:], delta=DELTA)
    torch.testing.assert_close(result.certificate[1], second.certificate, rtol=1e-4, atol=0.0)


def test_default_splits_fill_whole_waves():
    # H200: 132 SMs; Gluon at its 168-register cap holds 3 programs per SM, the Triton kernel 2.
    assert wave_splits(32 * 4, 3 * 132) == 3 and wave_splits(8 * 4, 3 * 132) == 12
    assert wave_splits(32 * 4, 2 * 132) == 2 and wave_splits(64 * 4, 3 * 132) == 3
    assert wave_splits(4, 3 * 132) == attention._MAX_SPLITS  # one row: as many splits as allowed
    for slots in (2 * 132, 3 * 132, 4 * 108):
        for units in range(1, 700):
            splits = wave_splits(units, slots)
            waves = math.ceil(units * splits / slots)
            assert units * splits >= 0.9 * waves * slots or splits == attention._MAX_SPLITS
            if splits > 1 and splits > slots // units:  # fewer splits would have left a wave emptier
                fewer = units * (splits - 1)
                assert fewer < 0.9 * math.ceil(fewer / slots) * slots


def test_programs_per_sm_follow_the_register_caps():
    config = LaunchConfig()
    assert config.gluon_programs_per_sm(True) == config.gluon_programs_per_sm(False) == 3  # 168 registers
    assert LaunchConfig(gluon_maxnreg=128).gluon_programs_per_sm(True) == 4
    assert LaunchConfig(gluon_maxnreg_nocert=None).gluon_programs_per_sm(False) == 2
    assert config.programs_per_sm() == 2  # the Triton kernel, uncapped at 4 warps
    assert LaunchConfig(num_warps=8).programs_per_sm() == 1
    assert LaunchConfig(maxnreg=168).programs_per_sm() == 3


def _plant_keys(pool: KVPool, slots: torch.Tensor, query: torch.Tensor, planted: dict[int, float]) -> None:
    """Overwrite the keys of the row positions in ``planted`` (KV head 0 of layer 1) with that multiple of ``query``
    ``[D]``: their logits for a query head reading ``query`` lie far above the random keys' (the multiple times
    ``sm |query|^2``, about 11, against about N(0, 1))."""
    generator = torch.Generator().manual_seed(13)
    positions = list(planted)
    k = torch.randn(len(positions), pool.kv_heads, pool.head_dim, generator=generator)
    k[:, 0] = torch.stack([planted[position] * query.float() for position in positions])
    v = torch.randn(len(positions), pool.kv_heads, pool.head_dim, generator=generator)
    pool.write(1, slots[positions], k.to(pool.dtype), v.to(pool.dtype))


@pytest.mark.parametrize("splits", [1, 4])
def test_the_held_token_is_the_first_argmax_of_the_end_tiles(splits):
    """A row of 600 tokens: its end tokens are positions 0-127 and 512-599 (``reference.end_tokens``). Query head 0's
    largest logit (token 300) lies between them, its largest among the end tokens in the last tile (token 550):
    the certificate holds token 550 apart, and token 300 sits in its cell. One split: the running max moves on
    the middle tiles and the held token does not. Four: splits of 256 tokens, the middle one ([256, 512), where
    the largest logit is) holds no token and adds its rest sums alone, the last ([512, 600)) holds token 550,
    and the fourth is empty. Every accumulator against the reference, for every head."""
    pool, indptr, slots = filled_pool([600], kv_heads=1, v_dither=False)
    q = _query(1, 7, seed=5)
    _plant_keys(pool, slots, q[0, 0], {300: 0.6, 550: 0.45})
    expected = oracle(q[0], pool, 1, slots, delta=DELTA)
    assert int(expected.probs[0].argmax()) == 300
    assert expected.accumulators.p_max[0] == expected.probs[0, 550]
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=splits)
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_an_overflowing_radius_counts_where_its_weight_underflows():
    pool, indptr, slots, q = far_token_case()
    expected = oracle(q[0], pool, 1, slots, delta=DELTA)
    assert expected.probs[0, 17] == 0 and torch.isinf(expected.radius[0, 17].expm1())
    assert torch.isinf(expected.certificate).all()
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2)
    assert torch.isinf(result.certificate[0]).all() and (result.certificate[0] > 0).all()
    torch.testing.assert_close(result.out[0].float(), expected.out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_groups", [False, True], ids=["random-keys", "zero-groups"])
def test_an_overflowing_radius_gives_an_infinite_certificate(zero_groups):
    """A radius beyond float32 is a valid, infinite bound: +inf in the reference and the kernel, never NaN
    (``g(inf)`` is not ``inf - inf``, and a zero group scale times the overflowed ``|q_g|^2`` is not
    ``0 * inf``)."""
    pool, indptr, slots, q, sm_scale = overflowing_query_case(zero_groups=zero_groups)
    result = decode_attention(q, pool, 1, indptr, slots, sm_scale=sm_scale, delta_step=DELTA, num_kv_splits=2)
    for row in range(2):
        row_slots = slots[indptr[row] : indptr[row + 1]]
        expected = oracle(q[row], pool, 1, row_slots, delta=DELTA, sm_scale=sm_scale)
        assert torch.isinf(expected.radius).all() and (expected.probs == 0).float().mean() > 0.9
        assert torch.isposinf(expected.certificate).all()
        assert torch.isposinf(result.certificate[row]).all()
        # Logits of thousands: float32 rounding alone moves them by ~1e-3 (float32_logit_tolerance).
        tolerance = float32_logit_tolerance(expected, pool.dequantize(1, row_slots, "v"))
        assert relative_error(result.out[row], expected.out) < tolerance


@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_value_written_unvalidated_poisons_only_its_readers(value, side):
    """A NaN or inf in K or V cannot be quantized; written without validation (the GPU default) it must not
    come back as finite codes: the row that reads the token gets a non-finite output and, for K, no finite
    certificate; the other row is untouched. (A NaN key written as a finite scale and arbitrary codes would
    give a finite output and certificate.)"""
    assert non_finite_token_readers("cpu", value, side, delta=DELTA) == "triton-interpreter"


def test_decode_without_certificate_gives_the_same_output():
    pool, indptr, slots = filled_pool([70, 5], kv_heads=2)
    q = _query(2, 14)
    with_cert = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2)
    without = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2, certificate=False)
    assert without.certificate is None
    assert torch.equal(with_cert.out, without.out) and torch.equal(with_cert.lse, without.lse)


def test_reference_fallback_agrees_with_the_kernels(monkeypatch, caplog):
    pool, indptr, slots = filled_pool([33, 64], kv_heads=2)
    q = _query(2, 14)
    kernel = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fallback = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA)
    assert fallback.path == "reference"
    assert relative_error(kernel.out[0], fallback.out[0]) < 1e-5
    torch.testing.assert_close(kernel.certificate, fallback.certificate, rtol=1e-4, atol=0.0)


@pytest.mark.parametrize(
    ("dither_bits", "outliers", "v_dither", "kv_heads", "dtype"),
    [
        (8, False, False, 4, torch.float16),
        (8, True, True, 3, torch.bfloat16),
        (16, True, True, 2, torch.float32),
        (24, False, True, 3, torch.float16),
    ],
)
def test_gather_is_bit_identical_to_reference_dequantize(dither_bits, outliers, v_dither, kv_heads, dtype):
    """``KVPool.gather``: every stored (slot, head) of both sides, in any order and with repeats, equals the
    reference's float32 ``x_hat`` rounded once to ``dtype``; outlier channels come back exact."""
    generator = torch.Generator().manual_seed(dither_bits + kv_heads)
    head_dim, tokens = 64, 40
    pairs = ([3, 17], [0, 30], [9, 10])[: min(kv_heads, 3)]
    channels = torch.stack([reference.rope_pair_channels(p, head_dim) for p in pairs]) if outliers else None
    pool = KVPool(
        96, 2, kv_heads, head_dim, group_size=16, outlier_channels=channels, seed=2**40 + 7,
        dither_bits=dither_bits, v_dither=v_dither, device="cpu", dtype=torch.bfloat16 if outliers else torch.float16,
    )  # fmt: skip
    written = torch.randperm(96, generator=generator)[:tokens]
    k = (torch.randn(tokens, kv_heads, head_dim, generator=generator) * 3).to(pool.dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(pool.dtype)
    pool.write(1, written, k, v)
    slots = written[torch.randint(0, tokens, (57,), generator=generator)].to(torch.int32)
    k_hat, v_hat = pool.gather(1, slots, dtype)
    for kind, got in (("k", k_hat), ("v", v_hat)):
        expected = pool.dequantize(1, slots, kind).to(dtype)
        assert got.dtype == dtype and got.shape == (57, kv_heads, head_dim)
        assert torch.equal(got, expected), kind
        if outliers:
            position = torch.full((96,), -1, dtype=torch.int64)
            position[written] = torch.arange(tokens)
            exact = (k if kind == "k" else v)[position[slots.long()]].to(dtype)
            index = pool.outlier_channels[1].expand(57, -1, -1)
            assert torch.equal(got.gather(-1, index), exact.gather(-1, index)), kind


def test_gather_marks_an_out_of_range_slot_with_nan_and_validation_refuses_it():
    pool, _, slots = filled_pool([12], kv_heads=2, v_dither=False)
    bad = slots.clone()
    bad[5] = pool.num_slots
    with pytest.raises(ValueError, match="slots must lie in"):
        pool.gather(1, bad)
    k_hat, v_hat = pool.gather(1, bad, validate=False)
    for kind, got in (("k", k_hat), ("v", v_hat)):
        assert torch.isnan(got[5]).all()
        keep = torch.arange(12) != 5
        assert torch.equal(got[keep], pool.dequantize(1, slots[keep], kind).half())


# --- extend --------------------------------------------------------------------------------------------


def test_extend_over_a_quantized_prefix_is_causal_and_matches_reference(per_row_extend):
    prefix, new = [20, 0], [3, 4]
    lengths = [p + n for p, n in zip(prefix, new, strict=True)]
    pool, kv_indptr, slots = filled_pool(lengths, kv_heads=2)
    qo_indptr = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = _query(7, 14)
    result = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, num_kv_splits=2)
    for row in range(7):
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, prefix, row, delta=DELTA)
        assert relative_error(result.out[row], expected.out) < 1e-5
        torch.testing.assert_close(result.certificate[row], expected.certificate, rtol=1e-4, atol=0.0)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "splits", "certificate"),
    [(14, 2, 3, False), (2, 2, None, False), (14, 2, 2, True)],
)
def test_tiled_extend_matches_reference(tiled_extend, q_heads, kv_heads, splits, certificate):
    """The tiled kernel (one K/V read per block of new tokens): a sequence of several blocks, one without a
    prefix, one with a single new token, GQA 7:1 and MHA, with and without the certificate; every row against
    the reference (its certificate from the row's own length)."""
    prefix, new = [20, 0, 70], [3, 20, 1]
    pool, kv_indptr, slots = filled_pool([p + n for p, n in zip(prefix, new, strict=True)], kv_heads=kv_heads,
                                         v_dither=False)  # fmt: skip
    qo_indptr = torch.tensor([0, 3, 23, 24], dtype=torch.int32)
    q = _query(24, q_heads, seed=3)
    result = extend_attention(
        q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=certificate, num_kv_splits=splits
    )
    assert result.path == "triton-interpreter" and (result.certificate is not None) == certificate
    for row in range(24):
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, prefix, row, delta=DELTA)
        assert relative_error(result.out[row], expected.out) < 1e-5, row
        torch.testing.assert_close(result.lse[row], expected.lse, rtol=1e-6, atol=1e-5)
        if certificate:
            torch.testing.assert_close(result.certificate[row], expected.certificate, rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("splits", [1, 4])
def test_tiled_extend_rows_hold_apart_their_own_end_tiles_argmax(tiled_extend, splits):
    """12 new tokens over a prefix of 250: rows 0-5 see 251-256 keys, whose end tokens are all of them, rows 6-11
    see 257-262, whose end tokens are positions 0-127 and from 256 on (``reference.end_tokens``): one program's rows
    with different end tiles. Query head 0's largest logit (key 200) is an end token of the first rows, held apart,
    and lies between the end tiles of the last; for rows 7-11 the held token is key 257, in their last tile. Four
    splits of 128 keys: the second ([128, 256)) holds no token of rows 6-11 and adds their rest sums alone. Every
    row's accumulators against the reference over the keys it sees."""
    prefix, new = 250, 12
    pool, kv_indptr, slots = filled_pool([prefix + new], kv_heads=1, v_dither=False)
    q = _query(new, 7, seed=6)
    q[:, 0] = q[0, 0]
    _plant_keys(pool, slots, q[0, 0], {200: 0.6, 257: 0.45})
    qo_indptr = torch.tensor([0, new], dtype=torch.int32)
    result = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, num_kv_splits=splits)
    assert result.path == "triton-interpreter"
    for row in range(new):
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, [prefix], row, delta=DELTA)
        assert int(expected.probs[0].argmax()) == 200
        held = 200 if row < 6 else 257 if row >= 7 else None
        if held is not None:
            assert expected.accumulators.p_max[0] == expected.probs[0, held], row
        assert relative_error(result.out[row], expected.out) < 1e-5, row
        torch.testing.assert_close(result.lse[row], expected.lse, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(result.certificate[row], expected.certificate, rtol=1e-4, atol=0.0)
        for name in ("p_max", "u_max", "a1_rest", "b_rest", "u_rest", "p_rest"):
            torch.testing.assert_close(
                getattr(result.accumulators, name)[row], getattr(expected.accumulators, name), rtol=1e-4, atol=1e-12
            )


def test_tiled_extend_gives_an_infinite_certificate_where_the_radius_overflows(tiled_extend):
    """The overflowing-query case with zero key groups, as extend (``overflowing_extend_certificates``): every
    certificate is +inf, as in the reference, never NaN."""
    assert overflowing_extend_certificates("cpu", delta=DELTA) == "triton-interpreter"


def test_extend_takes_host_offsets_and_checks_them(tiled_extend):
    """``bounds`` (the offsets on the host, which an engine has once per batch: an ``ExtendBounds`` or two
    lists) give the same result, and are checked like the tensors."""
    pool, kv_indptr, slots = filled_pool([20, 7], kv_heads=2, v_dither=False)
    qo_indptr = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = _query(7, 14)
    plain = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=False)
    bounds = (qo_indptr.tolist(), kv_indptr.tolist())
    hosted = extend_attention(
        q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=False, bounds=bounds
    )
    assert torch.equal(plain.out, hosted.out)
    planned = extend_attention(
        q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=False, bounds=ExtendBounds(*bounds)
    )
    assert torch.equal(plain.out, planned.out)
    with pytest.raises(ValueError, match="B \\+ 1 entries"):
        extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, bounds=([0, 7], bounds[1]))
    with pytest.raises(ValueError, match="B \\+ 1 entries each"):
        extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, bounds=([0, 7], [0, 27]))
    with pytest.raises(ValueError, match="at least as many KV slots"):
        extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, bounds=([0, 3, 7], [0, 2, 27]))
    # An empty batch: nothing to read back or to check against the pool.
    empty = torch.tensor([0, 0], dtype=torch.int32)
    nothing = extend_attention(q[:0], pool, 1, empty, empty, slots[:0], delta_step=DELTA, bounds=([0, 0], [0, 0]))
    assert nothing.out.shape == (0, 14, 128)


def test_tiled_extend_poisons_a_malformed_sequence_instead_of_reading_it(tiled_extend):
    """More new tokens than slots (validation off): that sequence's rows are NaN, the others are right."""
    pool, kv_indptr, slots = filled_pool([5, 8], kv_heads=2, v_dither=False)
    qo_indptr = torch.tensor([0, 7, 9], dtype=torch.int32)  # sequence 0: 7 new tokens over 5 slots
    q = _query(9, 14)
    result = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, validate=False)
    assert torch.isnan(result.out[:7]).all() and torch.isnan(result.certificate[:7]).all()
    expected = oracle(q[8], pool, 1, slots[5:13], delta=DELTA)
    assert relative_error(result.out[8], expected.out) < 1e-5


def test_decode_writes_the_certificate_into_certificate_out():
    """A preallocated certificate (a report buffer's rows) is written in place, with the values a new one gets."""
    pool, indptr, slots = filled_pool([300, 40], kv_heads=2)
    q = _query(2, 14)
    plain = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA)
    buffer = torch.full((3, 2, 14), math.nan)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, certificate_out=buffer[1])
    assert result.certificate.data_ptr() == buffer[1].data_ptr()
    assert torch.equal(buffer[1], plain.certificate) and buffer[[0, 2]].isnan().all()
    assert torch.equal(result.accumulator_block, plain.accumulator_block)


# --- bad input -----------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    pool, indptr, slots = filled_pool([10, 5], kv_heads=2)
    q = _query(2, 14)
    with pytest.raises(TypeError, match="dtype"):
        decode_attention(q.float(), pool, 1, indptr, slots, delta_step=DELTA)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(q[:, :, :64], pool, 1, indptr, slots, delta_step=DELTA)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(q[:, :3], pool, 1, indptr, slots, delta_step=DELTA)
    with pytest.raises(ValueError, match="B \\+ 1"):
        decode_attention(q, pool, 1, indptr[:2], slots, delta_step=DELTA)
    with pytest.raises(ValueError, match="non-decreasing"):
        decode_attention(q, pool, 1, torch.tensor([0, 12, 10]), slots, delta_step=DELTA)
    with pytest.raises(ValueError, match="exceeds"):
        decode_attention(q, pool, 1, torch.tensor([0, 10, 99]), slots, delta_step=DELTA)
    with pytest.raises(ValueError, match="slots in"):
        decode_attention(q, pool, 1, indptr, torch.full_like(slots, pool.num_slots), delta_step=DELTA)
    with pytest.raises(ValueError, match="layer"):
        decode_attention(q, pool, 2, indptr, slots, delta_step=DELTA)
    with pytest.raises(ValueError, match="delta_step"):
        decode_attention(q, pool, 1, indptr, slots, delta_step=0.0)
    with pytest.raises(TypeError, match="int32/int64"):
        decode_attention(q, pool, 1, indptr.float(), slots, delta_step=DELTA)
    for certificate_out, certificate in ((torch.empty(2, 7), True), (torch.empty(2, 14), False)):
        with pytest.raises(ValueError, match="certificate_out"):
            decode_attention(
                q, pool, 1, indptr, slots, delta_step=DELTA, certificate=certificate, certificate_out=certificate_out
            )
    k = torch.zeros(2, 2, 128, dtype=torch.float16)
    with pytest.raises(TypeError, match="pool's dtype"):
        pool.write(1, torch.tensor([0, 1]), k.float(), k.float())
    with pytest.raises(ValueError, match="slots must lie"):
        pool.write(1, torch.tensor([0, pool.num_slots]), k, k)
    with pytest.raises(ValueError, match="NaN or inf"):
        pool.write(1, torch.tensor([0, 1]), k.clone().fill_(math.nan), k)
    with pytest.raises(ValueError, match="must be \\[N"):
        pool.write(1, torch.tensor([0, 1]), k[:, :1], k[:, :1])


def test_nearest_v_near_the_fp16_range_decodes_exactly_and_beyond_it_is_refused():
    # V rounded to nearest is decoded through fp16 products scale * code (docs/KERNELS.md).
    generator = torch.Generator().manual_seed(9)
    pool = KVPool(64, 1, 2, 128, dtype=torch.bfloat16, device="cpu")
    assert not pool.v_dither
    slots = torch.randperm(64, generator=generator)[:40]
    k = torch.randn(40, 2, 128, generator=generator).bfloat16()
    v = (torch.randn(40, 2, 128, generator=generator) * 20000.0).clamp(-64000.0, 64000.0).bfloat16()
    pool.write(0, slots, k, v)
    q = torch.randn(1, 4, 128, generator=generator).bfloat16()
    result = decode_attention(q, pool, 0, torch.tensor([0, 40]), slots, delta_step=DELTA, num_kv_splits=2)
    expected = oracle(q[0], pool, 0, slots, delta=DELTA)
    assert torch.isfinite(result.out).all()
    assert relative_error(result.out[0], expected.out) < 1e-5
    with pytest.raises(ValueError, match="v_dither=True"):
        pool.write(0, slots, k, v * 2.0)
    dithered = KVPool(64, 1, 2, 128, dtype=torch.bfloat16, v_dither=True, device="cpu")
    dithered.write(0, slots, k, v * 2.0)  # the dithered-V path has bf16 operands: no such limit


def test_unvalidated_write_skips_out_of_range_slots():
    pool = KVPool(32, 1, 2, 128, device="cpu")
    k = torch.randn(3, 2, 128, generator=torch.Generator().manual_seed(4)).half()
    pool.write(0, torch.tensor([5, 32, -1]), k, k, validate=False)
    expected = reference.quantize(k[:1], seed=pool.seed, layer=0, slots=torch.tensor([5]), kind="k", dither_bits=8)
    assert torch.equal(pool.codes[0, 0, 5:6], encode_codes(expected.codes))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[5] = False
    assert not pool.codes[0, :, untouched].any() and not pool.scales[0, :, untouched].any()


def test_malformed_rows_without_validation_are_poisoned_not_read():
    pool, indptr, slots = filled_pool([10, 5], kv_heads=2)
    q = _query(2, 14)
    bad_slots = slots.clone()
    bad_slots[12] = 10**6  # row 1 reads an out-of-range slot
    result = decode_attention(q, pool, 1, indptr, bad_slots, delta_step=DELTA, validate=False, num_kv_splits=2)
    assert torch.isnan(result.certificate[1]).all() and torch.isnan(result.out[1]).all()
    assert_matches_oracle(result, q[:1], pool, 1, indptr[:2], slots[:10], delta=DELTA)


def test_paged_slots_fill_whole_pages():
    slots = paged_slots(40, 128, 16, torch.Generator().manual_seed(0))
    assert slots.unique().numel() == 40
    assert bool(((slots[1:16] - slots[:15]) == 1).all())


def test_selftest_checks_write_gather_and_decode_against_the_reference(capsys):
    """``witcert selftest``'s check, on the path this machine runs (the interpreter here)."""
    from witcert.kernels.cli import run_selftest

    assert run_selftest(3) == 0
    printed = capsys.readouterr().out
    assert "path: triton-interpreter" in printed
    for line in ("write: 0 code mismatches", "dither: 0 mismatches", "gather: 0 mismatches", "selftest passed"):
        assert line in printed, line
