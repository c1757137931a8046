"""Batch assembly and the training step's arithmetic (train.batch, train.trainer): micro-batch
planning, token-exact assembly of a hand-written trajectory, padding invariance of log-probs,
and gradient accumulation over micro-batches equal to one big batch for both aggregations."""

from __future__ import annotations

import os
import random

import orjson
import pytest
import torch

from marscli.errors import BadInput
from marscli.train.batch import Example, Spec, collate, load_example, micro_batches, plan, shard

from helpers import ROOT, picture, varied_rows

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def proc(tiny_model):
    from marscli.qwen.policy import load_processor

    return load_processor(str(tiny_model))


@pytest.fixture(scope="module")
def spec(proc, tiny_model):
    return Spec.of(proc, str(tiny_model))


@pytest.fixture(scope="module")
def examples(tmp_path_factory, proc, spec) -> list[Example]:
    folder = tmp_path_factory.mktemp("batch")
    out = []
    for n, row in enumerate(varied_rows(folder, proc)):
        e = load_example(row, "adv.jsonl", n + 1, folder, spec)
        e.advantage, e.index = row["advantage"], n
        out.append(e)
    return out


# ----------------------------------------------------------------------------- planning


@pytest.mark.parametrize("seed", range(5))
def test_micro_batches_keep_every_sequence_once_under_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    budget = 600
    mbs = micro_batches(lengths, budget)
    flat = sorted(i for mb in mbs for i in mb)
    assert flat == list(range(len(lengths)))
    for mb in mbs:
        assert max(lengths[i] for i in mb) * len(mb) <= budget
    # bucketing: sequences sorted by length, so each micro-batch is a contiguous length range
    order = [i for mb in mbs for i in mb]
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)


def test_micro_batches_padding_is_small_for_sorted_buckets():
    lengths = [10, 200, 11, 190, 12, 180, 13, 170]
    mbs = micro_batches(lengths, 400)
    padded = sum(max(lengths[i] for i in mb) * len(mb) for mb in mbs)
    assert padded - sum(lengths) <= 40  # long with long, short with short
    assert micro_batches([500], 100) == [[0]]  # an over-long one sits alone (refused upstream)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_and_plan_cover_each_sequence_once(world):
    rng = random.Random(world)
    lengths = [rng.randint(5, 100) for _ in range(17)]
    parts = [shard(lengths, r, world) for r in range(world)]
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # balanced by tokens
    exs = [Example("f", i, [7] * n, [0] + [1] * (n - 1)) for i, n in enumerate(lengths)]
    plans = [plan(exs, r, world, 150) for r in range(world)]
    n = max(len(p) for p in plans)
    padded = [plan(exs, r, world, 150, n_micro=n) for r in range(world)]
    assert all(len(p) == n for p in padded)
    real = [e.line for p in padded for m in p if m.weight for e in m.examples]
    assert sorted(real) == list(range(len(lengths)))
    assert all(m.weight == 0 for p in padded for m in p[len(plans[padded.index(p)]):])


# ----------------------------------------------------------------------------- assembly


