"""The agent loop: trajectories advance turn by turn, generating together and calling tools
concurrently, and are recorded with token-exact segments (DESIGN.md "Trajectory record").

A turn: every active trajectory's prompt goes to the engine in one batch; each reply is parsed
(protocol.parse_turn); tool calls of the turn run in a thread pool; the observation is appended
as a `tool` segment. Model mistakes (bad JSON, unknown tool, bad arguments, unclosed tags)
become error observations and are counted; the trajectory goes on until it answers or a limit
(turns, response tokens) stops it.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from marscli.engines import Engine, GenRequest, SamplingParams
from marscli.images import open_image
from marscli.jsonl import sha256_file
from marscli.protocol import Answer, FormatError, ToolCall, parse_turn, system_prompt
from marscli.records import Prompt, Segment, new_record
from marscli.tokens import (ImageFeatures, encode_parts, image_features, prompt_parts,
                            special_ids, tool_parts)
from marscli.tools import ConvImage, Tool, ToolContext, ToolResult

MAX_SOURCE_PIXELS = 100_000_000  # decoded input cap; the zoom tool crops from this


@dataclass
class AgentConfig:
    max_turns: int = 10
    max_response_tokens: int = 16_384  # model + tool tokens after the prompt
    max_turn_tokens: int = 2_048  # one reply
    max_tool_chars: int = 8_192
    system_prompt: str | None = None  # None: protocol.SYSTEM_PROMPT
    sampling: SamplingParams = field(default_factory=SamplingParams)
    batch_size: int = 32  # trajectories advanced together
    tool_workers: int = 16


Event = Callable[[str, "Traj", dict], None]


@dataclass
class Traj:
    """A trajectory being generated."""

    prompt: Prompt
    sample: int
    images: list[ConvImage]
    feats: list[ImageFeatures]
    segments: list[Segment]
    refs: list[dict]
    context: list[int]  # compact ids so far: the next prompt
    response_tokens: int = 0
    turns: int = 0
    stop: str | None = None
    final_answer: str | None = None
    tool_calls: Counter = field(default_factory=Counter)
    tool_errors: Counter = field(default_factory=Counter)  # the model's invalid calls
    tool_failures: Counter = field(default_factory=Counter)  # backends that failed
    format_errors: int = 0
    gen_tokens: int = 0
    ms: Counter = field(default_factory=Counter)

    @property
    def id(self) -> str:
        return f"{self.prompt.id}#{self.sample}"


def safe_name(s: str) -> str:
    """A record id as a file name: no separators, no leading dots, bounded length."""
    name = re.sub(r"[^A-Za-z0-9._#=-]", "_", s).lstrip(".")[:80] or "_"
    return name if name == s[:80] else f"{name}-{hashlib.sha1(s.encode()).hexdigest()[:8]}"


class Agent:
    def __init__(self, engine: Engine, tools: list[Tool], cfg: AgentConfig, *,
                 media_dir: Path, rel_to: Path, policy_name: str = "",
                 on_event: Event | None = None) -> None:
        self.engine, self.cfg = engine, cfg
        self.tools = {t.name: t for t in tools}
        self.processor = engine.processor
        self.tok = self.processor.tokenizer
        self.ids = special_ids(self.tok)
        self.system = system_prompt([t.schema for t in tools], cfg.system_prompt)
        self.media_dir, self.rel_to = Path(media_dir), Path(rel_to)
        self.policy_name = policy_name
        self.on_event = on_event or (lambda kind, traj, data: None)

    # ------------------------------------------------------------------ public

    def run(self, jobs: list[tuple[Prompt, int]]) -> Iterator[dict]:
        """Yield finished trajectory records, batch by batch, in job order within a batch."""
        cache: dict[str, tuple[list[ConvImage], list[ImageFeatures], list[dict]]] = {}
        for i in range(0, len(jobs), self.cfg.batch_size):
            batch = [self._start(p, s, cache) for p, s in jobs[i:i + self.cfg.batch_size]]
            while active := [t for t in batch if t.stop is None]:
                self._turn(active)
            for t in batch:
                yield self._record(t)
            cache.clear()

    # ------------------------------------------------------------------ steps

    def _start(self, prompt: Prompt, sample: int, cache: dict) -> Traj:
        if prompt.id not in cache:  # the G samples of a prompt share its decoded images
            images, feats, refs = [], [], []
            for i, path in enumerate(prompt.image_paths()):
                src = open_image(path, max_pixels=MAX_SOURCE_PIXELS,
                                 what=f"prompt {prompt.id!r}: image")
                images.append(ConvImage(image=src, ref={}, root=i, source=src))
                feats.append(image_features(self.processor, src))
                refs.append({"path": self._rel(path), "sha256": sha256_file(path)})
            cache[prompt.id] = (images, feats, refs)
        images, feats, refs = cache[prompt.id]
        parts = prompt_parts(self.system, prompt.question, [f.n_tokens for f in feats])
        toks = encode_parts(self.tok, self.ids, parts)
        seg = Segment("prompt", toks, images=list(range(len(images))))
        return Traj(prompt, sample, list(images), list(feats), [seg], [dict(r) for r in refs],
                    list(toks))

    def _turn(self, active: list[Traj]) -> None:
        reqs = []
        for t in active:
            budget = self.cfg.max_response_tokens - t.response_tokens
            reqs.append(GenRequest(t.context, t.feats, min(self.cfg.max_turn_tokens, budget),
                                   row=t.prompt.extra, turn=t.turns))
        t0 = time.perf_counter()
        gens = self.engine.generate(reqs, self.cfg.sampling)
        gen_ms = (time.perf_counter() - t0) * 1000 / max(1, len(active))
        calls: list[tuple[Traj, ToolCall | FormatError, bool]] = []
        for t, g in zip(active, gens):
            t.turns += 1
            t.ms["generate"] += gen_ms
            closed = g.finish == "stop"
            body = g.tokens[:-1] if closed else g.tokens
            text = self.tok.decode(body, skip_special_tokens=False)
            t.segments.append(Segment("model", g.tokens, logprobs=g.logprobs, text=text))
            t.context += g.tokens
            t.response_tokens += len(g.tokens)
            t.gen_tokens += len(g.tokens)
            action = parse_turn(text)
            self.on_event("model", t, {"text": text, "action": action})
            if isinstance(action, Answer) and closed:
                t.stop, t.final_answer = "answer", action.text
            elif t.response_tokens >= self.cfg.max_response_tokens:
                t.stop = "max_tokens"
            elif isinstance(action, Answer):  # an answer cut off mid-turn: not closed
                calls.append((t, FormatError("reply cut off before <|im_end|>"), closed))
            else:
                calls.append((t, action, closed))
        results = self._run_tools([(t, a) for t, a, _ in calls])
        for (t, action, closed), (res, ms) in zip(calls, results):
            self._observe(t, action, res, ms, closed)
        for t in active:
            if t.stop is None and t.turns >= self.cfg.max_turns:
                t.stop = "max_turns"
            if t.stop:
                self.on_event("stop", t, {"stop": t.stop, "answer": t.final_answer})

    def _run_tools(self, calls: list[tuple[Traj, Any]]) -> list[tuple[ToolResult, int]]:
        def one(item: tuple[Traj, Any]) -> tuple[ToolResult, int]:
            t, action = item
            t0 = time.perf_counter()
            if isinstance(action, FormatError):
                res = ToolResult(f"error: {action.message}", ok=False)
            elif action.name not in self.tools:
                res = ToolResult(f"error: unknown tool {action.name!r}; available: "
                                 f"{', '.join(self.tools)}", ok=False)
            else:
                ctx = ToolContext(images=t.images, row=t.prompt.row())
                try:
                    res = self.tools[action.name](action.arguments, ctx)
                except Exception as e:  # noqa: BLE001 - a tool bug must not kill the batch
                    res = ToolResult(f"error: tool failed ({type(e).__name__}: {e})", ok=False)
            return res, int((time.perf_counter() - t0) * 1000)

        if len(calls) <= 1:
            return [one(c) for c in calls]
        with ThreadPoolExecutor(min(self.cfg.tool_workers, len(calls))) as pool:
            return list(pool.map(one, calls))

    def _observe(self, t: Traj, action: Any, res: ToolResult, ms: int, closed: bool) -> None:
        name = action.name if isinstance(action, ToolCall) else None
        if isinstance(action, FormatError):
            t.format_errors += 1
        else:
            t.tool_calls[name] += 1
            if res.failed:
                t.tool_failures[name] += 1
            elif not res.ok:
                t.tool_errors[name] += 1
        text = res.text
        if len(text) > self.cfg.max_tool_chars:
            text = text[: self.cfg.max_tool_chars] + "\n[truncated]"
        new_idx, counts = [], []
        for k, img in enumerate(res.images):
            idx = len(t.images)
            path = self.media_dir / f"{safe_name(t.id)}-{idx}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            img.image.save(path)
            root = img.root if img.root is not None else idx
            t.images.append(ConvImage(img.image, {}, root=root, box=img.box,
                                      source=img.image if img.root is None else None))
            feat = image_features(self.processor, img.image)
            t.feats.append(feat)
            t.refs.append({"path": self._rel(path), "sha256": sha256_file(path), **img.meta})
            new_idx.append(idx)
            counts.append(feat.n_tokens)
        if counts and text.count("<image>") < len(counts):
            text = text + "".join("\n<image>" for _ in range(len(counts) - text.count("<image>")))
        toks = encode_parts(self.tok, self.ids, tool_parts(text, counts, closed))
        seg = Segment("tool", toks, images=new_idx or None, text=text,
                      tool=name or "invalid", ok=res.ok, ms=ms)
        if res.failed:
            seg.failed = True
        t.segments.append(seg)
        t.context += toks
        t.response_tokens += sum(-x if x < 0 else 1 for x in toks)
        t.ms["tools"] += ms
        self.on_event("tool", t, {"name": name, "args": getattr(action, "arguments", None),
                                  "text": text, "ok": res.ok,
                                  "images": [t.refs[i]["path"] for i in new_idx]})
        if t.response_tokens >= self.cfg.max_response_tokens:
            t.stop = "max_tokens"

    # ------------------------------------------------------------------ output

    def _rel(self, path: Path) -> str:
        try:
            return os.path.relpath(Path(path).resolve(), self.rel_to.resolve())
        except ValueError:  # another drive on Windows
            return str(Path(path).resolve())

    def _record(self, t: Traj) -> dict:
        p = t.prompt
        rec = new_record(**{k: v for k, v in p.extra.items() if k != "v"})
        rec.update(
            id=t.id, prompt_id=p.id, sample=t.sample, policy=self.policy_name,
            question=p.question, answer_gt=p.answer)
        if p.choices is not None:
            rec["choices"] = p.choices
        if p.category is not None:
            rec["category"] = p.category
        rec.update(
            images=t.refs, segments=[s.to_dict() for s in t.segments],
            final_answer=t.final_answer, stop=t.stop, turns=t.turns,
            tool_calls=dict(t.tool_calls), tool_errors=dict(t.tool_errors),
            tool_failures=dict(t.tool_failures),
            format_errors=t.format_errors, response_tokens=t.response_tokens,
            generated_tokens=t.gen_tokens, ms={k: int(v) for k, v in t.ms.items()})
        return rec
