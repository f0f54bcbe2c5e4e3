"""Contract tests for the reference mathematics (docs/THEORY.md): every claim marked (test) there."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from witcert.kernels import reference as ref
from witcert.kernels.soundness import random_bound_cases, run_soundness

# --- Philox ------------------------------------------------------------------------------------------

# Random123's published known-answer vectors for philox4x32-10 (kat_vectors).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    out = ref.philox4x32_10(torch.tensor(counter, dtype=torch.int64), torch.tensor(key, dtype=torch.int64))
    assert tuple(int(w) for w in out) == expected


def _numpy_philox(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """An independent implementation: full 64-bit unsigned products in numpy, no 16-bit splitting."""
    c = [counter[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = key[:, 0].astype(np.uint64), key[:, 1].astype(np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(0x9E3779B9)) & mask
            k1 = (k1 + np.uint64(0xBB67AE85)) & mask
        p0 = np.uint64(0xD2511F53) * c[0]
        p1 = np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & mask]
    return np.stack(c, axis=-1).astype(np.int64)


def test_philox_matches_independent_implementation_on_a_million_counters():
    rng = np.random.default_rng(1234)
    counter = rng.integers(0, 2**32, size=(1_000_000, 4), dtype=np.int64)
    key = rng.integers(0, 2**32, size=(1_000_000, 2), dtype=np.int64)
    ours = ref.philox4x32_10(torch.from_numpy(counter), torch.from_numpy(key)).numpy()
    np.testing.assert_array_equal(ours, _numpy_philox(counter, key))


def test_philox_rejects_values_outside_uint32():
    with pytest.raises(ValueError, match="uint32"):
        ref.philox4x32_10(torch.tensor([0, 0, 0, 2**32]), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="int64"):
        ref.philox4x32_10(torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))


# --- the dither stream -------------------------------------------------------------------------------


@pytest.mark.parametrize("dither_bits", ref.DITHER_BITS)
def test_distinct_tuples_never_share_a_dither_address(dither_bits):
    """(layer, kv_head, channel, kind) -> the per-channel part's (counter, word, field) and (layer, kv_head, slot,
    kind) -> the per-slot part's counter are injective, and no per-slot counter is a per-channel one."""
    slots = torch.tensor([0, 1, 7, 2**31, 2**32 - 1])
    channels = torch.arange(128)
    kv_heads = torch.tensor([0, 1, 5, 2**31 - 1])
    block, word, shift = ref.channel_address(channels, dither_bits)
    channel_addresses, slot_counters = set(), set()
    for kind in ("k", "v"):
        for layer in (0, 1, 27):
            counter = ref.dither_counter(block[None, :], ref.CHANNEL_PART, layer, kv_heads[:, None], kind)
            rows = torch.cat(
                (counter, word.expand(counter.shape[:-1])[..., None], shift.expand(counter.shape[:-1])[..., None]), -1
            )
            channel_addresses.update(map(tuple, rows.reshape(-1, 6).tolist()))
            counter = ref.dither_counter(slots[:, None], ref.SLOT_PART, layer, kv_heads[None, :], kind)
            slot_counters.update(map(tuple, counter.reshape(-1, 4).tolist()))
    assert len(channel_addresses) == 2 * 3 * len(kv_heads) * len(channels)
    assert len(slot_counters) == 2 * 3 * len(kv_heads) * len(slots)
    assert not {address[:4] for address in channel_addresses} & slot_counters


def _dither(dither_bits: int, **change) -> torch.Tensor:
    args = dict(seed=9, layer=3, slots=torch.arange(256), num_kv_heads=2, head_dim=128, kind="k")
    args["dither_bits"] = dither_bits
    return ref.dither_values(**{**args, **change, "dtype": torch.float64})


@pytest.mark.parametrize("dither_bits", ref.DITHER_BITS)
def test_k_and_v_streams_differ(dither_bits):
    k, v = _dither(dither_bits), _dither(dither_bits, kind="v")
    # Independent streams agree on a value with probability about 2**-b.
    assert (k == v).float().mean() < 2.0**-dither_bits * 4 + 1e-3


def _uniform_on_eight_bins(values: torch.Tensor) -> None:
    counts = torch.histc(values, bins=8, min=0.0, max=1.0)
    assert float((counts / counts.mean() - 1).abs().max()) < 0.12  # 512+ samples a bin: 5 standard errors


