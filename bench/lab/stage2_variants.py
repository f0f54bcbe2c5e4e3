"""Decode stage 2 (the merge of the splits and the certificate's evaluation) in other shapes, timed on the
partials of one real decode call: where the certificate's cost in stage 2 can go.

A decode call at the Qwen2.5-7B shape (28 query heads, 4 KV heads, head_dim 128, K dithered, V nearest) runs once
with and once without the certificate; its stage-2 inputs are kept, and each variant below merges them again,
timed on the device by PyTorch's profiler (CUPTI; the median over ``--calls`` launches, as
``profile_decode.py --kernel-times``). Every variant's outputs (out, LSE, certificate, accumulators) are checked
against the product's stage 2 on the same inputs before it is timed. GPU only.

- ``product``: ``triton_kernels.decode_stage2`` as ``attention._merge_splits`` launches it
  (``LAUNCH.stage2_num_warps``), and with ``W`` warps (``product_w{W}``): one program per row and query head.
- ``gluon{H}``: the product's algebra in Gluon, a warp per query head and ``H`` heads a program, each thread holding all
  of a head's splits: no lane exchange or barrier, every thread evaluating every split.
- ``heads{H}_w{W}``: one program per row and block of ``H`` query heads, every value a ``[H, splits]`` tile; the
  certificate's eleven sums in one multi-operand reduction; its six partials loaded beside the LSEs
  (``_early``) or after the output's loads (``_late``); ``_tail``: the held token's ``exp``, ``expm1`` and ``g``
  picked from every split's (computed beside the sums) instead of computed after them; ``_eager``: the splits'
  outputs loaded without waiting for the LSEs (every split's, the unused ones weighted 0).

    python bench/lab/stage2_variants.py --batches 8 32 --context 16384 --output bench/results/stage2_variants.json

``--sass SPLITS`` compiles every variant for sm_90 here instead (no GPU; Triton 3.6 as on the device:
``PYTHONPATH=/tmp/t36``) and prints its static instruction counts per program.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT / "bench"), str(_ROOT / "tests")]
from run_info import gpu_run_info  # noqa: E402

from witcert.kernels import KVPool, attention, decode_attention, reference  # noqa: E402
from witcert.kernels.launch import LAUNCH  # noqa: E402
from witcert.kernels.triton_kernels import FP32_INF, _add3, _add4, _first_max, expm1_and_g, mul_nonneg  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
VARIANTS = [
    "product", "product_w1", "product_w4",
    "heads4_w4_late", "heads4_w4_early", "heads4_w1_early", "heads7_w4_early", "heads1_w4_early_tail",
    "heads4_w4_early_tail", "heads4_w4_early_tail_eager", "heads4_w1_early_tail_eager", "gluon1", "gluon4",
]  # fmt: skip


@triton.jit
def _sum7(a0, a1, a2, a3, a4, a5, a6, b0, b1, b2, b3, b4, b5, b6):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6


@triton.jit
def stage2_heads(
    PartOut, PartLse, PartMax, PartA1, PartB, PartURest, PartPRest, PartU, Out, Lse, Certificate, Accumulators,
    stride_ob, stride_oh, eval_slack, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, HEADS_BLOCK: tl.constexpr, HEADS_PAD: tl.constexpr, CERTIFICATE: tl.constexpr,
    EARLY: tl.constexpr, TAIL: tl.constexpr, EAGER_OUT: tl.constexpr,
):  # fmt: skip
    """``decode_stage2``'s algebra on a ``[heads, splits]`` tile per program."""
    row = tl.program_id(0)
    block = tl.arange(0, HEADS_PAD)
    heads = tl.program_id(1) * HEADS_BLOCK + block
    head_ok = (block < HEADS_BLOCK) & (heads < NUM_Q_HEADS)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = head_ok[:, None] & (splits < NUM_SPLITS)[None, :]
    part = ((row * NUM_Q_HEADS + heads) * NUM_SPLITS)[:, None] + splits[None, :]
    lse = tl.load(PartLse + part, mask=split_ok, other=-FP32_INF)
    if CERTIFICATE and EARLY:
        split_max = tl.load(PartMax + part, mask=split_ok, other=-FP32_INF)
        a1_parts = tl.load(PartA1 + part, mask=split_ok, other=0.0)
        b_parts = tl.load(PartB + part, mask=split_ok, other=0.0)
        u_rest_parts = tl.load(PartURest + part, mask=split_ok, other=0.0)
        p_rest_parts = tl.load(PartPRest + part, mask=split_ok, other=0.0)
        u_parts = tl.load(PartU + part, mask=split_ok, other=0.0)
    total = tl.max(lse, axis=1)
    has_tokens = total > -FP32_INF
    safe_total = tl.where(has_tokens, total, 0.0)
    weight = tl.where(lse > -FP32_INF, tl.exp(lse - safe_total[:, None]), 0.0)
    weight = tl.where(lse != lse, (FP32_INF - FP32_INF), weight)
    weight_sum = tl.sum(weight, axis=1)
    global_lse = tl.where(has_tokens, safe_total + tl.log(tl.where(has_tokens, weight_sum, 1.0)), -FP32_INF)
    global_lse = tl.where(weight_sum != weight_sum, (FP32_INF - FP32_INF), global_lse)
    norm = tl.where(has_tokens[:, None], weight / weight_sum[:, None], 0.0)
    channels = tl.arange(0, HEAD_DIM)
    used = (norm > 0)[:, :, None]
    out_mask = split_ok[:, :, None] if EAGER_OUT else used
    parts = tl.load(PartOut + part[:, :, None] * HEAD_DIM + channels[None, None, :], mask=out_mask, other=0.0)
    out = tl.sum(tl.where(used, norm[:, :, None] * parts, 0.0), axis=1)
    out = out + tl.where(weight_sum == weight_sum, 0.0, (FP32_INF - FP32_INF))[:, None]
    out_ptr = Out + row * stride_ob + heads[:, None] * stride_oh + channels[None, :]
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=head_ok[:, None])
    tl.store(Lse + row * NUM_Q_HEADS + heads, global_lse, mask=head_ok)
    if CERTIFICATE:
        if not EARLY:
            split_max = tl.load(PartMax + part, mask=split_ok, other=-FP32_INF)
            a1_parts = tl.load(PartA1 + part, mask=split_ok, other=0.0)
            b_parts = tl.load(PartB + part, mask=split_ok, other=0.0)
            u_rest_parts = tl.load(PartURest + part, mask=split_ok, other=0.0)
            p_rest_parts = tl.load(PartPRest + part, mask=split_ok, other=0.0)
            u_parts = tl.load(PartU + part, mask=split_ok, other=0.0)
        live = split_ok & (lse > -FP32_INF)
        winner = tl.argmax(tl.where(live, split_max, -FP32_INF), axis=1, tie_break_left=True)
        is_winner = splits[None, :] == winner[:, None]
        loser = live & ~is_winner
        held = is_winner & live
        p_arg = tl.where(live, tl.exp(split_max - tl.where(has_tokens, global_lse, 0.0)[:, None]), 0.0)
        expm1_parts, g_parts = expm1_and_g(u_parts)
        if TAIL:
            # The held token's exp, expm1 and g picked from the splits' own, off the chain after the sums.
            e_m, expm1_m, g_m = tl.reduce(
                (tl.where(held, tl.exp(u_parts), 0.0), tl.where(held, expm1_parts, 0.0), tl.where(held, g_parts, 0.0)),
                1,
                _add3,
            )
            e_m = tl.where(tl.sum(held.to(tl.int32), axis=1) > 0, e_m, 1.0)
        a1, b, u_rest, p_rest, p_max, u_max, nan_count = tl.reduce(
            (
                tl.where(live, mul_nonneg(norm, a1_parts), 0.0) + tl.where(loser, mul_nonneg(p_arg, expm1_parts), 0.0),
                tl.where(live, mul_nonneg(norm, b_parts), 0.0) + tl.where(loser, mul_nonneg(p_arg, g_parts), 0.0),
                tl.where(live, mul_nonneg(norm, u_rest_parts), 0.0) + tl.where(loser, mul_nonneg(p_arg, u_parts), 0.0),
                tl.where(live, norm * p_rest_parts, 0.0) + tl.where(loser, p_arg, 0.0),
                tl.where(held, p_arg, 0.0),
                tl.where(held, u_parts, 0.0),
                tl.where(split_ok & (lse != lse), 1.0, 0.0),
            ),
            1,
            _sum7,
        )
        nan_in = (nan_count > 0) | (weight_sum != weight_sum)
        poison = tl.where(nan_in, (FP32_INF - FP32_INF), 0.0)
        if not TAIL:
            e_m = tl.exp(u_max)
            expm1_m, g_m = expm1_and_g(u_max)
        t1 = a1 + mul_nonneg(p_max, expm1_m)
        b_total = b + mul_nonneg(p_max, g_m)
        t4 = mul_nonneg(e_m, a1) + mul_nonneg(expm1_m, p_rest)
        pa_inner = mul_nonneg(e_m, b) + mul_nonneg(expm1_m, u_rest) + mul_nonneg(g_m, p_rest)
        bound = tl.minimum(tl.minimum(t1, t4), tl.minimum(tl.sqrt(b_total / 2.0), tl.sqrt(pa_inner / 2.0)))
        bound = tl.where(has_tokens, bound * eval_slack, 0.0) + poison
        index = row * NUM_Q_HEADS + heads
        field = tl.num_programs(0) * NUM_Q_HEADS
        tl.store(Certificate + index, bound, mask=head_ok)
        tl.store(Accumulators + index, a1 + poison, mask=head_ok)
        tl.store(Accumulators + field + index, b + poison, mask=head_ok)
        tl.store(Accumulators + 2 * field + index, u_rest + poison, mask=head_ok)
        tl.store(Accumulators + 3 * field + index, p_rest + poison, mask=head_ok)
        tl.store(Accumulators + 4 * field + index, p_max + poison, mask=head_ok)
        tl.store(Accumulators + 5 * field + index, u_max + poison, mask=head_ok)


