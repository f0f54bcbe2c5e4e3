"""Sustained ingest into chDB through a real ``witcert collector`` process.

Method: the collector runs as its own process (fresh chDB store and spool, OTLP/HTTP only); this
process is the load. Three loads, one after the other on the same collector, each for ``--seconds``:

- ``replay``: ``--clients`` threads POST prebuilt protobuf requests (the engine's sample shape:
  one gauge point per layer x head x step, ``--layers`` x ``--heads`` x ``--steps`` per request),
  each a fresh body (distinct steps), over keep-alive connections;
- ``sdk``: the opentelemetry-sdk OTLP/HTTP exporter exports hand-built ``MetricsData`` of the same
  shape (how the engine side sends samples), one exporter per client process (the SDK encodes
  each point in Python: threads of one process would measure the client's GIL);
- ``replay_small``: as ``replay`` with requests of 4 layers x 8 heads x 16 steps (512 samples, the
  reliability tests' stream): what a collector does per request rather than per sample.

Rates count certificate samples *stored*: from the first request to the moment the collector's
spool is empty again (``/readyz``), so a drain that falls behind lowers the figure. Latency is per
request, client side (includes the fsync before the acknowledgement). CPU is counted on both sides
per stored sample: the collector process (all its threads, chDB included) and the clients (the
replay threads' process; the SDK processes from building each request's points to the exporter's
answer), and the collector's cores in use over the load (its CPU seconds over the seconds from the
first request to the drained spool): on a 2-core machine a side near a whole core, or both sides
summing to the cores there are, is the bottleneck. Bytes on disk per million
samples are read from ``system.parts`` after ``OPTIMIZE ... FINAL`` (log-normal certificate values,
one +inf in 997, 50 steps/s, 32 layers x 32 heads), for the typed samples table
and, for comparison, for the same samples inserted as raw exporter-format rows into
``otel_metrics_gauge`` (with the insert time of each path): the measurement behind sending samples
straight to the typed table. The collector's RSS: ``VmRSS`` once it listens (idle, store open) and
``VmHWM`` after the loads (peak).

``--skip-replay`` and ``--skip-sdk`` leave those loads out (``--small-prebuilt 0`` the small one).
``--repeats N`` runs everything N times on fresh collectors and reports medians (the machine may be
shared). ``--baseline-pythonpath DIR`` interleaves each repeat with a second collector whose
``witcert`` package is imported from DIR (another checkout: ``git worktree add``, then a folder
holding a ``witcert`` package built from it), labelled ``--baseline-label``: the same loads, the
same machine, the same minutes. Results: ``bench/results/<--output>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from witcert.collector.loadgen import OtlpHttpClient, samples_request
from witcert.integrations.telemetry import schema as ts

RESULTS = Path(__file__).parent / "results"


def start_collector(root: Path, pythonpath: str | None = None) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-P", "-m", "witcert.cli", "collector", "--store", f"chdb://{root / 'chdb'}"]
    command += ["--spool", str(root / "spool"), "--otlp-http", "127.0.0.1:0", "--no-grpc", "--log-level", "WARNING"]
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    for line in process.stdout:
        match = re.search(r"OTLP/HTTP [\d.]+:(\d+)", line)
        if match:
            return process, int(match.group(1))
    raise RuntimeError("the collector did not start")


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """The process's peak (``VmHWM``) or current (``VmRSS``) resident memory."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no {field} for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def readiness(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=30) as response:
        return json.loads(response.read())


def wait_drained(port: int) -> float:
    while readiness(port)["spool_bytes"]:
        time.sleep(0.05)
    return time.perf_counter()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Load:
    """Shared state of one load: next request index, latencies, acknowledged points."""

    def __init__(self, points_per_request: int) -> None:
        self.points_per_request = points_per_request
        self.lock = threading.Lock()
        self.next_index = 0
        self.latencies: list[float] = []
        self.acked_points = 0
        self.refused = 0
        self.client_cpu_s = 0.0

    def take(self) -> int:
        with self.lock:
            self.next_index += 1
            return self.next_index - 1

    def record(self, latency: float, ok: bool) -> None:
        with self.lock:
            self.latencies.append(latency)
            if ok:
                self.acked_points += self.points_per_request
            else:
                self.refused += 1


