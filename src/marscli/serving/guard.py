"""What `marscli serve` lets in, and how many at once.

- `Folders`: the server opens images and loads checkpoints only under the folders it was
  started with (`--allow-dir`; by default the working folder and the folder holding the first
  policy), resolved, so `..` and symlinks cannot lead out. Anything else, and any file that
  is missing, not a regular file or not an image (a folder that is missing, not a checkpoint
  or a damaged one), gets the same one-line reply: a client learns nothing about the server's
  disk from it (the reason goes to the server's log, `log_refused`).
- `PixelBudget`: an image's size is read from its header before any decoding. A request whose
  images add up to more than `--max-request-pixels` is refused (413); decoding waits while the
  requests being decoded hold `--max-inflight-pixels` (503 + Retry-After after a short wait),
  so a handful of huge PNGs cannot take the server's memory.
- `PooledHTTPServer`: a bounded pool of handler threads (not one per connection), a listen
  backlog that holds a rollout's concurrency on fresh connections, and an idle timeout on
  every connection (`IDLE_S`), so idle keep-alive clients give their thread back.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import HTTPServer
from pathlib import Path
from typing import Any

from marscli.serving.config import MAX_INFLIGHT_PIXELS, MAX_REQUEST_PIXELS


class HttpFailure(Exception):
    def __init__(self, code: int, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.code, self.headers = code, headers or {}


# A kept-alive connection holds its handler thread while it waits for its next request, so the
# idle timeout is short (uvicorn's 5 s): a client's next turn after a slow tool reconnects.
IDLE_S = 5.0
BACKLOG = 1024  # the listen queue: 64 requests a shard, several shards, on fresh connections
WORKERS = 512  # handler threads at most (each generation holds one); beyond, they queue
BUDGET_WAIT_S = 2.0  # how long a request waits for decoding room before its 503
NOT_ALLOWED = "not an image this server may read"
NOT_A_CHECKPOINT = "policy: not a checkpoint this server may load (a folder under its --allow-dir)"


class Folders:
    """The folders a server may read (resolved)."""

    def __init__(self, allow: list[str], policy: str | None) -> None:
        dirs = [*allow] if allow else [os.getcwd()]
        if not allow and policy is not None:
            dirs.append(str(Path(policy).resolve().parent))
        self.dirs = sorted({Path(d).resolve() for d in dirs})

    def allows(self, path: str) -> Path | None:
        """`path` resolved when it lies under an allowed folder, else None."""
        try:
            p = Path(path).resolve()
        except (OSError, RuntimeError):  # a symlink loop
            return None
        return p if any(p.is_relative_to(d) for d in self.dirs) else None

    def image(self, path: str, i: int) -> Path:
        """An image file the server may open: resolved, allowed and a regular file."""
        p = self.allows(path)
        if p is None or not p.is_file():
            log_refused(f"images[{i}]: {path}: "
                        f"{'outside --allow-dir' if p is None else 'no file'}")
            raise HttpFailure(400, f"images[{i}]: {NOT_ALLOWED}")
        return p

    def checkpoint(self, path: str) -> str:
        p = self.allows(path)
        if p is None or not p.is_dir():
            log_refused(f"policy {path}: "
                        f"{'outside --allow-dir' if p is None else 'not a folder'}")
            raise HttpFailure(400, NOT_A_CHECKPOINT)
        return str(p)


class PixelBudget:
    """Pixels being decoded now, bounded; `hold(n)` waits (briefly) for room, then 503."""

    def __init__(self, per_request: int = MAX_REQUEST_PIXELS,
                 inflight: int = MAX_INFLIGHT_PIXELS) -> None:
        self.per_request, self.inflight = per_request, inflight
        self.used = 0
        self._room = threading.Condition()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        if pixels > self.per_request:
            raise HttpFailure(413, f"images: {pixels:,} pixels in one request, over "
                                   f"--max-request-pixels {self.per_request:,}")
        with self._room:
            if not self._room.wait_for(lambda: self.used + pixels <= self.inflight,
                                       timeout=BUDGET_WAIT_S):
                raise HttpFailure(503, f"images: {self.used:,} pixels being decoded, no room "
                                       f"for {pixels:,} more now", {"Retry-After": "1"})
            self.used += pixels
        try:
            yield
        finally:
            with self._room:
                self.used -= pixels
                self._room.notify_all()


def header_pixels(path: Path, i: int) -> int:
    """Width x height from the image's header (nothing decoded); the generic refusal when it
    is not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            w, h = im.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        log_refused(f"images[{i}]: {path}: {type(e).__name__}: {e}")
        raise HttpFailure(400, f"images[{i}]: {NOT_ALLOWED}") from None
    return w * h


class PooledHTTPServer(HTTPServer):
    """An HTTPServer whose connections are handled by at most `workers` daemon threads, started
    as they are needed; connections beyond wait in a queue (and before it, the listen
    backlog)."""

    request_queue_size = BACKLOG
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, workers: int = WORKERS) -> None:
        super().__init__(address, handler)
        self.workers = workers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = self._idle = 0
        self._count = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._jobs.put((request, client_address))
        with self._count:  # more waiting than idle threads to take them: one more thread
            if self._jobs.qsize() > self._idle and self._threads < self.workers:
                self._threads += 1
                threading.Thread(target=self._work, daemon=True,
                                 name=f"serve-{self._threads}").start()

    def _work(self) -> None:
        while True:
            with self._count:
                self._idle += 1
            request, client_address = self._jobs.get()
            with self._count:
                self._idle -= 1
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)


def log_refused(line: str) -> None:
    """Why a request was refused, for the server's operator (never in the reply)."""
    print(f"serve: refused {line}", file=sys.stderr)
