"""`marscli summary` (toy/summary.py): RUN/summary.json per run (the demo's contract) and the
table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from helpers import MARSCLI

ROOT = Path(__file__).resolve().parents[2]


def eval_summary(acc: float, zoom: float, cats: dict[str, float]) -> dict:
    """The fields `marscli eval summarize` writes that the summary reads."""
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


def summarize(*runs: Path, iters: int, opts: tuple[str, ...] = ()) -> str:
    proc = subprocess.run([*MARSCLI, "summary", *map(str, runs), "--iters", str(iters), *opts],
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


def zoom_record(box: list[int], logo: list[int], acc: float, category: str = "perception",
                crop_of_crop: list[int] | None = None) -> dict:
    """An eval record of the toy world with one zoom (and optionally a zoom into the crop)."""
    images = [{"path": "scene.png"}, {"path": "c1.png", "from": 0, "bbox_2d": box}]
    if crop_of_crop:
        images.append({"path": "c2.png", "from": 1, "bbox_2d": crop_of_crop})
    return {"toy": {"logo_box": logo, "size": 1000}, "images": images, "category": category,
            "tool_calls": {"image_zoom_in_tool": len(images) - 1},
            "score": {"accuracy": acc}}


def write_evals(run: Path, k: int, recs: list[dict]) -> None:
    (run / "eval" / f"ckpt-{k}.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n"
                                                            for r in recs))


def test_zoom_hits_map_a_crop_of_a_crop_back_to_the_scene():
    from marscli.toy.hits import hit_rate, zoom_hits

    logo = [600, 600, 700, 700]
    assert zoom_hits(zoom_record([500, 500, 750, 750], logo, 1)) == (1, 1)
    assert zoom_hits(zoom_record([500, 500, 650, 750], logo, 0)) == (1, 0)  # cuts the logo
    # the second box is [400..800] of the first crop [500..750]: scene 600..700, a hit
    rec = zoom_record([500, 500, 750, 750], logo, 1, crop_of_crop=[400, 400, 800, 800])
    assert zoom_hits(rec) == (2, 2)
    rec = zoom_record([500, 500, 750, 750], logo, 1, crop_of_crop=[0, 0, 300, 300])
    assert zoom_hits(rec) == (2, 1)
    assert zoom_hits({"toy": {}, "images": []}) == (0, 0)  # no ground truth: not counted
    assert hit_rate([zoom_record([0, 0, 10, 10], logo, 0)]) == 0.0
    assert hit_rate([]) is None


def test_seeds_give_mean_and_student_t_interval(tmp_path):
    accs = {"demo": [10.0, 20.0], "demo-seed1": [10.0, 26.0], "demo-seed2": [10.0, 29.0]}
    runs = {n: make_run(tmp_path, n, a) for n, a in accs.items()}
    logo = [600, 600, 700, 700]
    hit, miss = [500, 500, 750, 750], [0, 0, 250, 250]
    for name, run in runs.items():  # seed 0: 1 hit of 2 zooms at iter 1; others 2 of 2
        write_evals(run, 0, [zoom_record(miss, logo, 0), zoom_record(miss, logo, 0)])
        write_evals(run, 1, [zoom_record(hit, logo, 1),
                             zoom_record(miss if name == "demo" else hit, logo, 0)])
    png = tmp_path / "demo.png"
    table = summarize(runs["demo"], iters=1, opts=("--seeds", "3", "--plot", str(png)))
    summary = orjson.loads((runs["demo"] / "summary.json").read_bytes())
    assert summary["seeds"] == 3
    first, last = summary["iterations"]
    assert (first["test_accuracy"], first["test_accuracy_ci95"]) == (10.0, 0.0)
    # 20, 26, 29: mean 25, sd sqrt(21) = 4.583, t(2) = 4.303: 4.303 * 4.583 / sqrt(3) = 11.385
    assert last["test_accuracy"] == 25.0
    assert last["test_accuracy_ci95"] == pytest.approx(11.385, abs=1e-3)
    assert [p["test_accuracy"] for p in last["per_seed"]] == [20.0, 26.0, 29.0]
    assert [p["zoom_hit_rate"] for p in last["per_seed"]] == [50.0, 100.0, 100.0]
    assert first["zoom_hit_rate"] == 0.0 and last["zoom_hit_rate"] == pytest.approx(83.333)
    assert last["by_category"]["perception"]["tool_calls"] == {"zoom": 1.0}
    assert "25.0 ± 11.4" in table and "20.0 26.0 29.0" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_iterations_between_evaluations_keep_their_rollout_columns(tmp_path):
    """EVAL_EVERY=2: checkpoint 1 has no test-split evaluation, but its training rollouts (how
    often they zoom, and where) still make a row."""
    run = make_run(tmp_path, "demo", [30.0, None, 40.0])
    logo, hit, miss = [600, 600, 700, 700], [500, 500, 750, 750], [0, 0, 250, 250]
    it = run / "iter-1"
    it.mkdir()
    (it / "scored.jsonl.meta.json").write_bytes(orjson.dumps(
        {"stats": {"rows": 4, "accuracy_mean": 0.5, "format_mean": 1.0}}))
    direct = {"toy": {"logo_box": logo, "size": 1000}, "images": [{"path": "s.png"}],
              "tool_calls": {}}
    (it / "rollouts.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [
        zoom_record(hit, logo, 1), zoom_record(hit, logo, 1), zoom_record(miss, logo, 0),
        direct]))
    table = summarize(run, iters=2)
    rows = orjson.loads((run / "summary.json").read_bytes())["iterations"]
    assert [r["iter"] for r in rows] == [0, 1, 2]
    mid = rows[1]
    assert mid["test_accuracy"] is None and mid["zoom_hit_rate"] is None
    assert mid["rollout_accuracy"] == 50.0
    assert mid["rollout_zoom_share"] == 75.0  # 3 of 4 rollouts zoom
    assert mid["rollout_zoom_hit_rate"] == pytest.approx(66.667, abs=1e-2)  # 2 of 3 calls hit
    assert mid["rollout_found"] == 50.0  # 2 of 4 rollouts zoom on the logo
    assert rows[2]["zoom_calls"] == pytest.approx(0.8)
    assert "75.0" in table and "66.7" in table


# --------------------------------------------------------------------------- per question kind

LOGO, HIT, MISS = [600, 600, 700, 700], [500, 500, 750, 750], [0, 0, 250, 250]
MALFORMED = '<tool_call>{"name": "image_search_tool", "arguments": </tool_call>'  # never run


def call(name: str, **arguments) -> str:
    return "<thinking>t</thinking><tool_call>" + orjson.dumps(
        {"name": name, "arguments": arguments}).decode() + "</tool_call>"


IMAGE = call("image_search_tool")


def text(query: str) -> str:
    return call("text_search_tool", query=query)


def kind_record(kind: str, acc: float, *turns: str, zoom: list[int] | None = None) -> dict:
    """A toy trajectory about the company Zirbi: an optional first zoom (its crop in `images`,
    where the zoom hit rate reads it), then `turns` (model turns), then the answer."""
    images = [{"path": "scene.png"}]
    if zoom:
        images.append({"path": "c1.png", "from": 0, "bbox_2d": zoom})
        turns = (call("image_zoom_in_tool", bbox_2d=zoom), *turns)
    segments = [{"role": "prompt", "text": "q"}]
    for t in turns:
        segments += [{"role": "model", "text": t}, {"role": "tool", "text": "result"}]
    segments.append({"role": "model", "text": "<answer>a</answer>"})
    return {"toy": {"entity": "Zirbi", "logo_box": LOGO, "size": 1000}, "category": kind,
            "images": images, "segments": segments, "tool_calls": {}, "score": {"accuracy": acc}}


SEED_RECORDS = [
    [kind_record("perception", 1, zoom=HIT),
     kind_record("perception", 0, zoom=MISS),  # zooms, but not on the logo
     kind_record("perception", 0),
     kind_record("knowledge", 1, text("zirbi city")),  # the name, in another case
     kind_record("knowledge", 0, text("Maske city")),  # the wrong company: not found
     kind_record("both", 1, IMAGE, text("Zirbi founder")),  # the chain: found
     kind_record("both", 0, text("Zirbi founder"), IMAGE),  # guessed the name first: not found
     kind_record("both", 0, MALFORMED, text("Zirbi founder"))],  # no image search: not found
    [kind_record("perception", 1, zoom=HIT),
     kind_record("perception", 0, zoom=HIT),
     kind_record("knowledge", 1, text("Zirbi city")),
     kind_record("knowledge", 0),
     kind_record("both", 1, IMAGE, text("Zirbi"), zoom=HIT)],
]
# per seed and kind, by hand: (accuracy, zoom, text, image, found) %
EXPECTED = [
    {"perception": (33.33, 66.67, 0.0, 0.0, 33.33), "knowledge": (50.0, 0.0, 100.0, 0.0, 50.0),
     "both": (33.33, 0.0, 100.0, 66.67, 33.33)},
    {"perception": (50.0, 100.0, 0.0, 0.0, 100.0), "knowledge": (50.0, 0.0, 50.0, 0.0, 50.0),
     "both": (100.0, 100.0, 100.0, 100.0, 100.0)},
]
KIND_FIELDS = ("accuracy", "zoom", "text", "image", "found")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def test_tool_calls_parse_model_turns_and_skip_malformed_ones():
    from marscli.toy.summary import tool_calls

    rec = kind_record("both", 1, MALFORMED, IMAGE, text("Zirbi"), IMAGE + text("x"))
    rec["segments"].insert(1, {"role": "tool", "text": text("not the model's")})
    # the malformed call, the tool segment and the two-call turn (a format error) are no calls
    assert tool_calls(rec) == [("image", {}), ("text", {"query": "Zirbi"})]


def test_per_kind_accuracy_tool_share_and_found_over_seeds(tmp_path):
    cats = {"perception": 40.0, "knowledge": 50.0, "both": 60.0}
    runs = [make_run(tmp_path, name, [40.0], cats_of=lambda _: cats)
            for name in ("demo", "demo-seed1")]
    for run, recs in zip(runs, SEED_RECORDS, strict=True):
        write_evals(run, 0, recs)
        rollouts = [{k: v for k, v in r.items() if k != "score"} for r in recs]
        write_jsonl(run / "iter-0" / "rollouts.jsonl", rollouts)
        scored = [{**r, "reward": {"accuracy": r["score"]["accuracy"]}} for r in recs]
        if run.name == "demo-seed1":  # an unscored rollout has no accuracy: left out
            scored[3]["reward"] = {"status": "unscored", "error": "judge down"}
        write_jsonl(run / "iter-0" / "scored.jsonl", scored)
    png = tmp_path / "kinds.png"
    table = summarize(runs[0], iters=0, opts=("--seeds", "2", "--plot", str(png)))
    (row,) = orjson.loads((runs[0] / "summary.json").read_bytes())["iterations"]
    kinds = row["kinds"]
    assert list(kinds) == ["perception", "knowledge", "both"]
    for kind, st in kinds.items():
        for s, seed in enumerate(st["per_seed"]):
            assert seed["seed"] == s
            for field, want in zip(KIND_FIELDS, EXPECTED[s][kind], strict=True):
                # the rollouts are the test records again, but for seed 1's unscored one
                rollout_want = 100.0 if (s, kind, field) == (1, "knowledge", "accuracy") else want
                assert seed[f"test_{field}"] == want, (s, kind, field)
                assert seed[f"rollout_{field}"] == rollout_want, (s, kind, field)
        for field in KIND_FIELDS:
            # two seeds: sd = |a - b| / sqrt(2), so the half-width t(1) * sd / sqrt(2) is
            # 12.706 * |a - b| / 2
            a, b = (EXPECTED[s][kind][KIND_FIELDS.index(field)] for s in (0, 1))
            assert st[f"test_{field}"] == pytest.approx((a + b) / 2, abs=1e-3)
            assert st[f"test_{field}_ci95"] == pytest.approx(12.706 * abs(a - b) / 2, abs=1e-3)
    assert kinds["knowledge"]["rollout_accuracy"] == 75.0  # seeds 50 and 100
    assert kinds["knowledge"]["rollout_accuracy_ci95"] == pytest.approx(12.706 * 25)
    assert kinds["both"]["per_seed"][0]["test_items"] == 3
    assert row["test_accuracy"] == 40.0  # the existing fields stay
    # the table by kind: perception's test accuracy 33.33 and 50 is 41.7 ± 105.9
    lines = table.splitlines()
    assert any("by question kind" in line for line in lines)
    assert any("perception" in line and "41.7 ± 105.9" in line for line in lines)
    assert any("knowledge" in line and "50.0 ± 0.0" in line for line in lines)
    assert any("both" in line and "66.7 ± 423.6" in line for line in lines)  # found 33.33, 100
    assert "by category" not in table  # the table by kind has it
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_world_without_categories_prints_no_kind_table(tmp_path):
    run = make_run(tmp_path, "demo", [30.0])
    write_evals(run, 0, [{k: v for k, v in kind_record("perception", 1).items()
                          if k != "category"}])
    table = summarize(run, iters=0)
    (row,) = orjson.loads((run / "summary.json").read_bytes())["iterations"]
    assert row["kinds"] == {} and "by question kind" not in table


def test_kind_probe_prints_and_writes_one_eval_files_stats_per_kind(tmp_path):
    """scripts/kind_probe.py (make tiny-vlm-search's measure on a world never seen): the same
    per-kind numbers as the run summary, from one eval file; a missing file is exit 2."""
    evals = tmp_path / "probe.jsonl"
    write_jsonl(evals, [*SEED_RECORDS[0], {"id": "unanswered", "error": "judge down"}])
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts/kind_probe.py"), str(evals),
                        "--out", str(out)], capture_output=True, text=True, check=True)
    stats = orjson.loads(out.read_bytes())
    assert list(stats) == ["perception", "knowledge", "both"]
    for kind, want in EXPECTED[0].items():
        got = [stats[kind][f"test_{f}"] for f in KIND_FIELDS]
        assert got == pytest.approx(list(want), abs=0.01), kind
    assert stats["both"]["test_items"] == 3  # the record without segments is left out
    assert "knowledge   n=2   accuracy 50.0%  calls zoom 0.0%  text 100.0%" in r.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts/kind_probe.py"),
                          str(tmp_path / "none.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 2 and "none.jsonl: no such file" in bad.stderr
    torn = tmp_path / "torn.jsonl"  # an eval killed mid-write: its last line is cut
    torn.write_bytes(evals.read_bytes()[:-10])
    last = len(torn.read_bytes().splitlines())
    (tmp_path / "iter-0").mkdir()  # a run whose iteration 0 was killed mid-write
    (tmp_path / "iter-0" / "rollouts.jsonl").write_bytes(torn.read_bytes())
    for cmd in ([sys.executable, str(ROOT / "scripts/kind_probe.py"), str(torn)],
                [*MARSCLI, "summary", str(tmp_path), "--iters", "0"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 2, (cmd, r.stderr)
        assert r.stderr.strip().count("\n") == 0, r.stderr
        assert f".jsonl:{last}: not valid JSON (truncated last line?)" in r.stderr
