"""Bad inputs, table-driven, across the stages; and model mistakes, which are observations.

For every bad input the stage exits 2 (bad usage or input) or 1 (runtime failure), prints
exactly one `error:` line on stderr naming the file and line and the field, or the option,
prints nothing on stdout, and leaves its output folder as it found it (a pre-existing output
file unchanged, no temporary or partial files). Other stderr lines (progress, logs) may exist.

The cases run in this process through typer's CLI runner (exit code, stdout and stderr as the
user sees them, without a 5-second interpreter start-up per case once torch is imported), all
from one module fixture; each case is one parametrised test reading its result. A handful run
again as real `python -m marscli` subprocesses, to show the two agree.

Model mistakes (bad JSON, an unknown tool, arguments of the wrong type, x1 > x2, an img_idx out
of range, a reply that never closes its tags) become error observations, are counted in the
trajectory's statistics, cost the format reward, and the run goes on to an answer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from helpers import invoke, marscli, png_header, prompt, read_jsonl, scene, trajectory, write_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "200"}


# ----------------------------------------------------------------------------- fixtures


def scored(i: int, total=1.0) -> dict:
    return {"v": 1, "id": f"p{i // 2}#{i % 2}", "prompt_id": f"p{i // 2}",
            "reward": {"total": total, "accuracy": total, "format": 0.0, "judge": "exact"}}


def traj(i: int, **kw) -> dict:
    return {"v": 1, "id": f"t{i}#0", "prompt_id": f"t{i}", "answer_gt": ["red"],
            "final_answer": "red", "stop": "answer", "question": "What colour?",
            "segments": [{"role": "prompt", "tokens": [1, 2]},
                         {"role": "model", "tokens": [3], "text": "<answer>red</answer>"}],
            **kw}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model) -> Path:
    """Good and bad inputs of every kind, in one folder."""
    from marscli.qwen.policy import load_processor

    d = tmp_path_factory.mktemp("bad-inputs")
    scene(d / "scene.png")
    (d / "zero.png").write_bytes(b"")
    whole = (d / "scene.png").read_bytes()
    (d / "trunc.png").write_bytes(whole[: len(whole) // 2])
    (d / "bomb.png").write_bytes(png_header(50_000, 50_000))
    (d / "folder.png").mkdir()

    write_jsonl(d / "prompts.jsonl", [prompt("a"), prompt("b")])
    write_jsonl(d / "p-trunc.jsonl", [prompt("a")], tail=b'{"v": 1, "id": "b", "ima')
    write_jsonl(d / "p-dup.jsonl", [prompt("a"), prompt("b"), prompt("a")])
    write_jsonl(d / "p-noq.jsonl", [prompt("a"), {k: v for k, v in prompt("b").items()
                                            if k != "question"}])
    write_jsonl(d / "p-version.jsonl", [prompt("a"), {**prompt("b"), "v": 2}])
    (d / "empty.jsonl").write_bytes(b"\n\n")
    for name in ("missing", "zero", "bomb", "folder"):
        write_jsonl(d / f"p-{name}.jsonl", [prompt("a"), prompt("b", image=f"{name}.png")])
    write_jsonl(d / "p-trunc-image.jsonl", [prompt("a"), prompt("b", image="trunc.png")])

    write_jsonl(d / "scored.jsonl", [scored(i) for i in range(4)])
    write_jsonl(d / "s-trunc.jsonl", [scored(i) for i in range(3)],
                tail=b'{"v": 1, "id": "p1#1", "re')
    write_jsonl(d / "s-nonjson.jsonl", [scored(0), b"this is not json", scored(2)])
    write_jsonl(d / "s-type.jsonl", [scored(0), scored(1), scored(2, total="1.0")])
    write_jsonl(d / "s-nototal.jsonl", [scored(0), {**scored(1), "reward": {"accuracy": 1.0}}])
    write_jsonl(d / "s-version.jsonl", [{**scored(0), "v": 7}])

    write_jsonl(d / "t-nogt.jsonl",
                [traj(0), {k: v for k, v in traj(1).items() if k != "answer_gt"}])
    write_jsonl(d / "t-type.jsonl", [traj(0), traj(1, final_answer=42)])

    proc = load_processor(str(tiny_model))
    good = trajectory(d, proc, 0, answer="red")
    no_model = {**trajectory(d, proc, 1), "id": "t1",
                "segments": [s for s in good["segments"] if s["role"] != "model"]}
    alien = trajectory(d, proc, 2)  # another tokenizer's ids: beyond this vocabulary
    alien["segments"][-1]["tokens"] = [50_000 + t for t in alien["segments"][-1]["tokens"]]
    write_jsonl(d / "adv.jsonl", [good])
    write_jsonl(d / "a-nomodel.jsonl", [good, no_model])
    write_jsonl(d / "a-vocab.jsonl", [good, alien])
    write_jsonl(d / "a-noadv.jsonl", [good, {k: v for k, v in alien.items() if k != "advantage"}])

    (d / "ckpt-noconfig").mkdir()
    shutil.copy(tiny_model / "model.safetensors", d / "ckpt-noconfig")
    shutil.copytree(tiny_model, d / "ckpt-trunc")
    st = d / "ckpt-trunc" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    (d / "ds-optim.json").write_text('{"zero_optimization": {"stage": 2}, '
                                     '"optimizer": {"type": "Adam"}}')
    (d / "ds-broken.json").write_text('{"zero_optimization": {"stage": 2,')
    return d


# ----------------------------------------------------------------------------- the table


@dataclass
class Case:
    id: str
    args: list[str]  # {d}: the data folder, {m}: the tiny model, {o}: this case's output
    must: list[str]  # substrings of the error line
    code: int = 2
    out: str = "out.jsonl"  # the output this case names (pre-created with known bytes)
    out_dir: bool = False  # the output is a folder (a checkpoint: --out with --force)
    earlier: bool = True  # the output holds a record of an earlier run (else: it is new)


def R(*a):  # rollout through the replay engine (no model weights needed)
    return ["rollout", *a, "-o", "{o}", "--policy", "{m}", "--engine", "replay", "-n", "1"]


def U(adv, *a, policy="{m}"):
    return ["update", f"{{d}}/{adv}", "--policy", policy, "--out", "{o}", "--force", *a]


CASES = [
    # rollout: the prompts file, its images, its options
    Case("rollout-truncated-last-line", R("{d}/p-trunc.jsonl"),
         ["p-trunc.jsonl:2", "not valid JSON", "truncated last line"]),
    Case("rollout-duplicate-ids", R("{d}/p-dup.jsonl"), ["p-dup.jsonl:3", "id", "duplicate"]),
    Case("rollout-missing-field", R("{d}/p-noq.jsonl"), ["p-noq.jsonl:2", "question", "missing"]),
    Case("rollout-unknown-version", R("{d}/p-version.jsonl"),
         ["p-version.jsonl:2", "v:", "schema version 2"]),
    Case("rollout-empty-input", R("{d}/empty.jsonl"), ["empty.jsonl", "empty input"]),
    Case("rollout-missing-image", R("{d}/p-missing.jsonl"),
         ["p-missing.jsonl:2", "image", "missing.png", "not found"]),
    Case("rollout-zero-byte-image", R("{d}/p-zero.jsonl"),
         ["p-zero.jsonl:2", "image", "zero.png", "cannot be decoded"]),
    Case("rollout-truncated-image", R("{d}/p-trunc-image.jsonl"),
         ["p-trunc-image.jsonl:2", "image", "trunc.png", "cannot be decoded"]),
    Case("rollout-decompression-bomb", R("{d}/p-bomb.jsonl"),
         ["p-bomb.jsonl:2", "image", "bomb.png", "50000x50000", "decompression bomb"]),
    Case("rollout-image-is-a-folder", R("{d}/p-folder.jsonl"),
         ["p-folder.jsonl:2", "image", "folder.png", "is a folder"]),
    Case("rollout-shard-3/2", [*R("{d}/prompts.jsonl"), "--shard", "3/2"],
         ["--shard", "3/2", "out of range"]),
    Case("rollout-n-0", [*R("{d}/prompts.jsonl"), "-n", "0"], ["-n", "0", "out of range"]),
    Case("rollout-negative-search-retries", [*R("{d}/prompts.jsonl"), "--search-retries", "-1"],
         ["--search-retries", "-1", "out of range"]),
    Case("rollout-unknown-engine", ["rollout", "{d}/prompts.jsonl", "-o", "{o}", "--policy",
                                    "{m}", "--engine", "warp"],
         ["unknown engine 'warp'", "hf", "openai", "replay", "vllm"]),
    Case("rollout-unknown-text-backend", [*R("{d}/prompts.jsonl"), "--text-search", "bing:x"],
         ["text search backend", "bing", "local", "retriever", "serper"]),
    Case("rollout-unknown-image-backend", [*R("{d}/prompts.jsonl"), "--image-search", "tineye"],
         ["image search backend", "tineye", "data", "local", "serper-lens"]),
    Case("rollout-checkpoint-without-config",
         ["rollout", "{d}/prompts.jsonl", "-o", "{o}", "--policy", "{d}/ckpt-noconfig",
          "--engine", "replay"], ["--policy", "ckpt-noconfig", "config.json"], earlier=False),
    Case("rollout-truncated-safetensors",
         ["rollout", "{d}/prompts.jsonl", "-o", "{o}", "--policy", "{d}/ckpt-trunc",
          "--engine", "replay"], ["--policy", "model.safetensors", "truncated"], earlier=False),
    # records of an earlier run, but nothing says with which settings: never mixed
    Case("rollout-earlier-records-without-settings", R("{d}/prompts.jsonl"),
         ["out.jsonl", "holds 1 records but no out.jsonl.settings.json", "--force"]),
    Case("rollout-output-is-a-folder", R("{d}/prompts.jsonl"), ["out.jsonl", "is a folder"],
         out="out.jsonl", out_dir=True),
    # advantages
    Case("advantages-output-is-a-folder", ["advantages", "{d}/scored.jsonl", "-o", "{o}"],
         ["out.jsonl", "is a folder"], out="out.jsonl", out_dir=True),
    Case("advantages-truncated-last-line", ["advantages", "{d}/s-trunc.jsonl", "-o", "{o}"],
         ["s-trunc.jsonl:4", "not valid JSON", "truncated last line"]),
    Case("advantages-non-json-line", ["advantages", "{d}/s-nonjson.jsonl", "-o", "{o}"],
         ["s-nonjson.jsonl:2", "not valid JSON"]),
    Case("advantages-wrong-type", ["advantages", "{d}/s-type.jsonl", "-o", "{o}"],
         ["s-type.jsonl:3", "reward.total", "expected int or float, got str"]),
    Case("advantages-without-reward-total", ["advantages", "{d}/s-nototal.jsonl", "-o", "{o}"],
         ["s-nototal.jsonl:2", "reward.total", "missing"]),
    Case("advantages-unknown-version", ["advantages", "{d}/s-version.jsonl", "-o", "{o}"],
         ["s-version.jsonl:1", "v:", "schema version 7"]),
    Case("advantages-empty-input", ["advantages", "{d}/empty.jsonl", "-o", "{o}"],
         ["empty.jsonl", "empty input"]),
    Case("advantages-unknown-estimator",
         ["advantages", "{d}/scored.jsonl", "-o", "{o}", "--estimator", "ppo"],
         ["ppo", "bn-gspo", "dr-grpo", "grpo", "rloo"]),
    # reward
    Case("reward-missing-field", ["reward", "{d}/t-nogt.jsonl", "-o", "{o}"],
         ["t-nogt.jsonl:2", "answer_gt", "missing"]),
    Case("reward-wrong-type", ["reward", "{d}/t-type.jsonl", "-o", "{o}"],
         ["t-type.jsonl:2", "final_answer", "got int"]),
    Case("reward-unknown-judge", ["reward", "{d}/t-type.jsonl", "-o", "{o}", "--judge", "gpt"],
         ["--judge", "gpt", "exact", "openai:MODEL@URL"]),
    # eval
    Case("eval-missing-image", ["eval", "{d}/p-missing.jsonl", "-o", "{o}", "--policy", "{m}",
                                "--engine", "replay"],
         ["p-missing.jsonl:2", "image", "missing.png"]),
    Case("eval-decompression-bomb", ["eval", "{d}/p-bomb.jsonl", "-o", "{o}", "--policy", "{m}",
                                     "--engine", "replay"],
         ["p-bomb.jsonl:2", "image", "decompression bomb"]),
    Case("eval-unknown-format", ["eval", "{d}/prompts.jsonl", "-o", "{o}", "--policy", "{m}",
                                 "--engine", "replay", "--format", "mmlu"],
         ["--format", "mmlu", "mars", "vstar", "hrbench"]),
    Case("eval-unknown-judge", ["eval", "{d}/prompts.jsonl", "-o", "{o}", "--policy", "{m}",
                                "--engine", "replay", "--judge", "claude"],
         ["--judge", "claude", "exact", "openai:MODEL@URL"]),
    Case("eval-shard-3/2", ["eval", "{d}/prompts.jsonl", "-o", "{o}", "--policy", "{m}",
                            "--engine", "replay", "--shard", "3/2"], ["--shard", "3/2"]),
    # update: options, checkpoints, DeepSpeed config, rows
    Case("update-negative-lr", U("adv.jsonl", "--lr", "-1e-4"), ["--lr", "-0.0001", "out of range"],
         out="ckpt", out_dir=True),
    Case("update-unknown-loss", U("adv.jsonl", "--loss", "ppo"),
         ["loss", "ppo", "gspo", "grpo"], out="ckpt", out_dir=True),
    Case("update-invalid-deepspeed-section", U("adv.jsonl", "--deepspeed", "{d}/ds-optim.json"),
         ["--deepspeed", "ds-optim.json", "optimizer"], out="ckpt", out_dir=True),
    Case("update-invalid-deepspeed-json", U("adv.jsonl", "--deepspeed", "{d}/ds-broken.json"),
         ["--deepspeed", "ds-broken.json", "not valid JSON"], out="ckpt", out_dir=True),
    Case("update-checkpoint-without-config", U("adv.jsonl", policy="{d}/ckpt-noconfig"),
         ["--policy", "ckpt-noconfig", "config.json"], out="ckpt", out_dir=True),
    Case("update-truncated-safetensors", U("adv.jsonl", policy="{d}/ckpt-trunc"),
         ["--policy", "model.safetensors", "truncated"], out="ckpt", out_dir=True),
    Case("update-no-model-segment", U("a-nomodel.jsonl"),
         ["a-nomodel.jsonl:2", "segments", "no model segment"], out="ckpt", out_dir=True),
    Case("update-tokens-beyond-vocabulary", U("a-vocab.jsonl"),
         ["a-vocab.jsonl:2", "segments", "vocabulary"], out="ckpt", out_dir=True),
    Case("update-without-advantage", U("a-noadv.jsonl"),
         ["a-noadv.jsonl:2", "advantage", "missing"], out="ckpt", out_dir=True),
    # ask
    Case("ask-decompression-bomb", ["ask", "{d}/bomb.png", "What?", "--policy", "{m}"],
         ["bomb.png", "decompression bomb"], out=""),
]



def S(data, *a, policy="{m}"):
    return ["sft", f"{{d}}/{data}", "--policy", policy, "--out", "{o}", "--force", *a]


SFT_CASES = [
    Case("sft-negative-lr", S("adv.jsonl", "--lr", "-1"), ["--lr", "-1.0", "out of range"],
         out="ckpt", out_dir=True),
    Case("sft-zero-epochs", S("adv.jsonl", "--epochs", "0"), ["--epochs", "0"],
         out="ckpt", out_dir=True),
    Case("sft-unknown-schedule", S("adv.jsonl", "--lr-schedule", "step"),
         ["--lr-schedule", "step", "cosine", "constant", "linear"], out="ckpt", out_dir=True),
    Case("sft-empty-input", S("empty.jsonl"), ["empty.jsonl", "empty input"],
         out="ckpt", out_dir=True),
    Case("sft-truncated-last-line", S("s-trunc.jsonl"),
         ["s-trunc.jsonl:4", "not valid JSON", "truncated last line"], out="ckpt", out_dir=True),
    Case("sft-no-model-segment", S("a-nomodel.jsonl"), ["a-nomodel.jsonl:2"],
         out="ckpt", out_dir=True),
    Case("sft-tokens-beyond-vocabulary", S("a-vocab.jsonl"),
         ["a-vocab.jsonl:2", "segments", "vocabulary"], out="ckpt", out_dir=True),
    Case("sft-checkpoint-without-config", S("adv.jsonl", policy="{d}/ckpt-noconfig"),
         ["--policy", "ckpt-noconfig", "config.json"], out="ckpt", out_dir=True),
    Case("sft-truncated-safetensors", S("adv.jsonl", policy="{d}/ckpt-trunc"),
         ["--policy", "model.safetensors", "truncated"], out="ckpt", out_dir=True),
    Case("sft-invalid-deepspeed", S("adv.jsonl", "--deepspeed", "{d}/ds-optim.json"),
         ["--deepspeed", "ds-optim.json", "optimizer"], out="ckpt", out_dir=True),
]


def _prepare(case: Case, d: Path, m: Path, root: Path) -> tuple[list[str], Path, dict]:
    """The argv, the case's own folder, and what that folder held before the run."""
    folder = root / case.id.replace("/", "_")
    folder.mkdir()
    out = folder / case.out
    if case.out_dir:
        out.mkdir()
        (out / "keep.txt").write_bytes(b"an earlier checkpoint\n")
    elif case.out and case.earlier:
        out.write_bytes(b'{"v": 1, "id": "earlier#0"}\n')  # a record an earlier run wrote
    args = [a.format(d=d, m=m, o=out) for a in case.args]
    before = {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
              for p in folder.rglob("*")}
    return args, folder, before


