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
- `generate`: an existing output is opened first (locked, a torn tail cut) and the ids already
  in it are skipped, so a finished run re-run loads no model; the engine loads only when
  something is pending, and a new output (locked from the start) is created only once it has,
  so a policy that fails to load leaves nothing behind. Each complete record goes through the
  stage's `on_record` hook (eval scores it), then is appended. Crops and thumbnails go to
  `OUT.media/`; records hold paths relative to the output's folder.
- `--tools-config FILE` (`tools_config`): tool schemas read by `tools_config.load_tool_schemas`
  when the options are checked; the agent then renders prompts through the policy's chat
  template with `tools=` (renderers.py). Their hash is a sample setting.
- Settings: the stage's `sample_settings` (what decides the samples: policy and a cheap
  fingerprint of its weights, processor, tokenizer and chat template, engine, sampling,
  limits, tools, system prompt, seed, plus the stage's own) are written to
  `OUT.settings.json` before the first record; adding to records made with other settings is
  refused (`check_settings`: BadInput naming the setting, old → new). `start_over` is
  `--force`.
- Inputs: each record carries `input_hash` (`InputHashes`: its prompt row's question, image
  bytes, gold and image-search results); resuming over records whose row has changed under its
  id is refused (`check_inputs`: BadInput naming the id and what changed).
- Output `-` (`StdoutSink`): every job runs (no resume) and each record goes to stdout as one
  flushed line, its image paths absolute.
- Counts have upper bounds (`MAX_SAMPLES`, `MAX_BATCH`, ...), checked with the options.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marscli.configs import from_names
from marscli.engines import ENGINES, SamplingParams, check_engine, make_engine, split_engine
from marscli.errors import BadInput, check_range
from marscli.records.provenance import note_inputs, weights_fingerprint

if TYPE_CHECKING:  # the CLI imports this module for the defaults: the rest loads when used
    from marscli.agent.loop import AgentConfig, Event
    from marscli.records.outputs import AppendJsonl
    from marscli.records.schema import Prompt