def test_hand_made_trajectory_assembles_token_exactly(tmp_path, proc, spec):
    from marscli.qwen.tokens import special_ids
    from marscli.train.batch import placeholder_count

    ids = special_ids(proc.tokenizer)
    a = picture(tmp_path / "a.png", (64, 64), 1)
    b = picture(tmp_path / "b.png", (64, 96), 2)
    na, nb = placeholder_count(proc, a), placeholder_count(proc, b)
    assert na > 0 and nb > 0 and na != nb
    row = {"v": 1, "images": [{"path": "b.png"}, {"path": "a.png"}], "segments": [
        {"role": "prompt", "tokens": [ids.im_start, 100, 101, ids.vision_start, -na,
                                      ids.vision_end, 102, ids.im_end], "images": [1]},
        {"role": "model", "tokens": [200, 201, ids.im_end], "logprobs": [-0.5, -0.25, -0.125]},
        {"role": "tool", "tokens": [ids.im_start, 103, ids.vision_start, -nb, ids.vision_end,
                                    ids.im_end], "images": [0]},
        {"role": "model", "tokens": [202, ids.im_end], "logprobs": [-1.0, -2.0]}]}
    e = load_example(row, "adv.jsonl", 3, tmp_path, spec)
    want_ids = ([ids.im_start, 100, 101, ids.vision_start] + [ids.image_pad] * na
                + [ids.vision_end, 102, ids.im_end, 200, 201, ids.im_end, ids.im_start, 103,
                   ids.vision_start] + [ids.image_pad] * nb + [ids.vision_end, ids.im_end, 202,
                                                               ids.im_end])
    want_mask = [0] * (na + 7) + [1, 1, 1] + [0] * (nb + 5) + [1, 1]
    assert e.input_ids == want_ids
    assert e.loss_mask == want_mask
    assert e.images == [tmp_path / "a.png", tmp_path / "b.png"]  # in placeholder order
    lps = [x for x in e.engine_logprobs if x is not None]
    assert lps == [-0.5, -0.25, -0.125, -1.0, -2.0]
    b_ = collate([e], spec)
    assert b_.tensors["input_ids"][0].tolist() == want_ids
    assert b_.loss_mask[0].tolist() == want_mask
    assert b_.tensors["mm_token_type_ids"][0].tolist() == [
        int(t == ids.image_pad) for t in want_ids]
    assert b_.tensors["image_grid_thw"].shape == (2, 3)

    bad = orjson.loads(orjson.dumps(row))
    bad["segments"][1]["tokens"][0] = spec.vocab_size
    with pytest.raises(BadInput, match=r"adv.jsonl:3: segments: token ids exceed the policy"):
        load_example(bad, "adv.jsonl", 3, tmp_path, spec)
    bad = orjson.loads(orjson.dumps(row))
    bad["segments"][0]["tokens"][4] = -(na + 1)
    with pytest.raises(BadInput, match=r"adv.jsonl:3: images: .* placeholder tokens"):
        load_example(bad, "adv.jsonl", 3, tmp_path, spec)
    bad = orjson.loads(orjson.dumps(row))
    bad["images"][1]["path"] = "missing.png"
    with pytest.raises(BadInput, match=r"adv.jsonl:3: images\[1\].path: .*not found"):
        load_example(bad, "adv.jsonl", 3, tmp_path, spec)


# ----------------------------------------------------------------------------- numerics


@pytest.fixture(scope="module")
def policy(tiny_model):
    from marscli.train.distributed import Dist, seed_everything
    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import build_model

    seed_everything(0)
    return build_model(str(tiny_model), Dist(), optim=OptimConfig(lr=1e-3))


def test_logprobs_match_full_forward_and_ignore_padding(policy, examples, spec):
    import torch

    short = min(examples, key=len)
    long_ = max(examples, key=len)
    assert len(long_) > len(short) + 20
    alone = policy.logp(collate([short], spec))[0]  # [T]
    padded = policy.logp(collate([long_, short], spec))[1, :len(short)]
    m = torch.tensor(short.loss_mask, dtype=torch.bool)
    assert m.sum() > 3
    assert (alone[m] - padded[m]).abs().max() < 1e-5
    assert (padded[len(short):] == 0).all() and (alone[~m] == 0).all()
    # against the model's own full-vocabulary logits
    b = collate([short], spec)
    lm = policy.lm
    lm.model.rope_deltas = None
    with torch.no_grad():
        logits = lm(**b.tensors).logits[0, :-1].float()  # [T-1, V]
    ref = torch.log_softmax(logits, -1).gather(-1, b.tensors["input_ids"][0, 1:, None])[:, 0]
    assert (alone[1:][m[1:]] - ref[m[1:]]).abs().max() < 1e-5


@pytest.fixture(scope="module")
def with_old(policy, examples, spec) -> dict:
    """Old log-probs [T] by example index, a little off the current ones, so that ratios
    differ from 1."""
    import torch

    gen = torch.Generator().manual_seed(1)
    lp = policy.logp(collate(examples, spec))  # [B, T]
    old = {}
    for b, e in enumerate(examples):
        noise = 0.05 * torch.randn(len(e), generator=gen) * torch.tensor(e.loss_mask)
        old[e.index] = lp[b, :len(e)] + noise
    return {"old_logp": old}


@pytest.mark.parametrize("loss_name,agg", [("gspo", "seq-mean-token-mean"), ("gspo", "token-mean"),
                                           ("grpo", "token-mean")])