@pytest.fixture(scope="module")
def results(data, tiny_model, tmp_path_factory):
    """Run every case; {id: ((exit code, stdout, stderr), folder, before)}."""
    root = tmp_path_factory.mktemp("cases")
    out = {}
    for case in CASES + SFT_CASES:
        args, folder, before = _prepare(case, data, tiny_model, root)
        out[case.id] = (invoke(args, folder), folder, before)
    return out


def check(case: Case, results: dict) -> None:
    (code, stdout, stderr), folder, before = results[case.id]
    where = f"{case.id}: exit {code}\nstderr:\n{stderr[-3000:]}"
    assert code == case.code, where
    assert stdout == "", where
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, where
    assert "Traceback" not in stderr, where
    for s in case.must:
        assert s in errors[0], f"{s!r} not in {errors[0]!r}"
    after = {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
             for p in folder.rglob("*")}
    assert after == before, f"{case.id}: the output folder changed: {sorted(after)}"


@pytest.mark.parametrize("case", CASES + SFT_CASES, ids=lambda c: c.id)
def test_bad_input(case, results):
    check(case, results)


BOUNDARY = ["rollout-truncated-last-line", "advantages-non-json-line", "reward-unknown-judge",
            "eval-missing-image", "update-negative-lr", "ask-decompression-bomb"]


