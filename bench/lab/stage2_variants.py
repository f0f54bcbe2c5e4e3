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
- ``heads{H}_w{W}``: the product's algebra with one program per row and block of ``H`` query heads, every value a
  ``[H, splits]`` tile; the certificate's six partials loaded beside the LSEs (``_early``) or after the output's
  loads (``_late``); ``_eager``: the splits' outputs loaded without waiting for the LSEs (every split's, the unused
  ones weighted 0).

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
sys.path[:0] = [str(_ROOT / "bench" / "lab"), str(_ROOT / "bench"), str(_ROOT / "tests")]
from profile_decode import kernel_times  # noqa: E402
from run_info import gpu_run_info  # noqa: E402

from witcert.kernels import KVPool, attention, decode_attention, reference  # noqa: E402
from witcert.kernels.launch import LAUNCH  # noqa: E402
from witcert.kernels.triton_kernels import (  # noqa: E402
    FP32_INF,
    load_split_certificates,
    merge_weights,
    store_merged_certificate,
)

Q_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
VARIANTS = [
    "product", "product_w1", "product_w2", "product_w4",
    "heads4_w4_late", "heads4_w4_early", "heads4_w1_early", "heads7_w4_early", "heads4_w4_early_eager",
    "heads4_w1_early_eager", "gluon1", "gluon4",
]  # fmt: skip


@triton.jit
def stage2_heads(
    PartOut, PartLse, PartMax, PartA1, PartB, PartURest, PartPRest, PartU, Out, Lse, Certificate, Accumulators,
    stride_ob, stride_oh, eval_slack, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, HEADS_BLOCK: tl.constexpr, HEADS_PAD: tl.constexpr, CERTIFICATE: tl.constexpr,
    EARLY: tl.constexpr, EAGER_OUT: tl.constexpr,
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
        partials = load_split_certificates(PartMax, PartA1, PartB, PartURest, PartPRest, PartU, part, split_ok)
    merged = merge_weights(lse, 1)
    _, global_lse, norm, weight_sum, _ = merged
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
            partials = load_split_certificates(PartMax, PartA1, PartB, PartURest, PartPRest, PartU, part, split_ok)
        store_merged_certificate(
            Certificate, Accumulators, row * NUM_Q_HEADS + heads, tl.num_programs(0) * NUM_Q_HEADS, head_ok, partials,
            tl.zeros_like(part) + splits[None, :], merged, eval_slack, 1,
        )  # fmt: skip


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
    merged = merge_weights(lse, 1)
    _, global_lse, norm, weight_sum, _ = merged
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
        partials = load_split_certificates(PartMax, PartA1, PartB, PartURest, PartPRest, PartU, part, split_ok)
        store_merged_certificate(
            Certificate, Accumulators, row * NUM_Q_HEADS + heads, gl.num_programs(0) * NUM_Q_HEADS, head_ok, partials,
            gl.zeros_like(part) + splits, merged, eval_slack, 1,
        )  # fmt: skip


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
                     EARLY=order == "early", EAGER_OUT="eager" in flags)  # fmt: skip
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
                    (stage2_us,) = kernel_times(call, args.calls).values()  # the variant's one kernel
                    times[variant].append(statistics.median(stage2_us))
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
