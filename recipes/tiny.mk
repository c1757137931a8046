# recipes/tiny.mk — the CPU recipes' common part: the toy world and a small random Qwen3-VL,
# minutes on 2 cores. `make demo` runs recipes/tiny-sees.mk, which includes this file and starts
# from a tiny VLM that already sees (recipes/tiny-vlm). What each setting bought, measured and
# dated (levers a-ag): docs/notes/demo-log.md "The recipe's levers (recipes/tiny.mk)".
#
# Departures from the paper (recipes/mars-8b.mk has its settings), each for the 10-minute CPU budget:
#  1. Policy: the 1.2 M-parameter random Qwen3-VL (`tiny-model --size tiny`), its tokenizer
#     trained on the toy world's text, instead of Qwen3-VL-8B/32B-Instruct.
#  2. Data: the generated toy world instead of the MARS training mix; perception questions only
#     here (zoom, then answer), KINDS=perception,knowledge,both adds the search questions and tools.
#  3. Prompt: a 42-token system prompt (recipes/toy-system.txt) instead of the 160-token default.
#  4. Cold start: scripted expert trajectories replayed through the real tools, not a teacher model.
#  5. Scale: PROMPTS_PER_ITER prompts x N samples per iteration, short replies (MAX_TURN_TOKENS),
#     at most MAX_TURNS turns, instead of 128 x 8 with 16k-token responses.
#  6. Optimiser: lr 1e-4 instead of 1e-6, AdamW's state carried across iterations
#     (`--keep-optimizer`), 4 minibatches per iteration, no KL term.
#  7. Reward: exact match only (format weight 0: a format term taught the policy to stop zooming).
#  8. Pixels: the tiny processor sees at most 224x224 per image (49 tokens).
#  9. Rollout correction off (`update --rollout-is off`): the HF engine samples from the trainer's
#     own forward, so there is no gap to correct.

# Same seeds, same numbers on another x86-64 machine: torch, oneDNN and MKL pick kernels by the
# CPU's instruction set and split reductions by thread count, both of which change float rounding;
# the CPU demo pins all three to AVX2 and 2 threads (constraints.txt pins the libraries; the GPU
# recipes do not).
export OMP_NUM_THREADS ?= 2
export MKL_NUM_THREADS ?= $(OMP_NUM_THREADS)
export ATEN_CPU_CAPABILITY ?= avx2
export MKL_CBWR ?= AVX2
export ONEDNN_MAX_CPU_ISA ?= AVX2

NAME ?= tiny
RUN ?= runs/$(NAME)
WORLD ?= $(RUN)/world
KINDS ?= perception
PERCEIVE ?= 0
# The world's seed: its scenes, logos, facts and splits (`make demo WORLD_SEED=s`: another world).
WORLD_SEED ?= 0
WORLD_OPTS ?= --entities 8 --grid 4 --kinds $(KINDS) --train 192 --test 96 --sft 240 \
  --perceive $(PERCEIVE) --seed $(WORLD_SEED)
PERCEIVE_OPTS ?= --epochs 4 --lr 1e-3 --batch-size 16 --lr-schedule constant
MODEL_OPTS ?= --size tiny --min-pixels 16384 --max-pixels 50176 --seed 0
BASE ?= $(RUN)/base

PROMPTS ?= $(WORLD)/train.jsonl
TEST ?= $(WORLD)/test.jsonl
# The search tools only when the world asks knowledge questions (their schemas are ~300 tokens).
SEARCH_OPTS ?= $(if $(subst perception,,$(KINDS)),--text-search local:$(WORLD)/text.sqlite \
  --image-search data)
AGENT_OPTS ?= --system-prompt recipes/toy-system.txt $(SEARCH_OPTS)

PROMPTS_PER_ITER ?= 16
N ?= 8
MAX_TURNS ?= 5
MAX_TURN_TOKENS ?= 64
TEMPERATURE ?= 1.0
ROLLOUT_OPTS ?= -n $(N) --temperature $(TEMPERATURE) --max-turns $(MAX_TURNS) \
  --max-turn-tokens $(MAX_TURN_TOKENS) --max-response-tokens 4096 --batch-size 64 $(AGENT_OPTS)
