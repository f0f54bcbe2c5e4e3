"""Where the time of extend without the certificate goes (the SDPA path): device kernels and host functions.

For each shape (``bench_extend.py``'s ``[Bx][~]PREFIX:NEW``) it times ``extend_attention`` eagerly as the
SGLang backend calls it (offsets given on the host as an ``ExtendBounds``, no ``out``), lists the device
kernels of one call with ``torch.profiler`` (ms per call) and the host functions with ``cProfile`` over many
calls. When the eager time is well above the kernels' sum, the call is bound by host time, and the ``cProfile``
list says where. ``cProfile`` slows Python down several times, so its seconds rank functions; they are not timings.

    python bench/lab/profile_extend.py --shapes 64x0:128 8x~4096:256 --output bench/results/extend_sdpa_profile_h200.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from witcert.kernels import ExtendBounds, extend_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for bench_extend
from bench_extend import make_batch, parse_shape  # noqa: E402


def profile_shape(shape: str, calls: int) -> str:
    batch = make_batch(*parse_shape(shape))
    bounds = ExtendBounds(*batch.bounds)  # once per batch, as the SGLang backend makes it

    def run() -> None:
        extend_attention(
            batch.q, batch.pool, 0, batch.qo_indptr, batch.kv_indptr, batch.slots, delta_step=1e-8,
            certificate=False, bounds=bounds,
        )  # fmt: skip

    eager_ms = triton.testing.do_bench(run, rep=100, return_mode="median")
    with profile(activities=[ProfilerActivity.CUDA]) as device:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    kernels = sorted(
        ((event.key, event.device_time_total / calls / 1000) for event in device.key_averages()),
        key=lambda item: -item[1],
    )
    lines = [f"===== {shape}: eager {eager_ms:.4f} ms per call; device kernels, ms per call:"]
    lines += [f"  {ms:.4f}  {name[:110]}" for name, ms in kernels if ms > 0]
    host = cProfile.Profile()
    host.enable()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(14)
    lines += [f"host functions over {calls} calls (cProfile):", text.getvalue()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["16x0:512", "64x0:128", "8x~4096:256", "0:4096"])
    parser.add_argument("--calls", type=int, default=200, help="calls profiled per shape (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=Path("bench/results/extend_sdpa_profile_h200.txt"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    reports = []
    for shape in args.shapes:
        reports.append(profile_shape(shape, args.calls))
        print(reports[-1].split("\nhost functions")[0], flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n\n".join(reports) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
