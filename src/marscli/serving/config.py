"""`marscli serve`'s and `marscli serve-ctl`'s options, each declared once (light: the CLI
imports it for --help)."""

from __future__ import annotations

from dataclasses import dataclass

from marscli.options import option

MAX_REQUEST_PIXELS = 100_000_000  # one request's images (rollout's own source limit)
MAX_INFLIGHT_PIXELS = 200_000_000  # all requests' images being decoded at once (~600 MB RGB)


@dataclass
class ServeConfig:
    port: int = option(8471, "Port to listen on (0: any free one).")
    host: str = option(
        "127.0.0.1", "Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every "
                     "interface, for rollouts on other nodes).")
    device: str = option("auto", "auto (cuda when available, else cpu), cpu or cuda.")
    tensor_parallel: int = option(1, "GPUs per model (tensor parallelism).")
    max_batch: int = option(256, "Sequences vLLM batches at once.")
    max_model_len: int | None = option(
        None, "Context length (default: the model's, at most 32,768).")
    gpu_memory_utilization: float = option(
        0.85, "The share of each GPU's memory vLLM takes for weights and KV cache (GPUs only; "
              "--kv-cache-gib sets the cache instead).")
    kv_cache_gib: float | None = option(
        None, "KV cache size in GiB (default on CPU: 1; on GPUs: a share of the memory).")
    sleep_mode: bool = option(
        True, "vLLM's sleep mode where it has one (CUDA, ROCm): POST /sleep releases the GPU "
              "memory in place. Without it, and on vLLM-CPU, /sleep frees the engine and the "
              "wake builds a new one.", decls=("--sleep-mode/--no-sleep-mode",))
    allow_dir: list[str] | None = option(
        None, "A folder whose images and checkpoints requests may name (repeat it; default: "
              "the working folder and POLICY's parent).", metavar="DIR")
    max_request_pixels: int = option(
        MAX_REQUEST_PIXELS, "Pixels of one request's images at most (413 beyond).")
    max_inflight_pixels: int = option(
        MAX_INFLIGHT_PIXELS,
        "Pixels being decoded at once, all requests (503 + Retry-After beyond).")
    api_key_file: str | None = option(
        None, "A file (mode 600) holding a token: every request but GET /health must send "
              "Authorization: Bearer <token> (401 otherwise); clients read it from "
              "MARSCLI_SERVE_TOKEN_FILE.", metavar="FILE")


@dataclass
class ControlConfig:
    """`marscli serve-ctl URL ACTION`'s options."""

    policy: str | None = option(
        None, "wake: the checkpoint to wake with (default: the one the server holds).")
    level: int | None = option(
        None, "sleep: 1 keeps the weights in host memory, 2 drops them (default 1).")
    timeout: float = option(
        600.0, "Seconds in all, retries included (a connect waits at most 10 s).")
    retries: int = option(
        8, "Retries while the server does not answer (a refused connect is not retried).")
    if_awake: bool = option(
        False, "sleep: a server asleep already is left as it is (its health printed, exit 0) "
               "instead of refused.")
