"""The same GRPO step in TRL and in marscli, measured in one run (`make peers-venv` first):
the demo's tiny Qwen3-VL (recipes/tiny-vlm), P toy-world prompts with their images, G samples
each at temperature 1 (at most 64 new tokens), one AdamW step over the whole batch.

1. TRL's `GRPOTrainer` on CPU (two steps: the first warms up, the second is timed).
2. marscli with its engine kept warm: the hf engine and the trainer loaded once in this
   process; rollout (the agent), reward, advantages and update's own step functions.
3. marscli as `make rl-iter` runs it: one process per stage (`marscli rollout`, `reward`,
   `advantages`, `update`), start-up and loading included.

Training throughput is compared on the same batch: TRL's timed step's sequences (prompt and
completion tokens, its advantages) also go through update's step (length-bucketed
micro-batches) here, so both sides compute the same tokens; TRL's update time is its step's
time less its generation and scoring. Generation tokens/s: each side's own rollout (marscli's
includes the agent's parsing and the zoom tool call it makes).

Equivalence, checked before the timings are trusted (`equivalence_failures`):
- prompts: TRL's prompt ids (its chat template over the same system prompt, question and
  image) equal marscli's (tokens.prompt_parts);
- advantages: TRL's (`scale_rewards="none"`) equal marscli's `dr-grpo` on TRL's rewards;
- loss: on TRL's first micro-batch with non-trivial advantages, TRL's `_compute_loss`
  (`loss_type="grpo"`, `importance_sampling_level="sequence"` = GSPO, beta 0, epsilon 0.2 /
  0.28) and marscli's `gspo` loss (seq-mean-token-mean, the same clip) give the same value
  and the same gradient, from two fresh copies of the model.
What TRL cannot express, so the step compared is single-turn (`--max-turns 1`): marscli's
zoom tool loop (TRL 1.16's `tools=` parses calls through the chat template's own tool format
and has no image-cropping tool), and BN-GSPO's batch normalisation of the group advantages
(`scale_rewards="batch"` divides by the std of the rewards, not of the group-normalised
advantages); and TRL's group std has a fixed epsilon of 1e-4 (marscli's grpo: 1e-6), hence
the unscaled estimator on both sides. On the demo's model every sample calls the zoom tool
first, so the single-turn rewards are 0; the equivalence check uses its own advantages.

    .venv-peers/bin/python bench/bench_peers.py [--prompts 16] [-n 8] [--skip-processes]

The last line: `peers: train_tokens_per_s_ratio=X generation_tokens_per_s_ratio=Y
step_time_ratio_warm=Z step_time_ratio_processes=W` (marscli over TRL).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLICY = str(REPO / "recipes" / "tiny-vlm")
SYSTEM = REPO / "recipes" / "toy-system.txt"
LR, CLIP_LOW, CLIP_HIGH, GRAD_CLIP = 1e-4, 0.2, 0.28, 1.0
TOL = {"advantages": 1e-6, "loss": 1e-5, "grad": 1e-3}


# ------------------------------------------------------------------------------ the check


def equivalence_failures(trl: dict, ours: dict, tol: dict | None = None) -> list[str]:
    """What differs between the two sides' step (empty: the same work). Each side gives
    `prompt_ids` (lists of ints), `advantages` [N], `loss` (first micro-batch) and `grad` (a
    flat list, the gradient of that loss)."""
    tol = {**TOL, **(tol or {})}
    out = []
    if trl["prompt_ids"] != ours["prompt_ids"]:
        bad = next(i for i, (a, b) in enumerate(zip(trl["prompt_ids"], ours["prompt_ids"]))
                   if a != b) if len(trl["prompt_ids"]) == len(ours["prompt_ids"]) else "count"
        out.append(f"prompt ids differ (first at prompt {bad})")
    a, b = trl["advantages"], ours["advantages"]
    if len(a) != len(b):
        out.append(f"advantages: {len(a)} vs {len(b)} rows")
    elif (d := max((abs(x - y) for x, y in zip(a, b)), default=0.0)) > tol["advantages"]:
        out.append(f"advantages differ by up to {d:.3g} (tolerance {tol['advantages']})")
    if not abs(trl["loss"] - ours["loss"]) <= tol["loss"] * max(1.0, abs(trl["loss"])):
        out.append(f"first micro-batch loss {trl['loss']:.7g} vs {ours['loss']:.7g}")
    g1, g2 = trl["grad"], ours["grad"]
    norm = math.sqrt(sum(x * x for x in g1))
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(g1, g2))) if len(g1) == len(g2) else math.inf
    if not diff <= tol["grad"] * max(norm, 1e-12):
        out.append(f"gradients differ: |g_trl - g_ours| = {diff:.3g}, |g_trl| = {norm:.3g}")
    return out


# ------------------------------------------------------------------------------ set-up


def world(tmp: Path, prompts: int) -> Path:
    """The demo's toy world (recipes/tiny-sees.mk's options), `prompts` training rows."""
    subprocess.run([sys.executable, "-m", "marscli", "toy-world", str(tmp / "world"),
                    "--entities", "8", "--grid", "4", "--zoom-cells", "2", "--clutter", "0",
                    "--direct", "0.7", "--kinds", "perception", "--train", str(prompts),
                    "--test", "1", "--sft", "1", "--seed", "0", "--force"],
                   check=True, capture_output=True)
    return tmp / "world" / "train.jsonl"


class Setup:
    """What both sides share: prompts, images as the model sees them, the system prompt."""

    def __init__(self, prompts_file: Path, n: int, new_tokens: int) -> None:
        from marscli.agent.protocol import read_system_prompt, system_prompt
        from marscli.qwen.images import open_image
        from marscli.qwen.policy import load_processor
        from marscli.qwen.tokens import model_image, never_sampled, special_ids
        from marscli.records.schema import load_prompts
        from marscli.tools.zoom import SCHEMA

        self.file, self.n, self.new_tokens = prompts_file, n, new_tokens
        self.prompts = load_prompts(str(prompts_file))
        self.processor = load_processor(POLICY)
        self.ids = special_ids(self.processor.tokenizer)
        self.system = system_prompt([SCHEMA], read_system_prompt(str(SYSTEM)))
        self.images = [model_image(self.processor, open_image(p.image_paths()[0]))
                       for p in self.prompts]
        import json

        vocab = json.loads((Path(POLICY) / "config.json").read_text())["text_config"]
        self.banned = never_sampled(self.ids, len(self.processor.tokenizer), vocab["vocab_size"])

    def marscli_prompt_ids(self, i: int) -> list[int]:
        from marscli.qwen.tokens import encode_parts, expand, image_features, prompt_parts

        feat = image_features(self.processor, self.images[i])
        parts = prompt_parts(self.system, self.prompts[i].question, [feat.n_tokens])
        return expand(encode_parts(self.processor.tokenizer, self.ids, parts), self.ids.image_pad)


def load_lm():
    from marscli.qwen.policy import load_model

    return load_model(POLICY, device="cpu", dtype="float32")


# ------------------------------------------------------------------------------ TRL


class Timed:
    """Wrap `obj.name`: each call's wall time in `times`, its (args, result) in `calls`."""

    def __init__(self, obj, name: str) -> None:
        self.times: list[float] = []
        self.calls: list[tuple] = []
        fn = getattr(obj, name)

        def wrapped(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            self.times.append(time.perf_counter() - t)
            self.calls.append((a, out))
            return out

        setattr(obj, name, wrapped)


def run_trl(setup: Setup, tmp: Path, micro: int) -> dict:
    """Two TRL steps (the first warms up); the second's times, and what the check needs."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from marscli.agent.protocol import Answer, parse_turn
    from marscli.scoring.answers import score_answer

    rows = [{"prompt": [{"role": "system", "content": setup.system},
                        {"role": "user", "content": p.question}],
             "image": img, "gold": p.answer} for p, img in zip(setup.prompts, setup.images)]
    batch = len(rows) * setup.n
    rewards: list[list[float]] = []

    def accuracy(completions, gold, **_):
        """marscli's reward (exact match, format weight 0) of a single-turn reply."""
        out = []
        for c, g in zip(completions, gold):
            act = parse_turn(c[0]["content"] if isinstance(c, list) else c)
            out.append(score_answer(act.text, g, None) if isinstance(act, Answer) else 0.0)
        rewards.append(out)
        return out

    args = GRPOConfig(
        output_dir=str(tmp / "trl"), use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=2, seed=0, learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=GRAD_CLIP, per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, steps_per_generation=batch // micro,
        num_generations=setup.n, max_completion_length=setup.new_tokens, temperature=1.0,
        top_p=1.0, top_k=0, loss_type="grpo", importance_sampling_level="sequence",
        scale_rewards="none", beta=0.0, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH,
        shuffle_dataset=False, generation_kwargs={"suppress_tokens": setup.banned},
        gradient_checkpointing=False, bf16=False, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=load_lm(), reward_funcs=accuracy, args=args,
                          train_dataset=Dataset.from_list(rows),
                          processing_class=setup.processor)
    gen = Timed(trainer, "_generate")
    score = Timed(trainer, "_generate_and_score_completions")
    loss = Timed(trainer, "_compute_loss")
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    t0 = time.perf_counter()
    trainer.train()
    step = ends[1] - ends[0]
    timed = score.calls[1][1]
    comp = timed["completion_mask"]
    return {"trainer": trainer, "first": score.calls[0][1], "timed": timed,
            "rewards": rewards[0], "first_inputs": loss.calls[0][0][1],
            "first_loss": float(loss.calls[0][1].detach()) * (batch // micro),
            "step_s": step, "gen_s": gen.times[1], "update_s": step - score.times[1],
            "gen_tokens": int(comp.sum()), "train_tokens": int(timed["prompt_mask"].sum()
                                                                + comp.sum()),
            "warmup_s": ends[0] - t0}


# ------------------------------------------------------------------------------ marscli


def trl_examples(setup: Setup, out: dict) -> list:
    """TRL's batch as update's examples: the same tokens, images and advantages. Each row's
    image is found by its pixels (TRL shuffles a generation batch before cutting it into
    micro-batches, and prompts that differ only in their image have the same ids)."""
    from marscli.train.batch import FEATURES, Example

    files = [p.image_paths()[0] for p in setup.prompts]
    feats = [FEATURES.get(setup.processor, f).pixel_values for f in files]
    rows = out["image_grid_thw"].prod(-1).tolist()
    starts = [sum(rows[:i]) for i in range(len(rows))]
    exs = []
    for i in range(out["prompt_ids"].shape[0]):
        p = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
        c = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
        pix = out["pixel_values"][starts[i]:starts[i] + rows[i]]
        k = next(k for k, f in enumerate(feats) if f.shape == pix.shape and bool((f == pix).all()))
        exs.append(Example(src="trl", line=i + 1, input_ids=p + c,
                           loss_mask=[0] * len(p) + [1] * len(c), images=[files[k]],
                           engine_logprobs=[None] * (len(p) + len(c)),
                           advantage=float(out["advantages"][i]), index=i))
    return exs


class Warm:
    """marscli in one process: the hf engine and the trainer loaded once."""

    def __init__(self, setup: Setup, tmp: Path, budget: int) -> None:
        from marscli.agent.protocol import read_system_prompt
        from marscli.engines import make_engine
        from marscli.stages.update import UpdateConfig
        from marscli.train.batch import Spec
        from marscli.train.job import Job

        self.setup, self.tmp = setup, tmp
        self.batch = len(setup.prompts) * setup.n
        self.base = read_system_prompt(str(SYSTEM))
        self.engine = make_engine("hf", POLICY, device="cpu", max_batch=self.batch)
        self.engine_time = Timed(self.engine, "generate")  # the engine alone, as TRL's _generate
        self.cfg = UpdateConfig(loss="gspo", lr=LR, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                                grad_clip=GRAD_CLIP, old_logp="engine", micro_batch_tokens=budget,
                                device="cpu")
        self.job = Job("update", str(tmp / "warm-out"), self.cfg, None, [], time.time())
        self.model = self.job.build(POLICY, optim=self.cfg.optim())
        self.spec = Spec.of(setup.processor, POLICY)

    def rollout(self, seed: int) -> list[dict]:
        from marscli.agent.loop import Agent, AgentConfig
        from marscli.engines import SamplingParams
        from marscli.tools import build_tools

        s = self.setup
        cfg = AgentConfig(max_turns=1, max_turn_tokens=s.new_tokens, max_response_tokens=4096,
                          system_prompt=self.base, batch_size=self.batch,
                          sampling=SamplingParams(temperature=1.0, max_new_tokens=s.new_tokens,
                                                  seed=seed))
        agent = Agent(self.engine, build_tools(), cfg, media_dir=self.tmp / f"media-{seed}",
                      rel_to=self.tmp)
        return list(agent.run([(p, k) for p in s.prompts for k in range(s.n)]))

    def train(self, examples: list, old: str) -> tuple[float, int]:
        """update's step over `examples` (π_old: the engine's, or recomputed before the clock
        starts); returns its seconds and real tokens."""
        from dataclasses import replace

        from marscli.rl.losses import LOSSES
        from marscli.train.update import old_logps, train_step

        cfg = replace(self.cfg, old_logp=old, rollout_is="off")
        mb = self.job.minibatch(examples, cfg.micro_batch_tokens)
        logps, _ = old_logps(self.model, {0: mb}, self.spec, self.job.dist, cfg, examples)
        t = time.perf_counter()
        row, _ = train_step(self.job, self.model, mb, self.spec, cfg, "seq-mean-token-mean",
                       LOSSES.get("gspo"), LR, logps, {})
        return time.perf_counter() - t, row["tokens"]

    def step(self, seed: int) -> dict:
        """rollout → reward → advantages → update, timed in parts."""
        from marscli.rl.advantages import run as advantages
        from marscli.scoring.judge import make_judge
        from marscli.scoring.rewards import run as reward
        from marscli.train.batch import load_example

        t0 = time.perf_counter()
        before = len(self.engine_time.times)
        recs = self.rollout(seed)
        t_rollout = time.perf_counter() - t0
        t_gen = sum(self.engine_time.times[before:])
        scored, _ = reward(list(enumerate(recs, 1)), "warm", make_judge("exact"), 0.0)
        rows, _ = advantages(list(enumerate(scored, 1)), "warm", estimator="dr-grpo")
        exs = []
        for i, r in enumerate(rows):
            e = load_example(r, "warm", i + 1, self.tmp, self.spec)
            e.advantage, e.index = float(r["advantage"]), i
            exs.append(e)
        t_upd, tokens = self.train(exs, "engine")
        return {"step_s": time.perf_counter() - t0, "gen_s": t_gen, "rollout_s": t_rollout,
                "update_s": t_upd,
                "gen_tokens": sum(r["generated_tokens"] for r in recs), "train_tokens": tokens}


def processes(setup: Setup, tmp: Path, budget: int) -> dict:
    """The four stages as `make rl-iter` runs them, one process each."""
    import json

    it = tmp / "iter-0"
    mc = [sys.executable, "-m", "marscli"]
    stages = {
        "rollout": [*mc, "rollout", str(setup.file), "--policy", POLICY, "-o",
                    str(it / "rollouts.jsonl"), "-n", str(setup.n), "--temperature", "1.0",
                    "--max-turns", "1", "--max-turn-tokens", str(setup.new_tokens),
                    "--max-response-tokens", "4096", "--batch-size",
                    str(len(setup.prompts) * setup.n), "--system-prompt", str(SYSTEM),
                    "--seed", "0", "--device", "cpu"],
        "reward": [*mc, "reward", str(it / "rollouts.jsonl"), "-o", str(it / "scored.jsonl"),
                   "--judge", "exact", "--format-weight", "0"],
        "advantages": [*mc, "advantages", str(it / "scored.jsonl"), "-o",
                       str(it / "advantages.jsonl"), "--estimator", "dr-grpo", "--seed", "0"],
        "update": [*mc, "update", str(it / "advantages.jsonl"), "--policy", POLICY, "--out",
                   str(it / "ckpt-1"), "--loss", "gspo", "--lr", str(LR), "--clip-low",
                   str(CLIP_LOW), "--clip-high", str(CLIP_HIGH), "--grad-clip", str(GRAD_CLIP),
                   "--old-logp", "engine", "--micro-batch-tokens", str(budget), "--seed", "0",
                   "--device", "cpu"],
    }
    it.mkdir(parents=True)
    times = {}
    for name, cmd in stages.items():
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times[name] = time.perf_counter() - t
    side = json.loads((it / "rollouts.jsonl.meta.json").read_text())["stats"]
    m = json.loads((it / "ckpt-1" / "metrics.jsonl").read_text().splitlines()[-1])
    return {"step_s": sum(times.values()), "times": times, "gen_tokens": side["generated_tokens"],
            "gen_s": side["generate_s"], "update_s": m["seconds"], "train_tokens": m["tokens"]}


# ------------------------------------------------------------------------------ the check


def flat_grad(module) -> list[float]:
    """Every parameter's gradient, by name (none: zeros), flattened in name order."""
    import torch

    params = dict(module.named_parameters())
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for _, p in sorted(params.items())]).tolist()


