"""kill -9 at random moments, then the same command again: rollout, eval, update, sft, and one
`make rl-iter` of the tiny recipe. And SIGTERM and SIGINT to a rollout on a real model: it stops
within seconds and the same command again finishes it (`reward --follow`'s:
tests/cli/test_nothing_silently_wrong.py).

Each stage is killed (its whole process group, SIGKILL) in 5 seeded trials, at moments drawn
uniformly within the duration of an uninterrupted run of the same command, which is also the
reference. Trials chain: each starts the same command again on what the previous kill left.
After every kill the stage's input checkpoint is byte-identical and every checkpoint that exists
loads; after the final, uninterrupted re-run the result equals the reference (the same ids, no
duplicates; for update and sft the same weights, bit for bit on CPU) and no `*.tmp-*` file or
folder is left.

The four stages run as processes forked from a fork server (`Zygote`): one interpreter that has
imported torch, transformers and marscli, and forks a new session per command, which then runs
the CLI's `main` exactly as `python -m marscli` would. A kill hits a real process in the middle
of real work, and costs no 5-second interpreter start-up per trial. `make rl-iter` runs the
real Makefile, stage scripts and `marscli` executables; its kills land in seeded random stages.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from helpers import (
    MIXED,
    ZOOM_THEN_ANSWER,
    marscli,
    max_diff,
    read_jsonl,
    signal_after_first_record,
    strip_ms,
    varied_rows,
    weights,
    write_bench,
    write_jsonl,
    write_prompts,
)

ROOT = Path(__file__).resolve().parents[2]
TRIALS = 5
# One intra-op thread: on 2 shared cores, OpenMP's spinning threads slow a contended run
# tenfold; the reference and the trials run alike, so results still compare bit for bit.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}

_ZYGOTE = r"""
import json, os, signal, sys
# Imports only: no thread pool may start before a fork.
import torch, transformers  # noqa: F401
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: F401
import marscli.agent.loop, marscli.cli, marscli.engines.replay, marscli.stages.eval  # noqa: F401
import marscli.stages.rollout, marscli.train.trainer, marscli.stages.update  # noqa: F401
try:
    import marscli.stages.sft  # noqa: F401
except ImportError:
    pass
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(req["cwd"])
            sys.argv = ["marscli", *req["args"]]
            try:
                marscli.cli.main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            with open(req["log"] + ".code", "w") as fh:
                fh.write(str(code))
            os._exit(code)
    print(pid, flush=True)