REWARD_OPTS ?= --judge exact --format-weight 0
ESTIMATOR ?= bn-gspo
ADV_OPTS ?= --estimator $(ESTIMATOR) --minibatches 4
LOSS ?= gspo
# The demo trains with plain torch on one process. DEEPSPEED=recipes/ds_zero2_bf16.json NPROC=2
# runs the same update under DeepSpeed ZeRO-2 with bf16 on 2 ranks (CI runs one iteration so;
# its numbers are not the demo's).
KEEP_OPTIMIZER ?= --keep-optimizer
DEEPSPEED ?=
UPDATE_OPTS ?= --loss $(LOSS) --lr 1e-4 --clip-low 0.2 --clip-high 0.28 --grad-clip 1.0 \
  --rollout-is off $(KEEP_OPTIMIZER) $(if $(DEEPSPEED),--deepspeed $(DEEPSPEED))
SFT_DATA ?= $(RUN)/sft/trajectories.jsonl
SFT_OPTS ?= --epochs 8 --lr 2e-3 --batch-size 4 --lr-schedule cosine
# The greedy agent: the test split's settings, and tiny-vlm-search's probe with its own tools.
GREEDY_OPTS = --mode agent --temperature 0 --max-turns $(MAX_TURNS) \
  --max-turn-tokens $(MAX_TURN_TOKENS)
EVAL_OPTS ?= $(GREEDY_OPTS) $(AGENT_OPTS)

# The toy world, the tokenizer-aware tiny model, the text index and the expert trajectories;
# each target is the sidecar its command writes last (WORLD.meta.json beside the folder), so
# a kill between a folder and its sidecar redoes it. The world's files need the sidecar to
# exist (order-only: it is always newer than they are).
$(WORLD).meta.json:
	$(MARSCLI) toy-world $(WORLD) $(WORLD_OPTS) --force

$(WORLD)/train.jsonl $(WORLD)/test.jsonl $(WORLD)/sft.jsonl: | $(WORLD).meta.json ;

$(WORLD)/text.sqlite.meta.json: $(WORLD).meta.json
	$(MARSCLI) index text $(WORLD)/corpus.jsonl -o $(WORLD)/text.sqlite --force

# VLM=FOLDER (recipes/tiny-sees.mk): BASE is a link to a model that already sees instead.
ifeq ($(VLM),)
$(BASE).meta.json: $(WORLD).meta.json
	$(MARSCLI) tiny-model $(BASE) --text $(WORLD)/vocab.txt $(MODEL_OPTS) --force
else
$(BASE).meta.json: $(VLM)/config.json
	mkdir -p $(dir $(BASE)) && ln -sfn $(abspath $(VLM)) $(BASE) && cp $(VLM)/marscli.meta.json $@
endif

$(SFT_DATA).meta.json: $(BASE).meta.json $(WORLD)/text.sqlite.meta.json
	stages/rollout.sh $(WORLD)/sft.jsonl $(BASE) $(SFT_DATA) --engine replay -n 1 $(AGENT_OPTS)

# Perception pre-training (toy/perceive.py): the random model learns to read a logo's crop and
# to give the logo's box from short message rows, as Qwen3-VL did in its own pre-training, before
# the cold start teaches it the agent protocol. Beside BASE, so RL seeds and ablations share it.
PERCEIVED ?= $(BASE)-perceive
$(PERCEIVED)/config.json: $(BASE).meta.json
	$(call single,SFT,stages/sft.sh,$(WORLD)/perceive.jsonl $(BASE) $(PERCEIVED) $(PERCEIVE_OPTS) --force --metrics $(PERCEIVED).metrics.jsonl,$(TRAIN_ENV))
ifneq ($(PERCEIVE),0)
SFT_FROM = $(PERCEIVED)
SFT_FROM_TARGET = $(PERCEIVED)/config.json
endif

