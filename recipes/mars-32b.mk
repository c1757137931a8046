# recipes/mars-32b.mk — the paper's RL settings for Qwen3-VL-32B (SenseNova-MARS-32B): everything
# as in mars-8b.mk (read its departures from the paper), with vLLM tensor parallelism 4 for
# rollouts and ZeRO-3 across 8 GPUs for the update.

NAME ?= mars-32b
BASE ?= Qwen/Qwen3-VL-32B-Instruct
TP ?= 4
include recipes/mars-8b.mk
