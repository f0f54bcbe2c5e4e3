"""Versioned schema migrations (``collector/schema/NNNN_name.sql``), single node or cluster.

A migration file is a template: table names (``${T_<NAME>}``) come from ``tables``, metric and
attribute names from ``witcert.integrations.telemetry.schema`` (the contract with the engine side), engines,
TTLs and the ``ON CLUSTER`` clause from the deployment. Applied versions are recorded in
``tables.SCHEMA_MIGRATIONS``; a file whose text changed after it was applied is reported, never
silently re-run.
"""

from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass
from importlib import resources

from witcert.collector import tables
from witcert.collector.config import Retention
from witcert.integrations.telemetry import schema as ts

_FILE_RE = re.compile(r"^(\d{4})_(\w+)\.sql$")
# The cluster variant renames each data table to <name>_local and puts a Distributed table with
# the original name in front of it.
_TABLE_RE = re.compile(r"\b(" + "|".join(tables.DATA_TABLES) + r")\b")
# Rows per table a replayed insert is checked against (ClickHouse keeps this many block hashes).
DEDUPLICATION_WINDOW = 10_000


class MigrationError(RuntimeError):
    """The store's schema disagrees with the migration files."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    template: str

    @property
    def checksum(self) -> str:
        # Over the text with the table names written out, so that a store migrated by a release
        # that spelled the names in the files sees the same checksums.
        named = string.Template(self.template).safe_substitute(tables.TEMPLATE_NAMES)
        return hashlib.sha256(named.encode()).hexdigest()[:16]


def load_migrations() -> list[Migration]:
    folder = resources.files("witcert.collector") / "schema"
    found = []
    for entry in folder.iterdir():
        match = _FILE_RE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration versions must run 1..N without gaps, found {versions}")
    return found


def _sql_string_list(names: tuple[str, ...]) -> str:
    return ", ".join("'" + name.replace("'", "''") + "'" for name in names)


def _substitutions(retention: Retention, cluster: str | None) -> dict[str, str]:
    if cluster:
        zk_path = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"
        merge_tree = f"ReplicatedMergeTree({zk_path})"
        summing = f"ReplicatedSummingMergeTree({zk_path})"
        dedup = f", replicated_deduplication_window = {DEDUPLICATION_WINDOW}"
        on_cluster = f"ON CLUSTER {_quote_identifier(cluster)}"
    else:
        merge_tree, summing, on_cluster = "MergeTree", "SummingMergeTree", ""
        dedup = f", non_replicated_deduplication_window = {DEDUPLICATION_WINDOW}"
    return {
        **tables.TEMPLATE_NAMES,
        "ON_CLUSTER": on_cluster,
        "MERGE_TREE": merge_tree,
        "SUMMING_MERGE_TREE": summing,
        "DEDUP": dedup,
        "RAW_TTL_DAYS": str(retention.raw_days),
        "SAMPLES_TTL_DAYS": str(retention.samples_days),
        "ROLLUP_1M_TTL_DAYS": str(retention.rollup_1m_days),
        "ROLLUP_1H_TTL_DAYS": str(retention.rollup_1h_days),
        "R_INSTANCE": ts.RESOURCE_INSTANCE,
        "R_MODEL": ts.RESOURCE_MODEL,
        "R_ENGINE": ts.RESOURCE_ENGINE,
        "R_TP_RANK": ts.RESOURCE_TP_RANK,
        "A_LAYER": ts.ATTR_LAYER,
        "A_HEAD": ts.ATTR_HEAD,
        "A_STEP": ts.ATTR_STEP,
        "M_SAMPLE": ts.CERTIFICATE_SAMPLE,
        "M_VALUE": ts.CERTIFICATE_VALUE,
        "M_CERTIFICATES": ts.CERTIFICATES,
        "M_COVERED": ts.COVERED,
        "M_VACUOUS": ts.VACUOUS,
        "M_INFINITE": ts.INFINITE,
        "M_NAN": ts.NAN,
        "M_FALLBACKS": ts.FALLBACKS,
        "M_REPAIRED_BYTES": ts.REPAIRED_BYTES,
        "M_STEPS": ts.STEPS,
        "M_DROPPED": ts.DROPPED_POINTS,
        "M_COUNTERS": _sql_string_list(ts.COUNTER_METRICS),
    }


def _quote_identifier(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", name):
        raise ValueError(f"{name!r} is not a valid ClickHouse identifier")
    return name


def _strip_comments(sql: str) -> str:
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))


def render_statements(migration: Migration, retention: Retention, cluster: str | None = None) -> list[str]:
    """The migration's SQL statements with every placeholder filled (raises on an unknown one)."""
    text = string.Template(_strip_comments(migration.template)).substitute(_substitutions(retention, cluster))
    return [statement.strip() for statement in text.split(";") if statement.strip()]


