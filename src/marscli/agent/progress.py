"""The progress bar of `rollout` and `eval`: an agent event callback drawing on stderr.

- Shows trajectories done/total, generated tokens/s, tool calls, errors ("model": invalid
  calls and format errors; "tool": backend failures after retries; "engine": trajectories the
  engine gave up on), elapsed and ETA.
- Counts come from the trajectory's own counters (`gen_tokens`, `tool_calls`, `tool_errors`,
  `tool_failures`, `format_errors`, `stop`) at each event, by difference with what was last
  seen of it, so an event that carries no numbers (a streamed `"text"` delta) costs nothing
  and no count is taken twice.
- Only on a terminal: when stderr is redirected (a log file, a Slurm job) there is no output
  at all, and the stage's summary line says the same at the end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

Event = Callable[[str, Any, dict], None]
_COUNTS = ("tokens", "tools", "tool_errors", "failures", "format_errors")


def _counts(traj: Any) -> dict[str, int]:
    """What the bar counts, as the trajectory has it now."""
    return {"tokens": getattr(traj, "gen_tokens", 0),
            "tools": sum(getattr(traj, "tool_calls", {}).values()),
            "tool_errors": sum(getattr(traj, "tool_errors", {}).values()),
            "failures": sum(getattr(traj, "tool_failures", {}).values()),
            "format_errors": getattr(traj, "format_errors", 0)}


class _Tally:
    """Totals over the run, from per-trajectory counters seen at each event."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(_COUNTS, 0)
        self.engine_errors = 0
        self._seen: dict[str, dict[str, int]] = {}
        self.t0 = time.perf_counter()

    def update(self, kind: str, traj: Any) -> None:
        now, key = _counts(traj), getattr(traj, "id", id(traj))
        before = self._seen.get(key, dict.fromkeys(_COUNTS, 0))
        for k in _COUNTS:
            self.total[k] += now[k] - before[k]
        if kind == "stop":
            self._seen.pop(key, None)
            self.engine_errors += getattr(traj, "stop", None) == "engine_error"
        else:
            self._seen[key] = now

    def fields(self) -> dict[str, str]:
        t = self.total
        wall = max(time.perf_counter() - self.t0, 1e-9)
        model = t["tool_errors"] + t["format_errors"]
        return {"speed": f"{t['tokens'] / wall:,.0f} tok/s", "tools": f"{t['tools']} calls",
                "errors": f"errors {model} model · {t['failures']} tool · "
                          f"{self.engine_errors} engine"}


def stderr_console() -> Console:
    """The console every people-facing line goes to: stderr, so stdout stays data."""
    return Console(stderr=True, highlight=False)


@contextlib.contextmanager
def progress_bar(label: str, total: int, show: bool,
                 console: Console | None = None) -> Iterator[Event]:
    """A progress bar of `total` trajectories on stderr (a terminal only, and only when
    `show`), and the agent event callback that advances it on each `"stop"`."""
    console = console or stderr_console()
    tally = _Tally()
    bar = Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(bar_width=24), MofNCompleteColumn(),
                   TextColumn("{task.fields[speed]}"), TextColumn("{task.fields[tools]}"),
                   TextColumn("{task.fields[errors]}"), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), console=console,
                   disable=not (show and console.is_terminal), refresh_per_second=4)
    task = bar.add_task(label, total=total, **tally.fields())

    def on_event(kind: str, traj: Any, data: dict) -> None:
        if kind == "text":
            return
        tally.update(kind, traj)
        bar.update(task, advance=1 if kind == "stop" else 0, **tally.fields())

    on_event.wants_text = False  # the agent then skips decoding streamed text nobody shows
    with bar:
        yield on_event
