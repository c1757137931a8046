"""The HF export written as it is gathered (checkpoint.WeightShards): the same tensors and the
same config as transformers' own `save_pretrained`, in one file or split into shards with
transformers' index (read back by `from_pretrained`), in float32 and bfloat16; a tensor out of
the planned order or shape is a bug that stops the save."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from marscli.qwen.policy import load_model
from marscli.train.checkpoint import WeightShards, save_checkpoint


@pytest.fixture(scope="module")
def lm(tiny_model):
    return load_model(str(tiny_model), device="cpu", dtype="float32")


def specs(lm) -> list[tuple[str, list[int]]]:
    return [(n, list(p.shape)) for n, p in lm.named_parameters()]


def stream(lm, folder: Path, dtype: str, policy: Path, max_bytes: int | None = None) -> None:
    kw = {} if max_bytes is None else {"max_bytes": max_bytes}
    shards = WeightShards(folder, specs(lm), dtype, **kw)
    for n, p in lm.named_parameters():
        shards.put(n, p.detach())
    shards.close()
    save_checkpoint(lm, folder, str(policy), dtype)


def saved(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_file_equals_save_pretrained_in_that_dtype(lm, tiny_model, tmp_path, dtype):
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    dt = getattr(torch, dtype)
    copy.deepcopy(lm).to(dt).save_pretrained(ref)  # transformers' export of the model in dt
    stream(lm, ours, dtype, tiny_model)
    assert sorted(p.name for p in ours.glob("*.safetensors")) == ["model.safetensors"]
    a, b = saved(ref), saved(ours)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
                                        for k in a)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((ref / name).read_text()) == json.loads((ours / name).read_text())


def test_split_export_has_transformers_index_and_loads(lm, tiny_model, tmp_path):
    out = tmp_path / "ckpt"
    total = sum(4 * p.numel() for p in lm.parameters())
    stream(lm, out, "float32", tiny_model, max_bytes=total // 3)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == {n for n, _ in lm.named_parameters()}
    back = load_model(str(out), device="cpu", dtype="float32")
    mine = dict(lm.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in back.named_parameters())


def test_a_tensor_out_of_plan_stops_the_save(lm, tmp_path):
    names = specs(lm)
    shards = WeightShards(tmp_path / "x", names, "float32")
    with pytest.raises(RuntimeError, match=f"expected {names[0][0]}"):
        shards.put(names[1][0], torch.zeros(names[1][1]))
    shards.put(names[0][0], torch.zeros(names[0][1]))
    with pytest.raises(RuntimeError, match="planned"):
        shards.put(names[1][0], torch.zeros(3))
    with pytest.raises(RuntimeError, match="never came"):
        shards.close()