def run_replay(port: int, pid: int, args: argparse.Namespace, model: str, layers: int, heads: int, count: int) -> dict:
    steps = args.steps
    # Prebuilt before the clock starts: request i carries steps [i*steps, (i+1)*steps).
    bodies = [
        samples_request(
            model, "bench", layers, heads, range(i * steps, (i + 1) * steps), time.time_ns()
        ).SerializeToString()
        for i in range(count)
    ]
    load = Load(layers * heads * steps)

    def client(deadline: float) -> None:
        connection = OtlpHttpClient("127.0.0.1", port)
        while time.perf_counter() < deadline:
            index = load.take()
            if index >= count:
                break
            began = time.perf_counter()
            reply = connection.post(bodies[index], compress=args.gzip)
            load.record(time.perf_counter() - began, reply.status == 200)
            if reply.status != 200:
                time.sleep(float(reply.headers.get("retry-after", "1")))
        connection.close()

    return drive(
        port,
        pid,
        load,
        client,
        args,
        bytes_per_request=statistics.mean(len(b) for b in bodies[:10]),
        client_cpu=time.process_time,
    )


def sdk_client(
    port: int,
    layers: int,
    heads: int,
    steps: int,
    gzip: bool,
    model: str,
    first: int,
    stride: int,
    start_at: float,
    seconds: float,
) -> tuple[list[float], int, int, float]:
    """One SDK client process: build a request's points (the engine's cost, not in the latency),
    export it with the opentelemetry-sdk OTLP/HTTP exporter, repeat until ``seconds`` after
    ``start_at``. Returns request latencies, acknowledged points, refused requests and the process's
    CPU seconds over the loop."""
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import (
        Gauge,
        Metric,
        MetricExportResult,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    resource = Resource({ts.RESOURCE_SERVICE_NAME: "bench", ts.RESOURCE_INSTANCE: "sdk", ts.RESOURCE_MODEL: model})
    scope = InstrumentationScope(ts.INSTRUMENTATION_SCOPE)
    exporter = OTLPMetricExporter(
        endpoint=f"http://127.0.0.1:{port}/v1/metrics",
        compression=Compression.Gzip if gzip else Compression.NoCompression,
    )
    latencies: list[float] = []
    acked = refused = 0
    time.sleep(max(0.0, start_at - time.time()))
    deadline = time.perf_counter() + seconds
    cpu_before = time.process_time()
    index = first
    while time.perf_counter() < deadline:
        now = time.time_ns()
        points = [
            NumberDataPoint(
                attributes={ts.ATTR_LAYER: layer, ts.ATTR_HEAD: head, ts.ATTR_STEP: step},
                start_time_unix_nano=0,
                time_unix_nano=now,
                value=((layer + head + step) % 100) / 1000,
            )
            for step in range(index * steps, (index + 1) * steps)
            for layer in range(layers)
            for head in range(heads)
        ]
        metric = Metric(ts.CERTIFICATE_SAMPLE, "", "1", Gauge(points))
        data = MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, [metric], None)], None)])
        began = time.perf_counter()
        result = exporter.export(data)
        latencies.append(time.perf_counter() - began)
        if result is MetricExportResult.SUCCESS:
            acked += len(points)
        else:
            refused += 1
        index += stride
    cpu = time.process_time() - cpu_before
    exporter.shutdown()
    return latencies, acked, refused, cpu


def run_sdk(port: int, pid: int, args: argparse.Namespace, model: str) -> dict:
    """``--clients`` SDK client processes: the SDK encodes every point in Python, so client threads
    of one process would measure the client's GIL, not the collector."""
    import multiprocessing

    load = Load(args.layers * args.heads * args.steps)
    start_at = time.time() + 5.0  # the processes import the SDK first
    with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
        pending = pool.starmap_async(
            sdk_client,
            [
                (port, args.layers, args.heads, args.steps, args.gzip, model, i, args.clients, start_at, args.seconds)
                for i in range(args.clients)
            ],
        )
        time.sleep(max(0.0, start_at - time.time()))

        def clients(_deadline: float) -> None:
            for latencies, acked, refused, cpu in pending.get():
                load.latencies.extend(latencies)
                load.acked_points += acked
                load.refused += refused
                load.client_cpu_s += cpu

        return drive(port, pid, load, clients, args, bytes_per_request=None, threads=1)


