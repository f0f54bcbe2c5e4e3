"""``witcert report``: the built-in page's panels for one time range and selection, as one HTML file.

The file needs no server and no network: the page's own JavaScript, the vendored uPlot and both
stylesheets are inlined, and every panel's data is embedded as the JSON the page's API would have
answered (computed by the very same ``DashboardPage`` code, so the numbers are the page's numbers).
It is what an operator attaches to an incident. ``witcert demo --no-serve`` writes one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

from witcert import __version__

from .page import DashboardPage, QueryRunner
from .panels import PANELS, VARIABLES


@dataclass(frozen=True)
class ReportRequest:
    """What the report covers: a range, and optionally models, instances and the what-if tau."""

    start: datetime
    end: datetime
    models: Sequence[str] = ()
    instances: Sequence[str] = ()
    tau: str | None = None
    points: int = 1000  # the chart width Grafana would use as max data points


def _static(name: str) -> str:
    return (resources.files("witcert.dashboards") / "static" / name).read_text(encoding="utf-8")


def _script_json(document: Any) -> str:
    # Inside <script>, "</" would end the element early; "<\/" reads the same to JSON.parse and to JS.
    return json.dumps(document, separators=(",", ":")).replace("</", "<\\/")


def report_data(run_query: QueryRunner, request: ReportRequest) -> dict[str, Any]:
    """Layout, selection and every panel's rows, as the page's API answers them for ``request``."""
    params = {
        "from": repr(request.start.timestamp()),
        "to": repr(request.end.timestamp()),
        "points": str(request.points),
    }
    if request.models:
        params["model"] = ",".join(quote(model, safe="") for model in request.models)
    if request.instances:
        params["instance"] = ",".join(quote(instance, safe="") for instance in request.instances)
    if request.tau is not None:
        params["tau"] = request.tau
    page = DashboardPage(run_query)
    layout = page.layout(params)
    options = {variable["name"]: variable["options"] for variable in layout["variables"]}
    selection = {
        "model": list(request.models) or options["model"],
        "instance": list(request.instances) or options["instance"],
        "tau": [request.tau or (options["tau"][0] if options["tau"] else "")],
    }
    return {
        "layout": layout,
        "selection": selection,
        "panels": {spec.key: page.panel_data(spec.key, params) for spec in PANELS},
        "from": request.start.timestamp(),
        "to": request.end.timestamp(),
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "version": __version__,
    }


def _describe(data: dict[str, Any]) -> str:
    start = datetime.fromtimestamp(data["from"], UTC).strftime("%Y-%m-%d %H:%M:%S")
    end = datetime.fromtimestamp(data["to"], UTC).strftime("%Y-%m-%d %H:%M:%S")
    names = {variable.name: variable.label for variable in VARIABLES}
    chosen = "; ".join(f"{names[name]}: {', '.join(values) or 'none'}" for name, values in data["selection"].items())
    return f"{start} to {end} UTC. {chosen}. Generated {data['generated']} by witcert {data['version']}."


def render_report(data: dict[str, Any]) -> str:
    """The self-contained HTML document for ``report_data``'s result."""
    escape = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})
    return f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <meta name="viewport" content="width=device-width, initial-scale=1">
  <title>witcert report: certificate coverage</title>
  <link rel="icon" href="data:,">
  <style>{_static("vendor/uPlot.min.css")}</style>
  <style>{_static("page.css")}</style>
</head>
<body data-state="loading">
  <header>
    <h1>witcert <span>certificate coverage report</span></h1>
    <form id="controls" autocomplete="off"><span id="variables"></span></form>
  </header>
  <p id="report-range">{_describe(data).translate(escape)}</p>
  <p id="status" role="status"></p>
  <main id="sections"></main>
  <footer>A witcert report: the built-in page's panels with their data embedded (no server needed). The same
    panel SQL feeds the Grafana dashboard. Charts: uPlot (MIT).</footer>
  <script>window.WITCERT_REPORT = {_script_json(data)};</script>
  <!-- uPlot, inlined under its licence:
{_static("vendor/uPlot.LICENSE.txt").replace("--", "- -").translate(escape)}  -->
  <script>{_static("vendor/uPlot.iife.min.js")}</script>
  <script>{_static("page.js")}</script>
</body>
</html>
"""


def write_report(run_query: QueryRunner, request: ReportRequest, out: Path) -> Path:
    """Query the store and write the report to ``out``; returns the path written."""
    html = render_report(report_data(run_query, request))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out
