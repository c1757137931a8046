"""Training state that survives between processes: fp32 master weights and, when asked, AdamW's
moments and step, kept beside the HF export that engines load.

    CKPT/                          the rollout copy: a plain HF folder in --save-dtype (rollout,
      config.json model.safetensors  eval and vLLM load it; they read top-level files only)
      tokenizer... metrics.jsonl marscli.meta.json
      train_state/                 read by update and sft only (with --state-dir a link to
                                   its node-local copy, made durable by persist.py)
        state.json                 {"v": 2, "engine", "world", "zero_stage", "bf16", "steps",
                                    "master", "optimizer", "adam_step", "fingerprint": the
                                    export's beside it (export_fingerprint): a state moved
                                    beside another model's weights is refused, exit 2}
        shards.json                which rank file holds which slice of each parameter
        master-rank-00000-of-00002.safetensors   rank 0's fp32 masters: NAME → a flat slice;
        master-rank-00001-of-00002.safetensors   absent when the export is float32 (the export
                                                 is then the master itself)
        moments-rank-0000R-of-0000N.safetensors  exp_avg/NAME, exp_avg_sq/NAME, the same slices
                                                 (--keep-optimizer under DeepSpeed)
        optimizer/optimizer.pt     plain torch AdamW state_dict (--keep-optimizer)

Each rank writes and reads only its own fp32 partition (shards.py has the format, partitions.py
the slices under each engine): under ZeRO-3 its slice of every parameter, under ZeRO-1/2 its
fragments of the flat partition, in plain torch rank 0 the whole of each. No host gathers the
masters: a rank's share is 4 B/param / world (masters) + 8 B/param / world (moments). The
step of AdamW is in state.json (DeepSpeed steps every partition together).
Loading re-shards by name: a rank of an M-rank launch reads, from the N files, only the slices
that overlap its own partition (`safe_open(...).get_slice`), so a state written by N ranks
loads on M, under any ZeRO stage, bf16 or not. Plain torch keeps AdamW's own state_dict (any
world size); a plain-torch state does not load into DeepSpeed nor the reverse (refused, exit 2).
Read too, from earlier versions: `master.safetensors` (the masters gathered whole), and
DeepSpeed's own checkpoint in `optimizer/state/` (same world size, ZeRO stage and bf16 only:
another launch is refused, exit 2, naming both).

Why: at lr 1e-6 a bf16 copy rounded and reloaded between iterations discards ~98% of an update,
and a fresh AdamW each iteration is not the optimiser a long-lived trainer runs. The masters
come from the optimiser's fp32 partitions, never from the 16-bit module copy; the next run
seeds DeepSpeed's fp32 partitions from them after `deepspeed.initialize`. The HF export is
built on rank 0 one parameter at a time, cast to --save-dtype as it arrives (gathered from the
fp32 partitions: all-gather under ZeRO-3, all-reduce of fragments under ZeRO-1/2).
Importing this module is cheap: torch loads inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marscli.errors import BadInput
from marscli.records.outputs import AtomicDir, tmp_path
from marscli.train.shards import INDEX, MOMENTS, FlatReader, open_reader, read_index

STATE_DIR = "train_state"
DURABLE = "train_state.durable"  # persist.py's durable copy beside a link; whole by its name
LEGACY_MASTER = "master.safetensors"  # the masters gathered whole (earlier marscli versions)
TORCH_OPTIMIZER = "optimizer/optimizer.pt"
DS_DIR, DS_TAG = "optimizer", "state"  # DeepSpeed's own checkpoint (earlier marscli versions)
LEGACY_OPTIMIZER = "optimizer.pt"  # POLICY/optimizer.pt of earlier marscli versions (plain torch)


SAMPLES = 1024  # 16-byte windows read from each export file for the weights' fingerprint


def export_fingerprint(ckpt: str | Path) -> dict | None:
    """What a train_state/ belongs to, from the checkpoint's HF export beside it: "model", a
    hash of every tensor's name, shape and dtype (the headers: nothing is read), and
    "weights", a hash of SAMPLES evenly spaced 16-byte windows of each file's data (about 16
    KiB a file: another seed or another checkpoint of the same shapes differs there). None
    without safetensors files (a hub id)."""
    from marscli.qwen.policy import safetensors_header

    files = sorted(Path(ckpt).glob("*.safetensors"))
    if not files:
        return None
    model, weights = hashlib.sha256(), hashlib.sha256()
    for f in files:
        header = safetensors_header(f)
        model.update(json.dumps(sorted((n, h["dtype"], h["shape"]) for n, h in header.items()))
                     .encode())
        size = f.stat().st_size
        with f.open("rb") as fh:
            start = 8 + int.from_bytes(fh.read(8), "little")
            span = max(size - start - 16, 0)
            weights.update(f"{f.name} {size}".encode())
            for i in range(SAMPLES):
                fh.seek(start + span * i // (SAMPLES - 1))
                weights.update(fh.read(16))
    return {"model": model.hexdigest()[:16], "weights": weights.hexdigest()[:16]}


def check_fingerprint(ckpt: str | Path, st: dict) -> None:
    """A state.json that records the export it was saved with must sit beside that export:
    a train_state/ copied from another model (or checkpoint) is refused (BadInput), not loaded
    into this one (states of earlier versions carry none and are not checked)."""
    saved = st.get("fingerprint")
    here = export_fingerprint(ckpt) if saved else None
    if not saved or here is None or here == saved:
        return
    what = ("another model (other tensor names or shapes)" if saved.get("model") != here["model"]
            else "other weights (another checkpoint of the same shapes)")
    where = Path(ckpt) / STATE_DIR / "state.json"
    raise BadInput(f"{where}: fingerprint: saved with {what} than the export in {ckpt} — "
                   f"this training state is not that checkpoint's; point --policy at the one "
                   f"it was saved with, or delete {where.parent} to train from the HF weights "
                   "with a fresh optimiser (without --keep-optimizer)")


def restamp(ckpt: str | Path) -> None:
    """Record CKPT's export as the one its train_state/ belongs to (persist.adopt: a redone
    update's state taken for the run's checkpoint), written atomically."""
    f = Path(ckpt) / STATE_DIR / "state.json"
    st = read_state(ckpt)
    if st is None or "fingerprint" not in st:
        return
    st["fingerprint"] = export_fingerprint(ckpt)
    tmp = f.with_name(f"state.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(st, indent=2) + "\n")
    os.replace(tmp, f)


def read_state(ckpt: str | Path) -> dict | None:
    f = Path(ckpt) / STATE_DIR / "state.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise BadInput(f"{f}: not valid JSON ({e}) — delete {f.parent} to train from the HF "
                       "weights with a fresh optimiser") from None


@dataclass
class MasterSource:
    """Where a checkpoint's fp32 masters are: train_state's rank files (`index`), the single
    file of earlier versions (`legacy`), or else the HF export itself (`export`)."""

    state: Path
    index: dict | None = None
    legacy: Path | None = None
    export: list[Path] = field(default_factory=list)

    @property
    def separate(self) -> bool:
        """The masters are not the export (which is then a 16-bit copy of them)."""
        return self.index is not None or self.legacy is not None

    @property
    def where(self) -> Path:
        """The file an error about the masters names."""
        return self.state / INDEX if self.index is not None else self.legacy or self.state

    @contextmanager
    def reader(self) -> Iterator[FlatReader]:
        with open_reader() as r:
            if self.index is not None:
                r.add_shards(self.state, self.index, "master")
            else:
                r.add_whole([self.legacy] if self.legacy else self.export)
            yield r

    def shapes(self) -> dict[str, list[int]]:
        """Each master's shape, from the index or the file's header (nothing is read)."""
        if self.index is not None:
            return {n: list(e["shape"]) for n, e in self.index["params"].items()}
        from marscli.qwen.policy import safetensors_header

        return {n: h["shape"] for n, h in safetensors_header(self.legacy).items()}


def master_source(ckpt: str | Path) -> MasterSource | None:
    """The checkpoint's fp32 masters (None for a hub id: transformers loads it)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return None
    state = ckpt / STATE_DIR
    st = read_state(ckpt) or {}
    if st.get("master") == INDEX or (not st and (state / INDEX).is_file()
                                     and "master" in read_index(state)["kinds"]):
        return MasterSource(state, index=read_index(state))
    if (state / LEGACY_MASTER).is_file():
        return MasterSource(state, legacy=state / LEGACY_MASTER)
    return MasterSource(state, export=sorted(ckpt.glob("*.safetensors")))