@gluon.jit
def stage2_gluon(
    PartOut, PartLse, PartMax, PartA1, PartB, PartURest, PartPRest, PartU, Out, Lse, Certificate, Accumulators,
    stride_ob, stride_oh, eval_slack, NUM_Q_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_SPLITS: gl.constexpr,
    SPLITS_PAD: gl.constexpr, CERTIFICATE: gl.constexpr, HEADS: gl.constexpr,
):  # fmt: skip
    """``decode_stage2``'s algebra with a warp per query head and a head's splits in each thread: every reduction
    over the splits is a thread's own (no lane exchange, no barrier); the lanes share the channels."""
    out_layout: gl.constexpr = gl.BlockedLayout([1, SPLITS_PAD, HEAD_DIM // 32], [1, 1, 32], [HEADS, 1, 1], [2, 1, 0])
    split_layout: gl.constexpr = gl.SliceLayout(2, out_layout)
    head_layout: gl.constexpr = gl.SliceLayout(1, split_layout)
    channel_layout: gl.constexpr = gl.SliceLayout(1, out_layout)
    row = gl.program_id(0)
    heads = gl.program_id(1) * HEADS + gl.arange(0, HEADS, layout=head_layout)
    head_ok = heads < NUM_Q_HEADS
    splits = gl.arange(0, SPLITS_PAD, layout=gl.SliceLayout(0, split_layout))[None, :]
    split_ok = head_ok[:, None] & (splits < NUM_SPLITS)
    part = ((row * NUM_Q_HEADS + heads) * NUM_SPLITS)[:, None] + splits
    lse = gl.load(PartLse + part, mask=split_ok, other=-FP32_INF)
    total = gl.max(lse, axis=1)
    has_tokens = total > -FP32_INF
    safe_total = gl.where(has_tokens, total, 0.0)
    weight = gl.where(lse > -FP32_INF, gl.exp(lse - safe_total[:, None]), 0.0)
    weight = gl.where(lse != lse, (FP32_INF - FP32_INF), weight)
    weight_sum = gl.sum(weight, axis=1)
    global_lse = gl.where(has_tokens, safe_total + gl.log(gl.where(has_tokens, weight_sum, 1.0)), -FP32_INF)
    global_lse = gl.where(weight_sum != weight_sum, (FP32_INF - FP32_INF), global_lse)
    norm = gl.where(has_tokens[:, None], weight / weight_sum[:, None], 0.0)
    channels = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, channel_layout))
    used = (norm > 0)[:, :, None]
    parts = gl.load(PartOut + part[:, :, None] * HEAD_DIM + channels[None, None, :], mask=used, other=0.0)
    out = gl.sum(gl.where(used, norm[:, :, None] * parts, 0.0), axis=1)
    poisoned = gl.convert_layout(weight_sum != weight_sum, gl.SliceLayout(1, channel_layout))
    out = out + gl.where(poisoned, (FP32_INF - FP32_INF), 0.0)[:, None]
    out_heads = gl.convert_layout(heads, gl.SliceLayout(1, channel_layout))
    out_ptr = Out + row * stride_ob + out_heads[:, None] * stride_oh + channels[None, :]
    gl.store(out_ptr, out.to(Out.dtype.element_ty), mask=(out_heads < NUM_Q_HEADS)[:, None])
    gl.store(Lse + row * NUM_Q_HEADS + heads, global_lse, mask=head_ok)
    if CERTIFICATE:
        split_max = gl.load(PartMax + part, mask=split_ok, other=-FP32_INF)
        a1_parts = gl.load(PartA1 + part, mask=split_ok, other=0.0)
        b_parts = gl.load(PartB + part, mask=split_ok, other=0.0)
        u_rest_parts = gl.load(PartURest + part, mask=split_ok, other=0.0)
        p_rest_parts = gl.load(PartPRest + part, mask=split_ok, other=0.0)
        u_parts = gl.load(PartU + part, mask=split_ok, other=0.0)
        live = split_ok & (lse > -FP32_INF)
        held_logits = gl.where(live, split_max, -FP32_INF)
        index = gl.zeros_like(part) + splits
        max_logit, winner, u_max = gl.reduce((held_logits, index, gl.where(live, u_parts, 0.0)), 1, _first_max)
        loser = live & (splits != winner[:, None])
        lse_or_0 = gl.where(has_tokens, global_lse, 0.0)
        p_arg = gl.where(live, gl.exp(split_max - lse_or_0[:, None]), 0.0)
        p_max = gl.where(max_logit > -FP32_INF, gl.exp(max_logit - lse_or_0), 0.0)
        expm1_parts, g_parts = expm1_and_g(u_parts)
        a1, b, u_rest, p_rest = gl.reduce(
            (
                gl.where(live, mul_nonneg(norm, a1_parts), 0.0) + gl.where(loser, mul_nonneg(p_arg, expm1_parts), 0.0),
                gl.where(live, mul_nonneg(norm, b_parts), 0.0) + gl.where(loser, mul_nonneg(p_arg, g_parts), 0.0),
                gl.where(live, mul_nonneg(norm, u_rest_parts), 0.0) + gl.where(loser, mul_nonneg(p_arg, u_parts), 0.0),
                gl.where(live, norm * p_rest_parts, 0.0) + gl.where(loser, p_arg, 0.0),
            ),
            1,
            _add4,
        )
        poison = gl.where(weight_sum != weight_sum, (FP32_INF - FP32_INF), 0.0)
        e_m = gl.exp(u_max)
        expm1_m, g_m = expm1_and_g(u_max)
        t1 = a1 + mul_nonneg(p_max, expm1_m)
        b_total = b + mul_nonneg(p_max, g_m)
        t4 = mul_nonneg(e_m, a1) + mul_nonneg(expm1_m, p_rest)
        pa_inner = mul_nonneg(e_m, b) + mul_nonneg(expm1_m, u_rest) + mul_nonneg(g_m, p_rest)
        bound = gl.minimum(gl.minimum(t1, t4), gl.minimum(gl.sqrt(b_total / 2.0), gl.sqrt(pa_inner / 2.0)))
        bound = gl.where(has_tokens, bound * eval_slack, 0.0) + poison
        index = row * NUM_Q_HEADS + heads
        field = gl.num_programs(0) * NUM_Q_HEADS
        gl.store(Certificate + index, bound, mask=head_ok)
        gl.store(Accumulators + index, a1 + poison, mask=head_ok)
        gl.store(Accumulators + field + index, b + poison, mask=head_ok)
        gl.store(Accumulators + 2 * field + index, u_rest + poison, mask=head_ok)
        gl.store(Accumulators + 3 * field + index, p_rest + poison, mask=head_ok)
        gl.store(Accumulators + 4 * field + index, p_max + poison, mask=head_ok)
        gl.store(Accumulators + 5 * field + index, u_max + poison, mask=head_ok)


