"""What several test modules share: running the CLI (a real process or typer's in-process
runner), JSONL files, small pictures, prompt and trajectory rows, scripted replies and checkpoint
comparisons. Test modules import from here (or from conftest's fixtures), never from each other.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import io
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import orjson
import pytest
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
MARSCLI = [sys.executable, "-m", "marscli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "200"}


# ----------------------------------------------------------------------------- running the CLI


def marscli(*args: str, env: dict | None = None, timeout: float = 600,
            **kw) -> subprocess.CompletedProcess:
    """`python -m marscli ARGS` as a real process (text output captured, never raises)."""
    return subprocess.run([*MARSCLI, *args], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=timeout, check=False, **kw)


def invoke(args: list[str], cwd: Path | None = None) -> tuple[int, str, str]:
    """Run the CLI in this process (typer's runner: exit code, stdout, stderr as a user sees
    them, minus the interpreter start-up, which costs seconds once torch is imported)."""
    from typer.testing import CliRunner

    from marscli.cli import app

    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        res = CliRunner().invoke(app, args, env={"NO_COLOR": "1", "COLUMNS": "200"})
    finally:
        os.chdir(old)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.stdout, res.stderr


def kill_9_after_first_record(args: list[str], out: Path, timeout: float = 120) -> int:
    """Start `marscli ARGS`, SIGKILL it once OUT holds a complete line, and return how many
    lines it held after the kill (a kill that came too late fails the caller's checks)."""
    return signal_after_first_record(args, out, signal.SIGKILL, timeout).lines


class Stopped(NamedTuple):
    code: int  # the exit status (-N: ended by signal N, as Popen says it)
    lines: int  # the lines OUT held once it had ended
    seconds: float  # from the signal to its end
    stderr: str


def _default_sigint() -> None:
    """A test run started in the background by a non-interactive shell (`nohup ... &`, a CI
    runner's job) has SIGINT ignored, its children inherit that, and Python then leaves it
    ignored: Ctrl-C's test would send a signal nothing hears. The child gets the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_after_first_record(args: list[str], out: Path, sig: int, timeout: float = 120,
                              stop_s: float = 60) -> Stopped:
    """Start `marscli ARGS`, send it `sig` once OUT holds a complete line and wait for it to
    end; a process still running `stop_s` seconds after the signal is killed and fails the
    caller (a signal that is not acted on must not hang the test run)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([*MARSCLI, *args], stdout=subprocess.DEVNULL, stderr=err,
                                env=ENV, preexec_fn=_default_sigint)
        deadline = time.monotonic() + timeout
        while not (out.exists() and b"\n" in out.read_bytes()):
            assert proc.poll() is None, f"marscli {args[0]} ended before it could be signalled"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(sig)
        t0 = time.monotonic()
        try:
            proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"marscli {args[0]} still ran {stop_s} s after signal "
                                 f"{sig}") from None
        seconds = time.monotonic() - t0
        err.seek(0)
        return Stopped(proc.returncode, out.read_bytes().count(b"\n"), seconds, err.read())


# ----------------------------------------------------------------------------- files


