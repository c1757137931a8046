# recipes/eval-release.mk — evaluate a released checkpoint (SenseNova-MARS-8B/32B, or
# Qwen3-VL-8B-Instruct for the baseline) as the release evaluates it, beside the paper's settings.
#
#   make RECIPE=recipes/eval-release.mk runs/eval-release/eval/ckpt-0.summary.json \
#     BASE=/models/SenseNova-MARS-8B TEST=data/eval/hr_mmsearch \
#     SYSTEM_PROMPT=release-system.txt TOOLS_CONFIG=config/tool_config/tools_train.yaml
#
# BASE is linked as ckpt-0 (COLD_START=none, from recipes/mars-8b-release.mk, which this file
# includes; `make rl` with it trains as the release does). TEST is one of the release's
# data/eval/NAME folders (test_all.json: MMSearch, HR-MMSearch, V*, HR-Bench 4K/8K, MAT-Search,
# InfoSeek, FVQA, SimpleVQA, LiveVQA). SYSTEM_PROMPT is the release's system prompt, saved from
# its dataset manifest (the same text for every benchmark):
#   python3 -c 'import json; print(json.load(open("test_all.json"))["hr_mmsearch"]\
#     ["input_template"]["arguments"]["system_prompt"])' > release-system.txt
# TOOLS_CONFIG is the release's tool YAML, read as it is (`--tools-config`): the prompt is then
# rendered by the checkpoint's chat template with tools=, as verl's tool agent loop renders it.
# Left empty, marscli writes its own `# Tools` block and schemas after the system prompt.
#
# EVALUATOR picks which of the release's two official evaluators to follow (default verl):
#   verl       eval_single_node.sh: verl's validation pass (trainer.total_epochs=0), scoring by
#              verl/utils/reward_score/tool.py — the path the training code reports.
#   inference  inference/eval.sh + eval.py: the lighter OpenAI-client evaluator the release
#              added later, for an OpenAI-compatible server (serve_model.sh).
# Side by side ([paper] arXiv 2512.24330 as read through the release README and
# recipes/mars-8b.mk; "-" where what was read does not say):
# | setting        | paper              | verl (eval_single_node.sh)  | inference (eval.sh/eval.py) |
# |----------------|--------------------|-----------------------------|-----------------------------|
# | turns          | 10                 | 10 assistant turns          | 50 (--max-turns 50)         |
# | tokens         | 16,384 response    | 16,384 response, 8,192 per  | 4,096 per reply, no total   |
# |                |                    | tool response (tokens)      | (here: 50 x 4,096)          |
# | samples        | 8 for V*/HR-Bench  | 1 (val_kwargs.n=1)          | 1                           |
# | temperature    | -                  | 1.0                         | 0.7                         |
# | top-p / top-k  | -                  | 1.0 / 20                    | 0.8 / 20                    |
# | presence pen.  | -                  | 1.5 (repetition 1.0)        | 1.5 (repetition 1.0)        |
# | seed           | -                  | 3407, SGLang deterministic  | 3407                        |
# | engine         | -                  | SGLang, TP 2                | any OpenAI-compatible server|
# | judge          | GPT-4o             | gpt-4o-2024-11-20 (Azure),  | gpt-4o-2024-11-20, temp 0,  |
# |                |                    | 2 in flight, 300 s          | 5 retries, 300 s            |
# | judge sees     | -                  | the tagged answer; none: 0, | the tagged answer, else the |
# |                |                    | not asked (llm_score)       | whole last turn             |
# | MCQ scoring    | letter             | em_score_mcq (A-D)          | the same extractor          |
# | text search    | Serper + LLM       | tools_train.yaml even for   | Serper, pages fetched and   |
# |                | summariser         | val (TOOL_CONFIG_VAL): local| summarised by qwen3-32b,    |
# |                |                    | Wikipedia retrieval, top 3, | top 3 (the README says      |
# |                |                    | summarised by qwen3-32b     | Serper for validation too)  |
# | image search   | -                  | the cache in the data rows  | the cache in the data rows  |
# | system prompt  | -                  | test_all.json's, + tools=   | test_all.json's + "\n\n" +  |
# |                |                    | through the chat template   | a hand-written # Tools block|
# |                |                    | (tools_train.yaml schemas)  | (tools_eval.yaml schemas)   |
# | pixels         | -                  | 65,536 .. 8,294,400         | 65,536 .. 8,294,400         |
# | aggregation    | -                  | plain mean per benchmark    | plain mean per benchmark    |
# This recipe, per evaluator: --protocol release (verl) or release-inference (inference); the
# turns, token limits, samples, temperature, top-p, top-k and judge of that column; the image
# search cache (IMAGE_SEARCH=data); TEXT_SEARCH a variable: retriever:URL for verl's local
# retrieval (a Search-R1 server over the release's Wikipedia dump), serper for inference (set
# SERPER_API_KEY). The numbers printed beside ours (MARS-8B, MARS-32B) are the paper's.
# Departures (1 is a stand-in; 2-6 because marscli has no option for them today):
#  1. The presence penalty 1.5 is vLLM's (or the openai server's), standing for SGLang's.
#  2. The judge's prompt is marscli's own (judge.py), not the release's 13 principles; the model
#     and the asking (EM first, then one gold answer at a time, any Yes) are the release's.
#  3. Tool responses are truncated at 8,192 characters, not tokens (verl); the inference
#     evaluator does not truncate.
#  4. The text search summariser: marscli's `--text-search` backends return the retriever's or
#     Serper's text (optionally summarised by marscli's own summariser), not the release's
#     search server with its qwen3-32b mmsearch_r1 prompt.
#  5. The seed is marscli's per-request seed from EVAL_SEED (3407); SGLang's deterministic mode
#     has no counterpart, and vLLM's sampling differs from SGLang's in any case.
#  6. Unscored rows: a judge that fails after its retries leaves the row unscored (counted,
#     over --max-unscored exits 1); the release stops the run (inference) or continues if 95%
#     of its calls succeeded (verl).

