# recipes/mars-32b.mk — the paper's RL settings for Qwen3-VL-32B (SenseNova-MARS-32B): every
# value as in recipes/mars-8b.mk, with its sources and departures, except:
#   BASE        Qwen3-VL-32B-Instruct                                                  [paper]
#   TP          4: vLLM tensor parallelism for rollout and eval, 2 engines per 8-GPU node:
#               a 32B model in bf16 (~64 GB of weights) leaves room for the KV cache of
#               16k-token trajectories                                                [marscli]
#   NNODES      4 for update and sft: ZeRO-3 over 32 GPUs, so that the fp32 masters and AdamW
#               moments of 32B parameters (~16 bytes each, ~530 GB) take ~16 GB a GPU and a
#               micro-batch of 32,768 tokens fits beside them: `make plan` gives 75 GiB a GPU
#               of 80 (its worst case, every token an image token: 51 GiB of activations
#               with gradient checkpointing); on 2 nodes the model states are 42 GiB and the
#               peak 94 GiB, and no --micro-batch-tokens helps, as a row of max_model_len
#               trains alone. DeepSpeed's offload_optimizer on 2 nodes (59 GiB a GPU, ~400
#               GB of host memory a node, AdamW on the CPUs) is the other way     [marscli]
# Disk per iteration, rank 0's node (`make plan`): ~167 GB written (the bf16 export 67, the
# node's shares of the fp32 masters 33 and AdamW's moments 67) and ~234 GB read back by the next
# update (with its input export and the reference's): about 1.5 and 2 minutes at 2 GB/s.
# Rollout correction as mars-8b.mk (token-truncate, cap 2, departure 3): tensor parallelism 4
# sums bf16 partial results in another order than the trainer does, one more source of the
# engine/trainer mismatch that the weights correct.
# The release has no 32B training script (its train_multi_node.sh is for 8B), so there is no
# mars-32b-release.mk: recipes/mars-8b-release.mk with BASE=...32B and TP=4 is the nearest.

NAME ?= mars-32b
BASE ?= Qwen/Qwen3-VL-32B-Instruct
TP ?= 4
MODEL_CONFIG ?= recipes/qwen3-vl-32b.config.json
NNODES ?= 4
include recipes/mars-8b.mk
