# recipes/tiny.mk — the CPU demo: the toy world and a small random Qwen3-VL, minutes on 2 cores.
#
# Departures from the paper (recipes/mars-8b.mk has its settings), each for the 10-minute CPU budget:
#  1. Policy: a ~5.6 M-parameter random Qwen3-VL (`tiny-model --size small`) whose tokenizer is
#     trained on the toy world's text, instead of Qwen3-VL-8B/32B-Instruct.
#  2. Data: the generated toy world (perception, knowledge and both-kinds questions about made-up
#     companies' logos in 1024x1024 scenes) instead of the MARS training mix; search is the local
#     FTS5 index of the world's corpus and the rows' precomputed image-search results.
#  3. Cold start: scripted expert trajectories replayed through the real tools, not a teacher model.
#  4. Scale: PROMPTS_PER_ITER prompts x N samples per iteration, short replies (MAX_TURN_TOKENS),
#     at most MAX_TURNS turns, instead of 128 x 8 with 16k-token responses.
#  5. Optimiser: a learning rate of 3e-4 instead of 1e-6 (a random small model needs far larger
#     steps), 4 minibatches (4 optimiser steps) per iteration, and no KL term (the paper's
#     1e-4 barely acts in a few iterations; the reference forward costs a third of an update).
#  6. Judge: exact match only (the toy answers are single words).
#  7. The world keeps two of its three question kinds (perception, knowledge) on a 4x4 grid, and
#     the tiny processor sees at most 224x224 pixels per image (49 tokens): both to fit the budget.

NAME ?= tiny
RUN ?= runs/$(NAME)
WORLD ?= $(RUN)/world
WORLD_OPTS ?= --entities 8 --grid 4 --kinds perception,knowledge --train 192 --test 48 --sft 120 --seed 0
MODEL_OPTS ?= --size tiny --min-pixels 16384 --max-pixels 50176 --seed 0
BASE ?= $(RUN)/base

PROMPTS ?= $(WORLD)/train.jsonl
TEST ?= $(WORLD)/test.jsonl
SEARCH_OPTS ?= --text-search local:$(WORLD)/text.sqlite --image-search data

PROMPTS_PER_ITER ?= 16
N ?= 8
MAX_TURNS ?= 5
MAX_TURN_TOKENS ?= 64
ROLLOUT_OPTS ?= -n $(N) --temperature 1.0 --max-turns $(MAX_TURNS) \
  --max-turn-tokens $(MAX_TURN_TOKENS) --max-response-tokens 4096 --batch-size 64 $(SEARCH_OPTS)
REWARD_OPTS ?= --judge exact --format-weight 0.5
ESTIMATOR ?= bn-gspo
ADV_OPTS ?= --estimator $(ESTIMATOR) --minibatches 4
LOSS ?= gspo
UPDATE_OPTS ?= --loss $(LOSS) --lr 3e-4 --clip-low 0.2 --clip-high 0.28 --grad-clip 1.0
SFT_DATA ?= $(RUN)/sft/trajectories.jsonl
SFT_OPTS ?= --epochs 12 --lr 2e-3 --batch-size 4 --schedule cosine
EVAL_OPTS ?= --mode agent --temperature 0 --max-turns $(MAX_TURNS) \
  --max-turn-tokens $(MAX_TURN_TOKENS) $(SEARCH_OPTS)

# The toy world, the tokenizer-aware tiny model, the text index and the expert trajectories.
$(WORLD)/train.jsonl:
	$(MARSCLI) toy-world $(WORLD) $(WORLD_OPTS) --force

$(WORLD)/text.sqlite: $(WORLD)/train.jsonl
	$(MARSCLI) index text $(WORLD)/corpus.jsonl -o $@

$(BASE)/config.json: $(WORLD)/train.jsonl
	$(MARSCLI) tiny-model $(BASE) --text $(WORLD)/vocab.txt $(MODEL_OPTS) --force

$(SFT_DATA).meta.json: $(BASE)/config.json $(WORLD)/text.sqlite
	stages/rollout.sh $(WORLD)/sft.jsonl $(BASE) $(SFT_DATA) --engine replay -n 1 $(SEARCH_OPTS)

RECIPE_INPUTS = $(WORLD)/text.sqlite
