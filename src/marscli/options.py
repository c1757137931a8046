"""Each command-line option declared once, as a field of the config that owns it.

A config is a dataclass in a light module of its part (`GenerationOptions`, `UpdateConfig`,
...). A field that is an option says so in its metadata: `option(default, "help")`, with its
metavar, its other spellings and its old ones (`aliases`: accepted, hidden from --help). A
command names the config as a parameter, and `@configured` turns each such field into a typer
option, then hands the command the built config:

    @app.command()
    @configured
    def update(adv: Annotated[str, typer.Argument()], cfg: UpdateConfig) -> None: ...

A command may change a default, reword a help, keep a field off its command line (`only`) or
fix its value (`fixed`): `gen: GenerationOptions = use(temperature=0.0)`. A field named in two
of a command's configs is one option feeding both. A field whose metadata names a config of
its own (`options_of(EngineOptions)`) gathers that config's options into a dict (the engine's
own options, checked against each engine's `options`). The options' ranges are checked by the
configs' `check()`, which name the option. Only light modules are imported here: `marscli
--help` builds every command.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Annotated, Any

OPTION, GROUP = "marscli.option", "marscli.options_of"


@dataclass(frozen=True)
class Spec:
    """How a field looks on the command line."""

    help: str = ""
    decls: tuple[str, ...] = ()  # spellings other than --field-name: "-o", "--json", "--x/--no-x"
    metavar: str | None = None
    hidden: bool = False
    aliases: tuple[str, ...] = ()  # old spellings: accepted, hidden


def option(default: Any = None, help: str = "", *, decls: tuple[str, ...] = (),
           metavar: str | None = None, hidden: bool = False,
           aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is also a command-line option `--<field-name>`."""
    return field(default=default, metadata={OPTION: Spec(help, decls, metavar, hidden, aliases)})


def same_as(cls: type, name: str) -> Any:
    """`cls`'s option field `name` as it is (default, help, spellings): a question two commands
    ask (plan asks update's `--micro-batch-tokens`) declared once."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field(default=f.default, metadata=f.metadata)


def options_of(cls: type) -> Any:
    """A dict field gathering the options of `cls` (a config of option fields), those given."""
    return field(default_factory=dict, metadata={GROUP: cls})


@dataclass(frozen=True)
class Use:
    """How one command uses a config (`use(...)`)."""

    defaults: dict[str, Any]
    help: dict[str, str]
    only: tuple[str, ...] | None
    fixed: dict[str, Any]


def use(*, only: tuple[str, ...] | None = None, help: dict[str, str] | None = None,
        fixed: dict[str, Any] | None = None, **defaults: Any) -> Any:
    """A command's changes to a config: its defaults, helps, the fields it shows (`only`) and
    those it sets without an option (`fixed`)."""
    return Use(defaults, help or {}, only, fixed or {})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """`cls`'s option fields (and groups) with their evaluated types."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)
            if OPTION in f.metadata or GROUP in f.metadata]


def _default(f: dataclasses.Field, u: Use) -> Any:
    if f.name in u.defaults:
        return u.defaults[f.name]
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def _typer_param(name: str, tp: Any, spec: Spec, default: Any,
                 help: str | None) -> inspect.Parameter:
    import typer

    decls = spec.decls or ((_flag(name),) if tp is bool and default is False else ())
    info = typer.Option(*decls, help=help if help is not None else spec.help,
                        metavar=spec.metavar, hidden=spec.hidden)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                             annotation=Annotated[tp, info], default=default)


def _alias_param(name: str, tp: Any, old: str) -> inspect.Parameter:
    """A hidden option for an old spelling of `--name`."""
    import typer

    return inspect.Parameter(f"{name}__{old.lstrip('-').replace('-', '_')}",
                             inspect.Parameter.KEYWORD_ONLY,
                             annotation=Annotated[tp | None, typer.Option(old, hidden=True)],
                             default=None)


@dataclass
class _Group:
    """One config parameter of a command: its class, its use, the options that fill it."""

    cls: type
    use: Use
    names: list[str]  # option fields given by the command line
    nested: dict[str, list[str]]  # a dict field → the options gathered into it


def _expand(cls: type, u: Use, seen: dict[str, Any], params: list[inspect.Parameter],
            aliases: dict[str, tuple[str, Any]]) -> _Group:
    """Add `cls`'s options to `params` (once per name across the command) → its `_Group`."""
    group = _Group(cls, u, [], {})
    for f, tp in _fields(cls):
        if (u.only is not None and f.name not in u.only) or f.name in u.fixed:
            continue
        if GROUP in f.metadata:
            inner = _expand(f.metadata[GROUP], use(), seen, params, aliases)
            group.nested[f.name] = inner.names
            continue
        group.names.append(f.name)
        if f.name in seen:
            continue
        seen[f.name] = default = _default(f, u)
        spec = f.metadata[OPTION]
        params.append(_typer_param(f.name, tp, spec, default, u.help.get(f.name)))
        for old in spec.aliases:
            params.append(p := _alias_param(f.name, tp, old))
            aliases[p.name] = (f.name, old)
    return group


def _take_aliases(kw: dict[str, Any], aliases: dict[str, tuple[str, Any]],
                  defaults: dict[str, Any]) -> None:
    """An old spelling's value goes to its option; both given is refused."""
    from marscli.errors import BadInput

    for key, (name, old) in aliases.items():
        value = kw.pop(key)
        if value is None:
            continue
        if kw[name] != defaults[name]:
            raise BadInput(f"{old}: the old spelling of {_flag(name)} — give one of them")
        kw[name] = value


def configured(func: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose dataclass-typed parameters are filled from their fields' options."""
    hints = typing.get_type_hints(func, include_extras=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, _Group] = {}
    seen: dict[str, Any] = {}
    aliases: dict[str, tuple[str, Any]] = {}
    for p in inspect.signature(func).parameters.values():
        tp = hints.get(p.name, p.annotation)
        if dataclasses.is_dataclass(tp):
            u = p.default if isinstance(p.default, Use) else use()
            groups[p.name] = _expand(tp, u, seen, params, aliases)
        else:
            params.append(p.replace(annotation=tp, kind=inspect.Parameter.KEYWORD_ONLY))
    own = [p.name for p in params if p.name not in seen and p.name not in aliases]

    @functools.wraps(func, assigned=("__module__", "__name__", "__qualname__", "__doc__"),
                     updated=())
    def command(**kw: Any) -> Any:
        _take_aliases(kw, aliases, seen)
        args = {name: kw[name] for name in own}
        for name, g in groups.items():
            values = {n: kw[n] for n in g.names}
            values.update({d: {n: kw[n] for n in names} for d, names in g.nested.items()})
            args[name] = g.cls(**{**g.use.defaults, **values, **g.use.fixed})
        return func(**args)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command