@pytest.mark.parametrize("dither_bits", ref.DITHER_BITS)
def test_v_dither_is_uniform_mod_one_along_every_channel_and_every_slot(dither_bits):
    """V's ``xi = alpha_c + beta_t`` lies in (-1, 1) and ``xi mod 1`` on ``2**b`` equally spaced points. Along the
    channels of one slot and along the slots of one channel it is uniform (THEORY.md section 1: the V errors of
    a channel are independent across tokens, what the output bound of section 5 sums over)."""
    xi = _dither(dither_bits, slots=torch.arange(4096), num_kv_heads=64, kind="v")  # [4096 slots, 64 heads, 128]
    assert float(xi.min()) > -1 and float(xi.max()) < 1
    assert float(xi.abs().max()) <= 1 - 2.0 ** -(dither_bits + 1) - 2.0 ** -(ref.slot_dither_bits(dither_bits) + 1)
    fraction = torch.remainder(xi, 1.0)
    if dither_bits <= 16:  # alpha and beta both half a step off the 2**-b grid: their sum is on it
        index = fraction * 2**dither_bits
        assert torch.equal(index, index.round())
    # Along the slots one channel moves on the per-slot grid of 2**-min(b, 16) only (hence beta_V in
    # output_error_bound); up to float32's rounding of alpha + beta at 24 bits.
    along_slots = torch.remainder(xi[:, 3, 17] - xi[0, 3, 17], 1.0) * 2 ** ref.slot_dither_bits(dither_bits)
    assert float((along_slots - along_slots.round()).abs().max()) < 2.0**-7
    for values in (fraction[5].reshape(-1), fraction[:, 3, 17]):  # one slot's 8192 channels; one channel's slots
        _uniform_on_eight_bins(values)
    assert abs(float(fraction.mean()) - 0.5) < 2e-3
    assert abs(float(fraction.var()) - 1.0 / 12.0) < 1e-3


@pytest.mark.parametrize("dither_bits", ref.DITHER_BITS)
def test_k_dither_is_the_channel_part_alone(dither_bits):
    """K's ``xi = alpha_c``: the same for every slot, half a step off the ``2**-b`` grid, inside ``(-1/2, 1/2)``
    and uniform along the channels of one slot (THEORY.md section 1: a logit's error sums over the channels of
    one token, which need nothing else). K has no per-slot part to ask for."""
    xi = _dither(dither_bits, slots=torch.arange(64), num_kv_heads=64)  # [64 slots, 64 heads, 128 channels]
    assert torch.equal(xi, xi[:1].expand_as(xi))
    assert float(xi.abs().max()) <= 0.5 - 2.0 ** -(dither_bits + 1)
    index = (xi + 0.5) * 2**dither_bits - 0.5
    assert torch.equal(index, index.round())
    _uniform_on_eight_bins((xi[0] + 0.5).reshape(-1))
    with pytest.raises(ValueError, match="no per-slot part"):
        ref.slot_dither_fields(seed=9, layer=3, slots=torch.arange(4), num_kv_heads=2, kind="k", dither_bits=8)


def test_dither_parts_follow_their_formulas():
    assert float(ref.channel_dither_values(torch.tensor([0]), 8)) == 0.5 / 256 - 0.5
    assert float(ref.slot_dither_values(torch.tensor([255]), 8)) == 255.5 / 256 - 0.5
    assert float(ref.slot_dither_values(torch.tensor([2**16 - 1]), 24)) == (2**16 - 0.5) / 2**16 - 0.5
    alpha = ref.channel_dither_values(
        ref.channel_dither_fields(seed=1, layer=2, num_kv_heads=3, head_dim=64, kind="v", dither_bits=16), 16
    )
    beta = ref.slot_dither_values(
        ref.slot_dither_fields(seed=1, layer=2, slots=torch.tensor([4, 9]), num_kv_heads=3, kind="v", dither_bits=16),
        16,
    )
    xi = ref.dither_values(
        seed=1, layer=2, slots=torch.tensor([4, 9]), num_kv_heads=3, head_dim=64, kind="v", dither_bits=16,
        dtype=torch.float64,
    )  # fmt: skip
    assert torch.equal(xi, alpha[None] + beta[:, :, None])


def test_dither_depends_on_every_key_component():
    base = _dither(16, kind="v")
    for change in (dict(seed=6), dict(layer=2), dict(slots=torch.arange(1, 257)), dict(kind="k")):
        assert not torch.equal(_dither(16, **{"kind": "v", **change}), base), change
    # Every slot of V has its own offset, every channel its own part; K's changes with the seed and layer only.
    assert (base[1:] - base[:-1]).abs().amax(-1).min() > 0
    assert (base[:, :, 1:] - base[:, :, :-1]).abs().amax(0).min() > 0
    for change in (dict(seed=6), dict(layer=2)):
        assert not torch.equal(_dither(16, **change), _dither(16)), change
    assert torch.equal(_dither(16, slots=torch.arange(1, 257)), _dither(16))


# --- quantizer ---------------------------------------------------------------------------------------


