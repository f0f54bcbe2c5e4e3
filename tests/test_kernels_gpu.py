"""Kernel contracts on the GPU at larger shapes, and CUDA-graph replay (run on the H200: pytest -m gpu)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import (
    assert_matches_oracle,
    extend_oracle,
    far_token_case,
    filled_pool,
    float32_logit_tolerance,
    non_finite_token_readers,
    oracle,
    overflowing_extend_certificates,
    overflowing_query_case,
    radius_straddling_case,
    relative_error,
)

from witcert.kernels import (
    ExtendBounds,
    KVPool,
    decode_attention,
    extend_attention,
    extend_sdpa,
    reference,
)
from witcert.kernels.attention import gluon_supports
from witcert.kernels.launch import LAUNCH
from witcert.kernels.pool import encode_codes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DELTA = reference.delta_step(28, 28)
CUDA = torch.device("cuda")


@pytest.fixture(params=["gluon", "gluon_ws", "triton"])
def stage1(request):
    """Run the test with the Gluon stage 1 wherever it applies (whatever the size), with its warp-specialised form
    (kernels/gluon_decode_ws.py, Hopper only), then with the Triton one."""
    if request.param == "gluon_ws" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the warp-specialised stage 1 needs Hopper")
    saved = (LAUNCH.gluon, LAUNCH.gluon_min_tokens, LAUNCH.gluon_ws)
    LAUNCH.gluon, LAUNCH.gluon_min_tokens = request.param != "triton", 0
    LAUNCH.gluon_ws = request.param == "gluon_ws"
    yield request.param
    LAUNCH.gluon, LAUNCH.gluon_min_tokens, LAUNCH.gluon_ws = saved


def _expected_path(q: torch.Tensor, pool: KVPool) -> str:
    if LAUNCH.gluon and gluon_supports(q, pool):
        return "gluon-ws-gpu" if LAUNCH.gluon_ws else "gluon-gpu"
    return "triton-gpu"


def _query(
    rows: int, heads: int, seed: int = 7, dtype: torch.dtype = torch.float16, head_dim: int = 128
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, head_dim, generator=generator).to(dtype).to(CUDA)


def test_write_and_dither_are_bit_identical_on_gpu():
    generator = torch.Generator().manual_seed(0)
    channels = reference.rope_pair_channels([1, 9], 128)
    pool = KVPool(20000, 2, 4, 128, outlier_channels=channels, seed=2**50 + 3, v_dither=False, device=CUDA)
    slots = torch.randperm(20000, generator=generator)[:6000]
    k = (torch.randn(6000, 4, 128, generator=generator) * 2).half()
    v = torch.randn(6000, 4, 128, generator=generator).half()
    pool.write(1, slots.to(CUDA), k.to(CUDA), v.to(CUDA))
    for side, (kind, x) in enumerate((("k", k), ("v", v))):
        expected = reference.quantize(
            x, seed=pool.seed, layer=1, slots=slots, kind=kind, outlier_channels=channels, dither_bits=8,
            dither=kind == "k",
        )  # fmt: skip
        assert torch.equal(pool.codes[1, side, slots.to(CUDA)].cpu(), encode_codes(expected.codes))
        assert torch.equal(pool.scales[1, side, slots.to(CUDA)].cpu(), expected.scales)
        assert torch.equal(pool.outlier_values[1, side, slots.to(CUDA)].cpu(), expected.outlier_values)
    xi = reference.dither_values(
        seed=pool.seed, layer=1, slots=slots[:500], num_kv_heads=4, head_dim=128, kind="k", dither_bits=8
    )
    assert torch.equal(pool.dither(1, slots[:500].to(CUDA), "k", 3).cpu(), xi[:, 3])


def test_write_is_bit_identical_across_scales_on_gpu():
    """Group magnitudes from 1e-6 to 6e4 (fp16 scales from subnormal to ~500): codes and scales equal the
    reference's bit for bit at every scale, so the kernel's arithmetic rounds as the reference's does."""
    generator = torch.Generator().manual_seed(3)
    tokens = 100_000
    pool = KVPool(tokens, 1, 4, 128, seed=11, v_dither=False, device=CUDA)
    magnitude = torch.exp(torch.empty(tokens, 4, 4, 1).uniform_(math.log(1e-6), math.log(6e4), generator=generator))
    x = (torch.randn(tokens, 4, 4, 32, generator=generator) * magnitude).clamp(-65000, 65000).reshape(tokens, 4, 128)
    x = x.half()
    slots = torch.randperm(tokens, generator=generator)
    pool.write(0, slots.to(CUDA), x.to(CUDA), x.to(CUDA))
    for side, kind in enumerate(("k", "v")):
        expected = reference.quantize(
            x, seed=pool.seed, layer=0, slots=slots, kind=kind, outlier_channels=None, dither_bits=8,
            dither=kind == "k",
        )  # fmt: skip
        assert torch.equal(pool.scales[0, side, slots.to(CUDA)].cpu(), expected.scales)
        assert torch.equal(pool.codes[0, side, slots.to(CUDA)].cpu(), encode_codes(expected.codes))


