"""Decode-attention and write-kernel benchmark on one GPU (the H200): writes a JSON results file.

Method: Qwen2.5-7B decode shape (28 query heads, 4 KV heads, head_dim 128), one layer. For each
(batch, context) every variant is timed in the same process, back to back, as the median of CUDA-graph
replays (``triton.testing.do_bench_cudagraph``), so the ratios are paired:

* ``sdpa_cudnn``: ``torch.nn.functional.scaled_dot_product_attention`` on a contiguous fp16 (``--dtype``) cache
  ``[B, H_kv, S, D]`` with the cuDNN backend (GQA through ``enable_gqa``);
* ``fp16_kernel``: our split-KV kernel over a paged fp16 cache (the same structure as ours, no quantization;
  ``fp16_baseline.py``, checked against exact attention first: ``fp16_kernel_error``);
* ``int8_nocert`` / ``int8_cert``: our int8 dithered kernel without / with the certificate
  (``v_dither`` as given: K is always dithered), stage 1 in Gluon where it applies
  (``kernels/gluon_decode.py``); ``triton_nocert`` / ``triton_cert``: the same with the Triton stage 1;
  ``ws_nocert`` / ``ws_cert``: with the warp-specialised Gluon stage 1 (``kernels/gluon_decode_ws.py``) at its
  default register cap (three programs per SM), ``ws128_nocert`` / ``ws128_cert`` at a cap of 128 (two per SM, the
  consumers uncapped);
* with ``--baseline-stage1 FILE``, ``base_nocert`` / ``base_cert``: the int8 kernel with the Gluon stage 1 of FILE,
  another version of ``kernels/gluon_decode.py`` and its ``gluon_tiles.py`` as one module (``python
  bench/lab/whatif_stage1.py none --rev REV --output FILE``), in its place; everything else (stage 2, the shared
  Triton helpers) is this checkout's. Changes smaller than the few percent two runs differ by are measurable only
  this way, paired in one run. ``--baseline-maxnreg N`` runs them at register cap N (both variants; the default
  splits follow it, filling whole waves of as many programs per SM as the cap allows).

Inputs are rotated among enough copies that each timed call reads at least 512 MB, so the L2 (50 MB on
the H200) cannot serve them. ``--resident-slots N`` does the opposite, to split a kernel's time into memory
and the rest: the paged variants then read N slots over and over (``kv_indices`` is ``t % N`` for token
``t``), which the L2 holds for N up to about 32k (1088 int8 bytes per token of 4 KV heads; 2048 for the
fp16 kernel), so what is left is the time of the kernel's own instructions and latencies; SDPA, whose cache
is contiguous, is not timed then. ``--slot-order shuffled`` reads each row's pages of ``--page-size`` slots (default
1) in random order, as a pool's are after churn, where ``sequential`` (the default) reads a row's tokens from
consecutive slots, a best case for DRAM locality. Bandwidth = bytes the variant must read (K and V codes, scales,
indices; fp16 for the fp16 variants) / median time; ``copy_tbps`` is a device-to-device copy (read + write) of 2 GiB,
the measured ceiling. The write kernel is timed on 1M tokens against a copy of its input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import torch
import triton
from fp16_baseline import check_against_exact_attention, decode_attention_fp16
from run_info import gpu_run_info
from torch.nn.attention import SDPBackend, sdpa_kernel

import witcert.kernels
from witcert.kernels import KVPool, decode_attention, reference
from witcert.kernels.launch import LAUNCH, LaunchConfig

Q_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
ROTATE_BYTES = 512 * 2**20


def _median_ms(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def copy_bandwidth() -> float:
    src = torch.randn(2**29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median"))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


def _rotations(bytes_per_copy: int) -> int:
    return max(1, min(512, math.ceil(ROTATE_BYTES / bytes_per_copy)))


VARIANTS = (
    "sdpa_cudnn", "fp16_kernel", "int8_nocert", "int8_cert", "triton_nocert", "triton_cert", "ws_nocert", "ws_cert",
    "ws128_nocert", "ws128_cert",
)  # fmt: skip
BASELINE_VARIANTS = ("base_nocert", "base_cert")


def load_stage1(path: Path) -> ModuleType:
    """Another version of ``kernels/gluon_decode.py`` as a module of its own (its kernels compile apart)."""
    spec = importlib.util.spec_from_file_location(f"witcert_stage1_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path} as a Python module (another version of kernels/gluon_decode.py)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_decode(
    batch: int,
    context: int,
    v_dither: bool,
    delta: float,
    names: tuple[str, ...] = VARIANTS,
    dtype: torch.dtype = torch.float16,
    baseline: ModuleType | None = None,
    resident_slots: int | None = None,
    baseline_maxnreg: int | None = None,
    shuffled_pages: int | None = None,
) -> dict:
    tokens = batch * context
    fp16_bytes = tokens * KV_HEADS * HEAD_DIM * 2 * 2
    copies = _rotations(fp16_bytes)
    generator = torch.Generator(device="cuda").manual_seed(batch * 1000003 + context)
    row: dict = {
        "batch": batch, "context": context, "rotated_copies": copies, "resident_slots": resident_slots,
        "slot_order": "sequential" if shuffled_pages is None else f"pages of {shuffled_pages} shuffled",
    }  # fmt: skip
    # Slots of the paged caches: copy i reads [i * tokens, (i + 1) * tokens), or all copies the same
    # resident_slots slots.
    slots = resident_slots or copies * tokens

    q = [torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", generator=generator).to(dtype) for _ in range(copies)]
    indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * context
    pool = KVPool(slots, 1, KV_HEADS, HEAD_DIM, v_dither=v_dither, device="cuda", dtype=dtype)
    k_cache = torch.empty(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    chunk = 2**20
    for start in range(0, slots, chunk):
        stop = min(start + chunk, slots)
        k = torch.randn(stop - start, KV_HEADS, HEAD_DIM, device="cuda", generator=generator).to(dtype)
        v = torch.randn(stop - start, KV_HEADS, HEAD_DIM, device="cuda", generator=generator).to(dtype)
        k_cache[start:stop], v_cache[start:stop] = k, v
        pool.write(0, torch.arange(start, stop, device="cuda"), k, v, validate=False)
    if resident_slots:
        indices = [torch.arange(tokens, device="cuda", dtype=torch.int32) % resident_slots] * copies
        names = tuple(name for name in names if name != "sdpa_cudnn")
    else:
        indices = [torch.arange(i * tokens, (i + 1) * tokens, device="cuda", dtype=torch.int32) for i in range(copies)]
        if shuffled_pages:
            # A pool after churn: each row's pages (runs of consecutive slots) in random order. A row keeps its own
            # slots, so SDPA's contiguous caches below still hold the same attention.
            pages = context // shuffled_pages
            order = torch.rand(batch, pages, device="cuda", generator=generator).argsort(dim=1)
            order = order[:, :, None].expand(batch, pages, shuffled_pages)
            indices = [i.view(batch, pages, shuffled_pages).gather(1, order).flatten() for i in indices]
        # SDPA's contiguous caches: [B, H_kv, S, D] views of the same values.
        k_sdpa = [k_cache[i * tokens : (i + 1) * tokens].view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
                  .contiguous() for i in range(copies)]  # fmt: skip
        v_sdpa = [v_cache[i * tokens : (i + 1) * tokens].view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
                  .contiguous() for i in range(copies)]  # fmt: skip
    out = torch.empty(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    counter = {"i": 0}

    def next_copy() -> int:
        counter["i"] = (counter["i"] + 1) % copies
        return counter["i"]

    def sdpa() -> None:
        i = next_copy()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q[i].unsqueeze(2), k_sdpa[i], v_sdpa[i], enable_gqa=True)

    def fp16_kernel() -> None:
        i = next_copy()
        decode_attention_fp16(q[i], k_cache, v_cache, indptr, indices[i], out=out)

    def int8(
        certificate: bool,
        gluon: bool,
        stage1: ModuleType | None = None,
        ws_maxnreg: int | None = None,
        maxnreg: int | None = None,
    ):
        def run() -> None:
            # Read when the graph is captured: each variant records its own stage 1 (the Gluon one at every
            # size, so that the table shows where the size threshold, LAUNCH.gluon_min_tokens, belongs).
            LAUNCH.gluon, LAUNCH.gluon_min_tokens = gluon, 0
            LAUNCH.gluon_ws = ws_maxnreg is not None
            LAUNCH.gluon_ws_maxnreg = ws_maxnreg or LaunchConfig.gluon_ws_maxnreg
            current = importlib.import_module("witcert.kernels.gluon_decode")
            caps = LAUNCH.gluon_maxnreg, LAUNCH.gluon_maxnreg_nocert
            # attention.py imports the Gluon module at each call: the baseline takes its place for this one.
            witcert.kernels.gluon_decode = stage1 or current
            if maxnreg is not None:
                LAUNCH.gluon_maxnreg = LAUNCH.gluon_maxnreg_nocert = maxnreg
            try:
                i = next_copy()
                decode_attention(q[i], pool, 0, indptr, indices[i], delta_step=delta, out=out, certificate=certificate)
            finally:
                witcert.kernels.gluon_decode = current
                LAUNCH.gluon_maxnreg, LAUNCH.gluon_maxnreg_nocert = caps

        return run

    int8_bytes = tokens * KV_HEADS * 2 * (HEAD_DIM + 2 * pool.num_groups) + tokens * 4
    for name, fn, nbytes in (
        ("sdpa_cudnn", sdpa, fp16_bytes),
        ("fp16_kernel", fp16_kernel, fp16_bytes + tokens * 4),
        ("int8_nocert", int8(False, True), int8_bytes),
        ("int8_cert", int8(True, True), int8_bytes),
        ("triton_nocert", int8(False, False), int8_bytes),
        ("triton_cert", int8(True, False), int8_bytes),
        ("base_nocert", int8(False, True, baseline, maxnreg=baseline_maxnreg), int8_bytes),
        ("base_cert", int8(True, True, baseline, maxnreg=baseline_maxnreg), int8_bytes),
        ("ws_nocert", int8(False, True, ws_maxnreg=LaunchConfig.gluon_ws_maxnreg), int8_bytes),
        ("ws_cert", int8(True, True, ws_maxnreg=LaunchConfig.gluon_ws_maxnreg), int8_bytes),
        ("ws128_nocert", int8(False, True, ws_maxnreg=128), int8_bytes),
        ("ws128_cert", int8(True, True, ws_maxnreg=128), int8_bytes),
    ):
        if name not in names or (name in BASELINE_VARIANTS and baseline is None):
            continue
        try:
            ms = _median_ms(fn)
            row[name] = {"ms": ms, "tbps": nbytes / (ms * 1e-3) / 1e12}
        except Exception as error:  # a backend refusing a shape is a result to report, not a crash
            row[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    LAUNCH.gluon, LAUNCH.gluon_min_tokens = True, LaunchConfig.gluon_min_tokens
    LAUNCH.gluon_ws, LAUNCH.gluon_ws_maxnreg = LaunchConfig.gluon_ws, LaunchConfig.gluon_ws_maxnreg
    return row


def bench_write(tokens: int = 2**20) -> dict:
    pool = KVPool(tokens, 1, KV_HEADS, HEAD_DIM, device="cuda")
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda").half()
    v = torch.randn_like(k)
    slots = torch.randperm(tokens, device="cuda")
    k_copy, v_copy = torch.empty_like(k), torch.empty_like(v)
    write_ms = float(triton.testing.do_bench(lambda: pool.write(0, slots, k, v, validate=False), rep=200,
                                             return_mode="median"))  # fmt: skip
    copy_ms = float(triton.testing.do_bench(lambda: (k_copy.copy_(k), v_copy.copy_(v)), rep=200,
                                            return_mode="median"))  # fmt: skip
    moved = 2 * tokens * KV_HEADS * (HEAD_DIM * 2 + HEAD_DIM + 2 * pool.num_groups) + tokens * 8
    copied = 2 * 2 * tokens * KV_HEADS * HEAD_DIM * 2
    return {
        "tokens": tokens,
        "write_ms": write_ms,
        "write_tbps": moved / (write_ms * 1e-3) / 1e12,
        "copy_ms": copy_ms,
        "copy_tbps": copied / (copy_ms * 1e-3) / 1e12,
        "write_over_copy_time": copy_ms / write_ms,
    }


SWEEP = [
    # The Gluon stage 1 fixes its tile (128 tokens, 4 warps): only its register caps vary (cert / nocert), and
    # with them the programs per SM that the default splits fill.
    LaunchConfig(gluon=True, gluon_maxnreg=None, gluon_maxnreg_nocert=None),
    LaunchConfig(gluon=True, gluon_maxnreg=168, gluon_maxnreg_nocert=168),
    LaunchConfig(gluon=True, gluon_maxnreg=160, gluon_maxnreg_nocert=160),
    LaunchConfig(gluon=True, gluon_maxnreg=128, gluon_maxnreg_nocert=128),
    LaunchConfig(128, 4, 2, gluon=False),
    LaunchConfig(128, 4, 1, gluon=False),
    LaunchConfig(64, 4, 1, gluon=False),
    LaunchConfig(128, 8, 1, gluon=False),
    LaunchConfig(256, 8, 1, gluon=False),
    LaunchConfig(128, 4, 2, maxnreg=168, gluon=False),
    LaunchConfig(128, 4, 1, maxnreg=168, gluon=False),
]


def sweep_launch(delta: float, stages: str) -> list[dict]:
    """Time each launch config's int8 kernel, with and without certificate, at B=32, S=16k; keep the fastest
    config of each stage 1 (Gluon: its register cap; Triton: tile, warps, stages, cap)."""
    rows = []
    for config in SWEEP:
        if stages != "both" and config.gluon != (stages == "gluon"):
            continue
        LAUNCH.__dict__.update(config.__dict__)
        names = ("int8_nocert", "int8_cert") if config.gluon else ("triton_nocert", "triton_cert")
        row = bench_decode(32, 16384, False, delta, names)
        rows.append({"config": dict(config.__dict__), **row})
        print(f"sweep {config}: " + " ".join(f"{k}={v.get('ms', float('nan')):.4f}" for k, v in row.items()
                                             if isinstance(v, dict)), flush=True)  # fmt: skip

    def fastest(gluon: bool, metric: str) -> dict | None:
        candidates = [r for r in rows if r["config"]["gluon"] == gluon]
        return min(candidates, key=lambda r: r[metric].get("ms", math.inf))["config"] if candidates else None

    if best := fastest(True, "int8_cert"):
        LAUNCH.gluon_maxnreg = best["gluon_maxnreg"]
    if best := fastest(True, "int8_nocert"):
        LAUNCH.gluon_maxnreg_nocert = best["gluon_maxnreg_nocert"]
    if best := fastest(False, "triton_cert"):
        LAUNCH.__dict__.update({k: v for k, v in best.items() if not k.startswith("gluon")})
    LAUNCH.gluon, LAUNCH.gluon_min_tokens = True, LaunchConfig.gluon_min_tokens
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--v-dither", choices=["on", "off", "both"], default="both")
    parser.add_argument(
        "--dtype", choices=["fp16", "bf16"], default="fp16", help="the model's dtype: queries and the baselines' caches"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/kernels_h200.json"))
    parser.add_argument("--baseline-stage1", type=Path, metavar="FILE", help="another version of "
                        "kernels/gluon_decode.py, timed in the same run as base_nocert / base_cert")  # fmt: skip
    parser.add_argument("--baseline-maxnreg", type=int, metavar="N", help="the base_ variants' register cap "
                        "(default: LAUNCH's); the default splits follow it")  # fmt: skip
    parser.add_argument("--sweep", choices=["gluon", "triton", "both"], help="first pick the launch config of "
                        "these stage-1 kernels (B=32, S=16k); the others keep the defaults")  # fmt: skip
    parser.add_argument("--variants", nargs="+", choices=VARIANTS + BASELINE_VARIANTS, help="time only these "
                        "(default: all; the base_ ones need --baseline-stage1)")  # fmt: skip
    parser.add_argument("--resident-slots", type=int, metavar="N", help="the paged variants read N slots over "
                        "and over, which the L2 holds (N <= about 32k): time without DRAM; no SDPA")  # fmt: skip
    parser.add_argument("--slot-order", choices=["sequential", "shuffled"], default="sequential", help="the paged "
                        "variants' slots: a row's tokens at consecutive slots, or its pages (--page-size) in random "
                        "order, as in a pool after churn")  # fmt: skip
    parser.add_argument("--page-size", type=int, default=1, help="slots per page for --slot-order shuffled "
                        "(default 1: every token at a random slot of its row's)")  # fmt: skip
    args = parser.parse_args()
    baseline = load_stage1(args.baseline_stage1) if args.baseline_stage1 else None
    names = tuple(args.variants or VARIANTS + (BASELINE_VARIANTS if baseline else ()))
    if baseline is None and set(names) & set(BASELINE_VARIANTS):
        parser.error("--variants base_nocert / base_cert need --baseline-stage1")
    if args.resident_slots is not None and args.resident_slots < 1:
        parser.error(f"--resident-slots must be at least 1, not {args.resident_slots}")
    if args.resident_slots is not None and args.slot_order == "shuffled":
        parser.error("--slot-order shuffled reads from DRAM: it does not combine with --resident-slots")
    if args.page_size < 1 or any(context % args.page_size for context in args.contexts):
        parser.error(f"--page-size must be at least 1 and divide every context, not {args.page_size}")
    if args.page_size != 1 and args.slot_order != "shuffled":
        parser.error("--page-size applies to --slot-order shuffled")
    if args.baseline_maxnreg is not None and (baseline is None or not 24 <= args.baseline_maxnreg <= 255):
        parser.error("--baseline-maxnreg needs --baseline-stage1 and a cap from 24 to 255 registers")
    delta = reference.delta_step(28, Q_HEADS)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    results = {
        "method": __doc__,
        **gpu_run_info(),
        "copy_tbps": copy_bandwidth(),
        "write": bench_write(),
        "baseline_stage1": str(args.baseline_stage1) if baseline else None,
        "baseline_maxnreg": args.baseline_maxnreg,
        "resident_slots": args.resident_slots,
        "slot_order": args.slot_order,
        "page_size": args.page_size,
        "decode": [],
    }
    if "fp16_kernel" in names:
        results["fp16_kernel_error"] = check_against_exact_attention()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        results["sweep"] = sweep_launch(delta, args.sweep)
    results["launch"] = LAUNCH.__dict__
    print(f"copy {results['copy_tbps']:.2f} TB/s; write {results['write']}", flush=True)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.v_dither]
    for v_dither in modes:
        for batch in args.batches:
            for context in args.contexts:
                row = bench_decode(
                    batch, context, v_dither, delta, names=names, dtype=dtype, baseline=baseline,
                    resident_slots=args.resident_slots, baseline_maxnreg=args.baseline_maxnreg,
                    shuffled_pages=args.page_size if args.slot_order == "shuffled" else None,
                )  # fmt: skip
                row["v_dither"] = v_dither
                row["dtype"] = args.dtype
                results["decode"].append(row)
                cells = [f"{name}={row[name].get('ms', float('nan')):.4f}ms" for name in names if name in row]
                print(f"v_dither={v_dither} B={batch} S={context}: " + " ".join(cells), flush=True)
                torch.cuda.empty_cache()
                # Rewritten after every row: a run stopped at its time limit keeps what it measured.
                args.output.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
