# recipes/mars-8b-release.mk — what the released SenseNova-MARS training script runs for
# Qwen3-VL-8B (OpenSenseNova/SenseNova-MARS `train_multi_node.sh`, a verl 0.6.1 fork; evaluation
# settings from its `eval_single_node.sh`), as far as marscli's stages can express it today.
# recipes/mars-8b.mk has the paper's settings instead (lr 1e-6, KL 1e-4, BN-GSPO, cold start);
# recipes/eval-release.mk evaluates a released checkpoint under either of the release's two
# evaluators, beside the paper's settings.
#
# Sources, as tags after each value: [release] the release's scripts (an option they set);
# [verl] verl's default for an option the release leaves unset; [maintainers] what the
# maintainers said in the release's issues; [marscli] this recipe's choice.
#   start         RL from Qwen3-VL-8B-Instruct itself, no cold-start SFT (COLD_START=none) [release]
#   batch         128 prompts x 8 samples (data.train_batch_size, rollout.n)            [release]
#   steps         one optimiser step per batch (ppo_mini_batch_size=128, ppo_epochs 1)
#                                                                            [release; verl]
#   optimiser     AdamW lr 1e-5 constant, no warm-up, weight decay 0.01, betas 0.9/0.999,
#                 grad clip 1.0                                       [release: lr; verl: rest]
#   KL, entropy   none (use_kl_loss=False, use_kl_in_reward=False, entropy_coeff=0)     [release]
#   clip          0.2 / 0.28                                                            [release]
#   advantages    grpo: group mean and std, no batch normalisation (adv_estimator=grpo; the
#                 release's own default, its issue #4); BN_GSPO=1: bn-gspo               [release]
#   loss          token-level PPO clip ("vanilla"), token-mean; BN_GSPO=1: gspo, still token-mean
#                 (policy_loss.loss_mode=gspo; verl passes actor.loss_agg_mode, token-mean,
#                 to every policy loss)                                          [release; verl]
#   vision tower  frozen (freeze_vision_tower=True)                                     [release]
#   agent         10 assistant turns, 16,384 response tokens (model + tool)              [release]
#   per turn      at most 16,384 tokens: the release caps only the response budget      [marscli]
#   sampling      temperature 1, top-p 1, no top-k                                        [verl]
#   π_old         the rollout engine's log-probs (rollout correction "bypass" mode,
#                 calculate_log_probs=True): `update --old-logp engine`, no old-policy
#                 forward; the PPO ratio π_θ/π_engine carries the engine/trainer mismatch and
#                 its clip bounds it, so there is no separate IS weight (--rollout-is off,
#                 what engine implies)                                                 [release]
#   reward        answer (exact match, else the judge) + 0.5 format (format_score=0.5);
#                 exit if over 5% of the judge's calls fail                          [release]
#   scoring       as the release's tool.py scores (`--protocol release`, in reward and eval):
#                 llm_score (the judge only for a tagged answer), em_score_mcq for rows with
#                 choices (A-D, read from the whole last turn when it has no tag)     [release]
#   judges        training: Qwen3-VL-32B-Instruct (an OpenAI-compatible server, JUDGE), 300 s
#                 timeout, 4 in flight; evaluation: gpt-4o-2024-11-20 (EVAL_JUDGE), 2 in
#                 flight                                                                [release]
#   eval sampling 1 sample, temperature 1, top-p 1, top-k 20 (eval_single_node.sh)       [release]
#   image search  the cache in the data rows (IMAGE_SEARCH=data)                        [release]
#   rollout       vLLM, tensor parallel 2 (release: SGLang, TP 2; marscli has no SGLang
#                 engine)                                                     [release; marscli]
#   iterations    ITERS=300: the maintainers trained ~300 steps and released the best
#                 validated step, near 150                                          [maintainers]
# Departures, each because marscli has no option for it today:
#  1. Sampling: vLLM's presence penalty 1.5 (PRESENCE_PENALTY) stands for SGLang's; the two
#     samplers differ in their kernels, so the same seed gives other tokens.
#  2. Tool responses are truncated at 8,192 characters (marscli's agent, fixed); the release
#     truncates at 8,192 tokens (max_tool_response_length, right side).
#  3. The prompt limit: the release's 16,384 tokens (data.max_prompt_length with
#     data.truncation=error, train_multi_node.sh) stops its training at the first longer prompt;
#     `rollout --max-prompt-tokens 16384` (MAX_PROMPT_TOKENS) refuses that row alone (stop
#     prompt_too_long, scored 0, left out of the advantages) and goes on.
#  4. No dual clip: verl clips the loss of negative-advantage tokens at 3·|A| (clip_ratio_c=3);
#     marscli's losses do not.
#  5. No sequence parallelism (the release: Ulysses SP 2, 16k tokens per GPU): a micro-batch
#     holds up to 32,768 tokens, one whole 16k + 16k trajectory, and the log-probs come from
#     the final hidden states 1,024 positions at a time (update's --logp-chunk default), so
#     its [N, V] logits never exist (as verl's fused kernels avoid them). `make plan`: 43.0
#     GiB a GPU of 80, apart or colocated (88.97 before the chunks: it did not fit); an
#     iteration writes ~116 GB to the run folder (export 18, fp32 masters 33, AdamW's moments
#     66; the tower is frozen) and the next reads as much back: about a minute each at 2 GB/s.
#  6. The trainer: DeepSpeed ZeRO-3 under torchrun, one process per iteration [marscli]; the
#     release's is verl's FSDP (actor model_dtype=bfloat16) in one long-lived process. Across
#     iterations `update` keeps the fp32 master weights and (--keep-optimizer, as verl keeps its
#     optimiser) AdamW's moments and step in OUT/train_state/; OUT/ is the HF export the
#     engines load.
#  7. The system prompt: marscli's own unless SYSTEM_PROMPT=FILE; the release's wording is the
#     `system_prompt` of each entry in its train_qwen3_vl_8b.json (save it to a file).
#  8. Seeds: marscli's per-iteration seeds (Makefile SEED), not the release's 3407.
# You provide BASE (a local folder: COLD_START=none links it as ckpt-0), PROMPTS (the release's
# four data.jsonl files, 3,859 prompts, concatenated, their image paths relative to PROMPTS'
# folder), TEST, and the judge and search servers.

