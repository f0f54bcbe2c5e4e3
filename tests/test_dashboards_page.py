"""The built-in page, end to end: the opentelemetry-sdk's OTLP/HTTP exporter sends to a running
witcert collector with the page mounted through its route hook; the page's API runs the panel SQL;
headless Chromium (Debian ``chromium``) loads the page with no console message and fills every panel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import MetricExportResult
from test_dashboards import INSTANCES, MODEL, NOW, metrics_data

from witcert.collector.config import CollectorConfig
from witcert.collector.service import Collector
from witcert.collector.store import Store
from witcert.dashboards import page, panels

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
def base_url(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("page")
    config = CollectorConfig(
        store_url=f"chdb://{root / 'store'}", otlp_http="127.0.0.1:0", otlp_grpc=None, spool_dir=root / "spool"
    )
    with Collector(config, extra_routes=page.routes()) as collector:
        exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{collector.ports.http}/v1/metrics", timeout=30)
        for instance in INSTANCES:
            assert exporter.export(metrics_data(instance)) is MetricExportResult.SUCCESS
        exporter.shutdown()
        assert collector.wait_stored(60)
        yield f"http://127.0.0.1:{collector.ports.http}{page.PREFIX}"


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
    assert options["instance"] == list(INSTANCES)


def test_panel_api_runs_the_panel_sql_with_the_selection(base_url: str):
    status, data = get(f"{base_url}/api/panels/gate_coverage_now?{window(instance='node-a')}")
    assert status == 200
    assert data["results"][0]["rows"] == [[1.0]]
    status, data = get(f"{base_url}/api/panels/inf_now?{window(instance=quote('node-b') + ',' + quote('node-c'))}")
    assert data["results"][0]["rows"] == [[5 * 4 * 2 * 10]]
    status, data = get(f"{base_url}/api/panels/coverage_heatmap?{window(tau='0.01')}")
    assert {(layer, head): round(v, 9) for layer, head, v in data["results"][0]["rows"]} == {
        (layer, head): round(10 / (10 + layer) * (1 - 50 / 24000), 9) for layer in range(4) for head in range(2)
    }


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
    loaded = _chromium("--dump-dom", f"{base_url}/", profile=tmp_path / "profile")
    # Chromium logs every console message of the page (errors included) as a CONSOLE line.
    console = [line for line in loaded.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], "\n".join(console)
    dom = loaded.stdout
    assert re.search(r'<body[^>]*data-state="ready"', dom), "the page never finished loading"
    states = dict(re.findall(r'id="panel-(\w+)"[^>]*data-state="(\w+)"', dom))
    assert states == {spec.key: "filled" for spec in panels.PANELS}
    charts = dom.count("<canvas")
    assert charts >= sum(spec.kind == "timeseries" for spec in panels.PANELS)
    assert dom.count('class="matrix"') == sum(spec.kind == "matrix" for spec in panels.PANELS)

    screenshot = tmp_path / "page.png"
    _chromium(f"--screenshot={screenshot}", f"{base_url}/", profile=tmp_path / "profile-shot")
    image = screenshot.read_bytes()
    assert image.startswith(b"\x89PNG") and len(image) > 50_000  # a blank page compresses to a few kB


def test_a_link_fixes_the_first_view(base_url: str, tmp_path: Path):
    """``witcert demo`` prints a link with the range, tau and selection: the page must start there."""
    link = window(instance=quote("node-b"), tau="0.01")
    dom = _chromium("--dump-dom", f"{base_url}/?{link}", profile=tmp_path / "profile").stdout
    inf_stat = re.search(r'id="panel-inf_now".*?class="stat"[^>]*>([^<]*)<', dom, re.S)
    assert inf_stat and inf_stat.group(1) == "400"  # node-b alone: 5 degraded minutes x 8 heads x 10
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
