"""`marscli reward`: trajectory rows in, the same rows with `reward` out.

    reward.total = accuracy (0 or 1) + format (format_weight or 0)

Accuracy: as `--protocol` scores it, `mars` (the default) or `release`: the entry's `reward`
in `scoring/protocols.py`, which says how every protocol scores (`eval` takes the same entries).

Format: `format_weight` when the trajectory ended with a non-empty answer (stop "answer") and
made no invalid tool call (a tool segment with ok false, or stop "format_error"). The same under
every protocol: the release's format score (0.5, zeroed by a model-caused tool error) is this.

Rows are checked before they are scored (FILE:LINE: field): `answer_gt`, `choices` (1-5 option
strings that the gold answers name), `segments`; with a judge that asks a model, `question` and
the first image's file (relative to the input's folder), which the judge is shown.

A row that rollout refused (`stop: "prompt_too_long"`: its prompt did not fit, nothing was
generated) scores 0 (accuracy 0, format 0) without a judge call, counted as `prompt_too_long`
in the statistics; `advantages` then leaves it out (there is nothing to train on).

Failures: a judge that gives no verdict after its retries leaves the row
`{"status": "unscored", "error": ...}` with no `total`, never a silent 0.
- Up to `max_unscored` of the rows may be unscored: the output and sidecar are written, the
  unscored rows marked so, and `advantages` leaves them out (counting them).
- More than that, and the stage exits 1 leaving neither output nor sidecar (a pre-existing
  output is untouched), so `make` retries it. The rows that were scored go to `OUT.partial`
  (their rewards, keyed by id and a hash of the row and the scoring settings); a re-run takes
  them from there and asks the judge only about the rest, then removes it. With `-o -` there is
  no partial file (the judge's verdict cache still saves the calls).

Nothing here imports torch or transformers (a test checks `marscli reward` in a subprocess).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from marscli.errors import BadInput, RuntimeFailure, check_range
from marscli.records.jsonl import follow_rows, read_rows
from marscli.records.locks import hold_lock
from marscli.records.outputs import AtomicJsonl
from marscli.records.provenance import stage_inputs
from marscli.records.sidecar import write_sidecar
from marscli.scoring.judge import Judge, JudgeOptions, make_judge
from marscli.scoring.partial import load_partial, partial_path, save_partial
from marscli.scoring.protocols import reward_protocol
from marscli.scoring.rewards import run


@stage_inputs()
def main(input: str, output: str = "-", judge_spec: str = "exact", format_weight: float = 0.5,
         max_unscored: float = 0.05, judge_options: JudgeOptions | None = None,
         protocol: str = "mars",
         follow: bool = False) -> dict[str, Any]:
    """`marscli reward`: read, score, write all-or-nothing, write the sidecar. When too many
    rows are unscored: keep the scored ones in `OUT.partial`, write nothing else, and raise
    RuntimeFailure (exit 1). `follow`: score the input's rows as its writer appends them,
    until its sidecar appears (`jsonl.follow_rows`). OUT's lock is held from the start, so a
    second reward (or follower) on the same output fails at once instead of paying for every
    judge call again."""
    check_range("--format-weight", format_weight, 0)
    check_range("--max-unscored", max_unscored, 0, 1)
    opts = judge_options or JudgeOptions()
    opts.check()
    if follow and input == "-":
        raise BadInput("--follow: needs a file that a stage is writing, not stdin (a pipe "
                       "already streams rows as they come)")
    if follow and output != "-" and Path(output).resolve() == Path(input).resolve():
        raise BadInput(f"-o {output}: is the file being followed — pick another output")
    started = time.time()
    reward_protocol(protocol)  # a bad name fails before the judge or the input is touched
    judge = make_judge(judge_spec, opts)  # a bad spec fails before the input is read
    with contextlib.ExitStack() as stack:
        if output != "-":  # held from the start: a second reward on OUT fails before any call
            stack.callback(hold_lock(output).__exit__)
        try:
            rows = follow_rows(input) if follow else read_rows(input)
            out, stats = run(rows, input, judge, format_weight, max_unscored, opts.concurrency,
                             known=load_partial(output), protocol=protocol)
        finally:
            judge.close()
        return _finish(output, input, out, stats, judge, format_weight, max_unscored, protocol,
                       started)


def _finish(output: str, input: str, out: list[dict], stats: dict, judge: Judge,
            format_weight: float, max_unscored: float, protocol: str, started: float) -> dict:
    """Write the scored rows and the sidecar, or (too many unscored) keep the partial file
    and raise RuntimeFailure."""
    _summary(stats)
    if stats["over_unscored"]:
        kept = save_partial(output, out, judge.config(), format_weight, protocol)
        where = f"; the {kept} scored rows are kept in {partial_path(output)}" if kept else ""
        raise RuntimeFailure(
            f"{stats['unscored']} of {stats['rows']} rows unscored (over {max_unscored:.0%}), "
            f"first error: {stats['first_error']} — the judge is failing; nothing was written"
            f"{where}; fix the judge and re-run (scored rows and cached verdicts are reused)")
    with AtomicJsonl(output) as w:
        w.write_all(out)
    config = {**judge.config(), "protocol": protocol, "format_weight": format_weight,
              "max_unscored": max_unscored}
    write_sidecar(output, stage="reward", config=config, inputs=[input], stats=stats,
                  started=started)
    if output != "-":
        partial_path(output).unlink(missing_ok=True)
    return stats


def _summary(stats: dict) -> None:
    """One line on stderr; "no row scored" rather than an accuracy of None."""
    scores = (f"accuracy {stats['accuracy_mean']}, format {stats['format_mean']}"
              if stats["rows"] > stats["unscored"] else "no row scored")
    reused = f", {stats['reused']} from the partial file" if stats["reused"] else ""
    if stats["prompt_too_long"]:
        scores += f" ({stats['prompt_too_long']} prompt_too_long rows scored 0)"
    print(f"reward: {stats['rows']} rows ({stats['protocol']} protocol), {scores}, "
          f"judge calls {stats['judge_calls']} "
          f"(cache hits {stats['cache_hits']}{reused}), unscored {stats['unscored']}",
          file=sys.stderr)