CHECK_PIXELS = 1_000_000  # the up-front image check decodes at most this (JPEG draft mode)
# Upper bounds of the counts, so that a typo (-n 1000000000000) is refused before anything is
# read rather than growing memory until the OOM killer: far above any real setting.
MAX_SAMPLES = 1024  # -n, --samples: trajectories per prompt
MAX_BATCH = 4096  # --batch-size
MAX_TURNS = 100  # --max-turns (the paper: 10)
MAX_TOKENS = 1 << 20  # --max-turn-tokens, --max-response-tokens (the paper: 16,384)


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
    presence_penalty: float = 0.0  # the release samples with 1.5 (vllm and openai engines)
    seed: int = 0
    # limits
    max_turns: int | None = 10  # None: the stage's default (eval: 10, or 1 with --mode direct)
    max_turn_tokens: int = 2_048  # one reply
    max_response_tokens: int = 16_384  # model + tool tokens after the prompt
    max_prompt_tokens: int | None = None  # the first prompt (the release's prompt limit)
    batch_size: int = 32  # lock-step loop: trajectories advanced together
    max_inflight: int | None = None  # asynchronous loop: trajectories in flight (None: batch)
    lockstep: bool = False  # the lock-step loop even on an engine with an asynchronous one
    # tools and search
    system_prompt: str | None = None  # a file replacing the system prompt
    tools_config: str | None = None  # tool schemas (release YAML / JSON): render by template
    text_search: str | None = None
    image_search: str | None = None
    search_timeout: float = 30.0
    search_retries: int = 2
    search_opts: dict[str, Any] = field(default_factory=dict)  # more SearchOptions fields (win)

    def __post_init__(self) -> None:
        self.engine_opts = {k: v for k, v in self.engine_opts.items() if v is not None}
        self.engine, url = split_engine(self.engine)  # --engine server:http://HOST:PORT
        if url is not None:
            self.engine_opts["base_url"] = url

    def check(self) -> None:
        """BadInput naming the option, before anything is read or loaded; then the files
        the stage will read besides its data (`read_paths`) are noted as its inputs."""
        from marscli.http import MAX_RETRIES, MAX_TIMEOUT  # requests: not on --help's path

        check_range("--temperature", self.temperature, 0)
        check_range("--top-p", self.top_p, 0, 1, lo_open=True)
        check_range("--top-k", self.top_k, 0)
        check_range("--presence-penalty", self.presence_penalty, -2, 2)
        if self.presence_penalty and not getattr(ENGINES.get(self.engine), "presence_penalty",
                                                 False):
            takes = [n for n in ENGINES.names() if getattr(ENGINES.get(n), "presence_penalty",
                                                           False)]
            raise BadInput(f"--presence-penalty: the {self.engine} engine has none — use "
                           f"--engine {' or '.join(takes)}")
        check_range("--max-turns", self.max_turns, 1, MAX_TURNS)
        check_range("--max-turn-tokens", self.max_turn_tokens, 1, MAX_TOKENS)
        check_range("--max-response-tokens", self.max_response_tokens, 1, MAX_TOKENS)
        check_range("--max-prompt-tokens", self.max_prompt_tokens, 1, MAX_TOKENS)
        check_range("--batch-size", self.batch_size, 1, MAX_BATCH)
        check_range("--max-inflight", self.max_inflight, 1, MAX_BATCH)
        check_range("--search-timeout", self.search_timeout, 0, MAX_TIMEOUT, lo_open=True)
        check_range("--search-retries", self.search_retries, 0, MAX_RETRIES)
        check_engine(self.engine, self.policy, self.engine_opts)
        self.tool_schemas()  # a bad --tools-config fails before anything is loaded
        # read as text, by transformers or by SQLite: the stage's outputs may not be them
        note_inputs(*self.read_paths(), files_in_folders=True)

    def tool_schemas(self) -> list[dict] | None:
        """The schemas of `--tools-config` (tools_config.load_tool_schemas), None without one."""
        if self.tools_config is None:
            return None
        from marscli.agent.tools_config import load_tool_schemas

        return load_tool_schemas(self.tools_config)

    def input_files(self) -> list[str]:
        """The files besides the stage's data that decide its output (for the sidecar)."""
        return [f for f in (self.system_prompt, self.tools_config) if f]

    def read_paths(self) -> list[str]:
        """What a tracker must never write into: `input_files`, the policy's folder (none for
        a hub id or a served model's name: nothing on this disk) and the local search indexes
        (`--text-search local:INDEX`, `--image-search local:INDEX`)."""
        from marscli.search import parse_spec

        folder = [self.policy] if self.policy and os.path.isdir(self.policy) else []
        indexes = [arg for name, arg in map(parse_spec, filter(None, (
            self.text_search, self.image_search))) if name == "local" and arg]
        return [*self.input_files(), *folder, *indexes]

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

    @property
    def sampling(self) -> SamplingParams:
        """The fields of the same names; a reply's cap is `max_turn_tokens`."""
        return from_names(SamplingParams, self, max_new_tokens=self.max_turn_tokens)

    def agent_config(self, system_prompt: str | None) -> AgentConfig:
        """The fields of the same names (limits, batching); `system_prompt`: the text (the
        stage reads the file `self.system_prompt` early)."""
        from marscli.agent.loop import AgentConfig

        return from_names(
            AgentConfig, self, system_prompt=system_prompt, tool_schemas=self.tool_schemas(),
            max_turns=AgentConfig.max_turns if self.max_turns is None else self.max_turns,
            sampling=self.sampling)

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


