# recipes/tiny-sees.mk — the CPU demo started from a tiny Qwen3-VL that already sees (issue 19,
# recipes/tiny.mk lever f), as MARS starts from Qwen3-VL-Instruct. Not yet the default demo.
#   make tiny-vlm VLM_RUN=runs/vlm128 VLM_AGENT_EPOCHS=12 \
#     VLM_MODEL_OPTS='--size tiny --min-pixels 16384 --max-pixels 16384 --seed 0'   (~17 min)
#   make rl-eval RECIPE=recipes/tiny-sees.mk ITERS=8 EVAL_EVERY=4                     (~5 min)
# Measured once (one RL seed, 2 cores): the cold start answers 70% of its rows without a zoom, so
# the greedy SFT model never zooms (test 34.4%); RL raised the zoom share of the rollouts from
# 19% to 55% in 8 iterations, and the greedy policy of ckpt-8 zooms on every question: test
# 72.9%, 82 of 96 zooms on the logo. Seeds and the README's table: not yet.
VLM ?= runs/vlm128
DIRECT ?= 0.7
WORLD_OPTS ?= --entities 8 --grid 4 --zoom-cells 2 --clutter 0 --direct $(DIRECT) \
  --kinds $(KINDS) --train 192 --test 96 --sft 240 --seed 0
# The vision tower stays as the pre-training left it; the LM learns the protocol.
SFT_OPTS ?= --epochs 6 --lr 1e-3 --batch-size 4 --schedule cosine --freeze-vision
include recipes/tiny.mk
