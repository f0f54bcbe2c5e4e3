"""Every read the project makes of the store, in one place (CLI, HTTP API, built-in page).

Each query is parameterised (ClickHouse ``{name:Type}`` placeholders bound by the server); the
only text spliced into SQL is a table name chosen from constants here, never from input.
Time ranges are half-open ``[start, end)``, in UTC. Rollups are summed at read time because
SummingMergeTree merges rows of one key only eventually.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from witcert.collector import tables
from witcert.integrations.telemetry import schema as ts

if TYPE_CHECKING:
    from witcert.collector.store import Store

# Layer/head value of counters that are not per head (steps, dropped points).
NOT_PER_HEAD = 65535
# Ranges up to this long read the 1-minute rollups; longer ones the 1-hour rollups.
MINUTE_ROLLUP_MAX_RANGE = timedelta(days=2)
MAX_SAMPLE_ROWS = 100_000
# The store's DateTime64(9) columns hold 1900 .. 2262-04-11; its DateTime rollup buckets 1970 .. 2106.
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(2106, 1, 1, tzinfo=UTC)
TARGET_POINTS = 240

# name -> SQL. Placeholders: start, end (DateTime64), interval (seconds), model and instance
# ('' = all), tau, limit, layer and head (-1 = all). Table names are spliced from ``tables``:
# {samples} here, {rollup} (1-minute or 1-hour counts, by the window's length) when a report runs.
SQL: dict[str, str] = {
    "coverage": """
SELECT toStartOfInterval(Bucket, toIntervalSecond({interval:UInt32})) AS time,
       sum(Certificates) AS certificates, sum(Covered) AS covered, sum(Vacuous) AS vacuous,
       sum(Infinite) AS infinite, sum(NaNs) AS nans,
       if(certificates = 0, NULL, covered / certificates) AS coverage
FROM {rollup}
WHERE Bucket >= toStartOfMinute({start:DateTime64(9, 'UTC')}) AND Bucket < {end:DateTime64(9, 'UTC')}
  AND ({model:String} = '' OR Model = {model:String}) AND ({instance:String} = '' OR Instance = {instance:String})
  AND Layer != 65535
GROUP BY time ORDER BY time""",
    "coverage_at_tau": """
SELECT toStartOfInterval(Timestamp, toIntervalSecond({interval:UInt32})) AS time,
       count() AS samples, countIf(Value <= {tau:Float64}) AS covered,
       countIf(Value >= 1) AS vacuous, countIf(isInfinite(Value)) AS infinite,
       covered / samples AS coverage
FROM {samples}
WHERE Timestamp >= {start:DateTime64(9, 'UTC')} AND Timestamp < {end:DateTime64(9, 'UTC')}
  AND ({model:String} = '' OR Model = {model:String}) AND ({instance:String} = '' OR Instance = {instance:String})
GROUP BY time ORDER BY time""",
    "heatmap": """
SELECT Layer AS layer, Head AS head, sum(Certificates) AS certificates, sum(Covered) AS covered,
       if(certificates = 0, NULL, covered / certificates) AS coverage,
       sum(Vacuous) AS vacuous, sum(Infinite) AS infinite, sum(Fallbacks) AS fallbacks,
       if(certificates = 0, NULL, fallbacks / certificates) AS fallback_rate
FROM {rollup}
WHERE Bucket >= toStartOfMinute({start:DateTime64(9, 'UTC')}) AND Bucket < {end:DateTime64(9, 'UTC')}
  AND ({model:String} = '' OR Model = {model:String}) AND ({instance:String} = '' OR Instance = {instance:String})
  AND Layer != 65535
GROUP BY layer, head ORDER BY layer, head""",
    "heatmap_at_tau": """
SELECT Layer AS layer, Head AS head, count() AS samples, countIf(Value <= {tau:Float64}) AS covered,
       covered / samples AS coverage, countIf(isInfinite(Value)) AS infinite,
       quantileExactIf(0.99)(Value, isFinite(Value)) AS p99, max(Value) AS max
FROM {samples}
WHERE Timestamp >= {start:DateTime64(9, 'UTC')} AND Timestamp < {end:DateTime64(9, 'UTC')}
  AND ({model:String} = '' OR Model = {model:String}) AND ({instance:String} = '' OR Instance = {instance:String})
GROUP BY layer, head ORDER BY layer, head""",
    "worst_heads": """
