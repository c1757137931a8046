from __future__ import annotations

import subprocess
import sys

import orjson


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
