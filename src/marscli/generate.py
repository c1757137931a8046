"""One resumable generation loop for `rollout`, `eval` and `ask`, and the options that drive it.

- `GenerationOptions` holds what the three stages share (engine, sampling, limits, tools,
  search), declared once. `check()` validates it before anything is read or loaded: the ranges
  here, the engine's own rules in the engine (`engines.check_engine`). Its `asdict` is the
  stage's sidecar config, so a run records exactly the options that produced it.
- Shards: `--shard i/N` (0-based) keeps the ids whose stable hash is i (`shard_of`), so the N
  parts of a Slurm array together give exactly the ids of one run, whatever the row order; the
  samples of a prompt share its shard.
- `check_images`: every image must exist and decode before any generation (a draft decode of
  at most `CHECK_PIXELS`), so a bad row costs no model load and writes no output.
- `generate`: an existing output is opened first (cutting a torn tail) and the ids already in
  it are skipped, so a finished run re-run loads no model; the engine loads only when something
  is pending, and a new output is created only once it has. Each complete record goes through
  the stage's `on_record` hook (eval scores it), then is appended. Crops and thumbnails go to
  `OUT.media/`; records hold paths relative to the output's folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marscli.engines import SamplingParams, check_engine, make_engine
from marscli.errors import BadInput, check_range

if TYPE_CHECKING:  # the CLI imports this module for the defaults: the rest loads when used
    from marscli.agent import AgentConfig, Event
    from marscli.jsonl import AppendJsonl
    from marscli.records import Prompt

CHECK_PIXELS = 1_000_000  # the up-front image check decodes at most this (JPEG draft mode)


@dataclass
class GenerationOptions:
    """What rollout, eval and ask generate with; the CLI's options of the same names."""

    # engine
    engine: str = "hf"
    policy: str | None = None  # checkpoint folder or hub id (engines that load one)
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    engine_opts: dict[str, Any] = field(default_factory=dict)  # the engine's own (`options`)
    # sampling
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    # limits
    max_turns: int | None = 10  # None: the stage's default (eval: 10, or 1 with --mode direct)
    max_turn_tokens: int = 2_048  # one reply
    max_response_tokens: int = 16_384  # model + tool tokens after the prompt
    batch_size: int = 32  # trajectories advanced together
    # tools and search
    system_prompt: str | None = None  # a file replacing the system prompt
    text_search: str | None = None
    image_search: str | None = None
    search_timeout: float = 30.0
    search_retries: int = 2
    search_opts: dict[str, Any] = field(default_factory=dict)  # more SearchOptions fields (win)

    def __post_init__(self) -> None:
        self.engine_opts = {k: v for k, v in self.engine_opts.items() if v is not None}

    def check(self) -> None:
        """BadInput naming the option, before anything is read or loaded."""
        check_range("--temperature", self.temperature, 0)
        check_range("--top-p", self.top_p, 0, 1, lo_open=True)
        check_range("--top-k", self.top_k, 0)
        check_range("--max-turns", self.max_turns, 1)
        check_range("--max-turn-tokens", self.max_turn_tokens, 1)
        check_range("--max-response-tokens", self.max_response_tokens, 1)
        check_range("--batch-size", self.batch_size, 1)
        check_range("--search-timeout", self.search_timeout, 0, lo_open=True)
        check_range("--search-retries", self.search_retries, 0)
        check_engine(self.engine, self.policy, self.engine_opts)

    @property
    def policy_name(self) -> str:
        """What records carry as `policy`: the checkpoint, or the served model's name."""
        return self.policy if self.policy is not None else str(self.engine_opts.get("model") or "")

    def tools(self) -> list:
        """The tools offered to the model: zoom-in always, search where a backend is set."""
        from marscli.tools import build_tools

        opts = {"timeout": self.search_timeout, "attempts": self.search_retries + 1,
                **self.search_opts}
        return build_tools(text_search=self.text_search, image_search=self.image_search, **opts)

    def agent_config(self, system_prompt: str | None) -> AgentConfig:
        """`system_prompt`: the text (the stage reads the file `self.system_prompt` early)."""
        from marscli.agent import AgentConfig

        return AgentConfig(
            max_turns=AgentConfig.max_turns if self.max_turns is None else self.max_turns,
            max_response_tokens=self.max_response_tokens, max_turn_tokens=self.max_turn_tokens,
            system_prompt=system_prompt, batch_size=self.batch_size,
            sampling=SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                    top_k=self.top_k, max_new_tokens=self.max_turn_tokens,
                                    seed=self.seed))

    def sidecar(self, engine: Any) -> dict:
        """The sidecar's config: these options, the records' policy name, and the engine's
        own settings where it reports them (else the options it was given)."""
        config = engine.config() if hasattr(engine, "config") else dict(self.engine_opts)
        return {**asdict(self), "policy": self.policy_name, "engine_options": config}


# ----------------------------------------------------------------------------- shards and images


def parse_shard(spec: str | None, option: str = "--shard") -> tuple[int, int]:
    """`"i/N"` → (i, N), shards numbered 0..N-1 (`$SLURM_ARRAY_TASK_ID/N` with `--array
    0-(N-1)`); None → (0, 1), everything."""
    if spec is None:
        return 0, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m:
        raise BadInput(f"{option}: {spec!r} is not i/N — e.g. 0/4 (shards are numbered 0..N-1)")
    i, n = int(m[1]), int(m[2])
    if n < 1:
        raise BadInput(f"{option}: {spec}: N must be at least 1")
    if i >= n:
        raise BadInput(f"{option}: {spec}: shard {i} is out of range — the shards of {n} are "
                       f"numbered 0..{n - 1}")
    return i, n


