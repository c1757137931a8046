"""`marscli update` end to end on the tiny model: the right log-probs move the right way, every
trained parameter changes, the input checkpoint stays byte-identical, the output loads with
transformers, bad inputs exit 2 without output (bad options before torch loads), runs are
reproducible, 2-process ZeRO-2 / ZeRO-3 runs under torchrun match a 1-process run, and the
training state survives between updates: fp32 masters under ZeRO-3 + bf16, and AdamW's state
(two updates of one minibatch each equal one over both, plain torch and ZeRO-3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from marscli.errors import BadInput

from helpers import (
    LINEAR_ADAM,
    ZERO_TOL,
    bf16_config,
    delta_agreement,
    max_diff,
    torchrun,
    trajectory,
    tree_hash,
    varied_rows,
    weights,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parents[2]
# Linear AdamW (eps ≫ |g|, no clipping): the update is lr·g/eps, so any error in the scale of the
# gradient (accumulation weights, the world-size factor) shows in the weights. Plain AdamW's first
# step is sign(g)·lr whatever the scale, and would hide it.


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "marscli", "update", *args], check=False,
                          capture_output=True, text=True, env=e, timeout=600)


@pytest.fixture(scope="module")
def proc(tiny_model):
    from marscli.qwen.policy import load_processor

    return load_processor(str(tiny_model))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, proc) -> Path:
    """Two answers to the same picture: one rewarded (+1), one punished (−1)."""
    d = tmp_path_factory.mktemp("pair")
    rows = [trajectory(d, proc, 0, answer="red square", advantage=1.0),
            trajectory(d, proc, 0, answer="blue circle", advantage=-1.0)]
    rows[1]["id"] = "t0b"
    return write_jsonl(d / "adv.jsonl", rows)


@pytest.fixture(scope="module")
def varied(tmp_path_factory, proc) -> Path:
    """Six trajectories of different lengths (one text-only, two with a crop) in 2 minibatches."""
    d = tmp_path_factory.mktemp("varied")
    return write_jsonl(d / "adv.jsonl", varied_rows(d, proc, minibatches=2))


def seq_logps(model_dir: Path, adv: Path) -> list[float]:
    """Sum of log-probs over each row's model tokens under the checkpoint."""
    from marscli.qwen.policy import load_processor
    from marscli.records.jsonl import read_rows
    from marscli.train.batch import Spec, collate, load_example
    from marscli.train.distributed import Dist
    from marscli.train.trainer import build_model

    proc = load_processor(str(model_dir))
    spec = Spec.of(proc, str(model_dir))
    model = build_model(str(model_dir), Dist())
    exs = [load_example(r, str(adv), n, adv.parent, spec) for n, r in read_rows(str(adv))]
    return model.logp(collate(exs, spec)).sum(-1).tolist()


@pytest.fixture(scope="module")
def updated(tmp_path_factory, tiny_model, pair):
    from marscli.stages.update import run_update

    before = tree_hash(tiny_model)
    out = tmp_path_factory.mktemp("upd") / "ckpt1"
    stats = run_update(str(pair), str(tiny_model), str(out), lr=1e-3, seed=0)
    return out, before, stats


# ----------------------------------------------------------------------------- one update


def test_update_moves_logprobs_by_the_sign_of_the_advantage(updated, tiny_model, pair):
    out, _, _ = updated
    old = seq_logps(tiny_model, pair)
    new = seq_logps(out, pair)
    assert new[0] > old[0] + 1e-3, (old, new)  # advantage +1: more likely
    assert new[1] < old[1] - 1e-3, (old, new)  # advantage −1: less likely


