"""Shared builders for the kernel contract tests (CPU interpreter and GPU): pools, paged layouts, oracles."""

from __future__ import annotations

import bisect
import dataclasses
import math

import pytest
import torch

from witcert.kernels import KVPool, decode_attention, extend_attention, reference, select_path


def interpreter_only(gpu_tests: str) -> pytest.MarkDecorator:
    """The mark of a module that runs kernels in Triton's interpreter on CPU; ``gpu_tests`` says where the same
    kernels run compiled."""
    return pytest.mark.skipif(
        torch.cuda.is_available() or select_path(torch.device("cpu")) != "triton-interpreter",
        reason=f"runs the Triton interpreter on CPU ({gpu_tests})",
    )


def paged_slots(total_tokens: int, num_slots: int, page_size: int, generator: torch.Generator) -> torch.Tensor:
    """Random non-contiguous slots for ``total_tokens`` tokens: whole pages in random order, in-page contiguous."""
    pages = torch.randperm(num_slots // page_size, generator=generator)[: math.ceil(total_tokens / page_size)]
    slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
    return slots[:total_tokens]


def filled_pool(
    lengths: list[int],
    *,
    kv_heads: int,
    head_dim: int = 128,
    page_size: int = 1,
    v_dither: bool = True,
    outlier_channels: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    layer: int = 1,
    key_scale: float = 1.0,
) -> tuple[KVPool, torch.Tensor, torch.Tensor]:
    """A 2-layer pool with ``sum(lengths)`` random tokens written to ``layer``; returns (pool, indptr, slots)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    num_slots = page_size * (math.ceil(total / page_size) + 8)
    pool = KVPool(
        num_slots,
        2,
        kv_heads,
        head_dim,
        seed=seed + 12345,
        v_dither=v_dither,
        page_size=page_size,
        outlier_channels=outlier_channels,
        device=device,
        dtype=dtype,
    )
    slots = paged_slots(total, num_slots, page_size, generator)
    k = (torch.randn(total, kv_heads, head_dim, generator=generator) * key_scale).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
    if outlier_channels is not None:
        k[:, :, outlier_channels] *= 20.0
    pool.write(layer, slots.to(device), k.to(device), v.to(device))
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return pool, indptr.to(device), slots.to(device)


def radius_straddling_case(
    device: torch.device | str, delta: float
) -> tuple[KVPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys scaled (6.5 x randn) so that the radii of two rows (700 and 129 tokens, 4 KV heads of 7 query heads)
    lie on both sides of 1/4, where ``g``'s evaluation changes route (its series below, the exponential from
    there on): at least a fifth of each side, asserted against the reference. Returns (pool, indptr, slots, q)."""
    pool, indptr, slots = filled_pool([700, 129], kv_heads=4, v_dither=False, device=device, key_scale=6.5)
    q = torch.randn(2, 28, 128, generator=torch.Generator().manual_seed(7)).half().to(device)
    radius = oracle(q[0], pool, 1, slots[:700], delta=delta).radius
    quarter = float((radius < 0.25).float().mean())
    assert 0.2 <= quarter <= 0.8, f"{quarter:.2f} of the radii are below 1/4"
    return pool, indptr, slots, q


def far_token_case(
    device: torch.device | str = "cpu",
) -> tuple[KVPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row whose token 17 has keys near the fp16 limit, against query head 0's signs: its logit for that
    head lies so far below the max that its softmax weight underflows to 0, while its radius is so large
    that expm1 and g overflow. The reference's certificate is then +inf, since that token's true logit may lie
    above the max; for the heads where the token is the argmax it is +inf as well. Returns (pool, indptr,
    slots, q); 7 query heads on one KV head, V rounded to nearest (the Gluon kernel's case)."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 7, 128, generator=generator).half()
    k = torch.randn(40, 1, 128, generator=generator)
    k[17, 0] = -60000.0 * torch.sign(q[0, 0].float())
    v = torch.randn(40, 1, 128, generator=generator)
    pool = KVPool(64, 2, 1, 128, seed=99, device=device)
    slots = torch.randperm(64, generator=generator)[:40]
    pool.write(1, slots.to(device), k.half().to(device), v.half().to(device))
    indptr = torch.tensor([0, 40], dtype=torch.int32)
    return pool, indptr.to(device), slots.to(device), q.to(device)


def overflowing_query_case(
    device: torch.device | str = "cpu", *, zero_groups: bool = False
) -> tuple[KVPool, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Two rows of bf16 queries near 1e20 with the softmax scale 1e-18: logits spread over thousands, so
    almost every weight underflows to 0, while ``|q_g|^2`` overflows float32 and with it every token's radius.
    The reference's certificate is +inf (an infinite radius beside a zero weight counts, ``mul_nonneg``).
    ``zero_groups``: each row's first 6 tokens get all-zero keys and the next 6 a zero first channel group,
    whose scales are 0, so the radius meets ``0 * inf`` there.
    Returns (pool, indptr, slots, q, sm_scale); 7 query heads on one KV head, V rounded to nearest."""
    pool, indptr, slots = filled_pool([300, 40], kv_heads=1, v_dither=False, dtype=torch.bfloat16, device=device)
    if zero_groups:
        generator = torch.Generator().manual_seed(2)
        for start in indptr[:-1].tolist():
            k = torch.randn(12, 1, 128, generator=generator)
            k[:6] = 0.0
            k[6:, :, :32] = 0.0
            v = torch.randn(12, 1, 128, generator=generator)
            pool.write(1, slots[start : start + 12], k.to(torch.bfloat16).to(device), v.to(torch.bfloat16).to(device))
    q = torch.randn(2, 7, 128, generator=torch.Generator().manual_seed(1)) * 1e20
    return pool, indptr, slots, q.to(torch.bfloat16).to(device), 1e-18


def overflowing_extend_certificates(device: torch.device | str, *, delta: float) -> str:
    """``overflowing_query_case`` with zero key groups, as extend: the last 2 and 3 tokens of its two sequences
    are new, each with its row's query. Asserts that every certificate is +inf in the reference and in
    ``extend_attention``, never NaN; returns the path that ran."""
    pool, kv_indptr, slots, q, sm_scale = overflowing_query_case(device, zero_groups=True)
    qo_indptr = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    q = torch.cat((q[:1].expand(2, -1, -1), q[1:].expand(3, -1, -1)))
    result = extend_attention(q, pool, 1, qo_indptr, kv_indptr, slots, sm_scale=sm_scale, delta_step=delta)
    for row in range(5):
        expected = extend_oracle(q, pool, qo_indptr, kv_indptr, slots, [298, 37], row, delta=delta, sm_scale=sm_scale)
        assert torch.isposinf(expected.certificate).all()
        assert torch.isposinf(result.certificate[row]).all(), (row, result.certificate[row])
    return result.path


def non_finite_token_readers(device: torch.device | str, value: float, side: str, *, delta: float) -> str:
    """Two rows over one KV head, V rounded to nearest; token 5 of row 0 has ``value`` (NaN or +-inf) in
    channel 3 of its ``side`` ("k" or "v"), written without validation, as on a GPU by default. Asserts that
    row 0's decode output is not finite, nor, for K, any of its certificates, and that row 1 (five clean
    tokens) matches the reference. Returns the path that ran."""
    generator = torch.Generator().manual_seed(4)
    pool = KVPool(64, 2, 1, 128, seed=3, v_dither=False, device=device)
    k = torch.randn(25, 1, 128, generator=generator)
    v = torch.randn(25, 1, 128, generator=generator)
    (k if side == "k" else v)[5, 0, 3] = value
    slots = torch.randperm(64, generator=generator)[:25]
    pool.write(1, slots.to(device), k.half().to(device), v.half().to(device), validate=False)
    q = torch.randn(2, 7, 128, generator=generator).half().to(device)
    indptr = torch.tensor([0, 20, 25], dtype=torch.int32, device=device)
    result = decode_attention(q, pool, 1, indptr, slots.to(device), delta_step=delta)
    assert not torch.isfinite(result.out[0]).all()
    if side == "k":
        assert not torch.isfinite(result.certificate[0]).any(), result.certificate[0]
    expected = oracle(q[1], pool, 1, slots[20:].to(device), delta=delta)
    assert relative_error(result.out[1], expected.out) < 1e-5
    torch.testing.assert_close(result.certificate[1].cpu(), expected.certificate, rtol=1e-4, atol=0.0)
    return result.path


def _on_cpu(quantized: reference.QuantizedKV) -> reference.QuantizedKV:
    return dataclasses.replace(
        quantized,
        codes=quantized.codes.cpu(),
        scales=quantized.scales.cpu(),
        outlier_values=quantized.outlier_values.cpu(),
        outlier_channels=quantized.outlier_channels.cpu(),
        slots=quantized.slots.cpu(),
    )


def oracle(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    slots: torch.Tensor,
    *,
    delta: float,
    skip: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> reference.DecodeResult:
    """The reference decode of one query row ``[H_q, D]`` over ``slots`` of the pool (float32, on CPU).

    ``skip``: the pool-wide ``[num_slots, H_kv]`` mask given to the kernel; the rows of ``slots`` are used.
    """
    return reference.decode_attention(
        q.float().cpu(),
        _on_cpu(pool.quantized(layer, slots, "k")),
        _on_cpu(pool.quantized(layer, slots, "v")),
        sm_scale=sm_scale,
        delta_step=delta,
        skip=None if skip is None else skip.cpu()[slots.cpu()],
    )


def extend_oracle(
    q: torch.Tensor,
    pool: KVPool,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    slots: torch.Tensor,
    prefix: list[int],
    row: int,
    *,
    delta: float,
    sm_scale: float | None = None,
) -> reference.DecodeResult:
    """The reference for new token ``row`` of an extend batch over layer 1: its query over the keys it sees
    (its sequence's ``prefix`` and the new tokens up to itself)."""
    starts = qo_indptr.tolist()
    sequence = bisect.bisect_right(starts, row) - 1
    first = int(kv_indptr[sequence])
    visible = slots[first : first + prefix[sequence] + row - starts[sequence] + 1]
    return oracle(q[row], pool, 1, visible, delta=delta, sm_scale=sm_scale)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float().cpu() - expected).norm() / expected.norm())


def float32_logit_tolerance(expected: reference.DecodeResult, values: torch.Tensor, out_tol: float = 1e-5) -> float:
    """The output error (relative, norm) that float32 logits allow, for logits far from 0.

    Kernel and reference both round logits in float32: at ``|logit|`` near ``M`` a few roundings move a logit by
    up to about ``delta = 2**-20 M``. Logit errors ``e_t`` move head ``h``'s output by ``sum_t p_t (e_t - e_bar)
    (v_t - out_h)``, at most ``2 delta sum_t p_t |v_t - out_h|``: nothing where one token holds the weight, most
    at a near tie. ``values``: the dequantized V ``[T, H_kv, D]``; ``M`` is taken as the largest ``|lse| + 128``
    (weights more than 104 below the max are 0 in float32). ``out_tol`` on top."""
    delta = 2.0**-20 * (float(expected.lse.abs().max()) + 128.0)
    heads = expected.out.shape[0]
    per_head = values.float().cpu().repeat_interleave(heads // values.shape[1], dim=1).transpose(0, 1)  # [H, T, D]
    spread = (expected.probs[:, :, None] * (per_head - expected.out[:, None, :]).norm(dim=-1, keepdim=True)).sum(1)
    return out_tol + float((2.0 * delta * spread).norm() / expected.out.norm())


def assert_matches_oracle(
    result, q, pool, layer, indptr, slots, *, delta, out_tol=1e-5, cert_tol=1e-4, sm_scale=None
) -> None:
    """Every row: out within ``out_tol`` (relative, norm), certificate within ``cert_tol`` (relative, each head)."""
    for row in range(q.shape[0]):
        row_slots = slots[int(indptr[row]) : int(indptr[row + 1])]
        if row_slots.numel() == 0:
            assert torch.all(result.out[row] == 0)
            assert torch.all(result.lse[row] == -math.inf)
            assert torch.all(result.certificate[row] == 0)
            continue
        expected = oracle(q[row], pool, layer, row_slots, delta=delta, sm_scale=sm_scale)
        assert relative_error(result.out[row], expected.out) <= out_tol, f"row {row}"
        torch.testing.assert_close(result.lse[row].cpu(), expected.lse, rtol=1e-6, atol=1e-5)
        certificate = result.certificate[row].cpu()
        assert not torch.isnan(certificate).any()
        torch.testing.assert_close(certificate, expected.certificate, rtol=cert_tol, atol=0.0)
        acc = expected.accumulators
        kernel = result.accumulators
        torch.testing.assert_close(kernel.p_max[row].cpu(), acc.p_max, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(kernel.u_max[row].cpu(), acc.u_max, rtol=1e-5, atol=0.0)
        # The rest sums, accumulated apart (no 1 - p_max cancellation), match the reference's.
        for name in ("a1_rest", "b_rest", "u_rest", "p_rest"):
            torch.testing.assert_close(getattr(kernel, name)[row].cpu(), getattr(acc, name), rtol=1e-4, atol=1e-12)
