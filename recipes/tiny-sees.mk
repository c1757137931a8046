# recipes/tiny-sees.mk — the CPU demo (`make demo`): RL from a tiny Qwen3-VL that already sees,
# as MARS starts from Qwen3-VL-Instruct (issue 19; recipes/tiny.mk, lever f, has how it was found).
# The policy is recipes/tiny-vlm (4.7 MB, committed): the random tiny model after `make tiny-vlm`'s
# perception pre-training at a 128x128 view, where a scene's logo is too small to read and the
# zoom's crop is not. Its cold start answers 70% of its rows without zooming (DIRECT), so the SFT
# model under-uses the tool; RL has to learn when and where to zoom. Rebuild the model with
#   make tiny-vlm VLM_RUN=runs/tiny-vlm                                    (~17 min, 2 cores)
# and run the demo from it with VLM=runs/tiny-vlm. Everything else is recipes/tiny.mk's.
# Measured (2 cores, `make demo SEEDS=3` from an empty runs/, ~18 min; `make demo`, one seed, 6 min
# on a fresh clone): greedy test accuracy 34.4% after SFT (never zooms) -> 70.8 +- 11.3% after
# 12 iterations (seeds 0/1/2: 74.0 / 65.6 / 72.9; 74.0 +- 4.5 after 10), zoom hit rate 83.7 +-
# 3.0%; rollouts that zoom 17% -> 92%, that find the logo 12% -> 78% (iteration 10).
VLM ?= recipes/tiny-vlm
DIRECT ?= 0.7
# The 4x4 grid's quadrants are the zoom boxes (--zoom-cells 2); no clutter around the logo.
WORLD_OPTS ?= --entities 8 --grid 4 --zoom-cells 2 --clutter 0 --direct $(DIRECT) \
  --kinds $(KINDS) --train 192 --test 96 --sft 240 --seed $(WORLD_SEED)
# The vision tower stays as the pre-training left it; the LM learns the protocol.
SFT_OPTS ?= --epochs 6 --lr 1e-3 --batch-size 4 --schedule cosine --freeze-vision
# The demo: twelve iterations (one pass over the 192 training prompts), the test split every
# second checkpoint. `make rl`/`rl-eval`/`ablation`: 8 iterations, evaluated at 0, 4 and 8.
DEMO_ITERS ?= 12
DEMO_EVAL_EVERY ?= 2
ITERS ?= 8
EVAL_EVERY ?= 4
include recipes/tiny.mk
