"""The error family every stage raises; the CLI maps it to one stderr line and an exit code.

`BadInput` (exit 2) is the user's to fix: a malformed file, an option out of range, a missing
path. `RuntimeFailure` (exit 1) is ours or the world's: a judge that keeps failing, a crashed
worker. Messages read `what is wrong — what to do`, and name file:line: field where there is one.
"""

from __future__ import annotations


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
