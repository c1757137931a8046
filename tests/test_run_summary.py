"""scripts/run_summary.py: RUN/summary.json per run (the demo's contract) and the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]


def eval_summary(acc: float, zoom: float, cats: dict[str, float]) -> dict:
    """The fields `marscli eval --summarize` writes that the script reads."""
    return {"v": 1, "benchmarks": {"world": {
        "accuracy": acc, "items": 96, "mean_turns": 1 + zoom,
        "tool_use": {"image_zoom_in_tool": {"histogram": {}, "mean": zoom}},
        "categories": {c: {"accuracy": a} for c, a in cats.items()}}}}


def make_run(root: Path, name: str, accs: list[float], cats_of=lambda a: {"perception": a}):
    run = root / name
    (run / "eval").mkdir(parents=True)
    for k, acc in enumerate(accs):
        if acc is None:
            continue
        (run / "eval" / f"ckpt-{k}.summary.json").write_bytes(
            orjson.dumps(eval_summary(acc, 1.0 - k / 10, cats_of(acc))))
    (run / "iter-0").mkdir()
    (run / "iter-0" / "scored.jsonl.meta.json").write_bytes(orjson.dumps(
        {"stats": {"rows": 128, "accuracy_mean": 0.109375, "format_mean": 0.16}}))
    return run


def summarize(*runs: Path, iters: int) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_summary.py"),
                           *map(str, runs), "--iters", str(iters)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_summary_json_has_one_row_per_evaluated_iteration(tmp_path):
    run = make_run(tmp_path, "demo", [9.38, 14.58, None, 19.79])
    table = summarize(run, iters=3)
    rows = orjson.loads((run / "summary.json").read_bytes())["iterations"]
    assert [r["iter"] for r in rows] == [0, 1, 3]  # iteration 2 was not evaluated
    assert [r["test_accuracy"] for r in rows] == [9.38, 14.58, 19.79]
    assert rows[1]["tool_calls"] == {"image_zoom_in_tool": 0.9}
    assert rows[0]["rollout_reward"] == {"accuracy": 0.109375, "format": 0.16, "rows": 128}
    assert rows[1]["rollout_reward"] is None
    assert "10.9" in table and "19.8" in table
    assert "by category" not in table  # one category: the overall accuracy again


def test_table_compares_runs_and_shows_categories_when_there_are_several(tmp_path):
    two = {"perception": 20.0, "knowledge": 5.0}
    a = make_run(tmp_path, "abl-grpo", [9.4, 12.0], cats_of=lambda _: two)
    b = make_run(tmp_path, "abl-bn-gspo", [9.4, 16.7])
    table = summarize(a, b, iters=1)
    assert "by category" in table and "knowledge 5.0" in table
    assert "abl-grpo" in table and "abl-bn-gspo" in table and "16.7" in table
    assert (a / "summary.json").is_file() and (b / "summary.json").is_file()
