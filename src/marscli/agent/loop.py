"""The agent loop: trajectories advance turn by turn, generating together and calling tools
concurrently, and are recorded with token-exact segments (docs/design.md "The trajectory
record").

Two loops, one set of steps (`_request`, `_take`, `_tool`, `_observe`, `_end_turn`):
- Lock-step (the hf and replay engines, or `lockstep`): a turn sends every active
  trajectory's prompt to the engine in one batch; each reply is parsed (protocol.parse_turn);
  the turn's tool calls run in a thread pool; each observation is appended as a `tool` segment.
  A turn waits for its slowest tool call.
- Asynchronous (an engine with `agenerate`: vllm, server, openai): each trajectory is an
  asyncio task that generates a turn, runs its tool call in a pool of `tool_workers` threads
  and generates the next, while the others are in other phases; at most `max_inflight` run at
  once, started in job order. The engine batches whatever requests are pending (continuous
  batching). The loop runs in a thread of its own and yields records as trajectories finish.
  Requests are seeded per trajectory and turn, so both loops draw the same tokens where the
  engine's numerics do not depend on what shares a batch.

Model mistakes (bad JSON, unknown tool, bad arguments, unclosed tags) become error observations
and are counted; the trajectory goes on until it answers or a limit (turns, response tokens)
stops it. A first prompt longer than `max_prompt_tokens` (the release's prompt-length limit) or
than the engine's context (`max_context`, where the engine knows it: hf, vllm, server) is
refused per row: the trajectory is recorded with `stop: "prompt_too_long"` (the reason in
`error`), no model segment and no request; the others go on. Each reply is capped to the
room left in the context, and a trajectory whose context is full stops with `max_tokens`.
What the tools say of their backends (`ToolResult.health`) adds up per tool into the
record's `tool_health`.

Prompt rendering has three modes, one renderer each (renderers.py), chosen once when the Agent
is built: marscli's own layout; the checkpoint's chat template with `tools=` (`--tools-config`,
token-level engines); chat messages for a message-level engine (`engine.message_level`: the
openai engine), whose trajectories also keep `messages`, which the record carries. The steps
(`_start`, `_take`, `_observe`) ask the renderer for ids and never branch on the mode.

For a message-level engine without a processor (`--tokenize-with`), segments carry text only and
only the generated tokens (as the server counts them) count against `max_response_tokens`. A
request the engine gives up on (`finish == "error"`) ends its trajectory with
`stop: "engine_error"` and the reason in `error`; a conversation the server refuses as longer
than its context (`finish == "context"`) ends it with `stop: "max_tokens"`, a limit reached
(scored as it stands), not an engine failure.

Events (`on_event(kind, traj, data)`, for live traces and progress bars), in order per turn:
- `"text"`, `{"delta": str}`: a new piece of the reply being generated, when the engine streams
  (`engine.streams`: the hf engine) and the listener has not set `wants_text = False`. The
  pieces of a turn add up to exactly the text of its `"model"` event (no `<|im_end|>`); they
  come before it, and `traj.turns` still counts the finished replies only. Engines that do
  not stream send none: the `"model"` event carries the whole reply.
- `"model"`, `{"text", "action"}`: the reply and what it parsed to.
- `"tool"`, `{"name", "args", "text", "ok", "images"}`: the observation of a tool call or
  of a format error (`name` None).
- `"stop"`, `{"stop", "answer"}`: the trajectory ended.

Crop files are named from the trajectory id (`safe_name`): an id that had to be changed to be
a file name carries a hash of the whole id, so no two trajectories share a crop file.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marscli.agent.protocol import Answer, FormatError, ToolCall, parse_turn
from marscli.agent.renderers import choose_renderer
from marscli.agent.trajectory import Traj
from marscli.engines import Engine, Generation, GenRequest, SamplingParams
from marscli.qwen.images import MAX_SOURCE_PIXELS, open_image
from marscli.qwen.tokens import StreamDecoder, image_features, special_ids
from marscli.records.provenance import current_inputs, sha256_file
from marscli.records.schema import Prompt, Segment, new_record
from marscli.tools import ConvImage, NewImage, Tool, ToolContext, ToolResult


@dataclass
class AgentConfig:
    max_turns: int = 10
    max_response_tokens: int = 16_384  # model + tool tokens after the prompt
    max_prompt_tokens: int | None = None  # the first prompt at most (None: the context only)
    max_turn_tokens: int = 2_048  # one reply
    max_tool_chars: int = 8_192
    system_prompt: str | None = None  # None: protocol.SYSTEM_PROMPT
    # Tool schemas rendered by the policy's chat template (`tools=`); None: marscli's own
    # `# Tools` block in the system prompt, tokenised by marscli's layout (tokens.py).
    tool_schemas: list[dict] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    batch_size: int = 32  # lock-step loop: trajectories advanced together
    tool_workers: int = 16
    # Asynchronous loop (engines with `agenerate`): trajectories in flight at once (None:
    # batch_size); `lockstep` keeps the lock-step loop on such an engine too.
    max_inflight: int | None = None
    lockstep: bool = False


Event = Callable[[str, Traj, dict], None]


def safe_name(s: str) -> str:
    """A record id as a file name: no separators, no leading dots, bounded length.

    Distinct ids give distinct names: an id kept as it is stays as it is, and one that had to
    be changed (sanitised, or cut at 80 characters) gets `+` and a hash of the full id — `+`
    never survives sanitising, so such a name cannot equal a kept id's name either. Without the
    hash, two ids sharing their first 80 characters overwrote each other's crops."""
    name = re.sub(r"[^A-Za-z0-9._#=-]", "_", s).lstrip(".")[:80] or "_"
    if name == s:
        return name
    return f"{name}+{hashlib.sha256(s.encode()).hexdigest()[:16]}"


