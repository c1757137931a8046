"""Which slice of each parameter's fp32 master (and AdamW moments) this rank holds, and reading
or writing that slice in place, under each engine. Import it lazily (torch).

- ZeRO-3: every parameter is split on its own: rank r holds elements [r·P, min((r+1)·P, numel))
  of the flattened parameter, P = ceil(numel / world) (`ds_tensor`, padded at the end); the fp32
  master and moments through DeepSpeed's local API (`safe_get/set_local_fp32_param`,
  `safe_get/set_local_optimizer_state`).
- ZeRO-1/2 (and DeepSpeed's bf16 optimiser): the trainable parameters are flattened together
  and the flat buffer is split evenly, so a parameter may lie across ranks; a rank's fragment
  of it is `p._hp_mapping` (its [start, start+numel) in the parameter, and where that lies in
  the rank's flat fp32 partition, whose AdamW state holds the moments at the same offsets).
- Everything else (plain torch, frozen parameters outside ZeRO-3, ZeRO-0 in fp32) is replicated:
  rank 0 holds the whole parameter, the optimiser's state is keyed by the parameter itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def local_slice(p: nn.Parameter) -> tuple[int, int] | None:
    """[start, end) of `p` flattened whose fp32 value this rank keeps, or None (a replicated
    parameter: the whole of it, on every rank)."""
    if hasattr(p, "ds_id"):  # ZeRO-3
        size = p.ds_tensor.ds_numel
        r = torch.distributed.get_rank(group=getattr(p, "ds_process_group", None))
        start = r * size
        end = min(start + size, p.ds_numel)
        return (start, end) if end > start else None
    if hasattr(p, "_hp_mapping"):  # ZeRO-1/2: set on every trainable parameter, None off-rank
        m = p._hp_mapping
        if m is None:
            return None
        a = m.lp_fragment_address
        return a.start, a.start + a.numel
    return 0, p.numel()


def full_shape(p: nn.Parameter) -> list[int]:
    return list(getattr(p, "ds_shape", p.shape))


def get_master(p: nn.Parameter, start: int, end: int) -> torch.Tensor:
    """This rank's fp32 master of `p` over [start, end) (1-D): the optimiser's partition for a
    trained parameter under DeepSpeed, else the module's value in float32."""
    n = end - start
    if hasattr(p, "ds_id"):
        if p.requires_grad and getattr(p, "_z3_optimizer", None) is not None:
            from deepspeed.utils import safe_get_local_fp32_param

            return safe_get_local_fp32_param(p)[:n]
        return p.ds_tensor.detach()[:n].float()
    m = getattr(p, "_hp_mapping", None)
    if m is not None:
        return m.hp_fragment.detach()
    return p.detach().reshape(-1)[start:end].float()


def set_master(p: nn.Parameter, value: torch.Tensor, start: int, trained: bool) -> None:
    """Set this rank's slice of `p` (`value`, 1-D float32, starting at `start`): the optimiser's
    fp32 partition when `trained`, and under ZeRO-3 also the module's own partition (its other
    copy, in the module's dtype). Not collective."""
    n = value.numel()
    if hasattr(p, "ds_id"):
        p.ds_tensor.data[:n].copy_(value)
        if trained:
            from deepspeed.utils import safe_set_local_fp32_param

            safe_set_local_fp32_param(p, _padded(value, p.ds_tensor.numel()))
        return
    m = getattr(p, "_hp_mapping", None)
    if m is not None and trained:
        m.hp_fragment.data.copy_(value)
    elif m is None:
        p.data.view(-1)[start:start + n].copy_(value)


def _padded(value: torch.Tensor, numel: int) -> torch.Tensor:
    if value.numel() == numel:
        return value
    return torch.cat([value, value.new_zeros(numel - value.numel())])


# ------------------------------------------------------------------------------ AdamW's state


def _hp_flat(opt: torch.optim.Optimizer, p: nn.Parameter) -> torch.Tensor:
    """The flat fp32 partition (a ZeRO-1/2 param group's only tensor) holding `p`'s fragment."""
    return opt.param_groups[p._hp_mapping.param_group_index]["params"][0]


def get_moment(opt: torch.optim.Optimizer, p: nn.Parameter, key: str, n: int
               ) -> torch.Tensor | None:
    """This rank's slice of AdamW's `key` for `p` (1-D, n elements), or None before any step."""
    if hasattr(p, "ds_id"):
        from deepspeed.utils import safe_get_local_optimizer_state

        try:
            return safe_get_local_optimizer_state(p, key)[:n]
        except KeyError:
            return None
    m = getattr(p, "_hp_mapping", None)
    if m is not None:
        st = opt.state.get(_hp_flat(opt, p), {})
        return st[key].narrow(0, m.hp_fragment_address.start, n) if key in st else None
    st = opt.state.get(p, {})
    return st[key].reshape(-1) if key in st else None


def set_moment(opt: torch.optim.Optimizer, p: nn.Parameter, key: str, value: torch.Tensor) -> None:
    """Set this rank's slice of AdamW's `key` for `p` (the state exists: `init_state`)."""
    if hasattr(p, "ds_id"):
        from deepspeed.utils import safe_set_local_optimizer_state

        safe_set_local_optimizer_state(p, _padded(value, p.ds_tensor.numel()), key)
        return
    m = getattr(p, "_hp_mapping", None)
    if m is not None:
        opt.state[_hp_flat(opt, p)][key].narrow(0, m.hp_fragment_address.start,
                                                value.numel()).copy_(value)
    else:
        opt.state[p][key].view(-1).copy_(value)


def flat_tensors(engine: Any, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors AdamW's state is keyed by: ZeRO-3's fp32 sub-group partitions (its param
    groups are empty between steps), else the param groups' own tensors."""
    flats = getattr(getattr(engine, "optimizer", None), "fp32_partitioned_groups_flat", None)
    if flats is not None:
        return list(flats)
    return [t for g in opt.param_groups for t in g["params"]]


def init_state(engine: Any, opt: torch.optim.Optimizer, step: int) -> None:
    """AdamW's state as its first step would create it (zero moments), at `step`: torch's
    AdamW creates its state lazily, and the moments loaded next are written into it."""
    for t in flat_tensors(engine, opt):
        opt.state[t] = {"step": torch.tensor(float(step), dtype=torch.float32),
                        **{k: torch.zeros_like(t, memory_format=torch.preserve_format)
                           for k in ("exp_avg", "exp_avg_sq")}}


def adam_step(engine: Any, opt: torch.optim.Optimizer) -> int:
    """AdamW's step count (DeepSpeed steps every partition together: one number)."""
    steps = {int(opt.state[t]["step"]) for t in flat_tensors(engine, opt)
             if "step" in opt.state.get(t, {})}
    return max(steps, default=0)