def read_masters(ckpt: str | Path) -> dict:
    """Every fp32 master of a checkpoint, whole, by HF name (for tools and tests: one host)."""
    src = master_source(ckpt)
    with src.reader() as r:
        return {n: r.full(n) for n in sorted(r.shapes)}


def read_moments(ckpt: str | Path) -> dict:
    """AdamW's moments of a DeepSpeed state, whole, by "exp_avg/NAME" and "exp_avg_sq/NAME"
    (for tools and tests: one host)."""
    state = Path(ckpt) / STATE_DIR
    index = read_index(state)
    with open_reader() as r:
        r.add_shards(state, index, "moments", [f"{k}/" for k in MOMENTS])
        return {k: r.read(k).view(r.shapes[k.split("/", 1)[1]]) for k in sorted(r.where)}


def engine_of(ds_cfg: dict | None) -> dict:
    """How a run trains, as state.json records it."""
    from marscli.train.dsconfig import bf16_enabled, zero_stage

    return {"engine": "deepspeed" if ds_cfg else "torch", "zero_stage": zero_stage(ds_cfg),
            "bf16": bf16_enabled(ds_cfg)}


def _how(st: dict, world: bool = False) -> str:
    if st.get("engine") != "deepspeed":
        return "plain torch"
    ranks = f" on {st.get('world')} rank(s)" if world else ""
    return f"DeepSpeed ZeRO-{st.get('zero_stage')}{' bf16' if st.get('bf16') else ''}{ranks}"


