"""The built-in page's API and ``witcert report`` on a day of one 28-layer, 28-head engine at stride 32.

Method: a fresh chDB store with the collector's schema gets one day of one engine's rows generated
inside ClickHouse (``INSERT ... SELECT FROM numbers()``, not through OTLP: this measures reading):
``--steps-per-second`` decode steps (default 30) of which every 32nd is sampled, so 784 raw samples
per sampled step in ``witcert_certificate_samples`` (about 63.5 million rows a day at the default);
the counter rollups (every cell, every minute and hour; certificates of 8 batch rows a step), the
histogram rollups (5 non-empty buckets per cell and bucket), and the raw gauge points of a 10-second
flush (tau and export lag). Then every page API answer (``/api/layout`` and ``/api/panels/KEY``,
through ``DashboardPage`` with a 1000-point chart over the whole day, every variable at "All") runs
once to warm up and ``--repeats`` times, median reported, with tau at the engine's (exact) and at a
what-if value; and ``witcert report``'s generation (every panel, HTML written) likewise.
Results: ``bench/results/page_day_28x28.{json,md}``.

    python bench/bench_page.py [--steps-per-second 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from witcert.collector import tables
from witcert.collector.store import Store
from witcert.dashboards.page import DashboardPage
from witcert.dashboards.panels import PANELS
from witcert.dashboards.report import ReportRequest, write_report
from witcert.integrations.telemetry import schema

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = HEADS = 28
CELLS = LAYERS * HEADS
STRIDE, BATCH, TAU = 32, 8, 0.05
MODEL, INSTANCE = "bench-28x28", "bench-engine"
BOUNDS = (1e-3, 0.01, 0.03162277660168379, 0.05623413251903491, 0.1)


def fill(store: Store, end: int, steps_per_second: float) -> dict[str, int]:
    """One day ending at ``end`` (unix seconds); returns the rows written per table."""
    start = end - 86400
    cell = f"'{MODEL}' AS Model, '{INSTANCE}' AS Instance, toUInt16(0) AS TpRank"
    sampled_per_day = int(86400 * steps_per_second / STRIDE)
    sizes = {}
    # Raw samples: one per cell and sampled step; values spread over 1e-4 .. 0.1, one in 100,003 +inf.
    store.command(
        f"INSERT INTO {tables.CERTIFICATE_SAMPLES} SELECT "
        f"toDateTime64({start}, 9, 'UTC') + toIntervalNanosecond(toUInt64(intDiv(number, {CELLS}) * "
        f"{1e9 * STRIDE / steps_per_second:.0f})) AS Timestamp, 'witcert-engine' AS ServiceName, '{INSTANCE}' AS "
        f"Instance, '{MODEL}' AS Model, 'bench' AS Engine, toUInt16(0) AS TpRank, "
        f"toUInt16(intDiv(number % {CELLS}, {HEADS})) AS Layer, toUInt16(number % {HEADS}) AS Head, "
        f"intDiv(number, {CELLS}) * {STRIDE} AS Step, "
        f"if(number % 100003 = 0, inf, exp(-9.2 + 6.9 * (cityHash64(number) % 1000000) / 1e6)) AS Value "
        f"FROM numbers({sampled_per_day * CELLS})"
    )
    sizes[tables.CERTIFICATE_SAMPLES] = sampled_per_day * CELLS
    per_minute = int(60 * steps_per_second * BATCH)
    for table, step_s in ((tables.COUNTS_1M, 60), (tables.COUNTS_1H, 3600)):
        buckets = 86400 // step_s
        certificates = per_minute * step_s // 60
        store.command(
            f"INSERT INTO {table} SELECT toDateTime({start} + {step_s} * intDiv(number, {CELLS})) AS Bucket, {cell}, "
            f"toUInt16(intDiv(number % {CELLS}, {HEADS})) AS Layer, toUInt16(number % {HEADS}) AS Head, "
            f"{certificates} AS Certificates, {certificates} - number % 13 AS Covered, number % 3 AS Vacuous, "
            "toUInt64(number % 97 = 0) AS Infinite, 0 AS NaNs, number % 13 AS Fallbacks, "
            "4096 * (number % 13) AS RepairedBytes, 0 AS Steps, 0 AS Dropped "
            f"FROM numbers({buckets * CELLS})"
        )
        sizes[table] = buckets * CELLS
    bounds = "[" + ", ".join(map(repr, BOUNDS)) + "]"
    per = CELLS * len(BOUNDS)
    for table, step_s in ((tables.BUCKETS_1M, 60), (tables.BUCKETS_1H, 3600)):
        buckets = 86400 // step_s
        store.command(
            f"INSERT INTO {table} SELECT toDateTime({start} + {step_s} * intDiv(number, {per})) AS Bucket, {cell}, "
            f"toUInt16(intDiv(intDiv(number, {len(BOUNDS)}) % {CELLS}, {HEADS})) AS Layer, "
            f"toUInt16(intDiv(number, {len(BOUNDS)}) % {HEADS}) AS Head, "
            f"arrayElement({bounds}, number % {len(BOUNDS)} + 1) AS UpperBound, 1 + number % 7 AS Count "
            f"FROM numbers({buckets * per})"
        )
        sizes[table] = buckets * per
    flushes = 86400 // 10
    attributes = f"map('{schema.RESOURCE_MODEL}', '{MODEL}', '{schema.RESOURCE_INSTANCE}', '{INSTANCE}')"
    store.command(
        f"INSERT INTO {tables.GAUGE} (ResourceAttributes, ServiceName, MetricName, TimeUnix, Value) SELECT "
        f"{attributes}, 'witcert-engine', if(number % 2 = 0, '{schema.TAU}', '{schema.EXPORT_LAG}'), "
        f"toDateTime64({start}, 9) + toIntervalSecond(10 * intDiv(number, 2)), if(number % 2 = 0, {TAU}, 0.002) "
        f"FROM numbers({2 * flushes})"
    )
    sizes[tables.GAUGE] = 2 * flushes
    for table in (tables.COUNTS_1M, tables.BUCKETS_1M):
        store.command(f"OPTIMIZE TABLE {table} FINAL")
    return sizes


def _median(action, repeats: int) -> tuple[float, object]:
    result = action()  # warm-up
    timings = []
    for _ in range(repeats):
        began = time.perf_counter()
        result = action()
        timings.append(time.perf_counter() - began)
    return statistics.median(timings), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-per-second", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    now = datetime.now(UTC).replace(microsecond=0)
    end = int(now.timestamp())
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        store = Store(f"chdb://{folder}/store")
        began = time.perf_counter()
        sizes = fill(store, end, args.steps_per_second)
        fill_s = time.perf_counter() - began
        page = DashboardPage(store.query)
        base = {"from": str(end - 86400), "to": str(end), "points": "1000"}
        requests = [("layout", "", lambda params: page.layout(params))]
        requests += [(spec.key, "", lambda params, key=spec.key: page.panel_data(key, params)) for spec in PANELS]
        for name, _, call in requests:
            for tau in (repr(TAU), "0.04") if name in ("coverage_at_tau", "coverage_at_tau_over_time") else (None,):
                params = {**base, **({"tau": tau} if tau else {})}
                seconds, _ = _median(lambda call=call, params=params: call(params), args.repeats)
                rows.append({"answer": name, "tau": tau or "", "median_ms": round(1000 * seconds, 1)})
                print(f"{name:28s} {tau or '':6s} {1000 * seconds:9.1f} ms", flush=True)
        out = Path(folder) / "report.html"
        request = ReportRequest(now - timedelta(days=1), now)
        report_s, _ = _median(lambda: write_report(store.query, request, out), args.repeats)
        report_bytes = out.stat().st_size
        store.close()
    print(f"report: {report_s:.2f} s, {report_bytes / 1024:.0f} KiB", flush=True)
    document = {
        "method": __doc__.strip().split("\n\n")[1],
        "command": "python bench/bench_page.py " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
        },
        "measured_at": now.isoformat(),
        "steps_per_second": args.steps_per_second,
        "rows_generated": sizes,
        "fill_seconds": round(fill_s, 1),
        "repeats": args.repeats,
        "page_api": rows,
        "report_seconds": round(report_s, 2),
        "report_bytes": report_bytes,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "page_day_28x28.json").write_text(json.dumps(document, indent=2) + "\n")
    total = sum(row["median_ms"] for row in rows if row["tau"] in ("", repr(TAU)))
    lines = [
        "# Page API and report on a day of a 28-layer, 28-head engine at stride 32 (chDB)",
        "",
        document["method"],
        "",
        f"Command: `{document['command'].strip()}`. Rows: {sizes}. {os.cpu_count()} CPUs, load average at the end "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared machine: upper bounds).",
        "",
        "| answer | tau | median ms |",
        "|---|---|---|",
        *(f"| {row['answer']} | {row['tau']} | {row['median_ms']:.1f} |" for row in rows),
        "",
        f"A full page load (layout and every panel, tau at the engine's): {total / 1000:.2f} s of queries. "
        f"`witcert report` for the day: {report_s:.2f} s, {report_bytes / 1024:.0f} KiB.",
        "",
    ]
    (RESULTS / "page_day_28x28.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