def _variant(variant: str, certificate: bool, num_q_heads: int, head_dim: int, splits: int) -> tuple:
    """``(kernel, programs per row, constexprs, warps)`` of a variant's name."""
    shape = dict(NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, NUM_SPLITS=splits,
                 SPLITS_PAD=max(2, triton.next_power_of_2(splits)), CERTIFICATE=certificate)  # fmt: skip
    if variant.startswith("product"):
        warps = int(variant.split("_w")[1]) if "_w" in variant else LAUNCH.stage2_num_warps
        return attention.kernels_module().decode_stage2, num_q_heads, shape, warps
    if variant.startswith("gluon"):
        heads = int(variant.removeprefix("gluon"))
        return stage2_gluon, triton.cdiv(num_q_heads, heads), dict(shape, HEADS=heads), heads
    block, rest = variant.removeprefix("heads").split("_w")
    warps, order, *flags = rest.split("_")
    heads_block = int(block)
    constants = dict(shape, HEADS_BLOCK=heads_block, HEADS_PAD=triton.next_power_of_2(heads_block),
                     EARLY=order == "early", TAIL="tail" in flags, EAGER_OUT="eager" in flags)  # fmt: skip
    return stage2_heads, triton.cdiv(num_q_heads, heads_block), constants, int(warps)


