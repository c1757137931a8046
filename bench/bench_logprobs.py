"""The log-probs' chunks against the whole-batch path (train/logprobs.py): one training forward
and backward of the real-vocabulary tiny Qwen3-VL (`marscli tiny-model --vocab qwen`: 151,936
tokens, so the LM head's memory per token is the real one's) on one row of 2k, 4k and 8k loss
tokens, with the default chunk (1024) and without chunks. Each case runs in a child process of
its own; its memory is the child's peak RSS above its peak once the model is loaded (what the
micro-batch itself costs), its speed the loss tokens per second of the faster of the second
and third steps (the first warms up; the faster, as other load on the machine only slows one).
The last line:

    logprobs: peak_ratio_8k=X speed_ratio_8k=Y

X = whole-batch peak / chunked peak (goal ≥ 5), Y = chunked tokens/s / whole-batch tokens/s
(goal ≥ 0.9).

    python bench/bench_logprobs.py          # builds the model in a temporary folder
    MARSCLI_TINY_QWEN=PATH python bench/bench_logprobs.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = (2048, 4096, 8192)
PROMPT = 16  # tokens before the reply, outside the loss


def child(model: str, tokens: int, chunk: str) -> None:
    """One row of PROMPT + tokens ids: three forward+backward steps; prints
    `load_peak_kb step_peak_kb seconds` (the faster of the last two)."""
    import resource
    import time

    import torch

    from marscli.train.batch import Batch
    from marscli.train.distributed import Dist
    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import build_model

    torch.manual_seed(0)
    model_ = build_model(model, Dist(), optim=OptimConfig(lr=1e-6),
                         logp_chunk=None if chunk == "none" else "auto")
    n = PROMPT + tokens + 1
    ids = torch.randint(0, 150_000, (1, n))
    mask = torch.ones((1, n))
    mask[0, :PROMPT + 1] = 0
    b = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "mm_token_type_ids": torch.zeros_like(ids)}, mask, [])
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        logp = model_.logp(b, grad=True)
        (-(logp * b.loss_mask).sum()).backward()
        times.append(time.perf_counter() - t0)
        model_.module.zero_grad(set_to_none=True)
    seconds = min(times[1:])
    step_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(load_peak, step_peak, seconds)


def measure(model: str, tokens: int, chunk: str) -> tuple[float, float]:
    """(the micro-batch's peak MB, loss tokens/s)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, __file__, "--child", model, str(tokens), chunk],
                       capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise SystemExit(f"bench_logprobs: {tokens} tokens, chunk {chunk}: {r.stderr[-2000:]}")
    load_kb, peak_kb, seconds = r.stdout.split()
    return (int(peak_kb) - int(load_kb)) / 1024, tokens / float(seconds)


def main() -> int:
    model = os.environ.get("MARSCLI_TINY_QWEN")
    with tempfile.TemporaryDirectory() as tmp:
        if not model:
            from marscli.stages.tiny_model import main as tiny

            model = str(tiny(str(Path(tmp) / "qwen"), vocab="qwen"))
        print(f"{'loss tokens':>11} {'whole MB':>9} {'chunked MB':>10} {'peak ratio':>10} "
              f"{'whole tok/s':>11} {'chunked tok/s':>13} {'speed ratio':>11}")
        ratios = {}
        for tokens in SIZES:
            whole_mb, whole_tps = measure(model, tokens, "none")
            chunk_mb, chunk_tps = measure(model, tokens, "auto")
            ratios[tokens] = (whole_mb / max(chunk_mb, 1.0), chunk_tps / whole_tps)
            print(f"{tokens:>11} {whole_mb:>9.0f} {chunk_mb:>10.0f} {ratios[tokens][0]:>10.2f} "
                  f"{whole_tps:>11.0f} {chunk_tps:>13.0f} {ratios[tokens][1]:>11.2f}")
    peak, speed = ratios[8192]
    print(f"logprobs: peak_ratio_8k={peak:.2f} speed_ratio_8k={speed:.2f}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(main())
