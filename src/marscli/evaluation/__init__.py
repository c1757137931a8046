"""Evaluation's library: what `marscli eval` and its subcommands compute, apart from the
commands (`stages/eval.py`, `stages/eval_summarize.py`, `stages/eval_check.py`).

- `paths.py`: where an eval's summary and decoded images go.
- `modes.py`: `--mode agent|direct` and the direct prompt.
- `check.py`: a benchmark as eval reads it (`eval --check`), one-line errors.
- `summary.py`: the summary of a results file, per benchmark and category.
- `table.py`: the summary as a table and warnings on stderr.
- `health.py`: tool, page-fetch and judge health in the summary.
- `rescore.py`: re-scoring a results file in place (`eval rescore`).
- `compare.py`: checkpoints compared with 95% intervals (`eval summarize RUN`).
"""