def test_a_real_process_gives_the_same_answers(data, tiny_model, tmp_path):
    """A few cases again as `python -m marscli` subprocesses: the exit code and the one error
    line are those of the in-process runs (stderr also gets no traceback, stdout nothing)."""
    cases = [c for c in CASES if c.id in BOUNDARY]

    def run(case: Case):
        args, folder, before = _prepare(case, data, tiny_model, tmp_path)
        res = subprocess.run([sys.executable, "-m", "marscli", *args], capture_output=True,
                             text=True, env=ENV, timeout=300, check=False, cwd=folder)
        return case.id, ((res.returncode, res.stdout, res.stderr), folder, before)

    with ThreadPoolExecutor(2) as pool:
        results = dict(pool.map(run, cases))
    for case in cases:
        check(case, results)


def test_the_table_covers_every_stage():
    stages = {c.args[0] for c in CASES + SFT_CASES}
    assert {"rollout", "advantages", "reward", "eval", "update", "sft", "ask"} <= stages
    assert len(CASES + SFT_CASES) >= 25


def test_bomb_is_refused_from_its_header(data):
    """50,000 x 50,000 would need 7.5 GB decoded: refused before a pixel is read."""
    import resource
    import time

    from marscli.errors import BadInput
    from marscli.qwen.images import open_image

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(BadInput, match="decompression bomb"):
        open_image(data / "bomb.png")
    assert time.perf_counter() - t0 < 2.0  # refused before decoding
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 50_000  # KiB


