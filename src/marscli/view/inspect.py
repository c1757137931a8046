"""`marscli inspect`: read trajectories as a person would, in the terminal.

Also the pieces `report` shares: `blocks(rec)` (a trajectory as thinking / tool call /
observation / answer blocks), `describe_image`, and the `--where` filter.

`--where FIELD OP VALUE`, OP one of `== != >= <= > <`, FIELD a dotted path (`reward.accuracy`,
`tool_calls.image_zoom_in_tool`, `segments.0.role`). A number compares as a number, `true`,
`false`, `null` as themselves, anything else (quotes optional) as a string. A field that is
missing makes the comparison false, whatever the operator. On a list field, `==` means "some
element equals" and `!=` "no element equals" (`answer_gt==1997`). Ordering operators need a
number. Several `--where` are ANDed.

The module is `view`, not `inspect`: a file named inspect.py beside cli.py would shadow the
standard library's `inspect` whenever src/marscli is on sys.path.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from marscli.agent.protocol import Answer, FormatError, ToolCall, parse_turn
from marscli.errors import BadInput
from marscli.records.jsonl import dumps, iter_rows
from marscli.records.provenance import stage_inputs
from marscli.view.runs import number, token_counts

# ---------------------------------------------------------------------------------- --where

_MISSING = object()
_EXPR = re.compile(r"^\s*([^\s=!<>]+)\s*(==|!=|>=|<=|>|<)\s*(.*?)\s*$", re.DOTALL)
_ORDER = {">": lambda a, b: a > b, "<": lambda a, b: a < b,
          ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}
_LITERALS = {"true": True, "false": False, "null": None}


def lookup(row: Any, path: tuple[str, ...]) -> Any:
    """`a.b.0.c` in nested dicts and lists; `_MISSING` where the path ends early."""
    cur = row
    for part in path:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif (isinstance(cur, list) and part.lstrip("-").isdigit()
              and -len(cur) <= int(part) < len(cur)):
            cur = cur[int(part)]
        else:
            return _MISSING
    return cur


@dataclass(frozen=True)
class Where:
    expr: str
    path: tuple[str, ...]
    op: str
    text: str  # the value as a string (quotes removed)
    num: float | None  # the value as a number, if it is one (and was not quoted)
    literal: Any  # True / False / None for true / false / null, else _MISSING

    def __call__(self, row: dict) -> bool:
        val = lookup(row, self.path)
        if val is _MISSING:
            return False
        if isinstance(val, list):
            if self.op not in ("==", "!="):
                return False
            hit = any(self._equal(x) for x in val)
            return hit if self.op == "==" else not hit
        if self.op in _ORDER:
            x = number(val)
            if x is None and isinstance(val, str):
                try:
                    x = float(val)
                except ValueError:
                    return False
            return x is not None and _ORDER[self.op](x, self.num)
        eq = self._equal(val)
        return eq if self.op == "==" else not eq

    def _equal(self, val: Any) -> bool:
        if val is None or isinstance(val, bool):
            return self.literal is not _MISSING and val is self.literal
        if isinstance(val, (int, float)):
            return self.num is not None and float(val) == self.num
        if isinstance(val, str):
            return val == self.text
        return False


def parse_where(expr: str) -> Where:
    """`reward.accuracy==0` → a predicate on rows; BadInput naming `--where` otherwise."""
    m = _EXPR.match(expr)
    hint = ("write FIELD OP VALUE with OP one of ==, !=, >=, <=, >, < — "
            "e.g. --where reward.accuracy==0 or --where stop!=answer")
    if not m:
        raise BadInput(f"--where {expr!r}: not a comparison — {hint}")
    path, op, raw = m.groups()
    if not raw:
        raise BadInput(f"--where {expr!r}: no value after {op} — {hint} (\"\" for empty)")
    if any(not p for p in path.split(".")):
        raise BadInput(f"--where {expr!r}: empty part in the field path {path!r} — {hint}")
    quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'"
    text = raw[1:-1] if quoted else raw
    num = None
    if not quoted:
        try:
            num = float(text)
        except ValueError:
            pass
    literal = _LITERALS.get(text, _MISSING) if not quoted else _MISSING
    if op in _ORDER and num is None:
        raise BadInput(f"--where {expr!r}: {op} compares numbers, and {raw!r} is not one — {hint}")
    return Where(expr, tuple(path.split(".")), op, text, num, literal)


def select(rows: Iterable[dict], ids: list[str] | None = None, where: list[Where] | None = None,
           limit: int | None = None) -> Iterator[dict]:
    """The rows whose id is in `ids` (if given) and that pass every `where`, at most `limit`."""
    want = set(ids) if ids else None
    n = 0
    for row in rows:
        if limit is not None and n >= limit:
            return
        if want is not None and str(row.get("id")) not in want:
            continue
        if all(w(row) for w in where or ()):
            n += 1
            yield row


# ---------------------------------------------------------------------------------- blocks


@dataclass
class Block:
    kind: str  # question | thinking | call | answer | format_error | observation
    title: str
    text: str
    images: list[int] | None = None  # observation: the images it brought, in marker order
    ok: bool | None = None


def blocks(rec: dict) -> list[Block]:
    """A trajectory as the blocks a person reads, in order."""
    out = [Block("question", "question", str(rec.get("question", "")),
                 images=_prompt_images(rec))]
    turn = 0
    for seg in rec.get("segments") or []:
        if not isinstance(seg, dict):
            continue
        role = seg.get("role")
        if role == "model":
            turn += 1
            out += _model_blocks(seg.get("text"), turn)
        elif role == "tool":
            name = seg.get("tool") or "format error"
            status = "failed" if seg.get("failed") else ("ok" if seg.get("ok") else "error")
            ms = f" · {seg['ms']} ms" if isinstance(seg.get("ms"), (int, float)) else ""
            out.append(Block("observation", f"observation · {name} · {status}{ms}",
                             str(seg.get("text") or ""), images=list(seg.get("images") or []),
                             ok=bool(seg.get("ok")) and not seg.get("failed")))
    return out


def _prompt_images(rec: dict) -> list[int]:
    for seg in rec.get("segments") or []:
        if isinstance(seg, dict) and seg.get("role") == "prompt" and seg.get("images"):
            return list(seg["images"])
    return [i for i, im in enumerate(rec.get("images") or [])
            if isinstance(im, dict) and "from" not in im and "thumbnail" not in im]


def _model_blocks(text: str | None, turn: int) -> list[Block]:
    if text is None:
        return [Block("format_error", f"turn {turn} · reply", "(no text recorded)")]
    action = parse_turn(text)
    out = []
    if action.thinking:
        out.append(Block("thinking", f"turn {turn} · thinking", action.thinking))
    if isinstance(action, ToolCall):
        args = orjson.dumps(action.arguments).decode()
        out.append(Block("call", f"turn {turn} · tool call", f"{action.name} {args}"))
    elif isinstance(action, Answer):
        out.append(Block("answer", f"turn {turn} · answer", action.text))
    elif isinstance(action, FormatError):
        out.append(Block("format_error", f"turn {turn} · format error: {action.message}", text))
    return out


def describe_image(rec: dict, idx: int, inline: bool = False) -> str:
    """`[2] crops/q1-2.png — crop of image 1, bbox [0, 0, 500, 250] 'sign'`; `inline`:
    `[image 2: crops/...]`, as it stands in an observation's text."""
    imgs = rec.get("images") or []
    lead = f"[image {idx}: " if inline else f"[{idx}] "
    end = "]" if inline else ""
    if not 0 <= idx < len(imgs) or not isinstance(imgs[idx], dict):
        return f"{lead}(no such image){end}"
    im = imgs[idx]
    s = f"{lead}{im.get('path', '?')}"
    if "from" in im:
        box = im.get("bbox_2d")
        box = "[" + ", ".join(fmt_num(v) for v in box) + "]" if isinstance(box, list) else box
        s += f" — crop of image {im['from']}, bbox {box}"
        if im.get("label"):
            s += f" {im['label']!r}"
    elif "title" in im or "thumbnail" in im:
        s += f" — search result {im.get('title', '')!r}"
    return s + end