def _launch(variant: str, inputs: tuple, outputs: tuple) -> None:
    part_out, part_lse, part_stats = inputs
    out, lse, stats = outputs
    rows, num_q_heads, splits, head_dim = part_out.shape
    kernel, programs, constants, warps = _variant(variant, part_stats is not None, num_q_heads, head_dim, splits)
    kernel[(rows, programs)](
        part_out, part_lse, *attention._stat_pointers(part_stats, part_lse), out, lse,
        *(stats if stats is not None else (lse,) * 2), out.stride(0), out.stride(1), reference.CERTIFICATE_EVAL_SLACK,
        **constants, num_warps=warps,
    )  # fmt: skip


def _static_counts(variants: list[str], splits: int) -> None:
    """Each variant's SASS for sm_90 (compiled here, no GPU): instructions a program's warp runs (the kernel has
    no loop), lane exchanges, CTA barriers and shared-memory stores, without and with the certificate."""
    from sass import _sm90_cubin, profile
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    pointers = dict.fromkeys(("PartOut", "PartLse", "PartMax", "PartA1", "PartB", "PartURest", "PartPRest", "PartU",
                              "Lse", "Certificate", "Accumulators"), "fp32") | {"Out": "fp16"}  # fmt: skip
    scalars = dict(stride_ob="i32", stride_oh="i32", eval_slack="fp32")
    print(f"static SASS, sm_90, {Q_HEADS} query heads, {splits} splits: instructions (SHFL, BAR, STS), per program")
    for variant in variants:
        line = f"{variant:28s}"
        for certificate in (False, True):
            kernel, programs, constants, warps = _variant(variant, certificate, Q_HEADS, HEAD_DIM, splits)
            source = GluonASTSource if kernel is stage2_gluon else ASTSource
            cubin = _sm90_cubin(kernel, source, pointers, scalars, constants, {"num_warps": warps})
            ops = profile(cubin).opcodes
            line += f"  {'cert' if certificate else 'none'} {sum(ops.values()):5d} ({ops['SHFL']}, {ops['BAR']}, "
            line += f"{ops['STS']}) x {warps} warps x {programs} programs a row"
        print(line)


