"""`marscli plan POLICY_OR_CONFIG ...`: the memory a GPU needs for an RL iteration (the
trainer's `update`, the vLLM rollout engine), before any GPU hour is spent. The arithmetic is
train/memory.py's (its docstring has every formula), train/shape.py reads the model's
config.json and train/plan_table.py draws the table; this module checks the options and prints
the plan: a table on stdout, or JSON with --json.

Qwen3-VL-8B/32B-Instruct's config.json files ship as recipes/qwen3-vl-{8b,32b}.config.json
(docs/gpu.md "Memory plan, before the GPU hours" says where their values come from), so the
recipes can be planned without the weights: `make plan RECIPE=recipes/mars-8b.mk`.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from marscli.configs import from_names
from marscli.errors import BadInput, check_range
from marscli.train.config import PlanConfig
from marscli.train.memory import STAGES, GiB, Options, plan
from marscli.train.plan_table import render
from marscli.train.shape import check_tp, load_shape

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, option: str = "--gpu-memory") -> int:
    """`80GiB`, `141GB`, `81559MiB` → bytes (GB = 10^9, GiB = 2^30)."""
    m = _SIZE.match(text)
    if not m:
        raise BadInput(f"{option}: {text!r} is not a size — give a number and a unit, e.g. "
                       "80GiB or 141GB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise BadInput(f"{option}: {text!r} must be more than 0")
    return n


def zero_from_deepspeed(path: str, hidden: int) -> dict[str, Any]:
    """Stage, offload and buckets from a DeepSpeed JSON config (as update resolves it)."""
    from marscli.train.dsconfig import bf16_enabled, load_ds_config, zero_stage

    cfg = load_ds_config(path, grad_clip=1.0, bf16=True, hidden_size=hidden)
    if not bf16_enabled(cfg):
        raise BadInput(f"--deepspeed: {path}: bf16.enabled: false — plan counts DeepSpeed's "
                       "bf16 training, what update runs on GPUs (\"auto\")")
    z = cfg["zero_optimization"]

    def offloaded(key: str) -> bool:
        return isinstance(z.get(key), dict) and z[key].get("device") in ("cpu", "nvme")

    keys = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")
    return {"zero": zero_stage(cfg), "offload_optimizer": offloaded("offload_optimizer"),
            "offload_params": offloaded("offload_param"), "overlap_comm": bool(
                z.get("overlap_comm", zero_stage(cfg) == 3)),
            "buckets": {k: int(z[k]) for k in keys if isinstance(z.get(k), (int, float))}}


def check_options(o: Options) -> None:
    check_range("--gpus-per-node", o.gpus_per_node, 1, 1024)
    check_range("--nodes", o.nodes, 1, 100_000)
    check_range("--tensor-parallel", o.tp, 1, 1024)
    check_range("--max-model-len", o.max_model_len, 1)
    check_range("--max-num-seqs", o.max_num_seqs, 1)
    check_range("--gpu-memory-utilization", o.gpu_memory_utilization, 0, 1, lo_open=True)
    check_range("--micro-batch-tokens", o.micro_batch_tokens, 1)
    check_range("--loss-tokens", o.loss_tokens, 0, o.micro_batch_tokens)
    check_range("--image-tokens", o.image_tokens, 0, o.micro_batch_tokens)
    check_range("--logp-chunk", o.logp_chunk, 1, o.micro_batch_tokens)  # as update checks it
    check_range("--disk-gbps", o.disk_gbps, 0, lo_open=True)
    if o.loss_tokens is not None and o.image_tokens is not None \
            and o.loss_tokens + o.image_tokens > o.micro_batch_tokens:
        raise BadInput(f"--loss-tokens {o.loss_tokens} and --image-tokens {o.image_tokens}: "
                       f"more than --micro-batch-tokens {o.micro_batch_tokens} together")
    if o.zero not in STAGES:
        raise BadInput(f"--zero: {o.zero!r} is not a ZeRO stage — use 0 (plain torch), 2 or 3")
    if (o.offload_optimizer or o.offload_params) and o.zero not in (2, 3):
        raise BadInput("--offload-optimizer: DeepSpeed offloads with ZeRO-2 or 3 — add "
                       "--zero 2 or --zero 3")
    if o.offload_params and o.zero != 3:
        raise BadInput("offload_param: only ZeRO-3 offloads parameters")
    if o.sleep_level not in (0, 1, 2):
        raise BadInput(f"--sleep-level: {o.sleep_level} — use 0 (awake), 1 or 2")
    if o.sleep_level and not o.colocate:
        raise BadInput("--sleep-level: only with --colocate (the engine sleeps on the "
                       "trainer's GPUs)")
    if o.tp > o.ranks and o.colocate:
        raise BadInput(f"--tensor-parallel {o.tp}: more than the {o.ranks} GPUs the trainer "
                       "uses — a colocated engine runs on the trainer's GPUs")


def why_not(p: dict) -> str | None:
    """Why the plan does not fit, in a phrase (None when it fits): what `plan --check` and
    make's refusal of a launch say."""
    if p["fits"]:
        return None
    i, t = p["inputs"], p["trainer"]
    why = []
    if not p["trainer_fits"]:
        why.append(f"the trainer's peak ({t['peak_phase']}) is {t['total'] / GiB:.1f} GiB a GPU, "
                   f"over its budget of {p['trainer_budget'] / GiB:.1f} GiB")
    if not p["engine_fits"]:
        why.append(f"the engine (tensor parallel {i['tp']}, gpu_memory_utilization "
                   f"{i['gpu_memory_utilization']}) cannot hold one sequence of "
                   f"{i['max_model_len']:,} tokens")
    return "; ".join(why) or "the trainer and the engine do not fit together"


def run_plan(policy: str, cfg: PlanConfig, *, as_json: bool = False,
             check: bool = False) -> dict:
    """Read the model, resolve the options (`cfg`, as memory.Options), print the plan on stdout
    (a table, or JSON); returns it. check: a plan that does not fit is BadInput (exit 2), its
    reason in one line."""
    from dataclasses import replace

    zero, deepspeed = cfg.zero, cfg.deepspeed
    if zero is not None and deepspeed is not None:
        raise BadInput("--zero and --deepspeed: give one (the file says its stage)")
    if zero is not None and zero not in (0, 2, 3):
        raise BadInput(f"--zero: {zero} — use 0 (update without --deepspeed), 2 or 3")
    o = from_names(Options, cfg, zero="torch" if zero == 0 else 3 if zero is None else zero,
                   tp=cfg.tensor_parallel, gpu_memory=parse_size(cfg.gpu_memory))
    shape, f = load_shape(policy)
    if deepspeed is not None:
        o = replace(o, **zero_from_deepspeed(deepspeed, shape.hidden))
    check_options(o)
    check_tp(shape, o.tp, f)
    p = plan(shape, o)
    p["inputs"] = {"config": str(f), "deepspeed": deepspeed, **p["inputs"]}
    if as_json:
        sys.stdout.write(json.dumps(p, indent=1) + "\n")
    else:
        sys.stdout.write(render(p))
    if check and (why := why_not(p)):
        raise BadInput(f"does not fit: {why} — the table above (without --check) shows each "
                       "part; change the launch shape or the options")
    return p
