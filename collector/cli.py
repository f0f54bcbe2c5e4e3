"""``witcert collector``, ``witcert query`` and ``witcert schema``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from witcert.collector.config import DEFAULT_GRPC, DEFAULT_HTTP, CollectorConfig, Retention, default_store_url
from witcert.collector.queries import REPORTS
from witcert.errors import one_line

_QUERY_HELP = """reports:
  coverage       coverage over time (covered / certificates at the engine's tau; at --tau from samples)
  heatmap        per layer x head: certificates, coverage, fallbacks (with --tau: from samples, p99, max)
  worst-heads    heads with the lowest coverage, --limit of them
  samples        raw sampled certificates in the window (--layer/--head filter, --limit rows)
  fallback-rate  fallbacks / certificates over time, bytes repaired
  tau            the tau each engine instance reported last

examples:
  witcert query coverage --from=-6h --tau 0.05   (relative times need the = form)
  witcert query worst-heads --url http://127.0.0.1:4318 --format json
"""

_DEAD_LETTER_HELP = """actions:
  list     each dead record: name, points, tables, since when, the store's reason
  show     the rows of the named records (all when none is named), as JSON
  replay   put the named records (all when none is named) back for the drain; fix the cause first
  drop     delete the named records for good

example:
  witcert dead-letter list --spool /var/lib/witcert/chdb.spool
  witcert dead-letter replay --spool /var/lib/witcert/chdb.spool     (all of them)
"""


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as error:
        raise SystemExit(f"cannot read the token file {path}: {error.strerror}") from None
    if not token:
        raise SystemExit(f"the token file {path} is empty")
    return token


_RETENTION_FIELDS = ("raw_days", "samples_days", "rollup_1m_days", "rollup_1h_days")


def _retention_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Retention()
    group = parser.add_argument_group(
        "retention (days; applied when the schema is first created; points older are rejected)"
    )
    for name, help_text in zip(
        _RETENTION_FIELDS,
        ("otel_metrics_* raw tables", "certificate samples", "1-minute rollups", "1-hour rollups"),
        strict=True,
    ):
        flag = "--" + name.replace("_", "-")
        group.add_argument(flag, type=int, default=None, help=f"{help_text} (default {getattr(defaults, name)})")


def _retention(args: argparse.Namespace, base: Retention | None = None) -> Retention:
    given = {name: getattr(args, name) for name in _RETENTION_FIELDS if getattr(args, name) is not None}
    return (base or Retention()).model_copy(update=given) if given else (base or Retention())


def register(subparsers: argparse._SubParsersAction) -> None:
    collector = subparsers.add_parser(
        "collector",
        help="receive OTLP metrics and store them in ClickHouse or chDB",
        description=(
            "Receive OTLP metrics (HTTP: protobuf or JSON, gzip; gRPC), spool them durably, store them in "
            "ClickHouse or the embedded chDB engine, and serve /healthz, /readyz and the read API /api/v1."
        ),
    )
    collector.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a JSON or YAML file of collector settings (CollectorConfig: limits, retention, batching); "
        "the options below override it",
    )
    collector.add_argument(
        "--store",
        default=None,
        help=f"chdb:///path (embedded, default {default_store_url()}) or clickhouse://user:pass@host:8123/db",
    )
    collector.add_argument("--otlp-http", default=None, help=f"OTLP/HTTP listen address (default {DEFAULT_HTTP})")
    collector.add_argument("--otlp-grpc", default=None, help=f"OTLP/gRPC listen address (default {DEFAULT_GRPC})")
    collector.add_argument("--no-grpc", action="store_true", help="do not start the gRPC receiver")
    collector.add_argument("--spool", type=Path, default=None, help="spool directory (default: next to the data)")
    collector.add_argument("--token-file", default=None, help="file holding the bearer token clients must send")
    collector.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    collector.add_argument(
        "--print-config",
        action="store_true",
        help="print the settings in force and the most memory they let the collector's work hold, then exit",
    )
    _retention_arguments(collector)
    collector.set_defaults(handler=_run_collector)

    dead = subparsers.add_parser(
        "dead-letter",
        help="list, show, replay or drop spooled requests the store refused",
        description=(
            "Records the store refused for a reason of their rows (not an outage) are kept in the\n"
            "spool's dead/ folder, so that they never block the ones behind them. Replay puts them back\n"
            "for the drain: the running collector, or the next to start, stores them under the same\n"
            "labels, so nothing of a record is stored twice."
        ),
        epilog=_DEAD_LETTER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dead.add_argument("action", choices=["list", "show", "replay", "drop"], help="what to do (below)")
    dead.add_argument("names", nargs="*", metavar="NAME", help="records, named as list prints them")
    where = dead.add_mutually_exclusive_group()
    where.add_argument("--spool", type=Path, default=None, help="the collector's spool directory")
    where.add_argument(
        "--store", default=None, help="the collector's store, to find its spool (default: the default store's)"
    )
    dead.add_argument("--format", default="table", choices=["table", "json"], help="how list prints (default table)")
    dead.set_defaults(handler=_run_dead_letter)

    query = subparsers.add_parser(
        "query",
        help="read coverage, heat maps, worst heads, samples and fallback rates",
        description="Read certificate history from the store, or from a running collector's API (--url).",
        epilog=_QUERY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    query.add_argument("report", choices=list(REPORTS), help="which report (below)")
    source = query.add_mutually_exclusive_group()
    source.add_argument("--store", default=None, help=f"open the store directly (default {default_store_url()})")
    source.add_argument("--url", default=None, help="ask a running collector instead, e.g. http://127.0.0.1:4318")
    query.add_argument("--token-file", default=None, help="bearer token for --url")
    query.add_argument(
        "--from", dest="start", default="-1h", help="ISO-8601, 'now' or relative like -15m (default -1h)"
    )
    query.add_argument("--to", dest="end", default="now", help="ISO-8601, 'now' or relative (default now)")
    query.add_argument("--model", default="", help="only this model (witcert.model)")
    query.add_argument("--instance", default="", help="only this engine instance (service.instance.id)")
    query.add_argument("--tau", type=float, default=None, help="coverage at this tau, from the sampled values")
    query.add_argument("--interval", type=int, default=None, help="seconds per time bucket (default: automatic)")
    query.add_argument("--limit", type=int, default=20, help="rows for worst-heads and samples (default 20)")
    query.add_argument("--layer", type=int, default=None, help="samples: only this layer")
    query.add_argument("--head", type=int, default=None, help="samples: only this head")
    query.add_argument("--format", default="table", choices=["table", "json", "csv"], help="output format")
    query.set_defaults(handler=_run_query)

    schema = subparsers.add_parser(
        "schema",
        help="print the storage DDL (single node, or a cluster with --cluster)",
        description=(
            "Print the schema the collector applies. With --cluster: Replicated local tables, views on each "
            "node and Distributed front tables, every statement ON CLUSTER (see docs/STORAGE.md)."
        ),
    )
    schema.add_argument("--cluster", default=None, help="ClickHouse cluster name (remote_servers)")
    schema.add_argument("--database", default="default", help="database for the cluster tables")
    _retention_arguments(schema)
    schema.set_defaults(handler=_run_schema)


def _collector_config(args: argparse.Namespace) -> CollectorConfig:
    fields: dict = {}
    if args.config is not None:
        fields = _read_config_file(args.config)
    overrides = {
        "store_url": args.store,
        "otlp_http": args.otlp_http,
        "otlp_grpc": args.otlp_grpc,
        "spool_dir": args.spool,
        "token": _read_token(args.token_file),
    }
    fields.update({name: value for name, value in overrides.items() if value is not None})
    if args.no_grpc:
        fields["otlp_grpc"] = None
    config = CollectorConfig(**fields)
    retention = _retention(args, config.retention)
    return config.model_copy(update={"retention": retention}) if retention != config.retention else config


def _read_config_file(path: Path) -> dict:
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))  # YAML reads JSON too
    except OSError as error:
        raise ValueError(f"cannot read the config file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"the config file {path} is not JSON or YAML: {error}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"the config file {path} must hold a mapping of settings")
    return loaded


def _run_collector(args: argparse.Namespace) -> int:
    from witcert.collector.service import Collector
    from witcert.collector.spool import SpoolBusy, SpoolFormatError

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # While the store is down, every reconnection attempt would log urllib3's retry chain; the
    # collector says once that the store is unavailable, and /readyz says why.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    try:
        config = _collector_config(args)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        print(f"witcert collector: {one_line(error)}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.model_dump_json(indent=2))
        print(f"working memory bound: {config.working_memory_bytes() / 2**20:.0f} MiB on top of the idle process")
        return 0
    collector = Collector(config)
    try:
        ports = collector.start()
    except (SpoolBusy, SpoolFormatError, OSError) as error:
        print(f"witcert collector: {one_line(error)}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    listening = []
    if ports.http is not None:
        listening.append(f"OTLP/HTTP {config.otlp_http.rsplit(':', 1)[0]}:{ports.http}")
    if ports.grpc is not None:
        listening.append(f"OTLP/gRPC {config.otlp_grpc.rsplit(':', 1)[0]}:{ports.grpc}")
    ready, report = collector.pipeline.readiness()
    state = "" if ready else f"; not ready: {report['reason']}"
    print(
        f"witcert collector: {', '.join(listening)}; store {collector.store.location.describe()}; "
        f"spool {config.resolved_spool_dir()}{state}",
        flush=True,
    )
    stop.wait()
    collector.stop()
    return 0


def _run_dead_letter(args: argparse.Namespace) -> int:
    from witcert.collector import spool

    if args.spool is not None:
        spool_dir = args.spool
    else:
        spool_dir = CollectorConfig(store_url=args.store or default_store_url()).resolved_spool_dir()
    if not (spool_dir / spool.DEAD).is_dir():
        print(f"witcert dead-letter: no spool at {spool_dir}", file=sys.stderr)
        return 1
    letters = spool.dead_letters(spool_dir)
    known = {letter.name for letter in letters}
    unknown = [name for name in args.names if name not in known]
    if unknown:
        print(f"witcert dead-letter: no dead record {unknown[0]!r} in {spool_dir}", file=sys.stderr)
        return 1
    chosen = [letter for letter in letters if not args.names or letter.name in args.names]
    if args.action == "list":
        if args.format == "json":
            print(json.dumps([vars(letter) for letter in chosen]))
        else:
            _print_dead_letters(chosen)
    elif args.action == "show":
        rows = {letter.name: spool.read_dead_letter(spool_dir, letter.name) for letter in chosen}
        print(json.dumps(rows, default=str))
    elif args.action == "replay":
        moved = spool.requeue_dead_letters(spool_dir, args.names or None)
        print(f"{len(moved)} record(s) put back for the drain of {spool_dir}")
    else:
        if not args.names:
            print("witcert dead-letter: drop needs the names of the records to delete", file=sys.stderr)
            return 2
        dropped = spool.drop_dead_letters(spool_dir, args.names)
        print(f"{len(dropped)} record(s) deleted")
    return 0


def _print_dead_letters(letters) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dead letters")
    for column in ("name", "points", "tables", "since", "reason"):
        table.add_column(column, overflow="fold")
    for letter in letters:
        table.add_row(letter.name, str(letter.points), ", ".join(letter.tables), letter.dead_since, letter.reason)
    Console(width=200).print(table)
    if not letters:
        print("(no dead letters)")


def _run_query(args: argparse.Namespace) -> int:
    from witcert.collector import api
    from witcert.collector.queries import QueryError, QueryResult

    params = {
        "from": args.start,
        "to": args.end,
        "model": args.model,
        "instance": args.instance,
        "tau": "" if args.tau is None else repr(args.tau),
        "interval": "" if args.interval is None else str(args.interval),
        "limit": str(args.limit),
        "layer": "" if args.layer is None else str(args.layer),
        "head": "" if args.head is None else str(args.head),
    }
    try:
        if args.url:
            result = _query_over_http(args.url, args.report, params, _read_token(args.token_file))
        else:
            result = _query_store(args.store or default_store_url(), args.report, params)
    except (QueryError, RuntimeError) as error:  # StoreError is a RuntimeError
        print(f"witcert query: {one_line(error)}", file=sys.stderr)
        return 1
    assert isinstance(result, QueryResult)
    if args.format == "json":
        print(api.to_json(result))
    elif args.format == "csv":
        sys.stdout.write(api.to_csv(result))
    else:
        _print_table(result)
    return 0


def _query_store(url: str, report: str, params: dict[str, str]):
    from witcert.collector import api, tables
    from witcert.collector.queries import Queries
    from witcert.collector.store import Store, parse_store_url

    window = api.window_from_params(params)
    location = parse_store_url(url)
    if location.kind == "chdb" and not (location.path and location.path.exists()):
        raise RuntimeError(f"no chDB store at {location.path}: start `witcert collector --store {url}` first")
    store = Store(url, migrate=False)
    try:
        _, rows = store.query(f"EXISTS TABLE {tables.SCHEMA_MIGRATIONS}")
        if rows != [(1,)]:
            hint = f"run `witcert collector --store {url}` once"
            raise RuntimeError(f"{location.describe()} has no witcert schema: {hint}")
        return Queries(store).run(report, window)
    finally:
        store.close()


def _query_over_http(base_url: str, report: str, params: dict[str, str], token: str | None):
    from witcert.collector.queries import QueryResult

    query = urllib.parse.urlencode({name: value for name, value in params.items() if value != ""})
    request = urllib.request.Request(f"{base_url.rstrip('/')}/api/v1/{report}?{query}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            payload = json.load(response)
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        raise RuntimeError(f"{base_url} answered {error.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as error:
        raise RuntimeError(f"cannot reach {base_url}: {error}") from None
    columns = payload["columns"]
    rows = [tuple(record[column] for column in columns) for record in payload["rows"]]
    return QueryResult(payload["report"], columns, rows)


def _print_table(result) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=result.report, show_lines=False)
    for column in result.columns:
        table.add_column(column)
    for row in result.rows:
        table.add_row(*[_cell(value) for value in row])
    Console().print(table)
    if not result.rows:
        print("(no rows in this window)")


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _run_schema(args: argparse.Namespace) -> int:
    from witcert.collector import migrations

    retention = _retention(args)
    try:
        if args.cluster:
            sys.stdout.write(migrations.cluster_ddl(args.cluster, args.database, retention))
            return 0
        for migration in migrations.load_migrations():
            print(f"-- migration {migration.version:04d}_{migration.name}")
            for statement in migrations.render_statements(migration, retention):
                print(statement + ";\n")
    except ValueError as error:
        print(f"witcert schema: {one_line(error)}", file=sys.stderr)
        return 2
    return 0