SELECT Model AS model, Layer AS layer, Head AS head, sum(Certificates) AS certificates,
       sum(Covered) AS covered, covered / certificates AS coverage,
       sum(Infinite) AS infinite, sum(Fallbacks) AS fallbacks
FROM {rollup}
WHERE Bucket >= toStartOfMinute({start:DateTime64(9, 'UTC')}) AND Bucket < {end:DateTime64(9, 'UTC')}
  AND ({model:String} = '' OR Model = {model:String}) AND ({instance:String} = '' OR Instance = {instance:String})
  AND Layer != 65535
GROUP BY model, layer, head HAVING certificates > 0
ORDER BY coverage ASC, certificates DESC, layer, head LIMIT {limit:UInt32}""",
    "worst_heads_at_tau": """
SELECT Model AS model, Layer AS layer, Head AS head, count() AS samples,
       countIf(Value <= {tau:Float64}) AS covered, covered / samples AS coverage,
       countIf(isInfinite(Value)) AS infinite, max(Value) AS max
FROM {samples}
WHERE Timestamp >= {start:DateTime64(9, 'UTC')} AND Timestamp < {end:DateTime64(9, 'UTC')}
  AND ({model:String} = '' OR Model = {model:String}) AND ({instance:String} = '' OR Instance = {instance:String})
GROUP BY model, layer, head
ORDER BY coverage ASC, samples DESC, layer, head LIMIT {limit:UInt32}""",
    "samples": """
SELECT Timestamp AS time, Model AS model, Instance AS instance, TpRank AS tp_rank,
       Layer AS layer, Head AS head, Step AS step, Value AS value
FROM {samples}
WHERE Timestamp >= {start:DateTime64(9, 'UTC')} AND Timestamp < {end:DateTime64(9, 'UTC')}
  AND ({model:String} = '' OR Model = {model:String}) AND ({instance:String} = '' OR Instance = {instance:String})
  AND ({layer:Int32} < 0 OR Layer = {layer:Int32}) AND ({head:Int32} < 0 OR Head = {head:Int32})
ORDER BY Timestamp, Layer, Head LIMIT {limit:UInt32}""",
    "fallback_rate": """
SELECT toStartOfInterval(Bucket, toIntervalSecond({interval:UInt32})) AS time,
       sum(Certificates) AS certificates, sum(Fallbacks) AS fallbacks,
       if(certificates = 0, NULL, fallbacks / certificates) AS fallback_rate,
       sum(RepairedBytes) AS repaired_bytes
FROM {rollup}
WHERE Bucket >= toStartOfMinute({start:DateTime64(9, 'UTC')}) AND Bucket < {end:DateTime64(9, 'UTC')}
  AND ({model:String} = '' OR Model = {model:String}) AND ({instance:String} = '' OR Instance = {instance:String})
  AND Layer != 65535
GROUP BY time ORDER BY time""",
    "tau_in_force": f"""
SELECT ResourceAttributes['{ts.RESOURCE_MODEL}'] AS model,
       ResourceAttributes['{ts.RESOURCE_INSTANCE}'] AS instance,
       argMax(Value, TimeUnix) AS tau, max(TimeUnix) AS reported_at
FROM {tables.GAUGE}
WHERE MetricName = '{ts.TAU}'
  AND TimeUnix >= {{start:DateTime64(9, 'UTC')}} AND TimeUnix < {{end:DateTime64(9, 'UTC')}}
  AND ({{model:String}} = '' OR model = {{model:String}})
  AND ({{instance:String}} = '' OR instance = {{instance:String}})