# ----------------------------------------------------------------------------- model mistakes

ANSWER = "<thinking>Red.</thinking><answer>red</answer>"


def call(name: str, args: str) -> str:
    return f'<thinking>x</thinking><tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


MISTAKES = {  # prompt id -> (first reply, where it is counted)
    "bad-json": (('<thinking>x</thinking><tool_call>{"name": "image_zoom_in_tool", '
                 '"arguments": {"bbox_2d": [1, 2</tool_call>'), "format"),
    "unknown-tool": (call("teleport_tool", "{}"), "teleport_tool"),
    "wrong-type": (call("image_zoom_in_tool", '{"bbox_2d": "everywhere"}'), "image_zoom_in_tool"),
    "wrong-type-idx": (call("image_zoom_in_tool", '{"bbox_2d": [0, 0, 10, 10], "img_idx": "0"}'),
                       "image_zoom_in_tool"),
    "x1-over-x2": (call("image_zoom_in_tool", '{"bbox_2d": [600, 10, 300, 20]}'),
                   "image_zoom_in_tool"),
    "img-idx-out-of-range": (call("image_zoom_in_tool", '{"bbox_2d": [0, 0, 10, 10], '
                                                        '"img_idx": 7}'), "image_zoom_in_tool"),
    "unclosed-call": (('<thinking>x</thinking><tool_call>{"name": "image_zoom_in_tool", '
                      '"arguments": {"bbox_2d": [0, 0, 10, 10]}}'), "format"),
    "unclosed-thinking": ("<thinking>I will look at the corner and then", "format"),
}


