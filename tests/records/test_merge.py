from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "marscli", *args], capture_output=True, text=True)


def test_merge_joins_shards_in_order(tmp_path):
    a, b, out = tmp_path / "o.shard-0", tmp_path / "o.shard-1", tmp_path / "o.jsonl"
    a.write_text('{"v": 1, "id": "p1#0"}\n{"v": 1, "id": "p1#1"}\n')
    b.write_text('{"v": 1, "id": "p2#0", "x": [1]}\n')
    for shard in (a, b):  # finished shards: their jobs wrote their sidecars
        shard.with_name(f"{shard.name}.meta.json").write_text("{}")
    res = run("merge", str(out), str(a), str(b))
    assert res.returncode == 0, res.stderr
    assert [orjson.loads(x)["id"] for x in out.read_text().splitlines()] == ["p1#0", "p1#1", "p2#0"]
    meta = orjson.loads((tmp_path / "o.jsonl.meta.json").read_bytes())
    assert meta["stats"]["records"] == 3


def test_merge_refuses_duplicates_and_writes_nothing(tmp_path):
    a, out = tmp_path / "a", tmp_path / "o.jsonl"
    a.write_text('{"v": 1, "id": "x"}\n')
    (tmp_path / "a.meta.json").write_text("{}")
    res = run("merge", str(out), str(a), str(a))
    assert res.returncode == 2 and f"{a}:1: id: duplicate id 'x'" in res.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------- shards of one job
# Real shards (rollout and eval through the replay engine), so that what merge compares is what
# the stages write: OUT.shard-i.meta.json and OUT.shard-i.settings.json.


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_model) -> dict[str, str]:
    """A job of 3 rollout shards (shard 2 made with a moved copy of the same policy), and the
    strays a careless `merge` meets: shard 1 of another seed, of another policy, of another
    prompts file, of another count (1/2); and a job of 3 eval shards (its shard 1: `eval`)."""
    from helpers import MIXED, invoke, write_bench, write_prompts

    root = tmp_path_factory.mktemp("shards")
    ids = [f"q{i:02d}" for i in range(12)]
    prompts = write_prompts(root / "p.jsonl", ids)
    changed = write_prompts(root / "p2.jsonl", ids, question="Which shape?")
    moved, other = root / "moved", root / "other"
    shutil.copytree(tiny_model, moved)
    shutil.copytree(tiny_model, other)
    with (other / "chat_template.jinja").open("a") as fh:
        fh.write("{# another checkpoint #}")
    bench = write_bench(root / "bench" / "b.jsonl", [{**r, "id": f"{r['id']}-{k}"}
                                                      for k in range(2) for r in MIXED])
    made = {}

    def rollout(name: str, shard: str, data=prompts, policy=tiny_model, *extra: str) -> None:
        out = root / name / f"o.jsonl.shard-{shard[0]}"
        code, _, err = invoke(["rollout", str(data), "-o", str(out), "--policy", str(policy),
                               "--engine", "replay", "-n", "1", "--shard", shard, *extra])
        assert code == 0, err
        made[name if name != "job" else f"job{shard[0]}"] = str(out)

    for i, policy in ((0, tiny_model), (1, tiny_model), (2, moved)):
        rollout("job", f"{i}/3", prompts, policy)
    rollout("seed", "1/3", prompts, tiny_model, "--seed", "1")
    rollout("policy", "1/3", prompts, other)
    rollout("input", "1/3", changed)
    rollout("count", "1/2")
    for i in range(3):
        out = root / "eval" / f"o.jsonl.shard-{i}"
        code, _, err = invoke(["eval", str(bench), "-o", str(out), "--policy",
                               str(tiny_model), "--engine", "replay", "--shard", f"{i}/3"])
        assert code == 0, err
        made[f"eval{i}"] = str(out)
    made["eval"] = made["eval1"]
    return made


def merge(tmp_path, *shards: str) -> tuple[int, str]:
    from helpers import invoke

    code, _, err = invoke(["merge", str(tmp_path / "all.jsonl"), *shards])
    return code, err


def refused(tmp_path, code: int, err: str) -> str:
    """One line, exit 2, nothing written; the line."""
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "merge wrote something"
    return err.strip()


def test_merge_of_a_whole_job_records_what_its_shards_agree_on(tmp_path, shards):
    """Shard 2 was made with the policy moved elsewhere (same weights), and one shard went
    through another server: both are shards of one job."""
    settings = Path(f"{shards['job1']}.settings.json")
    saved = settings.read_bytes()
    data = orjson.loads(saved)
    data["settings"]["base_url"] = "http://node7:8000"  # SERVE_URLS: shard i, server i mod k
    settings.write_bytes(orjson.dumps(data))
    try:
        code, err = merge(tmp_path, shards["job0"], shards["job1"], shards["job2"])
    finally:
        settings.write_bytes(saved)
    assert code == 0, err
    assert "missing" not in err
    meta = orjson.loads((tmp_path / "all.jsonl.meta.json").read_bytes())
    assert meta["stats"]["records"] == 12 and meta["stats"]["complete"] is True
    assert meta["stats"]["missing_shards"] == [] and meta["stats"]["partial"] == []
    assert meta["config"]["of_stage"] == "rollout" and meta["config"]["shard_count"] == 3
    assert meta["config"]["settings"]["n"] == 1 and "shard" not in meta["config"]["settings"]
    assert meta["seed"] == 0


