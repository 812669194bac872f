"""The usage ledger: one SQLite row per finished request, written off the request path.

`record` only puts the row on a queue (a lock and an append: microseconds on the event loop).
One writer thread owns the write connection and inserts whatever has queued up since its last
commit in one transaction (`executemany`), so a burst of requests costs one fsync, not one
each. `close` queues a stop marker and waits for the thread, which drains everything queued
before it: a graceful shutdown loses no rows. A row recorded after `close` (a stream that
uvicorn cancelled at its shutdown deadline and that finishes during teardown) is written
synchronously instead of dropped. A batch that fails (disk full, database locked past the
busy timeout) is retried twice, then logged and counted as failed.

The database is in WAL mode, so `/v1/usage` queries (their own short-lived connections, in a
worker thread) never wait for the writer, and several routers may share one file.

Schema (table `usage`, one row per client request that reached a worker or was answered by
the router after its body parsed):
    time REAL            unix seconds when the router received the request
    identity TEXT        API key identity ("anonymous" when keys are off)
    user TEXT            the request's `user` field, if any
    model TEXT           the model the client asked for (what prices are looked up by)
    endpoint TEXT        the client's protocol: chat | completion | messages | responses
    request_id TEXT      the response id the client saw (chatcmpl-, cmpl-, msg_, resp_...)
    route TEXT           pd | direct
    prefill_worker TEXT, decode_worker TEXT   worker URLs (NULL where no hop went)
    status TEXT          ok | aborted (client went away) | error
    http_status INTEGER  what the router answered (499: the client disconnected)
    prompt_tokens, cached_tokens, completion_tokens INTEGER
    estimated INTEGER    1 when the workers never sent usage (see accounting.py)
    cost_input, cost_cached_input, cost_output, cost_total REAL   USD
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields
from pathlib import Path

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_BUSY_TIMEOUT_S = 10.0
_WRITE_ATTEMPTS = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    identity TEXT NOT NULL,
    user TEXT,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    request_id TEXT NOT NULL,
    route TEXT NOT NULL,
    prefill_worker TEXT,
    decode_worker TEXT,
    status TEXT NOT NULL,
    http_status INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    estimated INTEGER NOT NULL,
    cost_input REAL NOT NULL,
    cost_cached_input REAL NOT NULL,
    cost_output REAL NOT NULL,
    cost_total REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_time ON usage (time);
CREATE INDEX IF NOT EXISTS usage_identity_time ON usage (identity, time);
"""


@dataclass(frozen=True)
class UsageRow:
    time: float
    identity: str
    user: str | None
    model: str
    endpoint: str
    request_id: str
    route: str
    prefill_worker: str | None
    decode_worker: str | None
    status: str
    http_status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    estimated: bool
    cost_input: float
    cost_cached_input: float
    cost_output: float
    cost_total: float


_COLUMNS = tuple(f.name for f in fields(UsageRow))
_INSERT = (
    f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)})"
)


@dataclass(frozen=True)
class Totals:
    """One identity's (or everyone's) sums over a time range."""

    requests: int = 0
    aborted: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_input: float = 0.0
    cost_cached_input: float = 0.0
    cost_output: float = 0.0
    cost_total: float = 0.0

    def __add__(self, other: Totals) -> Totals:
        return Totals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def connect(path: Path) -> sqlite3.Connection:
    """A connection with the ledger's schema in place (created if missing)."""
    connection = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, check_same_thread=False)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        with connection:
            connection.executescript(_SCHEMA)
            connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        connection.close()
        raise
    return connection


class _Flush:
    """A marker on the queue: set once every row queued before it is committed."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class Ledger:
    def __init__(
        self,
        path: Path,
        max_batch: int = 1000,
        on_batch: Callable[[int, bool], None] | None = None,
    ) -> None:
        self.path = path
        self.max_batch = max_batch
        self._on_batch = on_batch
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> Ledger:
        """Create the schema here (a bad path fails the start, not a request), then the writer."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = connect(self.path)  # used by the writer thread alone from here on
        self._thread = threading.Thread(
            target=self._run, args=(connection,), name="usage-ledger", daemon=True
        )
        self._thread.start()
        return self

    def record(self, row: UsageRow) -> None:
        with self._lock:
            if not self._closed:
                self._queue.put(row)
                return
            self._write_late(row)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every row recorded so far is committed; False on timeout."""
        with self._lock:
            if self._closed:
                return True
            marker = _Flush()
            self._queue.put(marker)
        return marker.done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the usage ledger writer did not finish within %.0f s", timeout)

    # --- the writer thread -------------------------------------------------------------
    def _run(self, connection: sqlite3.Connection) -> None:
        try:
            stop = False
            while not stop:
                batch = [self._queue.get()]
                while len(batch) < self.max_batch:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                rows = [item for item in batch if isinstance(item, UsageRow)]
                if rows:
                    self._write(connection, rows)
                for item in batch:
                    if isinstance(item, _Flush):
                        item.done.set()
                    elif item is _STOP:
                        stop = True
        finally:
            connection.close()

    def _write(self, connection: sqlite3.Connection, rows: list[UsageRow]) -> None:
        values = [astuple(row) for row in rows]
        for attempt in range(1, _WRITE_ATTEMPTS + 1):
            try:
                with connection:
                    connection.executemany(_INSERT, values)
            except sqlite3.Error as exc:
                if attempt < _WRITE_ATTEMPTS:
                    logger.warning("usage ledger write failed (%s); retrying", exc)
                    time.sleep(0.1 * attempt)
                    continue
                logger.error("usage ledger: %d rows lost: %s", len(rows), exc)
                self._report(len(rows), False)
                return
            self._report(len(rows), True)
            return

    def _write_late(self, row: UsageRow) -> None:
        """Called under the lock, after close: rare, so a synchronous insert is fine."""
        try:
            with contextlib.closing(connect(self.path)) as connection:
                self._write(connection, [row])
        except sqlite3.Error as exc:
            logger.error("usage ledger: a row recorded after shutdown was lost: %s", exc)
            self._report(1, False)

    def _report(self, rows: int, ok: bool) -> None:
        if self._on_batch is not None:
            self._on_batch(rows, ok)

    # --- queries (any thread; each opens its own connection) --------------------------
    def totals(
        self,
        start: float,
        end: float,
        identity: str | None = None,
        user: str | None = None,
    ) -> dict[str, Totals]:
        """Per identity, rows with start <= time < end (and the identity / user given)."""
        where = ["time >= ?", "time < ?"]
        params: list[object] = [start, end]
        if identity is not None:
            where.append("identity = ?")
            params.append(identity)
        if user is not None:
            where.append("user = ?")
            params.append(user)
        sql = (
            "SELECT identity, COUNT(*), SUM(status = 'aborted'), SUM(status = 'error'), "
            "SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), SUM(cost_input), "
            "SUM(cost_cached_input), SUM(cost_output), SUM(cost_total) "
            f"FROM usage WHERE {' AND '.join(where)} GROUP BY identity ORDER BY identity"
        )
        with self._reader() as connection:
            result = connection.execute(sql, params).fetchall()
        return {row[0]: Totals(*row[1:]) for row in result}

    def first_time(self) -> float | None:
        with self._reader() as connection:
            (value,) = connection.execute("SELECT MIN(time) FROM usage").fetchone()
        return value

    def _reader(self) -> contextlib.closing[sqlite3.Connection]:
        return contextlib.closing(sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S))
