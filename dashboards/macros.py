"""Expand panel SQL the way Grafana and grafana-clickhouse-datasource expand it.

Two layers run in sequence in Grafana: the browser substitutes dashboard variables
(``${model:singlequote}``, ``${tau}``), then the plugin's backend expands its ``$__`` macros with the
query's time range and interval. The built-in page and the tests need the very same SQL text that
ClickHouse receives from Grafana, so both layers are reproduced here, for exactly the forms the
panels use; anything else is refused rather than guessed at.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

# The plugin's macro table (pkg/macros/macros.go). ``$__conditionalAll`` is absent on purpose: the
# browser expands it, so alert rules (evaluated server side) would see it raw.
_MACRO_ARITY = {
    "fromTime": 0,
    "toTime": 0,
    "fromTime_ms": 0,
    "toTime_ms": 0,
    "interval_s": 0,
    "timeFilter": 1,
    "timeFilter_ms": 1,
    "dateFilter": 1,
    "timeInterval": 1,
    "timeInterval_ms": 1,
    "dateTimeFilter": 2,
    "dt": 2,
}
# Longest names first so that ``$__timeFilter_ms`` is not read as ``$__timeFilter`` + ``_ms``.
_MACRO_RE = re.compile(r"\$__(" + "|".join(sorted(_MACRO_ARITY, key=len, reverse=True)) + r")\b(?:\(([^()]*)\))?")
_ANY_MACRO_RE = re.compile(r"\$__\w+")
# Grafana's variable syntaxes: $name, ${name}, ${name:format}, [[name]].
_VARIABLE_RE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)|\[\[(\w+)\]\]")


class MacroError(ValueError):
    """A panel query uses a macro or variable that cannot be expanded as Grafana would."""


@dataclass(frozen=True)
class TimeRange:
    """The dashboard's time range and the interval Grafana derived from it for one panel."""

    start: datetime
    end: datetime
    interval_s: float

    def __post_init__(self) -> None:
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise MacroError("time range bounds must be timezone-aware datetimes")
        if self.end < self.start:
            raise MacroError(f"time range ends ({self.end.isoformat()}) before it starts ({self.start.isoformat()})")
        if not math.isfinite(self.interval_s) or self.interval_s <= 0:
            raise MacroError(f"interval must be a positive number of seconds, got {self.interval_s!r}")

    @classmethod
    def for_width(cls, start: datetime, end: datetime, max_data_points: int = 1000) -> TimeRange:
        """Grafana's interval for a panel: the range split into ``max_data_points`` steps, at least 1 s."""
        span_s = (end - start).total_seconds()
        return cls(start, end, max(span_s / max(max_data_points, 1), 1.0))


def _date_time(moment: datetime) -> str:
    return f"toDateTime({int(moment.timestamp())})"


def _date_time_ms(moment: datetime) -> str:
    return f"fromUnixTimestamp64Milli({int(moment.timestamp() * 1000)})"


def _date(moment: datetime) -> str:
    return f"toDate('{moment.astimezone(UTC).strftime('%Y-%m-%d')}')"


def expand_macros(sql: str, time_range: TimeRange) -> str:
    """Expand the plugin's ``$__`` macros exactly as its backend does (same text, same rounding)."""
    interval_s = int(max(time_range.interval_s, 1))
    interval_ms = int(max(time_range.interval_s * 1000, 1))
    start, end = time_range.start, time_range.end

    def expand(match: re.Match[str]) -> str:
        name, raw_args = match.group(1), match.group(2)
        args = [arg.strip().replace('"', "").replace("'", "") for arg in raw_args.split(",")] if raw_args else []
        if len(args) != _MACRO_ARITY[name]:
            raise MacroError(
                f"$__{name} expects {_MACRO_ARITY[name]} argument(s), got {len(args)} in {match.group(0)!r}"
            )
        if name == "fromTime":
            return _date_time(start)
        if name == "toTime":
            return _date_time(end)
        if name == "fromTime_ms":
            return _date_time_ms(start)
        if name == "toTime_ms":
            return _date_time_ms(end)
        if name == "interval_s":
            return str(interval_s)
        if name == "timeFilter":
            return f"{args[0]} >= {_date_time(start)} AND {args[0]} <= {_date_time(end)}"
        if name == "timeFilter_ms":
            return f"{args[0]} >= {_date_time_ms(start)} AND {args[0]} <= {_date_time_ms(end)}"
        if name == "dateFilter":
            return f"{args[0]} >= {_date(start)} AND {args[0]} <= {_date(end)}"
        if name == "timeInterval":
            return f"toStartOfInterval(toDateTime({args[0]}), INTERVAL {interval_s} second)"
        if name == "timeInterval_ms":
            return f"toStartOfInterval(toDateTime64({args[0]}, 3), INTERVAL {interval_ms} millisecond)"
        date_col, time_col = args
        return (
            f"({date_col} >= {_date(start)} AND {date_col} <= {_date(end)}) AND "
            f"({time_col} >= {_date_time(start)} AND {time_col} <= {_date_time(end)})"
        )

    expanded = _MACRO_RE.sub(expand, sql)
    leftover = _ANY_MACRO_RE.search(expanded)
    if leftover:
        raise MacroError(f"unsupported macro {leftover.group(0)!r}: the datasource would not expand it")
    return expanded


def _single_quote(value: str) -> str:
    # Grafana's ``singlequote`` format escapes quotes only (not backslashes); callers that take values
    # from outside (the built-in page) accept only values the variable's own query returned.
    return "'" + value.replace("'", "\\'") + "'"


def _format_value(name: str, value: str | Sequence[str], fmt: str | None) -> str:
    values = [value] if isinstance(value, str) else list(value)
    if fmt == "singlequote":
        return ",".join(_single_quote(v) for v in values)
    if fmt in (None, "raw", "csv"):
        return ",".join(values)
    raise MacroError(f"variable format {fmt!r} of ${{{name}}} is not used by witcert panels")


def substitute_variables(sql: str, variables: Mapping[str, str | Sequence[str]]) -> str:
    """Substitute dashboard variables as Grafana's template service does for the formats panels use.

    A multi-value variable is a sequence (``All`` means every option, as Grafana sends it when the
    variable has no custom all-value). An unknown variable is an error, not silently left in place.
    """

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3) or match.group(4)
        if name.startswith("__"):
            return match.group(0)  # a datasource macro, expanded by expand_macros
        if name not in variables:
            raise MacroError(f"panel SQL uses variable ${name}, which has no value")
        return _format_value(name, variables[name], match.group(2))

    return _VARIABLE_RE.sub(substitute, sql)


def render_sql(sql: str, time_range: TimeRange, variables: Mapping[str, str | Sequence[str]]) -> str:
    """The SQL ClickHouse receives from Grafana for this panel, time range and variable selection."""
    return expand_macros(substitute_variables(sql, variables), time_range)
