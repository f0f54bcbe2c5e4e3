"""The store: a ClickHouse server or the embedded chDB engine, both through clickhouse-connect.

URLs: ``chdb:///absolute/path`` (embedded; one process per path, guarded by a lock file next to
it) and ``clickhouse://user:pass@host:8123/db`` (``clickhouses://`` or ``?secure=true`` for https).
Calls are serialised: one clickhouse-connect client is not safe for concurrent queries, and every
Store on one chDB path in a process shares that path's one session (chDB allows no other).
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import clickhouse_connect
from clickhouse_connect.driver.exceptions import ClickHouseError, DatabaseError, DataError, OperationalError

from witcert.collector import migrations
from witcert.collector.config import Retention

# max_threads = 1: an insert of one request's rows runs in the calling thread; handing it to the
# store's query threads costs more CPU than it saves (docs/COLLECTOR.md, "Performance").
_INSERT_SETTINGS = {"deduplicate_blocks_in_dependent_materialized_views": 1, "insert_deduplicate": 1, "max_threads": 1}


class StoreError(RuntimeError):
    """The store cannot be opened or refused an operation; the message says which and why."""


class StoreBusy(StoreError):
    """Another process holds the chDB path."""


class StoreUnavailable(StoreError):
    """The store is not connected (yet): the collector started without it, or it went away."""


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


def _refuse_a_folder_holding_a_store(path: Path) -> None:
    # `witcert demo --data-dir D` keeps its store in D/chdb: naming D would silently create a second, empty store.
    inner = path / "chdb"
    if not (path / "metadata").exists() and (inner / "metadata").is_dir():
        raise StoreError(f"chdb://{path} is the folder that holds a chDB store, not the store: use chdb://{inner}")


@dataclass
class _SharedChdb:
    """One chDB session per data path in this process, shared by every Store opened on the path."""

    client: Any
    lock: threading.Lock
    path_lock: _PathLock
    users: int = 1


_CHDB_SESSIONS: dict[Path, _SharedChdb] = {}
_CHDB_SESSIONS_LOCK = threading.Lock()

# Server errors that say the rows themselves can never be stored (retrying cannot help): the
# record is moved to the spool's dead letters. Every other failure is taken for an outage.
_REFUSED_DATA_CODES = frozenset(
    {
        6,  # CANNOT_PARSE_TEXT
        8,  # THERE_IS_NO_COLUMN
        10,  # NOT_FOUND_COLUMN_IN_BLOCK
        16,  # NO_SUCH_COLUMN_IN_TABLE
        27,  # CANNOT_PARSE_INPUT_ASSERTION_FAILED
        38,  # CANNOT_PARSE_DATE
        41,  # CANNOT_PARSE_DATETIME
        43,  # ILLEGAL_TYPE_OF_ARGUMENT
        44,  # ILLEGAL_COLUMN
        53,  # TYPE_MISMATCH
        69,  # ARGUMENT_OUT_OF_BOUND
        70,  # CANNOT_CONVERT_TYPE
        72,  # CANNOT_PARSE_NUMBER
        117,  # INCORRECT_DATA
        128,  # TOO_LARGE_ARRAY_SIZE
        131,  # TOO_LARGE_STRING_SIZE
        190,  # SIZES_OF_ARRAYS_DONT_MATCH
        321,  # VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE
        407,  # DECIMAL_OVERFLOW
        469,  # VIOLATED_CONSTRAINT
    }
)


def refuses_data(error: BaseException) -> bool:
    """Whether a failed insert failed because of the rows (for good), not because of the store."""
    if isinstance(error, OperationalError):  # the connection, not the data
        return False
    if isinstance(error, DataError | TypeError | ValueError | OverflowError | struct.error):
        return True  # the client could not encode the rows
    if isinstance(error, DatabaseError):
        code = getattr(error, "code", None)
        # 252 is both "too many parts" (merges behind: wait) and "too many partitions" (the block's).
        return code in _REFUSED_DATA_CODES or (code == 252 and "partitions for single INSERT" in str(error))
    return False


def server_answered(error: BaseException) -> bool:
    """Whether the store answered with an error of its own (it is up), rather than not answering."""
    return isinstance(error, DatabaseError) and not isinstance(error, OperationalError)


class Store:
    """One connection to the store, with the schema migrated when it opens.

    ``connect=False`` defers opening: ``connect()`` may then be retried until the store answers
    (the collector starts without its store). Calls are serialised per connection (per chDB path
    within a process: chDB has one session per path)."""

    def __init__(
        self, url: str, retention: Retention | None = None, migrate: bool = True, connect: bool = True
    ) -> None:
        self.location = parse_store_url(url)
        self.retention = retention or Retention()
        self.migrate = migrate
        self.client = None
        self._lock = threading.Lock()
        self._chdb_path: Path | None = None
        # (table, column names) -> the columns' ClickHouse types, read once (DESCRIBE) per connection.
        self._column_types: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
        if connect:
            self.connect()

    @property
    def connected(self) -> bool:
        return self.client is not None

    def connect(self) -> None:
        """Open the connection and apply missing migrations; StoreError when the store cannot be used."""
        if self.client is not None:
            return
        if self.location.kind == "chdb":
            assert self.location.path is not None
            _refuse_a_folder_holding_a_store(self.location.path)
            client, lock = _open_chdb(self.location.path)
            self._chdb_path = self.location.path
        else:
            client, lock = self._connect_server(), threading.Lock()
        try:
            if self.migrate:
                with lock:
                    migrations.migrate(client, self.retention)
        except BaseException as error:
            self._close_client(client)
            if isinstance(error, migrations.MigrationError):
                raise StoreError(str(error)) from error
            if isinstance(error, Exception) and not isinstance(error, StoreError):
                raise StoreError(f"cannot prepare the store {self.location.describe()}: {error}") from error
            raise
        self._column_types.clear()
        self.client, self._lock = client, lock

    def _connect_server(self):
        location = self.location
        try:
            return clickhouse_connect.get_client(
                host=location.host,
                port=location.port,
                username=location.username,
                password=location.password,
                database=location.database,
                secure=location.secure,
            )
        except OperationalError as error:
            # The driver's text carries the whole urllib3 retry chain; the operating system's reason is the news.
            text = str(error)
            reason = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text) or re.search(r"\((Name or service not known)", text)
            raise StoreError(
                f"cannot reach ClickHouse at {location.host}:{location.port} "
                f"({reason.group(1).strip() if reason else 'no answer'}): is the server up, and are the "
                "host and port of the store URL right?"
            ) from error
        except Exception as error:
            raise StoreError(f"cannot open the store {location.describe()}: {error}") from error

    def _connected_client(self):
        client = self.client
        if client is None:
            raise StoreUnavailable(f"the store {self.location.describe()} is not connected")
        return client

    def insert_columns(self, table: str, columns: Mapping[str, Sequence[Any]], token: str) -> None:
        """Insert column-oriented rows; a repeat with the same token is dropped by the store.

        The columns' types are read from the store on the first insert of a table and its column
        names, and again after any failed insert (the table may have changed)."""
        names = tuple(columns)
        settings = dict(_INSERT_SETTINGS, insert_deduplication_token=token)
        with self._lock:
            client = self._connected_client()
            key = (table, names)
            types = self._column_types.get(key)
            if types is None:
                types = self._column_types[key] = list(client.create_insert_context(table, list(names)).column_types)
            try:
                client.insert(
                    table,
                    [columns[name] for name in names],
                    column_names=list(names),
                    column_types=types,
                    column_oriented=True,
                    settings=settings,
                )
            except BaseException:
                self._column_types.pop(key, None)
                raise

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> tuple[list[str], list[tuple]]:
        """Run a parameterised read (``{name:Type}`` placeholders); return column names and rows."""
        with self._lock:
            result = self._connected_client().query(sql, parameters=dict(parameters or {}))
        return list(result.column_names), [tuple(row) for row in result.result_rows]

    def command(self, sql: str) -> None:
        with self._lock:
            self._connected_client().command(sql)

    def ping(self) -> bool:
        try:
            with self._lock:
                self._connected_client().query("SELECT 1")
            return True
        except (ClickHouseError, OSError, StoreError):
            return False

    def _close_client(self, client) -> None:
        if self.location.kind == "chdb":
            assert self.location.path is not None
            _close_chdb(self.location.path)
        else:
            client.close()

    def close(self) -> None:
        client, self.client = self.client, None
        self._column_types.clear()
        if client is not None:
            self._close_client(client)


def _open_chdb(path: Path) -> tuple[Any, threading.Lock]:
    with _CHDB_SESSIONS_LOCK:
        shared = _CHDB_SESSIONS.get(path)
        if shared is not None:
            shared.users += 1
            return shared.client, shared.lock
        path_lock = _PathLock(path)
        try:
            client = clickhouse_connect.get_client(interface="chdb", path=str(path))
        except Exception as error:
            path_lock.release()
            raise StoreError(f"cannot open the store chdb://{path}: {error}") from error
        _CHDB_SESSIONS[path] = _SharedChdb(client, threading.Lock(), path_lock)
        return client, _CHDB_SESSIONS[path].lock


def _close_chdb(path: Path) -> None:
    with _CHDB_SESSIONS_LOCK:
        shared = _CHDB_SESSIONS.get(path)
        if shared is None:
            return
        shared.users -= 1
        if shared.users == 0:
            del _CHDB_SESSIONS[path]
            shared.client.close()
            shared.path_lock.release()
