"""API keys never reach a file or a log. With SERPER_API_KEY and OPENAI_API_KEY set to sentinel
strings, a run goes rollout (OpenAI-compatible engine, serper text search) → reward (OpenAI
judge) → advantages → update → eval → report against the chaos server (tests/chaos.py), whose
HTTP 500 replies echo the credentials they received. Neither sentinel appears in any output,
sidecar, cache, metrics file, report, or in any command's stdout or stderr; and the servers did
receive them (so the test is not vacuous)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chaos import ChaosServer
from helpers import write_prompts

SERPER_KEY = "serper-sentinel-4c1d2e9b"
OPENAI_KEY = "sk-openai-sentinel-8a7f6e5d"


@pytest.mark.slow
def test_no_secret_in_any_file_or_log(tiny_model, tmp_path, monkeypatch):
    run = tmp_path / "run"
    it = run / "iter-0"
    (tmp_path / "data").mkdir()
    prompts = write_prompts(tmp_path / "data" / "p.jsonl", [f"q{i}" for i in range(4)])
    logs: list[str] = []
    with ChaosServer(seed=3, fail_rate=0.3, timeout_s=1.0) as server:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "SERPER_API_KEY": SERPER_KEY,
               "OPENAI_API_KEY": OPENAI_KEY, "SERPER_BASE_URL": server.url,
               "MARSCLI_CACHE_DIR": str(run / "cache")}
        for k, v in env.items():
            monkeypatch.setenv(k, v)

        def marscli(*args: str) -> None:
            res = subprocess.run([sys.executable, "-m", "marscli", *args], capture_output=True,
                                 text=True, env=env, timeout=600, check=False)
            logs.extend([res.stdout, res.stderr])
            assert res.returncode == 0, res.stderr

        engine = ["--engine", "openai", "--base-url", f"{server.url}/v1", "--model", "chaos",
                  "--timeout", "1", "--retries", "1", "--text-search", "serper",
                  "--search-timeout", "1", "--search-retries", "1"]
        judge = ["--judge", f"openai:chaos@{server.url}/v1", "--judge-timeout", "1",
                 "--judge-retries", "1", "--max-unscored", "1"]
        marscli("rollout", str(prompts), "-o", str(it / "rollouts.jsonl"), "-n", "2",
                "--max-turns", "4", "--tokenize-with", str(tiny_model), *engine)
        marscli("reward", str(it / "rollouts.jsonl"), "-o", str(it / "scored.jsonl"), *judge)
        marscli("advantages", str(it / "scored.jsonl"), "-o", str(it / "advantages.jsonl"))
        marscli("eval", str(prompts), "-o", str(run / "eval" / "ckpt-0.jsonl"), "--max-turns",
                "4", *engine, *judge)
        assert any(SERPER_KEY in h.get("x-api-key", "") for h in server.headers_seen)
        assert any(OPENAI_KEY in h.get("authorization", "") for h in server.headers_seen)
        assert server.faults["http500"] > 0  # replies that echoed the keys back were sent

    from marscli.stages.update import run_update

    rows = [r for r in (it / "advantages.jsonl").read_bytes().splitlines()
            if b'"stop":"answer"' in r]  # the trajectories the engine completed
    (it / "train.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    run_update(str(it / "train.jsonl"), str(tiny_model), str(run / "ckpt-1"), lr=1e-4,
               metrics=str(it / "metrics.jsonl"), device="cpu")
    marscli("report", str(run), "-o", str(run / "report.html"))

    files = [p for p in run.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"rollouts.jsonl.meta.json", "scored.jsonl.meta.json", "metrics.jsonl",
            "ckpt-0.summary.json", "report.html"} <= names
    assert any(p.suffix == ".sqlite" for p in files)  # the judge's and the search's caches
    for p in files:
        data = p.read_bytes()
        for key in (SERPER_KEY, OPENAI_KEY):
            assert key.encode() not in data, f"{key} leaked into {p}"
    for text in logs:
        assert SERPER_KEY not in text and OPENAI_KEY not in text
    echoed = [line for p in files if p.suffix in (".jsonl", ".json")
              for line in p.read_text().splitlines() if "you sent" in line]
    assert all("<redacted>" in line for line in echoed)  # what the server echoed, scrubbed