def _adversarial_keys(generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(512, 4, 128, generator=generator)
    x[0] = 0.0  # all-zero groups
    x[1] = 65504.0 * torch.sign(torch.randn(4, 128, generator=generator))  # fp16 extremes
    x[2] = 1e-7 * torch.randn(4, 128, generator=generator)  # subnormal scales
    x[3, :, ::32] = 1000.0  # one element sets the group amax
    x[4] = torch.linspace(-1, 1, 128)  # regular grid, many ties against the dither grid
    x[5:64] *= torch.logspace(-4, 4, 59)[:, None, None]
    return x.to(torch.float16)


@pytest.mark.parametrize("dither_bits", ref.DITHER_BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantizer_never_clips_and_error_is_within_half_a_step(dither_bits, dtype):
    x = _adversarial_keys(torch.Generator().manual_seed(dither_bits)).to(dtype)
    slots = torch.randperm(4096)[:512]
    qkv = ref.quantize(x, seed=11, layer=4, slots=slots, kind="k", dither_bits=dither_bits)
    scale = qkv.channel_scales(torch.float64)
    codes = qkv.codes.to(torch.int64)
    assert int(codes.abs().max()) <= ref.QMAX
    # Nothing clipped: |x / s| <= 126.5 for every element, with the stored scale.
    assert bool(((x.double().abs() <= scale * ref.SCALE_DIVISOR) | (scale == 0)).all())
    error = (qkv.dequantize(torch.float64) - x.double()).abs()
    slack = 2.0**-16
    assert bool((error <= scale * (0.5 + slack)).all())
    assert bool((error[scale == 0] == 0).all())


def test_scales_are_the_smallest_stored_fp16_values_that_cover_the_amax():
    x = _adversarial_keys(torch.Generator().manual_seed(0))
    qkv = ref.quantize(x, seed=0, layer=0, slots=torch.arange(512), kind="k")
    assert qkv.scales.dtype == torch.float16
    amax = x.float().abs().view(512, 4, 4, 32).amax(-1).double()
    stored = qkv.scales.double()
    assert bool((stored * 126.5 >= amax).all())
    previous = torch.nextafter(qkv.scales, torch.zeros_like(qkv.scales)).double()
    assert bool(((previous * 126.5 < amax) | (stored == 0)).all())


def _significant_bits(x: torch.Tensor) -> torch.Tensor:
    """Significant bits of finite fp16 values, each an integer multiple of 2**-24 (0 for zero)."""
    k = (x.double().abs() * 2.0**24).to(torch.int64)
    k = k // (k & -k).clamp(min=1)  # trailing zeros off
    return torch.where(k > 0, torch.floor(torch.log2(k.double().clamp(min=1))).to(torch.int64) + 1, 0)


def test_v_scales_are_the_smallest_with_4_significant_bits_that_cover_the_amax():
    """V's scales keep 4 significant bits, subnormal ones too, so that ``s * code`` is exact in fp16
    (docs/THEORY.md section 1); each is the smallest such value with ``s * 126.5 >= amax``, at most 12.5% above K's
    11-bit scale."""
    x = _adversarial_keys(torch.Generator().manual_seed(0))
    x[6] = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)) * 1e-5  # subnormal scales of 5+ bits
    qkv = ref.quantize(x, seed=0, layer=0, slots=torch.arange(512), kind="v", dither=False)
    k_scales = ref.quantize(x, seed=0, layer=0, slots=torch.arange(512), kind="k").scales
    finer = k_scales.double()
    stored = qkv.scales.double()
    assert bool((_significant_bits(qkv.scales) <= 4).all())
    assert bool((_significant_bits(k_scales) > 4).any())
    amax = x.float().abs().view(512, 4, 4, 32).amax(-1).double()
    assert bool((stored * 126.5 >= amax).all())
    # Every fp16 value of at most 4 significant bits, sorted: each stored scale's predecessor there is too small.
    every = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)
    coarse = every[_significant_bits(every) <= 4].double()
    below = coarse[(torch.searchsorted(coarse, stored.reshape(-1)) - 1).clamp(min=0)].reshape(stored.shape)
    assert bool(((below * 126.5 < amax) | (stored == 0)).all())
    assert bool(((stored <= finer * 1.125) | (finer == 0)).all())
    assert bool(((qkv.scales > 0) & (qkv.scales < 2.0**-14) & (_significant_bits(k_scales) > 4)).any()), (
        "some subnormal scales are rounded to 4 bits"
    )
    # Exact wherever it is within fp16's range (|v| up to 65000, pool.NEAREST_V_MAX; token 1 holds +-65504).
    exact = qkv.codes.double() * stored.repeat_interleave(32, dim=-1)
    in_range = exact.abs() <= 65504
    assert bool(in_range[2:].all())
    assert torch.equal(exact[in_range].to(torch.float16).double(), exact[in_range]), "s * code is exact in fp16"


