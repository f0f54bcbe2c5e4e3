"""The built-in page, end to end: engines' telemetry (``fleet.py``: the real aggregator and OTLP stream
with chosen certificates) reaches a running witcert collector with the page mounted through its route
hook; every page API answer equals the figure computed from the certificates sent; headless Chromium
(Debian ``chromium``) loads the page with no console message, fills every panel, and the numbers it
renders are those figures.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from urllib.parse import quote, urlencode

import fleet
import pytest
from fleet import INSTANCES, MODEL, NOW
from test_dashboards import WHAT_IF_TAUS, assert_rows_equal

from witcert.collector.config import CollectorConfig
from witcert.collector.service import Collector
from witcert.collector.store import Store
from witcert.dashboards import page, panels, report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_a_store_without_the_schema_gets_a_502_not_a_crash(tmp_path: Path):
    # Runs before the module's collector opens its store: chDB holds one data path per process.
    store = Store(f"chdb://{tmp_path / 'empty'}", migrate=False)
    try:
        response = page.DashboardPage(store.query).handle("/dashboard/api/panels/coverage_now", {})
    finally:
        store.close()
    assert response is not None and response.status == 502
    assert "witcert_" in json.loads(response.body)["error"]  # names the missing table


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("page")
    config = CollectorConfig(
        store_url=f"chdb://{root / 'store'}", otlp_http="127.0.0.1:0", otlp_grpc=None, spool_dir=root / "spool"
    )
    with Collector(config, extra_routes=page.routes()) as collector:
        records = fleet.send(f"http://127.0.0.1:{collector.ports.http}/v1/metrics")
        assert collector.wait_stored(60)
        yield f"http://127.0.0.1:{collector.ports.http}{page.PREFIX}", fleet.Fleet(records), collector


@pytest.fixture(scope="module")
def base_url(served) -> str:
    return served[0]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def window(**params: str) -> str:
    return urlencode({"from": str(int(NOW.timestamp()) - 7200), "to": str(int(NOW.timestamp())), **params})


def test_layout_lists_panels_and_the_stores_variables(base_url: str):
    status, layout = get(f"{base_url}/api/layout?{window()}")
    assert status == 200
    assert [p["key"] for p in layout["panels"]] == [spec.key for spec in panels.PANELS]
    options = {v["name"]: v["options"] for v in layout["variables"]}
    assert options["model"] == [MODEL]
    assert options["instance"] == sorted(INSTANCES)
    assert options["tau"][0] == repr(fleet.TAU)


def _from_json(rows: list[list]) -> list[tuple]:
    return [tuple(float("inf") if value == "+Inf" else value for value in row) for row in rows]


@pytest.mark.parametrize("key", [spec.key for spec in panels.PANELS if spec.key != "export_lag"])
def test_every_page_answer_is_the_figure_computed_from_the_certificates(served, key: str):
    base_url, sent, _ = served
    spec = panels.panel(key)
    taus = WHAT_IF_TAUS if "${tau}" in spec.queries[0].sql else (None,)
    for tau in taus:
        status, data = get(f"{base_url}/api/panels/{key}?{window(**({'tau': tau} if tau else {}))}")
        assert status == 200, data
        (result,) = data["results"]
        expected = fleet.expected_answer(sent, key, tau or repr(fleet.TAU))
        assert_rows_equal(_from_json(result["rows"]), expected, f"{key} at tau={tau}")


def test_panel_api_narrows_to_the_selection(served):
    base_url, sent, _ = served
    instances = ["node-b", "node-c"]
    status, data = get(f"{base_url}/api/panels/inf_now?{window(instance=','.join(quote(i) for i in instances))}")
    assert status == 200 and data["results"][0]["rows"] == [
        list(fleet.expected_answer(sent, "inf_now", "", instances)[0])
    ]


@pytest.mark.parametrize(
    ("path", "params", "message"),
    [
        ("api/panels/coverage_now", {"instance": "node-z"}, "no data for 'node-z'"),
        ("api/panels/coverage_now", {"instance": "x') OR 1=1 --"}, "no data for"),
        ("api/panels/coverage_now", {"tau": "abc"}, "tau must be a number"),
        ("api/panels/coverage_now", {"tau": "-1"}, "positive"),
        ("api/panels/no_such_panel", {}, "no panel 'no_such_panel'"),
        ("api/panels/coverage_now", {"points": "0"}, "points must be"),
        ("api/layout", {"from": "later"}, "unix seconds"),
    ],
)
def test_bad_requests_get_a_clear_400(base_url: str, path: str, params: dict, message: str):
    query = window(**params) if "from" not in params else urlencode(params)
    status, body = get(f"{base_url}/{path}?{query}")
    assert status == 400
    assert message in body["error"]


def test_range_must_be_ordered(base_url: str):
    status, body = get(f"{base_url}/api/layout?from=2000&to=1000")
    assert status == 400 and "before" in body["error"]


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("Debian chromium is required for the page test: apt-get install -y chromium")
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--enable-logging=stderr",
        "--v=0", f"--user-data-dir={profile}", "--window-size=1400,2300", "--virtual-time-budget=20000", *args,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def test_page_loads_in_chromium_without_console_messages_and_fills_every_panel(base_url: str, tmp_path: Path):
    dom = assert_loaded_and_filled(_chromium("--dump-dom", f"{base_url}/", profile=tmp_path / "profile"))
    assert dom.count('class="matrix"') == sum(spec.kind == "matrix" for spec in panels.PANELS)

    screenshot = tmp_path / "page.png"
    _chromium(f"--screenshot={screenshot}", f"{base_url}/", profile=tmp_path / "profile-shot")
    image = screenshot.read_bytes()
    assert image.startswith(b"\x89PNG") and len(image) > 50_000  # a blank page compresses to a few kB


def _to_fixed(value: float, digits: int) -> str:
    # JavaScript's toFixed: the exact binary value, ties away from zero.
    return str(Decimal(value).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def page_text(value: float, unit: str) -> str:
    """What page.js's formatValue shows for ``value`` (the same rules, written again here)."""
    if math.isinf(value):
        return "\u221e"
    if unit == "percentunit":
        digits = 3 if abs(value) < 0.01 else 1
        text = _to_fixed(100 * value, digits)
        while digits < 6 and ((value != 1 and float(text) == 100) or (value != 0 and float(text) == 0)):
            digits += 1
            text = _to_fixed(100 * value, digits)
        return text + "%"
    if unit == "none":
        return repr(value)
    if value != 0 and abs(value) < 0.01:
        mantissa, exponent = f"{Decimal(value):.1e}".split("e")
        return f"{mantissa}e{int(exponent):+d}".replace("e+", "e+").replace("+-", "-")
    if float(value).is_integer():
        return str(int(value))
    exponent = Decimal(value).adjusted()  # toPrecision(3): three significant digits, fixed notation here
    return _to_fixed(value, max(0, 2 - exponent))