"""


class Zygote:
    """A fork server for marscli commands (see the module docstring)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        assert self.proc.stdout.readline().strip() == "ready"
        self.n = 0

    def start(self, args: list[str], log: Path) -> int:
        self.n += 1
        req = {"args": [str(a) for a in args], "cwd": str(ROOT), "log": f"{log}.{self.n}"}
        Path(req["log"] + ".code").unlink(missing_ok=True)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        self.last_log = Path(req["log"])
        return int(self.proc.stdout.readline())

    def result(self) -> tuple[int | None, str]:
        code = Path(f"{self.last_log}.code")
        return (int(code.read_text()) if code.exists() else None,
                self.last_log.read_text() if self.last_log.exists() else "")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_dead(pid: int, timeout: float) -> bool:
    """True if the process ended within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    assert wait_dead(pid, 30)


def run_to_end(zyg: Zygote, args: list, log: Path) -> float:
    t0 = time.monotonic()
    pid = zyg.start(args, log)
    assert wait_dead(pid, 600)
    code, text = zyg.result()
    assert code == 0, text[-3000:]
    return time.monotonic() - t0


def kill_trials(zyg: Zygote, args: list, log: Path, duration: float, seed: int,
                after_kill, left=lambda: 1.0) -> list[float]:
    """TRIALS kills of the same command at seeded moments within its expected duration (that of
    the uninterrupted run, times `left()`, the fraction of the work a resumed run still has to
    do); `after_kill(i)` checks what each left. Returns the moments of the kills (a run that
    ends first is not killed)."""
    rng = random.Random(seed)
    moments = []
    for i in range(TRIALS):
        delay = rng.uniform(0.02, 1.0) * duration * max(left(), 0.2)
        pid = zyg.start(args, log)
        if not wait_dead(pid, delay):
            kill_group(pid)
            moments.append(round(delay, 2))
        after_kill(i)
    return moments


def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def no_tmp(root: Path) -> None:
    left = sorted(str(p) for p in root.rglob("*.tmp-*"))
    assert not left, left


def loads(ckpt: Path) -> dict:
    """A checkpoint folder that exists must load (config, weights, processor)."""
    from marscli.qwen.policy import load_model, load_processor

    load_processor(str(ckpt))
    load_model(str(ckpt))
    return weights(ckpt)


def ids_of(path: Path) -> list[str]:
    """Ids of the complete records (a torn last line, which the re-run cuts, is skipped)."""
    data = path.read_bytes() if path.exists() else b""
    return [orjson.loads(line)["id"] for line in data[: data.rfind(b"\n") + 1].splitlines()
            if line.strip()]


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


# ----------------------------------------------------------------------------- resumable


@pytest.mark.slow
def test_rollout_survives_kill_9(zygote, tiny_model, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"q{i:02d}" for i in range(12)],
                            replies=ZOOM_THEN_ANSWER)

    def args(out):
        return ["rollout", prompts, "-o", out, "--policy", tiny_model, "--engine", "replay",
                "-n", "4", "--batch-size", "4"]

    ref, out = tmp_path / "ref" / "t.jsonl", tmp_path / "run" / "t.jsonl"
    duration = run_to_end(zygote, args(ref), tmp_path / "log")

    def after_kill(i):
        got = ids_of(out)
        assert len(got) == len(set(got)), f"trial {i}: duplicates"

    moments = kill_trials(zygote, args(out), tmp_path / "log", duration, 1, after_kill,
                          left=lambda: 1 - len(ids_of(out)) / 48)
    assert len(moments) >= 3, moments
    run_to_end(zygote, args(out), tmp_path / "log")
    want = {r["id"]: strip_ms(r) for r in read_jsonl(ref)}
    got = read_jsonl(out)
    assert len(got) == len(want) == 48
    assert {r["id"]: strip_ms(r) for r in got} == want
    no_tmp(tmp_path)
    meta = orjson.loads(Path(f"{out}.meta.json").read_bytes())["stats"]
    assert meta["trajectories"] == 48


@pytest.mark.slow
def test_eval_survives_kill_9(zygote, tiny_model, tmp_path):
    bench = write_bench(tmp_path / "bench" / "b.jsonl", MIXED * 1)

    def args(out):
        return ["eval", bench, "-o", out, "--policy", tiny_model, "--engine", "replay",
                "--samples", "3", "--temperature", "0.5", "--max-turns", "4",
                "--batch-size", "2"]

    ref, out = tmp_path / "ref" / "r.jsonl", tmp_path / "run" / "r.jsonl"
    duration = run_to_end(zygote, args(ref), tmp_path / "log")

    def after_kill(i):
        got = ids_of(out)
        assert len(got) == len(set(got)), f"trial {i}: duplicates"

    moments = kill_trials(zygote, args(out), tmp_path / "log", duration, 2, after_kill,
                          left=lambda: 1 - len(ids_of(out)) / 18)
    assert len(moments) >= 3, moments
    run_to_end(zygote, args(out), tmp_path / "log")
    want = {r["id"]: strip_ms(r) for r in read_jsonl(ref)}
    assert len(want) == 18 and {r["id"]: strip_ms(r) for r in read_jsonl(out)} == want
    summary = orjson.loads((out.parent / "r.summary.json").read_bytes())
    ref_summary = orjson.loads((ref.parent / "r.summary.json").read_bytes())
    assert summary["benchmarks"] == ref_summary["benchmarks"]
    no_tmp(tmp_path)


# ----------------------------------------------------------------------------- signals


def hf_rollout(prompts: Path, policy: Path, out: Path) -> list[str]:
    """A real model (the hf engine on the tiny model), one trajectory at a time of 16 tokens:
    a record every fraction of a second, so that a signal lands mid-run."""
    return ["rollout", str(prompts), "-o", str(out), "--policy", str(policy), "--engine", "hf",
            "--device", "cpu", "-n", "2", "--batch-size", "1", "--max-turns", "1",
            "--max-turn-tokens", "16", "--seed", "3"]


@pytest.fixture(scope="module")
def hf_reference(tiny_model, tmp_path_factory) -> tuple[Path, dict]:
    """The prompts and the records of an uninterrupted run, by id (timings aside)."""
    d = tmp_path_factory.mktemp("signals")
    prompts = write_prompts(d / "p.jsonl", [f"q{i:02d}" for i in range(12)])
    res = marscli(*hf_rollout(prompts, tiny_model, d / "ref" / "t.jsonl"), timeout=300)
    assert res.returncode == 0, res.stderr
    return prompts, {r["id"]: strip_ms(r) for r in read_jsonl(d / "ref" / "t.jsonl")}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_rollout_stops_at_a_signal_and_the_rerun_equals_one_run(tiny_model, hf_reference,
                                                                 sig):
    """`kill PID` (a Slurm job cancelled, a pod stopped) or Ctrl-C mid-rollout: it ends within
    seconds, by the signal or with 128 + its number and no traceback, leaving no sidecar (make
    redoes it); the same command again finishes it, equal to a run never interrupted."""
    prompts, want = hf_reference
    out = prompts.parent / sig.name / "t.jsonl"  # beside the reference: the same image paths
    stopped = signal_after_first_record(hf_rollout(prompts, tiny_model, out), out, sig)
    assert stopped.code in (-sig, 128 + sig) and stopped.seconds < 20, stopped
    assert "Traceback" not in stopped.stderr, stopped.stderr
    assert 0 < stopped.lines < len(want) and not Path(f"{out}.meta.json").exists()
    res = marscli(*hf_rollout(prompts, tiny_model, out), timeout=300)
    assert res.returncode == 0, res.stderr
    got = read_jsonl(out)
    assert len(got) == len(want) and {r["id"]: strip_ms(r) for r in got} == want
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "t.jsonl", "t.jsonl.meta.json", "t.jsonl.settings.json"]  # no lock, no temporary


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_trials(zygote, tiny_model, tmp_path, stage_args, seed: int,
                      left=lambda out: 1.0) -> None:
    """Reference, kills, final run; the input checkpoint never changes; every checkpoint
    that exists loads; the result equals the reference bit for bit."""

    policy = tmp_path / "policy"
    shutil.copytree(tiny_model, policy)
    before = tree_hash(policy)
    ref, out = tmp_path / "ref" / "ckpt", tmp_path / "run" / "ckpt"
    duration = run_to_end(zygote, stage_args(policy, ref), tmp_path / "log")
    want = loads(ref)

    def after_kill(i):
        assert tree_hash(policy) == before, f"trial {i}: the input checkpoint changed"
        if out.exists():  # an earlier trial finished: the kill must not have touched it
            assert max_diff(loads(out), want) == 0.0, f"trial {i}"

    moments = kill_trials(zygote, stage_args(policy, out), tmp_path / "log", duration, seed,
                          after_kill, left=lambda: left(out))
    assert len(moments) >= 3, moments
    run_to_end(zygote, stage_args(policy, out), tmp_path / "log")
    assert tree_hash(policy) == before
    assert max_diff(loads(out), want) == 0.0
    no_tmp(tmp_path)


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory, tiny_model) -> Path:
    from marscli.qwen.policy import load_processor

    d = tmp_path_factory.mktemp("recovery-rows")
    return write_jsonl(d / "adv.jsonl", varied_rows(d, load_processor(str(tiny_model)), 2))


@pytest.mark.slow
def test_update_survives_kill_9(zygote, tiny_model, tmp_path, trajectories):
    def args(policy, out):
        return ["update", trajectories, "--policy", policy, "--out", out, "--force",
                "--epochs", "1", "--lr", "1e-3", "--micro-batch-tokens", "512",
                "--metrics", out.parent / "metrics.jsonl"]

    checkpoint_trials(zygote, tiny_model, tmp_path, args, 3)
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes().count(b"\n") == 2  # 2 minibatches


@pytest.mark.slow
def test_sft_survives_kill_9(zygote, tiny_model, tmp_path, trajectories):
    def args(policy, out):
        return ["sft", trajectories, "--policy", policy, "--out", out, "--force",
                "--epochs", "2", "--batch-size", "6", "--lr", "1e-3", "--save-every-epoch",
                "--max-tokens", "512", "--metrics", out.parent / "metrics.jsonl"]

    def left(out: Path) -> float:  # resumed after the last epoch saved
        state = out.with_name("ckpt.partial") / "state.json"
        return 1 - json.loads(state.read_text())["epoch"] / 2 if state.exists() else 1.0

    checkpoint_trials(zygote, tiny_model, tmp_path, args, 4, left)
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes().count(b"\n") == 2  # 2 epochs x 1 step
    assert not (tmp_path / "run" / "ckpt.partial").exists()


# ----------------------------------------------------------------------------- make rl-iter

RL_VARS = ["RECIPE=recipes/tiny.mk", "ITER=0", "PROMPTS_PER_ITER=4", "N=2", "MAX_TURNS=2",
           "MAX_TURN_TOKENS=8", ("WORLD_OPTS=--entities 5 --train 8 --test 4 --sft 8 --size 256 "
                                 "--kinds perception --seed 0"),
           "MODEL_OPTS=--size tiny --min-pixels 16384 --max-pixels 50176 --seed 0",
           "SFT_OPTS=--epochs 1 --lr 1e-3 --batch-size 4",
           "ADV_OPTS=--estimator bn-gspo --minibatches 2"]
# What the iteration builds, in order; a kill lands at a seeded moment after one of them.
MILESTONES = ["world/train.jsonl", "world/text.sqlite", "base/config.json",
              "sft/trajectories.jsonl", "ckpt-0/config.json", "iter-0/prompts.jsonl",
              "iter-0/rollouts.jsonl", "iter-0/rollouts.jsonl.meta.json",
              "iter-0/advantages.jsonl", "iter-0/metrics.jsonl"]


@pytest.mark.slow
def test_make_rl_iter_survives_kill_9(tmp_path):
    run = tmp_path / "run"
    cmd = ["make", "--no-print-directory", "rl-iter", f"RUN={run}", *RL_VARS]
    rng = random.Random(5)
    marks = sorted(rng.sample(range(len(MILESTONES) - 1), TRIALS))
    hashes: dict[str, dict] = {}  # checkpoints seen complete: they must never change
    kills = []
    for i, m in enumerate(marks):
        p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        target = run / MILESTONES[m]
        deadline = time.monotonic() + 300
        while not target.exists() and p.poll() is None:
            assert time.monotonic() < deadline, f"trial {i}: {target} never appeared"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 3.0))
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            kills.append(MILESTONES[m])
        p.wait()
        for name in ("base", "ckpt-0", "ckpt-1"):
            ckpt = run / name
            if (ckpt / "config.json").exists():
                h = tree_hash(ckpt)
                assert hashes.setdefault(name, h) == h, f"trial {i}: {name} changed"
    assert len(kills) >= 3, kills
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900,
                         check=False)
    assert res.returncode == 0, res.stderr[-4000:]

    it = run / "iter-0"
    prompts = [orjson.loads(x)["id"] for x in (it / "prompts.jsonl").read_bytes().splitlines()]
    want = sorted(f"{pid}#{k}" for pid in prompts for k in range(2))
    for name in ("rollouts", "scored", "advantages"):  # what an uninterrupted run gives
        assert sorted(r["id"] for r in read_jsonl(it / f"{name}.jsonl")) == want, name
    for name in ("base", "ckpt-0", "ckpt-1"):
        loads(run / name)
        if name in hashes:
            assert tree_hash(run / name) == hashes[name], name
    assert read_jsonl(it / "metrics.jsonl") and read_jsonl(run / "sft" / "metrics.jsonl")
    no_tmp(run)
