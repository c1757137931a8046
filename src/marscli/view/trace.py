"""Live rendering of agent events on stderr (rich), for `ask`; a person watches it.

- `LiveTrace.header`: the image (path, size in pixels), question, policy, engine and device,
  printed before the model loads.
- Numbered turns. The reply is streamed as it is generated (the engine's `"text"` events,
  `{"delta": str}`); an engine that does not stream shows the whole reply at the end of the
  turn (the `"model"` event). Under the reply: the tool call, or the format-error label (one
  per format error, a reply cut off mid-answer included; its error observation gets no panel).
- Tool responses: a summary panel (the first lines of what the model is shown), then each new
  image (crop, thumbnail) by path and size, and inline in terminals that draw images: the
  kitty graphics protocol (`TERM=xterm-kitty`, `TERM_PROGRAM=ghostty`) or iTerm2's
  (`TERM_PROGRAM=iTerm.app` or `WezTerm`); never when the trace's stream is not a terminal.
- The final answer, or why the trajectory stopped without one.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from marscli.agent.progress import stderr_console
from marscli.agent.protocol import FormatError, ToolCall

SUMMARY_LINES, SUMMARY_CHARS = 8, 600  # how much of a tool response the trace shows
INLINE_PX = 384  # inline images are drawn at most this wide and tall
_IM_END = "<|im_end|>"


class LiveTrace:
    """The agent's `on_event` for `ask`. `inline`: "kitty", "iterm", None (off), or "auto"
    (from TERM/TERM_PROGRAM, when the console is a terminal)."""

    def __init__(self, console: Console | None = None, inline: str | None = "auto") -> None:
        self.console = console or stderr_console()
        self.inline = (inline_protocol(os.environ, self.console.is_terminal)
                       if inline == "auto" else inline)
        self._streaming: set[str] = set()  # trajectories whose current reply is streaming
        self._labelled: set[str] = set()  # format errors labelled under their reply

    def header(self, image: str, size: tuple[int, int], question: str, policy: str,
               engine: str, device: str) -> None:
        grid = Table.grid(padding=(0, 2))
        grid.add_row("[bold]image[/]", f"{escape(image)}  [dim]{size[0]}×{size[1]} px[/]")
        grid.add_row("[bold]question[/]", escape(question))
        grid.add_row("[bold]policy[/]", f"{escape(policy)}  [dim]engine {escape(engine)} · "
                                        f"device {escape(device)}[/]")
        self.console.print(Panel(grid, title="marscli ask", title_align="left",
                                 border_style="blue"))

    def __call__(self, kind: str, traj: Any, data: dict) -> None:
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(traj, data)

    # ------------------------------------------------------------------ events

    def _on_text(self, traj: Any, data: dict) -> None:
        if traj.id not in self._streaming:
            self._streaming.add(traj.id)
            self._turn_rule(traj.turns + 1)  # `turns` counts finished replies
        delta = data["delta"].replace(_IM_END, "")
        if delta:
            self.console.print(Text(delta, style="dim"), end="", soft_wrap=True)

    def _on_model(self, traj: Any, data: dict) -> None:
        c = self.console
        if traj.id in self._streaming:
            self._streaming.discard(traj.id)
            c.print()  # end the streamed line
        else:
            self._turn_rule(traj.turns)
            c.print(Text(data["text"], style="dim"), soft_wrap=True)
        action = data["action"]
        if isinstance(action, ToolCall):
            c.print(f"[bold cyan]→ {escape(action.name)}[/] {escape(str(action.arguments))}")
        elif isinstance(action, FormatError):
            c.print(f"[yellow]✗ format error:[/] {escape(action.message)}")
            self._labelled.add(traj.id)

    def _on_tool(self, traj: Any, data: dict) -> None:
        c = self.console
        if data["name"] is None:  # the observation of a format error: the label says it
            if traj.id not in self._labelled:  # an answer cut off mid-turn: not labelled yet
                c.print(f"[yellow]✗ format error:[/] "
                        f"{escape(data['text'].removeprefix('error: '))}")
            self._labelled.discard(traj.id)
            return
        style = "green" if data["ok"] else "red"
        c.print(Panel(escape(summary(data["text"])), title=f"tool response · {data['name']}",
                      border_style=style, title_align="left"))
        n = len(data["images"])  # the new images are the trajectory's last files
        files = list(getattr(traj, "files", None) or data["images"])[-n:] if n else []
        for f in files:
            self._image(Path(f))

    def _on_stop(self, traj: Any, data: dict) -> None:
        if data["answer"] is not None:
            self.console.print(Panel(escape(data["answer"]), title="answer",
                                     border_style="bold green", title_align="left"))
        else:
            why = f" ({traj.error})" if getattr(traj, "error", None) else ""
            self.console.print(f"[red]stopped without an answer:[/] {data['stop']}"
                               f"{escape(why)}")

    # ------------------------------------------------------------------ pieces

    def _turn_rule(self, n: int) -> None:
        self.console.rule(f"turn {n}", align="left", style="dim")

    def _image(self, file: Path) -> None:
        """One new image: its path and size, and the picture where the terminal draws it."""
        from PIL import Image

        try:
            if not file.is_file():  # never open a named pipe (it would block)
                raise OSError(f"{file}: not a regular file")
            with Image.open(file) as im:
                size = f"  [dim]{im.size[0]}×{im.size[1]} px[/]"
        except OSError:
            size = ""
        self.console.print(f"  [magenta]image:[/] {escape(str(file))}{size}")
        if self.inline and size:
            self.console.file.write(inline_image(file, self.inline))
            self.console.file.flush()


def summary(text: str) -> str:
    """The first lines of a tool response, image markers left out, within SUMMARY_CHARS."""
    lines = [ln for ln in text.splitlines() if ln.strip() != "<image>"]
    short = "\n".join(lines[:SUMMARY_LINES])
    if len(short) > SUMMARY_CHARS:
        short = short[:SUMMARY_CHARS].rstrip()
    rest = len("\n".join(lines)) - len(short)
    return short + (f"\n… {rest} more characters" if rest > 0 else "")


def inline_protocol(env: Mapping[str, str], is_terminal: bool) -> str | None:
    """The inline-image protocol the terminal speaks, judged from TERM and TERM_PROGRAM;
    None (off) when unknown or when the output is not a terminal. tmux and screen set their
    own TERM and pass neither protocol through by default, so they are off."""
    if not is_terminal:
        return None
    term, program = env.get("TERM", ""), env.get("TERM_PROGRAM", "")
    if term == "xterm-kitty" or program == "ghostty":
        return "kitty"
    if program in ("iTerm.app", "WezTerm"):
        return "iterm"
    return None


def inline_image(path: Path, protocol: str, max_px: int = INLINE_PX) -> str:
    """The escape sequence that draws the image at `path` (scaled to fit `max_px`), then a
    newline. kitty: PNG data (f=100) sent in base64 chunks of at most 4096 bytes (m=1 on all
    but the last); iTerm2: one OSC 1337 File sequence."""
    from PIL import Image

    from marscli.qwen.images import check_regular_file

    check_regular_file(path)
    with Image.open(path) as im:
        im = im.convert("RGB")
        im.thumbnail((max_px, max_px))
        buf = io.BytesIO()
        im.save(buf, format="PNG")
    png = buf.getvalue()
    data = base64.standard_b64encode(png).decode()
    if protocol == "iterm":
        return f"\x1b]1337;File=inline=1;size={len(png)};preserveAspectRatio=1:{data}\x07\n"
    chunks = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    out = []
    for i, chunk in enumerate(chunks):
        more = int(i < len(chunks) - 1)
        out.append(f"\x1b_G{'a=T,f=100,' if i == 0 else ''}m={more};{chunk}\x1b\\")
    return "".join(out) + "\n"
