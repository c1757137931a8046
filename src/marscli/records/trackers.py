"""Experiment trackers: a stage's metrics, also sent to TensorBoard, W&B or a JSONL file.

    tracker = open_tracker(opts.track, run="iter-002/update", config=config)
    tracker.log({"loss": 0.3, "grad": {"norm": 1.2}}, step=7)    # → loss, grad/norm
    tracker.close()

- The spec is `KIND:ARG`, from the stage's `--track SPEC`, else the `MARSCLI_TRACK`
  environment variable (so `make rl MARSCLI_TRACK=tensorboard:runs/tb` reaches every stage),
  else none: the null tracker, which needs nothing installed. `none` turns a set variable off.
- `tensorboard:DIR`: event files in `DIR/RUN/` (and the config in `DIR/RUN/config.json`).
  With the `tensorboard` package installed, torch's `SummaryWriter` writes them; without it a
  built-in writer of the same format (TFRecord framing, CRC-32C, `Event` protobufs of scalar
  summaries), read back by TensorBoard's own loader in the tests.
- `wandb:PROJECT`: a W&B run named RUN with the config, in offline mode unless `WANDB_MODE`
  says otherwise (`wandb sync` uploads it later); needs `wandb` installed.
- `jsonl:FILE`: one line `{"v": 1, "run", "step", "metrics"}` a step, appended.
- `iteration_of(path)`: the RL iteration a stage's output belongs to (`iter-k`, `ckpt-k`), the
  step for per-stage summaries (rollout, eval) so that they line up across iterations.
- Opened before the stage works (`open_tracker`, `stats_tracker`), so that a tracker that
  cannot write (a read-only folder, a path under a regular file, wandb missing) fails first,
  one line, exit 2, with nothing written; and never onto the stage's data: a path a tracker
  writes that is an input or an output of the stage, inside one of their folders or beside an
  output as its companion (`OUT.meta.json`, ...), is refused (`check_clash`).
- Metrics: nested dicts flattened to `a/b`; only numbers are logged (bools, strings and None
  are skipped), so a stage can pass its metrics rows as they are.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from marscli.errors import BadInput
from marscli.registry import Registry

ENV = "MARSCLI_TRACK"


class Tracker(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


Opener = Callable[[str, str, dict], Tracker]  # (ARG, run, config) → tracker
TRACKERS: Registry[Opener] = Registry("tracker")


EXAMPLES = {"tensorboard": "tensorboard:runs/tb", "wandb": "wandb:marscli",
            "jsonl": "jsonl:runs/track.jsonl"}


def open_tracker(spec: str | None, *, run: str, config: dict,
                 inputs: Iterable[str | Path | None] = (),
                 outputs: Iterable[str | Path | None] = ()) -> Tracker:
    """The tracker `spec` names (None: `$MARSCLI_TRACK`, then none), opened: a stage opens it
    before any work, so that a tracker that cannot write fails first. BadInput, one line
    naming the option, for an unknown kind, a missing argument or a missing package, a path
    it cannot write (a read-only folder, a folder under a regular file), or one that is an
    input or an output of the stage (`inputs`, `outputs`: `check_clash`)."""
    parsed = _parse(spec)
    if parsed is None:
        return NullTracker()
    kind, arg, option = parsed
    opener = TRACKERS.get(kind)
    check_clash(f"{option}: {kind}:{arg}", _writes(opener, arg, run), inputs, outputs)
    try:
        return opener(arg, run, config)
    except BadInput as e:
        raise BadInput(f"{option}: {e}") from None
    except OSError as e:
        where = e.filename or arg
        raise BadInput(f"{option}: {kind}:{arg}: cannot write {where} ({e.strerror or e}) — "
                       "pick a folder you can write to") from None


def _writes(opener: Any, arg: str, run: str) -> list[Path]:
    """The paths a tracker writes (an entry's `writes(arg, run)`; none for a service)."""
    writes = getattr(opener, "writes", None)
    return list(writes(arg, run)) if writes is not None else []


def check_clash(what: str, writes: Iterable[Path], inputs: Iterable[str | Path | None],
                outputs: Iterable[str | Path | None]) -> None:
    """BadInput when a path a tracker writes is an input or an output of the stage: the same
    file (a link to it included), inside one of its folders (a checkpoint), or one of an
    output's companions (`OUT.meta.json`, `OUT.settings.json`, `OUT.lock`, ...). Trackers
    write beside the data, never onto it."""
    named = [("an input", Path(x)) for x in inputs if x and str(x) != "-"]
    named += [("an output", Path(x)) for x in outputs if x and str(x) != "-"]
    for w in writes:
        for kind, x in named:
            companion = kind == "an output" and w.parent.resolve() == x.parent.resolve() \
                and w.name.startswith(f"{x.name}.")
            if _same(w, x) or x.resolve() in w.resolve().parents or companion:
                raise BadInput(f"{what}: {w} is {kind} of this stage ({x}) or beside it — a "
                               "tracker would write into the stage's data: pick another path")


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def check_tracker(spec: str | None) -> None:
    """Refuse a malformed `--track`/`$MARSCLI_TRACK` before anything loads (opens nothing)."""
    _parse(spec)


def _parse(spec: str | None) -> tuple[str, str, str] | None:
    """(kind, argument, the option it came from), or None for no tracker."""
    option = "--track"
    if spec is None:
        spec, option = os.environ.get(ENV), ENV
    if spec is None or spec.strip() in ("", "none"):
        return None
    kind, _, arg = spec.partition(":")
    if kind not in TRACKERS:
        raise BadInput(f"{option}: {spec!r}: unknown tracker {kind!r} — choose one of: "
                       f"{', '.join(TRACKERS.names())} (as KIND:ARG, e.g. tensorboard:runs/tb)")
    if not arg:
        raise BadInput(f"{option}: {spec!r}: {kind} needs an argument — e.g. {EXAMPLES[kind]}")
    return kind, arg, option


def stats_tracker(spec: str | None, *, stage: str, output: str | Path,
                  inputs: Iterable[str | Path | None] = (),
                  outputs: Iterable[str | Path | None] = ()) -> Tracker:
    """The tracker a stage's summary statistics (rollout, eval) go to, opened before the stage
    works (`open_tracker`; `output` is among the outputs checked): run `RUN/STAGE`
    (`runs/demo/iter-3/rollouts.jsonl` → `demo/rollout`). Log with `log_stats`."""
    run = f"{Path(output).resolve().parent.parent.name}/{stage}"
    return open_tracker(spec, run=run, config={}, inputs=inputs, outputs=[output, *outputs])


def log_stats(tracker: Tracker, *, output: str | Path, stats: dict) -> None:
    """The statistics as one step at the iteration k of the output's `iter-k`/`ckpt-k` path
    (0 when there is none); the tracker is closed after."""
    try:
        tracker.log(stats, step=iteration_of(output))
    finally:
        tracker.close()


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """`{"a": {"b": 1}, "c": "x"}` → `{"a/b": 1.0}`: numbers only (bools are not numbers)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def iteration_of(path: str | Path) -> int:
    """The k of the last `iter-k` or `ckpt-k` in a run-folder path (`runs/demo/iter-3/
    rollouts.jsonl` → 3): the step at which a stage's summary goes on the run's curves; 0 when
    the path names none."""
    found = re.findall(r"(?:^|[/_.-])(?:iter|ckpt)-(\d+)(?=$|[/_.-])", str(path))
    return int(found[-1]) if found else 0


def _run_dir(root: str, run: str) -> Path:
    """`DIR/RUN`, RUN's path separators kept (runs group as folders), other oddities not."""
    parts = [re.sub(r"[^A-Za-z0-9._=#-]", "_", p) for p in Path(run).parts
             if p not in ("", ".", "..", "/")]
    return Path(root).joinpath(*(parts or ["run"]))


# ----------------------------------------------------------------------------- trackers


class NullTracker:
    """The default: nothing installed, nothing written."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


@TRACKERS.register("jsonl")
class JsonlTracker:
    """Appends a line a step, the file opened for each (a step is seconds of training)."""

    def __init__(self, path: str, run: str, config: dict) -> None:
        self.path, self.run = Path(path), run
        if self.path.is_dir():
            raise BadInput(f"jsonl:{path}: is a folder — name a file to append to")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.open("ab").close()  # can it be written: found now, not after the work

    @staticmethod
    def writes(arg: str, run: str) -> list[Path]:
        return [Path(arg)]

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"v": 1, "run": self.run, "step": step, "metrics": flatten(metrics)}
        from marscli.records.jsonl import dumps  # orjson: NaN becomes null, not invalid JSON

        with self.path.open("ab") as fh:
            fh.write(dumps(row))

    def close(self) -> None:
        pass


@TRACKERS.register("tensorboard")
class TensorBoardTracker:
    """Scalars as TensorBoard event files in DIR/RUN (see the module docstring)."""

    def __init__(self, root: str, run: str, config: dict, *, builtin: bool | None = None) -> None:
        self.dir = _run_dir(root, run)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(config, indent=1, default=str) + "\n")
        if builtin is None:
            builtin = not _has_tensorboard()
        self.writer: Any = EventWriter(self.dir) if builtin else _summary_writer(self.dir)

    @staticmethod
    def writes(arg: str, run: str) -> list[Path]:
        return [_run_dir(arg, run)]

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tag, value in flatten(metrics).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def _summary_writer(folder: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(folder))


@TRACKERS.register("wandb")
class WandbTracker:
    def __init__(self, project: str, run: str, config: dict) -> None:
        try:
            import wandb
        except ImportError:
            raise BadInput("wandb is not installed — pip install wandb, or use "
                           "--track tensorboard:DIR") from None
        mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(project=project, name=run, config=config, mode=mode)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(flatten(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


# ----------------------------------------------------------------------------- event files


class EventWriter:
    """TensorBoard's event file format without TensorFlow: TFRecords (u64 length, masked
    CRC-32C of it, the data, masked CRC-32C of that) of `Event` protobufs. The first event
    names the format version; each scalar is `Event{wall_time, step, summary{value{tag,
    simple_value}}}`."""

    def __init__(self, folder: Path) -> None:
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
        self.fh = (folder / name).open("wb")
        self._write(_field(1, 1, struct.pack("<d", time.time())) + _field(3, 2, b"brain.Event:2"))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        val = _field(1, 2, tag.encode()) + _field(2, 5, _f32(value))
        event = (_field(1, 1, struct.pack("<d", time.time())) + _field(2, 0, step)
                 + _field(5, 2, _field(1, 2, val)))
        self._write(event)

    def _write(self, data: bytes) -> None:
        head = struct.pack("<Q", len(data))
        self.fh.write(head + _masked_crc(head) + data + _masked_crc(data))

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def _f32(x: float) -> bytes:
    """A float32, beyond its range as ±inf (struct refuses those)."""
    try:
        return struct.pack("<f", x)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, x))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negative steps
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, wire: int, value: bytes | int) -> bytes:
    """One protobuf field: wire 0 varint (an int), 1 fixed64, 5 fixed32 (packed bytes), 2
    length-delimited."""
    key = _varint(number << 3 | wire)
    if wire == 0:
        return key + _varint(value)
    if wire == 2:
        return key + _varint(len(value)) + value
    return key + value


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # CRC-32C (Castagnoli), reflected
        table.append(c)
    return table


_CRC = _crc_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> bytes:
    c = crc32c(data)
    return struct.pack("<I", (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)
