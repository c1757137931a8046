"""`marscli sft` on the tiny model: message rows tokenise exactly as rollout's trajectories, the
loss mask covers the assistant's turns only (checked against the chat template), the loss
falls, a run killed after its first epoch resumes to the same weights as an uninterrupted one,
bad rows exit 2 with FILE:LINE (or are skipped and counted), and 2-process ZeRO-2/3 runs under
torchrun (killed and resumed too) match a 1-process run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from marscli.errors import BadInput

from helpers import (
    ROOT,
    ZERO_TOL,
    bf16_config,
    delta_agreement,
    max_diff,
    torchrun,
    tree_hash,
    weights,
)

TOY = {"entities": 8, "train": 0, "test": 0, "sft": 6, "size": 512}
FAST = {"lr": 1e-3, "batch_size": 1, "epochs": 3, "lr_schedule": "constant", "warmup_ratio": 0.0}


def read(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def sft_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "marscli", "sft", *args], check=False,
                          capture_output=True, text=True, env=e, timeout=600)


@pytest.fixture(scope="module")
def proc(tiny_model):
    from marscli.qwen.policy import load_processor

    return load_processor(str(tiny_model))


@pytest.fixture(scope="module")
def spec(proc, tiny_model):
    from marscli.train.batch import Spec

    return Spec.of(proc, str(tiny_model))


@pytest.fixture(scope="module")
def traj(tmp_path_factory, tiny_model) -> Path:
    """Expert trajectories of a small toy world, replayed through the agent and all three
    tools (`rollout --engine replay`): zoom-ins, reverse image searches, text searches."""
    from marscli.search.text_index import build_text_index
    from marscli.stages.rollout import run_rollout
    from marscli.toy.world import build_world

    d = tmp_path_factory.mktemp("sft")
    build_world(d / "world", seed=0, **TOY)
    build_text_index(str(d / "world" / "corpus.jsonl"), d / "text.sqlite", progress=False)
    out = d / "traj.jsonl"
    run_rollout(str(d / "world" / "sft.jsonl"), str(out), policy=str(tiny_model), engine="replay",
                n=1, text_search=f"local:{d / 'text.sqlite'}", image_search="data",
                progress=False)
    recs = read(out)
    assert len(recs) == TOY["sft"] and all(r["stop"] == "answer" for r in recs)
    return out


# ----------------------------------------------------------------------------- message rows


def as_message_row(rec: dict, style: str) -> dict:
    """The conversation of a rollout record, written as a message row in one of the layouts
    sft reads. `llamafactory`: string content with <image> markers, role "tool", no system
    turn, image paths as strings. `parts`: {"type": "image"} parts consumed in order.
    `openai`: the openai engine's record (system turn, image parts by index, tool responses
    as wrapped user turns, text-only segments)."""
    from marscli.agent.messages import default_system
    from marscli.agent.renderers import message_content

    segs = rec["segments"]
    paths = [im["path"] for im in rec["images"]]
    if style == "openai":
        msgs = [{"role": "system", "content": default_system()},
                {"role": "user", "content": message_content("<image>" + rec["question"], [0])}]
        for s in segs[1:]:
            if s["role"] == "model":
                msgs.append({"role": "assistant", "content": s["text"]})
            else:
                msgs.append({"role": "user", "content": message_content(
                    f"<tool_response>\n{s['text']}\n</tool_response>", s.get("images") or [])})
        text_only = [{k: v for k, v in s.items() if k not in ("tokens", "logprobs")} for s in segs]
        return {**rec, "segments": text_only, "messages": msgs}
    if style == "llamafactory":
        msgs = [{"role": "user", "content": "<image>" + rec["question"]}]
        for s in segs[1:]:
            msgs.append({"role": "assistant" if s["role"] == "model" else "tool",
                         "content": s["text"]})
        return {"messages": msgs, "images": paths}
    msgs = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": rec["question"]}]}]
    for s in segs[1:]:
        if s["role"] == "model":
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": s["text"]}]})
        else:
            parts = []
            for i, piece in enumerate(s["text"].split("<image>")):
                if i:
                    parts.append({"type": "image"})
                parts.append({"type": "text", "text": piece})
            msgs.append({"role": "tool", "content": parts})
    return {"messages": msgs, "images": paths}


@pytest.mark.parametrize("style", ["llamafactory", "parts", "openai"])
def test_message_rows_give_the_trajectories_token_ids_and_mask(traj, spec, style):
    from marscli.agent.messages import default_system
    from marscli.train.sft import load_sft_rows

    recs = read(traj)
    msg_file = write(traj.parent / f"msgs-{style}.jsonl", [as_message_row(r, style) for r in recs])
    ours, _ = load_sft_rows(str(msg_file), spec, 10**6, default_system())
    theirs, _ = load_sft_rows(str(traj), spec, 10**6, default_system())
    assert [e.extra["kind"] for e in ours] == ["messages"] * len(recs)
    assert [e.extra["kind"] for e in theirs] == ["trajectory"] * len(recs)
    tools_seen = set()
    for a, b, rec in zip(ours, theirs, recs):
        assert a.input_ids == b.input_ids, rec["id"]
        assert a.loss_mask == b.loss_mask, rec["id"]
        assert [p.resolve() for p in a.images] == [p.resolve() for p in b.images]
        tools_seen |= set(rec["tool_calls"])
    assert tools_seen == {"image_zoom_in_tool", "image_search_tool", "text_search_tool"}


def test_mask_is_the_chat_templates_assistant_mask(traj, spec, proc):
    """A message row with two images (input and crop) and a tool turn against
    `apply_chat_template(..., return_assistant_tokens_mask=True)`, after the processor has
    expanded each image's placeholder: same ids, and the mask is 1 exactly on the assistant's
    text and its <|im_end|> — never on the system prompt, the question, image placeholders or
    the tool response."""
    from PIL import Image

    from marscli.agent.messages import default_system
    from marscli.qwen.tokens import special_ids
    from marscli.train.sft import load_sft_rows

    rec = next(r for r in read(traj) if list(r["tool_calls"]) == ["image_zoom_in_tool"])
    assert len(rec["images"]) == 2
    row = as_message_row(rec, "llamafactory")
    f = write(traj.parent / "two-images.jsonl", [row])
    (e,), _ = load_sft_rows(str(f), spec, 10**6, default_system())
    pics = [Image.open(traj.parent / p).convert("RGB") for p in row["images"]]
    zoom, answer = [s["text"] for s in rec["segments"] if s["role"] == "model"]
    tool = next(s["text"] for s in rec["segments"] if s["role"] == "tool")
    before, after = f"<tool_response>\n{tool}\n</tool_response>".split("<image>")
    hf = [{"role": "system", "content": default_system()},
          {"role": "user", "content": [{"type": "image", "image": pics[0]},
                                       {"type": "text", "text": rec["question"]}]},
          {"role": "assistant", "content": zoom},
          {"role": "user", "content": [{"type": "text", "text": before},
                                       {"type": "image", "image": pics[1]},
                                       {"type": "text", "text": after}]},
          {"role": "assistant", "content": answer}]
    out = proc.apply_chat_template(hf, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"][0]), list(out["assistant_masks"][0])
    nl = proc.tokenizer.encode("\n", add_special_tokens=False)
    assert ids == e.input_ids + nl  # the template ends with "\n" after the last <|im_end|>
    assert mask == e.loss_mask + [0]
    sp = special_ids(proc.tokenizer)
    n_pad = sum(t == sp.image_pad for t in ids)
    assert n_pad == sum(int(x) for x in out["image_grid_thw"].prod(-1) // 4) > 0
    assert not any(m for t, m in zip(ids, mask) if t == sp.image_pad)
    trained = proc.tokenizer.decode([t for t, m in zip(e.input_ids, e.loss_mask) if m])
    assert trained == f"{zoom}<|im_end|>{answer}<|im_end|>"
    assert sum(e.loss_mask) == len(proc.tokenizer.encode(zoom + answer)) + 2


def test_tool_calls_field_and_generic_turns(tmp_path, spec):
    """OpenAI `tool_calls` become marscli's inline call; two tool messages in a row share one
    user turn; bad rows name their field."""
    from marscli.agent.messages import default_system
    from marscli.agent.protocol import ToolCall, parse_turn
    from marscli.train.sft import load_sft_rows

    row = {"messages": [
        {"role": "user", "content": "What year?"},
        {"role": "assistant", "content": "<thinking>search</thinking>",
         "tool_calls": [{"type": "function", "function": {
             "name": "text_search_tool", "arguments": '{"query": "Vukdi year"}'}}]},
        {"role": "tool", "content": "[1] Vukdi was founded in 1971."},
        {"role": "tool", "content": "[2] more"},
        {"role": "assistant", "content": "<thinking>ok</thinking><answer>1971</answer>"}]}
    f = write(tmp_path / "calls.jsonl", [row])
    (e,), _ = load_sft_rows(str(f), spec, 10**6, default_system())
    tok = spec.processor.tokenizer
    text = tok.decode(e.input_ids)
    call = ('<thinking>search</thinking><tool_call>{"name": "text_search_tool", "arguments": '
            '{"query": "Vukdi year"}}</tool_call>')
    assert isinstance(parse_turn(call), ToolCall)
    assert (f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>user\n<tool_response>\n"
            "[1] Vukdi was founded in 1971.\n</tool_response>\n<tool_response>\n[2] more\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n<thinking>ok</thinking>"
            "<answer>1971</answer><|im_end|>") in text
    assert text.startswith(f"<|im_start|>system\n{default_system()}<|im_end|>\n")
    bad = [({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\]\.role"),
           ({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant",
                                                                   "content": "y"}]},
            r"messages\[0\]\.content: more <image> markers .* than images \(0"),
           ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant",
                                                            "content": "y"}],
             "images": ["a.png"]}, r"images\[0\]: not placed"),
           ({"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            r"messages\[0\]\.content\[0\]: unsupported part 'video'")]
    for r, match in bad:
        f = write(tmp_path / "bad.jsonl", [r])
        with pytest.raises(BadInput, match=f"bad.jsonl:1: {match}"):
            load_sft_rows(str(f), spec, 10**6, default_system())


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, traj):
    """3 epochs at lr 1e-3 over the 6 replayed trajectories, one per step."""
    from marscli.stages.sft import run_sft

    before = tree_hash(tiny_model)
    out = tmp_path_factory.mktemp("sftout") / "ckpt"
    stats = run_sft(str(traj), str(tiny_model), str(out), seed=0, **FAST)
    return out, before, stats


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_loss_falls_and_output_is_a_checkpoint(trained, tiny_model):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out, before, stats = trained
    assert tree_hash(tiny_model) == before  # the input checkpoint is byte-identical
    steps = read(out / "metrics.jsonl")
    n = TOY["sft"]  # one sequence per step
    assert [s["step"] for s in steps] == list(range(1, 3 * n + 1))
    assert [s["epoch"] for s in steps] == [1] * n + [2] * n + [3] * n
    for k in ("loss", "lr", "grad_norm", "tokens_per_s", "model_tokens", "seconds"):
        assert all(k in s for s in steps), k
    assert sum(s["sequences"] for s in steps) == 3 * TOY["sft"]
    first, last = steps[0]["loss"], stats["epoch_loss"][-1]["loss"]
    assert last < 0.75 * first, (first, stats["epoch_loss"])
    losses = [ep["loss"] for ep in stats["epoch_loss"]]
    assert losses == sorted(losses, reverse=True)
    meta = orjson.loads((out / "marscli.meta.json").read_bytes())
    assert meta["stage"] == "sft" and meta["stats"]["skipped_rows"] == 0
    assert meta["stats"]["trajectory_rows"] == TOY["sft"] and meta["config"]["agg"] == "token-mean"
    AutoModelForImageTextToText.from_pretrained(out)
    assert AutoProcessor.from_pretrained(out).tokenizer("logo")["input_ids"]
    assert max_diff(weights(out), weights(tiny_model)) > 1e-3
    assert not list(out.parent.glob("ckpt.*"))  # no tmp, no partial


def test_step_loss_is_the_token_mean_over_the_step(trained, traj, spec, tiny_model):
    """The first step's loss equals −Σ log p / N over its sequences' model tokens, computed
    here with one forward per sequence under the input policy."""
    from marscli.agent.messages import default_system
    from marscli.train.batch import collate
    from marscli.train.distributed import Dist
    from marscli.train.sft import epoch_order, load_sft_rows
    from marscli.train.trainer import build_model

    out, _, _ = trained
    exs, _ = load_sft_rows(str(traj), spec, 10**6, default_system())
    model = build_model(str(tiny_model), Dist())
    group = [exs[i] for i in epoch_order(len(exs), 0, 0)[:FAST["batch_size"]]]
    s = sum(float(model.logp(collate([e], spec)).sum()) for e in group)
    n = sum(e.n_model_tokens for e in group)
    assert abs(read(out / "metrics.jsonl")[0]["loss"] - (-s / n)) < 1e-5


def test_freeze_vision_leaves_the_vision_tower(tmp_path, tiny_model, traj):
    from marscli.stages.sft import run_sft

    out = tmp_path / "frozen"
    run_sft(str(traj), str(tiny_model), str(out), freeze_vision=True, **{**FAST, "epochs": 1})
    old, new = weights(tiny_model), weights(out)
    for k in old:
        if k.startswith("model.visual."):
            assert bool((old[k] == new[k]).all()), k
    assert max_diff({k: new[k] for k in new if not k.startswith("model.visual.")},
                    {k: old[k] for k in old if not k.startswith("model.visual.")}) > 1e-4


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_killed_after_first_epoch_resumes_to_the_same_weights(tmp_path, tiny_model, traj,
                                                              trained):
    from marscli.stages.sft import run_sft

    out = tmp_path / "ckpt"
    args = [str(traj), "--policy", str(tiny_model), "--out", str(out), "--save-every-epoch",
            "--lr", "1e-3", "--batch-size", "1", "--epochs", "3", "--schedule", "constant",
            "--warmup-ratio", "0"]
    r = sft_cli(*args, env={"MARSCLI_SFT_KILL_AFTER_EPOCH": "1"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    part = tmp_path / "ckpt.partial"
    assert not out.exists() and orjson.loads((part / "state.json").read_bytes())["epoch"] == 1
    assert len(read(part / "metrics.jsonl")) == TOY["sft"]
    # another run's options: refused, the state kept
    with pytest.raises(BadInput, match=r"ckpt\.partial: resumable state of a different run "
                                       r"\(lr: 0\.001 there, 0\.002 here\)"):
        run_sft(str(traj), str(tiny_model), str(out), seed=0, **{**FAST, "lr": 2e-3})
    stats = run_sft(str(traj), str(tiny_model), str(out), seed=0, save_every_epoch=True, **FAST)
    assert stats["resumed_after_epoch"] == 1
    ref, _, _ = trained  # the same options, never interrupted, without --save-every-epoch
    a, b = weights(ref), weights(out)
    assert all(bool((a[k] == b[k]).all()) for k in a)  # bitwise
    ma, mb = read(ref / "metrics.jsonl"), read(out / "metrics.jsonl")
    assert [(m["step"], m["loss"], m["grad_norm"], m["model_tokens"]) for m in ma] == \
           [(m["step"], m["loss"], m["grad_norm"], m["model_tokens"]) for m in mb]
    assert not part.exists() and not list(tmp_path.glob("ckpt.tmp-*"))


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def bad_rows(traj) -> dict[str, dict]:
    recs = read(traj)
    for r in recs:  # absolute paths: these rows are written to other folders
        for im in r["images"]:
            im["path"] = str(traj.parent / im["path"])
    missing = as_message_row(recs[1], "llamafactory")
    missing["images"][0] = str(traj.parent / "nope.png")
    vocab = orjson.loads(orjson.dumps(recs[2]))
    vocab["segments"][-1]["tokens"][0] = 10 ** 6
    return {"good": recs[0], "good2": recs[3], "missing_image": missing,
            "no_assistant": {"messages": [{"role": "user", "content": "hi"}]},
            "vocab": vocab}


BAD = {"missing_image": r"images\[0\]\.path: .*nope\.png: image not found",
       "no_assistant": "messages: no assistant turn to train on",
       "vocab": "segments: token ids exceed the policy's vocabulary"}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_row_names_file_and_line(tmp_path, tiny_model, bad_rows, kind):
    from marscli.stages.sft import run_sft

    f = write(tmp_path / "d.jsonl", [bad_rows["good"], bad_rows[kind]])
    with pytest.raises(BadInput, match=f"d.jsonl:2: {BAD[kind]}"):
        run_sft(str(f), str(tiny_model), str(tmp_path / "o"))
    assert list(tmp_path.iterdir()) == [f]


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_bad_rows_exit_2_without_output_and_skip_bad_counts(tmp_path, tiny_model, bad_rows,
                                                           capsys):
    from marscli.stages.sft import run_sft

    rows = [bad_rows[k] for k in ("good", "missing_image", "no_assistant", "vocab", "good2")]
    f = write(tmp_path / "d.jsonl", rows)
    r = sft_cli(str(f), "--policy", str(tiny_model), "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"error: {f}:2: images[0].path" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]
    r = sft_cli(str(f), "--policy", str(tiny_model), "--out", str(tmp_path / "o"), "--lr", "-1")
    assert r.returncode == 2 and "--lr" in r.stderr and not (tmp_path / "o").exists()
    with pytest.raises(BadInput, match=r"d.jsonl:1: segments: \d+ tokens, over --max-tokens 64"):
        run_sft(str(f), str(tiny_model), str(tmp_path / "o"), max_tokens=64)

    stats = run_sft(str(f), str(tiny_model), str(tmp_path / "o"), skip_bad=True, epochs=1,
                    batch_size=2)
    err = capsys.readouterr().err
    assert stats["skipped_rows"] == 3 and stats["examples"] == 2 and stats["steps"] == 1
    for line in (2, 3, 4):
        assert f"warning: skipped {f}:{line}: " in err
    assert "skipped 3 bad row(s)" in err
    meta = orjson.loads((tmp_path / "o" / "marscli.meta.json").read_bytes())
    assert meta["stats"]["skipped_rows"] == 3 and len(meta["stats"]["skipped"]) == 3


@pytest.mark.parametrize("opts,match", [
    ({"lr": -1e-5}, "--lr"),
    ({"epochs": 0}, "--epochs"),
    ({"batch_size": 0}, "--batch-size"),
    ({"warmup_ratio": 1.0}, "--warmup-ratio"),
    ({"lr_schedule": "step"}, "--lr-schedule: unknown schedule 'step'"),
    ({"logp_chunk": 0}, "--logp-chunk: 0 is out of range — must be >= 1"),
    ({"max_tokens": 4096, "micro_batch_tokens": 1024, "logp_chunk": 2048},
     "--logp-chunk: 2048 is out of range — must be >= 1 and <= 1024"),
    ({"save_dtype": "int8"}, "--save-dtype"),
])
def test_bad_options_name_the_option(tmp_path, tiny_model, traj, opts, match):
    from marscli.stages.sft import run_sft

    with pytest.raises(BadInput, match=match):
        run_sft(str(traj), str(tiny_model), str(tmp_path / "o"), **opts)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- distributed


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_two_processes_killed_and_resumed_matches_one_process(stage, tmp_path, tiny_model,
                                                                     traj):
    """ZeRO-2/3 on 2 CPU processes, killed after epoch 1 and resumed from the rank files of
    train_state/, against one uninterrupted plain-torch process. Linear AdamW (eps ≫ |g|, no
    clipping) makes the update proportional to the gradient, so a wrong scale would show."""
    from marscli.stages.sft import run_sft

    opts = {**FAST, "lr": 1.0, "adam_eps": 100.0, "grad_clip": 0.0, "micro_batch_tokens": 32768}
    single = tmp_path / "single"
    run_sft(str(traj), str(tiny_model), str(single), seed=0, **opts)
    out = tmp_path / f"zero{stage}"
    flags = [x for k, v in opts.items() for x in (f"--{k.replace('_', '-')}", str(v))]

    def launch(env: dict) -> subprocess.CompletedProcess:
        return torchrun("sft", traj, tiny_model, out, "--save-every-epoch", "--deepspeed",
                        str(ROOT / f"recipes/ds_zero{stage}.json"), *flags, env=env, ok=False)

    r = launch({"MARSCLI_SFT_KILL_AFTER_EPOCH": "1"})
    assert r.returncode != 0 and not out.exists(), r.stderr[-3000:]
    assert "saved resumable state after epoch 1" in r.stderr, r.stderr[-3000:]
    part = tmp_path / f"zero{stage}.partial"
    assert orjson.loads((part / "state.json").read_bytes())["epoch"] == 1
    assert (part / "train_state" / "moments-rank-00001-of-00002.safetensors").is_file()
    r = launch({})
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stderr
    a, b = weights(single), weights(out)
    assert max_diff(a, weights(tiny_model)) > 1e-4
    assert max_diff(a, b) < ZERO_TOL
    for s, t in zip(read(out / "metrics.jsonl"), read(single / "metrics.jsonl"), strict=True):
        # losses near 8 in float32, summed in another order: relative 1e-6 (about 2 ulp)
        assert abs(s["loss"] - t["loss"]) < 1e-6 * max(1.0, abs(t["loss"]))
        assert abs(s["grad_norm"] - t["grad_norm"]) < 1e-5
    assert not part.exists()


@pytest.mark.distributed
def test_zero3_bf16_killed_and_resumed_keeps_the_fp32_masters(tmp_path, tiny_model, traj):
    """ZeRO-3 with bf16 compute on 2 CPU ranks at lr 1e-6 (plain AdamW), killed after epoch 1
    and resumed: the weights move as plain torch's fp32 ones do (measured: cosine 0.9993; the
    16-bit copy saved before gave 0.01, its rounding noise bigger than the update), and the
    resumable state holds the fp32 masters and AdamW's moments, one file per rank."""
    from marscli.stages.sft import run_sft

    opts = {"lr": 1e-6, "batch_size": 2, "epochs": 2, "lr_schedule": "constant",
            "warmup_ratio": 0.0}
    single = tmp_path / "single"
    run_sft(str(traj), str(tiny_model), str(single), seed=0, **opts)
    ds = bf16_config(tmp_path, 3)
    out, part = tmp_path / "z3", tmp_path / "z3.partial"
    flags = [x for k, v in opts.items() for x in (f"--{k.replace('_', '-')}", str(v))]

    def launch(env: dict) -> subprocess.CompletedProcess:
        return torchrun("sft", traj, tiny_model, out, "--save-every-epoch", "--deepspeed",
                        str(ds), *flags, env=env, ok=False)

    r = launch({"MARSCLI_SFT_KILL_AFTER_EPOCH": "1"})
    assert r.returncode != 0 and not out.exists(), r.stderr[-3000:]
    st = orjson.loads((part / "train_state" / "state.json").read_bytes())
    assert st["bf16"] and st["zero_stage"] == 3 and st["world"] == 2 and st["optimizer"]
    r = launch({})
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-4000:]
    cos, ratio = delta_agreement(tiny_model, single, out)
    assert cos > 0.99 and abs(ratio - 1) < 0.05, (cos, ratio)
    assert not part.exists()
