# recipes/mars-8b.mk — the paper's RL settings for Qwen3-VL-8B (SenseNova-MARS-8B).
#
# Paper settings kept: 128 prompts a batch, 8 samples a prompt, lr 1e-6, KL 1e-4 to the
# cold-start model, clip 0.2/0.28 (GSPO's own paper used 3e-4/4e-4: set CLIP_LOW/CLIP_HIGH),
# 10 turns, 16k response tokens, BN-GSPO advantages, GSPO loss, bf16.
# Departures:
#  1. The judge and search endpoints are variables (JUDGE, TEXT_SEARCH, IMAGE_SEARCH): the paper
#     used GPT-4o / Serper with an LLM summariser at eval and a local Wikipedia retriever in training.
#  2. Every update starts a fresh AdamW (each `update` is its own process); the paper's trainer
#     keeps optimiser state across steps. `update --keep-optimizer` carries it, but only without
#     DeepSpeed (ZeRO shards the state), and ZeRO-3 is what fits an 8B model here.
#  3. Checkpoints are saved in float32 between iterations so that 1e-6 steps are not rounded away.
# You provide: BASE (Qwen3-VL-8B-Instruct folder or hub id), SFT_DATA (cold-start trajectories,
# e.g. from `rollout --engine openai --tokenize-with BASE` + `reward` + a jq filter), PROMPTS, TEST.

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
SHARDS ?= 8
DEVICE ?= cuda
ENGINE ?= vllm
TP ?= 1
CLIP_LOW ?= 0.2
CLIP_HIGH ?= 0.28

PROMPTS_PER_ITER ?= 128
N ?= 8
MAX_TURNS ?= 10
ROLLOUT_OPTS ?= -n $(N) --engine $(ENGINE) --device $(DEVICE) --temperature 1.0 \
  --max-turns $(MAX_TURNS) --max-response-tokens 16384 --max-turn-tokens 4096 \
  --tensor-parallel $(TP) $(SEARCH_OPTS)
REWARD_OPTS ?= --judge $(JUDGE) --format-weight 0.5
ESTIMATOR ?= bn-gspo
ADV_OPTS ?= --estimator $(ESTIMATOR)
LOSS ?= gspo
NPROC ?= 8
UPDATE_OPTS ?= --loss $(LOSS) --lr 1e-6 --kl 1e-4 --ref $(RUN)/ckpt-0 --clip-low $(CLIP_LOW) \
  --clip-high $(CLIP_HIGH) --grad-clip 1.0 --deepspeed recipes/ds_zero3.json \
  --gradient-checkpointing --micro-batch-tokens 32768 --device cuda
SFT_OPTS ?= --epochs 3 --lr 1e-5 --freeze-vision --deepspeed recipes/ds_zero3.json \
  --save-every-epoch --device cuda
EVAL_OPTS ?= --mode agent --engine $(ENGINE) --device $(DEVICE) --judge $(JUDGE) $(SEARCH_OPTS)

$(SFT_DATA).meta.json:
	@test -f $(SFT_DATA) || { echo "SFT_DATA=$(SFT_DATA) not found: make cold-start trajectories first" >&2; exit 2; }
	@touch $@

RECIPE_INPUTS =