# `make tiny-vlm`: a tiny Qwen3-VL that sees, copies and calls the three tools, from nothing, on
# worlds disjoint from the demo's (seeds 0-2): world 1000 (perception rows), 50 copying worlds
# (1001-1050), four reading worlds (1002-1005) and 50 agent worlds (1101-1150), with a tokenizer
# trained on no world's names (syllables.txt); then the greedy agent on world 1999's three kinds
# (VLM_RUN-probe.json). About 115 minutes on 2 cores; recipes/tiny-vlm is its VLM_RUN, and
# `make demo VLM=runs/tiny-vlm` starts the demo from a rebuilt one.
# VLM_GENERAL=0: the model committed before issue 35 (~17 minutes), pre-trained on the demo's own
# world: three SFT phases on its perception rows, then one in the agent's format, the vision
# tower frozen, with the probe after phases 3 and 4.
VLM_RUN ?= runs/tiny-vlm
VLM_SCENES ?= 2000
VLM_GENERAL ?= 1
ifeq ($(VLM_GENERAL),1)
VLM_AVOID ?= --avoid-seeds 0,1,2 --avoid-entities 8
VLM_WORLD_OPTS ?= --entities 24 --grid 4 --zoom-cells 2 --clutter 0 \
  --kinds perception,knowledge,both --train 16 --test 96 --sft 0 --perceive $(VLM_SCENES) \
  --seed 1000 $(VLM_AVOID)
VLM_TEXT = syllables.txt
VLM_MODEL_OPTS ?= --size tiny --min-pixels 16384 --max-pixels 16384 --seed 0 --init-std 0.08
# The expert's worlds (levers o, r): 40 companies each, every one's trajectories in VX.
VLM_EXPERT_OPTS ?= --entities 40 --grid 4 --zoom-cells 2 --clutter 0 --train 1 $(VLM_AVOID)
VLM_COPY_SEEDS ?= $(shell seq 1001 1050)
VLM_AGENT_SEEDS ?= $(shell seq 1101 1150)
VLM_AGENT_EPOCHS ?= 3
# A variable, since a comma in $(call)'s arguments would split them.
VLM_KINDS = perception,knowledge,both
VLM_READ_SEEDS ?= 1002 1003 1004 1005
VLM_READ_OPTS ?= --entities 96 --grid 4 --zoom-cells 2 --clutter 0 --kinds perception \
  --train 1 --test 1 --sft 0 --perceive 1000 $(VLM_AVOID) --avoid-by logo
VR = $(VLM_RUN)-read
VX = $(VLM_RUN)-experts
# The rows of world folder $(1) in file $(2), their image paths made absolute (files are joined).
ABS_ROWS = sed "s\#\"images\":\[\"\([a-z]*\)/\#\"images\":[\"$(abspath $(1))/\1/\#" $(2)
# Each skill in the order it comes, every later phase with the copying rows beside it (levers
# w, x: copying comes from the random model, not after seeing): 1. copying, o's 2000 knowledge
# trajectories of 50 worlds; 2. grounding at the zoom's scale (t), then 3. on whole scenes;
# reading that composes (v): 4. the reading worlds' logo files, 5. their crops, the logo files
# and half the grounding rows.
define VLM_SEE
	rm -rf $(VX)
	$(call EXPERTS,$(VX),$(VLM_COPY_SEEDS),$(VLM_EXPERT_OPTS) --kinds knowledge --sft 40,$(VLM_RUN)-random,knows)
	$(call VLM_SFT,$(VX)/knows.jsonl,$(VLM_RUN)-random,$(VLM_RUN)-1,6)
	sed -n '2~2p' $(VW)/perceive.jsonl | cat - $(VW)/perceive-zoomed.jsonl > $(VW)/ground.jsonl
	$(call ABS_ROWS,$(VW),$(VW)/perceive-zoomed.jsonl) | cat $(VX)/knows.jsonl - > $(VX)/zoomed.jsonl
	$(call ABS_ROWS,$(VW),$(VW)/ground.jsonl) | cat $(VX)/knows.jsonl - > $(VX)/ground.jsonl
	$(call VLM_SFT,$(VX)/zoomed.jsonl,$(VLM_RUN)-1,$(VLM_RUN)-2,4)
	$(call VLM_SFT,$(VX)/ground.jsonl,$(VLM_RUN)-2,$(VLM_RUN)-3,1)
	$(foreach s,$(VLM_READ_SEEDS),$(MARSCLI) toy-world $(VR)/$(s) $(VLM_READ_OPTS) --seed $(s) --force
	)
	for s in $(VLM_READ_SEEDS); do $(call ABS_ROWS,$(VR)/$$s,$(VR)/$$s/perceive-logos.jsonl); \
	  done > $(VR)/logos.jsonl
	for s in $(VLM_READ_SEEDS); do sed -n '1~2p' $(VR)/$$s/perceive.jsonl | $(call ABS_ROWS,$(VR)/$$s); \
	  done > $(VR)/crops.jsonl
	$(call ABS_ROWS,$(VW),$(VW)/ground.jsonl) | sed -n '1~2p' \
	  | cat $(VR)/crops.jsonl $(VR)/logos.jsonl - > $(VR)/mix.jsonl
	cat $(VR)/logos.jsonl $(VX)/knows.jsonl > $(VX)/logos.jsonl
	cat $(VR)/mix.jsonl $(VX)/knows.jsonl > $(VX)/read.jsonl
	$(call VLM_SFT,$(VX)/logos.jsonl,$(VLM_RUN)-3,$(VLM_RUN)-4,3)
	$(call VLM_SFT,$(VX)/read.jsonl,$(VLM_RUN)-4,$(VLM_RUN)-5,2)
