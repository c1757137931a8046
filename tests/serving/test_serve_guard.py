"""What `marscli serve` lets in (issue 33, case 7), without vLLM: images and checkpoints only
under --allow-dir, one reply for everything else; a pixel budget read from headers before any
decoding; a bounded pool of handler threads, a deep listen queue and an idle timeout."""

from __future__ import annotations

import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import requests
from PIL import Image

from marscli.engines import Generation
from marscli.qwen.policy import load_processor
from marscli.serving import guard, request
from marscli.serving.guard import Folders, HttpFailure, PixelBudget, PooledHTTPServer
from marscli.serving.handler import make_handler
from marscli.serving.state import PolicyServer


class Engine:
    """Enough of VLLMEngine for `parse`: the tiny model's processor; replies echo the image
    count."""

    def __init__(self, processor) -> None:
        self.processor = processor
        self.loop = SimpleNamespace(inflight=0)

    def prepare(self, r, params, key):
        return Generation([len(r.images)], [-1.0], "length")

    def config(self) -> dict:
        return {"vllm": "fake", "max_model_len": 64, "sleep_mode": False}


@pytest.fixture
def served(tiny_model, tmp_path):
    """A PolicyServer allowed to read tmp_path/data only, behind the real handler and pool."""
    data = tmp_path / "data"
    data.mkdir()
    engine = Engine(load_processor(str(tiny_model)))
    server = PolicyServer(None, start=lambda path: engine, folders=Folders([str(data)], None))
    server.engine, server.policy, server.level = engine, str(tiny_model), None
    http = PooledHTTPServer(("127.0.0.1", 0), make_handler(server), workers=8)
    threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{http.server_port}", data, server
    http.shutdown()
    http.server_close()


def generate(url: str, *paths) -> requests.Response:
    return requests.post(f"{url}/generate", timeout=60, json={
        "tokens": [1, *[-4] * len(paths), 2], "images": [{"path": str(p)} for p in paths],
        "max_new_tokens": 2})


def test_images_only_under_allow_dir_and_one_reply_for_everything_else(served, tmp_path):
    url, data, _ = served
    Image.new("RGB", (64, 64), "red").save(data / "ok.png")
    assert generate(url, data / "ok.png").json()["tokens"] == [1]
    outside = tmp_path / "outside.png"
    Image.new("RGB", (64, 64), "red").save(outside)
    (data / "notes.png").write_text("not an image")
    (data / "link.png").symlink_to(outside)  # inside by name, outside once resolved
    (data / "dev.png").symlink_to("/dev/zero")
    (data / "sub").mkdir()
    replies = [generate(url, p) for p in (
        outside, data / "missing.png", data / "notes.png", data / "link.png", data / "dev.png",
        data / "sub", "/proc/self/cwd", data / ".." / "outside.png")]
    assert {r.status_code for r in replies} == {400}
    assert {r.json()["error"] for r in replies} == {"images[0]: not an image this server may read"}
    # checkpoints likewise: nothing about the server's disk in the reply
    r = requests.post(f"{url}/reload", json={"policy": "/proc/self/cwd"}, timeout=30)
    assert r.status_code == 400 and "/" not in r.json()["error"].split("(")[0], r.json()
    assert os.getcwd() not in r.text


def test_a_huge_image_is_refused_from_its_header_before_decoding(served, monkeypatch):
    url, data, server = served
    # 14000 x 14000 in a 1-bit PNG: ~25 KB on disk, 196 million pixels
    Image.new("1", (14000, 14000)).save(data / "huge.png", optimize=True)
    assert (data / "huge.png").stat().st_size < 100_000
    decoded = []
    monkeypatch.setattr(request, "decode", lambda f, i: decoded.append(f))
    r = generate(url, data / "huge.png")
    assert r.status_code == 413 and "196,000,000 pixels" in r.json()["error"]
    assert decoded == [] and server.budget.used == 0


