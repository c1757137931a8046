"""Peak host memory (per rank) and seconds of saving and loading the training state: `update`
with DeepSpeed ZeRO-2 / ZeRO-3 + bf16, --keep-optimizer and a bf16 export (so the fp32 masters
and AdamW's moments are written beside it), on 1 process and on 2 ranks (torchrun, gloo).

    python bench/bench_masters.py --policy CKPT --adv A.jsonl --adv2 B.jsonl --out DIR \
        [--ranks 1 2] [--zero 2 3] [--src SRC_DIR]

Per case two runs: `update A` from CKPT writes OUT_A (the save is measured), `update B` from
OUT_A loads its state (the load is measured: building the model and loading AdamW's state).
Each rank measures itself: before a phase it resets its peak RSS (writing 5 to
/proc/self/clear_refs), after it reads VmHWM, so a phase's peak is its own, with what the
process held when it began included ("start"). --src runs another source tree (e.g. an older
marscli's src/) through the same hooks, to compare before and after. `--scale H L` first builds
a bigger random model from CKPT's config (text hidden H, L layers) so the weights dominate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

PHASES = {"build": "load", "load_optimizer": "load", "save": "save"}


def vm(field: str) -> float:
    """A /proc/self/status memory field, in MB."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) / 1024


# ------------------------------------------------------------------------------ in each rank


def worker(result: str, argv: list[str]) -> None:
    """Run `marscli ARGV` with Job.build / load_optimizer / save measured; write RESULT-rankR."""
    from marscli.train import job as job_mod

    rows: dict[str, dict] = {}
    overall = [0.0]

    def measured(name: str, fn):
        def wrapper(self, *a, **kw):
            overall[0] = max(overall[0], vm("VmHWM"))
            Path("/proc/self/clear_refs").write_text("5")
            start, t0 = vm("VmRSS"), time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                peak = vm("VmHWM")
                overall[0] = max(overall[0], peak)
                r = rows.setdefault(PHASES[name], {"start_mb": start, "peak_mb": 0.0,
                                                   "seconds": 0.0})
                r["peak_mb"] = max(r["peak_mb"], peak)
                r["seconds"] += time.perf_counter() - t0
        return wrapper

    for name in PHASES:
        setattr(job_mod.Job, name, measured(name, getattr(job_mod.Job, name)))
    sys.argv = ["marscli", *argv]
    from marscli.cli import main

    try:
        main()
    finally:
        rank = os.environ.get("RANK", "0")
        out = {k: {f: round(v, 2) for f, v in r.items()} for k, r in rows.items()}
        out["process_peak_mb"] = round(max(overall[0], vm("VmHWM")), 1)
        Path(f"{result}-rank{rank}.json").write_text(json.dumps(out))


# ------------------------------------------------------------------------------ the driver


def scaled_model(policy: Path, out: Path, hidden: int, layers: int) -> Path:
    """CKPT's model with a wider, deeper text tower (random weights, seed 0), float32."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    if (out / "config.json").is_file():
        return out
    cfg = AutoConfig.from_pretrained(policy)
    t = cfg.text_config
    t.hidden_size, t.intermediate_size, t.num_hidden_layers = hidden, 4 * hidden, layers
    t.num_attention_heads, t.num_key_value_heads = hidden // 64, max(1, hidden // 256)
    cfg.vision_config.out_hidden_size = hidden
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for f in policy.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return out


def launch(ranks: int, result: Path, argv: list[str], src: str | None) -> dict[int, dict]:
    port = str(20000 + os.getpid() % 20000)
    head = ([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(ranks),
             "--master_port", port] if ranks > 1 else [sys.executable])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MASTER_PORT": port}
    if src:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    t0 = time.perf_counter()
    r = subprocess.run([*head, __file__, "--worker", str(result), "--", *argv],
                       capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise SystemExit(f"failed ({ranks} ranks): {' '.join(argv)}\n{r.stderr[-3000:]}")
    out = {k: json.loads(Path(f"{result}-rank{k}.json").read_text()) for k in range(ranks)}
    out[-1] = {"wall_s": round(time.perf_counter() - t0, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--policy", type=Path)
    ap.add_argument("--adv", type=Path)
    ap.add_argument("--adv2", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--zero", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--src")
    ap.add_argument("--label", default="")
    ap.add_argument("--scale", type=int, nargs=2)
    args, rest = ap.parse_known_args()
    if args.worker:
        return worker(args.worker, rest[1:] if rest[:1] == ["--"] else rest)
    args.out.mkdir(parents=True, exist_ok=True)
    policy = args.policy
    if args.scale:
        policy = scaled_model(policy, args.out / f"model-{args.scale[0]}x{args.scale[1]}",
                              *args.scale)
    root = Path(__file__).resolve().parents[1]
    for zero in args.zero:
        cfg = json.loads((root / f"recipes/ds_zero{zero}.json").read_text())
        cfg["bf16"] = {"enabled": True}
        ds = args.out / f"ds_zero{zero}_bf16.json"
        ds.write_text(json.dumps(cfg))
        for ranks in args.ranks:
            tag = f"{args.label}z{zero}r{ranks}"
            a, b = args.out / f"{tag}-a", args.out / f"{tag}-b"
            common = ["--deepspeed", str(ds), "--lr", "1e-6", "--keep-optimizer", "--force"]
            save = launch(ranks, args.out / f"{tag}-save", [
                "update", str(args.adv), "--policy", str(policy), "--out", str(a),
                "--save-dtype", "bfloat16", *common], args.src)
            load = launch(ranks, args.out / f"{tag}-load", [
                "update", str(args.adv2), "--policy", str(a), "--out", str(b), *common],
                args.src)
            for r in range(ranks):
                s, lo = save[r]["save"], load[r]["load"]
                print(json.dumps({"case": tag, "rank": r,
                                  "save_peak_mb": s["peak_mb"], "save_start_mb": s["start_mb"],
                                  "save_s": s["seconds"], "load_peak_mb": lo["peak_mb"],
                                  "load_start_mb": lo["start_mb"], "load_s": lo["seconds"],
                                  "process_peak_mb": max(save[r]["process_peak_mb"],
                                                         load[r]["process_peak_mb"])}),
                      flush=True)


if __name__ == "__main__":
    main()