def write_jsonl(path: Path, rows: list, tail: bytes = b"") -> Path:
    """Rows (dicts, or raw bytes for a broken line) as JSONL, plus raw `tail` bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n"
                              for r in rows) + tail)
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in Path(path).read_bytes().splitlines()]


def strip_ms(obj):
    """A record without its timings (`ms`, the only fields allowed to differ between runs)."""
    if isinstance(obj, dict):
        return {k: strip_ms(v) for k, v in obj.items() if k != "ms"}
    if isinstance(obj, list):
        return [strip_ms(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- pictures


def scene(path: Path, size: tuple[int, int] = (480, 360)) -> Path:
    """Grey, with a red bottom-right quadrant and a green block at its top-left (a quarter of
    the width, an eighth of the height), so that crops are checkable. The default size is quick
    to process."""
    w, h = size
    im = Image.new("RGB", size, (40, 40, 40))
    d = ImageDraw.Draw(im)
    d.rectangle([w // 2, h // 2, w - 1, h - 1], fill=(200, 30, 30))
    d.rectangle([w // 2, h // 2, w // 2 + w // 4 - 1, h // 2 + h // 8 - 1], fill=(30, 200, 30))
    im.save(path)
    return path


def big_scene(path: Path) -> Path:
    """`scene` at 1600x1200, large enough for crops of crops."""
    return scene(path, (1600, 1200))


def png_header(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h pixels (and holds almost no data): a decompression bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def picture(path: Path, size: tuple[int, int], seed: int) -> Path:
    """A plain picture of one seeded colour with a red square somewhere in its top-left."""
    rng = random.Random(seed)
    im = Image.new("RGB", size, (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    x, y = rng.randrange(size[0] // 2), rng.randrange(size[1] // 2)
    ImageDraw.Draw(im).rectangle([x, y, x + size[0] // 3, y + size[1] // 3], fill=(250, 20, 20))
    im.save(path)
    return path


# ----------------------------------------------------------------------------- scripted replies

ZOOM = '<tool_call>{{"name": "image_zoom_in_tool", "arguments": {args}}}</tool_call>'
ZOOM_THEN_ANSWER = [
    ('<thinking>Look closer.</thinking><tool_call>{"name": "image_zoom_in_tool", "arguments": '
     '{"bbox_2d": [500, 500, 1000, 1000]}}</tool_call>'),
    "<thinking>Red.</thinking><answer>red</answer>",
]
# Every kind of model mistake between two zooms and the answer.
REPLIES = [
    "<thinking>The sign is small.</thinking>"
    + ZOOM.format(args='{"bbox_2d": [500, 500, 1000, 1000], "label": "corner"}'),
    "<think>Closer.</think>"
    + ZOOM.format(args='{"bbox_2d": [0, 0, 500, 250], "img_idx": 1}'),
    '<thinking>oops</thinking><tool_call>{"name": "image_zoom_in_tool", "arguments": </tool_call>',
    '<thinking>x</thinking><tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>',
    "<thinking>x</thinking>" + ZOOM.format(args='{"bbox_2d": [600, 10, 300, 20]}'),
    "<thinking>x</thinking>" + ZOOM.format(args='{"bbox_2d": [0, 0, 10, 10], "img_idx": 9}'),
    "<thinking>I can read it now.</thinking><answer>1997</answer>",
]


def answer(text: str) -> str:
    return f"<thinking>Done.</thinking><answer>{text}</answer>"


# ----------------------------------------------------------------------------- prompt rows


def prompt(pid: str, image: str = "scene.png", **kw) -> dict:
    return {"v": 1, "id": pid, "image": image, "question": "What colour?", "answer": ["red"],
            "replies": ["<answer>red</answer>"], **kw}


def write_prompts(path: Path, ids: list[str], replies=ZOOM_THEN_ANSWER, **extra) -> Path:
    """Prompt rows for the replay engine (each replays `replies`), beside a `scene.png`."""
    if not (path.parent / "scene.png").exists():
        scene(path.parent / "scene.png")
    return write_jsonl(path, [{"v": 1, "id": i, "image": "scene.png", "question": "What colour?",
                               "answer": ["red"], "replies": replies, **extra} for i in ids])


# Open questions (fvqa): right, wrong, no <answer> tag. Multiple choice (vstar, options
# red/blue, gold A): right by letter, zoom then wrong, right by the option's text.
EVAL_ZOOM = ('<thinking>Closer.</thinking><tool_call>{"name": "image_zoom_in_tool", '
             '"arguments": {"bbox_2d": [0, 0, 500, 500]}}</tool_call>')
MIXED = [
    {"id": "o1", "benchmark": "fvqa", "category": "nature", "question": "What colour?",
     "answer": ["red"], "replies": [answer("Red.")]},
    {"id": "o2", "benchmark": "fvqa", "category": "nature", "question": "What colour?",
     "answer": ["red"], "replies": [answer("blue")]},
    {"id": "o3", "benchmark": "fvqa", "category": "nature", "question": "What colour?",
     "answer": ["red"], "replies": ["<thinking>Hmm.</thinking>It is red."]},
    {"id": "m1", "benchmark": "vstar", "category": "direct_attributes",
     "question": "Colour?\nOptions:\nA. red\nB. blue", "answer": ["A"],
     "choices": ["red", "blue"], "replies": [answer("A")]},
    {"id": "m2", "benchmark": "vstar", "category": "direct_attributes",
     "question": "Colour?\nOptions:\nA. red\nB. blue", "answer": ["A"],
     "choices": ["red", "blue"], "replies": [EVAL_ZOOM, answer("(B)")]},
    {"id": "m3", "benchmark": "vstar", "category": "relative_position",
     "question": "Colour?\nOptions:\nA. red\nB. blue", "answer": ["A"],
     "choices": ["red", "blue"], "replies": [answer("red")]},
]


def write_bench(path: Path, rows: list[dict]) -> Path:
    """Benchmark rows in marscli's own form, beside a small red picture they all show."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.parent / "red.png").exists():
        Image.new("RGB", (64, 48), (200, 30, 30)).save(path.parent / "red.png")
    return write_jsonl(path, [{"v": 1, "image": "red.png", **r} for r in rows])