def test_codes_are_computed_with_the_stored_fp16_scale():
    x = torch.randn(256, 2, 64, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    qkv = ref.quantize(x, seed=1, layer=0, slots=torch.arange(256), kind="v", dither_bits=16)
    expected = torch.round(x.float() / qkv.channel_scales(torch.float32) + qkv.dither(torch.float32))
    assert torch.equal(qkv.codes.to(torch.float32), expected)


def test_outlier_channels_are_exact_and_excluded_from_the_group_amax():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(128, 2, 128, generator=generator)
    outliers = ref.rope_pair_channels([3, 17], head_dim=128)  # channels 3, 17, 67, 81
    x[:, :, outliers] *= 1000.0
    x = x.to(torch.float16)
    with_outliers = ref.quantize(x, seed=2, layer=1, slots=torch.arange(128), kind="k", outlier_channels=outliers)
    without = ref.quantize(x, seed=2, layer=1, slots=torch.arange(128), kind="k")
    x_hat = with_outliers.dequantize(torch.float32)
    assert torch.equal(x_hat[:, :, outliers], x[:, :, outliers].float())
    masked = x.float().clone()
    masked[:, :, outliers] = 0
    expected_scales = ref.fp16_scale_rounded_up(masked.abs().view(128, 2, 4, 32).amax(-1))
    assert torch.equal(with_outliers.scales, expected_scales)
    # Groups 0 and 2 hold the outliers: the bypass is what buys their precision.
    assert bool((with_outliers.scales <= without.scales).all())
    assert (
        float(with_outliers.scales[:, :, [0, 2]].float().mean())
        < float(without.scales[:, :, [0, 2]].float().mean()) / 50
    )
    assert bool((with_outliers.channel_scales()[:, :, outliers] == 0).all())


@pytest.mark.parametrize(("head_dim", "group_size", "pairs"), [(128, 32, 0), (128, 32, 2), (64, 16, 1), (128, 64, 4)])
def test_byte_accounting_is_exact(head_dim, group_size, pairs):
    x = torch.randn(8, 2, head_dim).to(torch.float16)
    outliers = ref.rope_pair_channels(list(range(pairs)), head_dim) if pairs else None
    qkv = ref.quantize(
        x, seed=0, layer=0, slots=torch.arange(8), kind="k", group_size=group_size, outlier_channels=outliers
    )
    assert qkv.bytes_per_token_head == head_dim + 2 * head_dim // group_size + 2 * 2 * pairs
    stored = qkv.codes[0, 0].nbytes + qkv.scales[0, 0].nbytes + qkv.outlier_values[0, 0].nbytes
    assert stored == qkv.bytes_per_token_head


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(x=torch.randn(4, 64)), r"\[N, H_kv, D\]"),
        (dict(x=torch.ones(4, 1, 64, dtype=torch.int32)), "floating-point"),
        (dict(x=torch.full((4, 1, 64), math.nan)), "NaN or inf"),
        (dict(group_size=24), "must divide"),
        (dict(slots=torch.arange(3)), "slots"),
        (dict(kind="q"), "kind"),
        (dict(dither_bits=12), "dither_bits"),
        (dict(outlier_channels=torch.tensor([1])), "RoPE pairs"),
        (dict(outlier_channels=torch.tensor([1, 64])), r"\[0, 64\)"),
        (dict(x=torch.full((4, 1, 64), 1e7)), "group scale of K"),
        # Within K's reach (8.29e6), beyond V's: V's scales have 4 significant bits, the largest 61440.
        (dict(x=torch.full((4, 1, 64), 7.8e6), kind="v"), "group scale of V"),
        (dict(seed=-1), "seed"),
    ],
)
def test_quantize_rejects_bad_input_with_a_clear_message(kwargs, message):
    args = dict(x=torch.randn(4, 1, 64), seed=0, layer=0, slots=torch.arange(4), kind="k") | kwargs
    x = args.pop("x")
    with pytest.raises((ValueError, TypeError), match=message):
        ref.quantize(x, **args)


# --- the bound family ---------------------------------------------------------------------------------


def test_every_bound_is_at_least_the_exact_worst_case():
    probs, radius = random_bound_cases(6000, torch.Generator().manual_seed(7))
    worst = ref.worst_case_tv(probs, radius)
    terms = ref.accumulate_certificate(probs, radius).terms
    for name in ("t1", "t4", "p", "pa"):
        bound = getattr(terms, name)
        # worst_case_tv subtracts probabilities near 1: allow its float64 cancellation, nothing more.
        assert bool((bound >= worst - 1e-14).all()), name
    resolvable = worst > 1e-9  # below, float64 cancellation in worst_case_tv dominates the ratio
    ratio = terms.certificate[resolvable] / worst[resolvable]
    assert float(ratio.min()) >= 1.0
    assert float(ratio.median()) < 2.0  # tightness, THEORY.md reports a median of 1.13x