def _capture(batch: int, context: int, certificate: bool) -> tuple:
    """The stage-2 inputs of one decode call (stage 1 has written them), and fresh outputs of their shapes."""
    tokens = batch * context
    generator = torch.Generator(device="cuda").manual_seed(batch * 7919 + context)
    pool = KVPool(tokens, 1, KV_HEADS, HEAD_DIM, device="cuda")
    for start in range(0, tokens, 2**20):
        stop = min(start + 2**20, tokens)
        k, v = torch.randn(2, stop - start, KV_HEADS, HEAD_DIM, device="cuda", generator=generator).half()
        pool.write(0, torch.arange(start, stop, device="cuda"), k, v, validate=False)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", generator=generator).half()
    indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * context
    indices = torch.arange(tokens, device="cuda", dtype=torch.int32)
    captured: list[tuple] = []
    merge = attention._merge_splits

    def keep(part_out, part_lse, part_stats, out, lse, stats):  # noqa: ANN001, ANN202
        stats_copy = None if part_stats is None else attention._SplitPartials(*(t.clone() for t in part_stats))
        captured.append((part_out.clone(), part_lse.clone(), stats_copy))
        merge(part_out, part_lse, part_stats, out, lse, stats)

    attention._merge_splits = keep
    try:
        decode_attention(q, pool, 0, indptr, indices, delta_step=0.05, certificate=certificate)
    finally:
        attention._merge_splits = merge
    torch.cuda.synchronize()
    return captured[0]


