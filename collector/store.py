"""The store: a ClickHouse server or the embedded chDB engine, both through clickhouse-connect.

URLs: ``chdb:///absolute/path`` (embedded; one process per path, guarded by a lock file next to
it) and ``clickhouse://user:pass@host:8123/db`` (``clickhouses://`` or ``?secure=true`` for https).
Calls are serialised: one clickhouse-connect client is not safe for concurrent queries.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import clickhouse_connect
from clickhouse_connect.driver.exceptions import ClickHouseError

from witcert.collector import migrations
from witcert.collector.config import Retention

_INSERT_SETTINGS = {"deduplicate_blocks_in_dependent_materialized_views": 1, "insert_deduplicate": 1}


class StoreError(RuntimeError):
    """The store cannot be opened or refused an operation; the message says which and why."""


class StoreBusy(StoreError):
    """Another process holds the chDB path."""


@dataclass(frozen=True)
class StoreLocation:
    kind: str  # "chdb" or "clickhouse"
    path: Path | None = None
    host: str = "localhost"
    port: int = 8123
    username: str = "default"
    password: str = ""
    database: str = "default"
    secure: bool = False

    def describe(self) -> str:
        if self.kind == "chdb":
            return f"chdb://{self.path}"
        scheme = "clickhouses" if self.secure else "clickhouse"
        return f"{scheme}://{self.username}@{self.host}:{self.port}/{self.database}"


def parse_store_url(url: str) -> StoreLocation:
    parts = urlsplit(url)
    if parts.scheme == "chdb":
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise StoreError(f"store URL {url!r}: chdb:// needs a path, e.g. chdb:///var/lib/witcert/chdb")
        return StoreLocation(kind="chdb", path=Path(path).expanduser().resolve())
    if parts.scheme in ("clickhouse", "clickhouses", "http", "https"):
        if not parts.hostname:
            raise StoreError(f"store URL {url!r} has no host")
        query = parse_qs(parts.query)
        secure = parts.scheme in ("clickhouses", "https") or query.get("secure", ["false"])[0] in ("1", "true")
        database = parts.path.strip("/") or "default"
        return StoreLocation(
            kind="clickhouse",
            host=parts.hostname,
            port=parts.port or (8443 if secure else 8123),
            username=unquote(parts.username or "default"),
            password=unquote(parts.password or ""),
            database=database,
            secure=secure,
        )
    raise StoreError(f"store URL {url!r}: scheme must be chdb:// or clickhouse:// (or clickhouses:// for https)")


class _PathLock:
    """An exclusive flock on ``<path>.lock``: chDB itself fails obscurely on a second process."""

    def __init__(self, path: Path) -> None:
        self.lock_path = path.with_name(path.name + ".lock")
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise StoreBusy(
                f"the chDB store {path} is in use by another process (pid {holder}); only one process "
                "may open a chDB path: stop it, query through its HTTP API, or use another --store"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


class Store:
    """One connection to the store, with the schema migrated on open."""

    def __init__(self, url: str, retention: Retention | None = None, migrate: bool = True) -> None:
        self.location = parse_store_url(url)
        self._lock = threading.Lock()
        self._path_lock: _PathLock | None = None
        if self.location.kind == "chdb":
            assert self.location.path is not None
            self._path_lock = _PathLock(self.location.path)
        try:
            self.client = self._connect()
            if migrate:
                with self._lock:
                    migrations.migrate(self.client, retention or Retention())
        except BaseException:
            self.close()
            raise

    def _connect(self):
        location = self.location
        try:
            if location.kind == "chdb":
                return clickhouse_connect.get_client(interface="chdb", path=str(location.path))
            return clickhouse_connect.get_client(
                host=location.host,
                port=location.port,
                username=location.username,
                password=location.password,
                database=location.database,
                secure=location.secure,
            )
        except Exception as error:
            raise StoreError(f"cannot open the store {location.describe()}: {error}") from error

    def insert_columns(self, table: str, columns: Mapping[str, Sequence[Any]], token: str) -> None:
        """Insert column-oriented rows; a repeat with the same token is dropped by the store."""
        names = list(columns)
        settings = dict(_INSERT_SETTINGS, insert_deduplication_token=token)
        with self._lock:
            self.client.insert(
                table, [columns[name] for name in names], column_names=names, column_oriented=True, settings=settings
            )

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> tuple[list[str], list[tuple]]:
        """Run a parameterised read (``{name:Type}`` placeholders); return column names and rows."""
        with self._lock:
            result = self.client.query(sql, parameters=dict(parameters or {}))
        return list(result.column_names), [tuple(row) for row in result.result_rows]

    def command(self, sql: str) -> None:
        with self._lock:
            self.client.command(sql)

    def ping(self) -> bool:
        try:
            with self._lock:
                self.client.query("SELECT 1")
            return True
        except (ClickHouseError, OSError):
            return False

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
            self.client = None
        if self._path_lock is not None:
            self._path_lock.release()
            self._path_lock = None
