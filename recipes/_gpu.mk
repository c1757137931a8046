# recipes/_gpu.mk — what the GPU recipes (mars-8b.mk, mars-8b-release.mk, mars-32b.mk) share:
# how many GPUs, processes and nodes each stage gets, the Slurm requests that say so, and the
# files you provide. Included by them after their own settings (everything here is `?=`).
# Every value is marscli's choice for nodes of 8 GPUs unless it says otherwise; override any on
# the command line or in the environment.

# --- Environment: `make vllm-gpu` builds GPU_VENV (scripts/vllm-gpu-venv.sh: CUDA vLLM with
# the torch it pins, DeepSpeed, marscli; CUDA 13.0, NVIDIA driver >= 580, docs/gpu.md). Every
# stage runs its marscli (STAGE_VENV: the Makefile puts MARSCLI=... on each stage's line), and
# so do the servers (SERVE=1); make's own commands (merge, plan) stay `make setup`'s .venv.
GPU_VENV ?= .venv-gpu
STAGE_VENV ?= $(GPU_VENV)
SERVE_MARSCLI ?= $(abspath $(GPU_VENV))/bin/marscli

# --- Launch shape (stages/_common.sh reads NPROC, NNODES, GPUS_PER_NODE, MASTER_PORT) --------
# 8 GPUs a node, as the release's train_multi_node.sh (trainer.n_gpus_per_node=8).
GPUS_PER_NODE ?= 8
# Nodes for update and sft: one srun task per node, each a torchrun agent of NPROC ranks, with
# the rendezvous on the first node. The release runs on NNODES nodes the user chooses.
NNODES ?= 1
NPROC ?= $(GPUS_PER_NODE)
# Rollout and eval: SHARDS array tasks, each one vLLM engine over TP GPUs: as many GPUs as the
# update uses.
TP ?= 1
SHARDS ?= $(shell echo $$(( $(GPUS_PER_NODE) * $(NNODES) / $(TP) )))
# SERVE=1: a server per group of TP GPUs on each node (stages/serve.sh gives server i the
# node's i-th group), as many as the shards.
SERVERS ?= $(SHARDS)
export TP
DEVICE ?= cuda
ENGINE ?= vllm
# The engine's own options, which whoever starts the engine takes: rollout and eval without
# SERVE (STAGE_VLLM_OPTS, in the recipes' ROLLOUT_OPTS and EVAL_OPTS); with SERVE=1 the servers
# (SERVE_OPTS), and rollout and eval, generating through --engine server:URL, get none of them
# (the server engine refuses them). The context and the GPU share are `make plan`'s below.
VLLM_OPTS ?= --tensor-parallel $(TP)
STAGE_VLLM_OPTS = $(if $(filter 1,$(SERVE)),,$(VLLM_OPTS))
SERVE_OPTS ?= --device $(DEVICE) $(VLLM_OPTS) --max-model-len $(MAX_MODEL_LEN) \
  --gpu-memory-utilization $(GPU_MEMORY_UTILIZATION)

# --- make plan (the memory plan per GPU, see the Makefile): what the recipes do not say -------
# The model's config.json when BASE is not a local folder: Qwen3-VL-8B-Instruct's, shipped
# (recipes/qwen3-vl-32b.config.json for mars-32b.mk; the README's "Memory plan" cites them).
MODEL_CONFIG ?= recipes/qwen3-vl-8b.config.json
# The vllm engine's defaults (engines/vllm.py): context length and GPU share (SERVE=1 gives
# them to the servers). Sequences at
# once: rollout's --batch-size (32 unless ROLLOUT_OPTS says), or with SERVE=1 the server's
# --max-batch (256 unless SERVE_OPTS says). GPU_MEMORY: one GPU's memory.
MAX_MODEL_LEN ?= 32768
GPU_MEMORY_UTILIZATION ?= 0.85
MAX_NUM_SEQS ?= $(if $(filter 1,$(SERVE)),$(or $(call opt_value,--max-batch,$(SERVE_OPTS)),256),$(or \
  $(call opt_value,--batch-size,$(ROLLOUT_OPTS)),32))
GPU_MEMORY ?= 80GiB
# make rl and rl-job run `make plan`'s arithmetic first and refuse a launch that does not fit
# (one line: the reason); PLAN_CHECK=0 launches anyway (a GPU or engine the plan misjudges).
PLAN_CHECK ?= 1

