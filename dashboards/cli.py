"""``witcert dashboards export DIR`` and ``witcert dashboards push --grafana URL``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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
        print(f"witcert dashboards export: {error}", file=sys.stderr)
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
        print(f"witcert dashboards push: {error}", file=sys.stderr)
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
        config = CollectorConfig(store_url=args.store, otlp_http=args.listen, otlp_grpc=args.otlp_grpc)
    except ValueError as error:
        print(f"witcert dashboards serve: {error}", file=sys.stderr)
        return 2
    collector = Collector(config, extra_routes=routes())
    try:
        ports = collector.start()
    except (StoreError, SpoolBusy, OSError) as error:
        print(f"witcert dashboards serve: {error}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    host, _ = parse_listen_address(args.listen)
    print(f"witcert dashboards: http://{host}:{ports.http}{PREFIX}/ (OTLP/HTTP on the same port)", flush=True)
    stop.wait()
    collector.stop()
    return 0


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
