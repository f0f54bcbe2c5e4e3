"""``witcert query --store``: reading a stopped collector's chDB store directly, and clear failures."""

from __future__ import annotations

import json
import socket
import time
from datetime import UTC, datetime, timedelta

from witcert.cli import main as witcert_main
from witcert.collector.config import CollectorConfig
from witcert.collector.loadgen import OtlpHttpClient, samples_request
from witcert.collector.service import Collector


def test_query_a_store_directly(tmp_path, capsys):
    store_url = f"chdb://{tmp_path / 'chdb'}"
    config = CollectorConfig(store_url=store_url, otlp_http="127.0.0.1:0", otlp_grpc=None, batch_max_wait_s=0.02)
    with Collector(config) as collector:
        request = samples_request("direct", "n0", layers=2, heads=2, steps=range(3), time_ns=time.time_ns())
        assert OtlpHttpClient("127.0.0.1", collector.ports.http).post(request.SerializeToString()).status == 200
        assert collector.wait_stored(20)
    assert (tmp_path / "chdb.spool").is_dir()  # the default spool sits next to a chDB store

    until = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()  # steps are stamped 20 ms apart from now
    argv = ["query", "heatmap", "--store", store_url, "--tau", "0.003", "--from=-10m", "--to", until]
    argv += ["--format", "json"]
    assert witcert_main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    # value = (layer + head + step) % 100 / 1000 over steps 0..2, so covered at 0.003: layer + head + step <= 3.
    covered = {(row["layer"], row["head"]): row["covered"] for row in rows}
    assert covered == {(0, 0): 3, (0, 1): 3, (1, 0): 3, (1, 1): 2}

    assert witcert_main(["query", "coverage", "--store", f"chdb://{tmp_path / 'absent'}"]) == 1
    assert "no chDB store at" in capsys.readouterr().err
    assert not (tmp_path / "absent").exists()
    assert witcert_main(["query", "samples", "--store", store_url, "--from", "yesterday"]) == 1
    assert "neither ISO-8601" in capsys.readouterr().err


def test_collector_command_reports_a_busy_port_and_releases_the_store(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["collector", "--store", f"chdb://{tmp_path / 'chdb'}", "--otlp-http", f"127.0.0.1:{port}", "--no-grpc"]
        assert witcert_main(argv) == 1
    assert f"cannot listen for OTLP/HTTP on 127.0.0.1:{port}" in capsys.readouterr().err
    # The failed start closed the store and released its lock: another collector can open it.
    with Collector(CollectorConfig(store_url=f"chdb://{tmp_path / 'chdb'}", otlp_http=None, otlp_grpc=None)):
        pass
