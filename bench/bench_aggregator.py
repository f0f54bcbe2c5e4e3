"""Cost of the certificate aggregator and its OTLP stream inside a decode step (run on a CUDA device).

Method. A decode step of a 28-layer, 28-query-head model shape (Qwen2-7B: hidden 3584, 4 KV heads of
128, MLP 18944, bf16 weights, about 13 GB) is emulated layer by layer: QKV projection, SDPA decode
attention over a KV cache, a per-head certificate stand-in written into a per-step [L, B, H] buffer,
output projection and gated MLP. Each variant is captured in its own CUDA graph, as engines run
decode:

- ``off``: no aggregator;
- ``per_layer``: ``observe(layer, ...)`` after every layer (one launch per layer);
- ``stacked``: one ``observe_layers(0, buffer)`` per step (one launch per step).

Variants are timed paired: each round replays every variant (in a rotating order) ``replays`` times
between CUDA events; overhead is the median over rounds of (variant / off - 1). The stream is then
measured on the ``per_layer`` graph with ``poll()`` after every replay and an OTLP/HTTP exporter to a
local receiver: engine-thread time per poll (host clock), step time with polling vs without (paired),
and the background thread's CPU time per batch. Eager (no graph) per-layer observe is timed the same
way, since an engine without graphs also pays the Python launch.

Usage: ``python bench/bench_aggregator.py --out bench/results/aggregator_h200.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from witcert.integrations.telemetry import CertificateAggregator
from witcert.integrations.telemetry.exporter import EngineIdentity, TelemetryStream, otlp_http_exporter

TAU = 0.05


class CountingReceiver:
    """A local OTLP/HTTP endpoint that accepts and counts bytes (the collector's cost is not measured here)."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests += 1
                receiver.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metrics"


class DecodeStep:
    """One decode step of a dense GQA transformer with static buffers (graph-capturable)."""

    def __init__(self, args: argparse.Namespace, batch: int) -> None:
        self.args = args
        hidden, kv_dim = args.hidden, args.kv_heads * args.head_dim
        weight = dict(device="cuda", dtype=torch.bfloat16)
        scale = hidden**-0.5
        self.layers = [
            (
                torch.randn(hidden, hidden + 2 * kv_dim, **weight) * scale,
                torch.randn(hidden, hidden, **weight) * scale,
                torch.randn(hidden, 2 * args.intermediate, **weight) * scale,
                torch.randn(args.intermediate, hidden, **weight) * args.intermediate**-0.5,
                torch.randn(batch, args.kv_heads, args.context, args.head_dim, **weight),
                torch.randn(batch, args.kv_heads, args.context, args.head_dim, **weight),
            )
            for _ in range(args.layers)
        ]
        self.x = torch.randn(batch, hidden, **weight)
        self.certificates = torch.zeros(args.layers, batch, args.heads, device="cuda")
        self.batch = batch

    def run(self, aggregator: CertificateAggregator | None, stacked: bool) -> torch.Tensor:
        args, batch = self.args, self.batch
        x = self.x
        for layer, (w_qkv, w_o, w_gate_up, w_down, k_cache, v_cache) in enumerate(self.layers):
            # GQA decode as SDPA over [B, H_kv, group, D] queries: one fused kernel, no K/V repetition.
            group = args.heads // args.kv_heads
            q = (x @ w_qkv)[:, : args.hidden].reshape(batch, args.kv_heads, group, args.head_dim)
            attention = F.scaled_dot_product_attention(q, k_cache, v_cache)
            # Stand-in for the kernel's certificate: one small reduction writing [B, H] into the step buffer.
            torch.amax(
                attention.float().abs().view(batch, args.heads, args.head_dim), dim=2, out=self.certificates[layer]
            )
            if aggregator is not None and not stacked:
                aggregator.observe(layer, self.certificates[layer])
            x = x + attention.reshape(batch, args.hidden) @ w_o
            gate, up = (x @ w_gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w_down
        if aggregator is not None and stacked:
            aggregator.observe_layers(0, self.certificates)
        return x


def capture(step: DecodeStep, aggregator: CertificateAggregator | None, stacked: bool) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = None if aggregator is None else new_aggregator(step.args)
        step.run(warm, stacked)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(aggregator, stacked)
    return graph


def new_aggregator(args: argparse.Namespace) -> CertificateAggregator:
    return CertificateAggregator(args.layers, args.heads, tau=TAU, stride=args.stride, device="cuda")


def timed_ms(run, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def paired(variants: dict[str, callable], rounds: int, replays: int) -> dict[str, dict[str, float]]:
    """Median step time per variant and the median over rounds of its ratio to ``off`` minus one."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        timed_ms(variants[name], replays)
    for round_index in range(rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            times[name].append(timed_ms(variants[name], replays))
    result = {}
    for name in names:
        ratios = [t / o - 1.0 for t, o in zip(times[name], times["off"], strict=True)]
        result[name] = {
            "step_ms_median": statistics.median(times[name]),
            "step_ms_min": min(times[name]),
            "overhead_median": statistics.median(ratios),
            "overhead_p25": statistics.quantiles(ratios, n=4)[0],
            "overhead_p75": statistics.quantiles(ratios, n=4)[2],
        }
    return result


def kernel_only_us(args: argparse.Namespace, batch: int, stacked: bool) -> float:
    """Device time of the aggregator alone for one step (its graph replayed back to back)."""
    aggregator = new_aggregator(args)
    certificates = torch.rand(args.layers, batch, args.heads, device="cuda")

    def step(target: CertificateAggregator) -> None:
        if stacked:
            target.observe_layers(0, certificates)
        else:
            for layer in range(args.layers):
                target.observe(layer, certificates[layer])

    step(new_aggregator(args))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(aggregator)
    timed_ms(graph.replay, 50)
    return statistics.median(timed_ms(graph.replay, 200) for _ in range(5)) * 1000


def stream_cost(args: argparse.Namespace, step: DecodeStep) -> dict[str, float]:
    aggregator = new_aggregator(args)
    graph = capture(step, aggregator, stacked=False)
    receiver = CountingReceiver()
    stream = TelemetryStream(
        aggregator,
        otlp_http_exporter(receiver.endpoint),
        EngineIdentity(model="qwen2-7b-shape", engine="bench"),
        flush_steps=args.flush_steps,
        flush_seconds=3600.0,
    )
    poll_us: list[float] = []
    flush_poll_us: list[float] = []

    def replay_and_poll() -> None:
        graph.replay()
        started = stream.stats.flushes_started
        t0 = time.perf_counter()
        stream.poll()
        (flush_poll_us if stream.stats.flushes_started > started else poll_us).append((time.perf_counter() - t0) * 1e6)

    timing = paired({"off": graph.replay, "polled": replay_and_poll}, args.rounds, args.flush_steps)
    stream.close()
    stats = stream.stats
    return {
        "flush_steps": args.flush_steps,
        "step_ms_without_poll": timing["off"]["step_ms_median"],
        "step_ms_with_poll": timing["polled"]["step_ms_median"],
        "poll_overhead_median": timing["polled"]["overhead_median"],
        "poll_us_median": statistics.median(poll_us),
        "poll_us_max": max(poll_us),
        "flush_poll_us_median": statistics.median(flush_poll_us),
        "flush_poll_us_max": max(flush_poll_us),
        "batches": stats.batches_built,
        "points_per_batch": stats.points_built / max(stats.batches_built, 1),
        "bytes_per_request": receiver.bytes / max(receiver.requests, 1),
        "thread_build_cpu_ms_per_batch": 1e3 * stats.build_cpu_seconds / max(stats.batches_built, 1),
        "thread_export_cpu_ms_per_batch": 1e3 * stats.export_cpu_seconds / max(stats.batches_exported, 1),
        "thread_build_wall_ms_median": 1e3 * statistics.median(stats.build_wall_seconds),
        "points_dropped": stats.points_dropped,
        "flushes_skipped": stats.flushes_skipped,
    }


def thread_cost(args: argparse.Namespace) -> dict[str, float]:
    """Background-thread CPU per batch, split by part, on whatever CPU runs this (no GPU needed).

    The aggregator runs on the CPU here; only the host-side work of one flush is timed: the SDK
    counters (add + collect), the hand-built histogram and raw-sample points, and the exporter's
    protobuf encoding (``encode_metrics``; the HTTP post and gzip are left out).
    """
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    aggregator = CertificateAggregator(args.layers, args.heads, tau=TAU, stride=args.stride, device="cpu")
    stream = TelemetryStream(
        aggregator,
        otlp_http_exporter("http://127.0.0.1:9/v1/metrics"),
        EngineIdentity(model="qwen2-7b-shape", engine="bench"),
        flush_steps=10**9,
        flush_seconds=1e9,
    )
    generator = torch.Generator().manual_seed(0)
    parts: dict[str, list[float]] = {"histogram_ms": [], "raw_samples_ms": [], "build_ms": [], "encode_ms": []}
    points: list[int] = []
    raw_points: list[int] = []
    for _ in range(args.thread_batches):
        certificates = torch.rand(args.layers, 8, args.heads, generator=generator) ** 6
        for _ in range(args.flush_steps):
            aggregator.observe_layers(0, certificates)
        snapshot = stream._decode(aggregator.state.numpy())
        now = time.time_ns()
        started = time.thread_time()
        stream._histogram_metric(snapshot, stream._previous, now)
        parts["histogram_ms"].append(1e3 * (time.thread_time() - started))
        started = time.thread_time()
        stream._raw_sample_metric(snapshot, now)
        parts["raw_samples_ms"].append(1e3 * (time.thread_time() - started))
        started = time.thread_time()
        batch = stream._build(snapshot, now)
        parts["build_ms"].append(1e3 * (time.thread_time() - started))
        started = time.thread_time()
        encode_metrics(batch.data).SerializeToString()
        parts["encode_ms"].append(1e3 * (time.thread_time() - started))
        points.append(batch.points)
        raw_points.append(int((~np.isnan(snapshot.raw_value)).sum()))
    stream.close(timeout_s=0.1)
    result = {name: statistics.median(values) for name, values in parts.items()}
    result["counters_ms"] = result["build_ms"] - result["histogram_ms"] - result["raw_samples_ms"]
    result.update(points_per_batch=statistics.median(points), raw_points_per_batch=statistics.median(raw_points))
    result["us_per_point_build_and_encode"] = (
        1e3 * (result["build_ms"] + result["encode_ms"]) / result["points_per_batch"]
    )
    return result


def measure_batch(args: argparse.Namespace, batch: int) -> dict:
    step = DecodeStep(args, batch)
    graphs = {
        "off": capture(step, None, stacked=False),
        "per_layer": capture(step, new_aggregator(args), stacked=False),
        "stacked": capture(step, new_aggregator(args), stacked=True),
    }
    graphed = paired({name: graph.replay for name, graph in graphs.items()}, args.rounds, args.replays)
    eager_aggregator = new_aggregator(args)
    eager = paired(
        {"off": lambda: step.run(None, False), "per_layer": lambda: step.run(eager_aggregator, False)},
        max(args.rounds // 3, 4),
        args.replays,
    )
    return {
        "batch": batch,
        "graph": graphed,
        "eager": eager,
        "aggregator_only_us_per_step": {
            "per_layer": kernel_only_us(args, batch, stacked=False),
            "stacked": kernel_only_us(args, batch, stacked=True),
        },
        "stream": stream_cost(args, step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results file (JSON)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--intermediate", type=int, default=18944)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--stride", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--flush-steps", type=int, default=64)
    parser.add_argument(
        "--thread-cost-only", action="store_true", help="only the background thread's CPU per batch (runs on CPU)"
    )
    parser.add_argument("--thread-batches", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.thread_cost_only:
        result = {"method": thread_cost.__doc__, "config": {k: v for k, v in vars(args).items() if k != "out"}}
        result["cost"] = thread_cost(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result["cost"], indent=2))
        return
    results = {
        "method": __doc__,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": [],
    }
    for batch in (int(b) for b in args.batches.split(",")):
        results["runs"].append(measure_batch(args, batch))
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))

    print("| batch | mode | step ms (off) | step ms (on) | overhead (median [p25, p75]) | aggregator alone us/step |")
    print("|---|---|---|---|---|---|")
    for run in results["runs"]:
        for mode_name, timing, alone in (
            ("graph per_layer", run["graph"]["per_layer"], run["aggregator_only_us_per_step"]["per_layer"]),
            ("graph stacked", run["graph"]["stacked"], run["aggregator_only_us_per_step"]["stacked"]),
            ("eager per_layer", run["eager"]["per_layer"], None),
        ):
            off = run["eager" if mode_name.startswith("eager") else "graph"]["off"]["step_ms_median"]
            print(
                f"| {run['batch']} | {mode_name} | {off:.3f} | {timing['step_ms_median']:.3f} | "
                f"{100 * timing['overhead_median']:+.2f}% [{100 * timing['overhead_p25']:+.2f}, "
                f"{100 * timing['overhead_p75']:+.2f}] | {'' if alone is None else f'{alone:.1f}'} |"
            )
    for run in results["runs"]:
        s = run["stream"]
        print(
            f"stream B={run['batch']}: poll {s['poll_us_median']:.1f} us (max {s['poll_us_max']:.0f}), flush poll "
            f"{s['flush_poll_us_median']:.0f} us (max {s['flush_poll_us_max']:.0f}), step overhead "
            f"{100 * s['poll_overhead_median']:+.2f}%, thread CPU {s['thread_build_cpu_ms_per_batch']:.1f} ms build + "
            f"{s['thread_export_cpu_ms_per_batch']:.1f} ms export per batch of {s['points_per_batch']:.0f} points "
            f"({s['bytes_per_request'] / 1024:.0f} KiB), dropped {s['points_dropped']}"
        )


if __name__ == "__main__":
    main()
