"""What rollout, eval and ask generate with: `GenerationOptions`, each field its own option.

The three commands share these options (declared once here, `options.option`); each changes
only what it must (eval and ask are greedy; ask runs one trajectory). `check()` validates them
before anything is read or loaded: the ranges here, the engine's own rules in the engine
(`engines.check_engine`), which also refuses an option (`engines.EngineOptions`) the engine
does not take. Their `asdict` is the stage's sidecar config, so a run records exactly the
options that produced it. `JobOptions` are what a rollout or eval job reads and writes
besides. Light: the CLI imports this for `--help`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from marscli.configs import from_names
from marscli.engines import ENGINES, EngineOptions, SamplingParams, check_engine, split_engine
from marscli.errors import BadInput, check_range
from marscli.options import option, options_of
from marscli.records.provenance import note_inputs

if TYPE_CHECKING:
    from marscli.agent.loop import AgentConfig

# Upper bounds of the counts, so that a typo (-n 1000000000000) is refused before anything is
# read rather than growing memory until the OOM killer: far above any real setting.
MAX_SAMPLES = 1024  # -n, --samples: trajectories per prompt
MAX_BATCH = 4096  # --batch-size
MAX_TURNS = 100  # --max-turns (the paper: 10)
MAX_TOKENS = 1 << 20  # --max-turn-tokens, --max-response-tokens (the paper: 16,384)
# A search tool failing more often than this means a broken backend (agent/tool_health.py).
MAX_TOOL_FAILURE_RATE = 0.05


@dataclass
class GenerationOptions:
    """What rollout, eval and ask generate with; the CLI's options of the same names."""

    # engine
    engine: str = option("hf", "hf, vllm, server:URL (a `marscli serve` process), openai or "
                               "replay.")
    policy: str | None = option(None, "Checkpoint folder or hub id (hf, vllm, replay engines).")
    device: str = option("auto", "auto (cuda when available, else cpu), cpu or cuda (hf, vllm).")
    engine_opts: dict[str, Any] = options_of(EngineOptions)  # the engine's own (`options`)
    # sampling
    temperature: float = option(1.0, "Sampling temperature; 0: greedy.")
    top_p: float = option(1.0, "Nucleus sampling mass.")
    top_k: int = option(0, "Top-k sampling; 0: off.")
    presence_penalty: float = option(
        0.0, "Presence penalty in -2..2 (vllm and openai engines; the release samples with 1.5).")
    seed: int = option(0, "Sampling seed.")
    # limits
    max_turns: int | None = option(
        10, "Assistant turns at most (eval: 10 with --mode agent, 1 with direct).")
    max_turn_tokens: int = option(2_048, "Tokens per reply at most.", aliases=("--max-new-tokens",))
    max_response_tokens: int = option(16_384, "Model + tool tokens after the prompt, at most.")
    max_prompt_tokens: int | None = option(
        None, "Refuse a row whose first prompt (system, question, images) is longer than this "
              "(recorded with stop prompt_too_long, nothing generated); the model's context "
              "bounds it always.")
    batch_size: int = option(
        32, "Trajectories advanced together (the lock-step loop: the hf engine, --lockstep).")
    max_inflight: int | None = option(
        None, "Trajectories in flight at once in the asynchronous loop (vllm, server, openai "
              "engines; default: --batch-size).")
    lockstep: bool = option(
        False, "Advance trajectories together turn by turn even on an engine that batches "
               "continuously (each turn then waits for its slowest tool call).")
    # tools and search
    system_prompt: str | None = option(None, "File replacing the system prompt.", metavar="FILE")
    tools_config: str | None = option(
        None, "Tool schemas (the release's tools_*.yaml or a JSON list of OpenAI-style schemas): "
              "prompts are rendered by the policy's chat template with tools= instead of "
              "marscli's own # Tools block.", metavar="FILE")
    text_search: str | None = option(
        None, "Text search backend: local:INDEX, retriever:URL or serper.", metavar="SPEC")
    image_search: str | None = option(
        None, "Image search backend: data, local:INDEX or serper-lens.", metavar="SPEC")
    search_timeout: float = option(30.0, "Seconds per search request (text and image backends).")
    search_retries: int = option(2, "Retries after a failed search request (0: one attempt).")
    search_opts: dict[str, Any] = field(default_factory=dict)  # more SearchOptions fields (win)

    def __post_init__(self) -> None:
        self.engine_opts = {k: v for k, v in self.engine_opts.items() if v is not None}
        self.engine, url = split_engine(self.engine)  # --engine server:http://HOST:PORT
        if url is not None:
            self.engine_opts["base_url"] = url

    def check(self) -> None:
        """BadInput naming the option, before anything is read or loaded; then the files
        the stage will read besides its data (`read_paths`) are noted as its inputs."""
        from marscli.http import MAX_RETRIES, MAX_TIMEOUT  # requests: not on --help's path

        check_range("--temperature", self.temperature, 0)
        check_range("--top-p", self.top_p, 0, 1, lo_open=True)
        check_range("--top-k", self.top_k, 0)
        check_range("--presence-penalty", self.presence_penalty, -2, 2)
        if self.presence_penalty and not getattr(ENGINES.get(self.engine), "presence_penalty",
                                                 False):
            takes = [n for n in ENGINES.names() if getattr(ENGINES.get(n), "presence_penalty",
                                                           False)]
            raise BadInput(f"--presence-penalty: the {self.engine} engine has none — use "
                           f"--engine {' or '.join(takes)}")
        check_range("--max-turns", self.max_turns, 1, MAX_TURNS)
        check_range("--max-turn-tokens", self.max_turn_tokens, 1, MAX_TOKENS)
        check_range("--max-response-tokens", self.max_response_tokens, 1, MAX_TOKENS)
        check_range("--max-prompt-tokens", self.max_prompt_tokens, 1, MAX_TOKENS)
        check_range("--batch-size", self.batch_size, 1, MAX_BATCH)
        check_range("--max-inflight", self.max_inflight, 1, MAX_BATCH)
        check_range("--search-timeout", self.search_timeout, 0, MAX_TIMEOUT, lo_open=True)
        check_range("--search-retries", self.search_retries, 0, MAX_RETRIES)
        check_engine(self.engine, self.policy, self.engine_opts)
        self.tool_schemas()  # a bad --tools-config fails before anything is loaded
        # read as text, by transformers or by SQLite: the stage's outputs may not be them
        note_inputs(*self.read_paths(), files_in_folders=True)

    def tool_schemas(self) -> list[dict] | None:
        """The schemas of `--tools-config` (tools_config.load_tool_schemas), None without one."""
        if self.tools_config is None:
            return None
        from marscli.agent.tools_config import load_tool_schemas

        return load_tool_schemas(self.tools_config)

    def input_files(self) -> list[str]:
        """The files besides the stage's data that decide its output (for the sidecar)."""
        return [f for f in (self.system_prompt, self.tools_config) if f]

    def read_paths(self) -> list[str]:
        """What a tracker must never write into: `input_files`, the policy's folder (none for
        a hub id or a served model's name: nothing on this disk) and the local search indexes
        (`--text-search local:INDEX`, `--image-search local:INDEX`)."""
        from marscli.search import parse_spec

        folder = [self.policy] if self.policy and os.path.isdir(self.policy) else []
        indexes = [arg for name, arg in map(parse_spec, filter(None, (
            self.text_search, self.image_search))) if name == "local" and arg]
        return [*self.input_files(), *folder, *indexes]

    @property
    def policy_name(self) -> str:
        """What records carry as `policy`: the checkpoint, or the served model's name."""
        return self.policy if self.policy is not None else str(self.engine_opts.get("model") or "")

    def tools(self) -> list:
        """The tools offered to the model: zoom-in always, search where a backend is set."""
        from marscli.tools import build_tools

        opts = {"timeout": self.search_timeout, "attempts": self.search_retries + 1,
                **self.search_opts}
        return build_tools(text_search=self.text_search, image_search=self.image_search, **opts)

    @property
    def sampling(self) -> SamplingParams:
        """The fields of the same names; a reply's cap is `max_turn_tokens`."""
        return from_names(SamplingParams, self, max_new_tokens=self.max_turn_tokens)

    def agent_config(self, system_prompt: str | None) -> AgentConfig:
        """The fields of the same names (limits, batching); `system_prompt`: the text (the
        stage reads the file `self.system_prompt` early)."""
        from marscli.agent.loop import AgentConfig

        return from_names(
            AgentConfig, self, system_prompt=system_prompt, tool_schemas=self.tool_schemas(),
            max_turns=AgentConfig.max_turns if self.max_turns is None else self.max_turns,
            sampling=self.sampling)

    def sidecar(self, engine: Any) -> dict:
        """The sidecar's config: these options, the records' policy name, and the engine's
        own settings where it reports them (else the options it was given)."""
        config = engine.config() if hasattr(engine, "config") else dict(self.engine_opts)
        return {**asdict(self), "policy": self.policy_name, "engine_options": config}


