"""`marscli plan POLICY_OR_CONFIG ...`: the memory a GPU needs for an RL iteration (the
trainer's `update`, the vLLM rollout engine), before any GPU hour is spent. The arithmetic is
train/memory.py's (its docstring has every formula); this module reads the model's
config.json, checks the options and prints the plan: a table on stdout, or JSON with --json.

Qwen3-VL-8B/32B-Instruct's config.json files ship as recipes/qwen3-vl-{8b,32b}.config.json
(docs/gpu.md "Memory plan, before the GPU hours" says where their values come from), so the
recipes can be planned without the weights: `make plan RECIPE=recipes/mars-8b.mk`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from marscli.configs import from_names
from marscli.errors import BadInput, check_range
from marscli.train.memory import (
    QWEN3_VL_MAX_PIXELS,
    STAGES,
    GiB,
    Options,
    Shape,
    Vision,
    plan,
)

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_text", "qwen3")
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


def _read_json(f: Path) -> Any:
    try:
        return json.loads(f.read_bytes())
    except json.JSONDecodeError as e:
        raise BadInput(f"{f}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise BadInput(f"{f}: not valid JSON (not UTF-8 text)") from None
    except OSError as e:
        raise BadInput(f"{f}: cannot read it ({e.strerror or e})") from None


def config_file(path: str) -> Path:
    """POLICY_OR_CONFIG → the config.json to read."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise BadInput(f"{p}: no config.json in this folder — give a checkpoint folder or "
                           "a config.json file")
        return p / "config.json"
    if not p.exists():
        raise BadInput(f"{path}: no such file or folder — give a checkpoint folder or a "
                       "config.json file (recipes/qwen3-vl-8b.config.json ships one)")
    return p


# The most a config's size may say (the default: _MAX): well above any Qwen3 / Qwen3-VL model
# (8B: hidden 4,096, vocabulary 151,936), low enough that a typo (a vocabulary of 1e30)
# is refused instead of counted into a 25-digit parameter count.
_MAX = 1 << 20
_MAX_OF = {"hidden_size": 1 << 16, "out_hidden_size": 1 << 16, "num_hidden_layers": 1024,
           "depth": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
           "num_heads": 1024, "head_dim": 1024, "vocab_size": 1 << 22, "patch_size": 1024,
           "temporal_patch_size": 64, "in_channels": 64, "spatial_merge_size": 64}