def cluster_ddl(cluster: str, database: str = "default", retention: Retention | None = None) -> str:
    """DDL for a ClickHouse cluster: Replicated local tables, materialized views between the local
    tables on every node, and Distributed tables under the single-node names for writers and readers."""
    retention = retention or Retention()
    database = _quote_identifier(database)
    on_cluster = f"ON CLUSTER {_quote_identifier(cluster)}"
    parts = [
        f"-- witcert schema for cluster {cluster}, database {database}. Generated by `witcert schema --cluster`.",
        "-- Writers (the witcert collector or the OpenTelemetry Collector's ClickHouse exporter) insert",
        "-- into the Distributed tables, and materialized views run on the shard that receives the rows.",
        f"CREATE DATABASE IF NOT EXISTS {database} {on_cluster};",
    ]
    for migration in load_migrations():
        parts.append(f"\n-- migration {migration.version:04d}_{migration.name}")
        for statement in render_statements(migration, retention, cluster):
            parts.append(_TABLE_RE.sub(lambda m: f"{database}.{m.group(1)}_local", statement) + ";")
    parts.append("\n-- Distributed front tables")
    for table in tables.DATA_TABLES:
        parts.append(
            f"CREATE TABLE IF NOT EXISTS {database}.{table} {on_cluster} AS {database}.{table}_local\n"
            f"ENGINE = Distributed({cluster}, {database}, {table}_local, rand());"
        )
    return "\n".join(parts) + "\n"


def applied_versions(client) -> dict[int, str]:
    client.command(
        f"CREATE TABLE IF NOT EXISTS {tables.SCHEMA_MIGRATIONS} (Version UInt32, Name String, Checksum String, "
        "AppliedAt DateTime64(3, 'UTC') DEFAULT now64(3)) ENGINE = MergeTree ORDER BY Version"
    )
    rows = client.query(f"SELECT Version, Checksum FROM {tables.SCHEMA_MIGRATIONS}").result_rows
    return {int(version): checksum for version, checksum in rows}


def migrate(client, retention: Retention) -> list[int]:
    """Apply every migration the store lacks, in order; return the versions applied now.

    Every statement is ``IF NOT EXISTS``, so a migration interrupted half-way is simply re-run."""
    done = applied_versions(client)
    applied_now = []
    for migration in load_migrations():
        if migration.version in done:
            if done[migration.version] != migration.checksum:
                raise MigrationError(
                    f"migration {migration.version:04d}_{migration.name} changed after it was applied "
                    f"(checksum {done[migration.version]} in the store, {migration.checksum} on disk); "
                    "add a new migration instead of editing an applied one"
                )
            continue
        for statement in render_statements(migration, retention):
            client.command(statement)
        client.insert(
            tables.SCHEMA_MIGRATIONS,
            [[migration.version, migration.name, migration.checksum]],
            column_names=["Version", "Name", "Checksum"],
        )
        applied_now.append(migration.version)
    return applied_now
