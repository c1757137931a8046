"""Options declared once as config fields (options.py): what a command built from configs
takes, how it fills each config, old spellings, and that every command's configs are whole."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from marscli.options import OPTION, configured, option, options_of, same_as, use


@dataclass
class Inner:
    url: str | None = option(None, "The URL.", metavar="URL")
    tries: int | None = option(None, "Tries.")


@dataclass
class Outer:
    size: int = option(4, "The size.")
    rate: float = option(0.5, "The rate.", aliases=("--old-rate",))
    fast: bool = option(False, "Go fast.")
    name: str = option("a", "The name.", decls=("-n", "--name"))
    inner: dict = options_of(Inner)
    hidden_state: list = None  # not an option: never on the command line


@dataclass
class Other:
    size: int = same_as(Outer, "size")
    seed: int = option(0, "The seed.")


def _app(**use_kw) -> tuple[typer.Typer, list]:
    seen: list = []
    app = typer.Typer()

    @app.command()
    @configured
    def cmd(path: Annotated[str, typer.Argument()], cfg: Outer = use(**use_kw),
            other: Other = use()) -> None:
        seen.append((path, cfg, other))

    @app.command()
    def spare() -> None:  # a second command: typer then names the first on the command line
        pass

    return app, seen


def _run(app: typer.Typer, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["cmd", *args])
    return res.exit_code, res.output


def test_each_field_is_an_option_and_the_configs_are_built_from_them():
    app, seen = _app()
    code, out = _run(app, "p", "--size", "7", "--rate", "0.25", "--fast", "-n", "b",
                     "--url", "http://x", "--seed", "3")
    assert code == 0, out
    [(path, cfg, other)] = seen
    assert path == "p"
    assert cfg == Outer(size=7, rate=0.25, fast=True, name="b",
                        inner={"url": "http://x", "tries": None})
    assert other == Other(size=7, seed=3)  # one --size feeds both configs


def test_defaults_help_and_fixed_values_per_command():
    app, seen = _app(size=9, fixed={"name": "z"}, help={"rate": "Another help."})
    code, out = _run(app, "p")
    assert code == 0, out
    assert seen[0][1].size == 9 and seen[0][1].name == "z"
    assert seen[0][2].size == 9  # the command's default reaches every config of the field
    code, out = _run(app, "--help")
    assert "Another help." in out and "The rate." not in out
    assert "--name" not in out  # fixed: no option
    assert "--old-rate" not in out  # old spellings are hidden


def test_only_keeps_the_other_fields_off_the_command_line():
    app, seen = _app(only=("size",))
    code, out = _run(app, "p", "--rate", "0.1")
    assert code == 2 and "No such option: --rate" in out
    code, out = _run(app, "p", "--size", "2")
    assert code == 0, out
    assert seen[0][1] == Outer(size=2)


def test_an_old_spelling_is_accepted_and_both_at_once_are_refused():
    from marscli.errors import BadInput

    app, seen = _app()
    code, out = _run(app, "p", "--old-rate", "0.75")
    assert code == 0, out
    assert seen[0][1].rate == 0.75
    code, _ = _run(app, "p", "--old-rate", "0.75", "--rate", "0.1")
    assert code == 1 and not seen[1:]
    with pytest.raises(BadInput, match="--old-rate: the old spelling of --rate — give one"):
        CliRunner().invoke(app, ["cmd", "p", "--old-rate", "0.75", "--rate", "0.1"],
                           catch_exceptions=False)


def test_every_field_of_a_commands_config_is_an_option_or_named_otherwise():
    """A config field without option metadata never reaches the command line: each such field
    must be one the stages fill themselves (listed here), or it would keep its default."""
    from marscli.agent.generation import GenerationOptions, JobOptions
    from marscli.engines import EngineOptions
    from marscli.evaluation.config import EvalConfig
    from marscli.qwen.tiny_config import TinyConfig
    from marscli.rl.config import AdvantagesConfig
    from marscli.scoring.judge_config import JudgeConfig
    from marscli.serving.config import ControlConfig, ServeConfig
    from marscli.toy.config import SummaryConfig, WorldConfig
    from marscli.train.config import PlanConfig, SftConfig, StateConfig, UpdateConfig
    from marscli.view.config import InspectConfig, ReportConfig

    not_options = {"engine_opts", "search_opts"}  # engine_opts gathers EngineOptions
    for cls in (EngineOptions, GenerationOptions, JobOptions, EvalConfig, TinyConfig,
                AdvantagesConfig, JudgeConfig, ControlConfig, ServeConfig, SummaryConfig,
                WorldConfig, PlanConfig, SftConfig, StateConfig, UpdateConfig, InspectConfig,
                ReportConfig):
        bare = {f.name for f in fields(cls) if OPTION not in f.metadata} - not_options
        assert not bare, (cls.__name__, bare)


def test_plan_asks_updates_options_as_update_declares_them():
    from marscli.train.config import PlanConfig, UpdateConfig

    def spec(cls, name):
        return next(f for f in fields(cls) if f.name == name)

    for name in ("micro_batch_tokens", "gradient_checkpointing", "logp_chunk", "freeze_vision",
                 "keep_optimizer"):
        a, b = spec(PlanConfig, name), spec(UpdateConfig, name)
        assert (a.default, a.metadata) == (b.default, b.metadata), name
