"""Read-only HTTP API: ``GET /api/v1/<report>?from=&to=&model=&instance=&tau=&interval=&limit=&layer=&head=&format=``.

Reports are those of ``witcert query`` (``queries.REPORTS``); ``format`` is ``json`` (default) or
``csv``. Times: ISO-8601, ``now`` or relative (``-15m``); the default window is the last hour.
"""

from __future__ import annotations

import csv
import io
import json
import math
from datetime import date, datetime
from typing import Any

from witcert.collector.queries import REPORTS, QueryError, QueryResult, Window, parse_time
from witcert.collector.requests import ApiRequest, ApiResponse, Route

PREFIX = "/api/v1"


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no inf/NaN; +inf certificates are valid bounds and must survive as text.
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, datetime | date):
        return value.isoformat()
    return value


def to_json(result: QueryResult) -> str:
    records = [{k: _json_value(v) for k, v in record.items()} for record in result.records()]
    return json.dumps({"report": result.report, "columns": result.columns, "rows": records})


def to_csv(result: QueryResult) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(result.columns)
    for row in result.rows:
        writer.writerow([_json_value(value) if value is not None else "" for value in row])
    return buffer.getvalue()


PARAMETERS = ("from", "to", "model", "instance", "tau", "interval", "limit", "layer", "head", "format")
_MAX_NAME_CHARS = 1024


def _integer(params: dict[str, str], name: str, default: int | None) -> int | None:
    text = params.get(name)
    if text in (None, ""):
        return default
    digits = text[1:] if text.startswith("-") else text
    if not (0 < len(digits) <= 18 and digits.isascii() and digits.isdigit()):
        raise QueryError(f"{name} must be an integer, got {text[:40]!r}")
    return int(text)


def window_from_params(params: dict[str, str]) -> Window:
    """Build a query window from string parameters (HTTP query string or CLI), with clear errors."""
    unknown = sorted(set(params) - set(PARAMETERS))
    if unknown:
        raise QueryError(f"unknown parameter {unknown[0][:40]!r}; the parameters are {', '.join(PARAMETERS)}")
    for name in ("model", "instance"):
        if len(params.get(name, "")) > _MAX_NAME_CHARS:
            raise QueryError(f"{name} is longer than {_MAX_NAME_CHARS} characters")
    tau_text = params.get("tau")
    try:
        tau = float(tau_text) if tau_text not in (None, "") else None
    except ValueError:
        raise QueryError(f"tau must be a number, got {tau_text[:40]!r}") from None
    return Window(
        start=parse_time(params.get("from") or "-1h"),
        end=parse_time(params.get("to") or "now"),
        model=params.get("model", ""),
        instance=params.get("instance", ""),
        tau=tau,
        interval_s=_integer(params, "interval", None),
        limit=_integer(params, "limit", 20),
        layer=_integer(params, "layer", -1),
        head=_integer(params, "head", -1),
    )


def _report_handler(request: ApiRequest) -> ApiResponse:
    report = request.path[len(PREFIX) + 1 :].strip("/")
    fmt = request.params.get("format", "json")
    if report == "":
        body = json.dumps({"reports": list(REPORTS), "parameters": __doc__.split("\n")[0]})
        return ApiResponse(200, "application/json", body.encode())
    try:
        if fmt not in ("json", "csv"):
            raise QueryError(f"format must be json or csv, got {fmt!r}")
        if report not in REPORTS:
            raise QueryError(f"unknown report {report!r}; choose one of {', '.join(REPORTS)}")
        result = request.queries.run(report, window_from_params(dict(request.params)))
    except QueryError as error:
        return ApiResponse(400, "application/json", json.dumps({"error": str(error)}).encode())
    if fmt == "csv":
        return ApiResponse(200, "text/csv; charset=utf-8", to_csv(result).encode())
    return ApiResponse(200, "application/json", to_json(result).encode())


def routes() -> tuple[Route, ...]:
    return (Route(PREFIX, _report_handler),)