def _outputs(inputs: tuple) -> tuple:
    part_out, part_lse, part_stats = inputs
    rows, num_q_heads, _, head_dim = part_out.shape
    device = part_out.device
    out = torch.empty(rows, num_q_heads, head_dim, dtype=torch.float16, device=device)
    lse = torch.empty(rows, num_q_heads, dtype=torch.float32, device=device)
    stats = None
    if part_stats is not None:
        stats = attention._Certificate.allocate(rows, num_q_heads, device, fill=float("nan"))
    return out, lse, stats


def _named(outputs: tuple) -> dict[str, torch.Tensor]:
    out, lse, stats = outputs
    named = {"out": out.float(), "lse": lse}
    if stats is not None:
        named |= {"certificate": stats.certificate, "accumulators": stats.accumulators}
    return named


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per output, the largest relative difference between two stage 2s (inf where their NaNs or infinities differ).
    ``out`` is fp16: one unit in the last place is 2**-10 relative, more below fp16's normal range."""
    worst = {}
    for name, x in a.items():
        y = b[name]
        finite = torch.isfinite(x) & torch.isfinite(y)
        same = torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(x[torch.isinf(x)], y[torch.isinf(x)])
        diff = (x[finite] - y[finite]).abs() / y[finite].abs().clamp_min(1e-30)
        worst[name] = (float(diff.max()) if diff.numel() else 0.0) if same else float("inf")
    return worst


def _device_us(call, calls: int) -> float:  # noqa: ANN001
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = [e.time_range.elapsed_us() for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="each variant timed this many times, interleaved")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, help="the variants to time (default: %(default)s)")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--sass", type=int, metavar="SPLITS",
                        help="print each variant's static SASS at this many splits instead (no GPU)")  # fmt: skip
    args = parser.parse_args()
    if args.sass:
        _static_counts(args.variants, args.sass)
        return
    if args.output is None:
        parser.error("--output is required to time the variants")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    LAUNCH.gluon, LAUNCH.gluon_min_tokens = True, 0
    variants = list(args.variants)
    rows = []
    for batch in args.batches:
        for certificate in (False, True):
            inputs = _capture(batch, args.context, certificate)
            reference_out = _outputs(inputs)
            _launch("product", inputs, reference_out)
            torch.cuda.synchronize()
            checked = {}
            for variant in list(variants):
                outputs = _outputs(inputs)
                try:
                    _launch(variant, inputs, outputs)
                    torch.cuda.synchronize()
                except Exception as error:  # a variant that fails to compile is reported, not timed
                    print(f"B={batch} {variant}: {type(error).__name__}: {str(error)[-300:]}", flush=True)
                    variants.remove(variant)
                    continue
                checked[variant] = _max_rel(_named(outputs), _named(reference_out))
            times: dict[str, list[float]] = {v: [] for v in variants}
            outputs = {v: _outputs(inputs) for v in variants}
            for _ in range(args.rounds):
                for variant in variants:
                    call = functools.partial(_launch, variant, inputs, outputs[variant])
                    times[variant].append(_device_us(call, args.calls))
            for variant in variants:
                row = {"batch": batch, "context": args.context, "certificate": certificate, "variant": variant,
                       "us": statistics.median(times[variant]), "rounds_us": times[variant],
                       "max_rel_diff": checked[variant]}  # fmt: skip
                rows.append(row)
                diffs = " ".join(f"{name} {diff:.1e}" for name, diff in checked[variant].items())
                mode = "on " if certificate else "off"
                print(f"B={batch} cert={mode} {variant:18s} {row['us']:7.2f} us  rel diff {diffs}", flush=True)
    args.output.write_text(json.dumps({"run": gpu_run_info(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