def check_images(src: str, rows: list[tuple[int, Prompt]], unit: str = "line",
                 where: dict[str, str] | None = None) -> None:
    """Every image must exist and decode, before any generation; one error line names where
    the row is (`where[id]`, else `SRC:LINE`, or `SRC: UNIT N` for rows that are not lines)
    and the image. Each file is checked once."""
    from marscli.qwen.images import open_image

    checked: set[Path] = set()
    for line, p in rows:
        for path in p.image_paths():
            if path in checked:
                continue
            try:
                open_image(path, max_pixels=CHECK_PIXELS, for_model=True)
            except BadInput as e:
                at = (where or {}).get(p.id) or (f"{src}:{line}" if unit == "line"
                                                 else f"{src}: {unit} {line}")
                raise BadInput(f"{at}: image: {e}") from None
            checked.add(path)
            note_inputs(path)  # no output of the stage may be written onto it


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
             progress: bool = True, settings: dict | None = None,
             finished: tuple[Path, ...] = ()) -> Generated:
    """Run the agent over the jobs not yet in `output` and append each record (after
    `on_record`). A job (prompt, k) is trajectory PROMPTID#k. Without an output (`ask`) every
    job runs and records reach `on_record` only; `media` and `rel_to` then say where crops go
    and what record paths are relative to. `output` "-" streams every job's record to stdout
    (no resume; image paths absolute). `settings` (`sample_settings`): what the records
    already in `output` must have been made with (`check_settings`), recorded in
    `OUT.settings.json` before the first record. `on_event` replaces the progress bar
    (labelled `label`, shown on a terminal only). `finished`: what besides `OUT.meta.json`
    says the output is complete (eval's summary), removed before new records are appended."""
    from marscli.agent.loop import Agent
    from marscli.agent.progress import progress_bar
    from marscli.records.locks import OutputLock
    from marscli.records.outputs import AppendJsonl

    hashes = InputHashes(p for p, _ in jobs) if output else None
    for p, _ in jobs:  # no crop (`Agent._keep_image`) may be written onto a prompt's picture
        note_inputs(*p.image_paths())
    with contextlib.ExitStack() as stack:
        out: AppendJsonl | StdoutSink | None = None
        if output == "-":
            out = StdoutSink(rel_to or Path.cwd())
        elif output and Path(output).exists():
            out = _resume(stack, output, settings, hashes)
        elif output:  # a new output: locked now, created once the engine has loaded
            _make_parent(output)
            stack.enter_context(OutputLock(output))
        pending = [(p, k) for p, k in jobs if out is None or f"{p.id}#{k}" not in out.ids]
        if pending and isinstance(out, AppendJsonl):  # a finished output that grows again:
            for done in (Path(f"{output}.meta.json"), *finished):  # a kill must not leave the
                done.unlink(missing_ok=True)  # files that say it is complete (make, merge)
        eng = make_engine(gen.engine, gen.policy, device=gen.device, max_batch=gen.batch_size,
                          **gen.engine_opts) if pending else None
        if output and out is None:
            if settings is not None:
                check_settings(output, settings, frozenset())
            out = stack.enter_context(AppendJsonl(output))
        run = {"new": 0, "skipped": len(jobs) - len(pending), "new_engine_errors": 0,
               "first_error": None, "generated_tokens": 0}
        t0 = time.perf_counter()
        if pending:
            base = rel_to or (Path.cwd() if output == "-" else Path(output).parent)
            with progress_bar(label, len(pending), progress and on_event is None) as advance:
                agent = Agent(eng, tools, gen.agent_config(system_prompt),
                              media_dir=media or media_dir(output), rel_to=base,
                              policy_name=getattr(eng, "policy_name", None) or gen.policy_name,
                              on_event=on_event or advance)
                _append(agent.run(pending), out, on_record, run, hashes)
    wall = time.perf_counter() - t0
    run["generate_s"] = round(wall, 3)
    run["trajectories_per_s"] = round(run["new"] / wall, 3) if run["new"] else None
    run["generated_tokens_per_s"] = round(run["generated_tokens"] / wall, 1) if run["new"] else None
    run["tools"] = {t.name: t.stats() for t in tools if hasattr(t, "stats")}
    if hasattr(eng, "stats"):
        run["engine"] = eng.stats()
    return Generated(run, eng)


def _make_parent(output: str) -> None:
    """The output's folder, made (BadInput naming it when it cannot be)."""
    try:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{output}: cannot write here ({e.strerror or e})") from None


def _resume(stack: contextlib.ExitStack, output: str, settings: dict | None,
            hashes: InputHashes | None) -> AppendJsonl:
    """An existing output, opened (locked) before its settings and inputs are checked: it
    must have been made with `settings` (`check_settings`) from the rows it is resumed with
    (`check_inputs`)."""
    from marscli.records.outputs import AppendJsonl

    recorded: dict[str, tuple[int, Any]] = {}  # prompt id → (line, input_hash) of its first

    def note(line: int, rec: dict) -> None:
        if isinstance(rec, dict):
            recorded.setdefault(str(rec.get("prompt_id")), (line, rec.get("input_hash")))

    out = stack.enter_context(AppendJsonl(output, on_row=note))
    if settings is not None:
        check_settings(output, settings, out.ids)
    if hashes is not None:
        check_inputs(output, recorded, hashes)
    return out


def _append(records: Iterator[dict], out: AppendJsonl | StdoutSink | None,
            on_record: Callable[[dict], None] | None, run: dict,
            hashes: InputHashes | None = None) -> None:
    """Each record (with its prompt's `input_hash`) through `on_record`, then appended, and
    counted in `run`."""
    for rec in records:
        if hashes is not None:
            rec["input_hash"] = hashes.of(rec["prompt_id"])
        if on_record is not None:
            on_record(rec)
        if out is not None:
            out.write(rec)
        run["new"] += 1
        run["generated_tokens"] += rec.get("generated_tokens", 0)
        if rec["stop"] == "engine_error":
            run["new_engine_errors"] += 1
            run["first_error"] = run["first_error"] or rec.get("error")