def _panel_chunks(dom: str) -> dict[str, str]:
    parts = dom.split('<section class="panel" id="panel-')[1:]
    return {part.split('"', 1)[0]: part for part in parts}


def _json_number(text: str) -> float:
    return float("inf") if text == "+Inf" else float(text)


def assert_rendered_figures(dom: str, sent: fleet.Fleet, tau: str) -> None:
    """Every stat, interval and heat-map cell the page rendered shows the figure computed from the
    certificates: its exact value in the element's data attributes, and page.js's formatting of it as text."""
    chunks = _panel_chunks(dom)
    checked = 0
    for spec in panels.PANELS:
        chunk = chunks[spec.key]
        if spec.kind == "stat":
            ((expected,),) = fleet.expected_answer(sent, spec.key, tau)
            found = re.search(r'class="stat" data-value="([^"]*)"[^>]*>([^<]*)<', chunk)
            assert found, spec.key
            assert _json_number(found.group(1)) == expected, spec.key
            assert found.group(2) == page_text(expected, spec.unit), spec.key
        elif spec.kind == "interval":
            ((low, high, exact),) = fleet.expected_answer(sent, spec.key, tau)
            found = re.search(r'class="stat[^"]*" data-at-least="([^"]*)" data-at-most="([^"]*)"[^>]*>([^<]*)<', chunk)
            assert found, spec.key
            assert (_json_number(found.group(1)), _json_number(found.group(2))) == (low, high), spec.key
            text = page_text(low, spec.unit)
            if low != high:
                text = f"between {text} and {page_text(high, spec.unit)}"
            if not exact:
                assert "an interval from the sampled histogram" in chunk or "sampled steps only" in chunk, spec.key
            assert html.unescape(found.group(3)) == text, spec.key
        elif spec.kind == "matrix":
            cells = {
                (int(layer), int(head)): (_json_number(value), html.unescape(shown))
                for value, layer, head, shown in re.findall(
                    r'<td data-value="([^"]*)"[^>]*title="layer (\d+), head (\d+): ([^"]*)"', chunk
                )
            }
            expected_cells = {(layer, head): value for layer, head, value in fleet.expected_answer(sent, spec.key, tau)}
            assert {cell: value for cell, (value, _) in cells.items()} == expected_cells, spec.key
            assert all(shown == page_text(expected_cells[cell], spec.unit) for cell, (_, shown) in cells.items())
        else:
            continue
        checked += 1
    assert checked == sum(spec.kind != "timeseries" for spec in panels.PANELS)
    if tau == "0.04":  # inside a bucket that holds certificates
        assert "between " in chunks["coverage_at_tau"]


