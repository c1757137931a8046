"""Live rendering of agent events on stderr (rich): thinking, tool calls, observations,
crops and the answer. Used by `ask`; a null renderer when quiet."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

from marscli.protocol import Answer, FormatError, ToolCall


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


class LiveTrace:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or stderr_console()

    def __call__(self, kind: str, traj: Any, data: dict) -> None:
        c = self.console
        if kind == "model":
            action = data["action"]
            if action.thinking:
                c.print(Panel(escape(action.thinking), title=f"thinking · turn {traj.turns}",
                              border_style="dim", title_align="left"))
            if isinstance(action, ToolCall):
                c.print(f"[bold cyan]→ {escape(action.name)}[/] {escape(str(action.arguments))}")
            elif isinstance(action, FormatError):
                c.print(f"[yellow]✗ format error:[/] {escape(action.message)}")
                c.print(f"[dim]{escape(data['text'][:500])}[/]")
        elif kind == "tool":
            style = "green" if data["ok"] else "red"
            c.print(Panel(escape(data["text"][:1500]),
                          title=f"tool response · {data['name'] or 'format error'}",
                          border_style=style, title_align="left"))
            for p in data["images"]:
                c.print(f"  [magenta]image saved:[/] {escape(p)}")
        elif kind == "stop":
            if data["answer"] is not None:
                c.print(Panel(escape(data["answer"]), title="answer", border_style="bold green",
                              title_align="left"))
            else:
                c.print(f"[red]stopped without an answer:[/] {data['stop']}")


def describe(action: Any) -> str:
    if isinstance(action, Answer):
        return f"answer: {action.text}"
    if isinstance(action, ToolCall):
        return f"call {action.name}"
    return f"format error: {action.message}"
