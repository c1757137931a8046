"""The error family every stage raises; the CLI maps it to one stderr line and an exit code.

`BadInput` (exit 2) is the user's to fix: a malformed file, an option out of range, a missing
path. `RuntimeFailure` (exit 1) is ours or the world's: a judge that keeps failing, a crashed
worker. Messages read `what is wrong — what to do`, and name file:line: field where there is one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class MarsError(Exception):
    exit_code = 1


class BadInput(MarsError):
    """Bad usage or bad input data: exit code 2."""

    exit_code = 2


class RuntimeFailure(MarsError):
    """A failure while running (a dependency, a worker): exit code 1."""

    exit_code = 1


def where(path: str, line: int | None = None, field: str | None = None) -> str:
    """`FILE:LINE: field` prefix for a message about one record's field."""
    loc = str(path) if line is None else f"{path}:{line}"
    return f"{loc}: {field}" if field else loc


def unknown_name(kind: str, name: str, valid: list[str] | tuple[str, ...]) -> BadInput:
    """Error for a registry lookup that failed, listing the valid names."""
    return BadInput(f"unknown {kind} {name!r} — choose one of: {', '.join(sorted(valid))}")


def check_range(name: str, v: float | None, lo: float | None = None, hi: float | None = None,
                *, lo_open: bool = False, hi_open: bool = False) -> None:
    """BadInput naming the option when `v` is not finite or outside [lo, hi] (open ends with
    `lo_open`/`hi_open`); None passes (an option left at "not set")."""
    import math

    if v is None:
        return
    bad = (not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo))
           or (hi is not None and (v >= hi if hi_open else v > hi)))
    if bad:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi}"
        must = " and ".join(x for x in (lo_s, hi_s) if x)
        raise BadInput(f"{name}: {v} is out of range — must be {must}")


# errno values that are the user's environment, not a bug: one line, never a traceback.
_OS_ERRORS = {"ENOSPC": ("no space left on the device", RuntimeFailure),
              "EDQUOT": ("disk quota exceeded", RuntimeFailure),
              "EFBIG": ("file too large for this process's file-size limit (ulimit -f)",
                        RuntimeFailure),
              "EROFS": ("read-only file system", BadInput),
              "EACCES": ("permission denied", BadInput)}


def os_error(e: BaseException) -> MarsError | None:
    """The one-line error for a full disk, a quota, a read-only or forbidden folder (naming
    the path when the OS gave one); None for any other error, which stays a traceback."""
    import errno

    for name, (what, kind) in _OS_ERRORS.items():
        if isinstance(e, OSError) and e.errno == getattr(errno, name, None):
            where_ = f"{e.filename}: " if e.filename else ""
            return kind(f"{where_}{what} — free space or pick another output folder"
                        if kind is RuntimeFailure else
                        f"{where_}{what} — pick an output folder you can write to")
    return None


_ROOM = 256 << 20  # free bytes under which a failed torch.save is put down to a full disk


def save_error(e: BaseException, path: object) -> MarsError | None:
    """The one-line error for a full disk that a saver reports in its own words: safetensors
    as "... (os error 28)", torch.save as "[enforce fail at inline_container.cc] unexpected
    pos" with no errno at all (then: ENOSPC when the folder's disk has under 256 MiB free,
    EFBIG when a file-size limit is set). None for anything else."""
    import errno
    import os
    import re
    import resource
    import shutil
    from pathlib import Path

    m = re.search(r"\(os error (\d+)\)", str(e))
    if m:
        n = int(m.group(1))
        return os_error(OSError(n, os.strerror(n), str(path)))
    if not (isinstance(e, RuntimeError) and "inline_container" in str(e)):
        return None
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return os_error(OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(path)))
    here = Path(str(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    if shutil.disk_usage(here).free < _ROOM:
        return os_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)))
    return None


@contextmanager
def save_errors(path: object) -> Iterator[None]:
    """Turn a full disk (or a file-size limit) that torch.save or safetensors report in their
    own words into the one-line error of `save_error`; any other error stays as it is."""
    try:
        yield
    except MarsError:
        raise
    except Exception as e:
        err = save_error(e, path)
        if err is None:
            raise
        raise err from None
