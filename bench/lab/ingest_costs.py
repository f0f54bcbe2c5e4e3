"""Where a collector's CPU goes: the HTTP server, chDB's per-insert cost, the collector's threads.

Three measurements behind the "Performance" section of docs/COLLECTOR.md:

- ``http``: a bare server that reads each POST body (in 256 KiB reads, as the collector does) and
  answers 200, in a child process: the standard library's ``ThreadingHTTPServer`` (the collector
  before aiohttp) against aiohttp with the collector's settings. Two client threads over keep-alive
  connections send ``--http-requests`` bodies of 0.94 MB (a replay request, 16,384 samples) and of
  29 KB (512 samples); the server process's CPU per request.
- ``inserts``: chDB inserts of one request's sample rows (512 and 16,384 rows) into the samples
  table with a deduplication label (what the drain does), without deduplication, and into a bare
  MergeTree of the same columns; wall and process CPU (merges included) per insert, after 100
  warm-up inserts.
- ``threads``: a ``witcert collector`` process (``bench_ingest.start_collector``) under
  ``bench_ingest``'s replay load (16,384 samples a request) and its replay_small load (512), CPU
  per stored sample by thread name: chDB names its threads (``MergeMutate`` merges parts,
  ``ThreadPool`` runs queries), Python's are ``python``. ``--baseline-pythonpath`` adds an earlier
  collector (threads that exit during a load, such as ``http.server``'s thread per connection,
  are not counted).

    python bench/lab/ingest_costs.py [--baseline-pythonpath DIR]

Results: ``bench/results/ingest_costs.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.client
import json
import multiprocessing
import os
import platform
import re
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_ingest  # noqa: E402

from witcert.collector import otlp, tables  # noqa: E402
from witcert.collector.config import CONNECTION_BUFFER_BYTES, Limits  # noqa: E402
from witcert.collector.loadgen import samples_request  # noqa: E402
from witcert.collector.store import Store  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
_READ_STEP = 256 * 1024


# --- http -------------------------------------------------------------------------------------


class _Reader(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
        left = int(self.headers["Content-Length"])
        while left:
            left -= len(self.rfile.read(min(left, _READ_STEP)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _serve_stdlib(ready) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Reader)
    server.daemon_threads = True
    ready.send(server.server_address[1])
    server.serve_forever()


def _serve_aiohttp(ready) -> None:
    from aiohttp import web

    limits = Limits()

    async def handle(request: web.Request) -> web.Response:
        while await request.content.read(_READ_STEP):
            pass
        return web.Response(status=200)

    async def serve() -> None:
        app = web.Application(client_max_size=limits.max_body_bytes)
        app.router.add_route("POST", "/v1/metrics", handle)
        runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=limits.header_timeout_s,
            lingering_time=limits.body_timeout_s,
            read_bufsize=CONNECTION_BUFFER_BYTES // 2,
            auto_decompress=False,
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ready.send(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(serve())


def http_cost(server: str, body: bytes, requests: int) -> dict:
    parent, child = multiprocessing.Pipe()
    target = _serve_stdlib if server == "http.server" else _serve_aiohttp
    process = multiprocessing.get_context("spawn").Process(target=target, args=(child,), daemon=True)
    process.start()
    port = parent.recv()
    assert process.pid is not None

    def client(count: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port)
        headers = {"Content-Type": "application/x-protobuf"}
        for _ in range(count):
            connection.request("POST", "/v1/metrics", body=body, headers=headers)
            response = connection.getresponse()
            response.read()
            assert response.status == 200
        connection.close()

    client(20)  # warm-up
    cpu_before = bench_ingest.cpu_seconds(process.pid)
    began = time.perf_counter()
    workers = [threading.Thread(target=client, args=(requests // 2,)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - began
    cpu = bench_ingest.cpu_seconds(process.pid) - cpu_before
    process.kill()
    process.join()
    sent = 2 * (requests // 2)
    return {
        "server": server,
        "body_bytes": len(body),
        "requests": sent,
        "server_cpu_ms_per_request": round(cpu / sent * 1000, 3),
        "server_cpu_us_per_mb": round(cpu / (sent * len(body) / 1e6) * 1e6, 1),
        "requests_per_s": round(sent / wall),
    }


# --- inserts ----------------------------------------------------------------------------------


def insert_cost(rows_per_insert: int, inserts: int) -> list[dict]:
    heads = rows_per_insert // (16 * 4)
    now = time.time_ns()
    batches = [
        otlp.convert_request(
            samples_request("m", "n", 4, heads, range(i * 16, (i + 1) * 16), now), Limits()
        ).rows.columns[tables.CERTIFICATE_SAMPLES]
        for i in range(100 + 3 * inserts)
    ]
    results = []
    with tempfile.TemporaryDirectory(prefix="witcert-lab-") as tmp:
        store = Store(f"chdb://{tmp}/chdb")
        try:
            store.command(
                f"CREATE TABLE bare AS {tables.CERTIFICATE_SAMPLES} ENGINE = MergeTree "
                "PARTITION BY toDate(Timestamp) ORDER BY (Model, Layer, Head, Timestamp)"
            )
            client = store.client
            assert client is not None
            for index, columns in enumerate(batches[:100]):
                store.insert_columns(tables.CERTIFICATE_SAMPLES, columns, token=f"warm-{index}")
            variants = (
                ("labelled (the drain's insert)", tables.CERTIFICATE_SAMPLES, True),
                ("no deduplication", tables.CERTIFICATE_SAMPLES, False),
                ("bare MergeTree, no deduplication", "bare", False),
            )
            for number, (label, table, labelled) in enumerate(variants):
                chosen = batches[100 + number * inserts : 100 + (number + 1) * inserts]
                began, cpu_before = time.perf_counter(), time.process_time()
                for index, columns in enumerate(chosen):
                    if labelled:
                        store.insert_columns(table, columns, token=f"{number}-{index}")
                    else:
                        names = list(columns)
                        client.insert(
                            table,
                            [columns[name] for name in names],
                            column_names=names,
                            column_oriented=True,
                            settings={"insert_deduplicate": 0},
                        )
                results.append(
                    {
                        "rows_per_insert": rows_per_insert,
                        "insert": label,
                        "wall_ms_per_insert": round((time.perf_counter() - began) / inserts * 1000, 2),
                        "process_cpu_ms_per_insert": round((time.process_time() - cpu_before) / inserts * 1000, 2),
                    }
                )
        finally:
            store.close()
    return results


# --- threads ----------------------------------------------------------------------------------


def _thread_cpu(pid: int) -> collections.Counter:
    """CPU seconds per thread name (digits at the end dropped)."""
    found: collections.Counter = collections.Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = re.sub(r"\d+$", "", stat[stat.index("(") + 1 : stat.rindex(")")])
        fields = stat.rsplit(")", 1)[1].split()
        found[name] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def thread_cost(pythonpath: str | None, seconds: float) -> dict:
    args = argparse.Namespace(seconds=seconds, clients=2, steps=16, gzip=False)
    loads = {"replay": (32, 32, 400), "replay_small": (4, 8, 6000)}
    result = {}
    for load, (layers, heads, count) in loads.items():
        with tempfile.TemporaryDirectory(prefix="witcert-lab-") as tmp:
            process, port = bench_ingest.start_collector(Path(tmp), pythonpath)
            try:
                before = _thread_cpu(process.pid)
                figures = bench_ingest.run_replay(port, process.pid, args, load, layers, heads, count)
                after = _thread_cpu(process.pid)
            finally:
                process.terminate()
                process.wait(timeout=120)
        stored = figures["stored_points"]
        result[load] = {
            "stored_points_per_s": figures["stored_points_per_s"],
            "collector_cpu_us_per_point": figures["collector_cpu_us_per_point"],
            "load_average_1m_at_start": figures["load_average_1m_at_start"],
            "threads_cpu_us_per_point": {
                name: round((after[name] - before.get(name, 0.0)) / stored * 1e6, 2)
                for name in sorted(after, key=lambda n: before.get(n, 0.0) - after[n])
                if after[name] - before.get(name, 0.0) > 0.01
            },
        }
    return result


def markdown(report: dict) -> str:
    lines = ["# Where a collector's CPU goes", "", f"{report['when']} on {report['machine']}.", ""]
    lines += [
        "| server | body bytes | server CPU ms/request | server CPU us/MB | requests/s |",
        "|---|---|---|---|---|",
    ]
    for row in report["http"]:
        lines.append(
            f"| {row['server']} | {row['body_bytes']:,} | {row['server_cpu_ms_per_request']} | "
            f"{row['server_cpu_us_per_mb']} | {row['requests_per_s']} |"
        )
    lines += ["", "| rows/insert | insert | wall ms/insert | process CPU ms/insert |", "|---|---|---|---|"]
    for row in report["inserts"]:
        lines.append(
            f"| {row['rows_per_insert']:,} | {row['insert']} | {row['wall_ms_per_insert']} | "
            f"{row['process_cpu_ms_per_insert']} |"
        )
    lines += [
        "",
        "| collector | load | stored samples/s | CPU us/sample | by thread (us/sample) |",
        "|---|---|---|---|---|",
    ]
    for label, loads in report["threads"].items():
        for load, row in loads.items():
            threads = ", ".join(f"{name} {value}" for name, value in row["threads_cpu_us_per_point"].items())
            rate, cpu = row["stored_points_per_s"], row["collector_cpu_us_per_point"]
            lines.append(f"| {label} | {load} | {rate:,} | {cpu} | {threads} |")
    lines += ["", "Method: see the docstring of bench/lab/ingest_costs.py.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--http-requests", type=int, default=400)
    parser.add_argument("--inserts", type=int, default=200, help="inserts per variant")
    parser.add_argument("--seconds", type=float, default=15.0, help="duration of each collector load")
    parser.add_argument("--baseline-pythonpath", default=None)
    parser.add_argument("--baseline-label", default="before: 31a973e")
    parser.add_argument("--label", default="this checkout")
    args = parser.parse_args()
    report: dict = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
        "command": "python bench/lab/ingest_costs.py " + " ".join(sys.argv[1:]),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
    }
    now = time.time_ns()
    bodies = [
        samples_request("m", "n", layers, heads, range(16), now).SerializeToString()
        for layers, heads in ((32, 32), (4, 8))
    ]
    report["http"] = [
        http_cost(server, body, args.http_requests if len(body) > 100_000 else 10 * args.http_requests)
        for body in bodies
        for server in ("http.server", "aiohttp")
    ]
    print(json.dumps(report["http"]), flush=True)
    report["inserts"] = insert_cost(512, args.inserts) + insert_cost(16_384, max(10, args.inserts // 10))
    print(json.dumps(report["inserts"]), flush=True)
    variants = {args.label: None}
    if args.baseline_pythonpath:
        variants[args.baseline_label] = args.baseline_pythonpath
    report["threads"] = {label: thread_cost(path, args.seconds) for label, path in variants.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ingest_costs.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "ingest_costs.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