# ---------------------------------------------------------------------------------- header


def fmt_num(x: Any, signed: bool = False) -> str:
    v = number(x)
    if v is None:
        return "—" if x is None else str(x)
    if v == 0:
        return "0"
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):+d}" if signed else str(int(v))
    return f"{v:+.4g}" if signed else f"{v:.4g}"


def reward_text(rec: dict) -> str:
    r = rec.get("reward")
    if not isinstance(r, dict):
        return "not scored"
    if r.get("status") == "unscored":
        return f"unscored ({r.get('error', 'no reason given')})"
    parts = [f"total {fmt_num(r.get('total'))}"]
    parts += [f"{k} {fmt_num(r[k])}" for k in ("accuracy", "format") if k in r]
    if r.get("judge"):
        parts.append(f"judge {r['judge']}")
    return " · ".join(parts)


def advantage_text(rec: dict) -> str:
    if "advantage" not in rec:
        return "—"
    s = fmt_num(rec["advantage"], signed=True)
    g = rec.get("group")
    if isinstance(g, dict):
        s += (f" (group mean {fmt_num(g.get('mean'))}, std {fmt_num(g.get('std'))}, "
              f"size {fmt_num(g.get('size'))})")
    if "minibatch" in rec:
        s += f" · minibatch {rec['minibatch']}"
    return s


def tokens_text(rec: dict) -> str:
    t = token_counts(rec)
    if not t["total"]:
        return "no token ids recorded (a text-only trajectory)"
    return (f"prompt {t['prompt']:,} · model {t['model']:,} · tool {t['tool']:,} · "
            f"loss mask {t['model']:,}/{t['total']:,} = {100 * t['mask_share']:.1f}%")