endef
# 6. The agent's format (lever r's data, from a model that copies now): 60 expert trajectories of
# the three kinds in each of 50 more worlds. 7-8. Grounding in the tool call itself (lever ab):
# the perception trajectories cut after their zoom call (scripts/zoom_rows.py), 4 epochs twice
# (as measured: two runs, AdamW restarted between them); 9. the trajectories again with the zoom
# rows twice beside them, which brings back the turns after the zoom. 10. Reading in the agent's
# format (lever ag): the trajectories again with the reading worlds' crops beside them (phase 5's
# message rows), so that what the zoom's crop shows is read there. Then the greedy agent on world
# 1999 (KIND_PROBE).
VLM_ZOOM_EPOCHS ?= 4
define VLM_AGENT_PHASE
	$(call EXPERTS,$(VX),$(VLM_AGENT_SEEDS),$(VLM_EXPERT_OPTS) --kinds $(VLM_KINDS) --sft 60,$(VLM_RUN)-random,agent)
	$(call VLM_SFT,$(VX)/agent.jsonl,$(VLM_RUN)-5,$(VLM_RUN)-6,$(VLM_AGENT_EPOCHS))
	$(PY) scripts/zoom_rows.py $(VX)/agent.jsonl > $(VX)/zoom.jsonl
	cat $(VX)/zoom.jsonl $(VX)/zoom.jsonl $(VX)/agent.jsonl > $(VX)/agent-zoom.jsonl
	$(call VLM_SFT,$(VX)/zoom.jsonl,$(VLM_RUN)-6,$(VLM_RUN)-7,$(VLM_ZOOM_EPOCHS))
	$(call VLM_SFT,$(VX)/zoom.jsonl,$(VLM_RUN)-7,$(VLM_RUN)-8,$(VLM_ZOOM_EPOCHS))
	$(call VLM_SFT,$(VX)/agent-zoom.jsonl,$(VLM_RUN)-8,$(VLM_RUN)-9,2)
	cat $(VR)/crops.jsonl $(VX)/agent.jsonl > $(VX)/agent-crops.jsonl
	$(call VLM_SFT,$(VX)/agent-crops.jsonl,$(VLM_RUN)-9,$(VLM_RUN),2)
	$(call KIND_PROBE,$(VX),1999,$(VLM_EXPERT_OPTS) --kinds $(VLM_KINDS),$(VLM_RUN))