def test_the_inflight_budget_makes_later_requests_wait_then_retry(monkeypatch):
    monkeypatch.setattr(guard, "BUDGET_WAIT_S", 0.2)
    budget = PixelBudget(per_request=100, inflight=150)
    with budget.hold(100):
        t0 = time.monotonic()
        with pytest.raises(HttpFailure) as e, budget.hold(60):
            pass
        assert e.value.code == 503 and e.value.headers == {"Retry-After": "1"}
        assert time.monotonic() - t0 >= 0.2
        with budget.hold(50):  # room for this one
            assert budget.used == 150
    assert budget.used == 0

    def holder() -> None:
        with budget.hold(100):
            time.sleep(0.1)

    t = threading.Thread(target=holder)
    t.start()
    time.sleep(0.02)
    with budget.hold(100):  # waits until the holder is done, within BUDGET_WAIT_S
        assert budget.used == 100
    t.join()


class Slow(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 0.5
    threads: ClassVar[set[str]] = set()

    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:
        Slow.threads.add(threading.current_thread().name)
        time.sleep(0.05)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def test_many_fresh_connections_on_a_bounded_pool_and_idle_ones_are_closed():
    http = PooledHTTPServer(("127.0.0.1", 0), Slow, workers=4)
    threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{http.server_port}/"
        results: list[int] = []

        def client() -> None:
            with requests.Session() as s:  # a fresh connection each
                results.append(s.get(url, timeout=60).status_code)

        clients = [threading.Thread(target=client) for _ in range(64)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert results == [200] * 64  # no resets: the backlog held them
        assert 1 <= len(Slow.threads) <= 4  # and at most 4 threads served them
        idle = socket.create_connection(("127.0.0.1", http.server_port))
        idle.settimeout(10)
        t0 = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server after Slow.timeout
        assert time.monotonic() - t0 < 5
        idle.close()
    finally:
        http.shutdown()
        http.server_close()


def test_serve_refuses_a_missing_allow_dir(tiny_model, tmp_path):
    from marscli.errors import BadInput
    from marscli.stages.serve import serve

    with pytest.raises(BadInput, match=r"^--allow-dir: \S+/nope: not a folder$"):
        serve(str(tiny_model), port=0, allow_dir=[str(Path(tmp_path) / "nope")])


def test_checkpoint_replies_never_map_the_servers_disk(tiny_model, tmp_path, monkeypatch,
                                                       capfd):
    """The default folders (the working one): `/reload /proc/self/cwd` used to reply "TMP: no
    config.json", and inside them a missing folder, a folder that is not a checkpoint and a
    damaged one each got their own reply. Now: one reply, the reason in the server's log; only
    another architecture is said, naming the policy as the client sent it."""
    import shutil

    monkeypatch.chdir(tmp_path)
    engine = Engine(load_processor(str(tiny_model)))
    server = PolicyServer(None, start=lambda path: engine)  # default folders: the cwd
    server.engine, server.policy, server.level = engine, str(tiny_model), None
    assert server.folders.dirs == [tmp_path.resolve()]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    shutil.copytree(tiny_model, tmp_path / "broken")
    (tmp_path / "broken" / "config.json").write_text("{")
    http = PooledHTTPServer(("127.0.0.1", 0), make_handler(server), workers=4)
    threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{http.server_port}"
    try:
        replies = [requests.post(f"{url}/{endpoint}", json={"policy": p}, timeout=30)
                   for endpoint in ("reload", "wake")
                   for p in ("/proc/self/cwd", str(tmp_path / "notes"), "notes", "missing",
                             str(tmp_path / "broken"), str(tmp_path / "notes" / "a.txt"))]
        assert {r.status_code for r in replies} == {400}
        assert all(str(tmp_path) not in r.text for r in replies)
        assert {r.json()["error"] for r in replies} == {
            "policy: not a checkpoint this server may load (a folder under its --allow-dir)"}
        log = capfd.readouterr().err
        assert "no config.json" in log and "not valid JSON" in log  # the operator is told
        # another architecture: said, naming what the client sent, not where it leads
        shutil.copytree(tiny_model, tmp_path / "models" / "ckpt")
        (tmp_path / "ckpt").symlink_to(tmp_path / "models" / "ckpt")
        server.names = {"other.weight": [1]}
        r = requests.post(f"{url}/reload", json={"policy": "ckpt"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"].startswith(
            "policy ckpt: other tensors than the served checkpoint's"), r.text
        assert str(tmp_path) not in r.text and server.policy == str(tiny_model)
    finally:
        http.shutdown()
        http.server_close()
