"""The `server` engine's client side against a fake `marscli serve` (no vLLM): the reload it
asks for, the policy check on every reply, 4xx as an engine error, a server gone for good as a
stage failure, a URL that is not a marscli server. The real server: tests/test_serve.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from marscli.agent.runner import GenerationOptions
from marscli.engines import GenRequest, SamplingParams, make_engine
from marscli.errors import BadInput, RuntimeFailure

from fakes import FakeServer, always, sequence


def health(policy: Path) -> dict:
    return {"ok": True, "policy": str(policy), "inflight": 0}


def reply(policy: Path, tokens=(5, 6)) -> dict:
    return {"tokens": list(tokens), "logprobs": [-1.0] * len(tokens), "finish": "length",
            "policy": str(policy)}


REQ = GenRequest([1, 2, 3], max_new_tokens=2, key="q#0", turn=1)


def test_engine_spelling_and_options():
    gen = GenerationOptions(engine="server:http://h:1")
    assert gen.engine == "server" and gen.engine_opts == {"base_url": "http://h:1"}
    with pytest.raises(BadInput, match="server:http://HOST:PORT"):
        GenerationOptions(engine="server").check()
    with pytest.raises(BadInput, match="expected an http"):
        GenerationOptions(engine="server:ftp://h").check()


def test_policy_moves_the_server_and_every_reply_is_checked(tiny_model, tmp_path):
    other = tmp_path / "other"  # another checkpoint folder (a link would be the same one)
    shutil.copytree(tiny_model, other)
    with FakeServer({"/health": always(200, health(other)),
                     "/reload": always(200, {"policy": str(tiny_model), "reloaded": True}),
                     "/generate": sequence(reply(tiny_model), reply(other))}) as srv:
        eng = make_engine("server", str(tiny_model), base_url=srv.url)
        (rel,) = [r for r in srv.log if r["path"] == "/reload"]
        assert rel["body"] == {"policy": str(Path(tiny_model).resolve())}
        g = eng.generate([REQ], SamplingParams(seed=7))[0]
        assert (g.tokens, g.finish, eng.policy_name) == ([5, 6], "length", str(tiny_model))
        sent = next(r for r in srv.log if r["path"] == "/generate")["body"]
        assert (sent["key"], sent["turn"], sent["seed"], sent["tokens"]) == ("q#0", 1, 7, [1, 2, 3])
        with pytest.raises(RuntimeFailure, match="reloaded during this run"):
            eng.generate([REQ], SamplingParams())


def test_4xx_ends_one_trajectory_and_a_gone_server_fails_the_stage(tiny_model):
    with FakeServer({"/health": always(200, health(tiny_model)),
                     "/generate": always(400, {"error": "tokens: bad"})}) as srv:
        eng = make_engine("server", None, base_url=srv.url, retries=1, backoff=0.01)
        g = eng.generate([REQ], SamplingParams())[0]
        assert g.finish == "error" and "HTTP 400" in g.error and eng.policy_name == str(tiny_model)
        srv.routes["/generate"] = always(503, "restarting")
        with pytest.raises(RuntimeFailure, match="start it again and re-run"):
            eng.generate([REQ], SamplingParams())


def test_a_url_that_is_not_a_marscli_server():
    with FakeServer(always(200, "hello")) as srv, \
            pytest.raises(RuntimeFailure, match="not a marscli serve reply"):
        make_engine("server", None, base_url=srv.url)


def test_serve_refuses_a_port_in_use_before_loading_anything(tiny_model):
    """Bound before the engine loads: a busy port is one line and exit 1 at once (here vLLM
    need not even be installed)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "marscli", "serve", str(tiny_model), "--port",
                            str(port)], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == (f"error: --port {port}: cannot listen on 127.0.0.1 "
                                "(Address already in use)")
    r = subprocess.run([sys.executable, "-m", "marscli", "serve", "/no/such/ckpt"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "no such checkpoint folder" in r.stderr