class Agent:
    def __init__(self, engine: Engine, tools: list[Tool], cfg: AgentConfig, *,
                 media_dir: Path, rel_to: Path, policy_name: str = "",
                 on_event: Event | None = None) -> None:
        self.engine, self.cfg = engine, cfg
        # The rendering mode, chosen once: the steps ask the renderer, never the mode. With
        # --tools-config the tools are offered under the schemas' names.
        self.renderer, self.tools = choose_renderer(engine, tools, cfg.system_prompt,
                                                    cfg.tool_schemas)
        self.processor = engine.processor  # None: a message-level engine without a tokenizer
        self.tok = self.processor.tokenizer if self.processor is not None else None
        self.ids = special_ids(self.tok) if self.tok is not None else None
        self.context: int | None = getattr(engine, "max_context", None)  # tokens, if known
        self.media_dir, self.rel_to = Path(media_dir), Path(rel_to)
        # the stage's inputs, taken here: the asyncio loop runs in a thread that cannot see them
        self.inputs = current_inputs()
        self.policy_name = policy_name
        self.on_event = on_event or (lambda kind, traj, data: None)
        # Stream replies as "text" events: someone listens (and has not said
        # `wants_text = False`), the engine streams, and there are tokens to decode.
        self.streaming = (on_event is not None and getattr(on_event, "wants_text", True)
                          and bool(getattr(engine, "streams", False)) and self.tok is not None)

    # ------------------------------------------------------------------ public

    @property
    def asynchronous(self) -> bool:
        """Each trajectory on its own: the engine has `agenerate`, nobody listens for streamed
        text (only the hf engine streams, and it has no async path) and no lock-step asked."""
        return hasattr(self.engine, "agenerate") and not self.cfg.lockstep and not self.streaming

    def run(self, jobs: list[tuple[Prompt, int]]) -> Iterator[dict]:
        """Yield finished trajectory records: lock-step, batch by batch and in job order within
        a batch; asynchronously (`asynchronous`), as each trajectory finishes."""
        if self.asynchronous:
            yield from self._run_async(jobs)
            return
        cache: dict[str, tuple] = {}
        for i in range(0, len(jobs), self.cfg.batch_size):
            batch = [self._start(p, s, cache) for p, s in jobs[i:i + self.cfg.batch_size]]
            while active := [t for t in batch if t.stop is None]:
                self._turn(active)
            for t in batch:
                yield self._record(t)
            cache.clear()

    # ------------------------------------------------------------------ asynchronous loop

    def _run_async(self, jobs: list[tuple[Prompt, int]]) -> Iterator[dict]:
        """The asyncio loop runs in a thread of its own and hands finished records over a
        queue, so that the caller's loop (write, score, count) stays a plain iterator. A
        caller that stops early (an exception in its hook) cancels the trajectories in flight."""
        done: queue.Queue = queue.Queue()
        cancel = threading.Event()

        def main() -> None:
            try:
                asyncio.run(self._trajectories(jobs, done, cancel))
            except BaseException as e:  # re-raised in the caller's thread
                done.put(e)
            else:
                done.put(_DONE)

        thread = threading.Thread(target=main, name="marscli-agent", daemon=True)
        thread.start()
        try:
            while (item := done.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()
            thread.join()

    async def _trajectories(self, jobs: list[tuple[Prompt, int]], done: queue.Queue,
                            cancel: threading.Event) -> None:
        """Every job as a task; at most `max_inflight` past their start (FIFO, so they start
        in job order); tool calls in a pool of `tool_workers` threads. The first failure
        cancels the rest."""
        limit = asyncio.Semaphore(self.cfg.max_inflight or self.cfg.batch_size)
        pool = ThreadPoolExecutor(self.cfg.tool_workers, thread_name_prefix="marscli-tool")
        cache: dict[str, tuple] = {}  # a prompt's decoded images, until its last sample ends
        left = Counter(p.id for p, _ in jobs)

        async def one(prompt: Prompt, sample: int) -> None:
            async with limit:
                if cancel.is_set():
                    raise asyncio.CancelledError
                t = self._start(prompt, sample, cache)
                while t.stop is None:
                    await self._step(t, pool)
                done.put(self._record(t))
                left[prompt.id] -= 1
                if not left[prompt.id]:
                    cache.pop(prompt.id, None)

        tasks = [asyncio.create_task(one(p, s)) for p, s in jobs]
        watch = asyncio.create_task(_wait_for(cancel))
        try:
            finished, _ = await asyncio.wait([asyncio.gather(*tasks), watch],
                                             return_when=asyncio.FIRST_COMPLETED)
            for f in finished:
                if f is not watch:
                    f.result()  # the first trajectory's exception, if any
        finally:
            for task in [*tasks, watch]:
                task.cancel()
            await asyncio.gather(*tasks, watch, return_exceptions=True)
            pool.shutdown(wait=True, cancel_futures=True)

    async def _step(self, t: Traj, pool: ThreadPoolExecutor) -> None:
        """One turn of one trajectory: its request joins whatever the engine is batching;
        its tool call runs in the pool while other trajectories generate."""
        t0 = time.perf_counter()
        g = await self.engine.agenerate(self._request(t), self.cfg.sampling)
        call = self._take(t, g, None, (time.perf_counter() - t0) * 1000)
        if call is not None:
            action, closed = call
            res, ms = await asyncio.get_running_loop().run_in_executor(pool, self._tool, t,
                                                                       action)
            self._observe(t, action, res, ms, closed)
        self._end_turn(t)

    # ------------------------------------------------------------------ steps

    def _start(self, prompt: Prompt, sample: int, cache: dict) -> Traj:
        if prompt.id not in cache:  # the G samples of a prompt share its decoded images
            cache[prompt.id] = self._prompt_images(prompt)
        images, feats, refs, files = cache[prompt.id]
        t = Traj(prompt, sample, list(images), list(feats), [], [dict(r) for r in refs], [],
                 files=list(files))
        toks = self.renderer.prompt(t)
        t.segments.append(Segment("prompt", toks, images=list(range(len(images)))))
        t.context += toks or []
        if (why := self._too_long(t)) is not None:  # refused: recorded, nothing generated
            t.stop, t.error = "prompt_too_long", why
            self.on_event("stop", t, {"stop": t.stop, "answer": None})
        return t

    def _too_long(self, t: Traj) -> str | None:
        """Why the first prompt may not be sampled from: longer than `max_prompt_tokens`, or
        leaving no room in the engine's context (`max_context`); None when it fits or its
        length is not known (a message-level engine without a tokenizer)."""
        if self.tok is None:
            return None
        n = _length(t.context)
        if self.cfg.max_prompt_tokens is not None and n > self.cfg.max_prompt_tokens:
            return f"prompt of {n} tokens, over --max-prompt-tokens {self.cfg.max_prompt_tokens}"
        if self.context is not None and n >= self.context:
            return f"prompt of {n} tokens, past the model's context of {self.context}"
        return None

    def _prompt_images(self, prompt: Prompt) -> tuple[list, list, list, list]:
        """A prompt's images, decoded once: (images, features, refs, files)."""
        images, feats, refs, files = [], [], [], []
        for i, path in enumerate(prompt.image_paths()):
            src = open_image(path, max_pixels=MAX_SOURCE_PIXELS,
                             what=f"prompt {prompt.id!r}: image")
            images.append(ConvImage(image=src, ref={}, root=i, source=src))
            if self.processor is not None:  # without one nothing is tokenised
                feats.append(image_features(self.processor, src))
            refs.append({"path": self._rel(path), "sha256": sha256_file(path)})
            files.append(Path(path))
        return images, feats, refs, files

    def _turn(self, active: list[Traj]) -> None:
        """One lock-step turn: every active trajectory generates in one batch, then the
        turn's tool calls run together."""
        t0 = time.perf_counter()
        gens, streams = self._generate(active, [self._request(t) for t in active])
        gen_ms = (time.perf_counter() - t0) * 1000 / max(1, len(active))
        calls = [(t, *call) for t, g, stream in zip(active, gens, streams)
                 if (call := self._take(t, g, stream, gen_ms)) is not None]
        results = self._run_tools([(t, a) for t, a, _ in calls])
        for (t, action, closed), (res, ms) in zip(calls, results):
            self._observe(t, action, res, ms, closed)
        for t in active:
            self._end_turn(t)

    def _request(self, t: Traj) -> GenRequest:
        budget = self.cfg.max_response_tokens - t.response_tokens
        if self.context is not None and self.tok is not None:  # never sample past the context
            budget = min(budget, self.context - _length(t.context))
        return GenRequest(t.context, t.feats, min(self.cfg.max_turn_tokens, budget),
                          row=t.prompt.extra, turn=t.turns, messages=t.messages,
                          image_files=t.files, key=t.id)

    def _take(self, t: Traj, g: Generation, stream: StreamDecoder | None, gen_ms: float
              ) -> tuple[ToolCall | FormatError, bool] | None:
        """Record a reply; the tool call it asks for (or the format error to observe) and
        whether the turn closed, or None when the trajectory stopped."""
        if g.finish == "error":  # the engine gave up on this request: end it, recorded
            t.stop, t.error = "engine_error", g.error or "engine error"
            return None
        if g.finish == "context":  # the conversation outgrew the server's context window
            t.stop = "max_tokens"
            return None
        closed = g.finish == "stop"
        text, toks, logprobs = self.renderer.reply(t, g, closed)
        if stream is not None and (rest := stream.rest(text)):  # what was held back
            self.on_event("text", t, {"delta": rest})
        t.turns += 1
        t.ms["generate"] += gen_ms
        t.segments.append(Segment("model", toks, logprobs=logprobs, text=text))
        n = len(toks) if toks is not None else (g.usage or 0)
        t.context += toks or []
        t.response_tokens += n
        t.gen_tokens += n
        action = parse_turn(text)
        self.on_event("model", t, {"text": text, "action": action})
        if isinstance(action, Answer) and closed:
            t.stop, t.final_answer = "answer", action.text
        elif t.response_tokens >= self.cfg.max_response_tokens:
            t.stop = "max_tokens"
        elif isinstance(action, Answer):  # an answer cut off mid-turn: not closed
            return FormatError("reply cut off before <|im_end|>"), closed
        else:
            return action, closed
        return None

    def _end_turn(self, t: Traj) -> None:
        if t.stop is None and t.turns >= self.cfg.max_turns:
            t.stop = "max_turns"
        if (t.stop is None and self.context is not None and self.tok is not None
                and _length(t.context) >= self.context):  # the context is full: a token budget
            t.stop = "max_tokens"
        if t.stop:
            self.on_event("stop", t, {"stop": t.stop, "answer": t.final_answer})

    def _generate(self, active: list[Traj], reqs: list[GenRequest]
                  ) -> tuple[list[Generation], list[StreamDecoder | None]]:
        """The engine's replies; streamed as `"text"` events when someone listens and the
        engine streams (one decoder per request, whose leftovers the caller emits)."""
        if not self.streaming:
            return self.engine.generate(reqs, self.cfg.sampling), [None] * len(reqs)
        decoders = [StreamDecoder(self.tok, self.ids.im_end) for _ in reqs]

        def on_tokens(i: int, ids: list[int]) -> None:
            if piece := decoders[i].push(ids):
                self.on_event("text", active[i], {"delta": piece})

        return self.engine.generate(reqs, self.cfg.sampling, on_tokens=on_tokens), decoders

    def _run_tools(self, calls: list[tuple[Traj, Any]]) -> list[tuple[ToolResult, int]]:
        if len(calls) <= 1:
            return [self._tool(t, a) for t, a in calls]
        with ThreadPoolExecutor(min(self.cfg.tool_workers, len(calls))) as pool:
            return list(pool.map(lambda c: self._tool(*c), calls))

    def _tool(self, t: Traj, action: Any) -> tuple[ToolResult, int]:
        """Run one tool call (thread-safe: it reads the trajectory, never writes it)."""
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
            except Exception as e:  # a tool bug must not kill the batch
                res = ToolResult(f"error: tool failed ({type(e).__name__}: {e})", ok=False)
        return res, int((time.perf_counter() - t0) * 1000)

    def _observe(self, t: Traj, action: Any, res: ToolResult, ms: int, closed: bool) -> None:
        """Append an observation (a tool's result, or a format error's) as a tool segment."""
        name = self._count(t, action, res)
        text = res.text
        if len(text) > self.cfg.max_tool_chars:
            text = text[: self.cfg.max_tool_chars] + "\n[truncated]"
        new_idx = list(range(len(t.images), len(t.images) + len(res.images)))
        counts = [n for img in res.images if (n := self._keep_image(t, img)) is not None]
        text, toks = self.renderer.tool(t, text, new_idx, counts, closed)
        if toks is not None:
            t.context += toks
            t.response_tokens += sum(-x if x < 0 else 1 for x in toks)
        seg = Segment("tool", toks, images=new_idx or None, text=text,
                      tool=name or "invalid", ok=res.ok, ms=ms)
        if res.failed:
            seg.failed = True
        t.segments.append(seg)
        t.ms["tools"] += ms
        self.on_event("tool", t, {"name": name, "args": getattr(action, "arguments", None),
                                  "text": text, "ok": res.ok,
                                  "images": [t.refs[i]["path"] for i in new_idx]})
        if t.response_tokens >= self.cfg.max_response_tokens:
            t.stop = "max_tokens"

    @staticmethod
    def _count(t: Traj, action: Any, res: ToolResult) -> str | None:
        """Count a call (or format error) and its outcome; the tool's name (None: a format
        error)."""
        if isinstance(action, FormatError):
            t.format_errors += 1
            return None
        t.tool_calls[action.name] += 1
        if res.health:
            t.tool_health.setdefault(action.name, Counter()).update(res.health)
        if res.failed:
            t.tool_failures[action.name] += 1
        elif not res.ok:
            t.tool_errors[action.name] += 1
        return action.name

    def _keep_image(self, t: Traj, img: NewImage) -> int | None:
        """Save a tool's image as the trajectory's next one (a crop file under `media_dir`);
        its image-token count, None without a processor."""
        idx = len(t.images)
        path = self.media_dir / f"{safe_name(t.id)}-{idx}.png"
        self.inputs.check_not_input(path)  # a crop named as an input picture (--crops-dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        img.image.save(path)
        root = img.root if img.root is not None else idx
        t.images.append(ConvImage(img.image, {}, root=root, box=img.box,
                                  source=img.image if img.root is None else None))
        t.files.append(path)
        t.refs.append({"path": self._rel(path), "sha256": sha256_file(path), **img.meta})
        if self.processor is None:
            return None
        feat = image_features(self.processor, img.image)
        t.feats.append(feat)
        return feat.n_tokens

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
            tool_health={k: dict(sorted(v.items())) for k, v in sorted(t.tool_health.items())},
            format_errors=t.format_errors, response_tokens=t.response_tokens,
            generated_tokens=t.gen_tokens,
            logprobs_mode=getattr(self.engine, "logprobs_mode", None))
        if t.messages is not None:
            rec["messages"] = t.messages
        if t.error is not None:
            rec["error"] = t.error
        rec["ms"] = {k: int(v) for k, v in t.ms.items()}  # timings: the only fields that vary
        return rec


_DONE = object()  # the asynchronous loop's end-of-records marker


def _length(context: list[int]) -> int:
    """Tokens as the model sees them (a compact placeholder -n is n image tokens)."""
    return sum(-x if x < 0 else 1 for x in context)


async def _wait_for(event: threading.Event) -> None:
    """Return once `event` is set (polled: a threading.Event has no awaitable)."""
    while not event.is_set():
        await asyncio.sleep(0.05)