def test_each_refinement_beats_t1_somewhere():
    probs, radius = random_bound_cases(6000, torch.Generator().manual_seed(8))
    terms = ref.accumulate_certificate(probs, radius).terms
    for name in ("t4", "p", "pa"):
        assert bool((getattr(terms, name) < terms.t1).any()), name


def test_float32_certificate_near_a_sink_token_still_bounds_the_exact_evaluation():
    # One token holds all but ~1e-6 of the attention: 1 - p_max in float32 would be off by several percent,
    # far beyond the evaluation slack; the rest mass is summed instead, so float32 plus the slack bounds the
    # float64 evaluation of the same accumulators.
    generator = torch.Generator().manual_seed(3)
    logits = 0.5 * torch.randn(64, 200, generator=generator, dtype=torch.float64)
    logits[:, 0] += 18.0 + 2.0 * torch.rand(64, generator=generator, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    radius = 0.02 + 0.05 * torch.rand(64, 200, generator=generator, dtype=torch.float64)
    exact = ref.accumulate_certificate(probs, radius).terms
    single = ref.accumulate_certificate(probs.float(), radius.float()).terms
    assert float((1.0 - probs[:, 0]).max()) < 1e-5  # the sink regime
    assert bool((single.certificate.double() >= torch.minimum(exact.t4, exact.pa)).all())
    assert bool((single.certificate.double() >= exact.certificate / ref.CERTIFICATE_EVAL_SLACK).all())


def test_overflowing_radius_gives_inf_never_nan():
    probs = torch.tensor([[0.9, 0.1, 0.0]], dtype=torch.float32)
    radius = torch.tensor([[200.0, 1.0, 500.0]], dtype=torch.float32)
    terms = ref.accumulate_certificate(probs, radius).terms
    assert math.isinf(float(terms.certificate[0]))
    for name in ("t1", "t4", "p", "pa"):
        assert not bool(torch.isnan(getattr(terms, name)).any()), name


def test_zero_radius_gives_a_zero_certificate():
    probs = torch.softmax(torch.randn(3, 10, dtype=torch.float64), -1)
    terms = ref.accumulate_certificate(probs, torch.zeros(3, 10, dtype=torch.float64)).terms
    assert torch.equal(terms.certificate, torch.zeros(3, dtype=torch.float64))


def test_expm1_minus_x_is_accurate_across_the_series_switch():
    x = torch.cat((torch.logspace(-8, 1, 500, dtype=torch.float64), -torch.logspace(-8, 0, 200, dtype=torch.float64)))
    exact = torch.tensor([math.fsum([math.expm1(v), -v]) for v in x.tolist()], dtype=torch.float64)
    high = torch.tensor([sum(v**n / math.factorial(n) for n in range(2, 40)) for v in x.tolist()], dtype=torch.float64)
    assert torch.allclose(ref.expm1_minus_x(x), high, rtol=1e-10, atol=0)
    assert torch.allclose(exact[x.abs() > 0.1], high[x.abs() > 0.1], rtol=1e-10)


def test_h_is_g_over_x_squared_increasing_and_inf_where_g_overflows():
    x = torch.cat((torch.zeros(1), torch.logspace(-8, 2.5, 800), torch.tensor([1e20, math.inf]))).double()
    h = ref.h_of(x)
    series = x < 2.0
    high = [sum(v ** (n - 2) / math.factorial(n) for n in range(2, 60)) for v in x[series].tolist()]
    assert torch.allclose(h[series], torch.tensor(high, dtype=torch.float64), rtol=1e-12, atol=0)
    direct = [(math.expm1(v) - v) / v**2 for v in x[~series & (x < 300)].tolist()]
    assert torch.allclose(h[~series & (x < 300)], torch.tensor(direct, dtype=torch.float64), rtol=1e-14, atol=0)
    assert bool((h[:-2].diff() >= 0).all())
    assert h[0] == 0.5 and math.isinf(float(h[-1])) and math.isinf(float(h[-2]))
    assert math.isinf(float(ref.h_of(torch.tensor([100.0]))[0]))  # float32: g overflows above 88


def _per_token_accumulators(probs, radius, held, exact):
    """Section 3's sums token by token with ``held`` held apart (``-1``: none), exact tokens adding weight alone."""
    index = torch.arange(probs.shape[-1])
    rest = (index != held[..., None]) & ~exact
    zero = torch.zeros((), dtype=probs.dtype)
    u = torch.where(rest, probs * radius, zero).sum(-1)
    b = torch.where(rest, probs * ref.expm1_minus_x(radius), zero).sum(-1)
    p_rest = torch.where(index != held[..., None], probs, zero).sum(-1)
    has = held >= 0
    p_max = torch.where(has, probs.gather(-1, held.clamp_min(0)[..., None]).squeeze(-1), zero)
    u_max = torch.where(has, radius.gather(-1, held.clamp_min(0)[..., None]).squeeze(-1), zero)
    return ref.CertificateAccumulators(u + b, b, u, p_rest, p_max, u_max)


@pytest.mark.parametrize("num_tokens", [1, 8, 31, 33, 128, 129, 300, 1000])
def test_the_cells_bound_the_per_token_sums_with_the_end_tiles_argmax_held_apart(num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    heads = 64
    logits = 3.0 * torch.randn(heads, num_tokens, generator=generator, dtype=torch.float64)
    logits[:8, num_tokens // 2] += 30.0  # the largest weight between the end tiles for some heads
    probs = torch.softmax(logits, -1)
    radius = 0.05 * torch.rand(heads, num_tokens, generator=generator, dtype=torch.float64) ** 2
    radius[8:16] *= 100.0  # radii past the series switch of g and h
    exact = torch.rand(heads, num_tokens, generator=generator) < 0.2
    exact[16:24] = False
    exact[24, :] = True
    radius = radius.masked_fill(exact, 0.0)
    ends = ref.end_tokens(num_tokens)
    acc = ref.accumulate_certificate(probs, radius, exact)

    candidates = probs.masked_fill(~ends | exact, -1.0)
    held = torch.where(candidates.amax(-1) >= 0, candidates.argmax(-1), -1)
    per_token = _per_token_accumulators(probs, radius, held, exact)
    torch.testing.assert_close(acc.p_max, per_token.p_max, rtol=0, atol=0)
    torch.testing.assert_close(acc.u_max, per_token.u_max, rtol=0, atol=0)
    torch.testing.assert_close(acc.p_rest, per_token.p_rest, rtol=1e-12, atol=0)
    for name in ("a1_rest", "b_rest", "u_rest"):
        assert bool((getattr(acc, name) >= getattr(per_token, name) * (1 - 1e-12)).all()), name
    assert bool((acc.certificate >= per_token.certificate * (1 - 1e-12)).all())
    assert acc.p_max[24] == 0 and acc.u_max[24] == 0 and acc.certificate[24] == 0  # every token exact
    if num_tokens > 2 * ref.END_TILE:
        assert bool((acc.p_max[:8] < probs[:8, num_tokens // 2]).all())  # the middle token is not held apart
    if num_tokens <= ref.CELL_STRIDE:
        # One token per cell: the bounds are the per-token sums.
        for name in ("a1_rest", "b_rest", "u_rest"):
            torch.testing.assert_close(getattr(acc, name), getattr(per_token, name), rtol=1e-12, atol=0)


def test_a_cell_is_a_blocks_tokens_with_the_same_position_mod_8():
    # Tokens 200 and 208 (block 6, cell 0) share a cell between the end tiles (S = 300); 209 sits in cell 1.
    probs = torch.zeros(1, 300, dtype=torch.float64)
    radius = torch.zeros(1, 300, dtype=torch.float64)
    probs[0, [0, 200, 208, 209]] = torch.tensor([0.4, 0.2, 0.3, 0.1], dtype=torch.float64)
    radius[0, [0, 200, 208, 209]] = torch.tensor([0.1, 0.02, 0.05, 0.03], dtype=torch.float64)
    acc = ref.accumulate_certificate(probs, radius)
    moment = 0.2 * 0.02**2 + 0.3 * 0.05**2
    u = math.sqrt(0.5 * moment) + 0.1 * 0.03
    b = (
        float(ref.h_of(torch.tensor(0.05, dtype=torch.float64))) * moment
        + float(ref.expm1_minus_x(torch.tensor(0.03, dtype=torch.float64))) * 0.1
    )
    assert float(acc.p_max[0]) == 0.4 and float(acc.u_max[0]) == 0.1
    assert float(acc.u_rest[0]) == pytest.approx(u, rel=1e-12)
    assert float(acc.b_rest[0]) == pytest.approx(b, rel=1e-12)
    assert float(acc.a1_rest[0]) == pytest.approx(u + b, rel=1e-12)
    assert float(acc.p_rest[0]) == pytest.approx(0.6, rel=1e-12)


def test_each_end_block_argmax_is_exact_and_the_first_of_the_largest_is_held():
    # S = 256: the end tiles are [0, 128) and [128, 256), all 8 blocks. Equal largest weights at 40 and 140: the
    # first is held; every other block's first argmax keeps its exact terms, so a cell's looser bound never
    # reaches a token that tops its block.
    probs = torch.full((1, 256), 0.5 / 254, dtype=torch.float64)
    probs[0, [40, 140]] = 0.25
    radius = torch.full((1, 256), 0.01, dtype=torch.float64)
    radius[0, 140] = 0.5
    acc = ref.accumulate_certificate(probs, radius)
    assert float(acc.p_max[0]) == 0.25 and float(acc.u_max[0]) == 0.01
    singles = [32 * b for b in range(8) if b not in (1, 4)] + [140]
    assert float(acc.u_rest[0]) >= 0.25 * 0.5 + sum(float(probs[0, t]) * 0.01 for t in singles if t != 140)


# --- decode and the radius ----------------------------------------------------------------------------


def test_decode_matches_a_plain_attention_on_the_dequantized_cache():
    generator = torch.Generator().manual_seed(10)
    keys = torch.randn(300, 2, 64, generator=generator).to(torch.float16)
    values = torch.randn(300, 2, 64, generator=generator).to(torch.float16)
    slots = torch.randperm(1000, generator=generator)[:300]
    k = ref.quantize(keys, seed=3, layer=2, slots=slots, kind="k")
    v = ref.quantize(values, seed=3, layer=2, slots=slots, kind="v")
    q = torch.randn(14, 64, generator=generator, dtype=torch.float64)
    result = ref.decode_attention(q, k, v, delta_step=1e-8)
    k_hat = k.dequantize(torch.float64).repeat_interleave(7, dim=1)
    v_hat = v.dequantize(torch.float64).repeat_interleave(7, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:, None, :], k_hat.transpose(0, 1), v_hat.transpose(0, 1), scale=1 / 8
    )[:, 0, :]
    assert torch.allclose(result.out, expected, rtol=1e-10, atol=1e-12)
    assert result.certificate.shape == (14,)
    assert bool((result.certificate > 0).all())


@pytest.mark.parametrize("law", ["gaussian", "exact-outliers"])
def test_float32_evaluation_moves_the_attention_far_less_than_useful_certificates(law):
    """THEORY.md section 3: the certificate bounds TV(p, p~) with ``p~`` the attention over the dequantized keys
    in exact arithmetic; evaluating it in float32 moves it by at most 1e-5 on these shapes (the float64
    reference on the same quantized keys), far below any certificate a gate would act on."""
    generator = torch.Generator().manual_seed(7)
    outliers = ref.rope_pair_channels([0, 1], 128) if law == "exact-outliers" else None
    worst = 0.0
    for num_tokens in (256, 4096):
        keys = torch.randn(num_tokens, 2, 128, generator=generator, dtype=torch.float64)
        if outliers is not None:
            keys[:, :, outliers] *= 40.0  # large logits carried by exact channels
        keys = keys.to(torch.float16)
        slots = torch.randperm(4 * num_tokens, generator=generator)[:num_tokens]
        common = dict(seed=3, layer=1, slots=slots, dither_bits=8)
        k = ref.quantize(keys, kind="k", outlier_channels=outliers, **common)
        v = ref.quantize(keys, kind="v", **common)
        for temperature in (0.5, 4.0, 16.0):
            q = (temperature * torch.randn(14, 128, generator=generator, dtype=torch.float64)).to(torch.float16)
            r32, r64 = (ref.decode_attention(q.to(t), k, v, delta_step=1e-7) for t in (torch.float32, torch.float64))
            evaluation_error = ref.total_variation(r64.probs, r32.probs.double())
            worst = max(worst, float(evaluation_error.max()))
            useful = r64.certificate >= 1e-2
            assert bool((evaluation_error[useful] < 1e-3 * r64.certificate[useful]).all())
    assert 0 < worst < 1e-5


def test_radius_formula_and_outliers_carry_no_radius():
    keys = torch.randn(50, 1, 64).to(torch.float16)
    outliers = ref.rope_pair_channels([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], 64)  # one full group
    k = ref.quantize(keys, seed=0, layer=0, slots=torch.arange(50), kind="k", outlier_channels=outliers)
    q = torch.randn(1, 64, dtype=torch.float64)
    delta = 1e-6
    radius = ref.logit_radius(q, k, sm_scale=0.125, delta=delta, kv_head_of_query=torch.tensor([0]))
    c = math.sqrt(2 * math.log(2 * 50 / delta))
    q_masked = q.clone()
    q_masked[:, outliers] = 0
    groups = q_masked.view(1, 2, 32)
    s = k.scales.double()[:, 0, :]  # [S, 2]
    sigma = 0.125 * torch.sqrt((s.square() * groups.square().sum(-1)).sum(-1) / 12)
    beta = 2.0**-25 + 2.0**-16
    bias = 0.125 * (s * groups.abs().sum(-1)).sum(-1) * beta
    # (c + kappa) sigma, kappa = beta sqrt(12 D_q) over the 64 - 32 quantized channels; it bounds c sigma + bias.
    assert torch.allclose(radius[0], (c + beta * math.sqrt(12 * 32)) * sigma, rtol=1e-12)
    assert bool((radius[0] >= c * sigma + bias).all())


def test_a_zero_scale_beside_an_overflowed_query_gives_an_infinite_radius():
    """``|q_g|^2`` beyond float32 meets a zero group scale (an all-zero key group): ``0 * inf`` is +inf there,
    section 3's rule for products with an overflowed factor, where plain float32 would give NaN."""
    keys = torch.randn(4, 1, 64).to(torch.float16)
    keys[:2] = 0.0  # both groups' scales 0
    keys[2, :, :32] = 0.0  # the first group's scale 0
    k = ref.quantize(keys, seed=0, layer=0, slots=torch.arange(4), kind="k")
    assert bool((k.scales[:2] == 0).all()) and float(k.scales[2, 0, 0]) == 0.0
    q = torch.full((1, 64), 1e20, dtype=torch.float32)
    radius = ref.logit_radius(q, k, sm_scale=1e-18, delta=1e-6, kv_head_of_query=torch.tensor([0]))
    assert bool(torch.isposinf(radius).all()), radius


def test_delta_step_allocates_the_request_budget():
    assert ref.delta_step(28, 28) == pytest.approx(1e-2 / (28 * 28 * 256))
    assert ref.delta_step(2, 4, delta_req=0.1, horizon=10) == pytest.approx(0.1 / 80)
    with pytest.raises(ValueError):
        ref.delta_step(0, 4)
    with pytest.raises(ValueError):
        ref.delta_step(2, 4, delta_req=1.5)


def test_decode_rejects_bad_input():
    keys = torch.randn(10, 2, 64).to(torch.float16)
    k = ref.quantize(keys, seed=0, layer=0, slots=torch.arange(10), kind="k")
    v = ref.quantize(keys, seed=0, layer=0, slots=torch.arange(10), kind="v")
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ref.decode_attention(torch.randn(3, 64), k, v, delta_step=1e-6)
    with pytest.raises(ValueError, match="head_dim"):
        ref.decode_attention(torch.randn(4, 32), k, v, delta_step=1e-6)
    with pytest.raises(ValueError, match="'k' side"):
        ref.decode_attention(torch.randn(4, 64), v, k, delta_step=1e-6)
    with pytest.raises(ValueError, match="delta_step"):
        ref.decode_attention(torch.randn(4, 64), k, v, delta_step=0.0)


# --- soundness end to end -----------------------------------------------------------------------------


def test_soundness_monte_carlo_fast():
    report = run_soundness(draws=1500, tokens=(256, 1024), seed=1)
    assert report.violations <= report.allowed_violations
    assert report.box_misses <= report.allowed_violations
    assert report.median_ratio >= 1.0


@pytest.mark.slow
def test_soundness_monte_carlo_at_realistic_shapes():
    """>= 10^5 (head, step) draws at D = 128, S up to 4096, GQA 7:1, Gaussian and outlier-channel keys."""
    report = run_soundness(draws=100_000, tokens=(512, 1024, 2048, 4096), kv_heads=4, seed=2)
    assert report.draws >= 100_000
    assert report.violations <= report.allowed_violations


# --- output error (THEORY.md section 5) ---------------------------------------------------------------


@pytest.mark.parametrize("v_dither", [True, False])
def test_output_error_bound_holds_against_exact_attention(v_dither):
    generator = torch.Generator().manual_seed(21)
    delta = 1e-6
    violations = draws = 0
    for trial in range(12):
        keys = torch.randn(512, 2, 128, generator=generator, dtype=torch.float64).to(torch.float16)
        values = torch.randn(512, 2, 128, generator=generator, dtype=torch.float64).to(torch.float16)
        slots = torch.randperm(2048, generator=generator)[:512]
        common = dict(seed=trial, layer=0, slots=slots, dither_bits=8)
        k = ref.quantize(keys, kind="k", **common)
        v = ref.quantize(values, kind="v", dither=v_dither, **common)
        q = 2.0 * torch.randn(14, 128, generator=generator, dtype=torch.float64)
        result = ref.decode_attention(q, k, v, delta_step=delta)
        bound = ref.output_error_bound(result, v, delta=delta)
        exact_k = keys.double().repeat_interleave(7, dim=1)
        exact_v = values.double().repeat_interleave(7, dim=1)
        probs = torch.softmax(torch.einsum("hd,shd->hs", q, exact_k) / math.sqrt(128), -1)
        exact_out = torch.einsum("hs,shd->hd", probs, exact_v)
        violations += int(((exact_out - result.out).abs() > bound).sum())
        draws += bound.numel()
    assert violations == 0, f"{violations} of {draws} channels exceeded their bound"