# ----------------------------------------------------------------------------- trajectory rows

SYSTEM = "You are a careful visual agent."


def trajectory(folder: Path, proc, i: int, *, size=(64, 64), answer="red", advantage=1.0,
               minibatch=None, crop=None, think="", logprob: float | None = None) -> dict:
    """A trajectory row built the agent's way: a prompt with an image (or none), optionally a
    zoom call answered by a tool turn with a second image, then an answer. Model segments carry
    no engine log-probs (`null`, as a hand-made row has none) unless `logprob` gives one value
    for every token."""
    from marscli.qwen.images import open_image
    from marscli.qwen.tokens import (
        encode_parts,
        image_features,
        prompt_parts,
        special_ids,
        tool_parts,
    )

    tok = proc.tokenizer
    ids = special_ids(tok)
    refs: list[dict] = []

    def add_image(sz) -> int:
        p = picture(folder / f"t{i}-{len(refs)}.png", sz, seed=i * 10 + len(refs))
        refs.append({"path": p.name})
        return image_features(proc, open_image(p)).n_tokens

    def model(text: str) -> dict:
        toks = tok.encode(text, add_special_tokens=False) + [ids.im_end]
        lps = None if logprob is None else [logprob] * len(toks)
        return {"role": "model", "tokens": toks, "logprobs": lps, "text": text}

    counts = [add_image(size)] if size else []
    segs = [{"role": "prompt", "images": list(range(len(counts))),
             "tokens": encode_parts(tok, ids, prompt_parts(SYSTEM, "What colour is the square?",
                                                           counts))}]
    if crop:
        segs.append(model(f"<thinking>{think}zoom</thinking><tool_call>{{\"name\": "
                          "\"image_zoom_in_tool\"}</tool_call>"))
        n = add_image(crop)
        segs.append({"role": "tool", "images": [len(refs) - 1],
                     "tokens": encode_parts(tok, ids, tool_parts("<image>", [n], True))})
    segs.append(model(f"<thinking>{think}</thinking><answer>{answer}</answer>"))
    row = {"v": 1, "id": f"t{i}", "advantage": advantage, "images": refs, "segments": segs}
    if minibatch is not None:
        row["minibatch"] = minibatch
    return row


VARIED = [  # (image size, crop size, answer, advantage, thinking padding)
    ((64, 64), None, "red", 1.0, ""),
    ((96, 64), (64, 64), "blue square", -1.0, "look closer "),
    ((64, 128), None, "top left", 0.5, "hmm " * 6),
    (None, None, "green", -0.5, "text only "),
    ((64, 64), (96, 96), "red", 0.25, "zoom in " * 3),
    ((128, 64), None, "yellow", -0.25, ""),
]


def varied_rows(folder: Path, proc, minibatches: int | None = None) -> list[dict]:
    """Six trajectories of different lengths, image counts and sizes, and advantages."""
    return [trajectory(folder, proc, i, size=s, crop=c, answer=a, advantage=adv, think=th,
                       minibatch=None if minibatches is None else i % minibatches)
            for i, (s, c, a, adv, th) in enumerate(VARIED)]


# ----------------------------------------------------------------------------- checkpoints


