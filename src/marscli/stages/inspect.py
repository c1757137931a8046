"""`marscli inspect TRAJ.jsonl`: print the matching trajectories turn by turn (a rich view on a
terminal, plain text in a pipe), or as JSONL (`--json`), or their ids (`--ids`); how many matched
goes to stderr. The filter and the renderings are view/inspect.py's."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from marscli.errors import BadInput, check_range
from marscli.records.jsonl import dumps, iter_rows
from marscli.records.provenance import stage_inputs
from marscli.view.inspect import parse_where, render_plain, render_rich, select


@stage_inputs()
def main(path: str, ids: list[str] | None = None, where: list[str] | None = None,
         limit: int | None = None, as_json: bool = False, as_ids: bool = False) -> int:
    """Print the matching trajectories of `path` to stdout, then how many matched to stderr;
    returns that count."""
    check_range("--limit", limit, 1)
    if as_json and as_ids:
        raise BadInput("--json and --ids: pick one")
    preds = [parse_where(w) for w in where or []]  # bad expressions fail before reading

    def rows() -> Iterator[dict]:
        for line, row in iter_rows(path):
            if "segments" not in row and "id" not in row:
                raise BadInput(f"{path}:{line}: segments: missing required field — inspect "
                               "reads trajectory rows (rollout, reward or advantages output)")
            yield row

    console = None
    if not (as_json or as_ids):
        from rich.console import Console

        console = Console(highlight=False)
    n = 0
    out = sys.stdout
    try:
        for rec in select(rows(), ids, preds, limit):
            n += 1
            if as_ids:
                out.write(f"{rec.get('id')}\n")
            elif as_json:
                out.flush()
                sys.stdout.buffer.write(dumps(rec))
            elif console.is_terminal:
                render_rich(rec, console)
            else:
                out.write(render_plain(rec) + "\n")
        out.flush()
    except BrokenPipeError:  # `marscli inspect ... | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    print(f"{n:,} {'trajectory' if n == 1 else 'trajectories'} matched", file=sys.stderr)
    return n

