"""Distributed set-up for `update` and `sft`: which rank this process is, joining the process
group the launcher describes, a few collectives on plain numbers, seeding, rank-0 logging.

Launchers: `torchrun --nproc_per_node N -m marscli ...`, `deepspeed --no_local_rank --module
marscli ...`, or `srun` (SLURM_PROCID/SLURM_STEP_NUM_TASKS become RANK/WORLD_SIZE). Without a
distributed environment and without `--deepspeed`: one plain torch process, no process group.
Importing this module is cheap: torch loads inside the functions that need it.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from marscli.errors import BadInput


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"
    backend: str | None = None  # None: not initialised (one process)

    @property
    def main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed variables for a task started by `srun` (one task per rank); nothing
    when a launcher already set RANK, or outside an srun step of several tasks (a batch
    script's own shell sees SLURM_NTASKS of the whole job, but no SLURM_STEP_NUM_TASKS)."""
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_STEP_NUM_TASKS", "1")) < 2:
        return {}
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": env.get("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")),
            "MASTER_PORT": env.get("MASTER_PORT", "29500")}


def is_main_process(env: Mapping[str, str] | None = None) -> bool:
    """Rank 0 as the launcher will say, before any process group exists."""
    env = os.environ if env is None else env
    return env.get("RANK", env.get("SLURM_PROCID", "0")) == "0"


def launch_world(env: Mapping[str, str] | None = None) -> int:
    """The world size the launcher describes, before any process group exists."""
    env = os.environ if env is None else env
    return int(slurm_env(env).get("WORLD_SIZE") or env.get("WORLD_SIZE", "1"))


def init_distributed(deepspeed: bool = False, device: str = "auto") -> Dist:
    """Join the process group the launcher describes (torchrun, deepspeed, srun), or none."""
    import torch

    env = os.environ
    env.update(slurm_env(env))
    world = int(env.get("WORLD_SIZE", "1"))
    if deepspeed and "RANK" not in env:  # DeepSpeed wants a process group even for one process
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    rank, local = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInput(f"--device {device}: CUDA is not available on this machine")
        device = device if ":" in device else f"cuda:{local}"
        torch.cuda.set_device(torch.device(device))
    d = Dist(rank, world, local, device)
    if deepspeed:
        import deepspeed as ds

        _quiet_deepspeed()
        if not device.startswith("cuda") and not env.get("MARSCLI_DS_SHM"):
            # On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op on first use (about
            # 2 minutes on 2 cores); gloo is exact and enough here. MARSCLI_DS_SHM=1 keeps it.
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        ds.init_distributed(verbose=False)
        d.backend = torch.distributed.get_backend()
    elif world > 1:
        d.backend = "nccl" if device.startswith("cuda") else "gloo"
        torch.distributed.init_process_group(d.backend)
    return d


def _quiet_deepspeed() -> None:
    import logging
    import warnings

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # DeepSpeed calls torch.distributed functions that torch 2.14 deprecates, once per bucket
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)


def close_distributed(d: Dist) -> None:
    if d.backend is None:
        return
    import torch

    if torch.distributed.is_initialized():
        # DeepSpeed's own destroy also drops its references to the groups it made (its world
        # group is a separate Gloo group from `new_group`, with its own worker threads); with
        # torch's alone, that group lived on into interpreter exit, where a rank sometimes
        # aborted ("terminate called without an active exception") after its work was done.
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        if ds_comm is not None and ds_comm.cdb is not None:
            ds_comm.destroy_process_group()
        else:
            torch.distributed.destroy_process_group()


def all_reduce(values: Sequence[float], d: Dist, op: str = "sum") -> list[float]:
    """Reduce a few numbers over ranks (sum, max or min), float64."""
    if d.backend is None:
        return [float(v) for v in values]
    import torch

    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if d.backend == "nccl":
        t = t.to(d.device)
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
           "min": torch.distributed.ReduceOp.MIN}
    torch.distributed.all_reduce(t, op=ops[op])
    return t.cpu().tolist()


def barrier(d: Dist) -> None:
    if d.backend is not None:
        import torch

        torch.distributed.barrier()


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def log(d: Dist, msg: str) -> None:
    """A progress line on stderr, from rank 0 only."""
    if d.main:
        print(msg, file=sys.stderr, flush=True)
