"""Run decode stage 1 a few times on one shape, for a profiler to sample (the timings are bench_kernels.py's).

Nsight Compute's warp-state sampling says where a kernel's warps wait, per SASS instruction, e.g.::

    ncu --clock-control none --kernel-name regex:decode_stage1 --launch-skip 4 --launch-count 1 \\
        --section WarpStateStats --section SchedulerStats --section SourceCounters -o stage1 \\
        python bench/lab/profile_decode.py --batch 32 --context 16384 --certificate on
    ncu -i stage1.ncu-rep --page source --csv --print-source sass > stage1_sass.csv

``--kernel-times`` instead times each kernel of a call on the device (PyTorch's profiler, CUPTI), with and
without the certificate, and prints one line per kernel: where the certificate's cost lies between stage 1
and stage 2 (their sum is a little below ``bench_kernels.py``'s graph replays, which include the gaps); with
``--stage2-warps 2 4`` at each of those stage-2 warp counts in turn, twice, paired in one process.

The shape is Qwen2.5-7B's (28 query heads, 4 KV heads, head_dim 128), one layer, K dithered and V
rounded to nearest, as in the benchmark. ``--stage1-file FILE`` profiles another version of
``kernels/gluon_decode.py`` (a ``bench/lab/whatif_stage1.py`` output) in its place. ``--resident-slots N`` makes
every row read the same N slots (``bench_kernels.py``'s option of that name): with N small enough for the L2, the
kernel's own instructions rather than DRAM set its pace, as on the H200.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import witcert.kernels
from witcert.kernels import KVPool, decode_attention
from witcert.kernels.launch import LAUNCH

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for bench_kernels
from bench_kernels import load_stage1  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--certificate", choices=["on", "off"], default="on")
    parser.add_argument("--stage1", choices=["gluon", "triton"], default="gluon", help="which stage 1 runs")
    parser.add_argument("--calls", type=int, default=8, help="decode calls to make (profile one past warm-up)")
    parser.add_argument("--maxnreg", type=int, help="the Gluon stage 1's register cap (0: none; default: LAUNCH's)")
    parser.add_argument("--resident-slots", type=int, metavar="N", help="every row reads slots 0..N-1 (the L2 holds "
                        "16384: 18 MB of int8 K and V)")  # fmt: skip
    parser.add_argument("--stage1-file", type=Path, metavar="FILE", help="another version of kernels/gluon_decode.py")
    parser.add_argument("--kernel-times", action="store_true",
                        help="print each kernel's median device time, with and without the certificate")  # fmt: skip
    parser.add_argument("--stage2-warps", type=int, nargs="+", metavar="W",
                        help="with --kernel-times: time the call at each of these LAUNCH.stage2_num_warps in turn, "
                        "twice, in one process (default: LAUNCH's)")  # fmt: skip
    args = parser.parse_args()
    if args.resident_slots is not None and args.resident_slots < 1:
        parser.error(f"--resident-slots must be at least 1, not {args.resident_slots}")
    if any(w not in (1, 2, 4, 8, 16) for w in args.stage2_warps or []):
        parser.error(f"--stage2-warps takes powers of two from 1 to 16, not {args.stage2_warps}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    if args.stage1_file:
        witcert.kernels.gluon_decode = load_stage1(args.stage1_file)

    tokens = args.batch * args.context
    slots = min(args.resident_slots or tokens, tokens)
    generator = torch.Generator(device="cuda").manual_seed(0)
    pool = KVPool(slots, 1, KV_HEADS, HEAD_DIM, device="cuda")
    chunk = 2**20
    for start in range(0, slots, chunk):
        stop = min(start + chunk, slots)
        k, v = torch.randn(2, stop - start, KV_HEADS, HEAD_DIM, device="cuda", generator=generator).half()
        pool.write(0, torch.arange(start, stop, device="cuda"), k, v, validate=False)
    q = torch.randn(args.batch, Q_HEADS, HEAD_DIM, device="cuda", generator=generator).half()
    indptr = torch.arange(args.batch + 1, device="cuda", dtype=torch.int32) * args.context
    indices = torch.arange(tokens, device="cuda", dtype=torch.int32) % slots
    LAUNCH.gluon, LAUNCH.gluon_min_tokens = args.stage1 == "gluon", 0
    if args.maxnreg is not None:
        LAUNCH.gluon_maxnreg = LAUNCH.gluon_maxnreg_nocert = args.maxnreg or None
    if args.kernel_times:
        warps = args.stage2_warps or [LAUNCH.stage2_num_warps]
        for stage2_warps in warps * (2 if args.stage2_warps else 1):
            LAUNCH.stage2_num_warps = stage2_warps
            if args.stage2_warps:
                print(f"stage 2 at {stage2_warps} warps")
            for certificate in (False, True):
                call = functools.partial(decode_attention, q, pool, 0, indptr, indices, delta_step=0.05,
                                         certificate=certificate)  # fmt: skip
                _print_kernel_times(call, args.calls, certificate)
        return
    for _ in range(args.calls):
        result = decode_attention(q, pool, 0, indptr, indices, delta_step=0.05, certificate=args.certificate == "on")
    torch.cuda.synchronize()
    finite = "n/a" if result.certificate is None else bool(torch.isfinite(result.certificate).all())
    print(f"stage 1: {result.path}; certificate finite: {finite}")


def kernel_times(call: Callable[[], object], calls: int) -> dict[str, list[float]]:
    """Each kernel's device times (us, CUPTI) over ``calls`` calls, after two that compile and warm up."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name, []).append(event.time_range.elapsed_us())
    return times


def _print_kernel_times(call: Callable[[], object], calls: int, certificate: bool) -> None:
    """Each kernel's median device time over ``calls`` calls."""
    times = kernel_times(call, calls)
    total = 0.0
    for name, us in sorted(times.items(), key=lambda item: -statistics.median(item[1])):
        total += statistics.median(us) * len(us) / calls
        print(f"certificate {'on ' if certificate else 'off'} {statistics.median(us):9.2f} us  x{len(us) // calls}  "
              f"{name[:90]}")  # fmt: skip
    print(f"certificate {'on ' if certificate else 'off'} {total:9.2f} us  per call")


if __name__ == "__main__":
    main()
