"""The policy server's state: the engine, the policy it holds (by path and fingerprint), awake
or asleep at which level, and the moves between them (`reload`, `sleep`, `wake`), each checked
before anything moves, so a refused one leaves the server as it was. The HTTP handler
(handler.py) calls it; vLLM comes in only through `start_engine` and weights.py."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marscli.engines import Generation, GenRequest
from marscli.engines.server import ASLEEP
from marscli.errors import BadInput, MarsError
from marscli.records.provenance import weights_fingerprint
from marscli.serving.guard import NOT_A_CHECKPOINT, Folders, HttpFailure, PixelBudget, log_refused
from marscli.serving.request import parse
from marscli.serving.weights import (
    check_complete,
    load_weights,
    tensor_difference,
    tensor_shapes,
    wake_weights,
)

RETRY_AFTER_S = 5  # an asleep server's Retry-After: a wake takes seconds (GPU) to ~25 s (CPU)


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
        r, params = parse(engine, body, self.folders, self.budget)
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
        self.names = self.names or tensor_shapes(path)

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