EVALUATOR ?= verl
BASE ?= OpenSenseNova/SenseNova-MARS-8B
NAME ?= eval-release
TOOLS_CONFIG ?=
EVAL_SEED ?= 3407
EVAL_JUDGE ?= openai:gpt-4o-2024-11-20@https://api.openai.com/v1
IMAGE_SEARCH ?= data
ifeq ($(EVALUATOR),inference)
TEXT_SEARCH ?= serper
EVAL_PROTOCOL ?= release-inference
EVAL_SAMPLING ?= --samples 1 --temperature 0.7 --top-p 0.8 --top-k 20 --presence-penalty 1.5 --max-turns 50 \
  --max-turn-tokens 4096 --max-response-tokens 204800
EVAL_JUDGE_OPTS ?= --judge-timeout 300 --judge-retries 5 --judge-concurrency 64
else ifeq ($(EVALUATOR),verl)
TEXT_SEARCH ?= retriever:http://127.0.0.1:8000/retrieve
EVAL_PROTOCOL ?= release
EVAL_SAMPLING ?= --samples 1 --temperature 1.0 --top-p 1.0 --top-k 20 --presence-penalty 1.5 --max-turns 10 \
  --max-turn-tokens 16384 --max-response-tokens 16384
EVAL_JUDGE_OPTS ?= --judge-timeout 300 --judge-concurrency 2
else
$(error EVALUATOR=$(EVALUATOR): choose verl (eval_single_node.sh) or inference (inference/eval.py))
endif
include recipes/mars-8b-release.mk

EVAL_OPTS := --mode agent --engine $(ENGINE) --device $(DEVICE) --tensor-parallel $(TP) \
  --protocol $(EVAL_PROTOCOL) $(EVAL_SAMPLING) --seed $(EVAL_SEED) --judge $(EVAL_JUDGE) \
  $(EVAL_JUDGE_OPTS) $(AGENT_OPTS) $(if $(TOOLS_CONFIG),--tools-config $(TOOLS_CONFIG))