def _int(cfg: dict, key: str, f: Path, prefix: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise BadInput(f"{f}: {prefix}{key}: missing — plan reads Qwen3 / Qwen3-VL configs")
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise BadInput(f"{f}: {prefix}{key}: expected a positive integer, got {v!r}")
    if v > (hi := _MAX_OF.get(key, _MAX)):
        raise BadInput(f"{f}: {prefix}{key}: {v:,} is over {hi:,}, more than any Qwen3 / "
                       "Qwen3-VL model has — check the config")
    return v


def _kv_heads(text: dict, heads: int, f: Path, prefix: str) -> int:
    """num_key_value_heads as transformers reads it: absent is its class default (32), null
    is one a head (no GQA); a Qwen3 layer repeats each KV head heads / kv_heads times, so
    they must divide (transformers' num_key_value_groups)."""
    absent = "num_key_value_heads" not in text
    if text.get("num_key_value_heads", 0) is None:
        text = {**text, "num_key_value_heads": heads}
    kv = _int(text, "num_key_value_heads", f, prefix, 32)
    if heads % kv:
        raise BadInput(f"{f}: {prefix}num_key_value_heads: {kv}"
                       f"{' (absent: transformers default)' if absent else ''} does not divide "
                       f"num_attention_heads {heads} — grouped-query attention shares each KV "
                       "head among a whole number of query heads")
    return kv


def check_tp(s: Shape, tp: int, f: Path) -> None:
    """vLLM's own checks of a tensor-parallel size (ModelConfig.verify_with_parallel_config,
    the attention layers, the vision tower it shards too): refused here, not at engine start."""
    why = None
    if s.heads % tp:
        why = f"num_attention_heads {s.heads}"
    elif s.kv_heads % tp if s.kv_heads >= tp else tp % s.kv_heads:
        why = (f"num_key_value_heads {s.kv_heads} (vLLM splits KV heads evenly, or "
               "replicates them when fewer than --tp, a whole number of times)")
    elif s.vision and s.vision.heads % tp:
        why = f"vision_config.num_heads {s.vision.heads}"
    if why:
        raise BadInput(f"--tp {tp}: does not divide {f}'s {why} — vLLM refuses it; use a "
                       "--tp that does")


def _check_vision(v: Vision, f: Path) -> None:
    if v.hidden % v.heads:  # the vision attention's head width (transformers', vLLM's)
        raise BadInput(f"{f}: vision_config.num_heads: {v.heads} does not divide "
                       f"vision_config.hidden_size {v.hidden}")


def load_shape(path: str) -> tuple[Shape, Path]:
    """The model's shape from a checkpoint folder or a config.json (BadInput naming the file
    and field when it is unreadable, malformed or not a Qwen3 / Qwen3-VL dense model)."""
    f = config_file(path)
    cfg = _read_json(f)
    if not isinstance(cfg, dict):
        raise BadInput(f"{f}: expected a JSON object")
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise BadInput(f"{f}: model_type: {mt!r} is not a dense Qwen3 / Qwen3-VL model — plan "
                       f"counts {', '.join(MODEL_TYPES)}")
    text, tp = (cfg["text_config"], "text_config.") if "text_config" in cfg else (cfg, "")
    if not isinstance(text, dict):
        raise BadInput(f"{f}: text_config: expected a JSON object")
    heads = _int(text, "num_attention_heads", f, tp)
    hidden = _int(text, "hidden_size", f, tp)
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    vision = None
    if "vision_config" in cfg:
        v, vp = cfg["vision_config"], "vision_config."
        if not isinstance(v, dict):
            raise BadInput(f"{f}: vision_config: expected a JSON object")
        ds = v.get("deepstack_visual_indexes", [])
        if not isinstance(ds, list):
            raise BadInput(f"{f}: vision_config.deepstack_visual_indexes: expected a list")
        vision = Vision(
            hidden=_int(v, "hidden_size", f, vp), intermediate=_int(v, "intermediate_size", f, vp),
            depth=_int(v, "depth", f, vp), heads=_int(v, "num_heads", f, vp),
            patch=_int(v, "patch_size", f, vp),
            temporal_patch=_int(v, "temporal_patch_size", f, vp, 2),
            in_channels=_int(v, "in_channels", f, vp, 3),
            merge=_int(v, "spatial_merge_size", f, vp, 2),
            out_hidden=_int(v, "out_hidden_size", f, vp, hidden),
            positions=_int(v, "num_position_embeddings", f, vp),
            deepstack=len(ds), max_pixels=max_pixels(f.parent) if f.name == "config.json"
            else QWEN3_VL_MAX_PIXELS)
        _check_vision(vision, f)
    shape = Shape(
        hidden=hidden, layers=_int(text, "num_hidden_layers", f, tp), heads=heads,
        kv_heads=_kv_heads(text, heads, f, tp),
        # transformers' Qwen3 / Qwen3-VL default, not hidden / heads (Qwen3-8B: 4096 / 32)
        head_dim=_int(text, "head_dim", f, tp, 128),
        intermediate=_int(text, "intermediate_size", f, tp),
        vocab=_int(text, "vocab_size", f, tp), tied=bool(tied),
        attention_bias=bool(text.get("attention_bias", False)), vision=vision)
    return shape, f


def max_pixels(folder: Path) -> int:
    """The image processor's pixel budget (size.longest_edge) in a checkpoint folder, if it
    says; Qwen3-VL's default otherwise. Only config.json is required."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            doc = json.loads((folder / name).read_bytes())
        except (OSError, ValueError):
            continue
        ip = doc.get("image_processor", doc) if isinstance(doc, dict) else None
        size = ip.get("size") if isinstance(ip, dict) else None
        edge = size.get("longest_edge") if isinstance(size, dict) else None
        if isinstance(edge, int) and edge > 0:
            return edge
    return QWEN3_VL_MAX_PIXELS


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
    check_range("--tp", o.tp, 1, 1024)
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
        raise BadInput(f"--tp {o.tp}: more than the {o.ranks} GPUs the trainer uses — a "
                       "colocated engine runs on the trainer's GPUs")


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


def run_plan(policy: str, params: Mapping[str, Any], *, zero: int | None = None,
             deepspeed: str | None = None, gpu_memory: str = "80GiB",
             as_json: bool = False, check: bool = False) -> dict:
    """Read the model, resolve the options (`params`: a command's parameters, those named as
    memory.Options' fields taken), print the plan on stdout (a table, or JSON); returns it.
    check: a plan that does not fit is BadInput (exit 2), its reason in one line."""
    from dataclasses import replace

    if zero is not None and deepspeed is not None:
        raise BadInput("--zero and --deepspeed: give one (the file says its stage)")
    if zero is not None and zero not in (0, 2, 3):
        raise BadInput(f"--zero: {zero} — use 0 (update without --deepspeed), 2 or 3")
    o = from_names(Options, params, zero="torch" if zero == 0 else 3 if zero is None else zero,
                   gpu_memory=parse_size(gpu_memory))
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


# ------------------------------------------------------------------------------ the table


def _g(n: float) -> str:
    return f"{n / GiB:8.2f}"


def _stage(z: int | str) -> str:
    return "plain torch" if z == "torch" else f"ZeRO-{z}"


def render(p: dict) -> str:
    """The plan as a table, GiB per GPU."""
    i, m, t, e = p["inputs"], p["model"], p["trainer"], p["engine"]
    sp = t["activation_split"]
    lines = [f"plan: {i['config']}: {m['total'] / 1e9:.2f}B parameters (text "
             f"{m['text'] / 1e9:.2f}B, vision {m['vision'] / 1e9:.2f}B); "
             f"{i['nodes']} node(s) x {i['gpus_per_node']} GPUs of {i['gpu_memory'] / GiB:g} "
             f"GiB; {p['mode']}",
             f"{'per GPU':<60}{'GiB':>8}",
             f"trainer (update, {_stage(t['stage'])} over {i['ranks']} ranks"
             f"{', optimizer offloaded' if i['offload_optimizer'] else ''})"]
    rows: list[tuple[str, float | None]] = [("  model states", t["model_states"])]
    rows += [(f"    {k}", v) for k, v in t["model_state_parts"].items()]
    rows.append((f"  activations ({sp['tokens']:,} tokens: {sp['loss_tokens']:,} loss, "
                 f"{sp['image_tokens']:,} image)", t["activations"]))
    rows += [(f"    {k}", v) for k, v in t["activation_parts"].items()]
    shape = (f"one row of {sp['tokens']:,} tokens, alone" if sp["lone_row"] or not sp["row"]
             else f"rows of {sp['row']:,} tokens, padded")
    rows.append((f"    (at the {sp['peak_at']}; {shape}; C = --logp-chunk "
                 f"{sp['logp_chunk']:,})", None))
    if t["reference"]:
        rows.append(("  reference policy (--ref, scored before training)", t["reference"]))
    if t["buffers"]:
        rows.append(("  DeepSpeed buckets", t["buffers"]))
    rows.append(("  CUDA context (assumed)", t["context"]))
    lines += [f"{k:<60}{_g(v)}" if v is not None else k for k, v in rows]
    lines.append(f"{'  peak: ' + t['peak_phase']:<60}{_g(t['total'])}  of "
                 f"{p['trainer_budget'] / GiB:.2f}: "
                 f"{'fits' if p['trainer_fits'] else 'DOES NOT FIT'}")
    host = t["host_per_node"]
    lines.append("  host memory per node: " + ", ".join(
        f"{k} {v / GiB:.0f} GiB" for k, v in host.items() if v))
    lines.append(f"engine (vLLM, tensor parallel {i['tp']}, max_model_len {i['max_model_len']:,}, "
                 f"max_num_seqs {i['max_num_seqs']})")
    rows = [(f"  budget: gpu_memory_utilization {i['gpu_memory_utilization']}", e["total"]),
            ("    weights (bf16)", e["weights"])]
    rows += [(f"    {k}", v) for k, v in e["overhead_parts"].items() if v]
    rows.append((f"    KV cache: {e['kv_tokens']:,} tokens, {e['full_sequences']} x "
                 "max_model_len", e["kv_cache"]))
    lines += [f"{k:<60}{_g(v)}" for k, v in rows]
    lines.append(f"{'    (max_num_seqs x max_model_len would need)':<60}{_g(e['kv_needed'])}")
    u = p["max_gpu_memory_utilization"]
    lines.append(f"fits: {'yes' if p['fits'] else 'NO'} (trainer "
                 f"{'fits' if p['trainer_fits'] else 'does not fit'}, engine "
                 f"{'starts' if p['engine_fits'] else 'cannot hold one max_model_len sequence'})")
    lines.append("largest gpu_memory_utilization: "
                 + (f"{u:.2f}" if u is not None else "none")
                 + f" (smallest that starts: {p['min_gpu_memory_utilization']:.2f}; bound: "
                 f"{p['max_gpu_memory_utilization_basis']})")
    mm = p["max_micro_batch_tokens"]
    lines.append("largest --micro-batch-tokens: " + (f"{mm:,}" if mm else "none"))
    lines += _disk_lines(p["disk"], i["nodes"])
    lines += [f"note: {n}" for n in p["notes"]]
    return "\n".join(lines) + "\n"


def _disk_lines(d: dict, nodes: int) -> list[str]:
    """What an iteration writes and reads through the run folder on rank 0's node, in GB
    (10^9, as --disk-gbps counts), and the seconds each takes."""
    where = "rank 0's node" if nodes > 1 else "one node"
    head = f"disk per iteration ({where}; --disk-gbps {d['gbps']:g})"
    lines = [f"{head:<60}{'GB':>8}{'s':>6}"]

    def block(title: str, parts: dict, total: int, secs: float) -> None:
        lines.append(f"{'  ' + title:<60}{total / 1e9:8.2f}{secs:6.0f}")
        lines.extend(f"{'    ' + k:<60}{v / 1e9:8.2f}" for k, v in parts.items() if v)

    block("update writes", d["written"], d["write_bytes"], d["write_seconds"])
    block("the next update reads", d["read"], d["read_bytes"], d["read_seconds"])
    lines.append(f"{'  each engine reads the export when it starts':<60}"
                 f"{d['engine_read_bytes'] / 1e9:8.2f}{d['engine_read_seconds']:6.0f}")
    return lines