@pytest.mark.parametrize(
    ("kv_heads", "group", "page_size", "v_dither", "dtype"),
    [
        (4, 7, 1, True, torch.float16),
        (4, 7, 16, False, torch.float16),
        (4, 7, 16, False, torch.bfloat16),
        (8, 1, 16, True, torch.float16),
        (8, 1, 1, False, torch.bfloat16),
        (4, 7, 1, False, torch.float16),
        (2, 12, 1, False, torch.float16),
        (8, 1, 16, False, torch.float16),
    ],
    ids=[
        "qwen-page1-vdither", "qwen-page16-vnearest", "qwen-bf16", "mha", "mha-bf16-vnearest", "qwen-page1-vnearest",
        "two-head-blocks", "mha-vnearest",
    ],
)  # fmt: skip
def test_decode_matches_reference_on_gpu(kv_heads, group, page_size, v_dither, dtype, stage1):
    lengths = [1, 4097, 0, 1500, 64, 129]
    pool, indptr, slots = filled_pool(
        lengths, kv_heads=kv_heads, page_size=page_size, v_dither=v_dither, device=CUDA, dtype=dtype
    )
    q = _query(len(lengths), kv_heads * group, dtype=dtype)
    for splits in (None, 5):
        result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=splits)
        assert result.path == _expected_path(q, pool)
        assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_matches_reference_at_gemma_3s_head_dim_256_on_gpu(dtype):
    """Gemma 3 270M's shape (4 query heads on 1 KV head, head dim 256), which only the Triton stage 1 covers."""
    lengths = [1, 2500, 129]
    pool, indptr, slots = filled_pool(lengths, kv_heads=1, head_dim=256, v_dither=False, device=CUDA, dtype=dtype)
    q = _query(len(lengths), 4, dtype=dtype, head_dim=256)
    for splits in (None, 3):
        result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=splits)
        assert result.path == "triton-gpu"
        assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


@pytest.mark.parametrize(("v_dither", "outliers"), [(True, True), (False, True), (False, False)])
def test_decode_with_outliers_and_skipped_pairs_matches_reference_on_gpu(v_dither, outliers, stage1):
    channels = reference.rope_pair_channels([2, 40], 128) if outliers else None
    lengths = [3000, 130]
    pool, indptr, slots = filled_pool(lengths, kv_heads=4, outlier_channels=channels, v_dither=v_dither, device=CUDA)
    q = _query(2, 28)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA)
    assert result.path == _expected_path(q, pool)
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)
    generator = torch.Generator().manual_seed(5)
    skip = torch.rand(pool.num_slots, 4, generator=generator) < 0.2
    skip[slots[:1024].cpu(), 2] = True  # whole tiles skipped before live tokens
    skip[slots[3000:].cpu(), 1] = True  # row 1, KV head 1: nothing left
    skipped = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA, skip=skip.to(CUDA))
    for row in range(2):
        row_slots = slots[int(indptr[row]) : int(indptr[row + 1])]
        expected = oracle(q[row], pool, 1, row_slots, delta=DELTA, skip=skip)
        assert relative_error(skipped.out[row], expected.out) <= 1e-5
        torch.testing.assert_close(skipped.certificate[row].cpu(), expected.certificate, rtol=1e-4, atol=0.0)
    assert torch.all(skipped.lse[1, 7:14] == -float("inf")) and torch.all(skipped.certificate[1, 7:14] == 0)