NAME ?= mars-8b-release
RUN ?= runs/$(NAME)
BASE ?= Qwen/Qwen3-VL-8B-Instruct
COLD_START ?= none
PROMPTS ?= data/mars/train.jsonl
TEST ?= data/hr-mmsearch/data.jsonl
SFT_DATA ?= data/mars/cold_start.jsonl
ITERS ?= 300
JUDGE ?= openai:Qwen3-VL-32B-Instruct@http://127.0.0.1:8181/v1
EVAL_JUDGE ?= openai:gpt-4o-2024-11-20@https://api.openai.com/v1
TEXT_SEARCH ?= retriever:http://127.0.0.1:8000/retrieve
IMAGE_SEARCH ?= data
SEARCH_OPTS ?= --text-search $(TEXT_SEARCH) --image-search $(IMAGE_SEARCH)
SYSTEM_PROMPT ?=
AGENT_OPTS ?= $(SEARCH_OPTS) $(if $(SYSTEM_PROMPT),--system-prompt $(SYSTEM_PROMPT))
TP ?= 2
KEEP_OPTIMIZER ?= --keep-optimizer
# BN_GSPO=1: the paper's estimator and loss, as the release switches them on
# (+algorithm.apply_batch_norm=True, policy_loss.loss_mode=gspo); everything else as above.
BN_GSPO ?= 0
include recipes/_gpu.mk

PROMPTS_PER_ITER ?= 128
N ?= 8
MAX_TURNS ?= 10
MAX_RESPONSE_TOKENS ?= 16384
MAX_TURN_TOKENS ?= 16384
# The trainer's device (update, sft): DEVICE's unless set (make rehearse: cpu).
TRAIN_DEVICE ?= $(DEVICE)
PRESENCE_PENALTY ?= 1.5  # the release's sampling, in training and evaluation  [release]
MAX_PROMPT_TOKENS ?= 16384  # data.max_prompt_length                                  [release]
ROLLOUT_OPTS ?= -n $(N) --engine $(ENGINE) --device $(DEVICE) $(STAGE_VLLM_OPTS) \
  --temperature 1.0 --top-p 1.0 --top-k 0 --presence-penalty $(PRESENCE_PENALTY) \
  --max-turns $(MAX_TURNS) --max-response-tokens $(MAX_RESPONSE_TOKENS) \
  --max-turn-tokens $(MAX_TURN_TOKENS) --max-prompt-tokens $(MAX_PROMPT_TOKENS) \
  $(AGENT_OPTS)
REWARD_OPTS ?= --judge $(JUDGE) --protocol release --format-weight 0.5 --max-unscored 0.05 \
  --judge-timeout 300 --judge-concurrency 4
ESTIMATOR ?= $(if $(filter 1,$(BN_GSPO)),bn-gspo,grpo)
ADV_OPTS ?= --estimator $(ESTIMATOR) --minibatches 1
LOSS ?= $(if $(filter 1,$(BN_GSPO)),gspo,grpo)
UPDATE_OPTS ?= --loss $(LOSS) --agg token-mean --lr 1e-5 --lr-schedule constant \
  --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.999 --clip-low 0.2 --clip-high 0.28 \
  --grad-clip 1.0 --epochs 1 --freeze-vision --deepspeed recipes/ds_zero3.json \
  $(KEEP_OPTIMIZER) --gradient-checkpointing --micro-batch-tokens 32768 --device $(TRAIN_DEVICE) \
  --old-logp engine --rollout-is off
# Only with COLD_START=sft (the release has no SFT stage): mars-8b.mk's.
SFT_OPTS ?= --epochs 3 --lr 1e-5 --freeze-vision --deepspeed recipes/ds_zero3.json \
  --save-every-epoch --device $(TRAIN_DEVICE)
EVAL_OPTS ?= --mode agent --engine $(ENGINE) --device $(DEVICE) $(STAGE_VLLM_OPTS) \
  --samples 1 --temperature 1.0 --top-p 1.0 --top-k 20 --max-turns $(MAX_TURNS) \
  --max-response-tokens $(MAX_RESPONSE_TOKENS) --max-turn-tokens $(MAX_TURN_TOKENS) \
  --judge $(EVAL_JUDGE) \
  --protocol release --judge-timeout 300 --judge-concurrency 2 $(AGENT_OPTS)
