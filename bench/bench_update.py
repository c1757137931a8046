"""Training throughput of `update`'s length-bucketed micro-batches against naive padded batches
(the same number of sequences per batch, in input order), on variable-length trajectories of
the tiny model, measured in the same run; prints tokens/s of each and the ratio.

Both arms run the same forward + backward + AdamW step (train.trainer.train_minibatch) over the
same trajectories with the same number of micro-batches; only the grouping differs, so the
ratio is the padding that bucketing does not compute.

    python bench/bench_update.py [--policy CKPT] [--n 32] [--budget 4096] [--repeat 2]
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path

from PIL import Image


def trajectories(folder: Path, proc, n: int, seed: int) -> list[dict]:
    """n rows: a prompt with one 64x64 image, then a model reply of 16 to 1,024 tokens
    (log-uniform: many short answers, a few long chains of thought)."""
    from marscli.qwen.images import open_image
    from marscli.qwen.tokens import encode_parts, image_features, prompt_parts, special_ids

    rng = random.Random(seed)
    tok = proc.tokenizer
    ids = special_ids(tok)
    img = folder / "img.png"
    Image.new("RGB", (64, 64), (90, 120, 200)).save(img)
    count = image_features(proc, open_image(img)).n_tokens
    prompt = encode_parts(tok, ids, prompt_parts("You are a visual agent.", "What is it?", [count]))
    rows = []
    for i in range(n):
        length = int(math.exp(rng.uniform(math.log(16), math.log(1024))))
        reply = [rng.randrange(100, 1000) for _ in range(length)] + [ids.im_end]
        rows.append({"v": 1, "id": f"b{i}", "advantage": rng.uniform(-1, 1),
                     "images": [{"path": img.name}],
                     "segments": [{"role": "prompt", "tokens": prompt, "images": [0]},
                                  {"role": "model", "tokens": reply}]})
    return rows


def run(model, groups, spec, lr: float = 1e-6) -> tuple[float, int]:
    """Seconds and real tokens for one minibatch trained over `groups` of examples."""
    from marscli.rl.losses import micro_weight
    from marscli.train.batch import collate
    from marscli.train.trainer import train_minibatch

    n_tok = sum(e.n_model_tokens for g in groups for e in g)
    n_seq = sum(len(g) for g in groups)

    def loss_fn(logp, b):
        loss = -(logp * b.loss_mask).sum() / b.loss_mask.sum()  # token-mean NLL
        return loss * micro_weight(b.loss_mask, "token-mean", n_tok, n_seq), {}

    t = time.perf_counter()
    _, _, tokens = train_minibatch(model, (collate(g, spec) for g in groups), len(groups),
                                   loss_fn, lr)
    return time.perf_counter() - t, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", help="checkpoint folder (default: a fresh tiny model)")
    ap.add_argument("--n", type=int, default=32, help="trajectories")
    ap.add_argument("--budget", type=int, default=4096, help="--micro-batch-tokens")
    ap.add_argument("--repeat", type=int, default=2, help="runs per arm; the best counts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from marscli.qwen.policy import load_processor
    from marscli.train.batch import Spec, load_example, plan
    from marscli.train.distributed import Dist, seed_everything
    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import build_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        policy = args.policy
        if policy is None:
            from marscli.qwen.tiny import build_tiny_model

            policy = str(build_tiny_model(folder / "tiny", seed=0))
        proc = load_processor(policy)
        spec = Spec.of(proc, policy)
        rows = trajectories(folder, proc, args.n, args.seed)
        exs = [load_example(r, "bench", i + 1, folder, spec) for i, r in enumerate(rows)]
        seed_everything(args.seed)
        model = build_model(policy, Dist(), optim=OptimConfig(lr=1e-6))
        bucketed = [m.examples for m in plan(exs, 0, 1, args.budget)]
        per = math.ceil(len(exs) / len(bucketed))  # same number of micro-batches, input order
        naive = [exs[i:i + per] for i in range(0, len(exs), per)]
        run(model, naive[:1], spec)  # warm-up
        results = {}
        for name, groups in (("bucketed", bucketed), ("naive", naive)):
            best = min(run(model, groups, spec) for _ in range(args.repeat))
            padded = sum(max(len(e) for e in g) * len(g) for g in groups)
            results[name] = (best[1] / best[0], padded, len(groups))
    real = sum(len(e) for e in exs)
    for name, (tps, padded, k) in results.items():
        print(f"{name:9s} {k:3d} micro-batches, {padded:7d} padded tokens for {real} real: "
              f"{tps:8.0f} tokens/s")
    ratio = results["bucketed"][0] / results["naive"][0]
    print(f"ratio (bucketed / naive tokens/s): {ratio:.2f}")
    print(f"update: bucketed_ratio={ratio:.2f} (goal: at least 1.5)")


if __name__ == "__main__":
    main()