def test_extend_matches_reference_on_gpu(per_row_extend):
    prefix, new = [700, 0, 33], [5, 17, 1]
    pool, kv_indptr, slots = filled_pool([p + n for p, n in zip(prefix, new, strict=True)], kv_heads=4, device=CUDA)
    qo_indptr = torch.tensor([0, 5, 22, 23], device=CUDA)
    q = _query(23, 28)
    result = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA)
    for row in (0, 4, 5, 21, 22):
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, prefix, row, delta=DELTA)
        assert relative_error(result.out[row], expected.out) < 1e-5
        torch.testing.assert_close(result.certificate[row].cpu(), expected.certificate, rtol=1e-4, atol=0.0)


_PREFILL_PREFIX = [3000, 0, 40]
_PREFILL_ROWS = (0, 17, 69, 70, 90, 102, 103)


def _prefill_batch(dtype: torch.dtype):
    """``(prefix, pool, qo_indptr, kv_indptr, slots, q)``: a prefix hit of 70 new tokens over 3000 cached
    ones, a 33-token prompt without a prefix and one new token over 40, Qwen2.5-7B's heads, V nearest."""
    new = [70, 33, 1]
    pool, kv_indptr, slots = filled_pool(
        [p + n for p, n in zip(_PREFILL_PREFIX, new, strict=True)], kv_heads=4, v_dither=False, device=CUDA,
        dtype=dtype,
    )  # fmt: skip
    return (
        _PREFILL_PREFIX,
        pool,
        torch.tensor([0, 70, 103, 104], device=CUDA),
        kv_indptr,
        slots,
        _query(104, 28, dtype=dtype),
    )


@pytest.mark.parametrize("certificate", [False, True], ids=["no-certificate", "certificate"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_tiled_extend_matches_reference_on_gpu(tiled_extend, dtype, certificate):
    """Extend on the tiled kernel: several blocks per sequence, a long prefix, with and without the certificate."""
    prefix, pool, qo_indptr, kv_indptr, slots, q = _prefill_batch(dtype)
    result = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=certificate)
    assert result.path == "triton-gpu"
    for row in _PREFILL_ROWS:
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, prefix, row, delta=DELTA)
        assert relative_error(result.out[row], expected.out) < 1e-5, row
        if certificate:
            torch.testing.assert_close(result.certificate[row].cpu(), expected.certificate, rtol=1e-4, atol=0.0)


def test_tiled_extend_gives_an_infinite_certificate_where_the_radius_overflows_on_gpu(tiled_extend):
    """``overflowing_extend_certificates`` compiled: every certificate +inf, as in the reference."""
    assert overflowing_extend_certificates(CUDA, delta=DELTA) == "triton-gpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gather_is_bit_identical_to_reference_dequantize_on_gpu(dtype):
    """The gather kernel compiled: K dithered, V dithered and nearest, rounded once to fp16 or bf16."""
    for v_dither in (False, True):
        pool, _, slots = filled_pool([300, 77], kv_heads=4, v_dither=v_dither, device=CUDA, dtype=dtype)
        order = slots[torch.randperm(slots.numel(), device=CUDA)]
        k_hat, v_hat = pool.gather(1, order)
        assert torch.equal(k_hat, pool.dequantize(1, order, "k").to(dtype))
        assert torch.equal(v_hat, pool.dequantize(1, order, "v").to(dtype))


