"""`marscli advantages SCORED.jsonl`: scored rows in, advantage rows out (numpy only, no torch).

The options are checked before the input is read (stdin may block), the rows are turned into
advantage rows by `rl.advantages.run` (the estimators and what each departs from), written
atomically, then the sidecar and one line on stderr.
"""

from __future__ import annotations

import sys
import time

from marscli.records.jsonl import read_rows
from marscli.records.outputs import AtomicJsonl
from marscli.records.provenance import stage_inputs
from marscli.records.sidecar import write_sidecar
from marscli.rl.advantages import EPS_BATCH, EPS_GROUP, check_options, run


@stage_inputs()
def main(input: str, output: str = "-", estimator: str = "bn-gspo", minibatches: int = 1,
         filter_zero_std: bool = False, seed: int = 0, mask_truncated: bool = False) -> dict:
    """read → run → atomic write → sidecar; a one-line summary on stderr. Returns the stats."""
    started = time.time()
    check_options(estimator, minibatches)  # before blocking on stdin
    rows, stats = run(read_rows(input), input, estimator, minibatches, filter_zero_std, seed,
                      mask_truncated)
    with AtomicJsonl(output) as out:
        out.write_all(rows)
    config = {"estimator": estimator, "minibatches": minibatches,
              "filter_zero_std": filter_zero_std, "mask_truncated": mask_truncated,
              "eps_group": EPS_GROUP, "eps_batch": EPS_BATCH}
    write_sidecar(output, stage="advantages", seed=seed, config=config, inputs=[input],
                  stats=stats, started=started)
    dropped = f", dropped {stats['dropped_groups']} flat groups" if filter_zero_std else ""
    if mask_truncated:
        dropped += f", masked {stats['masked_truncated']} truncated"
    if stats["unscored_rows"]:
        dropped += f", skipped {stats['unscored_rows']} unscored rows"
    if stats["prompt_too_long_rows"]:
        dropped += f", skipped {stats['prompt_too_long_rows']} prompt_too_long rows"
    print(f"advantages ({estimator}): {stats['rows']} rows in {stats['groups']} groups{dropped}, "
          f"zero-std groups {stats['zero_std_groups']}, "
          f"wrote {'stdout' if output == '-' else output}",
          file=sys.stderr)
    return stats
