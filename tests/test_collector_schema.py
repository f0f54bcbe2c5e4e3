"""Schema: migrations on real chDB, exporter compatibility, the cluster DDL, store URLs and the path lock."""

from __future__ import annotations

import subprocess
import sys

import pytest

from witcert.cli import main as witcert_main
from witcert.collector import migrations, tables
from witcert.collector.config import Retention
from witcert.collector.store import Store, StoreError, parse_store_url

# The OpenTelemetry Collector (contrib) ClickHouse exporter's columns, in its order
# (exporter/clickhouseexporter/internal/sqltemplates/metrics_*_table.sql).
_EXPORTER_COMMON = [
    ("ResourceAttributes", "Map(LowCardinality(String), String)"),
    ("ResourceSchemaUrl", "String"),
    ("ScopeName", "String"),
    ("ScopeVersion", "String"),
    ("ScopeAttributes", "Map(LowCardinality(String), String)"),
    ("ScopeDroppedAttrCount", "UInt32"),
    ("ScopeSchemaUrl", "String"),
    ("ServiceName", "LowCardinality(String)"),
    ("MetricName", "String"),
    ("MetricDescription", "String"),
    ("MetricUnit", "String"),
    ("Attributes", "Map(LowCardinality(String), String)"),
    ("StartTimeUnix", "DateTime64(9)"),
    ("TimeUnix", "DateTime64(9)"),
]
_EXEMPLARS = [
    ("Exemplars.FilteredAttributes", "Array(Map(LowCardinality(String), String))"),
    ("Exemplars.TimeUnix", "Array(DateTime64(9))"),
    ("Exemplars.Value", "Array(Float64)"),
    ("Exemplars.SpanId", "Array(String)"),
    ("Exemplars.TraceId", "Array(String)"),
]
EXPORTER_COLUMNS = {
    "otel_metrics_gauge": _EXPORTER_COMMON + [("Value", "Float64"), ("Flags", "UInt32")] + _EXEMPLARS,
    "otel_metrics_sum": _EXPORTER_COMMON
    + [("Value", "Float64"), ("Flags", "UInt32")]
    + _EXEMPLARS
    + [("AggregationTemporality", "Int32"), ("IsMonotonic", "Bool")],
    "otel_metrics_histogram": _EXPORTER_COMMON
    + [
        ("Count", "UInt64"),
        ("Sum", "Float64"),
        ("BucketCounts", "Array(UInt64)"),
        ("ExplicitBounds", "Array(Float64)"),
    ]
    + _EXEMPLARS
    + [("Flags", "UInt32"), ("Min", "Float64"), ("Max", "Float64"), ("AggregationTemporality", "Int32")],
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    opened = Store(f"chdb://{tmp_path_factory.mktemp('schema') / 'chdb'}", Retention(raw_days=3))
    yield opened
    opened.close()


def test_raw_tables_match_the_exporter(store):
    for table, expected in EXPORTER_COLUMNS.items():
        _, rows = store.query(f"SELECT name, type FROM system.columns WHERE table = '{table}' ORDER BY position")
        assert rows == expected, table


def test_migrations_apply_once_and_refuse_edited_history(store):
    assert sorted(migrations.applied_versions(store.client)) == [1, 2, 3]
    assert migrations.migrate(store.client, Retention()) == []
    store.command(f"ALTER TABLE {tables.SCHEMA_MIGRATIONS} UPDATE Checksum = 'edited' WHERE Version = 2")
    try:
        with pytest.raises(migrations.MigrationError, match="0002_certificate_samples changed after it was applied"):
            migrations.migrate(store.client, Retention())
    finally:
        checksum = migrations.load_migrations()[1].checksum
        store.command(f"ALTER TABLE {tables.SCHEMA_MIGRATIONS} UPDATE Checksum = '{checksum}' WHERE Version = 2")


def test_every_table_has_its_ttl(store):
    _, rows = store.query(
        "SELECT name, create_table_query FROM system.tables WHERE database = currentDatabase() "
        "AND engine LIKE '%MergeTree' AND name != {m:String}",
        {"m": tables.SCHEMA_MIGRATIONS},
    )
    ddl = dict(rows)
    assert set(ddl) == set(tables.DATA_TABLES)
    assert "toIntervalDay(3)" in ddl["otel_metrics_gauge"]  # the configured raw_days
    assert all(" TTL " in text for text in ddl.values())


def test_cluster_ddl(capsys, store):
    assert witcert_main(["schema", "--cluster", "prod", "--database", "witcert"]) == 0
    ddl = capsys.readouterr().out
    statements = [s.strip() for s in ddl.split(";") if s.strip() and "CREATE" in s]
    assert len(statements) == 1 + 13 + len(tables.DATA_TABLES)  # database, 8 tables + 5 views, Distributed
    assert all("ON CLUSTER prod" in statement for statement in statements)
    for statement in statements:  # ClickHouse's own parser accepts each (no cluster here to run them)
        store.query("EXPLAIN AST " + statement)
    for table in tables.DATA_TABLES:
        assert f"CREATE TABLE IF NOT EXISTS witcert.{table}_local ON CLUSTER prod" in ddl
        assert f"ENGINE = Distributed(prod, witcert, {table}_local, rand())" in ddl
    assert "ReplicatedSummingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')" in ddl
    assert "FROM witcert.otel_metrics_gauge_local" in ddl  # views read the local tables
    assert "non_replicated_deduplication_window" not in ddl
    assert witcert_main(["schema", "--cluster", "bad name;"]) == 2


def test_store_urls():
    assert parse_store_url("chdb:///var/lib/w").path.as_posix() == "/var/lib/w"
    server = parse_store_url("clickhouse://ops:p%40ss@db.example:9000/metrics")
    assert (server.host, server.port, server.username, server.password, server.database) == (
        "db.example",
        9000,
        "ops",
        "p@ss",
        "metrics",
    )
    assert parse_store_url("clickhouses://db.example/x").secure
    assert parse_store_url("clickhouses://db.example/x").port == 8443
    with pytest.raises(StoreError, match="scheme must be"):
        parse_store_url("postgres://x")
    with pytest.raises(StoreError, match="needs a path"):
        parse_store_url("chdb://")


def test_a_second_process_on_the_same_chdb_path_gets_a_clear_message(store):
    probe = (
        "import sys\nfrom witcert.collector.store import Store, StoreBusy\n"
        "try:\n    Store(sys.argv[1])\nexcept StoreBusy as error:\n    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, store.location.describe()], capture_output=True, text=True, timeout=120
    )
    assert "is in use by another process" in result.stdout, result.stderr
    assert "only one process may open a chDB path" in result.stdout


def test_an_insert_after_a_column_changed_type_reads_the_new_type(store):
    store.command("CREATE TABLE retyped (Name String, Count UInt8) ENGINE = MergeTree ORDER BY Name")
    store.insert_columns("retyped", {"Name": ["a"], "Count": [1]}, token="retyped-1")
    store.command("ALTER TABLE retyped MODIFY COLUMN Count String")
    with pytest.raises(ValueError):  # encoded as the type read before the change (refuses_data: the drain retries)
        store.insert_columns("retyped", {"Name": ["b"], "Count": ["two"]}, token="retyped-2")
    store.insert_columns("retyped", {"Name": ["b"], "Count": ["two"]}, token="retyped-2")
    assert store.query("SELECT Name, Count FROM retyped ORDER BY Name")[1] == [("a", "1"), ("b", "two")]