def test_accumulation_over_micro_batches_equals_one_big_batch(policy, examples, with_old, spec,
                                                               loss_name, agg):
    import torch

    from marscli.rl.losses import LOSSES, micro_weight

    loss_fn = LOSSES.get(loss_name)
    params = [p for p in policy.module.parameters() if p.requires_grad]
    n_tok = sum(e.n_model_tokens for e in examples)

    def grads(micros: list[list[Example]], weighted: bool) -> list[torch.Tensor]:
        """Gradients accumulated over `micros`, each loss scaled by its micro_weight."""
        for p in params:
            p.grad = None
        for mb in micros:
            b = collate(mb, spec, logps=with_old)
            logp = policy.logp(b, grad=True)
            loss, _ = loss_fn(logp, b.extra["old_logp"], b.extra["advantages"], b.loss_mask,
                              0.2, 0.28, agg=agg)
            w = micro_weight(b.loss_mask, agg, n_tok, len(examples)) if weighted else 1.0
            policy.backward(loss * w)
        out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        for p in params:
            p.grad = None
        return out

    full = grads([examples], weighted=False)
    micros = [m.examples for m in plan(examples, 0, 1, max(len(e) for e in examples) + 60)]
    assert 2 < len(micros) < len(examples)
    acc = grads(micros, weighted=True)
    scale = max(g.abs().max().item() for g in full)
    assert scale > 1e-4
    assert max((a - f).abs().max().item() for a, f in zip(acc, full)) < 1e-5 * max(1.0, scale)
    # the test can fail: accumulating unweighted micro-batch losses is not the minibatch loss
    naive = grads(micros, weighted=False)
    assert max((a / len(micros) - f).abs().max().item() for a, f in zip(naive, full)) > 1e-3 * scale


def test_blank_image_row_keeps_text_only_logprobs(policy, examples, spec):
    """Under ZeRO a text-only micro-batch gets a 1-token blank image row (every rank must run
    the vision tower); the sequences' log-probs must not change."""
    text_only = [e for e in examples if not e.images]
    assert text_only
    b_text = collate(text_only, spec)
    assert "pixel_values" not in b_text.tensors
    plain = policy.logp(b_text)
    policy.module.touch_visual = True
    try:
        touched = policy.logp(b_text)
    finally:
        policy.module.touch_visual = False
    assert touched.shape == plain.shape
    assert (touched - plain).abs().max() < 1e-6 and plain.abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients(policy, examples, spec, tiny_model):
    import torch

    from marscli.train.distributed import Dist
    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import build_model

    ckpt = build_model(str(tiny_model), Dist(), optim=OptimConfig(), gradient_checkpointing=True)
    b = collate(examples[:3], spec)
    out = []
    for m in (policy, ckpt):
        m.train(True)
        loss = -(m.logp(b, grad=True) * b.loss_mask).sum() / b.loss_mask.sum()
        m.backward(loss)
        out.append({n: p.grad.clone() for n, p in m.module.named_parameters()
                    if p.grad is not None})
        m.optimizer.zero_grad(set_to_none=True)
    assert ckpt.lm.is_gradient_checkpointing
    assert out[0].keys() == out[1].keys() and len(out[0]) > 50
    assert max((out[0][k] - out[1][k]).abs().max().item() for k in out[0]) < 1e-5
    assert torch.isfinite(loss)


def test_job_step_is_train_minibatch_with_its_metrics_reduced(tiny_model, examples, spec):
    """Job.step (the step update and sft share) trains exactly as train_minibatch over the
    planned micro-batches; the closure's metrics come back summed, least or greatest as named,
    the stage's own numbers alongside; a name given twice is refused before the step."""
    import torch

    from marscli.train.config import TrainOptions
    from marscli.train.distributed import seed_everything
    from marscli.train.job import Job, Reduce
    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import build_model, train_minibatch

    job = Job("test", "unused", TrainOptions(), None, [], 0.0)  # one process: no __enter__
    mb = job.minibatch(examples, max(len(e) for e in examples) + 60)
    assert len(mb.micros) > 2 and all(m.weight for m in mb.micros)
    assert (mb.n_seqs, mb.n_tokens) == (len(examples), sum(e.n_model_tokens for e in examples))

    def lf(logp, b):
        loss = -(logp * b.loss_mask).sum() / mb.n_tokens * b.weight
        return loss, {"loss": loss.item(), "lo": float(len(b.examples)),
                      "hi": float(len(b.examples))}

    def model():
        seed_everything(0)
        return build_model(str(tiny_model), job.dist, optim=OptimConfig(lr=1e-3))

    a, b = model(), model()
    s = job.step(a, mb, lf, 1e-3, spec, sums=("loss",), mins=("lo",), maxs=("hi",),
                 extra=Reduce(sum={"n": 2.0}, max={"w": -1.0}))
    batches = (collate(m.examples, spec, m.weight) for m in mb.micros)
    ms, norm, tokens = train_minibatch(b, batches, len(mb.micros), lf, 1e-3)
    assert s.grad_norm == norm > 0
    assert all(torch.equal(x, y) for x, y in zip(a.module.parameters(), b.module.parameters()))
    sizes = [len(m.examples) for m in mb.micros]
    assert s.metrics == {"loss": sum(m["loss"] for m in ms), "lo": min(sizes), "hi": max(sizes)}
    assert s.extra == Reduce(sum={"n": 2.0}, max={"w": -1.0})
    row = s.counts()
    assert list(row) == ["sequences", "model_tokens", "tokens", "micro_batches", "seconds",
                         "tokens_per_s", "gpu_peak_allocated", "gpu_peak_reserved"]
    assert row["gpu_peak_allocated"] is None and row["gpu_peak_reserved"] is None  # CPU
    assert (row["tokens"], row["micro_batches"]) == (tokens, len(mb.micros))
    with pytest.raises(ValueError, match="taken twice"):
        job.step(a, mb, lf, 1e-3, spec, sums=("loss",), extra=Reduce(min={"loss": 0.0}))


