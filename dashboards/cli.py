"""``witcert dashboards export DIR`` and ``witcert dashboards push --grafana URL``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from witcert.errors import one_line

from . import alerts


def _add_threshold_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("alert thresholds")
    group.add_argument(
        "--coverage-target",
        type=float,
        default=alerts.COVERAGE_TARGET,
        help="alert when coverage at the engine's tau stays below this for 5 minutes (default: %(default)s)",
    )
    group.add_argument(
        "--inf-floor",
        type=float,
        default=alerts.INF_FRACTION_FLOOR,
        help="inf-fraction spike: the recent fraction must exceed this (default: %(default)s)",
    )
    group.add_argument(
        "--fallback-floor",
        type=float,
        default=alerts.FALLBACK_RATE_FLOOR,
        help="fallback-rate spike: the recent rate must exceed this (default: %(default)s)",
    )
    group.add_argument(
        "--spike-factor",
        type=float,
        default=alerts.SPIKE_FACTOR,
        help="a spike is this many times the previous hour's rate (default: %(default)s)",
    )
    group.add_argument(
        "--silence",
        type=int,
        default=alerts.SILENCE_S,
        help="seconds without telemetry before an instance is reported silent (default: %(default)s)",
    )


def _receivers(text: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in alerts.RECEIVERS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"choose among {', '.join(alerts.RECEIVERS)}, comma-separated, got {text!r}")
    return kinds


def _add_receiver_option(parser: argparse.ArgumentParser, where: str) -> None:
    variables = "; ".join(f"{kind}: {variable}" for kind, (variable, _, _) in alerts.RECEIVERS.items())
    parser.add_argument(
        "--notify",
        type=_receivers,
        default=alerts.DEFAULT_RECEIVERS,
        metavar="KINDS",
        help=f"receivers of the witcert contact point, comma-separated (default: %(default)s); each reads its "
        f"destination from {where}: {variables}",
    )


def _thresholds(args: argparse.Namespace) -> dict[str, float | int]:
    return {
        "coverage_target": args.coverage_target,
        "inf_fraction_floor": args.inf_floor,
        "fallback_rate_floor": args.fallback_floor,
        "spike_factor": args.spike_factor,
        "silence_s": args.silence,
    }


def _export(args: argparse.Namespace) -> int:
    from .export import export

    try:
        written = export(Path(args.directory), receivers=args.notify, **_thresholds(args))
    except (OSError, ValueError) as error:
        print(f"witcert dashboards export: {one_line(error)}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def _push(args: argparse.Namespace) -> int:
    from .export import ClickHouseConnection
    from .push import PushError, push

    token = os.environ.get("GRAFANA_TOKEN") if args.token is None else args.token
    password = os.environ.get("CLICKHOUSE_READER_PASSWORD", "")
    connection = ClickHouseConnection(
        host=args.clickhouse_host,
        port=args.clickhouse_port,
        protocol=args.clickhouse_protocol,
        database=args.clickhouse_database,
        username=args.clickhouse_user,
        password=password,
        secure=args.clickhouse_secure,
    )
    try:
        report = push(args.grafana, connection, credential=token or None, receivers=args.notify, **_thresholds(args))
    except (PushError, ValueError) as error:
        print(f"witcert dashboards push: {one_line(error)}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from witcert.collector.config import CollectorConfig, parse_listen_address
    from witcert.collector.service import Collector
    from witcert.collector.spool import SpoolBusy
    from witcert.collector.store import StoreError

    from .page import PREFIX, routes

    try:
        parse_listen_address(args.listen)
    except ValueError as error:
        print(f"witcert dashboards serve: --listen {one_line(error)}, e.g. 127.0.0.1:4318", file=sys.stderr)
        return 2
    try:
        config = CollectorConfig(store_url=args.store, otlp_http=args.listen, otlp_grpc=args.otlp_grpc)
    except ValueError as error:
        print(f"witcert dashboards serve: {one_line(error)}", file=sys.stderr)
        return 2
    collector = Collector(config, extra_routes=routes())
    try:
        ports = collector.start()
    except (StoreError, SpoolBusy, OSError) as error:
        print(f"witcert dashboards serve: {one_line(error)}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    host, _ = parse_listen_address(args.listen)
    print(f"witcert dashboards: http://{host}:{ports.http}{PREFIX}/ (OTLP/HTTP on the same port)", flush=True)
    stop.wait()
    collector.stop()
    return 0


def _report(args: argparse.Namespace) -> int:
    from witcert.collector import tables
    from witcert.collector.queries import parse_time
    from witcert.collector.store import Store, parse_store_url

    from .report import ReportRequest, write_report

    start, end = parse_time(args.start), parse_time(args.end)
    if not start < end:
        raise ValueError(f"--from ({start.isoformat()}) must be before --to ({end.isoformat()})")
    if args.tau is not None and not (args.tau > 0 and args.tau != float("inf")):
        raise ValueError(f"--tau must be a positive number, got {args.tau}")
    location = parse_store_url(args.store)
    if location.kind == "chdb" and not (location.path and location.path.exists()):
        raise ValueError(f"no chDB store at {location.path}: give --store the store a collector or the demo wrote")
    store = Store(args.store, migrate=False)
    try:
        if store.query(f"EXISTS TABLE {tables.SCHEMA_MIGRATIONS}")[1] != [(1,)]:
            raise ValueError(f"{location.describe()} has no witcert schema: is --store the store a collector wrote?")
        request = ReportRequest(
            start, end, args.model or (), args.instance or (), None if args.tau is None else repr(args.tau)
        )
        out = write_report(store.query, request, Path(args.out))
    finally:
        store.close()
    print(out)
    return 0


def _register_report(subparsers: argparse._SubParsersAction, default_store: str) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write the dashboard's panels for a time range as one self-contained HTML file",
        description="Write the built-in page's panels for a time range and selection into one HTML file: data "
        "embedded, scripts inlined, no server or network needed to open it (the file to attach to an incident).",
    )
    parser.add_argument("--store", default=default_store, help="store URL (default %(default)s)")
    parser.add_argument("--out", required=True, metavar="FILE.html", help="the HTML file to write")
    parser.add_argument(
        "--from", dest="start", default="-6h", help="ISO-8601, 'now' or relative like -6h (default -6h)"
    )
    parser.add_argument("--to", dest="end", default="now", help="ISO-8601, 'now' or relative (default now)")
    parser.add_argument("--model", action="append", help="only this model (repeatable; default: all)")
    parser.add_argument("--instance", action="append", help="only this instance (repeatable; default: all)")
    parser.add_argument(
        "--tau", type=float, default=None, help="tau of the what-if coverage panels (default: the engines' own)"
    )
    parser.set_defaults(handler=_report)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dashboards",
        help="Grafana dashboards and alert rules: export provisioning files, or push to a Grafana",
        description="Grafana dashboards and alert rules for witcert, generated from the same panel SQL the "
        "built-in page runs.",
    )
    commands = parser.add_subparsers(dest="dashboards_command", metavar="ACTION")
    parser.set_defaults(handler=lambda _args: parser.print_help() or 2)

    export_parser = commands.add_parser(
        "export",
        help="write Grafana provisioning files (datasource, dashboard, alert rules) under DIR",
        description="Write DIR/provisioning/{datasources,dashboards,alerting}/*.yaml and DIR/dashboards/*.json: "
        "mount DIR/provisioning at /etc/grafana/provisioning and DIR/dashboards at "
        "/var/lib/grafana/dashboards/witcert. The ClickHouse connection is read from the environment of "
        "Grafana (CLICKHOUSE_HOST, CLICKHOUSE_DATABASE, CLICKHOUSE_READER_USER, "
        "CLICKHOUSE_READER_PASSWORD).",
    )
    export_parser.add_argument("directory", metavar="DIR", help="output directory (created if missing)")
    _add_threshold_options(export_parser)
    _add_receiver_option(export_parser, "Grafana's environment (the files hold $VARIABLE references)")
    export_parser.set_defaults(handler=_export)

    push_parser = commands.add_parser(
        "push",
        help="create or update the datasource, folder, dashboard and alert rules in a running Grafana",
        description="Idempotent: objects have fixed uids and are updated in place. Credentials: --token "
        "(or GRAFANA_TOKEN), or user:password in the URL. The ClickHouse reader's password is read from "
        "CLICKHOUSE_READER_PASSWORD.",
    )
    push_parser.add_argument(
        "--grafana", required=True, metavar="URL", help="Grafana base URL, e.g. http://admin:admin@localhost:3000"
    )
    push_parser.add_argument("--token", default=None, help="Grafana API or service-account token")
    push_parser.add_argument(
        "--clickhouse-host", default="clickhouse", help="ClickHouse host as Grafana reaches it (default: %(default)s)"
    )
    push_parser.add_argument("--clickhouse-port", type=int, default=8123, help="(default: %(default)s)")
    push_parser.add_argument(
        "--clickhouse-protocol", choices=("http", "native"), default="http", help="(default: %(default)s)"
    )
    push_parser.add_argument("--clickhouse-secure", action="store_true", help="connect to ClickHouse over TLS")
    push_parser.add_argument("--clickhouse-database", default="default", help="(default: %(default)s)")
    push_parser.add_argument(
        "--clickhouse-user", default="witcert_reader", help="a read-only ClickHouse user (default: %(default)s)"
    )
    _add_threshold_options(push_parser)
    _add_receiver_option(push_parser, "this command's environment")
    push_parser.set_defaults(handler=_push)

    from witcert.collector.config import DEFAULT_HTTP, default_store_url

    serve_parser = commands.add_parser(
        "serve",
        help="run a collector on a store with the built-in dashboard page mounted (no Grafana needed)",
        description="Start the witcert collector with the read-only dashboard page at /dashboard/. It also "
        "receives OTLP like `witcert collector` (one process per chDB store: stop the other collector first).",
    )
    serve_parser.add_argument("--store", default=default_store_url(), help="store URL (default %(default)s)")
    serve_parser.add_argument(
        "--listen", default=DEFAULT_HTTP, help="HTTP address for the page and OTLP/HTTP (default %(default)s)"
    )
    serve_parser.add_argument(
        "--otlp-grpc", default=None, metavar="HOST:PORT", help="also receive OTLP/gRPC here (default: off)"
    )
    serve_parser.set_defaults(handler=_serve)
    _register_report(subparsers, default_store_url())