GROUP BY model, instance ORDER BY model, instance""",
}
SQL = {name: text.replace("{samples}", tables.CERTIFICATE_SAMPLES) for name, text in SQL.items()}

# The reports `witcert query` and the HTTP API offer, and the SQL each picks (tau given or not).
REPORTS: dict[str, tuple[str, str]] = {
    "coverage": ("coverage", "coverage_at_tau"),
    "heatmap": ("heatmap", "heatmap_at_tau"),
    "worst-heads": ("worst_heads", "worst_heads_at_tau"),
    "samples": ("samples", "samples"),
    "fallback-rate": ("fallback_rate", "fallback_rate"),
    "tau": ("tau_in_force", "tau_in_force"),
}


class QueryError(ValueError):
    """A request for a report with unusable parameters; the message says which."""


@dataclass(frozen=True)
class Window:
    """What every report is asked: a time range and optional filters."""

    start: datetime
    end: datetime
    model: str = ""
    instance: str = ""
    tau: float | None = None
    interval_s: int | None = None
    limit: int = 20
    layer: int = -1
    head: int = -1

    def __post_init__(self) -> None:
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise QueryError("start and end must carry a time zone")
        for name, moment in (("from", self.start), ("to", self.end)):
            if not EARLIEST <= moment <= LATEST:
                raise QueryError(
                    f"{name} {moment.isoformat()} is outside {EARLIEST.date().isoformat()} .. "
                    f"{LATEST.date().isoformat()} (the range of the store's time columns)"
                )
        if self.end <= self.start:
            raise QueryError(f"empty time range: end {self.end.isoformat()} <= start {self.start.isoformat()}")
        if self.tau is not None and not (math.isfinite(self.tau) and self.tau > 0):
            raise QueryError(f"tau must be a finite number > 0, got {self.tau}")
        if self.interval_s is not None and not 1 <= self.interval_s <= 366 * 86400:
            raise QueryError(f"interval must be 1 s .. 366 days, got {self.interval_s} s")
        if not 1 <= self.limit <= MAX_SAMPLE_ROWS:
            raise QueryError(f"limit must be 1..{MAX_SAMPLE_ROWS}, got {self.limit}")
        if not -1 <= self.layer < NOT_PER_HEAD or not -1 <= self.head < NOT_PER_HEAD:
            raise QueryError("layer and head must be 0..65534 (or omitted)")

    @property
    def rollup(self) -> str:
        return tables.COUNTS_1M if self.end - self.start <= MINUTE_ROLLUP_MAX_RANGE else tables.COUNTS_1H

    @property
    def interval(self) -> int:
        """Seconds per point: as asked, else about TARGET_POINTS points (whole minutes on rollups)."""
        if self.interval_s is not None:
            return self.interval_s
        seconds = (self.end - self.start).total_seconds() / TARGET_POINTS
        step = 60 if self.rollup == tables.COUNTS_1M else 3600
        return max(step, int(math.ceil(seconds / step)) * step)

    def parameters(self) -> dict[str, Any]:
        return {
            "start": self.start.astimezone(UTC).replace(tzinfo=None),
            "end": self.end.astimezone(UTC).replace(tzinfo=None),
            "model": self.model,
            "instance": self.instance,
            "tau": self.tau if self.tau is not None else 0.0,
            "interval": self.interval,
            "limit": self.limit,
            "layer": self.layer,
            "head": self.head,
        }


@dataclass(frozen=True)
class QueryResult:
    report: str
    columns: list[str]
    rows: list[tuple]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


def report_sql(report: str, window: Window) -> str:
    """The SQL text of a report for a window (placeholders unbound)."""
    if report not in REPORTS:
        raise QueryError(f"unknown report {report!r}; choose one of {', '.join(REPORTS)}")
    plain, at_tau = REPORTS[report]
    return SQL[at_tau if window.tau is not None else plain].replace("{rollup}", window.rollup)


class Queries:
    """The reports over one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def run(self, report: str, window: Window) -> QueryResult:
        columns, rows = self.store.query(report_sql(report, window), window.parameters())
        return QueryResult(report, columns, rows)

    def sql(self, sql: str, parameters: dict[str, Any]) -> QueryResult:
        """Run one of the SQL texts above (or a page's own parameterised read) with bound values."""
        columns, rows = self.store.query(sql, parameters)
        return QueryResult("sql", columns, rows)


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """ISO-8601 (naive means UTC), ``now``, or a relative ``-15m`` / ``-2h`` / ``-7d`` / ``-30s``."""
    now = now or datetime.now(UTC)
    text = text.strip()
    if text == "now":
        return now
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    problem = QueryError(f"time {text[:40]!r} is neither ISO-8601, 'now', nor relative like -15m")
    if not text.isascii():
        raise problem
    amount = text[1:-1]
    if text.startswith("-") and text[-1:] in units and amount.isdigit():
        if len(amount) > 12:
            raise QueryError(f"time {text[:40]!r} reaches too far back")
        try:
            return now - timedelta(seconds=int(amount) * units[text[-1]])
        except OverflowError:
            raise QueryError(f"time {text[:40]!r} reaches too far back") from None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise problem from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