def test_srun_environment_maps_to_torch_distributed():
    from marscli.train.distributed import slurm_env

    step = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7"}
    assert slurm_env(step) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                               "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
    assert slurm_env({**step, "RANK": "0"}) == {}  # srun torchrun ...: torchrun's own
    assert slurm_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) == {}  # the batch script


def test_feature_cache_reuses_pixels_until_the_file_changes_and_stays_under_budget(tmp_path,
                                                                                   proc):
    from marscli.train.batch import FeatureCache

    a, b = picture(tmp_path / "a.png", (64, 64), 1), picture(tmp_path / "b.png", (64, 64), 2)
    cache = FeatureCache(max_bytes=1 << 30)
    first = cache.get(proc, a)
    assert cache.get(proc, a) is first and (cache.hits, cache.misses) == (1, 1)
    picture(a, (64, 64), 3)  # rewritten: new pixels, new mtime
    os.utime(a, ns=(1, 1))
    again = cache.get(proc, a)
    assert again is not first and not torch.equal(again.pixel_values, first.pixel_values)
    one = again.pixel_values.numel() * again.pixel_values.element_size()
    small = FeatureCache(max_bytes=one)  # room for one image: b evicts a
    small.get(proc, a), small.get(proc, b), small.get(proc, a)
    assert (small.hits, small.misses) == (0, 3) and small.bytes <= one


@pytest.mark.parametrize("size", [(1024, 512), (512, 1024), (1024, 1024), (700, 300)])
def test_image_tokens_agree_when_min_pixels_equals_max_pixels(tmp_path, size):
    """The demo's processor (recipes/tiny-vlm: min = max = 128x128 pixels). A 1024x512 crop
    (a zoom on half the scene) scaled to the budget is 64x160, under min_pixels, which the
    processor would scale up again to 96x224: the rollout's placeholders (21) then disagreed
    with the update's count from the file's header (10), and the update refused the row."""
    from PIL import Image

    from marscli.qwen.policy import load_processor
    from marscli.qwen.tokens import image_features
    from marscli.train.batch import placeholder_count

    proc = load_processor(str(ROOT / "recipes" / "tiny-vlm"))
    path = tmp_path / "crop.png"
    Image.new("RGB", size, (200, 30, 30)).save(path)
    with Image.open(path) as im:
        direct = proc.image_processor(images=[im.convert("RGB")], return_tensors="pt")
        n = image_features(proc, im.convert("RGB")).n_tokens
    want = int(direct["image_grid_thw"][0].prod()) // 4
    assert n == placeholder_count(proc, path) == want
    if size == (1024, 512):
        assert want == 10


def test_job_releases_the_models_it_built_before_closing_the_process_group(monkeypatch):
    """Every model `Job.build` made is released (DeepSpeed's hooks and buffers freed) before
    the process group is destroyed, also when the stage's body raises: left to interpreter exit,
    a ZeRO-3 rank sometimes aborted after the group was gone."""
    import marscli.train.job as jobmod
    import marscli.train.trainer as trainer
    from marscli.train.config import TrainOptions
    from marscli.train.job import Job

    events: list[str] = []

    class Model:
        master_load_seconds = 0.0

        def __init__(self, name: str) -> None:
            self.name = name

        def release(self) -> None:
            events.append(f"release {self.name}")

    monkeypatch.setattr(trainer, "build_model", lambda policy, d, **kw: Model(policy))
    monkeypatch.setattr(jobmod, "close_distributed", lambda d: events.append("close"))
    job = Job("test", "unused", TrainOptions(), None, [], 0.0)
    with pytest.raises(RuntimeError, match="body"), job:
        job.build("policy")
        job.build("ref")
        raise RuntimeError("body")
    assert events == ["release policy", "release ref", "close"]
    assert job.models == []
