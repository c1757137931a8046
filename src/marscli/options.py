"""The CLI's shared options, each declared once as a typer `Annotated` type.

A command names the type and gives the default (`temperature: opt.Temperature =
opt.GEN.temperature`): the defaults come from `GenerationOptions` except where a stage chooses
its own (eval and ask are greedy; ask's --policy is the released model).

Each stage's configuration is a dataclass whose fields are named as the command's parameters,
built once from the command's `locals()`: `config(UpdateConfig, locals())`,
`generation_options(locals())` (rollout, eval, ask), `judge_options(locals())` (eval). Only
light modules are imported here: `marscli --help` reads these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import typer

from marscli.agent.runner import GenerationOptions
from marscli.configs import from_names
from marscli.qwen.policy import DEFAULT_POLICY  # noqa: F401 - ask's default, re-exported

if TYPE_CHECKING:
    from marscli.scoring.judge import JudgeOptions

GEN = GenerationOptions()  # the shared defaults


def value_option(metavar: str, help: str) -> Any:
    """An optional option that takes one value (a file, a URL, a spec), shown as METAVAR."""
    return Annotated[str | None, typer.Option(metavar=metavar, help=help)]


# engine
Policy = Annotated[str | None, typer.Option(
    help="Checkpoint folder or hub id (hf, vllm, replay engines).")]
Engine = Annotated[str, typer.Option(
    help="hf, vllm, server:URL (a `marscli serve` process), openai or replay.")]
Device = Annotated[str, typer.Option(
    help="auto (cuda when available, else cpu), cpu or cuda (hf, vllm).")]
BaseUrl = value_option("URL", "openai: the server's base URL, e.g. http://127.0.0.1:8000/v1.")
Model = Annotated[str | None, typer.Option(help="openai: the served model's name.")]
ApiKeyEnv = value_option("VAR", "openai: environment variable holding the API key "
                                "(default OPENAI_API_KEY).")
TokenizeWith = value_option("CKPT", "openai: processor checkpoint for token-exact segments "
                                    "(without it, segments carry text only).")
Timeout = Annotated[float | None, typer.Option(
    help="openai, server: seconds per request (default 300, 600).")]
Retries = Annotated[int | None, typer.Option(
    help="openai, server: retries after a failed request (default 3, 8).")]
Concurrency = Annotated[int | None, typer.Option(
    help="openai, server: requests in flight (default 8, 64).")]
TensorParallel = Annotated[int | None, typer.Option(
    help="vllm: GPUs per model (tensor parallelism).")]
# The parameters above that go to the engine as `GenerationOptions.engine_opts`.
ENGINE_OPTIONS = ("base_url", "model", "api_key_env", "tokenize_with", "timeout", "retries",
                  "concurrency", "tensor_parallel")

# sampling and limits
Temperature = Annotated[float, typer.Option(help="Sampling temperature; 0: greedy.")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass.")]
TopK = Annotated[int, typer.Option(help="Top-k sampling; 0: off.")]
PresencePenalty = Annotated[float, typer.Option(
    help="Presence penalty in -2..2 (vllm and openai engines; the release samples with 1.5).")]
Seed = Annotated[int, typer.Option(help="Sampling seed.")]
MaxTurns = Annotated[int | None, typer.Option(
    help="Assistant turns at most (eval: 10 with --mode agent, 1 with direct).")]
MaxTurnTokens = Annotated[int, typer.Option(help="Tokens per reply at most.")]
MaxResponseTokens = Annotated[int, typer.Option(
    help="Model + tool tokens after the prompt, at most.")]
MaxPromptTokens = Annotated[int | None, typer.Option(
    help="Refuse a row whose first prompt (system, question, images) is longer than this "
         "(recorded with stop prompt_too_long, nothing generated); the model's context "
         "bounds it always.")]
BatchSize = Annotated[int, typer.Option(
    help="Trajectories advanced together (the lock-step loop: the hf engine, --lockstep).")]
MaxInflight = Annotated[int | None, typer.Option(
    help="Trajectories in flight at once in the asynchronous loop (vllm, server, openai "
         "engines; default: --batch-size).")]
Lockstep = Annotated[bool, typer.Option(
    "--lockstep", help="Advance trajectories together turn by turn even on an engine that "
                       "batches continuously (each turn then waits for its slowest tool call).")]

# inputs, tools and search
Shard = value_option("i/N", "Only the rows whose id hashes to shard i of N (0-based): the N shards "
                            "together give one run's ids.")
ImageDir = value_option("DIR", "Folder the rows' image paths are relative to (default: the rows' "
                               "own folder).")
SystemPrompt = value_option("FILE", "File replacing the system prompt.")
ToolsConfig = value_option("FILE", "Tool schemas (the release's tools_*.yaml or a JSON list of "
                                   "OpenAI-style schemas): prompts are rendered by the policy's "
                                   "chat template with tools= instead of marscli's own # Tools "
                                   "block.")
TextSearch = value_option("SPEC", "Text search backend: local:INDEX, retriever:URL or serper.")
ImageSearch = value_option("SPEC", "Image search backend: data, local:INDEX or serper-lens.")
SearchTimeout = Annotated[float, typer.Option(
    help="Seconds per search request (text and image backends).")]
SearchRetries = Annotated[int, typer.Option(
    help="Retries after a failed search request (0: one attempt).")]

Force = Annotated[bool, typer.Option(
    "--force", help="Start over: remove the output, its media, sidecar and settings first "
                    "(without it, a rerun resumes, and refuses other settings).")]

# judging (reward and eval); the defaults are judge.JudgeOptions' (not imported: it loads
# an HTTP client), --judge-retries counting the attempts after the first
JUDGE, MAX_UNSCORED, JUDGE_TIMEOUT, JUDGE_RETRIES, JUDGE_CONCURRENCY = "exact", 0.05, 60.0, 2, 8
Judge = Annotated[str, typer.Option(
    help="exact (no judge: non-exact answers score 0) or openai:MODEL@URL (an OpenAI-compatible "
         "chat API; key from OPENAI_API_KEY or JUDGE_API_KEY); the release judges with GPT-4o.")]
MaxUnscored = Annotated[float, typer.Option(
    help="Exit 1 when more than this fraction of rows is unscored (judge or engine failures).")]
MAX_TOOL_FAILURE_RATE = 0.05  # marscli.agent.tool_health.MAX_TOOL_FAILURE_RATE (light here)
MaxToolFailureRate = Annotated[float, typer.Option(
    help="A search tool's failure rate over this fraction means a broken backend: eval marks "
         "the benchmark and warns (also for the page fetches' or the judge's rate); rollout "
         "exits 1, keeping its records.")]
JudgeTimeout = Annotated[float, typer.Option(help="Seconds per judge request.")]
JudgeRetries = Annotated[int, typer.Option(
    help="Retries after a failed judge request (0: one attempt).")]
JudgeConcurrency = Annotated[int, typer.Option(help="Judge requests in flight.")]
JudgeCache = value_option("PATH", "SQLite verdict cache (default: "
                                  "$MARSCLI_CACHE_DIR/judge.sqlite or "
                                  "~/.cache/marscli/judge.sqlite).")


# training (update and sft); each stage gives its own defaults
PolicyIn = Annotated[str, typer.Option(help="Input checkpoint (HF folder); left untouched.")]
OutCkpt = Annotated[str, typer.Option(help="Output checkpoint folder (must not exist).")]
AdamBeta1 = Annotated[float, typer.Option()]
AdamBeta2 = Annotated[float, typer.Option()]
AdamEps = Annotated[float, typer.Option()]
WeightDecay = Annotated[float, typer.Option()]
GradClip = Annotated[float, typer.Option(help="Clip the gradient norm (0: off).")]
FreezeVision = Annotated[bool, typer.Option(
    "--freeze-vision", help="Do not train the vision tower and projector.")]
GradientCheckpointing = Annotated[bool, typer.Option(
    "--gradient-checkpointing", help="Recompute activations in backward.")]
LogpChunk = Annotated[int | None, typer.Option(
    metavar="C", help="Loss positions whose logits [C, vocab] are formed at once: the "
    "log-probs and their backward go a chunk at a time (default: the largest power of two "
    "whose logits take at most 3 GiB, 1024 at Qwen's vocabulary, or --micro-batch-tokens "
    "when smaller; at most --micro-batch-tokens).")]
DeepSpeed = value_option("CONFIG", "DeepSpeed JSON config (recipes/ds_zero2.json, ds_zero3.json).")
Metrics = value_option("FILE", "Metrics JSONL, one line per step (default: OUT/metrics.jsonl).")
TrainDevice = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
Track = value_option("SPEC", "Also send metrics to a tracker: tensorboard:DIR, wandb:PROJECT "
                             "(offline) or jsonl:FILE (default: $MARSCLI_TRACK, else none).")
SaveDtype = Annotated[str, typer.Option(
    help="Of the HF export engines load: auto (bfloat16 on CUDA, float32 on CPU), float32, "
         "bfloat16 or input. The fp32 masters stay in OUT/train_state/.")]
StateDir = value_option("DIR", "Write train_state/ into DIR/<OUT's name> (node-local storage: "
                               "/dev/shm, a local NVMe) and OUT/train_state as a link to it "
                               "(make rl STATE_DIR=...; `marscli state` copies it durably).")


# A stage's config (a dataclass) from a command's parameters (its `locals()`), by field name;
# fields without a parameter keep their defaults. Checked by the stage.
config = from_names


def generation_options(params: Mapping[str, Any]) -> GenerationOptions:
    """A command's parameters as `GenerationOptions`: the fields by name, the engine options
    given (not None) as `engine_opts`. Checked where it is used."""
    return config(GenerationOptions, params,
                  engine_opts={k: params.get(k) for k in ENGINE_OPTIONS})


def judge_options(params: Mapping[str, Any], check: bool = True) -> JudgeOptions:
    """A command's `--judge-*` parameters as `judge.JudgeOptions`, checked (BadInput naming the
    option) before anything is read; `check=False` leaves that to the stage (reward checks its
    own options first, in the order its errors have always come)."""
    from marscli.scoring.judge import JudgeOptions  # an HTTP client: not for --help

    opts = JudgeOptions(timeout_s=params["judge_timeout"], attempts=params["judge_retries"] + 1,
                        concurrency=params["judge_concurrency"],
                        cache_path=params.get("judge_cache"))
    if check:
        opts.check()
    return opts