@contextmanager
def local_state(folder: Path, at: Path, pid: int, main: bool) -> Iterator[Path]:
    """The folder every rank writes train_state/ into (`at`.tmp-PID, PID rank 0's); renamed
    onto `at` when the body ends well, then FOLDER/train_state is made a link to it (rank 0).
    On an error the temporary goes (outputs.AtomicDir)."""
    with AtomicDir(at, active=main, tmp=tmp_path(at, pid)) as ad:
        yield ad.tmp
    if main:
        os.symlink(at, folder / STATE_DIR)


def check_present(ckpt: str | Path) -> None:
    """A checkpoint whose train_state/ is a link to a working copy that is gone is refused
    (BadInput): read through, it would look like no state at all, and the update would start
    a fresh AdamW from the export without a word."""
    ckpt = Path(ckpt)
    link = ckpt / STATE_DIR
    if not link.is_symlink() or (link / "state.json").is_file():
        return
    fix = (f"its durable copy is {ckpt / DURABLE}: `marscli state check RUN K` links it"
           if (ckpt / DURABLE).is_dir() else
           "make rl with STATE_DIR set redoes the updates since the last durable copy "
           "(docs/rl-loop.md)")
    raise BadInput(f"{link}: links to {os.readlink(link)}, which is not there (node-local "
                   f"training state of another node, or wiped) — {fix}")


def check_state(ckpt: str) -> None:
    """The checkpoint's train_state/ is readable: state.json parses, the shard index parses
    and names rank files that are all there (BadInput naming the file); a link to a node-local
    copy that is gone is refused (check_present). Cheap: JSON and file names only; run
    before anything heavy loads."""
    check_present(ckpt)
    master_source(ckpt)
    st = read_state(ckpt) or {}
    check_fingerprint(ckpt, st)
    if st.get("optimizer") == INDEX:
        read_index(Path(ckpt) / STATE_DIR)