def tree_hash(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder`, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def weights(folder: Path) -> dict:
    """The tensors of an HF checkpoint's top-level safetensors shards."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def messages_of(rec: dict, proc) -> tuple[list[dict], list[Image.Image]]:
    """Rebuild the chat messages (and images in order) that a trajectory stands for, as the
    processor's chat template would be given them."""
    from marscli.agent.protocol import system_prompt
    from marscli.tools.zoom import SCHEMA

    images = [Image.open(Path(rec["_base"]) / im["path"]).convert("RGB") for im in rec["images"]]
    msgs = [{"role": "system", "content": system_prompt([SCHEMA])},
            {"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": rec["question"]}]}]
    for s in rec["segments"][1:]:
        if s["role"] == "model":
            msgs.append({"role": "assistant", "content": s["text"]})
            continue
        parts = []
        pieces = ("<tool_response>\n" + s["text"] + "\n</tool_response>").split("<image>")
        for i, piece in enumerate(pieces):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        msgs.append({"role": "user", "content": parts})
    return msgs, images


# ----------------------------------------------------------------------------- a run folder

# Scripts for the scripted engine: zoom, zoom into the zoom, answer 1997 (A); reverse image
# search, then answer from the title (B); never a valid turn, stops at max_turns (C).
RUN_SCRIPTS = {
    "A": ["<thinking>The sign is small.</thinking>"
          + ZOOM.format(args='{"bbox_2d": [500, 500, 1000, 1000], "label": "corner"}'),
          "<think>Closer.</think>"
          + ZOOM.format(args='{"bbox_2d": [0, 0, 500, 250], "img_idx": 1}'),
          "<thinking>I can read it now.</thinking><answer>1997</answer>"],
    "B": [('<thinking>Search the picture.</thinking><tool_call>{"name": "image_search_tool", '
           '"arguments": {}}</tool_call>'),
          "<thinking>The title says Gustave.</thinking><answer>Gustave</answer>"],
    "C": ["<thinking>hmm</thinking>no tags at all"],
}
# (prompt, sample, script) per iteration
RUN_JOBS = {0: [("q1", 0, "A"), ("q1", 1, "B"), ("q2", 0, "C"), ("q2", 1, "A")],
            1: [("q1", 0, "A"), ("q1", 1, "A"), ("q2", 0, "B"), ("q2", 1, "C")]}
RUN_UNSCORED = {(1, "q2#1")}  # the judge failed on this one
METRIC_KEYS = ("loss", "pg_loss", "kl", "clip_frac", "grad_norm", "lr")


def _score(rec: dict, it: int) -> dict:
    if (it, rec["id"]) in RUN_UNSCORED:
        return {**rec, "reward": {"status": "unscored", "error": "judge timed out"}}
    acc = 1.0 if rec["final_answer"] in rec["answer_gt"] else 0.0
    clean = rec["stop"] == "answer" and not rec["format_errors"] and not rec["tool_errors"]
    fmt = 0.5 if clean else 0.0
    return {**rec, "reward": {"total": acc + fmt, "accuracy": acc, "format": fmt, "judge": "exact"}}


def _with_advantages(rows: list[dict]) -> list[dict]:
    out = []
    for pid in dict.fromkeys(r["prompt_id"] for r in rows):
        group = [r for r in rows if r["prompt_id"] == pid and "total" in r["reward"]]
        tot = [r["reward"]["total"] for r in group]
        mean = sum(tot) / len(tot)
        std = (sum((t - mean) ** 2 for t in tot) / len(tot)) ** 0.5
        for r in group:
            out.append({**r, "advantage": round(r["reward"]["total"] - mean, 4),
                        "group": {"mean": mean, "std": std, "size": len(group)}})
    return out


def make_run(tiny_model: Path, root: Path) -> Path:
    """ROOT/demo/{iter-0,iter-1}: trajectories made by the real agent loop with a scripted
    engine, then scored (one unscored), advantages and metrics (iter-1's in a checkpoint
    subfolder, as `update --out` leaves it); rollouts for iter-0 only."""
    from marscli.agent.loop import Agent, AgentConfig
    from marscli.engines import SamplingParams
    from marscli.qwen.policy import load_processor
    from marscli.records.schema import Prompt
    from marscli.tools import build_tools

    from scripted import ScriptedEngine

    run = root / "demo"
    run.mkdir(parents=True)
    big_scene(run / "scene.png")
    Image.new("RGB", (300, 200), (20, 60, 220)).save(run / "thumb.png")
    proc = load_processor(str(tiny_model))
    prompts = {
        "q1": Prompt(id="q1", question="What year is on the sign?", images=["scene.png"],
                     answer=["1997"], base=run, category="visual",
                     image_search=[{"title": "Old town sign, 1997", "thumbnail": "thumb.png"}]),
        "q2": Prompt(id="q2", question="Who built the tower?", images=["scene.png"],
                     answer=["Eiffel"], base=run, category="knowledge",
                     image_search=[{"title": "Tower by Gustave Eiffel", "thumbnail": "thumb.png"}]),
    }
    for it, jobs in RUN_JOBS.items():
        folder = run / f"iter-{it}"
        folder.mkdir()
        rows = []
        for pid, sample, script in jobs:
            agent = Agent(ScriptedEngine(proc, RUN_SCRIPTS[script]),
                          build_tools(image_search="data"),
                          AgentConfig(max_turns=3, sampling=SamplingParams()),
                          media_dir=folder / "rollouts.jsonl.media", rel_to=folder,
                          policy_name=f"ckpt/iter-{it}")
            rows.append(next(agent.run([(prompts[pid], sample)])))
        scored = [_score(r, it) for r in rows]
        if it == 0:
            write_jsonl(folder / "rollouts.jsonl", rows)
        write_jsonl(folder / "scored.jsonl", scored)
        write_jsonl(folder / "advantages.jsonl", _with_advantages(scored))
        metrics = [{"step": 2 * it + s, **{k: 0.1 * (i + 1) + 0.01 * s + 0.05 * it
                                          for i, k in enumerate(METRIC_KEYS)}} for s in range(2)]
        write_jsonl(folder / ("metrics.jsonl" if it == 0 else "ckpt/metrics.jsonl"), metrics)
    return run


# ----------------------------------------------------------------------------- training runs

LINEAR_ADAM = {"lr": 1.0, "adam_eps": 100.0, "grad_clip": 0.0}


ZERO_TOL = 1e-6  # max |ZeRO − single| per weight; the weights themselves move by ~1e-4


def delta_agreement(base: Path, a: Path, b: Path) -> tuple[float, float]:
    """Cosine and norm ratio (b / a) of two checkpoints' weight changes from `base`."""
    import torch

    w0, wa, wb = weights(base), weights(a), weights(b)
    da = torch.cat([(wa[k].double() - w0[k].double()).flatten() for k in sorted(w0)])
    db = torch.cat([(wb[k].double() - w0[k].double()).flatten() for k in sorted(w0)])
    return (torch.nn.functional.cosine_similarity(da, db, dim=0).item(),
            (db.norm() / da.norm()).item())


def torchrun(stage: str, data: Path, policy: Path, out: Path, *args: str, env: dict | None = None,
             ok: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m marscli STAGE DATA --policy P --out O ARGS` (2 CPU ranks,
    gloo); with `ok`, a non-zero exit fails the test."""
    from marscli.train.distributed import free_port

    port = str(free_port())
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2",
           "--master_port", port, "-m", "marscli", stage, str(data), "--policy", str(policy),
           "--out", str(out), *args]
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
         **(env or {})}
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=e, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0 or not ok, r.stderr[-4000:]
    return r


def bf16_config(tmp_path: Path, stage: int) -> Path:
    """recipes/ds_zeroN.json with bf16 on (what "auto" gives on a GPU; DeepSpeed takes it on
    CPU too)."""
    import json

    cfg = json.loads((ROOT / f"recipes/ds_zero{stage}.json").read_text())
    cfg["bf16"] = {"enabled": True}
    path = tmp_path / f"ds_zero{stage}_bf16.json"
    path.write_text(json.dumps(cfg))
    return path


# ----------------------------------------------------------------------------- benchmark files

def png(color=(200, 30, 30), size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_tsv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["\t".join(header)] + ["\t".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


HR_HEADER = ["index", "question", "A", "B", "C", "D", "answer", "category", "image",
             "cycle_category"]


def hr_rows() -> list[list[str]]:
    b64 = base64.b64encode(png((10, 200, 10))).decode()
    return [
        ["0", "What is on the sign?", "cat", "dog", "cow", "pig", "B", "single", b64, "cycle1"],
        ["1", "What is on the sign?", "dog", "cow", "pig", "cat", "A", "single", "0", "cycle2"],
        ["2", '"Which is larger?\nLook closely."', "left", "right", "same", "unknown", "C",
         "cross", b64, "cycle1"],
    ]


def recorded_vs_forward(model, processor, rec: dict, base: Path) -> tuple[list[float], list[float]]:
    """A trajectory's recorded model log-probs and a teacher-forced forward's over the same
    token ids and images (model tokens only): (forward, recorded)."""
    import torch
    from PIL import Image

    from marscli.qwen.tokens import assemble, image_features, special_ids

    ids = special_ids(processor.tokenizer)
    seq = assemble(rec["segments"], ids.image_pad)
    feats = [image_features(processor, Image.open(base / im["path"]).convert("RGB"))
             for im in rec["images"]]
    input_ids = torch.tensor([seq.input_ids])
    kw = {"pixel_values": torch.cat([f.pixel_values for f in feats]),
          "image_grid_thw": torch.stack([f.grid_thw for f in feats]),
          "mm_token_type_ids": (input_ids == ids.image_pad).int()}
    model.model.rope_deltas = None
    with torch.no_grad():
        logits = model(input_ids=input_ids, **kw).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, input_ids[0, 1:, None])[:, 0]
    got = [x for x, m in zip(lp.tolist(), seq.loss_mask[1:], strict=True) if m]
    want = [x for x, m in zip(seq.model_logprobs[1:], seq.loss_mask[1:], strict=True) if m]
    return got, want


def judge_options(timeout: float = 60.0, retries: int = 2, concurrency: int = 8,
                  cache: str | None = None, backoff: float = 0.01):
    """The reward stage's `JudgeOptions` as its `--judge-*` flags spell them (short backoff)."""
    from marscli.scoring.judge import JudgeOptions

    return JudgeOptions(timeout_s=timeout, attempts=retries + 1, concurrency=concurrency,
                        cache_path=cache, backoff_s=backoff)


def idle_nodes() -> list[str]:
    """Names of the Slurm nodes that can take a job now ([] when there is no cluster)."""
    if shutil.which("sinfo") is None:
        return []
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                           timeout=8, check=False)  # a dead controller: 10 s+
    except subprocess.TimeoutExpired:
        return []
    up = ("idle", "mixed", "allocated", "completing")
    return sorted({n for n, s in (line.split()[:2] for line in r.stdout.splitlines()
                                  if len(line.split()) >= 2) if s.rstrip("*~#") in up})