# --- Slurm (SLURM=1): per-stage sbatch options; SBATCH_OPTS (partition, account, --time) is
# yours. CPUs: CPUS_PER_GPU per GPU for the GPU stages (marscli's choice: image decoding and the
# tools run on the CPU); the judge's requests wait on the network.
CPUS_PER_GPU ?= 8
# Host memory: a cluster's default per CPU is often a few GB, less than a stage holds — update
# loads its model share on the CPU (`make plan`'s host memory line), a server asleep at level 1
# keeps its weights there (16 GB at 8B), images decode there. MEM_PER_GPU for the GPU stages
# and servers, MEM_CPU for the CPU-only ones (reward, advantages, a served rollout); whole
# nodes (rl-job) take all of theirs (--mem=0). Empty: the cluster's default.
MEM_PER_GPU ?= 64G
MEM_CPU ?= 32G
SBATCH_MEM_GPU = $(if $(MEM_PER_GPU),--mem-per-gpu=$(MEM_PER_GPU))
SBATCH_MEM_CPU = $(if $(MEM_CPU),--mem=$(MEM_CPU))
# With SERVE=1 rollout and eval generate through the servers: CPUs only (the tools, images).
SBATCH_ROLLOUT ?= $(if $(filter 1,$(SERVE)),--cpus-per-task=$(CPUS_PER_GPU) $(SBATCH_MEM_CPU),\
  --gres=gpu:$(TP) --cpus-per-gpu=$(CPUS_PER_GPU) $(SBATCH_MEM_GPU))
SBATCH_EVAL ?= $(SBATCH_ROLLOUT)
SBATCH_REWARD ?= --cpus-per-task=4 $(SBATCH_MEM_CPU)
SBATCH_ADVANTAGES ?= --cpus-per-task=1 $(SBATCH_MEM_CPU)
SBATCH_UPDATE ?= --nodes=$(NNODES) --ntasks-per-node=1 --gres=gpu:$(GPUS_PER_NODE) \
  --cpus-per-gpu=$(CPUS_PER_GPU) $(SBATCH_MEM_GPU)
# SFT asks for what update asks for (so SBATCH_UPDATE=... sets both, unless SBATCH_SFT is set).
SBATCH_SFT ?= $(SBATCH_UPDATE)
# The servers (SERVE=1): SLURM=1, an array job of TP GPUs a task; SLURM=steps, one step of a
# task per GPU group on every node, holding the nodes' GPUs (each task takes its group).
# (SLURM=steps needs COLOCATE=1 with SERVE=1: the update step overlaps these GPUs.)
SBATCH_SERVE ?= --gres=gpu:$(TP) --cpus-per-gpu=$(CPUS_PER_GPU) $(SBATCH_MEM_GPU)
SRUN_SERVE ?= --nodes=$(NNODES) --ntasks-per-node=$$(( $(GPUS_PER_NODE) / $(TP) )) \
  --gres=gpu:$(GPUS_PER_NODE) --cpus-per-gpu=$(CPUS_PER_GPU) $(SBATCH_MEM_GPU)
# SLURM=steps (make rl-job): the allocation, whole nodes with their GPUs.
SBATCH_JOB ?= --nodes=$(NNODES) --exclusive --gres=gpu:$(GPUS_PER_NODE) --mem=0

# --- Disk: the HF exports. Each is ~17 GB at 8B, ~67 GB at 32B (`make plan`'s disk table):
# all 300 of a run are ~5 TB and ~20 TB. Keep the last 3 (what the next update and a state redo
# read, KEEP_STATE and PERSIST_EVERY's defaults), besides ckpt-0 and the checkpoints rl-eval
# evaluates (EVAL_CKPTS: with EVAL_EVERY=1, the default, every one, so set EVAL_EVERY=10 or so
# to prune). KEEP_EXPORTS= (empty) keeps every export.
KEEP_EXPORTS ?= 3
# RUN must live on a file system every node reaches at the same path (the cluster's shared
# /scratch or /project; not node-local disk), as every stage of every node reads and writes it;
# not inside the checkout when update runs on several nodes (NNODES > 1) or under Slurm, unless
# the checkout is itself on that shared file system: RUN=/scratch/$USER/runs/mars-8b.

# --- What you provide: BASE (a local Qwen3-VL folder, BASE=/models/Qwen3-VL-8B-Instruct; the
# Makefile sets HF_HUB_OFFLINE=1, so a hub id works only if it is in your HF cache), PROMPTS and
# TEST as JSONL (MARS-style rows are read as they are), and, for COLD_START=sft, SFT_DATA:
# cold-start trajectories, e.g. from `rollout --engine openai --tokenize-with BASE` + `reward`
# + a jq filter on the reward.
$(PROMPTS) $(TEST):
	@echo "$@ not found: set PROMPTS= and TEST= to your JSONL files (see $(RECIPE))" >&2; exit 2

$(SFT_DATA).meta.json:
	@test -f $(SFT_DATA) || { echo "SFT_DATA=$(SFT_DATA) not found: make cold-start trajectories first" >&2; exit 2; }
	@touch $@

RECIPE_INPUTS =
