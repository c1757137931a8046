"""Experiment trackers: the spec (option, then MARSCLI_TRACK, then none), flattening, the
TensorBoard event files read back (by TensorBoard's own loader where it is installed, and by
parsing the records, CRCs checked, everywhere), W&B offline through a stand-in module, JSONL."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from marscli.errors import BadInput
from marscli.records.trackers import (
    JsonlTracker,
    NullTracker,
    TensorBoardTracker,
    crc32c,
    flatten,
    iteration_of,
    open_tracker,
)

METRICS = [({"loss": 0.5, "grad": {"norm": 2.0, "clipped": True}, "note": "x", "n": 3}, 1),
           ({"loss": 0.25, "grad": {"norm": 1.0}, "lr": None}, 2)]
WANT = {"loss": [(1, 0.5), (2, 0.25)], "grad/norm": [(1, 2.0), (2, 1.0)], "n": [(1, 3.0)]}


def test_flatten_keeps_numbers_under_slashed_names():
    assert flatten(METRICS[0][0]) == {"loss": 0.5, "grad/norm": 2.0, "n": 3.0}
    assert flatten({"a": {"b": {"c": 1}}, "d": [1, 2], "e": None}) == {"a/b/c": 1.0}


def test_spec_comes_from_the_option_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MARSCLI_TRACK", raising=False)
    assert isinstance(open_tracker(None, run="r", config={}), NullTracker)
    monkeypatch.setenv("MARSCLI_TRACK", f"jsonl:{tmp_path / 'env.jsonl'}")
    assert isinstance(open_tracker(None, run="r", config={}), JsonlTracker)
    assert isinstance(open_tracker("none", run="r", config={}), NullTracker)  # option wins
    monkeypatch.setenv("MARSCLI_TRACK", "nope:x")
    with pytest.raises(BadInput, match=r"^MARSCLI_TRACK: 'nope:x': unknown tracker 'nope' — "
                                       r"choose one of: jsonl, tensorboard, wandb"):
        open_tracker(None, run="r", config={})
    with pytest.raises(BadInput, match=r"^--track: 'tensorboard': tensorboard needs an "
                                       r"argument — e.g. tensorboard:runs/tb$"):
        open_tracker("tensorboard", run="r", config={})


def test_crc32c_is_castagnolis():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crc32c(b"") == 0


def _masked(data: bytes) -> bytes:
    c = crc32c(data)
    return struct.pack("<I", (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def records(path: Path) -> list[bytes]:
    """The TFRecords of an event file, both CRCs of each checked."""
    data, i, out = path.read_bytes(), 0, []
    while i < len(data):
        head = data[i:i + 8]
        (n,) = struct.unpack("<Q", head)
        assert data[i + 8:i + 12] == _masked(head), f"length CRC at {i}"
        body = data[i + 12:i + 12 + n]
        assert data[i + 12 + n:i + 16 + n] == _masked(body), f"data CRC at {i}"
        out.append(body)
        i += 16 + n
    return out


def _scalars_by_hand(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag → [(step, value)] from the built-in writer's protobuf bytes, parsed field by field
    (a second, independent reading of the format)."""
    def fields(b: bytes):
        i = 0
        while i < len(b):
            key, i = _varint(b, i)
            num, wire = key >> 3, key & 7
            if wire == 0:
                v, i = _varint(b, i)
            elif wire == 1:
                v, i = b[i:i + 8], i + 8
            elif wire == 5:
                v, i = b[i:i + 4], i + 4
            else:
                n, i = _varint(b, i)
                v, i = b[i:i + n], i + n
            yield num, v

    out: dict[str, list] = {}
    [f] = folder.glob("events.out.tfevents.*")
    recs = records(f)
    assert dict(fields(recs[0]))[3] == b"brain.Event:2"
    for r in recs[1:]:
        ev = dict(fields(r))
        val = dict(fields(dict(fields(ev[5]))[1]))
        out.setdefault(val[1].decode(), []).append((ev[2], struct.unpack("<f", val[2])[0]))
    return out


def _varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        n |= (b[i] & 0x7F) << shift
        shift += 7
        i += 1
        if not b[i - 1] & 0x80:
            return n, i