def test_model_mistakes_are_observations_that_cost_the_format_reward(tiny_model, tmp_path):
    from marscli.stages.rollout import run_rollout

    ids = [*MISTAKES, "clean"]
    prompts = tmp_path / "p.jsonl"
    scene(tmp_path / "scene.png")
    write_jsonl(prompts, [prompt(i, replies=[MISTAKES[i][0], ANSWER] if i in MISTAKES else [ANSWER])
                    for i in ids])
    out = tmp_path / "t.jsonl"
    stats = run_rollout(str(prompts), str(out), policy=str(tiny_model), engine="replay", n=1,
                        max_turns=3, progress=False)
    recs = {r["prompt_id"]: r for r in read_jsonl(out)}
    assert set(recs) == set(ids)
    for pid, (_, counted) in MISTAKES.items():
        r = recs[pid]
        assert r["stop"] == "answer" and r["final_answer"] == "red" and r["turns"] == 2, pid
        tool = [s for s in r["segments"] if s["role"] == "tool"]
        assert len(tool) == 1 and tool[0]["ok"] is False and "failed" not in tool[0], pid
        assert tool[0]["text"].startswith("error: "), (pid, tool[0]["text"])
        if counted == "format":
            assert r["format_errors"] == 1 and not r["tool_errors"], pid
        else:
            assert r["tool_errors"] == {counted: 1} and r["format_errors"] == 0, pid
    assert recs["clean"]["turns"] == 1 and recs["clean"]["stop"] == "answer"
    assert orjson.loads(Path(f"{out}.meta.json").read_bytes())["stats"]["stop"] == {"answer": 9}
    assert stats["format_errors"] == 3
    assert stats["tool_errors"] == {"image_zoom_in_tool": 4, "teleport_tool": 1}

    scored = tmp_path / "s.jsonl"
    res = marscli("reward", str(out), "-o", str(scored), "--format-weight", "0.5")
    assert res.returncode == 0, res.stderr
    rewards = {r["prompt_id"]: r["reward"] for r in read_jsonl(scored)}
    assert rewards["clean"] == {"total": 1.5, "accuracy": 1.0, "format": 0.5, "judge": "exact"}
    for pid in MISTAKES:
        assert rewards[pid]["accuracy"] == 1.0 and rewards[pid]["format"] == 0.0, pid
