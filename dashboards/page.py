"""The built-in read-only dashboard page: the panels of ``panels.py`` without Grafana.

The collector mounts these routes on its HTTP server (it knows nothing of dashboards: it only
offers a hook for extra read-only routes). The page is static HTML and JavaScript (uPlot,
vendored under ``static/vendor``, MIT licence); its data comes from two JSON endpoints that run
the very panel SQL Grafana runs, with the datasource's macros expanded the way the plugin expands
them. Variable values from the URL are accepted only if the variable's own query returned them,
and every query runs with the ClickHouse setting ``readonly = 1``.

Query parameters: ``from``/``to`` (unix seconds), ``points`` (the chart width Grafana would use as
max data points), ``tau``, and ``model``/``instance`` as comma-separated lists whose items are
each percent-encoded (the collector hands routes one value per parameter).
"""

from __future__ import annotations

import json
import math
import mimetypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any
from urllib.parse import unquote

from .macros import MacroError, TimeRange, render_sql
from .panels import PANELS, VARIABLES, PanelSpec, VariableSpec, panel

# (sql) -> (column names, rows): the collector passes its store's read method.
QueryRunner = Callable[[str], tuple[Sequence[str], Sequence[Sequence[Any]]]]

PREFIX = "/dashboard"
MAX_RANGE = timedelta(days=400)
DEFAULT_RANGE = timedelta(hours=6)
_STATIC_FILES = {
    "": "index.html",
    "/": "index.html",
    "/page.js": "page.js",
    "/page.css": "page.css",
    "/vendor/uPlot.iife.min.js": "vendor/uPlot.iife.min.js",
    "/vendor/uPlot.min.css": "vendor/uPlot.min.css",
}


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes


class BadRequest(ValueError):
    """The request asks for something the page cannot give (a 400, with this message)."""


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
        return moment.timestamp()
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no infinities; +inf is a valid (overflowed) bound and the page shows it as such.
        return None if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return value


def _json_response(document: Any, status: int = 200) -> Response:
    return Response(status, "application/json", json.dumps(document, separators=(",", ":")).encode())


def _error(status: int, message: str) -> Response:
    return _json_response({"error": message}, status)