def _scalars_by_tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(folder))
    acc.Reload()
    return {t: [(s.step, s.value) for s in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _log(tr) -> None:
    for m, step in METRICS:
        tr.log(m, step)
    tr.close()


def test_builtin_event_writer_is_read_back(tmp_path):
    """The writer used where the tensorboard package is missing: the records parse by hand,
    and TensorBoard's own loader (where installed) reads the same scalars."""
    tr = TensorBoardTracker(str(tmp_path / "tb"), "iter-1/update", {"seed": 3}, builtin=True)
    _log(tr)
    folder = tmp_path / "tb" / "iter-1" / "update"
    assert json.loads((folder / "config.json").read_text()) == {"seed": 3}
    assert _scalars_by_hand(folder) == WANT
    assert _scalars_by_tensorboard(folder) == WANT


def test_summary_writer_path_where_tensorboard_is_installed(tmp_path):
    pytest.importorskip("tensorboard")
    tr = open_tracker(f"tensorboard:{tmp_path / 'tb'}", run="sft", config={"lr": 1e-5})
    assert not hasattr(tr.writer, "fh")  # torch's SummaryWriter, not the built-in one
    _log(tr)
    assert _scalars_by_tensorboard(tmp_path / "tb" / "sft") == WANT


def test_event_values_beyond_float32_become_infinities(tmp_path):
    tr = TensorBoardTracker(str(tmp_path), "r", {}, builtin=True)
    tr.log({"big": 1e300, "small": -1e300}, 0)
    tr.close()
    assert _scalars_by_hand(tmp_path / "r") == {"big": [(0, math.inf)], "small": [(0, -math.inf)]}


def test_jsonl_tracker_appends_a_line_a_step(tmp_path):
    p = tmp_path / "t" / "track.jsonl"
    _log(open_tracker(f"jsonl:{p}", run="a", config={}))
    _log(open_tracker(f"jsonl:{p}", run="b", config={}))
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    assert [(r["run"], r["step"]) for r in rows] == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert rows[0] == {"v": 1, "run": "a", "step": 1,
                       "metrics": {"loss": 0.5, "grad/norm": 2.0, "n": 3.0}}


def test_wandb_runs_offline_with_the_config(monkeypatch):
    calls: dict = {"log": []}

    def init(**kw):
        calls["init"] = kw
        return SimpleNamespace(log=lambda m, step: calls["log"].append((step, m)),
                               finish=lambda: calls.setdefault("finished", True))

    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _log(open_tracker("wandb:marscli-tiny", run="iter-1/update", config={"seed": 0}))
    assert calls["init"] == {"project": "marscli-tiny", "name": "iter-1/update",
                             "config": {"seed": 0}, "mode": "offline"}
    assert calls["log"][1] == (2, {"loss": 0.25, "grad/norm": 1.0}) and calls["finished"]


def test_wandb_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(BadInput, match=r"^--track: wandb is not installed — pip install wandb"):
        open_tracker("wandb:p", run="r", config={})


@pytest.mark.parametrize("path,k", [
    ("runs/demo/iter-3/rollouts.jsonl", 3), ("runs/demo/eval/ckpt-12.jsonl", 12),
    ("runs/demo/ckpt-2", 2), ("runs/iter-1/x/iter-4/scored.jsonl", 4),
    ("runs/demo/rollouts.jsonl", 0), ("runs/myiter-7/a.jsonl", 0)])
def test_iteration_of_reads_the_run_folder_layout(path, k):
    assert iteration_of(path) == k


def test_stages_send_their_metrics_to_the_tracker(tiny_model, tmp_path, monkeypatch):
    """Wired end to end: `rollout --track` logs its summary at the iteration of its path, and
    `sft` (through `MARSCLI_TRACK`, as `make rl` passes it) one line per optimiser step,
    the same rows as its metrics file."""
    from helpers import invoke, read_jsonl, write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    traj = tmp_path / "run" / "iter-2" / "rollouts.jsonl"
    track = tmp_path / "track.jsonl"
    code, _, err = invoke(["rollout", str(prompts), "--policy", str(tiny_model), "--engine",
                           "replay", "-n", "2", "-o", str(traj), "--track", f"jsonl:{track}"])
    assert code == 0, err
    (line,) = read_jsonl(track)
    assert line["run"] == "run/rollout" and line["step"] == 2
    assert line["metrics"]["trajectories"] == 4

    monkeypatch.setenv("MARSCLI_TRACK", f"jsonl:{tmp_path / 'sft-track.jsonl'}")
    out = tmp_path / "run" / "ckpt-0"
    code, _, err = invoke(["sft", str(traj), "--policy", str(tiny_model), "--out", str(out),
                           "--epochs", "2", "--batch-size", "2"])
    assert code == 0, err
    steps = read_jsonl(out / "metrics.jsonl")
    logged = read_jsonl(tmp_path / "sft-track.jsonl")
    assert [r["step"] for r in logged] == [r["step"] for r in steps] and len(steps) == 4
    assert all(r["run"] == "run/ckpt-0" for r in logged)
    assert logged[0]["metrics"]["loss"] == pytest.approx(steps[0]["loss"])


def test_a_bad_track_spec_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from helpers import invoke

    monkeypatch.setenv("MARSCLI_TRACK", "mlflow:x")
    code, _, err = invoke(["sft", str(tmp_path / "none.jsonl"), "--policy", str(tmp_path),
                           "--out", str(tmp_path / "o")])
    assert code == 2 and "MARSCLI_TRACK: 'mlflow:x': unknown tracker" in err, err
