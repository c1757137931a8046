"""The command line's machinery (the commands themselves are cli.py's): the typer application
and its groups (`eval`'s callback, which takes an argument), the error boundary (`guard`:
`MarsError` → one stderr line and its exit code, 2 bad input, 1 runtime failure) and `command`,
which registers a command with its configs' options (options.py). Torch-free, as `--help`
must be. No `from __future__ import annotations` here, as in cli.py.
"""

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

from marscli.errors import MarsError, os_error
from marscli.options import configured
from marscli.secrets import redact  # an error may echo a URL with a password

app = typer.Typer(
    name="marscli",
    help="SenseNova-MARS as composable stages: rollout | reward | advantages, then update.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: typer 0.29's rich panels print a value (`--json <bool>`, even
    # `--help <bool>`) after every flag, as if flags took one
    rich_markup_mode=None,
)
index_app = typer.Typer(help="Build search indexes (text: SQLite FTS5; images: perceptual hashes).",
                        no_args_is_help=True, rich_markup_mode=None)
app.add_typer(index_app, name="index")


class ArgumentOrCommand(TyperGroup):
    """A group whose callback is a command of its own, with an argument: `eval BENCH [OPTIONS]`
    runs the callback (options before or after BENCH), `eval summarize|rescore ...` the
    subcommand (a first word naming a subcommand is never read as BENCH)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            # stop at the subcommand's name: the callback's argument gets a copy of it, and
            # everything from the name on is the subcommand's
            ctx.allow_interspersed_args, ctx.allow_extra_args = False, True
            return super().parse_args(ctx, [args[0], *args])
        # parsed as a command: options anywhere, and a word after BENCH is an extra argument
        ctx.allow_interspersed_args, ctx.allow_extra_args = True, False
        return super().parse_args(ctx, args)

    def get_params(self, ctx: typer.Context) -> list[Any]:
        """A subcommand's usage line names the group without the callback's argument."""
        params = super().get_params(ctx)
        return params if ctx.command is self else [p for p in params
                                                   if p.param_type_name != "argument"]


eval_app = typer.Typer(cls=ArgumentOrCommand, rich_markup_mode=None,
                       subcommand_metavar="| summarize|rescore RESULTS.jsonl [OPTIONS]")
app.add_typer(eval_app, name="eval")


def fail(err: MarsError) -> None:
    """Print `error: ...` on one line and exit with the error's code."""
    msg = redact(" ".join(str(err).split("\n")))
    print(f"error: {msg}", file=sys.stderr)
    raise typer.Exit(err.exit_code)


def run(app: typer.Typer) -> None:
    """Run the application: a MarsError or an OSError raised outside a command body (option
    callbacks, a config refusing its options) is one stderr line and its exit code too."""
    try:
        app()
    except MarsError as e:  # raised outside a command body (option callbacks)
        if os.environ.get("MARSCLI_DEBUG"):
            raise
        print(f"error: {redact(str(e))}", file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:  # a full disk or a read-only folder met outside a guard
        err = os_error(e)
        if err is None or os.environ.get("MARSCLI_DEBUG"):
            raise
        print(f"error: {redact(str(err))}", file=sys.stderr)
        sys.exit(err.exit_code)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """`with guard():` around a command body maps MarsError to one stderr line and its exit
    code (`MARSCLI_DEBUG=1`: the traceback instead). Each command is one stage, with its own
    memory of the inputs it read (`provenance.stage_inputs`: its outputs never clobber them)."""
    from marscli.records.provenance import stage_inputs

    try:
        with stage_inputs():
            yield
    except MarsError as e:
        if os.environ.get("MARSCLI_DEBUG"):
            raise
        fail(e)
    except OSError as e:
        err = os_error(e)
        if err is None or os.environ.get("MARSCLI_DEBUG"):
            raise
        fail(err)


def command(group: typer.Typer, name: str | None = None, callback: bool = False) -> Any:
    """Register a command: its configs' options added (`options.configured`), its body run in
    `guard()`; `callback`: the group's own command (`eval BENCH`)."""

    def register(func: Any) -> Any:
        configured_func = configured(func)

        @functools.wraps(configured_func)  # its signature: the configs' options
        def guarded(**kw: Any) -> Any:
            with guard():  # building the configs too (an old spelling beside the new one)
                return configured_func(**kw)

        if callback:
            return group.callback(invoke_without_command=True)(guarded)
        return group.command(name)(guarded)

    return register