def assert_loaded_and_filled(loaded: subprocess.CompletedProcess) -> str:
    # Chromium logs every console message of the page (errors included) as a CONSOLE line.
    console = [line for line in loaded.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], "\n".join(console)
    dom = loaded.stdout
    assert re.search(r'<body[^>]*data-state="ready"', dom), "the page never finished loading"
    states = dict(re.findall(r'id="panel-(\w+)"[^>]*data-state="(\w+)"', dom))
    assert states == {spec.key: "filled" for spec in panels.PANELS}
    assert dom.count("<canvas") >= sum(spec.kind == "timeseries" for spec in panels.PANELS)
    return dom


@pytest.mark.parametrize("tau", ["0.05", "0.04"])
def test_the_numbers_rendered_are_the_exact_figures(served, tmp_path: Path, tau: str):
    base_url, sent, _ = served
    loaded = _chromium("--dump-dom", f"{base_url}/?{window(tau=tau)}", profile=tmp_path / "profile")
    assert_rendered_figures(assert_loaded_and_filled(loaded), sent, tau)


@pytest.mark.parametrize("tau", ["0.05", "0.04"])
def test_a_report_is_one_file_that_renders_the_same_figures(served, tmp_path: Path, tau: str):
    """``witcert report``'s file: opened from disk with no server, it renders every panel with the figures."""
    _, sent, collector = served
    request = report.ReportRequest(NOW - timedelta(hours=2), NOW, tau=tau)
    out = report.write_report(collector.store.query, request, tmp_path / "incident.html")
    text = out.read_text()
    assert not re.search(r'(src|href)="(?!data:)', text)  # nothing to fetch: scripts and styles are inlined
    assert "Copyright" in text and "uPlot" in text  # the vendored licence travels with the inlined code
    loaded = _chromium("--dump-dom", out.as_uri(), profile=tmp_path / "profile")
    assert_rendered_figures(assert_loaded_and_filled(loaded), sent, tau)


def test_a_link_fixes_the_first_view(served, tmp_path: Path):
    """``witcert demo`` prints a link with the range, tau and selection: the page must start there."""
    base_url, sent, _ = served
    link = window(instance=quote("node-b"), tau="0.01")
    dom = _chromium("--dump-dom", f"{base_url}/?{link}", profile=tmp_path / "profile").stdout
    inf_stat = re.search(r'id="panel-inf_now".*?class="stat"[^>]*>([^<]*)<', dom, re.S)
    ((infinite,),) = fleet.expected_answer(sent, "inf_now", "0.01", ["node-b"])
    assert inf_stat and inf_stat.group(1) == str(infinite)
    assert '<option value="0.01" selected="">0.01</option>' in dom
    assert '<option value="linked" selected="">as linked</option>' in dom


def test_dashboards_serve_runs_a_collector_with_the_page(tmp_path: Path):
    with socket.socket() as probe:  # a free port for the child to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "witcert.cli", "dashboards", "serve", "--store", f"chdb://{tmp_path / 'store'}",
               "--listen", f"127.0.0.1:{port}"]  # fmt: skip
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = child.stdout.readline()
        assert f"http://127.0.0.1:{port}/dashboard/" in banner, banner + child.stderr.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/dashboard/", timeout=30) as response:
            assert response.status == 200 and b"uPlot" in response.read()
        status, layout = get(f"http://127.0.0.1:{port}/dashboard/api/layout")
        assert status == 200 and {v["name"]: v["options"] for v in layout["variables"]}["model"] == []
    finally:
        os.kill(child.pid, signal.SIGTERM)
        assert child.wait(timeout=60) == 0