def check_resumable(ckpt: str, ds_cfg: dict | None, world: int) -> None:
    """Refuse (BadInput, exit 2) an optimiser state this launch cannot load: one of the other
    engine (plain torch ↔ DeepSpeed), or DeepSpeed's own checkpoint of earlier versions on
    another world size, ZeRO stage or bf16 setting. The rank-file state loads on any world
    size and ZeRO stage. Runs before anything heavy loads."""
    st = read_state(ckpt)
    if not st or not st.get("optimizer"):
        return
    here = {**engine_of(ds_cfg), "world": world}
    where = Path(ckpt) / STATE_DIR
    fix = "or drop --keep-optimizer to start a fresh AdamW from the saved fp32 weights"
    if st.get("engine") != here["engine"]:
        raise BadInput(f"{where}: optimiser state saved by {_how(st)}, this run uses "
                       f"{_how(here)} — run it the same way, {fix}")
    if st["optimizer"] == f"{DS_DIR}/{DS_TAG}" and any(
            st.get(k) != here[k] for k in ("zero_stage", "bf16", "world")):
        raise BadInput(f"{where}: DeepSpeed's own optimiser checkpoint (an earlier marscli) "
                       f"saved by {_how(st, world=True)}, this run is {_how(here, world=True)} "
                       f"— launch it that way once (its output loads on any world size), {fix}")
    _check_optimizer_there(where, st["optimizer"], fix)  # after: a state of another engine


def _check_optimizer_there(where: Path, saved: str, fix: str) -> None:
    """--keep-optimizer where state.json names AdamW's state and it is gone: refused, not a
    fresh optimiser started silently (the moments files of INDEX: check_state)."""
    path = where / saved
    if saved != INDEX and not path.exists():
        raise BadInput(f"{path}: missing — {where / 'state.json'} records AdamW's state there; "
                       f"restore it, point --policy at the checkpoint that has it, {fix}")


# ------------------------------------------------------------------------------ saving


def save_all(model: Any, folder: Path, policy: str, processor: Any, dtype: str, *,
             optimizer: bool, steps: int, ds_cfg: dict | None, state_at: Path | None = None,
             pid: int = 0) -> dict:
    """Write the HF export (rank 0) and train_state/ (collective: every rank must call it);
    with `state_at`, train_state/ goes there (node-local, built in `state_at`.tmp-PID, PID
    rank 0's) and FOLDER/train_state is a link to it (persist.py).
    Returns {"save_seconds", "master_save_seconds", "bytes_written"} (bytes on rank 0: the
    whole folder; master_save_seconds: this rank writing its fp32 masters and moments into
    its rank files, a part of save_seconds)."""
    from marscli.errors import save_errors

    with save_errors(folder):  # a full disk: one line, whichever writer meets it
        if state_at is None:
            return _save_all(model, folder, folder / STATE_DIR, policy, processor, dtype,
                             optimizer=optimizer, steps=steps, ds_cfg=ds_cfg)
        with local_state(folder, state_at, pid, model.dist.main) as state:
            return _save_all(model, folder, state, policy, processor, dtype,
                             optimizer=optimizer, steps=steps, ds_cfg=ds_cfg)


def _save_all(model: Any, folder: Path, state: Path, policy: str, processor: Any, dtype: str,
              *, optimizer: bool, steps: int, ds_cfg: dict | None) -> dict:
    from marscli.train.checkpoint import WeightShards, save_checkpoint
    from marscli.train.distributed import barrier
    from marscli.train.partitions import adam_step

    d = model.dist
    t0 = time.perf_counter()
    # rank 0 writes each weight as it is gathered (collective under DeepSpeed)
    shards = WeightShards(folder, model.export_specs(), dtype) if d.main else None
    model.export_weights(dtype, shards.put if shards else None)
    if shards:
        shards.close()
        save_checkpoint(model.lm, folder, policy, dtype, processor)
        state.mkdir(exist_ok=True)
    barrier(d)  # the folder exists before other ranks write into it
    kinds = (["master"] if dtype != "float32" else []) + (
        ["moments"] if optimizer and model.engine is not None else [])
    writers = d.world if model.engine is not None else 1  # plain torch: rank 0 holds it all
    t1 = time.perf_counter()
    if kinds and d.rank < writers:
        write_shards(model, state, kinds, writers)
    master_seconds = time.perf_counter() - t1
    if optimizer and model.engine is None and d.main:
        import torch

        (state / TORCH_OPTIMIZER).parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.optimizer.state_dict(), state / TORCH_OPTIMIZER)
    barrier(d)  # every rank's files are written
    if d.main:
        from marscli.train.shards import write_index

        if kinds:
            write_index(state, writers, kinds)
        info = {"v": 2, **engine_of(ds_cfg), "world": d.world, "steps": steps,
                "fingerprint": export_fingerprint(folder),
                "master": INDEX if "master" in kinds else None,
                "optimizer": (INDEX if model.engine is not None else TORCH_OPTIMIZER)
                if optimizer else None}
        if "moments" in kinds:
            info["adam_step"] = adam_step(model.engine, model.optimizer)
        (state / "state.json").write_text(json.dumps(info, indent=2) + "\n")
    barrier(d)
    seconds = time.perf_counter() - t0
    n = sum(f.stat().st_size for f in {*folder.rglob("*"), *state.rglob("*")}
            if f.is_file()) if d.main else 0
    return {"save_seconds": round(seconds, 3), "master_save_seconds": round(master_seconds, 3),
            "bytes_written": n}