class StdoutSink:
    """`-o -`: each complete record to stdout as one flushed line, so a pipe's next stage
    reads trajectories as they finish. Nothing is resumed (`ids` stays empty), and image
    paths become absolute (from `base`, the folder the agent made them relative to), so
    whichever file the pipe ends in, `reward` and `update` find the crops."""

    def __init__(self, base: Path) -> None:
        self.base = Path(base).resolve()
        self.ids: frozenset[str] = frozenset()

    def write(self, rec: dict) -> None:
        from marscli.records.jsonl import dumps

        for ref in rec.get("images") or []:
            ref["path"] = os.path.normpath(self.base / ref["path"])
        sys.stdout.buffer.write(dumps(rec))
        sys.stdout.buffer.flush()


# ----------------------------------------------------------------------------- run settings
# A resumed output must not mix runs: the records already there and the ones this run adds
# must come from the same settings. They are written to OUT.settings.json before the first
# record (the sidecar comes only at the end of a complete run, so a killed run has none).

def sample_settings(gen: GenerationOptions, system_prompt: str | None, **stage: Any) -> dict:
    """What decides the samples of a run, flat, named like the options (`stage`: the stage's
    own, e.g. n and shard). Batch size, device, progress, timeouts and retries do not change
    what is sampled and are left out. Secrets in URLs are redacted."""
    import orjson

    from marscli.secrets import redact

    engine_opts = {k: gen.engine_opts.get(k) for k in ("base_url", "model", "tokenize_with")}
    prompt = None if system_prompt is None else hashlib.sha256(system_prompt.encode()).hexdigest()
    schemas = gen.tool_schemas()
    tools = None if schemas is None else hashlib.sha256(orjson.dumps(schemas)).hexdigest()
    return redact({
        "policy": gen.policy_name, "weights": weights_fingerprint(gen.policy),
        "engine": gen.engine, **engine_opts, "temperature": gen.temperature,
        "top_p": gen.top_p, "top_k": gen.top_k,
        "presence_penalty": gen.presence_penalty or None,  # None: as a file written before it
        "seed": gen.seed, "max_turns": gen.max_turns,
        "max_turn_tokens": gen.max_turn_tokens, "max_response_tokens": gen.max_response_tokens,
        "max_prompt_tokens": gen.max_prompt_tokens,  # None: as a file written before it
        "system_prompt": prompt, "tools_config": tools, "text_search": gen.text_search,
        "image_search": gen.image_search, "search_options": dict(sorted(gen.search_opts.items())),
        **stage})


def settings_path(output: str | Path) -> Path:
    """`runs/traj.jsonl` → `runs/traj.jsonl.settings.json`."""
    return Path(f"{output}.settings.json")


def _option(key: str) -> str:
    return {"n": "-n", "weights": "--policy (its weights)"}.get(key, "--" + key.replace("_", "-"))


def check_settings(output: str, settings: dict, ids: set[str] | frozenset[str]) -> None:
    """Refuse to add to records made with other settings (BadInput naming the first setting
    that differs, old → new); record `settings` when `output` holds no record yet. The policy
    path itself may differ (a moved run folder) when the weights are the same."""
    import orjson

    from marscli.records.outputs import AtomicFile

    path = settings_path(output)
    if not ids:
        with AtomicFile(path) as fh:
            fh.write(orjson.dumps({"v": 1, "settings": settings}, option=orjson.OPT_INDENT_2))
        return
    try:
        old = read_settings(path, "add --force to start over")
    except FileNotFoundError:
        raise BadInput(f"{output}: holds {len(ids)} records but no {path.name} says what made "
                       "them (an older marscli, or a merged file) — add --force to start over, "
                       "or pick another -o") from None
    for key in ["weights", *settings, *(k for k in old if k not in settings)]:
        a, b = old.get(key), settings.get(key)
        if a == b or (key == "policy" and a and old.get("weights") and
                      old.get("weights") == settings.get("weights")):
            continue
        if key == "weights":
            if not (a and b):  # a hub id or served model on one side: the names tell
                continue
            a, b = (f"{old.get('policy')}, sha256 {a[:12]}",
                    f"{settings.get('policy')}, sha256 {b[:12]}")
        raise BadInput(f"{output}: {_option(key)} differs from the run that wrote its "
                       f"{len(ids)} records ({a} → {b}) — re-run with the same settings to "
                       "resume, or add --force to start over")