@pytest.mark.parametrize("chunk_keys", [None, 100], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("max_calls", [64, 0], ids=["sdpa-per-sequence", "varlen"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sdpa_extend_matches_reference_within_half_precision_on_gpu(dtype, max_calls, chunk_keys, monkeypatch):
    """Extend without the certificate over the gathered K/V, one SDPA call per sequence or one varlen_attn
    call: a prefix hit (causal aligned at the end of the keys), a prompt without a prefix, a single new
    token, GQA 7:1. Against the float32 reference and the exact tiled kernel, at the accuracy of
    half-precision attention. ``chunks``: K/V gathered at most 100 keys at a time, so the 3070-key sequence
    alone and the other two together (``LAUNCH.extend_sdpa_chunk_bytes``)."""
    monkeypatch.setattr(LAUNCH, "extend_sdpa_max_calls", max_calls)
    prefix, pool, qo_indptr, kv_indptr, slots, q = _prefill_batch(dtype)
    if chunk_keys is not None:
        monkeypatch.setattr(LAUNCH, "extend_sdpa_chunk_bytes", chunk_keys * extend_sdpa.key_bytes(q, pool))
        assert ExtendBounds(qo_indptr.tolist(), kv_indptr.tolist()).chunks(chunk_keys) == [(0, 1), (1, 3)]
    gathered = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=False)
    assert gathered.path == "sdpa-gpu" and gathered.certificate is None and gathered.lse is None
    bounds = (qo_indptr.tolist(), kv_indptr.tolist())
    with_bounds = extend_attention(
        q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=False, bounds=bounds
    )
    assert torch.equal(with_bounds.out, gathered.out)
    monkeypatch.setattr(LAUNCH, "extend_sdpa", False)
    exact = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=False)
    assert exact.path == "triton-gpu"
    tolerance = 4e-3 if dtype == torch.float16 else 2e-2
    for row in _PREFILL_ROWS:
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, prefix, row, delta=DELTA)
        assert relative_error(gathered.out[row], expected.out) < tolerance, row
    assert relative_error(gathered.out.cpu(), exact.out.cpu()) < tolerance


@pytest.mark.parametrize("prefix", [[200, 200, 200, 0], [0, 0, 0, 0]], ids=["prefix-hits", "prompts"])
def test_sdpa_extend_batches_equal_sequences_on_gpu(prefix):
    """Sequences of one shape share a batched SDPA call (``extend_bounds.equal_runs``): GQA 7:1, with the
    causal mask aligned bottom-right (prefix hits) or plain (prompts), against the float32 reference."""
    new = [30, 30, 30, 30]
    pool, kv_indptr, slots = filled_pool(
        [p + n for p, n in zip(prefix, new, strict=True)], kv_heads=4, v_dither=False, device=CUDA
    )
    qo_indptr = torch.tensor([0, 30, 60, 90, 120], device=CUDA)
    q = _query(120, 28)
    result = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=False)
    assert result.path == "sdpa-gpu" and result.out.dtype == torch.float16
    for row in (0, 29, 31, 59, 75, 90, 119):
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, prefix, row, delta=DELTA)
        assert relative_error(result.out[row], expected.out) < 4e-3, row


def test_sdpa_extend_checks_offsets_and_poisons_bad_slots_on_gpu():
    """The SDPA path slices sequences by host offsets, which are always checked (SDPA trusts them); a slot
    outside the pool raises when validated and otherwise makes only its own sequence's rows NaN."""
    pool, kv_indptr, slots = filled_pool([50, 20], kv_heads=4, v_dither=False, device=CUDA)
    q = _query(6, 28)
    qo_indptr = torch.tensor([0, 3, 6], device=CUDA)
    bad_slots = slots.clone()
    bad_slots[4] = pool.num_slots
    with pytest.raises(ValueError, match="kv_indices must be slots"):
        extend_attention(
            q, pool, 1, qo_indptr, kv_indptr, bad_slots, delta_step=DELTA, certificate=False, validate=True
        )
    poisoned = extend_attention(q, pool, 1, qo_indptr, kv_indptr, bad_slots, delta_step=DELTA, certificate=False)
    assert poisoned.path == "sdpa-gpu"
    assert torch.isnan(poisoned.out[:3]).all() and torch.isfinite(poisoned.out[3:]).all()
    with pytest.raises(ValueError, match="non-decreasing"):
        extend_attention(q, pool, 1, qo_indptr, kv_indptr.flip(0), slots, delta_step=DELTA, certificate=False)
    with pytest.raises(ValueError, match="at least as many KV slots"):
        extend_attention(
            q, pool, 1, torch.tensor([0, 1, 6], device=CUDA), torch.tensor([0, 50, 53], device=CUDA), slots,
            delta_step=DELTA, certificate=False,
        )  # fmt: skip
    with pytest.raises(ValueError, match="qo_indptr\\[-1\\]"):
        extend_attention(
            q, pool, 1, qo_indptr, kv_indptr, slots, delta_step=DELTA, certificate=False,
            bounds=([0, 3, 5], kv_indptr.tolist()),
        )  # fmt: skip