def check_sides(setup: Setup, trl: dict, warm: Warm) -> tuple[dict, dict]:
    """Both sides' prompts, advantages, first micro-batch loss and gradient (module docstring)."""
    import torch

    from marscli.rl.advantages import compute
    from marscli.rl.losses import LOSSES
    from marscli.train.batch import collate
    from marscli.train.trainer import PolicyLM

    trainer, first = trl["trainer"], trl["first"]
    n = first["prompt_ids"].shape[0]
    trl_prompts = [first["prompt_ids"][i][first["prompt_mask"][i].bool()].tolist()
                   for i in range(0, n, setup.n)]
    ours_adv = compute(trl["rewards"], [i // setup.n for i in range(n)], "dr-grpo").tolist()
    # the first micro-batch, with advantages of both signs (the step's rewards may be flat)
    inputs = dict(trl["first_inputs"])
    b = inputs["completion_ids"].shape[0]
    order = torch.randperm(b, generator=torch.Generator().manual_seed(0))
    adv = torch.linspace(-1.0, 2.0, b)[order]  # both signs, mean 0.5
    inputs["advantages"] = adv
    lm = trainer.model  # TRL's own forward (its fused LM head), back at the initial weights
    lm.load_state_dict(load_lm().state_dict())
    lm.zero_grad(set_to_none=True)
    lm.train()
    gas = trainer.current_gradient_accumulation_steps
    loss_t = trainer._compute_loss(lm, inputs) * gas
    loss_t.backward()
    side_t = {"prompt_ids": trl_prompts, "advantages": first["advantages"].tolist(),
              "loss": float(loss_t.detach()), "grad": flat_grad(lm)}
    exs = trl_examples(setup, inputs)  # the generation batch's first rows, in order
    model = PolicyLM(load_lm())
    model.train()
    batch = collate(exs, warm.spec)
    logp = model(**batch.tensors, loss_mask=batch.loss_mask)
    loss_o, _ = LOSSES.get("gspo")(logp, logp.detach(), adv, batch.loss_mask, CLIP_LOW,
                                   CLIP_HIGH)
    loss_o.backward()
    side_o = {"prompt_ids": [setup.marscli_prompt_ids(i) for i in range(len(trl_prompts))],
              "advantages": ours_adv, "loss": float(loss_o.detach()), "grad": flat_grad(model.lm)}
    return side_t, side_o


# ------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="prompts (the demo: 16)")
    ap.add_argument("-n", type=int, default=8, help="samples per prompt (the demo: 8)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per reply (the demo: 64)")
    ap.add_argument("--micro", type=int, default=16, help="TRL's sequences per micro-batch")
    ap.add_argument("--skip-processes", action="store_true", help="no process-per-stage run")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import trl

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        setup = Setup(world(tmp, args.prompts), args.n, args.new_tokens)
        # TRL's micro-batch holds `micro` sequences padded to its longest; marscli's budget is
        # that many of the longest possible (prompt + reply + the zoom tool's response).
        longest = max(len(setup.marscli_prompt_ids(i)) for i in range(len(setup.prompts)))
        budget = args.micro * (longest + args.new_tokens + 96)
        t = run_trl(setup, tmp, args.micro)
        warm = Warm(setup, tmp, budget)
        side_t, side_o = check_sides(setup, t, warm)
        bad = equivalence_failures(side_t, side_o)
        print(f"equivalence (TRL {trl.__version__} vs marscli, first micro-batch of "
              f"{args.micro}): loss {side_t['loss']:.6f} vs {side_o['loss']:.6f}, "
              f"{'OK' if not bad else 'FAILED: ' + '; '.join(bad)}")
        if bad:
            return 1
        warm.step(seed=1)  # warm-up, as TRL's first step
        w = warm.step(seed=2)
        same_s, same_tokens = warm.train(trl_examples(setup, t["timed"]), "recompute")
        p = None if args.skip_processes else processes(setup, tmp, budget)
    report(t, w, p, same_s, same_tokens)
    return 0


def report(t: dict, w: dict, p: dict | None, same_s: float, same_tokens: int) -> None:
    def rate(tokens: float, s: float) -> float:
        return tokens / s if s > 0 else float("nan")

    rows = [("TRL GRPOTrainer", t), ("marscli warm (one process)", w)]
    rows += [("marscli processes (rl-iter)", p)] if p else []
    print(f"{'':30s} {'gen tok/s':>10s} {'train tok/s':>12s} {'step s':>8s}")
    for name, r in rows:
        print(f"{name:30s} {rate(r['gen_tokens'], r['gen_s']):10.0f} "
              f"{rate(r['train_tokens'], r['update_s']):12.0f} {r['step_s']:8.2f}")
    print(f"  warm rollout (agent, parsing, the zoom tool's call): {w['rollout_s']:.2f} s, "
          f"of it the engine {w['gen_s']:.2f} s")
    if p:
        print("  processes: " + ", ".join(f"{k} {v:.2f} s" for k, v in p["times"].items()))
    trl_train = rate(t["train_tokens"], t["update_s"])
    ours_train = rate(same_tokens, same_s)
    print(f"update on TRL's own batch ({same_tokens} tokens): TRL {trl_train:.0f} tokens/s, "
          f"marscli {ours_train:.0f} tokens/s")
    train = ours_train / trl_train
    gen = rate(w["gen_tokens"], w["gen_s"]) / rate(t["gen_tokens"], t["gen_s"])
    warm = w["step_s"] / t["step_s"]
    procs = p["step_s"] / t["step_s"] if p else float("nan")
    print(f"peers: train_tokens_per_s_ratio={train:.2f} generation_tokens_per_s_ratio={gen:.2f} "
          f"step_time_ratio_warm={warm:.2f} step_time_ratio_processes={procs:.2f}")


if __name__ == "__main__":
    sys.exit(main())