def drive(
    port: int,
    pid: int,
    load: Load,
    client,
    args: argparse.Namespace,
    bytes_per_request: float | None,
    threads: int | None = None,
    client_cpu=None,
) -> dict:
    """Run ``client`` on ``threads`` threads (``--clients`` by default) until the deadline, wait for
    the spool to drain, and measure. ``client_cpu``: a clock of the clients' CPU seconds when they are
    this process's threads; otherwise the clients add theirs to ``load.client_cpu_s``."""
    before = readiness(port)["counters"]["stored_points"]
    cpu_before = cpu_seconds(pid)
    client_cpu_before = client_cpu() if client_cpu else 0.0
    load_average = os.getloadavg()[0]
    started = time.perf_counter()
    deadline = started + args.seconds
    workers = [threading.Thread(target=client, args=(deadline,)) for _ in range(threads or args.clients)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    sent_until = time.perf_counter()
    if client_cpu:
        load.client_cpu_s = client_cpu() - client_cpu_before
    drained = wait_drained(port)
    stored = readiness(port)["counters"]["stored_points"] - before
    collector_cpu = cpu_seconds(pid) - cpu_before
    return {
        "load_average_1m_at_start": round(load_average, 2),
        # Collector CPU (all its threads, chDB included) per stored sample: what one core sustains
        # without contention is about 1e6 / this.
        "collector_cpu_us_per_point": round(collector_cpu / max(stored, 1) * 1e6, 2),
        "collector_cores": round(collector_cpu / (drained - started), 2),
        "client_cpu_us_per_point": round(load.client_cpu_s / max(load.acked_points, 1) * 1e6, 2),
        "requests": len(load.latencies),
        "refused_requests": load.refused,
        "points_per_request": load.points_per_request,
        "request_bytes": bytes_per_request,
        "acked_points": load.acked_points,
        "stored_points": stored,
        "send_seconds": round(sent_until - started, 3),
        "drain_tail_seconds": round(drained - sent_until, 3),
        "acked_points_per_s": round(load.acked_points / (sent_until - started)),
        "stored_points_per_s": round(stored / (drained - started)),
        "latency_p50_ms": round(1000 * percentile(load.latencies, 0.5), 2),
        "latency_p99_ms": round(1000 * percentile(load.latencies, 0.99), 2),
    }


def disk_usage(root: Path, samples: int) -> dict:
    """Typed rows vs raw exporter rows for the same samples: insert time and bytes on disk."""
    from witcert.collector import otlp, tables
    from witcert.collector.config import Limits
    from witcert.collector.store import Store

    store = Store(f"chdb://{root / 'disk'}")
    try:
        per_request = 32 * 32 * 16
        typed_s = raw_s = 0.0
        rng = random.Random(20261202)
        start_ns = time.time_ns()
        for index in range(max(1, samples // per_request)):
            steps = range(index * 16, index * 16 + 16)
            request = samples_request("m", "disk", 32, 32, steps, start_ns, inf_every=997, rng=rng)
            typed = otlp.convert_request(request, Limits()).rows.columns[tables.CERTIFICATE_SAMPLES]
            began = time.perf_counter()
            store.insert_columns(tables.CERTIFICATE_SAMPLES, typed, token=f"typed-{index}")
            typed_s += time.perf_counter() - began
            request.resource_metrics[0].scope_metrics[0].metrics[0].name = "bench.raw.sample"
            raw = otlp.convert_request(request, Limits()).rows.columns[tables.GAUGE]
            began = time.perf_counter()
            store.insert_columns(tables.GAUGE, raw, token=f"raw-{index}")
            raw_s += time.perf_counter() - began
        result = {}
        for table, seconds in ((tables.CERTIFICATE_SAMPLES, typed_s), (tables.GAUGE, raw_s)):
            store.command(f"OPTIMIZE TABLE {table} FINAL")
            _, rows = store.query(
                "SELECT sum(rows), sum(bytes_on_disk) FROM system.parts WHERE active AND table = {t:String}",
                {"t": table},
            )
            row_count, size = rows[0]
            result[table] = {
                "rows": row_count,
                "bytes_per_million": round(size / row_count * 1e6),
                "insert_us_per_row": round(seconds / row_count * 1e6, 2),
            }
        return result
    finally:
        store.close()


LOADS = ("replay", "sdk", "replay_small")
MEASURES = (
    ("stored_points_per_s", "stored samples/s"),
    ("latency_p50_ms", "p50 ms"),
    ("latency_p99_ms", "p99 ms"),
    ("refused_requests", "refused"),
    ("collector_cpu_us_per_point", "collector CPU us/sample"),
    ("collector_cores", "collector cores busy"),
    ("client_cpu_us_per_point", "client CPU us/sample"),
    ("idle_rss_mib", "collector idle RSS MiB"),
    ("peak_rss_mib", "collector peak RSS MiB"),
)


def run_collector(args: argparse.Namespace, pythonpath: str | None) -> dict:
    """The loads on one fresh collector; its idle and peak RSS."""
    with tempfile.TemporaryDirectory(prefix="witcert-bench-") as tmp:
        process, port = start_collector(Path(tmp), pythonpath)
        try:
            idle = rss_mib(process.pid, "VmRSS")
            result = {}
            if not args.skip_replay:
                result["replay"] = run_replay(port, process.pid, args, "replay", args.layers, args.heads, args.prebuilt)
            if not args.skip_sdk:
                result["sdk"] = run_sdk(port, process.pid, args, "sdk")
            if args.small_prebuilt:
                result["replay_small"] = run_replay(port, process.pid, args, "small", 4, 8, args.small_prebuilt)
            rss = rss_mib(process.pid)
            for load in result.values():
                load["idle_rss_mib"] = idle
                load["peak_rss_mib"] = rss
        finally:
            process.terminate()
            process.wait(timeout=120)
    return result


def medians(runs: list[dict]) -> dict:
    return {
        load: {key: statistics.median(run[load][key] for run in runs) for key, _ in MEASURES}
        for load in LOADS
        if all(load in run for run in runs)
    }


def markdown(report: dict) -> str:
    lines = [
        "# Ingest benchmark",
        "",
        f"{report['when']} on {report['machine']}; command: `{report['command']}`.",
        f"Medians of {report['parameters']['repeats']} interleaved repeats; 1-minute load average at the start of "
        f"each load: {report['load_averages']}.",
        "",
        "| collector | load | " + " | ".join(label for _, label in MEASURES) + " |",
        "|---|---|" + "---|" * len(MEASURES),
    ]
    for variant, figures in report["medians"].items():
        for load, values in figures.items():
            cells = " | ".join(
                f"{round(values[key]):,}" if key == "stored_points_per_s" else f"{round(values[key], 2):g}"
                for key, _ in MEASURES
            )
            lines.append(f"| {variant} | {load} | {cells} |")
    if "disk" in report:
        lines += ["", "| table | rows | bytes on disk per million samples | insert us/row |", "|---|---|---|---|"]
        for table, usage in report["disk"].items():
            lines.append(
                f"| {table} | {usage['rows']:,} | {usage['bytes_per_million']:,} | {usage['insert_us_per_row']} |"
            )
    lines += ["", "Method: see the docstring of bench/bench_ingest.py.", ""]
    return "\n".join(lines)


def checkouts(label: str, baseline_label: str, baseline_pythonpath: str | None) -> dict[str, str | None]:
    """The variants to time: label -> PYTHONPATH (None: this checkout), the baseline first where one is given."""
    variants: dict[str, str | None] = {label: None}
    if baseline_pythonpath:
        variants = {baseline_label: baseline_pythonpath, **variants}
    return variants


def alternated(variants: dict[str, str | None], repeats: int) -> Iterator[tuple[int, str, str | None]]:
    """``(repeat, label, pythonpath)`` over ``repeats`` rounds of ``variants``, every other round in reverse
    order, so that neither variant always runs first."""
    for repeat in range(repeats):
        order = list(variants.items())
        if repeat % 2:
            order.reverse()
        for label, pythonpath in order:
            yield repeat, label, pythonpath


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="duration of each load")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per request")
    parser.add_argument("--prebuilt", type=int, default=300, help="replay requests built before the clock starts")
    parser.add_argument("--gzip", action="store_true", help="gzip request bodies")
    parser.add_argument("--repeats", type=int, default=1, help="fresh collectors per variant; medians reported")
    parser.add_argument("--baseline-pythonpath", default=None, help="PYTHONPATH of a baseline collector to interleave")
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument("--label", default="this checkout", help="name of this checkout's collector in the table")
    parser.add_argument("--disk-samples", type=int, default=1_000_000, help="0: skip the disk measurement")
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--skip-sdk", action="store_true")
    parser.add_argument(
        "--small-prebuilt", type=int, default=6000, help="replay_small requests built before its clock starts (0: skip)"
    )
    parser.add_argument("--output", default="ingest", help="results file stem under bench/results/")
    args = parser.parse_args()

    report: dict = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
        "command": "python bench/bench_ingest.py " + " ".join(sys.argv[1:]),
        "parameters": vars(args),
    }
    variants = checkouts(args.label, args.baseline_label, args.baseline_pythonpath)
    runs: dict[str, list[dict]] = {label: [] for label in variants}
    for repeat, label, pythonpath in alternated(variants, args.repeats):
        result = run_collector(args, pythonpath)
        runs[label].append(result)
        print(label, repeat, json.dumps(result), flush=True)
    report["runs"] = runs
    report["load_averages"] = sorted(
        run[load]["load_average_1m_at_start"] for label in runs for run in runs[label] for load in run
    )
    report["medians"] = {label: medians(label_runs) for label, label_runs in runs.items()}
    if args.disk_samples:
        with tempfile.TemporaryDirectory(prefix="witcert-bench-") as tmp:
            report["disk"] = disk_usage(Path(tmp), args.disk_samples)
        print("disk", report["disk"], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.output}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{args.output}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