@pytest.mark.parametrize("v_dither", [True, False])
def test_cuda_graph_replay_is_bit_identical_to_eager(v_dither, stage1):
    capacity = [3000, 3000, 3000]
    pool, _, slots = filled_pool(capacity, kv_heads=4, device=CUDA, v_dither=v_dither)
    indptr = torch.tensor([0, 3000, 6000, 9000], device=CUDA, dtype=torch.int32)
    static_q = _query(3, 28)
    static_out = torch.empty(3, 28, 128, device=CUDA)

    def step() -> object:
        return decode_attention(static_q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=16, out=static_out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for trial in range(4):
        # New queries and new lengths each time: the graph must follow both, with no recapture.
        static_q.copy_(_query(3, 28, seed=100 + trial))
        ends = torch.tensor([0, 1 + 700 * trial, 3000 + 13 * trial, 6000 + 999 * trial], dtype=torch.int32)
        indptr.copy_(ends.cumsum(0).to(torch.int32).clamp_max(9000))
        graph.replay()
        eager = decode_attention(static_q, pool, 1, indptr, slots, delta_step=DELTA, num_kv_splits=16)
        torch.cuda.synchronize()
        assert torch.equal(captured.out, eager.out)
        assert torch.equal(captured.lse, eager.lse)
        assert torch.equal(captured.certificate, eager.certificate)
        assert torch.isfinite(captured.certificate).all()


@pytest.mark.parametrize("v_dither", [True, False])
def test_malformed_rows_on_gpu_are_poisoned_without_a_device_fault(v_dither, stage1):
    pool, indptr, slots = filled_pool([100, 50], kv_heads=4, device=CUDA, v_dither=v_dither)
    q = _query(2, 28)
    bad = slots.clone()
    bad[120] = 2**30
    result = decode_attention(q, pool, 1, indptr, bad, delta_step=DELTA)
    torch.cuda.synchronize()
    assert torch.isnan(result.certificate[1]).all() and torch.isfinite(result.certificate[0]).all()
    with pytest.raises(ValueError, match="slots in"):
        decode_attention(q, pool, 1, indptr, bad, delta_step=DELTA, validate=True)


def test_radii_on_both_sides_of_a_quarter_match_reference_on_gpu(stage1):
    """g's two routes (the series below 1/4, the exponential from there), mixed within a thread's radii."""
    pool, indptr, slots, q = radius_straddling_case(CUDA, DELTA)
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA)
    assert result.path == _expected_path(q, pool)
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA)


def test_an_overflowing_radius_counts_where_its_weight_underflows_on_gpu(stage1):
    pool, indptr, slots, q = far_token_case(CUDA)
    expected = oracle(q[0], pool, 1, slots, delta=DELTA)
    assert expected.probs[0, 17] == 0 and torch.isinf(expected.certificate).all()
    result = decode_attention(q, pool, 1, indptr, slots, delta_step=DELTA)
    assert result.path == _expected_path(q, pool)
    assert torch.isinf(result.certificate[0]).all() and (result.certificate[0] > 0).all()
    assert relative_error(result.out[0], expected.out) < 1e-5


