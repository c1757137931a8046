# recipes/mars-8b.mk — the paper's RL settings for Qwen3-VL-8B (SenseNova-MARS-8B, arXiv
# 2512.24330). recipes/mars-8b-release.mk has what the released training script runs instead;
# the two differ in lr, KL, the estimator and more (its header lists how).
#
# Sources, as tags after each value: [paper] the paper; [release] the released
# train_multi_node.sh (OpenSenseNova/SenseNova-MARS); [marscli] this recipe's choice.
#   pipeline      cold-start SFT on ~3,000 trajectories, then RL                     [paper]
#   batch         128 prompts x 8 samples an iteration                               [paper]
#   optimiser     AdamW lr 1e-6, constant; grad clip 1.0            [paper; clip: verl's default]
#   KL            1e-4 (k3) to the cold-start model                                  [paper]
#   clip          0.2 / 0.28 (GSPO's own paper: 3e-4 / 4e-4: set CLIP_LOW, CLIP_HIGH) [paper]
#   advantages    BN-GSPO: group, then batch normalisation                           [paper]
#   loss          GSPO, sequence-mean of token means                                 [paper]
#   agent         10 assistant turns, 16,384 response tokens                         [paper]
#   per turn      at most 4,096 tokens                                             [marscli]
#   reward        accuracy (exact match, else the judge) + 0.5 format             [release]
#   precision     bf16 compute (DeepSpeed "auto" on GPU)                            [paper]
#   log-probs     from the final hidden states, update's --logp-chunk positions at a time
#                 (default 1,024 at Qwen's vocabulary): a micro-batch's [N, V] logits never
#                 exist                                                              [marscli]
# Departures:
#  1. The judge and search endpoints are variables (JUDGE, TEXT_SEARCH, IMAGE_SEARCH): the
#     paper used GPT-4o / Serper with an LLM summariser at eval and a local Wikipedia retriever
#     in training.
#  2. The trainer is DeepSpeed ZeRO-3 over torchrun, a process boundary per iteration
#     [marscli]; the paper's (verl's) trainer is one long-lived FSDP process. What a long-lived
#     trainer keeps crosses that boundary in OUT/train_state/: the fp32 master weights and,
#     with --keep-optimizer (KEEP_OPTIMIZER), AdamW's moments and step. OUT/ itself is the HF
#     export that vLLM and transformers load; the next `update` starts from train_state, not
#     from the export, so 1e-6 steps are not lost to a 16-bit round trip.
#  3. Old log-probs are recomputed by `update` with the input policy (as verl does by default),
#     with rollout correction on: each model token's loss weighs min(π_old/π_engine, 2)
#     (ROLLOUT_IS=token-truncate, ROLLOUT_IS_CAP=2, TIS) [marscli]. The paper names no
#     correction. vLLM samples in bf16 and the trainer computes from fp32 masters, so the two
#     disagree on every token; on 16k-token, 10-turn trajectories a per-token bound keeps the
#     weights' variance ≤ 4 without dropping a token, where a sequence weight (even a geometric
#     mean) would hide the few tokens that disagree most. Watch `rollout_kl` in metrics.jsonl;
#     ROLLOUT_IS=token-mask ROLLOUT_IS_FLOOR=0.5 ROLLOUT_IS_CAP=5 (IcePop's bounds) drops the
#     worst tokens instead; ROLLOUT_IS=off trains as before.
#  4. The vision tower trains in RL (nothing in the paper's RL settings says otherwise) and is
#     frozen in SFT [marscli]; the release freezes it in RL too.
# Memory and disk, as `make plan RECIPE=recipes/mars-8b.mk` gives them (how it counts:
# docs/gpu.md "Memory plan, before the GPU hours"): 56.7 GiB a GPU of 80 at micro-batches of
# 32,768 tokens, apart or colocated with the engine asleep (the worst micro-batch: every token
# an image token). The log-probs' chunks hold 1.2 GiB in the forward and the LM head's fp32
# gradient 4.6 GiB in the backward, where the [N, V] logits of 32,768 loss tokens were 55.6
# GiB (90.2 GiB a GPU: it did not fit). An iteration writes ~123 GB to the run folder (the bf16
# export 18, the fp32 masters 35, AdamW's moments 70) and the next reads ~140 GB back (with the
# export and the reference's): about a minute each at 2 GB/s.
# You provide BASE, PROMPTS, TEST, SFT_DATA (see recipes/_gpu.mk); launch shape and Slurm
# requests are in recipes/_gpu.mk (GPUS_PER_NODE=8, NNODES=1, NPROC=GPUS_PER_NODE, TP=1).

NAME ?= mars-8b
RUN ?= runs/$(NAME)
BASE ?= Qwen/Qwen3-VL-8B-Instruct
PROMPTS ?= data/mars/train.jsonl
TEST ?= data/hr-mmsearch/data.jsonl
SFT_DATA ?= data/mars/cold_start.jsonl
JUDGE ?= openai:gpt-4o@https://api.openai.com/v1
TEXT_SEARCH ?= retriever:http://127.0.0.1:8000/retrieve
IMAGE_SEARCH ?= data
SEARCH_OPTS ?= --text-search $(TEXT_SEARCH) --image-search $(IMAGE_SEARCH)
CLIP_LOW ?= 0.2
CLIP_HIGH ?= 0.28
KEEP_OPTIMIZER ?= --keep-optimizer
ROLLOUT_IS ?= token-truncate
ROLLOUT_IS_CAP ?= 2
ROLLOUT_IS_FLOOR ?= 0
include recipes/_gpu.mk

PROMPTS_PER_ITER ?= 128
N ?= 8
MAX_TURNS ?= 10
MAX_RESPONSE_TOKENS ?= 16384
MAX_TURN_TOKENS ?= 4096
# The trainer's device (update, sft): DEVICE's unless set (make rehearse: cpu).
TRAIN_DEVICE ?= $(DEVICE)
ROLLOUT_OPTS ?= -n $(N) --engine $(ENGINE) --device $(DEVICE) --temperature 1.0 \
  --max-turns $(MAX_TURNS) --max-response-tokens $(MAX_RESPONSE_TOKENS) \
  --max-turn-tokens $(MAX_TURN_TOKENS) \
  $(STAGE_VLLM_OPTS) $(SEARCH_OPTS)
REWARD_OPTS ?= --judge $(JUDGE) --format-weight 0.5
ESTIMATOR ?= bn-gspo
ADV_OPTS ?= --estimator $(ESTIMATOR)
LOSS ?= gspo
UPDATE_OPTS ?= --loss $(LOSS) --lr 1e-6 --kl 1e-4 --ref $(RUN)/ckpt-0 --clip-low $(CLIP_LOW) \
  --clip-high $(CLIP_HIGH) --grad-clip 1.0 --deepspeed recipes/ds_zero3.json $(KEEP_OPTIMIZER) \
  --gradient-checkpointing --micro-batch-tokens 32768 --device $(TRAIN_DEVICE) \
  --old-logp recompute --rollout-is $(ROLLOUT_IS) --rollout-is-cap $(ROLLOUT_IS_CAP) \
  --rollout-is-floor $(ROLLOUT_IS_FLOOR)
SFT_OPTS ?= --epochs 3 --lr 1e-5 --freeze-vision --deepspeed recipes/ds_zero3.json \
  --save-every-epoch --device $(TRAIN_DEVICE)
EVAL_OPTS ?= --mode agent --engine $(ENGINE) --device $(DEVICE) --judge $(JUDGE) \
  $(STAGE_VLLM_OPTS) $(SEARCH_OPTS)