class DashboardPage:
    """Routes of the built-in page, bound to one store."""

    def __init__(self, run_query: QueryRunner) -> None:
        self._store_query = run_query

    def _run_query(self, sql: str) -> tuple[Sequence[str], Sequence[Sequence[Any]]]:
        # The SQL is ours and its variables are checked, but a read-only page must not be able to
        # write even if that changed: ClickHouse refuses anything but reads under readonly = 1.
        return self._store_query(sql + "\nSETTINGS readonly = 1")

    # --- request parsing -------------------------------------------------------------------------

    def _time_range(self, params: Mapping[str, str]) -> TimeRange:
        def seconds(name: str) -> float | None:
            text = params.get(name, "")
            if not text:
                return None
            try:
                number = float(text)
            except ValueError as error:
                raise BadRequest(f"{name} must be unix seconds, got {text!r}") from error
            if not math.isfinite(number) or number < 0:
                raise BadRequest(f"{name} must be unix seconds, got {text!r}")
            return number

        end_s, start_s = seconds("to"), seconds("from")
        end = datetime.fromtimestamp(end_s, UTC) if end_s is not None else datetime.now(UTC)
        start = datetime.fromtimestamp(start_s, UTC) if start_s is not None else end - DEFAULT_RANGE
        if not start < end:
            raise BadRequest("from must be before to")
        if end - start > MAX_RANGE:
            raise BadRequest(f"the range may span at most {MAX_RANGE.days} days")
        points_text = params.get("points") or "1000"
        if not points_text.isdigit() or not 10 <= int(points_text) <= 5000:
            raise BadRequest("points must be an integer between 10 and 5000")
        return TimeRange.for_width(start, end, int(points_text))

    def _options(self, spec: VariableSpec, time_range: TimeRange, chosen: Mapping[str, Any]) -> list[str]:
        if spec.query is None:
            return list(spec.choices)
        _, rows = self._run_query(render_sql(spec.query, time_range, chosen))
        return [str(row[0]) for row in rows]

    def _variables(
        self, params: Mapping[str, str], time_range: TimeRange
    ) -> tuple[dict[str, Any], dict[str, list[str]]]:
        """Each variable's value and its options; later variables see the values chosen before them."""
        chosen: dict[str, Any] = {}
        options: dict[str, list[str]] = {}
        for spec in VARIABLES:
            options[spec.name] = self._options(spec, time_range, chosen)
            text = params.get(spec.name, "")
            requested = [unquote(item) for item in text.split(",") if item] if spec.multi else [text] if text else []
            if spec.multi:
                unknown = [value for value in requested if value not in options[spec.name]]
                if unknown:
                    raise BadRequest(f"{spec.name}: no data for {', '.join(map(repr, unknown))} in this range")
                # "All", as Grafana sends it: every option; with no option at all, a value that matches no row.
                chosen[spec.name] = requested or options[spec.name] or [""]
            else:
                first = options[spec.name][0] if options[spec.name] else ""
                value = requested[-1] if requested else spec.default or first
                try:
                    number = float(value)
                except ValueError as error:
                    raise BadRequest(f"{spec.name} must be a number, got {value!r}") from error
                if not math.isfinite(number) or number <= 0:
                    raise BadRequest(f"{spec.name} must be a positive number, got {value!r}")
                chosen[spec.name] = repr(number)
        return chosen, options

    # --- endpoints ----------------------------------------------------------------------------------

    def layout(self, params: Mapping[str, str]) -> dict[str, Any]:
        """Sections, panels and variables with their options for the requested range."""
        time_range = self._time_range(params)
        _, options = self._variables(params, time_range)
        return {
            "variables": [
                {
                    "name": spec.name,
                    "label": spec.label,
                    "description": spec.description,
                    "multi": spec.multi,
                    "options": options[spec.name],
                    "default": spec.default,
                }
                for spec in VARIABLES
            ],
            "panels": [_panel_layout(spec) for spec in PANELS],
        }

    def panel_data(self, key: str, params: Mapping[str, str]) -> dict[str, Any]:
        """Run every query of one panel and return its columns and rows."""
        try:
            spec = panel(key)
        except KeyError as error:
            raise BadRequest(str(error.args[0])) from error
        time_range = self._time_range(params)
        chosen, _ = self._variables(params, time_range)
        results = []
        for query in spec.queries:
            columns, rows = self._run_query(render_sql(query.sql, time_range, chosen))
            if tuple(columns) != query.columns:
                raise RuntimeError(f"panel {key} query {query.ref_id} returned {columns}, expected {query.columns}")
            results.append(
                {
                    "refId": query.ref_id,
                    "columns": list(columns),
                    "rows": [[_json_value(v) for v in row] for row in rows],
                }
            )
        return {
            "key": key,
            "from": time_range.start.timestamp(),
            "to": time_range.end.timestamp(),
            "interval_s": time_range.interval_s,
            "results": results,
        }

    def handle(self, path: str, params: Mapping[str, str]) -> Response | None:
        """Answer a GET under ``PREFIX``; ``None`` for paths this page does not own."""
        if path != PREFIX and not path.startswith(PREFIX + "/"):
            return None
        subpath = path[len(PREFIX) :]
        if subpath in _STATIC_FILES:
            return _static(_STATIC_FILES[subpath])
        try:
            if subpath == "/api/layout":
                return _json_response(self.layout(params))
            if subpath.startswith("/api/panels/"):
                return _json_response(self.panel_data(subpath[len("/api/panels/") :], params))
        except (BadRequest, MacroError) as error:
            return _error(400, str(error))
        except Exception as error:  # noqa: BLE001 - a failing store must not take the server down
            return _error(502, f"the store could not answer: {type(error).__name__}: {error}")
        return _error(404, f"no such page: {path}")


def _panel_layout(spec: PanelSpec) -> dict[str, Any]:
    return {
        "key": spec.key,
        "title": spec.title,
        "description": spec.description,
        "kind": spec.kind,
        "unit": spec.unit,
        "section": spec.section,
        "width": spec.width,
        "height": spec.height,
        "min": spec.min_value,
        "max": spec.max_value,
        "higherIsBetter": spec.higher_is_better,
        "queries": [
            {"refId": query.ref_id, "columns": list(query.columns), "labels": list(query.labels)}
            for query in spec.queries
        ],
    }


def _static(name: str) -> Response:
    data = (resources.files("witcert.dashboards") / "static" / name).read_bytes()
    content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if content_type.startswith("text/") or content_type.endswith("javascript"):
        content_type += "; charset=utf-8"
    return Response(200, content_type, data)


def routes() -> tuple[Any, ...]:
    """The page as routes for the collector's hook: ``Collector(config, extra_routes=routes())``.

    Each request reads through the collector's own store connection (``request.queries``).
    """
    from witcert.collector.requests import ApiRequest, ApiResponse, Route

    def handle(request: ApiRequest) -> ApiResponse:
        def run_query(sql: str) -> tuple[Sequence[str], Sequence[Sequence[Any]]]:
            result = request.queries.sql(sql, {})
            return result.columns, result.rows

        response = DashboardPage(run_query).handle(request.path, request.params)
        if response is None:
            return ApiResponse(404, "application/json", b'{"error":"not found"}')
        return ApiResponse(response.status, response.content_type, response.body, {"Cache-Control": "no-store"})

    return (Route(PREFIX, handle),)