@pytest.mark.parametrize("zero_groups", [False, True], ids=["random-keys", "zero-groups"])
def test_an_overflowing_radius_gives_an_infinite_certificate_on_gpu(stage1, zero_groups):
    """Every radius beyond float32 beside weights that underflowed: +inf, as in the reference, also where a zero
    group scale meets the overflowed ``|q_g|^2``. The Gluon stage 1 takes such a head's infinity through the
    radius' bias operand and reads a NaN U_rest as +inf."""
    pool, indptr, slots, q, sm_scale = overflowing_query_case(CUDA, zero_groups=zero_groups)
    result = decode_attention(q, pool, 1, indptr, slots, sm_scale=sm_scale, delta_step=DELTA)
    assert result.path == _expected_path(q, pool)
    for row in range(2):
        row_slots = slots[indptr[row] : indptr[row + 1]]
        expected = oracle(q[row], pool, 1, row_slots, delta=DELTA, sm_scale=sm_scale)
        assert torch.isposinf(expected.certificate).all()
        assert torch.isposinf(result.certificate[row]).all(), result.certificate[row]
        # Logits of thousands: float32 rounding alone moves them by ~1e-3 (float32_logit_tolerance).
        tolerance = float32_logit_tolerance(expected, pool.dequantize(1, row_slots, "v"))
        assert relative_error(result.out[row], expected.out) < tolerance


@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_non_finite_value_written_unvalidated_poisons_only_its_readers_on_gpu(value, side, stage1):
    """The write kernel compiled gives a NaN in K or V a NaN scale (an inf one already is): the reading row's
    output is not finite, nor, for K, its certificate; the other row matches the reference."""
    expected = {"gluon": "gluon-gpu", "gluon_ws": "gluon-ws-gpu", "triton": "triton-gpu"}[stage1]
    assert non_finite_token_readers(CUDA, value, side, delta=DELTA) == expected


@pytest.mark.parametrize("magnitude", [1e5, 1e-6])
def test_bf16_queries_outside_the_fp16_range_match_reference_on_gpu(magnitude, stage1):
    """bf16 queries whose values overflow fp16 (1e5) or sit among its subnormals (1e-6), with the softmax
    scale that brings their logits back to O(1): the Gluon stage 1 rescales them per head by a power of two."""
    lengths = [2000, 300]
    pool, indptr, slots = filled_pool(lengths, kv_heads=4, v_dither=False, device=CUDA, dtype=torch.bfloat16)
    q = (_query(2, 28, dtype=torch.float32) * magnitude).to(torch.bfloat16)
    sm_scale = 1.0 / (magnitude * math.sqrt(128))
    result = decode_attention(q, pool, 1, indptr, slots, sm_scale=sm_scale, delta_step=DELTA)
    assert result.path == _expected_path(q, pool)
    assert_matches_oracle(result, q, pool, 1, indptr, slots, delta=DELTA, sm_scale=sm_scale)


def test_a_pool_of_2_31_code_bytes_matches_reference_on_gpu(stage1):
    """Slots whose codes lie past 2**31 bytes of the layer's buffer: both stage 1s switch to 64-bit addresses."""
    num_slots = 2**24 + 2048  # one KV head of 128 channels: slot 2**24 starts at byte 2**31
    pool = KVPool(num_slots, 1, 1, 128, seed=5, device=CUDA)
    assert pool.codes[0, 0].numel() >= 2**31
    generator = torch.Generator().manual_seed(11)
    lengths = [3000, 1000]
    slots = (2**24 - 2048 + torch.randperm(4096, generator=generator)[: sum(lengths)]).to(CUDA)
    k = torch.randn(sum(lengths), 1, 128, generator=generator).half().to(CUDA)
    v = torch.randn(sum(lengths), 1, 128, generator=generator).half().to(CUDA)
    pool.write(0, slots, k, v)
    indptr = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=CUDA)
    q = _query(2, 7)
    result = decode_attention(q, pool, 0, indptr, slots, delta_step=DELTA)
    assert result.path == _expected_path(q, pool)
    assert_matches_oracle(result, q, pool, 0, indptr, slots, delta=DELTA)