endef
else
VLM_AGENT ?= 1000
VLM_AGENT_EPOCHS ?= 12
VLM_WORLD_OPTS ?= --entities 8 --grid 4 --zoom-cells 2 --clutter 0 \
  --kinds perception,knowledge,both --train 192 --test 96 --sft 240 --perceive $(VLM_SCENES) \
  --seed 0
VLM_AGENT_OPTS ?= --entities 8 --grid 4 --zoom-cells 2 --clutter 0 --kinds perception \
  --train 16 --test 96 --sft $(VLM_AGENT) --seed 0
VLM_TEXT = vocab.txt
# f's three phases: all rows; the reading rows alone; all rows with the reading rows twice more.
define VLM_SEE
	sed -n '1~2p' $(VW)/perceive.jsonl > $(VW)/read.jsonl
	cat $(VW)/perceive.jsonl $(VW)/read.jsonl $(VW)/read.jsonl > $(VW)/mix.jsonl
	$(call VLM_SFT,$(VW)/perceive.jsonl,$(VLM_RUN)-random,$(VLM_RUN)-1,8)
	$(call VLM_SFT,$(VW)/read.jsonl,$(VLM_RUN)-1,$(VLM_RUN)-2,8)
	$(call VLM_SFT,$(VW)/mix.jsonl,$(VLM_RUN)-2,$(VLM_RUN)-3,1)
endef
# 4. The agent's format: the expert's trajectories of the demo's world, as many reading rows.
define VLM_AGENT_PHASE
	$(MARSCLI) toy-world $(VA) $(VLM_AGENT_OPTS) --force
	$(MARSCLI) index text $(VA)/corpus.jsonl -o $(VA)/text.sqlite --force
	$(PY) scripts/perception_probe.py $(VA) $(VLM_RUN)-3
	$(MARSCLI) rollout $(VA)/sft.jsonl --policy $(VLM_RUN)-3 -o $(VA)/trajectories.jsonl --force \
	  --engine replay -n 1 --system-prompt recipes/toy-system.txt
	head -n $(VLM_AGENT) $(VW)/read.jsonl | sed 's#"images":\["images/#"images":["$(abspath $(VW))/images/#' \
	  | cat $(VA)/trajectories.jsonl - > $(VA)/mix.jsonl
	$(call VLM_SFT,$(VA)/mix.jsonl,$(VLM_RUN)-3,$(VLM_RUN),$(VLM_AGENT_EPOCHS),frozen)
	$(PY) scripts/perception_probe.py $(VA) $(VLM_RUN)
endef
endif
VLM_MODEL_OPTS ?= --size tiny --min-pixels 16384 --max-pixels 16384 --seed 0
VLM_SFT = $(MARSCLI) sft $(1) --policy $(2) --out $(3) --epochs $(4) --lr 1e-3 --batch-size 16 \
  --lr-schedule $(if $(5),cosine --freeze-vision,constant) --seed 0 --force \
  --metrics $(3).metrics.jsonl
VW = $(VLM_RUN)-world
VA = $(VLM_RUN)-agent
# Expert worlds in the agent's format (tiny-vlm-search, VLM_GENERAL=1), through the toy world's
# three tools: world $(1)/$(2) of seed $(2) and options $(3), written, its text indexed.
SEARCH_TOOLS = --system-prompt recipes/toy-system.txt --image-search data
define EXPERT_WORLD
	$(MARSCLI) toy-world $(1)/$(2) $(3) --seed $(2) --force
	$(MARSCLI) index text $(1)/$(2)/corpus.jsonl -o $(1)/$(2)/text.sqlite --force
endef
# The worlds of seeds $(2) (options $(3), --sft rows among them) in folder $(1), each expert
# replayed by policy $(4) through the three tools into $(1)/SEED.jsonl, all joined into
# $(1)/$(5).jsonl: every world beside the others, so their image paths (relative to the folder)
# stay valid when they are joined.
define EXPERT_REPLAY
$(call EXPERT_WORLD,$(1),$(2),$(3) --test 1)
	$(MARSCLI) rollout $(1)/$(2)/sft.jsonl --policy $(4) -o $(1)/$(2).jsonl --force \
	  --engine replay -n 1 $(SEARCH_TOOLS) --text-search local:$(1)/$(2)/text.sqlite

