"""Latency of every dashboard panel query over ranges from 1 hour to 30 days, on chDB.

Method: a fresh chDB store with the collector's schema (witcert.collector.store.Store) gets
synthetic rollup rows generated inside ClickHouse (INSERT ... SELECT FROM numbers()): one model,
2 instances x 32 layers x 8 heads = 512 series; the 1-minute rollups hold the last 7 days, the
1-hour rollups the last 30 days, 5 non-empty histogram buckets per series and time bucket. Rollups
are written directly (not through OTLP): this measures reading, and the ingest path has its own
benchmark. Each panel query, with the macros expanded as grafana-clickhouse-datasource does for a
1000-point-wide panel and every variable at "All", runs once to warm up, then REPEATS times; the
median is reported. Results: bench/results/dashboards_queries.{json,md}.

    python bench/dashboards_queries.py [--days-1m 7] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from witcert.collector.store import Store
from witcert.dashboards import macros, panels

INSTANCES, LAYERS, HEADS = 2, 32, 8
SERIES = INSTANCES * LAYERS * HEADS
BOUNDS = (1e-4, 1e-3, 1e-2, 0.1, 1.0)
RANGES = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "2d": timedelta(days=2), "7d": timedelta(days=7),
          "30d": timedelta(days=30)}  # fmt: skip
RESULTS = Path(__file__).resolve().parent / "results"


def _series_columns(number: str) -> str:
    return (
        f"'bench-model' AS Model, concat('node-', toString({number} % {SERIES} % {INSTANCES})) AS Instance, "
        f"toUInt16(0) AS TpRank, toUInt16(intDiv({number} % {SERIES}, {INSTANCES}) % {LAYERS}) AS Layer, "
        f"toUInt16(intDiv({number} % {SERIES}, {INSTANCES * LAYERS})) AS Head"
    )


def fill(store: Store, now: datetime, days_1m: int) -> dict[str, int]:
    end = int(now.timestamp())
    sizes = {}
    for table, step_s, buckets in (
        ("witcert_counts_1m", 60, days_1m * 1440),
        ("witcert_counts_1h", 3600, 30 * 24),
    ):
        start = end - end % step_s
        store.command(
            f"INSERT INTO {table} SELECT toDateTime({start} - {step_s} * intDiv(number, {SERIES})) AS Bucket, "
            f"{_series_columns('number')}, 1000 AS Certificates, 990 - number % 20 AS Covered, number % 3 AS Vacuous, "
            "toUInt64(number % 97 = 0) AS Infinite, 0 AS NaNs, number % 11 AS Fallbacks, 4096 * (number % 11) "
            "AS RepairedBytes, 0 AS Steps, 0 AS Dropped "
            f"FROM numbers({buckets * SERIES})"
        )
        sizes[table] = buckets * SERIES
    bounds = "[" + ", ".join(map(repr, BOUNDS)) + "]"
    for table, step_s, buckets in (
        ("witcert_buckets_1m", 60, days_1m * 1440),
        ("witcert_buckets_1h", 3600, 30 * 24),
    ):
        start = end - end % step_s
        per = SERIES * len(BOUNDS)
        store.command(
            f"INSERT INTO {table} SELECT toDateTime({start} - {step_s} * intDiv(number, {per})) AS Bucket, "
            f"{_series_columns(f'intDiv(number, {len(BOUNDS)})')}, "
            f"arrayElement({bounds}, number % {len(BOUNDS)} + 1) AS UpperBound, 1 + number % 7 AS Count "
            f"FROM numbers({buckets * per})"
        )
        sizes[table] = buckets * per
    store.command("OPTIMIZE TABLE witcert_counts_1m FINAL")
    store.command("OPTIMIZE TABLE witcert_buckets_1m FINAL")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days-1m", type=int, default=7, help="days held in the 1-minute rollups")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    now = datetime.now(UTC)
    with tempfile.TemporaryDirectory() as folder:
        store = Store(f"chdb://{folder}/store")
        started = time.perf_counter()
        sizes = fill(store, now, args.days_1m)
        fill_s = time.perf_counter() - started
        variables = {"model": ["bench-model"], "instance": [f"node-{i}" for i in range(INSTANCES)], "tau": "0.01"}
        rows = []
        for range_name, span in RANGES.items():
            time_range = macros.TimeRange.for_width(now - span, now, 1000)
            for spec in panels.PANELS:
                for query in spec.queries:
                    sql = macros.render_sql(query.sql, time_range, variables)
                    store.query(sql)
                    timings = []
                    for _ in range(args.repeats):
                        began = time.perf_counter()
                        _, result = store.query(sql)
                        timings.append(time.perf_counter() - began)
                    rows.append({"range": range_name, "panel": spec.key, "query": query.ref_id,
                                 "median_ms": 1000 * statistics.median(timings), "rows": len(result)})  # fmt: skip
        store.close()
    RESULTS.mkdir(exist_ok=True)
    document = {
        "method": __doc__.strip().split("\n\n")[1],
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}, chDB",
        "measured_at": now.isoformat(timespec="seconds"),
        "rows_generated": sizes,
        "fill_seconds": round(fill_s, 1),
        "repeats": args.repeats,
        "results": rows,
    }
    (RESULTS / "dashboards_queries.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        "# Dashboard panel query latency (chDB)",
        "",
        document["method"],
        "",
        f"Rows: {sizes}. Median of {args.repeats} runs, milliseconds.",
        "",
        "| panel | query | " + " | ".join(RANGES) + " |",
        "|---|---|" + "---|" * len(RANGES),
    ]
    for spec in panels.PANELS:
        for query in spec.queries:
            cells = [f"{r['median_ms']:.1f}" for r in rows if r["panel"] == spec.key and r["query"] == query.ref_id]
            lines.append(f"| {spec.key} | {query.ref_id} | " + " | ".join(cells) + " |")
    worst = max(rows, key=lambda r: r["median_ms"])
    lines += ["", f"Slowest: {worst['panel']} over {worst['range']}: {worst['median_ms']:.1f} ms."]
    (RESULTS / "dashboards_queries.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
