"""Rollout speed on the tiny model (CPU), measured in one run:

1. the hf engine generating one turn for 32 trajectories in one batch against the same 32
   requests one at a time (the ratio is what batching buys);
2. `run_rollout` end to end (agent loop, zoom tool, records appended): trajectories/s and
   generated tokens/s.

    python bench/bench_rollout.py [--model CKPT] [--batch 32] [--new-tokens 32]

Without `--model` (or `MARSCLI_TINY=CKPT`) a tiny model is built in a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import orjson
from PIL import Image, ImageDraw


def scene(path: Path) -> Path:
    im = Image.new("RGB", (448, 448), (40, 40, 40))
    ImageDraw.Draw(im).rectangle([224, 224, 447, 447], fill=(200, 30, 30))
    im.save(path)
    return path


def bench_engine(model: str, image: Path, batch: int, new_tokens: int) -> None:
    from marscli.agent.protocol import system_prompt
    from marscli.engines import GenRequest, SamplingParams, make_engine
    from marscli.qwen.tokens import encode_parts, image_features, prompt_parts, special_ids
    from marscli.tools.zoom import SCHEMA

    eng = make_engine("hf", model, max_batch=batch)
    tok = eng.processor.tokenizer
    feat = image_features(eng.processor, Image.open(image).convert("RGB"))
    toks = encode_parts(tok, special_ids(tok), prompt_parts(
        system_prompt([SCHEMA]), "What colour is the corner?", [feat.n_tokens]))
    reqs = [GenRequest(toks, [feat], new_tokens) for _ in range(batch)]
    # A random model rarely samples <|im_end|>: nearly every request runs to `new_tokens`,
    # so both sides do the same work (tokens/s below says so if not).
    params = SamplingParams(temperature=1.0, seed=0)
    eng.generate(reqs[:2], params)  # warm-up
    t = time.perf_counter()
    batched = eng.generate(reqs, params)
    t_batched = time.perf_counter() - t
    t = time.perf_counter()
    single = [eng.generate([r], params)[0] for r in reqs]
    t_single = time.perf_counter() - t
    n_b = sum(len(g.tokens) for g in batched)
    n_s = sum(len(g.tokens) for g in single)
    print(f"hf engine, {batch} requests x {new_tokens} new tokens, prompt {len(toks)} ids "
          f"({feat.n_tokens} image tokens)")
    print(f"  batched:        {t_batched:7.2f} s  {n_b / t_batched:8.1f} tokens/s")
    print(f"  one at a time:  {t_single:7.2f} s  {n_s / t_single:8.1f} tokens/s")
    print(f"  ratio (one at a time / batched): {t_single / t_batched:.2f}")
    print(f"rollout: batched_ratio={t_single / t_batched:.2f} (goal: at least 4)")


def bench_rollout(model: str, tmp: Path, prompts: int, n: int, new_tokens: int) -> None:
    from marscli.stages.rollout import run_rollout

    src = tmp / "prompts.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"v": 1, "id": f"q{i}", "image": "scene.png",
                                           "question": "What colour is the corner?"}) + b"\n"
                             for i in range(prompts)))
    stats = run_rollout(str(src), str(tmp / "traj.jsonl"), policy=model, n=n, max_turns=3,
                        max_turn_tokens=new_tokens, batch_size=32, progress=False)
    print(f"rollout, {prompts} prompts x {n} samples, up to 3 turns x {new_tokens} tokens:")
    print(f"  {stats['trajectories_per_s']:.2f} trajectories/s, "
          f"{stats['generated_tokens_per_s']:.0f} generated tokens/s, "
          f"mean response {stats['mean_response_tokens']} tokens, turns {stats['turns']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("MARSCLI_TINY"),
                    help="checkpoint (default: build a tiny one)")
    ap.add_argument("--batch", type=int, default=32, help="requests in the batched engine call")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per reply")
    ap.add_argument("--prompts", type=int, default=8, help="rollout: prompts")
    ap.add_argument("-n", type=int, default=4, help="rollout: samples per prompt")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = args.model
        if not model:
            from marscli.qwen.tiny import build_tiny_model

            model = str(build_tiny_model(tmp / "tiny", seed=0))
        image = scene(tmp / "scene.png")
        bench_engine(model, image, args.batch, args.new_tokens)
        bench_rollout(model, tmp, args.prompts, args.n, args.new_tokens)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