# ----------------------------------------------------------------------------- input rows
# A row may change under its id between a run and its resume (a fixed question, another
# picture, a corrected gold). Each record carries `input_hash`, short sha256s of what its
# prompt row gave, and a resume compares them with the rows it is given: the records of a
# changed row were made from another input, so the resume is refused (appended rows, new ids,
# resume as ever). Records written before the field have nothing to compare and resume as they
# did. The image part hashes each picture's bytes (as the records' `images[].sha256` do), not
# its path: a data folder may move, and a picture replaced in place is caught.

INPUT_PARTS = ("question", "image", "answer", "image_search")


class InputHashes:
    """The `input_hash` of each prompt of a run, computed when first asked (each image file
    hashed once per run)."""

    def __init__(self, prompts: Iterable[Prompt]) -> None:
        self.prompts = {p.id: p for p in prompts}  # in input order: the first change is named
        self._files: dict[Path, str] = {}
        self._hashes: dict[str, dict[str, str]] = {}

    def of(self, prompt_id: str) -> dict[str, str]:
        if prompt_id not in self._hashes:
            p = self.prompts[prompt_id]
            images = [self._file(path) for path in p.image_paths()]
            parts = {"question": [p.question, p.choices, p.extra.get("prompt")],
                     "image": images, "answer": p.answer, "image_search": p.image_search}
            self._hashes[prompt_id] = {k: _short_hash(parts[k]) for k in INPUT_PARTS}
        return dict(self._hashes[prompt_id])

    def _file(self, path: Path) -> str:
        from marscli.records.provenance import sha256_file

        if path not in self._files:
            try:
                self._files[path] = sha256_file(path)
            except OSError as e:
                raise BadInput(f"{path}: image: cannot be read ({e.strerror or e})") from None
        return self._files[path]


def _short_hash(value: Any) -> str:
    import orjson

    data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)
    return hashlib.sha256(data).hexdigest()[:16]


def check_inputs(output: str, recorded: dict[str, tuple[int, Any]],
                 hashes: InputHashes) -> None:
    """Refuse to resume over records whose prompt row has changed since (the block above):
    BadInput naming the output line of the first changed row's first record, what changed
    (question, image, answer or image_search) and the prompt id. `recorded`: prompt id →
    (line, input_hash) of its first record in `output`."""
    for pid in hashes.prompts:
        line, old = recorded.get(pid, (0, None))
        if not isinstance(old, dict):  # no record of it, or one written before the field
            continue
        new = hashes.of(pid)
        for part in INPUT_PARTS:
            if part in old and old[part] != new[part]:
                raise BadInput(
                    f"{output}:{line}: {part}: prompt {pid!r} changed since its records were "
                    f"made (its {part} is not the one they were made from) — restore the row, "
                    "give the changed row a new id, or add --force to start over")


def read_settings(path: str | Path, fix: str) -> dict:
    """The settings a settings file records (`{"v": 1, "settings": {...}}`); BadInput, one
    line naming it and ending in `fix`, when it is a folder or anything else. A missing file
    is FileNotFoundError: what that means is the caller's to say."""
    import orjson

    path = Path(path)
    if path.is_dir():
        raise BadInput(f"{path}: is a folder, not a settings file — move it away")
    try:
        settings = orjson.loads(path.read_bytes())["settings"]
    except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
        settings = None
    if not isinstance(settings, dict):
        raise BadInput(f"{path}: not a settings file (expected {{\"v\": 1, \"settings\": "
                       f"{{...}}}}) — {fix}")
    return settings


def start_over(output: str, *also: Path) -> None:
    """`--force`: remove the output, its media folder, sidecar and settings (and `also`),
    holding the output's lock (a writer still at work is not pulled from under)."""
    from marscli.records.locks import OutputLock
    from marscli.records.provenance import current_inputs

    files = (Path(output), Path(f"{output}.meta.json"), settings_path(output), *also)
    inputs = current_inputs()
    with OutputLock(output):
        for p in files:  # all checked before any is removed
            if p.is_dir() and not p.is_symlink():
                raise BadInput(f"{p}: is a folder where --force removes a file — move it away")
            inputs.check_not_input(p)  # --force starts the output over, never an input
        inputs.check_no_input_inside(media_dir(output))
        for p in files:
            p.unlink(missing_ok=True)
        shutil.rmtree(media_dir(output), ignore_errors=True)
