"""A result cache shared by processes and threads: one SQLite file in WAL mode.

Rollouts ask the same questions again and again (G samples per prompt, every iteration), and
a paid API should answer each once. Keys hash the backend spec with secrets removed, the query,
k and anything else that changes the answer (the summariser). Only successes are stored, so a
transient failure is retried next time rather than replayed forever.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from marscli.secrets import public


def public_spec(spec: str) -> str:
    """The spec without URL userinfo (dropped: the same server answers whoever asks), secret
    query parameters or known API keys: what cache keys hash."""
    return public(spec)


def cache_key(*parts: Any) -> str:
    return hashlib.sha256(orjson.dumps(list(parts))).hexdigest()


class ResultCache:
    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / "search-cache.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self.hits = 0
        self.misses = 0
        self._db()  # create the table now, so a bad folder fails at start-up

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA busy_timeout=60000")  # before WAL: switching needs the lock
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS cache"
                       "(key TEXT PRIMARY KEY, value BLOB NOT NULL, created REAL NOT NULL)")
            self._local.db = db
        return db

    def get(self, key: str) -> Any | None:
        row = self._db().execute("SELECT value FROM cache WHERE key=?", (key,)).fetchone()
        if row is None:
            self.misses += 1
            return None
        self.hits += 1
        return orjson.loads(row[0])

    def put(self, key: str, value: Any) -> None:
        self._db().execute("INSERT OR REPLACE INTO cache VALUES (?,?,?)",
                           (key, orjson.dumps(value), time.time()))

    def through(self, key: str, compute: Callable[[], Any]) -> Any:
        """The cached value, or `compute()` stored on success (an exception stores nothing)."""
        got = self.get(key)
        if got is not None:
            return got
        value = compute()
        self.put(key, value)
        return value


_OPEN: dict[Path, ResultCache] = {}
_OPEN_LOCK = threading.Lock()


def open_cache(folder: str | Path | None) -> ResultCache | None:
    """One ResultCache per folder and process (tools built twice share it)."""
    if folder is None:
        return None
    p = Path(folder).expanduser().resolve()
    with _OPEN_LOCK:
        if p not in _OPEN:
            _OPEN[p] = ResultCache(p)
        return _OPEN[p]