def tools_text(rec: dict) -> str:
    calls, errs = rec.get("tool_calls") or {}, rec.get("tool_errors") or {}
    fails = rec.get("tool_failures") or {}
    parts = []
    for name, n in calls.items():
        extra = [f"{errs[name]} error(s)"] if errs.get(name) else []
        extra += [f"{fails[name]} backend failure(s)"] if fails.get(name) else []
        parts.append(f"{name}×{n}" + (f" ({', '.join(extra)})" if extra else ""))
    s = ", ".join(parts) or "none"
    if rec.get("format_errors"):
        s += f" · format errors {rec['format_errors']}"
    return s


def header(rec: dict) -> list[tuple[str, str]]:
    """(label, value) lines shown above a trajectory, by inspect and report alike."""
    gold = rec.get("answer_gt")
    gold = " | ".join(map(str, gold)) if isinstance(gold, list) else str(gold)
    final = rec.get("final_answer")
    out = [("question", str(rec.get("question", ""))),
           ("gold", gold),
           ("answer", "(none)" if final is None else str(final)),
           ("stop", f"{rec.get('stop', '?')} after {rec.get('turns', '?')} turn(s)"),
           ("reward", reward_text(rec)),
           ("advantage", advantage_text(rec)),
           ("tokens", tokens_text(rec)),
           ("tools", tools_text(rec))]
    if rec.get("choices"):
        out.insert(1, ("choices", " | ".join(map(str, rec["choices"]))))
    if rec.get("category"):
        out.append(("category", str(rec["category"])))
    if rec.get("error"):
        out.append(("error", str(rec["error"])))
    return out


def title(rec: dict) -> str:
    bits = [str(rec.get("id", "?"))]
    if "prompt_id" in rec:
        bits.append(f"prompt {rec['prompt_id']}")
    if "sample" in rec:
        bits.append(f"sample {rec['sample']}")
    if rec.get("policy"):
        bits.append(f"policy {rec['policy']}")
    return " · ".join(bits)


# ---------------------------------------------------------------------------------- rendering


def _observation_text(rec: dict, b: Block) -> str:
    """`<image>` markers → `[image k: path]`; images without a marker go last."""
    pieces = b.text.split("<image>")
    imgs = list(b.images or [])
    out = pieces[0]
    for i, piece in enumerate(pieces[1:]):
        out += (describe_image(rec, imgs[i], inline=True) if i < len(imgs) else "[image ?]") + piece
    for idx in imgs[len(pieces) - 1:]:
        out += "\n" + describe_image(rec, idx, inline=True)
    return out


def block_text(rec: dict, b: Block) -> str:
    if b.kind == "observation":
        return _observation_text(rec, b)
    if b.kind == "question":
        return b.text + "".join("\n" + describe_image(rec, i, inline=True) for i in b.images or [])
    return b.text


def render_plain(rec: dict) -> str:
    """A trajectory as plain text (what `inspect` prints when stdout is not a terminal)."""
    lines = [f"══ {title(rec)} " + "═" * max(4, 76 - len(title(rec)))]
    lines += [f"{k}: {v}" for k, v in header(rec)]
    imgs = rec.get("images") or []
    if imgs:
        lines.append("images:")
        lines += [f"  {describe_image(rec, i)}" for i in range(len(imgs))]
    for b in blocks(rec)[1:]:
        lines.append(f"--- {b.title} ---")
        lines.append(block_text(rec, b))
    return "\n".join(lines) + "\n"


_STYLE = {"thinking": "dim", "call": "cyan", "answer": "bold green", "format_error": "yellow",
          "question": "white"}


def render_rich(rec: dict, console: Any) -> None:
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    console.rule(f"[bold]{escape(title(rec))}")
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    for k, v in header(rec):
        t.add_row(k, escape(v))
    for i in range(len(rec.get("images") or [])):
        t.add_row("images" if i == 0 else "", escape(describe_image(rec, i)))
    console.print(t)
    for b in blocks(rec)[1:]:
        style = ("green" if b.ok else "red") if b.kind == "observation" else _STYLE[b.kind]
        console.print(Panel(escape(block_text(rec, b)), title=escape(b.title), title_align="left",
                            border_style=style))


@stage_inputs()
def inspect(path: str, ids: list[str] | None = None, where: list[str] | None = None,
            limit: int | None = None, as_json: bool = False, as_ids: bool = False) -> int:
    """Print the matching trajectories of `path` to stdout; returns how many matched."""
    preds = [parse_where(w) for w in where or []]  # bad expressions fail before reading

    def rows() -> Iterator[dict]:
        for line, row in iter_rows(path):
            if "segments" not in row and "id" not in row:
                raise BadInput(f"{path}:{line}: segments: missing required field — inspect "
                               "reads trajectory rows (rollout, reward or advantages output)")
            yield row

    console = None
    if not (as_json or as_ids):
        from rich.console import Console

        console = Console(highlight=False)
    n = 0
    out = sys.stdout
    try:
        for rec in select(rows(), ids, preds, limit):
            n += 1
            if as_ids:
                out.write(f"{rec.get('id')}\n")
            elif as_json:
                out.flush()
                sys.stdout.buffer.write(dumps(rec))
            elif console.is_terminal:
                render_rich(rec, console)
            else:
                out.write(render_plain(rec) + "\n")
        out.flush()
    except BrokenPipeError:  # `marscli inspect ... | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return n
