"""One resumable generation loop for `rollout`, `eval` and `ask`, driven by their
`GenerationOptions` (generation.py).

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
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marscli.agent.generation import GenerationOptions
from marscli.engines import make_engine
from marscli.errors import BadInput
from marscli.records.provenance import note_inputs, weights_fingerprint

if TYPE_CHECKING:  # the CLI imports this module for the defaults: the rest loads when used
    from marscli.agent.loop import Event
    from marscli.records.outputs import AppendJsonl
    from marscli.records.schema import Prompt

CHECK_PIXELS = 1_000_000  # the up-front image check decodes at most this (JPEG draft mode)


# ----------------------------------------------------------------------------- shards and images


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
    from marscli.records.outputs import AppendJsonl

    hashes = InputHashes(p for p, _ in jobs) if output else None
    for p, _ in jobs:  # no crop (`Agent._keep_image`) may be written onto a prompt's picture
        note_inputs(*p.image_paths())
    with contextlib.ExitStack() as stack:
        out = _open_output(stack, output, settings, hashes, rel_to)
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


def _open_output(stack: contextlib.ExitStack, output: str | None, settings: dict | None,
                 hashes: InputHashes | None,
                 rel_to: Path | None) -> AppendJsonl | StdoutSink | None:
    """The records already written, opened for appending (locked, checked against `settings`
    and the rows' `hashes`), or stdout's sink; None for no output, and for a new one, which is
    locked now and created once the engine has loaded."""
    from marscli.records.locks import OutputLock

    if output == "-":
        return StdoutSink(rel_to or Path.cwd())
    if output and Path(output).exists():
        return _resume(stack, output, settings, hashes)
    if output:
        _make_parent(output)
        stack.enter_context(OutputLock(output))
    return None


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