def write_shards(model: Any, state: Path, kinds: list[str], writers: int) -> None:
    """This rank's fp32 masters and/or AdamW moments, flat slices by HF name, into its rank
    files. A frozen parameter's master under bf16 is its float32 value in the files the model
    was loaded from (the module holds it in 16 bits only)."""
    import torch

    from marscli.train.partitions import full_shape, get_master, get_moment, local_slice
    from marscli.train.shards import Piece, rank_file, write_rank_file

    d = model.dist
    pieces: dict[str, Piece] = {}
    out: dict[str, dict[str, Any]] = {k: {} for k in kinds}
    with model.frozen_reader() as frozen:
        for name, p in model.module.named_parameters():
            key = name.removeprefix("lm.")
            sl = local_slice(p)
            if sl is None or (_replicated(p) and d.rank != 0):
                continue
            start, end = sl
            trained = p.requires_grad and model.optimizer is not None
            pieces[key] = Piece(start, end, full_shape(p), p.requires_grad)
            if "master" in out:
                v = frozen.read(key, start, end) if frozen and not trained else None
                ok = v is not None and v.dtype == torch.float32
                out["master"][key] = v if ok else get_master(p, start, end)
            if "moments" in out and trained:
                for k in MOMENTS:
                    m = get_moment(model.optimizer, p, k, end - start)
                    out["moments"][f"{k}/{key}"] = m if m is not None else torch.zeros(end - start)
    for kind in kinds:
        write_rank_file(state / rank_file(kind, d.rank, writers), out[kind], pieces)


def _replicated(p: Any) -> bool:
    """A parameter every rank holds whole (rank 0 writes it)."""
    return not hasattr(p, "ds_id") and not hasattr(p, "_hp_mapping")


# ------------------------------------------------------------------------------ loading


def seed_masters(module: Any, source: MasterSource, *, trained: bool, bf16: bool) -> None:
    """Set each rank's own slices from the fp32 masters (not collective): under ZeRO-3 the
    module's partition and, when `trained`, the optimiser's fp32 partition; under ZeRO-1/2 with
    bf16 the optimiser's fp32 fragments (the 16-bit module copy is already the masters rounded
    to nearest: the bf16 export, or from_pretrained's cast of a float32 one). Replicated
    parameters were loaded whole with the module. A 16-bit source is skipped: the module's
    copy is exact already."""
    import torch

    from marscli.train.partitions import local_slice, set_master

    with source.reader() as r, torch.no_grad():
        for name, p in module.named_parameters():
            key = name.removeprefix("lm.")
            sl = local_slice(p)
            zero3 = hasattr(p, "ds_id")
            if sl is None or r.dtypes.get(key) != "F32" or _replicated(p):
                continue
            if not zero3 and not (bf16 and trained and p.requires_grad):
                continue
            v = r.read(key, *sl)
            set_master(p, v.to(p.ds_tensor.device if zero3 else p.device),
                       sl[0], trained and p.requires_grad)
            if zero3 and getattr(p, "ds_persist", False) and p.data.numel() == p.ds_numel:
                # a small parameter DeepSpeed also keeps whole (not re-gathered before a step)
                p.data.copy_(r.full(key).view_as(p.data))