@contextlib.contextmanager
def without_dac_override() -> Iterator[None]:
    """This thread loses CAP_DAC_OVERRIDE (root's power to write where a mode forbids it)."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    hdr, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        pytest.skip("root without capget: cannot make a folder read-only for this test")
    saved = data[0].effective
    data[0].effective &= ~(1 << 1)  # CAP_DAC_OVERRIDE
    if libc.capset(ctypes.byref(hdr), data) != 0:
        pytest.skip("root without capset: cannot make a folder read-only for this test")
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(hdr), data) == 0


def invoke_read_only(folder: Path, args: list[str]) -> tuple[int, str, str]:
    """`invoke(args)` while `folder` is read-only (mode 555, root's override dropped)."""
    folder.chmod(0o555)
    try:
        with without_dac_override():
            return invoke(args)
    finally:
        folder.chmod(0o755)


HOLD = """
import sys
from marscli.records.locks import OutputLock
with OutputLock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def held(out: Path, env: dict | None = None) -> Iterator[subprocess.Popen]:
    """Another process holding OUT's lock (writing it, as rollout does) until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env or ENV)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


# ----------------------------------------------------------------------------- make -n

# Variables a developer's shell may hold that would change what the recipes expand to.
MAKE_CLEAN = ("NPROC", "NNODES", "GPUS_PER_NODE", "MASTER_PORT", "SLURM", "SHARDS", "TP",
              "BN_GSPO", "DEEPSPEED", "KEEP_OPTIMIZER", "COLD_START", "RUN", "NAME", "BASE",
              "MAKEFLAGS")


def dry_run(*args: str, env: dict | None = None) -> list[str]:
    """`make -n ARGS` in the repository: the commands make would run, one logical line each."""
    e = {k: v for k, v in os.environ.items()
         if k not in MAKE_CLEAN and not k.startswith("SBATCH_")}
    r = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, text=True,
                       capture_output=True, env={**e, **(env or {})}, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout.replace("\\\n", " ").splitlines()


# ----------------------------------------------------------------------------- ports, disk


def free_ports(n: int) -> int:
    """A port p with p..p+n-1 free now."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(free(base + i) for i in range(n)):
            return base
    raise AssertionError("no run of free ports")


@contextlib.contextmanager
def file_size_limit(n: int) -> Iterator[None]:
    """Writes past `n` bytes in one file fail with EFBIG (a full disk, as a process sees it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