@pytest.mark.parametrize(("stray", "want"), [
    ("seed", "seed: 1 here, 0 in {job0}"),
    ("policy", "policy: {other} (sha256 "),
    ("input", "input: {p2} (sha256 "),
    ("eval", "stage: eval here, rollout in {job0}"),
    ("count", "shard: 1/2 here, 0/3 in {job0}"),
])
def test_merge_refuses_a_shard_of_another_job_naming_the_difference(tmp_path, shards, stray,
                                                                    want):
    root = Path(shards["job0"]).parents[1]
    code, err = merge(tmp_path, shards["job0"], shards[stray], shards["job2"])
    line = refused(tmp_path, code, err)
    assert line.removeprefix("error: ").startswith(f"{shards[stray]}: ")
    assert want.format(other=root / "other", p2=root / "p2.jsonl", **shards) in line
    assert "not shards of one job" in line


def test_merge_refuses_the_same_shard_twice(tmp_path, shards):
    copy = tmp_path.parent / f"{tmp_path.name}-copy"
    copy.mkdir()
    for suffix in ("", ".meta.json", ".settings.json"):
        shutil.copy(f"{shards['job1']}{suffix}", copy / f"o.jsonl.shard-9{suffix}")
    code, err = merge(tmp_path, shards["job0"], shards["job1"], str(copy / "o.jsonl.shard-9"))
    line = refused(tmp_path, code, err)
    assert f"shard: 1/3, as {shards['job1']} — the same shard given twice" in line


def test_merge_refuses_a_job_with_a_shard_missing_unless_allow_partial(tmp_path, shards):
    code, err = merge(tmp_path, shards["job0"], shards["job2"])
    line = refused(tmp_path, code, err)
    assert "2 of the 3 shards given, none is shard 1/3" in line and "--allow-partial" in line
    code, err = merge(tmp_path, shards["job0"], shards["job2"], "--allow-partial")
    assert code == 0, err
    assert "shard 1/3 missing (--allow-partial)" in err
    meta = orjson.loads((tmp_path / "all.jsonl.meta.json").read_bytes())
    assert meta["stats"]["missing_shards"] == ["1/3"] and meta["stats"]["complete"] is False
    assert meta["config"]["allow_partial"] is True


def test_merge_of_eval_shards_then_summarize(tmp_path, shards):
    """Eval's shards each read the whole benchmark (the same sha256); merge writes no summary
    (make runs `eval summarize` after it), and a refused merge leaves nothing to summarize."""
    from helpers import invoke

    code, err = merge(tmp_path, shards["job0"], shards["eval1"], shards["eval2"])
    refused(tmp_path, code, err)
    code, err = merge(tmp_path, shards["eval0"], shards["eval1"], shards["eval2"])
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.jsonl", "all.jsonl.meta.json"]
    meta = orjson.loads((tmp_path / "all.jsonl.meta.json").read_bytes())
    assert meta["config"]["of_stage"] == "eval" and meta["stats"]["records"] == 12
    code, _, err = invoke(["eval", "summarize", str(tmp_path / "all.jsonl")])
    assert code == 0, err
    assert (tmp_path / "all.summary.json").is_file()
    # a re-merge replaces OUT: the old summary (make's `test -f` target) must not outlive it
    code, err = merge(tmp_path, shards["eval0"], shards["eval1"], shards["eval2"])
    assert code == 0, err
    assert not (tmp_path / "all.summary.json").exists()


def test_allow_partial_takes_an_unfinished_shard_of_the_job_but_never_another_job(tmp_path,
                                                                                  shards):
    """A killed shard has no sidecar, but its settings file (written before its first record)
    says what made it: another seed is refused, --allow-partial or not."""
    killed = tmp_path.parent / f"{tmp_path.name}-killed"
    killed.mkdir()
    for name in ("job1", "seed", "eval"):
        for suffix in ("", ".settings.json"):
            shutil.copy(f"{shards[name]}{suffix}", killed / f"{name}{suffix}")
    for stray, want in (("seed", "seed: 1 here, 0 in"), ("eval", "stage: eval here, rollout")):
        code, err = merge(tmp_path, shards["job0"], str(killed / stray), shards["job2"],
                          "--allow-partial")
        assert want in refused(tmp_path, code, err)
    code, err = merge(tmp_path, shards["job0"], str(killed / "job1"), shards["job2"],
                      "--allow-partial")
    assert code == 0, err
    meta = orjson.loads((tmp_path / "all.jsonl.meta.json").read_bytes())
    assert meta["stats"]["partial"] == [str(killed / "job1")]
    assert meta["stats"]["complete"] is False and meta["stats"]["missing_shards"] == []