def load_optimizer(model: Any, ckpt: str | Path, *, betas: tuple[float, float], eps: float,
                   weight_decay: float) -> bool:
    """Restore AdamW's moments and step (earlier DeepSpeed checkpoints: its fp32 partitions
    too) from CKPT/train_state (or a legacy CKPT/optimizer.pt); False when there is none (the
    first update after SFT). This run's betas, eps and weight decay replace the saved ones."""
    import pickle

    import torch

    ckpt = Path(ckpt)
    st = read_state(ckpt) or {}
    if model.engine is not None:
        if not st.get("optimizer"):
            return False
        if st["optimizer"] == INDEX:
            load_moments(model, ckpt / STATE_DIR, int(st.get("adam_step", 0)))
        else:
            _load_deepspeed_checkpoint(model, ckpt)
    else:
        path = ckpt / STATE_DIR / TORCH_OPTIMIZER
        if not path.is_file():
            path = ckpt / LEGACY_OPTIMIZER
        if not path.is_file():
            return False
        try:
            model.optimizer.load_state_dict(torch.load(path, map_location=model.dist.device,
                                                       weights_only=True))
        except (ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            raise BadInput(f"{path}: does not fit the policy's trainable parameters ({e}) — "
                           "delete it to start a fresh optimiser") from None
        _check_moment_shapes(model.optimizer, path)
    for g in model.optimizer.param_groups:
        g.update(betas=betas, eps=eps, weight_decay=weight_decay)
    return True


def _check_moment_shapes(optimizer: Any, path: Path) -> None:
    """torch's load_state_dict checks parameter counts only: moments of another shape (a
    state of another model, of an earlier version without a fingerprint) would fail in the
    first step with a long traceback."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            m = optimizer.state.get(p, {}).get("exp_avg")
            if m is not None and m.shape != p.shape:
                raise BadInput(f"{path}: AdamW's moments of shape {list(m.shape)} for a "
                               f"parameter of shape {list(p.shape)} — the optimiser state is "
                               "another model's; delete it to start a fresh optimiser")


def load_moments(model: Any, state: Path, step: int) -> None:
    """AdamW's state at `step` with each rank's slices of the moments read from the rank files
    (any world size wrote them). A trained parameter without saved moments is refused."""
    import torch

    from marscli.qwen.policy import SHOWN_KEYS as SHOWN
    from marscli.train.partitions import init_state, local_slice, set_moment

    index = read_index(state)
    trained = {n.removeprefix("lm."): p for n, p in model.module.named_parameters()
               if p.requires_grad}
    saved = {n for n, e in index["params"].items() if e.get("trainable", True)}
    if "moments" not in index["kinds"] or set(trained) - saved:
        gone = sorted(set(trained) - saved) if "moments" in index["kinds"] else sorted(trained)
        raise BadInput(f"{state / INDEX}: no saved AdamW moments for {len(gone)} trained "
                       f"parameter(s): {', '.join(gone[:SHOWN])} — train the same parameters "
                       "(--freeze-vision as before), or drop --keep-optimizer")
    init_state(model.engine, model.optimizer, step)
    with open_reader() as r, torch.no_grad():
        r.add_shards(state, index, "moments", [f"{k}/" for k in MOMENTS])
        for key, p in trained.items():
            sl = local_slice(p)
            if sl is None:
                continue
            for k in MOMENTS:
                v = r.read(f"{k}/{key}", *sl)
                set_moment(model.optimizer, p, k, v.to(p.ds_tensor.device if hasattr(p, "ds_id")
                                                         else p.device))


def _load_deepspeed_checkpoint(model: Any, ckpt: Path) -> None:
    """DeepSpeed's own checkpoint (earlier marscli versions; check_resumable refused another
    world size, stage or bf16 setting)."""
    where = ckpt / STATE_DIR / DS_DIR
    path, _ = model.engine.load_checkpoint(str(where), tag=DS_TAG, load_optimizer_states=True,
                                           load_lr_scheduler_states=False)
    if path is None:
        raise BadInput(f"{where}: no DeepSpeed checkpoint '{DS_TAG}' — delete "
                       f"{ckpt / STATE_DIR} to start a fresh optimiser")
