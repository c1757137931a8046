"""The training state by parameter name, one file per rank (trainstate.py, shards.py,
partitions.py): a state written by 2 ranks (ZeRO-3 + bf16, a real `update`) loads on 1 rank
(ZeRO-2) and on 2 ranks (ZeRO-3), and one written by 1 rank loads on 2 (ZeRO-2), each equal bit
for bit to the saved masters, moments and step (read back with DeepSpeed's own gathering API,
and saved again), with ZeRO-3's model built partitioned (no parameter above the persistence
threshold reaches `deepspeed.initialize` whole); the single master.safetensors of earlier
versions still loads; a rank file missing or damaged, or a broken index, is one line and exit
2, before anything trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from marscli.errors import BadInput

from helpers import bf16_config, torchrun, varied_rows, weights, write_jsonl

HERE = Path(__file__).resolve().parents[1]  # tests/: the workers
WORKER = HERE / "masters_worker.py"


# ------------------------------------------------------------------------------ the reader


def test_flat_ranges_read_alike_from_pieces_and_whole_tensors(tmp_path):
    """Any range of a flattened 2-D tensor, read from three uneven rank pieces or from the
    whole tensor (only the rows that cover it), equals the range itself."""
    import torch
    from safetensors.torch import save_file

    from marscli.train.shards import Piece, open_reader, rank_file, write_index, write_rank_file

    t = torch.arange(7 * 5, dtype=torch.float32).view(7, 5) / 3
    flat = t.reshape(-1)
    cuts = [(0, 11), (11, 12), (12, 35)]  # a one-element piece in the middle
    for r, (a, b) in enumerate(cuts):
        write_rank_file(tmp_path / rank_file("master", r, 3), {"w": flat[a:b]},
                        {"w": Piece(a, b, [7, 5], True)})
    index = write_index(tmp_path, 3, ["master"])
    assert index["params"]["w"]["pieces"] == [[0, 0, 11], [1, 11, 12], [2, 12, 35]]
    save_file({"w": t}, str(tmp_path / "whole.safetensors"))
    with open_reader() as sharded, open_reader() as whole:
        sharded.add_shards(tmp_path, index, "master")
        whole.add_whole([tmp_path / "whole.safetensors"])
        for a, b in [(0, 35), (3, 4), (10, 13), (11, 12), (4, 31), (34, 35), (12, 12)]:
            assert torch.equal(sharded.read("w", a, b), flat[a:b]), (a, b)
            assert torch.equal(whole.read("w", a, b), flat[a:b]), (a, b)
        assert sharded.read("nope") is None
    (tmp_path / rank_file("master", 1, 3)).unlink()
    with pytest.raises(BadInput, match=r"master-rank-00001-of-00003\.safetensors: missing "
                                       r"\(written by rank 1 of 3\)"):
        from marscli.train.shards import read_index

        read_index(tmp_path)


# ------------------------------------------------------------------------------ 1 rank, plain


@pytest.fixture(scope="module")
def adv(tmp_path_factory, processor) -> Path:
    d = tmp_path_factory.mktemp("adv")
    rows = varied_rows(d, processor, minibatches=2)
    return write_jsonl(d / "mb0.jsonl", [r for r in rows if r["minibatch"] == 0])


@pytest.fixture(scope="module")
def plain_state(tmp_path_factory, tiny_model, adv) -> Path:
    """A plain-torch update with a bf16 export: its masters in one rank file."""
    from marscli.stages.update import run_update

    out = tmp_path_factory.mktemp("plain") / "ckpt"
    run_update(str(adv), str(tiny_model), str(out), lr=1e-5, save_dtype="bfloat16")
    return out


def test_old_single_master_file_still_loads(tmp_path, plain_state):
    """A checkpoint of an earlier version (train_state/master.safetensors, state.json v1):
    the model is built from its masters, exactly, not from the bf16 export."""
    import torch
    from safetensors.torch import save_file

    from marscli.train.distributed import Dist
    from marscli.train.trainer import build_model
    from marscli.train.trainstate import read_masters

    masters = read_masters(plain_state)
    old = tmp_path / "old"
    shutil.copytree(plain_state, old, ignore=shutil.ignore_patterns("train_state"))
    (old / "train_state").mkdir()
    save_file(masters, str(old / "train_state" / "master.safetensors"), metadata={"format": "pt"})
    (old / "train_state" / "state.json").write_text(json.dumps(
        {"v": 1, "engine": "torch", "zero_stage": None, "bf16": False, "world": 1, "steps": 1,
         "master": "master.safetensors", "optimizer": None}))
    export = weights(old)
    assert any(not torch.equal(export[k].float(), masters[k]) for k in export)  # bf16 ≠ fp32
    model = build_model(str(old), Dist())
    got = {n.removeprefix("lm."): p.detach() for n, p in model.module.named_parameters()}
    assert got.keys() == masters.keys()
    assert all(torch.equal(got[k], masters[k]) for k in masters)
    assert all(torch.equal(read_masters(old)[k], masters[k]) for k in masters)


@pytest.mark.parametrize("damage, match", [
    ("missing", r"master-rank-00000-of-00001\.safetensors: missing \(written by rank 0 of 1\)"),
    ("truncated", r"master-rank-00000-of-00001\.safetensors: (truncated|not a valid)"),
    ("index", r"train_state/shards\.json: not a readable shard index"),
])
def test_a_missing_or_damaged_rank_file_is_one_line(tmp_path, plain_state, adv, damage, match):
    from marscli.stages.update import run_update

    ckpt = tmp_path / "ckpt"
    shutil.copytree(plain_state, ckpt)
    f = ckpt / "train_state" / "master-rank-00000-of-00001.safetensors"
    if damage == "missing":
        f.unlink()
    elif damage == "truncated":
        f.write_bytes(f.read_bytes()[:-1000])
    else:
        (ckpt / "train_state" / "shards.json").write_text('{"world": 1, ')
    with pytest.raises(BadInput, match=match) as e:
        run_update(str(adv), str(ckpt), str(tmp_path / "out"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    if damage == "missing":  # the CLI: exit 2, one line
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        r = subprocess.run([sys.executable, "-m", "marscli", "update", str(adv), "--policy",
                            str(ckpt), "--out", str(tmp_path / "out")], capture_output=True,
                           text=True, env=env, timeout=300, check=False)
        assert r.returncode == 2, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and "missing" in r.stderr
        assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ N → M ranks


@pytest.fixture(scope="module")
def two_rank_state(tmp_path_factory, tiny_model, adv) -> Path:
    """`update` on 2 ranks, ZeRO-3 + bf16, lr 1e-6, --keep-optimizer, a bf16 export."""
    d = tmp_path_factory.mktemp("z3")
    out = d / "ckpt"
    torchrun("update", adv, tiny_model, out, "--deepspeed", str(bf16_config(d, 3)), "--lr",
             "1e-6", "--keep-optimizer", "--save-dtype", "bfloat16")
    return out


def worker(result: Path, *jobs: Path, ranks: int) -> list[dict]:
    """tests/masters_worker.py over (CKPT, DS_CONFIG, OUT) jobs, on 1 process or 2 ranks."""
    from marscli.train.distributed import free_port

    port = str(free_port())
    launch = ([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(ranks),
               "--master_port", port] if ranks > 1 else [sys.executable])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*launch, str(WORKER), str(result), *map(str, jobs)], capture_output=True,
                       text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    return orjson.loads(result.read_bytes())["jobs"]


@pytest.mark.distributed
def test_state_of_2_ranks_loads_on_1_and_2_and_of_1_on_2(tmp_path, two_rank_state, tiny_model):
    """2 → 1 (ZeRO-3 → ZeRO-2), 2 → 2 (ZeRO-3) and 1 → 2 (ZeRO-2): every fp32 master and both
    moments of every parameter, as DeepSpeed gathers them after the load, equal the saved ones
    (max |difference| 0.0), the step is the saved one, and the state saved again from each
    engine is the same, bit for bit."""
    import torch

    from marscli.train.trainstate import read_masters, read_moments, read_state

    src = two_rank_state
    st = read_state(src)
    assert (st["world"], st["zero_stage"], st["adam_step"]) == (2, 3, 1)
    index = json.loads((src / "train_state" / "shards.json").read_text())
    assert index["world"] == 2 and index["kinds"] == ["master", "moments"]
    assert all(len(e["pieces"]) == 2 for e in index["params"].values())  # ZeRO-3 splits each
    masters, moments = read_masters(src), read_moments(src)
    base = weights(tiny_model)
    moved = sum(int((masters[k] != base[k]).sum()) for k in base)
    assert moved / sum(v.numel() for v in base.values()) > 0.5  # lr 1e-6 kept in fp32
    # every parameter with a gradient (deepstack merger 1 gets none here) has its moments
    assert sum(bool(moments[f"exp_avg_sq/{k}"].gt(0).any()) for k in base) > 0.9 * len(base)

    z2, z3 = bf16_config(tmp_path, 2), bf16_config(tmp_path, 3)
    one, two, one_two = tmp_path / "2to1", tmp_path / "2to2", tmp_path / "1to2"
    jobs = worker(tmp_path / "r1.json", src, z2, one, ranks=1)
    jobs += worker(tmp_path / "r2.json", src, z3, two, one, z2, one_two, ranks=2)
    assert [j["world"] for j in jobs] == [1, 2, 2]
    for j in jobs:
        assert j == {**j, "master_diff": 0.0, "moment_diff": 0.0, "params": len(base),
                     "step": [1]}
    # ZeRO-3 builds the model partitioned (zero.Init): no parameter above the persistence
    # threshold reaches deepspeed.initialize whole; ZeRO-2 gets the module whole
    assert jobs[1]["built"]["whole"] == 0 and jobs[1]["built"]["partitioned"] > len(base) // 2
    assert jobs[0]["built"]["partitioned"] == 0 and jobs[2]["built"]["partitioned"] == 0
    for out, world in ((one, 1), (two, 2), (one_two, 2)):
        assert json.loads((out / "train_state" / "shards.json").read_text())["world"] == world
        again, m_again = read_masters(out), read_moments(out)
        assert again.keys() == masters.keys() and m_again.keys() == moments.keys()
        assert all(torch.equal(again[k], masters[k]) for k in masters), out
        assert all(torch.equal(m_again[k], moments[k]) for k in moments), out


def test_what_cannot_be_loaded_is_refused_naming_both(tmp_path):
    """Plain torch ↔ DeepSpeed, and DeepSpeed's own checkpoint (an earlier marscli) on another
    world size: refused before anything loads; the rank-file state on another world size and
    ZeRO stage is not."""
    from marscli.train.trainstate import check_resumable

    def state(**st) -> str:
        ckpt = tmp_path / str(len(list(tmp_path.iterdir())))
        (ckpt / "train_state").mkdir(parents=True)
        (ckpt / "train_state" / "state.json").write_text(json.dumps(
            {"v": 2, "engine": "deepspeed", "zero_stage": 3, "bf16": True, "world": 2,
             "steps": 1, **st}))
        return str(ckpt)

    z2 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}
    check_resumable(state(optimizer="shards.json"), z2, 1)  # 2 ranks ZeRO-3 → 1 rank ZeRO-2
    with pytest.raises(BadInput, match=r"optimiser state saved by DeepSpeed ZeRO-3 bf16, this "
                                       r"run uses plain torch — "):
        check_resumable(state(optimizer="shards.json"), None, 1)
    with pytest.raises(BadInput, match=r"saved by plain torch, this run uses DeepSpeed ZeRO-2"):
        check_resumable(state(engine="torch", optimizer="optimizer/optimizer.pt"), z2, 1)
    with pytest.raises(BadInput, match=r"DeepSpeed's own optimiser checkpoint .* saved by "
                                       r"DeepSpeed ZeRO-3 bf16 on 2 rank\(s\), this run is "
                                       r"DeepSpeed ZeRO-3 bf16 on 1 rank\(s\)"):
        z3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
        check_resumable(state(optimizer="optimizer/state"), z3, 1)
