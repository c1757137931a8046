# recipes/tiny-sees.mk — the CPU demo (`make demo`): RL from a tiny Qwen3-VL that already sees,
# copies and calls the paper's three tools, as MARS starts from Qwen3-VL-Instruct (issues 19, 35;
# docs/notes/demo-log.md, levers f-ag, has how it was found). The policy is recipes/tiny-vlm (5.2 MB,
# committed): `make tiny-vlm`'s pre-training on 109 worlds that share no seed and no logo with the
# demo's (worlds of seeds 0-2), at a 128x128 view, where a scene's logo is too small to read and
# the zoom's crop is not. The demo's world asks the three kinds (perception: zoom; knowledge: text
# search; both: image search, then text search); its cold start answers 70% of each attribute's
# rows without a tool and blind (DIRECT; lever ae), so the SFT model calls none; RL has to learn
# when to call which. Rebuild the model with
#   make tiny-vlm VLM_RUN=runs/tiny-vlm                                   (~115 min, 2 cores)
# and run the demo from it with VLM=runs/tiny-vlm. Everything else is recipes/tiny.mk's.
# Measured: README "What the demo shows" and docs/demo.md (`make demo SEEDS=3`).
VLM ?= recipes/tiny-vlm
# The paper's three kinds: perception (zoom), knowledge (text search), both (image search, then
# text search).
KINDS ?= perception,knowledge,both
DIRECT ?= 0.7
# The 4x4 grid's quadrants are the zoom boxes (--zoom-cells 2); no clutter around the logo.
WORLD_OPTS ?= --entities 8 --grid 4 --zoom-cells 2 --clutter 0 --direct $(DIRECT) \
  --kinds $(KINDS) --train 192 --test 96 --sft 240 --seed $(WORLD_SEED)
# The vision tower stays as the pre-training left it; the LM learns the protocol.
SFT_OPTS ?= --epochs 6 --lr 1e-3 --batch-size 4 --lr-schedule cosine --freeze-vision
# The demo: twelve iterations (one pass over the 192 training prompts), the test split every
# fourth checkpoint (every second: 2 minutes more, over the budget of 15). `make rl`/`rl-eval`/
# `ablation`: 8 iterations, evaluated at 0, 4 and 8.
DEMO_ITERS ?= 12
DEMO_EVAL_EVERY ?= 4
ITERS ?= 8
EVAL_EVERY ?= 4
include recipes/tiny.mk
