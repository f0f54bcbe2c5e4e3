"""Collector CPU per 512-sample request, in process and by part, for two checkouts alternately.

A child process runs ``Pipeline`` (the collector without its HTTP server) on a fresh chDB store
and spool, ingests ``--requests`` prebuilt 512-sample requests (4 layers x 8 heads x 16 steps)
from its main thread while the drain stores them, and waits until the spool is empty. CPU is read
per thread from ``/proc/self/task``: the ingesting thread (decode, convert, spool with its fsync),
the drain thread (spool read, clickhouse-connect's encoding, the chDB insert run in that thread),
and chDB's own threads by name (merges, query pools). The parent alternates the children of this
checkout and of ``--baseline-pythonpath`` (a folder holding another checkout's ``witcert``
package) ``--repeats`` times and reports medians per request: the machine is shared, and the
alternation keeps drift from favouring either.

    python bench/lab/small_request_costs.py --baseline-pythonpath DIR [--requests 400 --repeats 4]

Results: ``bench/results/<--output>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of every thread of this process, with its name."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        found[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return found


def child(requests: int) -> dict:
    from witcert.collector import otlp
    from witcert.collector.config import CollectorConfig
    from witcert.collector.loadgen import samples_request
    from witcert.collector.pipeline import Pipeline

    with tempfile.TemporaryDirectory(prefix="witcert-lab-") as tmp:
        root = Path(tmp)
        config = CollectorConfig(
            store_url=f"chdb://{root / 'chdb'}", spool_dir=root / "spool", otlp_http=None, otlp_grpc=None
        )
        pipeline = Pipeline(config)
        pipeline.start()
        now = time.time_ns()
        bodies = [
            samples_request("lab", "lab", 4, 8, range(i * 16, (i + 1) * 16), now).SerializeToString()
            for i in range(requests + 20)
        ]
        for body in bodies[:20]:  # warm-up: the store's first inserts, the spool's first segment
            pipeline.ingest(body, otlp.PROTOBUF)
        assert pipeline.wait_stored(120)
        drain_id = next(t.native_id for t in threading.enumerate() if t.name == "witcert-drain")
        before, began = thread_cpu(), time.perf_counter()
        for body in bodies[20:]:
            pipeline.ingest(body, otlp.PROTOBUF)
        assert pipeline.wait_stored(300)
        wall = time.perf_counter() - began
        after = thread_cpu()
        pipeline.stop()
    parts: dict[str, float] = collections.Counter()
    for tid, (name, seconds) in after.items():
        spent = seconds - before.get(tid, (name, 0.0))[1]
        if tid == os.getpid():
            parts["ingesting thread"] += spent
        elif tid == drain_id:
            parts["drain thread"] += spent
        else:
            parts[f"chDB {name.rstrip('0123456789')}" if name != "python" else "other python"] += spent
    per_request = {part: round(seconds / requests * 1e3, 3) for part, seconds in sorted(parts.items()) if seconds}
    per_request["total"] = round(sum(parts.values()) / requests * 1e3, 3)
    per_request["wall"] = round(wall / requests * 1e3, 3)
    return per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--baseline-pythonpath", default=None)
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--output", default="ingest_small_requests_costs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.requests)))
        return
    # bench_ingest (bench/) alternates the checkouts; imported here, not in the child, which may run another checkout.
    sys.path.insert(0, str(RESULTS.parent))
    from bench_ingest import alternated, checkouts

    variants = checkouts(args.label, args.baseline_label, args.baseline_pythonpath)
    runs: dict[str, list[dict]] = {label: [] for label in variants}
    for repeat, label, pythonpath in alternated(variants, args.repeats):
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        command = [sys.executable, "-P", __file__, "--child", "--requests", str(args.requests)]
        output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        runs[label].append(json.loads(output.splitlines()[-1]))
        print(label, repeat, runs[label][-1], flush=True)
    medians = {
        label: {
            part: round(statistics.median(run.get(part, 0.0) for run in label_runs), 3)
            for part in sorted({part for run in label_runs for part in run})
        }
        for label, label_runs in runs.items()
    }
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/lab/small_request_costs.py " + " ".join(sys.argv[1:]),
        "unit": "ms per 512-sample request (CPU by thread, and wall)",
        "medians": medians,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.output}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()
