"""The command-line boundary: help everywhere, no heavy imports at start-up, each stage's
config built from the command's options (every field an option), and `ask`'s exit codes,
messages and live trace."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from PIL import Image

from helpers import invoke, png_header

MARSCLI = [sys.executable, "-m", "marscli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*MARSCLI, *args], capture_output=True, text=True, env=ENV, cwd=cwd,
                          timeout=600)


def command_names() -> list[list[str]]:
    from marscli.cli import app

    names = [[c.name or c.callback.__name__.replace("_", "-")] for c in app.registered_commands]
    for group in app.registered_groups:
        names.append([group.name])  # eval's is also a command's (its callback)
        names += [[group.name, c.name or c.callback.__name__.replace("_", "-")]
                  for c in group.typer_instance.registered_commands]
    return names


def test_help_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom marscli.cli import app\n"
            "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('torch', 'transformers')))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("cmd", command_names(), ids=lambda c: " ".join(c))
def test_every_command_has_help(cmd):
    code = ("import sys\nfrom marscli.cli import app\n"
            f"try:\n    app({cmd + ['--help']!r})\nexcept SystemExit as e:\n    assert not e.code\n"
            "assert 'torch' not in sys.modules, 'help imported torch'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "Usage" in res.stdout


# ----------------------------------------------------------------------------- configs


def options_of(command) -> set[str]:
    return set(inspect.signature(command).parameters)


def test_every_config_field_is_an_option():
    """A command's config is built from its options by field name: a field of a config that a
    command names, without an option of its name, would silently keep its default."""
    from marscli import cli
    from marscli.agent.generation import GenerationOptions, JobOptions
    from marscli.engines import EngineOptions
    from marscli.train.config import SftConfig, UpdateConfig

    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    gen = names(GenerationOptions) - {"engine_opts", "search_opts"} | names(EngineOptions)
    for command in (cli.rollout, cli.eval_cmd):
        assert gen | names(JobOptions) <= options_of(command), command.__name__
    assert names(UpdateConfig) <= options_of(cli.update)
    assert names(SftConfig) <= options_of(cli.sft)


@pytest.mark.parametrize("stage, argv, expected", [
    ("update", ["--lr", "3e-4", "--kl", "0.1", "--ref", "r", "--keep-optimizer", "--agg",
                "token-mean", "--rollout-is", "off", "--deepspeed", "ds.json", "--seed", "7"],
     {"lr": 3e-4, "kl": 0.1, "ref": "r", "keep_optimizer": True, "agg": "token-mean",
      "rollout_is": "off", "deepspeed": "ds.json", "seed": 7}),
    ("sft", ["--epochs", "2", "--system-prompt", "s.txt", "--skip-bad", "--save-every-epoch",
             "--micro-batch-tokens", "99", "--track", "jsonl:t.jsonl"],
     {"epochs": 2, "system_prompt": "s.txt", "skip_bad": True, "save_every_epoch": True,
      "micro_batch_tokens": 99, "track": "jsonl:t.jsonl"}),
])
def test_training_configs_are_built_from_the_options(monkeypatch, stage, argv, expected):
    import importlib

    from marscli.train import config

    module = importlib.import_module(f"marscli.stages.{stage}")
    cls = {"update": config.UpdateConfig, "sft": config.SftConfig}[stage]
    seen = []
    monkeypatch.setattr(module, f"run_{stage}", lambda *a: seen.append(a))
    code, _, err = invoke([stage, "data.jsonl", "--policy", "p", "--out", "o", *argv])
    assert code == 0, err
    assert seen == [("data.jsonl", "p", "o", cls(**expected))]


def test_generation_options_derive_the_agent_config():
    from marscli.agent.generation import GenerationOptions
    from marscli.agent.loop import AgentConfig
    from marscli.engines import SamplingParams

    gen = GenerationOptions(temperature=0.7, top_p=0.9, top_k=5, presence_penalty=1.5, seed=3,
                            max_turns=None, max_turn_tokens=77, max_response_tokens=999,
                            batch_size=5, max_inflight=9, lockstep=True, system_prompt="f.txt")
    assert gen.agent_config("the prompt") == AgentConfig(
        max_turns=AgentConfig.max_turns, max_response_tokens=999, max_turn_tokens=77,
        system_prompt="the prompt", batch_size=5, max_inflight=9, lockstep=True,
        tool_schemas=None, sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5,
                                                   presence_penalty=1.5, max_new_tokens=77,
                                                   seed=3))
    assert gen.agent_config(None).max_turns == 10
    assert GenerationOptions(max_turns=4).agent_config(None).max_turns == 4


def test_judge_options_from_the_command_options():
    from marscli.errors import BadInput
    from marscli.scoring.judge import JudgeOptions, judge_options
    from marscli.scoring.judge_config import JudgeConfig

    cfg = JudgeConfig(judge_timeout=5.0, judge_retries=0, judge_concurrency=3,
                      judge_cache="j.sqlite")
    assert judge_options(cfg) == JudgeOptions(timeout_s=5.0, attempts=1, concurrency=3,
                                         cache_path="j.sqlite")
    with pytest.raises(BadInput, match=r"--judge-retries: -1 is out of range"):
        judge_options(JudgeConfig(judge_retries=-1))
    with pytest.raises(BadInput, match=r"--judge-concurrency: 0 is out of range"):
        JudgeOptions(concurrency=0).check()


@pytest.fixture()
def photo(tmp_path) -> Path:
    p = tmp_path / "photo.png"
    Image.new("RGB", (800, 600), (10, 120, 200)).save(p)
    return p


def test_ask_bad_inputs(tmp_path, photo, tiny_model):
    notimg = tmp_path / "notes.txt"
    notimg.write_text("hello")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    cases = [
        (["ask", str(tmp_path / "missing.jpg"), "q", "--policy", str(tiny_model)],
         "image not found"),
        (["ask", str(notimg), "q", "--policy", str(tiny_model)], "cannot be decoded"),
        (["ask", str(empty), "q", "--policy", str(tiny_model)], "cannot be decoded"),
        (["ask", str(tmp_path), "q", "--policy", str(tiny_model)], "is a folder"),
        (["ask", str(photo), "q", "--policy", str(tmp_path / "nope")], "no such checkpoint"),
        (["ask", str(photo), "q", "--policy", str(tmp_path)], "has no config.json"),
        (["ask", str(photo), "q", "--policy", str(tiny_model), "--system-prompt", "nope.txt"],
         "--system-prompt: nope.txt: no such file"),
        (["ask", str(photo), "q", "--policy", str(tiny_model), "--max-turns", "0"],
         "--max-turns: 0 is out of range"),
    ]
    for args, msg in cases:
        res = run(*args)
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode == 2, (args, res.stderr)
        assert len(lines) == 1 and msg in lines[0], (args, res.stderr)
        assert res.stdout == ""


def test_ask_decompression_bomb_refused_before_decoding(tmp_path, tiny_model):
    """A PNG header claiming 50,000 x 50,000 pixels is refused from the header alone."""
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_header(50_000, 50_000))
    res = run("ask", str(bomb), "q", "--policy", str(tiny_model))
    assert res.returncode == 2 and "decompression bomb" in res.stderr


@pytest.mark.parametrize("image, message", [
    ("https://example.com/cat.jpg", "URLs are not supported: download the image first"),
    ("HTTP://example.com/cat.jpg", "URLs are not supported: download the image first"),
    ("wide.png", "aspect ratio of 5000:1"),  # the processor takes 200:1 at most
])
def test_ask_url_and_extreme_aspect_are_one_line(tmp_path, tiny_model, image, message):
    Image.new("RGB", (50_000, 10), (10, 120, 200)).save(tmp_path / "wide.png")
    res = run("ask", image, "q", "--policy", str(tiny_model), cwd=tmp_path)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(lines) == 1 and message in lines[0], res.stderr


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_ask_trace_shows_what_the_trajectory_did(photo, tiny_model, tmp_path):
    """The live trace of a greedy run against the record of the same run (`--json`): one
    tool-response panel per tool segment, one format-error line per format error, and the
    answer on stdout (or the stop reason on stderr)."""
    args = ["ask", str(photo), "Where is the sign?", "--policy", str(tiny_model),
            "--max-turns", "3", "--max-turn-tokens", "16"]
    live = run(*args, "--crops-dir", str(tmp_path / "a"))
    assert live.returncode == 0, live.stderr
    rec = json.loads(run(*args, "--json", "--crops-dir", str(tmp_path / "b")).stdout)
    tools = [s for s in rec["segments"] if s["role"] == "tool"]
    assert live.stderr.count("tool response ·") == sum(s["tool"] != "invalid" for s in tools)
    assert live.stderr.count("format error:") == rec["format_errors"]
    if rec["final_answer"] is not None:
        assert live.stdout.strip() == rec["final_answer"].strip()
    else:
        assert f"stopped without an answer: {rec['stop']}" in live.stderr
        assert live.stdout.strip() == ""


@pytest.mark.slow  # measured: over 9 s on 2 cores
def test_ask_json_prints_the_trajectory_record(photo, tiny_model, tmp_path):
    res = run("ask", str(photo), "Where?", "--policy", str(tiny_model), "--json",
              "--max-turns", "1", "--max-turn-tokens", "8", "--crops-dir", str(tmp_path / "c"))
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout)
    assert rec["v"] == 1 and rec["id"] == "ask#0" and rec["segments"][0]["role"] == "prompt"
    assert rec["segments"][1]["role"] == "model" and len(rec["segments"][1]["tokens"]) <= 8
    assert rec["images"][0]["sha256"]
    assert all(Path(i["path"]).is_absolute() for i in rec["images"])  # a saved record finds them