def test_every_parameter_changed_and_input_untouched(updated, tiny_model):
    out, before, _ = updated
    assert tree_hash(tiny_model) == before  # byte-identical input checkpoint
    old, new = weights(tiny_model), weights(out)
    assert old.keys() == new.keys()
    # The tiny model injects deepstack features of vision layer i after LM layer i; the last
    # one's output only reaches the hidden states of image positions after the last LM layer,
    # which no loss reads: that merger gets no gradient (in Qwen3-VL-8B, layers 0-2 of 36 do).
    cfg = orjson.loads((tiny_model / "config.json").read_bytes())
    n_layers = cfg["text_config"]["num_hidden_layers"]
    dead = tuple(f"model.visual.deepstack_merger_list.{i}."
                 for i in range(n_layers - 1,
                                len(cfg["vision_config"]["deepstack_visual_indexes"])))
    unchanged = [k for k in old if (old[k] - new[k]).abs().max().item() == 0]
    assert [k for k in unchanged if not k.startswith(dead)] == []
    assert any(k.startswith("model.visual.") for k in old)  # the vision tower trained too


def test_output_loads_with_transformers(updated, tiny_model):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out, _, stats = updated
    model = AutoModelForImageTextToText.from_pretrained(out)
    proc = AutoProcessor.from_pretrained(out)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert proc.tokenizer("red square")["input_ids"]
    assert (out / "chat_template.jinja").is_file() or "chat_template" in (
        out / "tokenizer_config.json").read_text()
    assert not list(out.parent.glob("ckpt1.tmp-*"))
    lines = [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert len(lines) == 1
    m = lines[0]
    for k in ("step", "loss", "pg_loss", "kl", "clip_frac", "approx_kl", "ratio_mean",
              "ratio_min", "ratio_max", "grad_norm", "lr", "tokens_per_s", "seconds",
              "logprob_mismatch", "rollout_kl", "rollout_is_mean", "rollout_is_max",
              "rollout_masked_frac", "rollout_is_seq_mean", "rollout_truncated_frac"):
        assert k in m, k
    assert m["step"] == 1 and m["lr"] == 1e-3 and m["sequences"] == 2
    assert abs(m["ratio_mean"] - 1) < 1e-5  # old log-probs recomputed with the same policy
    # hand-made rows carry no engine log-probs (null): nothing to compare, every weight 1
    assert m["logprob_mismatch"] is None and m["rollout_kl"] is None
    assert m["rollout_masked_frac"] == 0.0 and m["rollout_truncated_frac"] == 0.0
    assert m["gpu_peak_allocated"] is None and m["gpu_peak_reserved"] is None  # CPU
    meta = orjson.loads((out / "marscli.meta.json").read_bytes())
    assert meta["stage"] == "update" and meta["seed"] == 0 and meta["stats"]["steps"] == 1
    assert stats["trajectories"] == 2


def test_freeze_vision_leaves_the_vision_tower(tmp_path, tiny_model, pair):
    from marscli.stages.update import run_update

    out = tmp_path / "frozen"
    metrics = tmp_path / "logs" / "frozen.jsonl"
    run_update(str(pair), str(tiny_model), str(out), lr=1e-3, freeze_vision=True,
               metrics=str(metrics))
    assert len(metrics.read_bytes().splitlines()) == 1 and not (out / "metrics.jsonl").exists()
    assert sorted(p.name for p in metrics.parent.iterdir()) == ["frozen.jsonl"]
    old, new = weights(tiny_model), weights(out)
    for k in old:
        if "deepstack_merger_list" not in k:  # see test_every_parameter_changed...
            same = bool((old[k] == new[k]).all())
            assert same == k.startswith("model.visual."), k
        else:
            assert bool((old[k] == new[k]).all()), k


def test_interrupted_update_leaves_no_output(tmp_path, tiny_model, pair, monkeypatch):
    import marscli.train.trainer
    from marscli.stages.update import run_update

    before = tree_hash(tiny_model)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(marscli.train.trainer, "train_minibatch", boom)
    out = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        run_update(str(pair), str(tiny_model), str(out), lr=1e-3)
    assert list(tmp_path.iterdir()) == []  # neither OUT nor OUT.tmp-*
    assert tree_hash(tiny_model) == before


# ----------------------------------------------------------------------------- bad input


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_bad_rows_exit_2_without_output(tmp_path, tiny_model, pair):
    rows = [orjson.loads(x) for x in pair.read_bytes().splitlines()]
    for r in rows:
        for im in r["images"]:
            im["path"] = str(pair.parent / im["path"])
    no_adv = [rows[0], {k: v for k, v in rows[1].items() if k != "advantage"}]
    f = write_jsonl(tmp_path / "noadv.jsonl", no_adv)
    r = cli(str(f), "--policy", str(tiny_model), "--out", str(tmp_path / "o1"))
    assert r.returncode == 2, r.stderr
    assert f"{f}:2: advantage" in r.stderr
    assert not (tmp_path / "o1").exists() and not list(tmp_path.glob("o1.tmp-*"))

    big = orjson.loads(orjson.dumps(rows[0]))
    big["segments"][-1]["tokens"][0] = 10 ** 6
    f = write_jsonl(tmp_path / "vocab.jsonl", [rows[1], big])
    r = cli(str(f), "--policy", str(tiny_model), "--out", str(tmp_path / "o2"))
    assert r.returncode == 2, r.stderr
    assert f"{f}:2: segments: token ids exceed the policy's vocabulary" in r.stderr
    assert not (tmp_path / "o2").exists()

    r = cli(str(pair), "--policy", str(tiny_model), "--out", str(tmp_path / "o3"), "--lr", "-1e-6")
    assert r.returncode == 2, r.stderr
    assert "--lr" in r.stderr and not (tmp_path / "o3").exists()


_REFUSE_WITHOUT_TORCH = r"""
import sys
from marscli.cli import main
codes = []
for stage in ("update", "sft"):
    sys.argv = ["marscli", stage, "adv.jsonl", "--policy", "nowhere", "--out", "o", "--lr", "-1"]
    try:
        main()
    except SystemExit as e:
        codes.append(e.code)
print(codes, "torch" in sys.modules, "transformers" in sys.modules)
"""


def test_bad_options_are_refused_before_torch_loads(tmp_path):
    """Option validation is torch-free: `update --lr -1` (and sft's) exit 2 at once."""
    r = subprocess.run([sys.executable, "-c", _REFUSE_WITHOUT_TORCH], check=False,
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.stdout.split("\n")[0] == "[2, 2] False False", (r.stdout, r.stderr)
    assert r.stderr.count("error: --lr: -1.0 is out of range — must be >= 0") == 2, r.stderr


@pytest.mark.parametrize("opts,match", [
    ({"micro_batch_tokens": 0}, "--micro-batch-tokens"),
    ({"logp_chunk": -3}, "--logp-chunk: -3 is out of range — must be >= 1"),
    ({"micro_batch_tokens": 50, "logp_chunk": 64}, r"--logp-chunk: 64 .* <= 50"),
    ({"clip_low": 1.5}, "--clip-low"),
    ({"epochs": 0}, "--epochs"),
    ({"kl": 0.1}, "--kl: .* --ref"),
    ({"loss": "ppo2"}, "unknown loss 'ppo2' — choose one of: grpo, gspo"),
    ({"agg": "sum"}, "--agg"),
    ({"lr_schedule": "step"}, "--lr-schedule"),
    ({"metrics": "OUT/m.jsonl"}, "--metrics: .* inside --out"),
    ({"old_logp": "vllm"}, "--old-logp: unknown source 'vllm' — choose one of: recompute"),
    ({"rollout_is": "tis"}, "unknown --rollout-is mode 'tis' — choose one of: off, "),
    ({"rollout_is_cap": 0.0}, "--rollout-is-cap"),
    ({"rollout_is_floor": 3.0}, r"--rollout-is-floor: 3\.0 .* <= 2\.0"),
    ({"old_logp": "engine", "rollout_is": "token-truncate"}, "with --old-logp engine"),
    ({"old_logp": "engine"}, r"adv.jsonl:1: segments\[1\]\.logprobs: no engine log-probs"),
])
def test_bad_options_name_the_option(tmp_path, tiny_model, pair, opts, match):
    from marscli.stages.update import run_update

    if "metrics" in opts:
        opts = {**opts, "metrics": str(tmp_path / "o" / "m.jsonl")}
    with pytest.raises(BadInput, match=match):
        run_update(str(pair), str(tiny_model), str(tmp_path / "o"), **opts)
    assert not (tmp_path / "o").exists()


OPT = Path("train_state/optimizer/optimizer.pt")


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_keep_optimizer_carries_adam_moments_into_the_next_update(tmp_path, tiny_model, pair):
    """With the advantages flipped, a fresh AdamW's first step is sign descent (every moved
    weight moves by about lr); the carried moments nearly cancel it (first moment
    (0.09 g - 0.1 g) / 0.19, second ~g²: a twentieth of lr)."""
    import torch

    from marscli.stages.update import run_update

    lr = 1e-5  # small: the flipped gradient at the moved weights stays close to -g
    rows = [orjson.loads(x) for x in pair.read_bytes().splitlines()]
    flipped = write_jsonl(pair.with_name("adv-flipped.jsonl"),  # beside its images
                         [{**r, "advantage": -r["advantage"]} for r in rows])
    a = tmp_path / "a"
    assert run_update(str(pair), str(tiny_model), str(a), lr=lr, keep_optimizer=True,
                      seed=0)["optimizer"] == "fresh"
    assert {int(s["step"]) for s in torch.load(a / OPT)["state"].values()} == {1}
    fresh, kept = tmp_path / "fresh", tmp_path / "kept"
    run_update(str(flipped), str(a), str(fresh), lr=lr, seed=0)
    assert not (fresh / "train_state" / "optimizer").exists()  # not asked for: not written
    assert not (fresh / "optimizer.pt").exists()
    assert run_update(str(flipped), str(a), str(kept), lr=lr, keep_optimizer=True,
                      seed=0)["optimizer"] == "carried"
    assert {int(s["step"]) for s in torch.load(kept / OPT)["state"].values()} == {2}
    assert orjson.loads((kept / "train_state" / "state.json").read_bytes())["steps"] == 2

    def median_step(out: Path) -> float:
        wa, wo = weights(a), weights(out)
        d = torch.cat([(wo[k].float() - wa[k].float()).abs().flatten() for k in wa])
        return d[d > 0].median().item() / lr

    assert median_step(fresh) > 0.8
    assert median_step(kept) < 0.2
    (kept / OPT).write_bytes(b"not a state")  # a broken state names the file
    with pytest.raises(BadInput, match=r"optimizer.pt"):
        run_update(str(pair), str(kept), str(tmp_path / "c"), lr=lr, keep_optimizer=True)
    assert not (tmp_path / "c").exists()


def split_by_minibatch(adv: Path) -> list[Path]:
    """One file per minibatch of `adv`, beside its images."""
    rows = [orjson.loads(x) for x in adv.read_bytes().splitlines()]
    return [write_jsonl(adv.with_name(f"mb{k}.jsonl"), [r for r in rows if r["minibatch"] == k])
            for k in sorted({r["minibatch"] for r in rows})]


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_two_updates_with_kept_optimizer_equal_one_over_both_minibatches(tmp_path, tiny_model,
                                                                        varied):
    """Iteration-split invariance in plain torch: an update per minibatch, the AdamW state
    carried, moves the weights as one update over both (measured: cosine 0.999996; with a
    fresh optimiser in the second, 0.869). The old log-probs of the second minibatch come from
    the first update's weights here, from the input policy in the single run: not bitwise.
    The first update exports bf16 (the rollout copy), so the second must start from the fp32
    masters in train_state/: the bf16 rounding (~4e-5) is bigger than a step (1e-5)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from marscli.stages.update import run_update

    mb0, mb1 = split_by_minibatch(varied)
    whole, a, b = tmp_path / "whole", tmp_path / "a", tmp_path / "b"
    run_update(str(varied), str(tiny_model), str(whole), lr=1e-5)
    run_update(str(mb0), str(tiny_model), str(a), lr=1e-5, keep_optimizer=True,
               save_dtype="bfloat16")
    assert {v.dtype for v in weights(a).values()} == {torch.bfloat16}
    assert (a / "train_state" / "master-rank-00000-of-00001.safetensors").is_file()
    AutoModelForImageTextToText.from_pretrained(a)  # the engines' copy loads as it is
    stats = run_update(str(mb1), str(a), str(b), lr=1e-5, keep_optimizer=True)
    assert stats["optimizer"] == "carried" and stats["bytes_written"] > 0
    assert stats["load_seconds"] > 0 and stats["save_seconds"] > 0
    # b started from a's train_state/master.safetensors; its float32 export is its own master
    assert 0 < stats["master_load_seconds"] < stats["load_seconds"]
    assert 0 <= stats["master_save_seconds"] < stats["save_seconds"]
    cos, ratio = delta_agreement(tiny_model, whole, b)
    assert cos > 0.99 and abs(ratio - 1) < 0.05, (cos, ratio)


def test_bad_deepspeed_config_and_existing_out(tmp_path, tiny_model, pair, updated):
    from marscli.stages.update import run_update

    cases = {"missing.json": None, "bad.json": "{not json",
             "stage.json": '{"zero_optimization": {"stage": 4}}',
             "opt.json": '{"optimizer": {"type": "Adam"}}'}
    msgs = {"missing.json": "no such file", "bad.json": "not valid JSON",
            "stage.json": "zero_optimization.stage: 4 is not a ZeRO stage",
            "opt.json": "optimizer: marscli builds AdamW"}
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(BadInput, match=f"--deepspeed: .*{name}: {msgs[name]}"):
            run_update(str(pair), str(tiny_model), str(tmp_path / "o"),
                       deepspeed=str(tmp_path / name))
    out, _, _ = updated
    with pytest.raises(BadInput, match=r"--out: .*already exists .* --force"):
        run_update(str(pair), str(tiny_model), str(out))
    with pytest.raises(BadInput, match=r"--out: .*is an input checkpoint"):
        run_update(str(pair), str(tiny_model), str(tiny_model), force=True)
    rows = [orjson.loads(x) for x in pair.read_bytes().splitlines()]
    rows[0]["minibatch"] = 0
    f = write_jsonl(pair.parent / "mixed.jsonl", rows)
    with pytest.raises(BadInput, match=r"mixed.jsonl:2: minibatch: missing here"):
        run_update(str(f), str(tiny_model), str(tmp_path / "o"))


# ------------------------------------------------------------------------ reproducible, distributed


RUN_OPTS = dict(kl=0.05, micro_batch_tokens=215, seed=3, **LINEAR_ADAM)


def cli_opts(opts: dict) -> list[str]:
    out = []
    for k, v in opts.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model, varied):
    """The 1-process reference: 2 minibatches (2 steps), KL to the input policy, several
    micro-batches per step, a text-only trajectory among them."""
    from marscli.stages.update import run_update

    out = tmp_path_factory.mktemp("single") / "ckpt"
    run_update(str(varied), str(tiny_model), str(out), ref=str(tiny_model), **RUN_OPTS)
    return out


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_same_seed_same_weights(single, tmp_path, tiny_model, varied):
    from marscli.stages.update import run_update

    out = tmp_path / "again"
    run_update(str(varied), str(tiny_model), str(out), ref=str(tiny_model), **RUN_OPTS)
    a, b = weights(single), weights(out)
    assert all(bool((a[k] == b[k]).all()) for k in a)
    steps = [orjson.loads(x) for x in (single / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["minibatch"] for s in steps] == [0, 1]
    assert all(s["micro_batches"] >= 2 and s["kl"] is not None for s in steps)
    assert max_diff(a, weights(tiny_model)) > 1e-4


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_two_cpu_processes_matches_one_process(stage, single, tmp_path, tiny_model, varied):
    out = tmp_path / f"zero{stage}"
    torchrun("update", varied, tiny_model, out, "--ref", str(tiny_model), "--deepspeed",
             str(ROOT / f"recipes/ds_zero{stage}.json"), *cli_opts(RUN_OPTS))
    a, b = weights(single), weights(out)
    assert max_diff(a, weights(tiny_model)) > 1e-4
    assert max_diff(a, b) < ZERO_TOL
    steps = [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]
    ref = [orjson.loads(x) for x in (single / "metrics.jsonl").read_bytes().splitlines()]
    for s, t in zip(steps, ref):
        assert abs(s["loss"] - t["loss"]) < 1e-6 and abs(s["grad_norm"] - t["grad_norm"]) < 1e-5
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(out)


@pytest.mark.distributed
def test_zero3_bf16_keeps_fp32_masters_and_adam_across_updates(tmp_path, tiny_model, varied):
    """ZeRO-3 with bf16 compute on 2 CPU ranks, three launches.
    1. At lr 1e-6 the fp32 masters move in most entries, as plain torch's weights do (0.91 of
       them; the bf16 copy saved and reloaded before kept 0.02; an lr-0 run saves the input
       unchanged). The HF export is bf16 here (--save-dtype), the masters sit in train_state/,
       and the next update starts from them.
    2. Two updates with --keep-optimizer, one minibatch each, move the weights as one update
       over both (masters and moments in one file per rank, by parameter name).
    3. A 1-process DeepSpeed run carries that 2-rank state (re-sharded by name: tests/
       test_masters.py checks it bit for bit)."""
    import torch

    from marscli.train.trainstate import read_masters

    ds = bf16_config(tmp_path, 3)
    mb0, mb1 = split_by_minibatch(varied)
    a, b, whole = tmp_path / "a", tmp_path / "b", tmp_path / "whole"
    torchrun("update", mb0, tiny_model, a, "--deepspeed", str(ds), "--lr", "1e-6",
             "--keep-optimizer", "--save-dtype", "bfloat16")
    export, master = weights(a), read_masters(a)
    assert {v.dtype for v in export.values()} == {torch.bfloat16}
    assert {v.dtype for v in master.values()} == {torch.float32}
    base = weights(tiny_model)
    moved = sum(int((master[k] != base[k]).sum()) for k in base)
    assert moved / sum(v.numel() for v in base.values()) >= 0.5
    state = orjson.loads((a / "train_state" / "state.json").read_bytes())
    assert state == {**state, "engine": "deepspeed", "world": 2, "zero_stage": 3, "bf16": True,
                     "steps": 1, "master": "shards.json", "optimizer": "shards.json",
                     "adam_step": 1}
    r = torchrun("update", mb1, a, b, "--deepspeed", str(ds), "--lr", "1e-6", "--keep-optimizer")
    assert "carried optimiser" in r.stderr
    torchrun("update", varied, tiny_model, whole, "--deepspeed", str(ds), "--lr", "1e-6")
    cos, ratio = delta_agreement(tiny_model, whole, b)
    assert cos > 0.99 and abs(ratio - 1) < 0.05, (cos, ratio)
    r = cli(str(mb1), "--policy", str(b), "--out", str(tmp_path / "c"), "--deepspeed", str(ds),
            "--keep-optimizer")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 rank(s), ZeRO-3 on cpu, carried optimiser" in r.stderr


# ----------------------------------------------------------------------------- divergence


def test_a_diverged_update_exits_1_and_leaves_out_as_it_was(tmp_path, tiny_model, pair):
    """--lr 1e30 gives finite weights of 1e30 whose forward is nan: exit 1, one line, no
    checkpoint, and an earlier OUT under --force untouched."""
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "keep.txt").write_text("earlier")
    res = cli(str(pair), "--policy", str(tiny_model), "--out", str(prev), "--force",
              "--lr", "1e30")
    assert res.returncode == 1, res.stderr
    assert "diverged" in res.stderr and "Traceback" not in res.stderr
    assert [p.name for p in prev.iterdir()] == ["keep.txt"]
    assert not any(p.name.startswith("prev.") for p in tmp_path.iterdir())


def test_every_step_skipped_exits_1_without_a_checkpoint(tmp_path, tiny_model, pair, monkeypatch):
    from marscli.errors import RuntimeFailure
    from marscli.stages.update import run_update
    from marscli.train import trainer

    monkeypatch.setattr(trainer, "clip_grad_norm", lambda *a: float("nan"))
    with pytest.raises(RuntimeFailure, match=r"all 1 optimiser step\(s\) were skipped"):
        run_update(str(pair), str(tiny_model), str(tmp_path / "o"), lr=1e-3)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- whose state


@pytest.fixture(scope="module")
def kept(tmp_path_factory, tiny_model, pair) -> Path:
    """An update's output with AdamW's state (plain torch: optimizer.pt)."""
    from marscli.stages.update import run_update

    out = tmp_path_factory.mktemp("kept") / "ckpt1"
    run_update(str(pair), str(tiny_model), str(out), lr=1e-3, keep_optimizer=True)
    return out


def _beside(tmp_path: Path, tiny_model: Path, kept: Path, change) -> Path:
    """A copy of the tiny model, its weights changed by `change`, with `kept`'s train_state/."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    w = load_file(other / "model.safetensors")
    save_file(change(w), other / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(kept / "train_state", other / "train_state")
    return other


@pytest.mark.parametrize("change,what", [
    (lambda w: {k: v * 1.01 for k, v in w.items()}, "other weights"),  # same shapes
    (lambda w: {k: v[:1] if k.endswith("norm.weight") else v for k, v in w.items()},
     "another model")])
def test_a_train_state_of_another_model_is_refused(tmp_path, tiny_model, kept, pair, change,
                                                   what):
    other = _beside(tmp_path, tiny_model, kept, change)
    for keep in (["--keep-optimizer"], []):  # the masters are not loaded either
        res = cli(str(pair), "--policy", str(other), "--out", str(tmp_path / "o"), *keep)
        assert res.returncode == 2, res.stderr
        assert f"fingerprint: saved with {what}" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_keep_optimizer_refuses_a_missing_optimiser_file(tmp_path, kept, pair):
    import shutil

    from marscli.stages.update import run_update

    ckpt = tmp_path / "ckpt1"
    shutil.copytree(kept, ckpt)
    (ckpt / OPT).unlink()
    with pytest.raises(BadInput, match=r"optimizer\.pt: missing — .*drop --keep-optimizer"):
        run_update(str(pair), str(ckpt), str(tmp_path / "o"), lr=1e-3, keep_optimizer=True)
    assert not (tmp_path / "o").exists()


def test_moments_of_another_shape_are_refused_without_a_fingerprint(tmp_path, kept, pair):
    """A state of an earlier version (no fingerprint) whose AdamW moments have other shapes:
    one line naming optimizer.pt, not a size-mismatch traceback in the first step."""
    import shutil

    import torch

    from marscli.stages.update import run_update

    ckpt = tmp_path / "ckpt1"
    shutil.copytree(kept, ckpt)
    st = orjson.loads((ckpt / "train_state" / "state.json").read_bytes())
    del st["fingerprint"]
    (ckpt / "train_state" / "state.json").write_bytes(orjson.dumps(st))
    opt = torch.load(ckpt / OPT)
    first = opt["state"][0]
    first["exp_avg"] = first["exp_avg"].flatten()[:3]
    torch.save(opt, ckpt / OPT)
    with pytest.raises(BadInput, match=r"optimizer\.pt: AdamW's moments of shape \[3\]"):
        run_update(str(pair), str(ckpt), str(tmp_path / "o"), lr=1e-3, keep_optimizer=True)
    assert not (tmp_path / "o").exists()
