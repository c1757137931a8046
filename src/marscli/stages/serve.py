"""`marscli serve [POLICY] --port P`: one vLLM engine kept up for a whole RL run, over HTTP
(the server itself, its endpoints and what it lets in: marscli.serving). This stage checks the
options and the first checkpoint, binds the port, and serves until interrupted."""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from marscli.engines.server import read_token
from marscli.errors import BadInput, check_range
from marscli.serving.guard import (
    MAX_INFLIGHT_PIXELS,
    MAX_REQUEST_PIXELS,
    Folders,
    PixelBudget,
    PooledHTTPServer,
)
from marscli.serving.handler import make_handler
from marscli.serving.state import PolicyServer

MAX_BATCH = 65536  # --max-batch: sequences vLLM batches at once


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