@dataclass
class JobOptions:
    """What a rollout or eval job reads and writes besides its records."""

    shard: str | None = option(
        None, "Only the rows whose id hashes to shard i of N (0-based): the N shards together "
              "give one run's ids.", metavar="i/N")
    image_dir: str | None = option(
        None, "Folder the rows' image paths are relative to (default: the rows' own folder).",
        metavar="DIR")
    max_tool_failure_rate: float = option(
        MAX_TOOL_FAILURE_RATE, "A search tool's failure rate over this fraction means a "
        "broken backend: eval marks the benchmark and warns (also for the page fetches' or the "
        "judge's rate); rollout exits 1, keeping its records.")
    force: bool = option(
        False, "Start over: remove the output, its media, sidecar and settings first (without "
               "it, a rerun resumes, and refuses other settings).")
    track: str | None = option(
        None, "Also send metrics to a tracker: tensorboard:DIR, wandb:PROJECT (offline) or "
              "jsonl:FILE (default: $MARSCLI_TRACK, else none).", metavar="SPEC")

    def stage_kwargs(self) -> dict[str, Any]:
        """As the stages take them (`run_rollout`, `run_eval`): the shard parsed."""
        from marscli.records.shards import parse_shard

        return {**asdict(self), "shard": parse_shard(self.shard)}