endef
define EXPERTS
	mkdir -p $(1)
	$(foreach s,$(2),$(call EXPERT_REPLAY,$(1),$(s),$(3),$(4)))
	cat $(foreach s,$(2),$(1)/$(s).jsonl) > $(1)/$(5).jsonl
endef
# The greedy agent $(4) on the 96 test questions of world $(1)/$(2) (options $(3)), none of whose
# seeds it was trained on: per kind accuracy, tool use and found (scripts/kind_probe.py), i.e.
# whether its skills carry to companies and logos it never saw; into $(4)-probe.json.
define KIND_PROBE
$(call EXPERT_WORLD,$(1),$(2),$(3) --sft 1 --test 96)
	$(MARSCLI) eval $(1)/$(2)/test.jsonl --policy $(4) -o $(4)-probe.jsonl --judge exact \
	  $(GREEDY_OPTS) $(SEARCH_TOOLS) --text-search local:$(1)/$(2)/text.sqlite
	$(PY) scripts/kind_probe.py $(4)-probe.jsonl --out $(4)-probe.json
endef
.PHONY: tiny-vlm
tiny-vlm: setup
	$(MARSCLI) toy-world $(VW) $(VLM_WORLD_OPTS) --force
	$(MARSCLI) tiny-model $(VLM_RUN)-random --text $(VW)/$(VLM_TEXT) $(VLM_MODEL_OPTS) --force
	$(VLM_SEE)
	$(VLM_AGENT_PHASE)

# `make tiny-vlm-search`: the search protocol in the agent's format on top of a policy (VLM,
# default the committed model): SEARCH_PER_WORLD expert trajectories of SEARCH_KINDS in each of
# SEARCH_WORLDS worlds (seeds 1001, ...; none of the demo's), replayed through the three tools,
# SEARCH_EPOCHS epochs of SFT; then the greedy agent per kind on world SEARCH_TEST, of no
# training seed (scripts/kind_probe.py). About 7 minutes. Then
#   make demo VLM=runs/tiny-vlm-search KINDS=perception,knowledge,both
SEARCH_RUN ?= runs/tiny-vlm-search
SEARCH_WORLDS ?= 1
SEARCH_PER_WORLD ?= 1200
SEARCH_ENTITIES ?= 8
SEARCH_KINDS ?= perception,knowledge,both
SEARCH_EPOCHS ?= 6
SEARCH_TEST ?= 1999
# frozen: the vision tower frozen, a cosine schedule (a model that sees); empty: all weights at a
# constant rate (lever o, from a random model).
SEARCH_FROZEN ?= frozen
SEARCH_WORLD_OPTS ?= --entities $(SEARCH_ENTITIES) --grid 4 --zoom-cells 2 --clutter 0 \
  --kinds $(SEARCH_KINDS) --train 1 --avoid-seeds 0,1,2 --avoid-entities 8
SEARCH_FROM = $(or $(VLM),recipes/tiny-vlm)
SEARCH_SEEDS = $(shell seq 1001 $$((1000 + $(SEARCH_WORLDS))))
SW = $(SEARCH_RUN)-world
.PHONY: tiny-vlm-search
tiny-vlm-search: setup
	rm -rf $(SW)
	$(call EXPERTS,$(SW),$(SEARCH_SEEDS),$(SEARCH_WORLD_OPTS) --sft $(SEARCH_PER_WORLD),$(SEARCH_FROM),trajectories)
	$(call VLM_SFT,$(SW)/trajectories.jsonl,$(SEARCH_FROM),$(SEARCH_RUN),$(SEARCH_EPOCHS),$(SEARCH_FROZEN))
	$(call KIND_PROBE,$(SW),$(SEARCH_TEST),$(SEARCH_WORLD_OPTS),$(SEARCH_RUN))

RECIPE_INPUTS = $(WORLD)/text.sqlite.meta.json