def shard_of(prompt_id: str, n: int) -> int:
    """The shard of a prompt id: a stable hash (not Python's `hash`, which is salted per run)."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big") % n


def in_shard(prompt_id: str, shard: tuple[int, int]) -> bool:
    return shard_of(prompt_id, shard[1]) == shard[0]


def media_dir(output: str | Path) -> Path:
    """`runs/traj.jsonl` → `runs/traj.media` (crops and thumbnails of that file)."""
    p = Path(output)
    return p.with_name(p.name.removesuffix(".jsonl") + ".media")


def check_images(src: str, rows: list[tuple[int, Prompt]], unit: str = "line") -> None:
    """Every image must exist and decode, before any generation; one error line names where
    the row is (`SRC:LINE`, or `SRC: UNIT N` for rows that are not lines) and the image. Each
    file is checked once."""
    from marscli.images import open_image

    checked: set[Path] = set()
    for line, p in rows:
        for path in p.image_paths():
            if path in checked:
                continue
            try:
                open_image(path, max_pixels=CHECK_PIXELS)
            except BadInput as e:
                where = f"{src}:{line}" if unit == "line" else f"{src}: {unit} {line}"
                raise BadInput(f"{where}: image: {e}") from None
            checked.add(path)


# ----------------------------------------------------------------------------- the loop


@dataclass
class Generated:
    """What one `generate` call did: this run's counts and speeds (for the sidecar), and the
    engine (None when nothing was pending, so none was loaded)."""

    stats: dict
    engine: Any = None

    @property
    def all_failed(self) -> bool:
        """Every new trajectory failed at the engine: the server is down or misconfigured."""
        return bool(self.stats["new"]) and self.stats["new_engine_errors"] == self.stats["new"]


def generate(jobs: list[tuple[Prompt, int]], gen: GenerationOptions, tools: list, *,
             output: str | None, system_prompt: str | None, label: str,
             on_record: Callable[[dict], None] | None = None, on_event: Event | None = None,
             media: Path | None = None, rel_to: Path | None = None,
             progress: bool = True) -> Generated:
    """Run the agent over the jobs not yet in `output` and append each record (after
    `on_record`). A job (prompt, k) is trajectory PROMPTID#k. Without an output (`ask`) every
    job runs and records reach `on_record` only; `media` and `rel_to` then say where crops go
    and what record paths are relative to. `on_event` replaces the progress bar (labelled
    `label`, shown on a terminal only)."""
    from marscli.agent import Agent
    from marscli.jsonl import AppendJsonl

    with contextlib.ExitStack() as stack:
        out = stack.enter_context(AppendJsonl(output)) if output and Path(output).exists() else None
        pending = [(p, k) for p, k in jobs if out is None or f"{p.id}#{k}" not in out.ids]
        eng = make_engine(gen.engine, gen.policy, device=gen.device, max_batch=gen.batch_size,
                          **gen.engine_opts) if pending else None
        if output and out is None:
            out = stack.enter_context(AppendJsonl(output))
        run = {"new": 0, "skipped": len(jobs) - len(pending), "new_engine_errors": 0,
               "first_error": None, "generated_tokens": 0}
        t0 = time.perf_counter()
        if pending:
            with _progress(label, len(pending), progress and on_event is None) as advance:
                agent = Agent(eng, tools, gen.agent_config(system_prompt),
                              media_dir=media or media_dir(output),
                              rel_to=rel_to or Path(output).parent,
                              policy_name=gen.policy_name, on_event=on_event or advance)
                _append(agent.run(pending), out, on_record, run)
    wall = time.perf_counter() - t0
    run["generate_s"] = round(wall, 3)
    run["trajectories_per_s"] = round(run["new"] / wall, 3) if run["new"] else None
    run["generated_tokens_per_s"] = round(run["generated_tokens"] / wall, 1) if run["new"] else None
    run["tools"] = {t.name: t.stats() for t in tools if hasattr(t, "stats")}
    if hasattr(eng, "stats"):
        run["engine"] = eng.stats()
    return Generated(run, eng)


@contextlib.contextmanager
def _progress(label: str, total: int, show: bool) -> Iterator[Event]:
    """A progress bar on stderr (a terminal only) and the agent event that advances it."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from marscli.trace import stderr_console

    console = stderr_console()
    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=console,
                   disable=not (show and console.is_terminal))
    task = bar.add_task(label, total=total)

    def advance(kind: str, traj: Any, data: dict) -> None:
        if kind == "stop":
            bar.advance(task)

    with bar:
        yield advance


def _append(records: Iterator[dict], out: AppendJsonl | None,
            on_record: Callable[[dict], None] | None, run: dict) -> None:
    """Each record through `on_record`, then appended, and counted in `run`."""
    for rec in records:
        if on_record is not None:
            on_record(rec)
        if out is not None:
            out.write(rec)
        run["new"] += 1
        run["generated_tokens"] += rec.get("generated_tokens", 0)
        if rec["stop"] == "engine_error":
            run["new_engine_errors"] += 1
            run["first_error"] = run["first_error"] or rec.get("error")
