# recipes/mars-32b.mk — the paper's RL settings for Qwen3-VL-32B (SenseNova-MARS-32B): every
# value as in recipes/mars-8b.mk, with its sources and departures, except:
#   BASE        Qwen3-VL-32B-Instruct                                                  [paper]
#   TP          4: vLLM tensor parallelism for rollout and eval, 2 engines per 8-GPU node:
#               a 32B model in bf16 (~64 GB of weights) leaves room for the KV cache of
#               16k-token trajectories                                                [marscli]
#   NNODES      2 for update and sft: ZeRO-3 over 16 GPUs, so that the fp32 masters and AdamW
#               moments of 32B parameters (~16 bytes each, ~512 GB) take ~32 GB a GPU    [marscli]
# Rollout correction as mars-8b.mk (token-truncate, cap 2, departure 3): tensor parallelism 4
# sums bf16 partial results in another order than the trainer does, one more source of the
# engine/trainer mismatch that the weights correct.
# The release has no 32B training script (its train_multi_node.sh is for 8B), so there is no
# mars-32b-release.mk: recipes/mars-8b-release.mk with BASE=...32B and TP=4 is the nearest.

NAME ?= mars-32b
BASE ?= Qwen/Qwen3-VL-32B-Instruct
TP ?= 4
MODEL_CONFIG ?= recipes/qwen3-vl-32b.config.json
NNODES ?= 2
include recipes/mars-8b.mk
