"""`marscli plan`'s table: the plan (`memory.plan`) in GiB per GPU, and the disk an
iteration writes and reads."""

from __future__ import annotations

from marscli.train.memory import GiB


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
