"""The policy as the trainer drives it: log-prob forwards, backward, AdamW (plain torch or a
DeepSpeed ZeRO engine), gradient accumulation over a minibatch. Import it lazily (torch).

A training step over one minibatch (see `train_minibatch`):
    for each micro-batch (the same count on every rank; fillers have weight 0):
        logp = model.logp(batch, grad=True)          # [B, T], 0 off the loss mask
        model.backward(loss_fn(logp, batch))         # losses SUM to the minibatch objective
    grad_norm = model.step(lr)                       # all-reduce, clip, AdamW
The contract for `loss_fn`: the losses it returns, summed over micro-batches *and ranks*, equal
the loss over the whole minibatch (`losses.micro_weight` gives each micro-batch's share);
`backward` undoes DeepSpeed's averaging over ranks. So a 2-rank ZeRO run and a 1-process run
compute the same gradient (up to summation order).

bf16 on GPU (DeepSpeed's bf16, or autocast in plain torch with fp32 weights), fp32 on CPU.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from marscli.train.batch import Batch
from marscli.train.distributed import Dist
from marscli.train.dsconfig import bf16_enabled, zero_stage
from marscli.train.logprobs import default_chunk, logp_head
from marscli.train.optim import OptimConfig

LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict[str, float]]]


# ------------------------------------------------------------------------------ the model


class PolicyLM(nn.Module):
    """A Qwen3-VL `...ForConditionalGeneration` whose forward returns per-token log-probs.

    Only the positions under the loss mask go through the LM head, `logp_chunk` of them at a
    time (train/logprobs.py: the head is replaced by one holding the same weight), so neither
    the [T, V] logits of prompt and tool tokens nor the [N, V] of the loss tokens exist at
    once; "auto" takes logprobs.default_chunk of the vocabulary, None forms the [N, V] logits
    whole (the reference path). With
    `touch_visual`, a micro-batch without images gets one extra row holding a 1-token blank
    image (loss mask 0, its output dropped): under ZeRO-3 every rank must run the same modules
    in the same order, or the parameter gathers mismatch (a separate call into the vision
    tower is not enough: gloo aborts with "Received data size doesn't match expected size"),
    and under ZeRO-2 every rank must produce gradients for the same parameters.
    """

    def __init__(self, lm: nn.Module, touch_visual: bool = False,
                 logp_chunk: int | str | None = "auto") -> None:
        super().__init__()
        if logp_chunk == "auto":
            logp_chunk = default_chunk(lm.lm_head.weight.ds_shape[0]
                                       if hasattr(lm.lm_head.weight, "ds_shape")
                                       else lm.lm_head.weight.shape[0])
        lm.lm_head = logp_head(lm.lm_head, logp_chunk)
        self.lm = lm
        self.touch_visual = touch_visual

    def forward(self, input_ids, attention_mask, mm_token_type_ids, loss_mask,
                pixel_values=None, image_grid_thw=None):
        n = input_ids.shape[0]
        if pixel_values is None and self.touch_visual:
            (input_ids, attention_mask, mm_token_type_ids, loss_mask, pixel_values,
             image_grid_thw) = self._blank_image_row(input_ids, attention_mask,
                                                     mm_token_type_ids, loss_mask)
        self.lm.model.rope_deltas = None  # never reuse 3-D positions cached by an earlier forward
        out = self.lm.model(input_ids=input_ids, attention_mask=attention_mask,
                            mm_token_type_ids=mm_token_type_ids, pixel_values=pixel_values,
                            image_grid_thw=image_grid_thw, use_cache=False)
        h = out.last_hidden_state[:n]  # [B, T, H]
        sel = loss_mask[:n, 1:] > 0  # [B, T-1]: token t+1 is predicted at position t
        lp = self.lm.lm_head(h[:, :-1][sel], targets=input_ids[:n, 1:][sel])  # [N] float32
        full = torch.zeros(sel.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)
        return F.pad(full, (1, 0))  # [B, T]

    def _blank_image_row(self, ids, attn, mm, mask):
        cfg = self.lm.config
        vc = cfg.vision_config
        m = vc.spatial_merge_size
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        width = max(ids.shape[1], 3)
        row = torch.zeros((1, width), dtype=ids.dtype, device=ids.device)  # [1, T]
        row[0, :3] = torch.tensor([cfg.vision_start_token_id, cfg.image_token_id,
                                   cfg.vision_end_token_id])
        on = torch.zeros_like(row)
        on[0, :3] = 1

        def cat(x, extra):
            x = F.pad(x, (0, width - x.shape[1]))
            return torch.cat([x, extra.to(x.dtype)])

        pv = torch.zeros((m * m, dim), dtype=torch.float32, device=ids.device)  # [patches, dim]
        grid = torch.tensor([[1, m, m]], device=ids.device)  # one merged token
        return (cat(ids, row), cat(attn, on), cat(mm, (row == cfg.image_token_id).int()),
                cat(mask, torch.zeros_like(row)), pv, grid)


class TrainModel:
    """The policy as the trainer drives it: log-prob forwards, backward, an optimiser step,
    the full state dict. Plain torch (one process, or several with an all-reduce of
    gradients) or a DeepSpeed engine; without an optimiser it only scores (the reference)."""

    def __init__(self, module: PolicyLM, d: Dist, *, engine: Any = None,
                 optimizer: torch.optim.Optimizer | None = None, grad_clip: float = 0.0,
                 zero_stage: int | None = None, autocast: torch.dtype | None = None,
                 bf16: bool = False, source: Any = None) -> None:
        self.module, self.dist, self.engine = module, d, engine
        self.optimizer, self.grad_clip, self.zero_stage = optimizer, grad_clip, zero_stage
        self.autocast = autocast
        self.bf16 = bf16  # DeepSpeed's bf16: 16-bit module, fp32 masters in the optimiser
        self.source = source  # trainstate.MasterSource the fp32 masters were loaded from
        self.master_load_seconds = 0.0  # setting the masters in (build_model)

    @property
    def lm(self) -> nn.Module:
        return self.module.lm

    def train(self, mode: bool = True) -> None:
        (self.engine if self.engine is not None else self.module).train(mode)

    def logp(self, batch: Batch, grad: bool = False) -> torch.Tensor:
        """Per-token log-probs [B, T] (float32), 0 outside the loss mask."""
        kw = dict(batch.tensors, loss_mask=batch.loss_mask)
        run = self.engine if self.engine is not None else self.module
        amp = (torch.autocast(device_type="cuda", dtype=self.autocast)
               if self.autocast is not None else nullcontext())
        with (torch.enable_grad() if grad else torch.no_grad()), amp:
            return run(**kw).float()

    def set_boundary(self, last: bool) -> None:
        """Tell DeepSpeed whether the next backward ends the minibatch (call before forward)."""
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(last)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss`; losses sum over micro-batches and ranks."""
        if self.engine is not None:  # DeepSpeed averages gradients over ranks: undo it
            self.engine.backward(loss * self.dist.world, scale_wrt_gas=False)
        else:
            loss.backward()

    def step(self, lr: float) -> float:
        """All-reduce (plain multi-process), clip, AdamW step at `lr`; returns the gradient
        norm before clipping. A non-finite norm skips the step in plain torch."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.dist.backend is not None:
            _all_reduce_grads(params)
        norm = clip_grad_norm(params, self.grad_clip)
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            print(f"warning: gradient norm is {float(norm)} — step skipped", file=sys.stderr)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def release(self) -> None:
        """Remove DeepSpeed's hooks and free its buffers now, while the process group is up.
        Left to the engine's reference cycles, they were freed at interpreter exit, after the
        group was destroyed, and a ZeRO-3 rank sometimes aborted there ("terminate called
        without an active exception"; Gloo work objects outliving their group)."""
        if self.engine is not None:
            self.engine.destroy()
        self.engine = self.optimizer = None

    def frozen_reader(self) -> Any:
        """A reader of the float32 values of the files the model was loaded from, for frozen
        parameters under DeepSpeed's bf16 (the module holds them in 16 bits, the optimiser not
        at all); a context yielding None elsewhere (the module's value is exact)."""
        if self.engine is None or not self.bf16 or self.source is None:
            return nullcontext()
        return self.source.reader()

    def export_specs(self) -> list[tuple[str, list[int]]]:
        """Every parameter's HF name and full shape, in the order `export_weights` gives them
        (the same on every rank; under ZeRO-3 the shape DeepSpeed partitioned)."""
        from marscli.train.partitions import full_shape

        return [(name.removeprefix("lm."), full_shape(p))
                for name, p in self.module.named_parameters()]

    def export_weights(self, dtype: str,
                       put: Callable[[str, torch.Tensor], None] | None) -> None:
        """Hand `put` (rank 0's; None elsewhere) each weight by HF name in `dtype`, one
        parameter at a time: nothing is kept whole beyond the parameter at hand. Collective
        under DeepSpeed: every rank must call it.

        Plain torch: the weights themselves. DeepSpeed: the optimiser's fp32 partitions,
        gathered parameter by parameter (`safe_get_full_fp32_param`), never the 16-bit module
        copy; a parameter the optimiser does not hold (frozen) is the module's value, or, under
        bf16, its float32 value in the files the model was loaded from."""
        dt = getattr(torch, dtype)
        with self.frozen_reader() as source:
            for name, p in self.module.named_parameters():
                key = name.removeprefix("lm.")
                v = self._fp32_master(p)
                if v is None:
                    v = self._gathered(p)
                    if put is not None and source is not None and not p.requires_grad:
                        src = source.full(key)
                        v = src if src is not None and src.dtype == torch.float32 else v
                if put is not None:
                    put(key, v.to("cpu", dt))
                del v

    def _fp32_master(self, p: nn.Parameter) -> torch.Tensor | None:
        if self.engine is None or self.optimizer is None:
            return None
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(p)  # collective; None without an fp32 partition

    def _gathered(self, p: nn.Parameter) -> torch.Tensor:
        """The module's full value of `p` (all-gathered under ZeRO-3: collective)."""
        if self.engine is not None and self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                return p.data.detach().clone()
        return p.data


def is_finite(model: TrainModel, probe: tuple[Any, Any] | None) -> bool:
    """Every weight this rank holds is finite (its partition under ZeRO-3), and so are the
    log-probs of `probe` (a micro-batch and its Spec) under the model: one forward, run on
    every rank whatever the weights (collective under ZeRO-3)."""
    from marscli.train.batch import collate

    with torch.no_grad():
        ok = all(bool(torch.isfinite(getattr(p, "ds_tensor", p.data)).all())
                 for p in model.module.parameters())
    if probe is not None:
        micro, spec = probe
        model.train(False)
        logp = model.logp(collate(micro.examples, spec, micro.weight, model.dist.device))
        ok = bool(torch.isfinite(logp).all()) and ok
    return ok


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Scale gradients to norm ≤ max_norm (0: never); returns the norm before clipping.

    The norm is accumulated in float64: torch's fp32 norm of a 3690×128 embedding gradient on
    CPU was off by 2e-4 relative, enough to make runs that agree on every weight disagree on
    the reported norm (DeepSpeed's agrees with float64)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])))
    if max_norm > 0 and norm > max_norm and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm


def _all_reduce_grads(params: list[torch.Tensor]) -> None:
    """SUM gradients over ranks in one flat buffer (a missing gradient counts as zeros)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    torch.distributed.all_reduce(flat)
    i = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[i:i + n].view_as(p.grad))
        i += n


# ------------------------------------------------------------------------------ building


def build_model(policy: str, d: Dist, *, optim: OptimConfig | None = None,
                ds_config: dict | None = None, gradient_checkpointing: bool = False,
                freeze_vision: bool = False, logp_chunk: int | str | None = "auto"
                ) -> TrainModel:
    """Load the policy for training (with `optim`) or scoring only (without: the reference).

    The weights are the checkpoint's fp32 masters (POLICY/train_state/, see trainstate.py, when
    present, else its HF weights). Plain torch and ZeRO-0/1/2 in fp32 hold the module whole on
    every rank, loaded with the masters. Under ZeRO-3 the model is built already partitioned
    (`zero3_init`), and each rank then sets its own slices of the masters; DeepSpeed with bf16
    loads the 16-bit module copy and, after `deepspeed.initialize`, seeds each rank's fp32
    partition from its slices of the masters, so no step of an earlier run is rounded away.
    The result's `master_load_seconds` is the time the masters took to read in (0 without)."""
    from marscli.train.trainstate import master_source, seed_masters

    bf16 = bf16_enabled(ds_config)
    stage = zero_stage(ds_config)
    source = master_source(policy)
    seconds = [0.0]  # reading the masters in, wherever it happens below
    lm = _load_lm(policy, ds_config, stage, bf16, source, seconds)
    module = PolicyLM(lm, touch_visual=ds_config is not None and d.world > 1,
                      logp_chunk=logp_chunk)
    if freeze_vision:
        lm.model.visual.requires_grad_(False)
    if gradient_checkpointing:
        lm.config.use_cache = False
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    amp = torch.bfloat16 if d.device.startswith("cuda") and ds_config is None else None
    if optim is None:
        return _reference_model(module, d, ds_config, stage, source, bf16, amp, seconds)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    if ds_config is not None:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config)
        if source is not None and (stage == 3 or bf16):
            with timed(seconds):
                seed_masters(module, source, trained=True, bf16=bf16)
        return _timed_model(TrainModel(module, d, engine=engine, optimizer=opt,
                                       grad_clip=optim.grad_clip, zero_stage=stage, bf16=bf16,
                                       source=source), seconds)
    module.to(d.device)
    return _timed_model(TrainModel(module, d, optimizer=opt, grad_clip=optim.grad_clip,
                                   autocast=amp), seconds)


def _load_lm(policy: str, ds_config: dict | None, stage: int | None, bf16: bool, source: Any,
             seconds: list[float]) -> nn.Module:
    """The HF module on CPU, partitioned as it loads under ZeRO-3; where the masters are
    separate and the module is their fp32 copy (no ZeRO-3, no bf16), they are loaded into it
    here, since no later step seeds them."""
    from marscli.qwen.policy import load_model

    with zero3_init(ds_config if stage == 3 else None):
        lm = load_model(policy, device="cpu", dtype="bfloat16" if bf16 else "float32")
    if source is not None and source.separate:
        check_masters(lm, source)
        if stage != 3 and not bf16:  # the module is the fp32 copy: load the masters into it
            with timed(seconds):
                _load_whole(lm, source)
    return lm


def _reference_model(module: PolicyLM, d: Dist, ds_config: dict | None, stage: int | None,
                     source: Any, bf16: bool, amp: torch.dtype | None,
                     seconds: list[float]) -> TrainModel:
    """The frozen policy, for scoring only: under ZeRO-3 an engine without an optimiser
    (partitioned like the policy), else the whole module on this rank's device."""
    from marscli.train.trainstate import seed_masters

    module.requires_grad_(False)
    if ds_config is not None and stage == 3:  # partition the reference too
        import deepspeed

        cfg = {k: v for k, v in ds_config.items() if k != "gradient_clipping"}
        engine, *_ = deepspeed.initialize(model=module, config=cfg)
        engine.eval()
        if source is not None and source.separate:
            with timed(seconds):
                seed_masters(module, source, trained=False, bf16=bf16)
        return _timed_model(TrainModel(module, d, engine=engine, zero_stage=3), seconds)
    module.to(d.device).eval()
    return _timed_model(TrainModel(module, d, autocast=amp), seconds)


@contextmanager
def timed(seconds: list[float]) -> Iterator[None]:
    """Adds the block's wall time to seconds[0]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds[0] += time.perf_counter() - t0


def _timed_model(model: TrainModel, seconds: list[float]) -> TrainModel:
    model.master_load_seconds = seconds[0]
    return model


class _Zero3Config:
    """What transformers asks of a registered DeepSpeed config while it loads a model: the
    config dict and whether it is ZeRO-3. transformers' own `HfDeepSpeedConfig` holds the same
    but needs accelerate, which marscli does not otherwise use."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def is_zero3(self) -> bool:
        return True


@contextmanager
def zero3_init(ds_config: dict | None) -> Iterator[None]:
    """Under a ZeRO-3 config, `from_pretrained` builds the model inside `deepspeed.zero.Init`
    (each parameter partitioned as it is created) and loads each weight into its partition
    (rank 0 reads the files, one module's parameters gathered at a time), as it does when a
    Trainer's config is alive: no rank holds the whole model. Elsewhere nothing happens."""
    if ds_config is None:
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    cfg = _Zero3Config(ds_config)  # transformers keeps a weak reference: held here
    set_hf_deepspeed_config(cfg)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def _load_whole(lm: nn.Module, source: Any) -> None:
    """Copy each fp32 master into the module, one parameter at a time."""
    with source.reader() as r, torch.no_grad():
        for name, p in lm.named_parameters():
            v = r.full(name)
            if v is not None:
                p.copy_(v)


def check_masters(lm: nn.Module, source: Any) -> None:
    """The fp32 masters cover exactly the model's parameters, each in its shape (from the index
    or the file's header: nothing is read). A master missing would leave that weight at its
    16-bit export value, a wrong shape would not copy; both are refused (BadInput) naming the
    file."""
    from marscli.errors import BadInput
    from marscli.qwen.policy import SHOWN_KEYS

    saved = source.shapes()
    params = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in lm.named_parameters()}
    problems = [
        ("missing", sorted(set(params) - set(saved))),
        ("not parameters of the model", sorted(set(saved) - set(params))),
        ("of another shape than the model's", sorted(
            f"{n} {saved[n]} vs {shape}" for n, shape in params.items()
            if n in saved and list(saved[n]) != shape)),
    ]
    for what, keys in problems:
        if keys:
            more = f" (+{len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else ""
            raise BadInput(f"--policy: {source.where}: {len(keys)} fp32 master(s) {what}: "
                           f"{', '.join(keys[:SHOWN_KEYS])}{more} — the training state does "
                           f"not belong to this checkpoint; delete {source.state} to train "
                           "from the HF weights with a fresh optimiser")


# ------------------------------------------------------------------------------ one step


def train_minibatch(model: TrainModel, batches: Iterable[Batch], n_batches: int, loss_fn: LossFn,
                    lr: float) -> tuple[list[dict[str, float]], float, int]:
    """Accumulate gradients over a minibatch's micro-batches, then take one optimiser step.

    `loss_fn(logp, batch) -> (loss, metrics)` must return losses that sum, over micro-batches
    and ranks, to the minibatch objective (weight-0 fillers: return loss · 0). Returns the
    per-micro-batch metrics of real micro-batches, the gradient norm and the tokens computed."""
    model.train(True)
    metrics, tokens = [], 0
    for i, b in enumerate(batches):
        model.set_boundary(i == n_batches - 1)
        with out_of_memory(b, "training forward and backward"):
            logp = model.logp(b, grad=True)  # [B, T]
            loss, m = loss_fn(logp, b)
            model.backward(loss)
        if b.weight:
            metrics.append(m)
            tokens += b.n_tokens
    return metrics, model.step(lr), tokens


def score(model: TrainModel, batches: Iterable[Batch]) -> Iterable[tuple[Batch, torch.Tensor]]:
    """Log-probs [B, T] without gradients (old policy, reference), batch by batch."""
    model.train(False)
    for b in batches:
        with out_of_memory(b, "scoring forward"):
            lp = model.logp(b, grad=False).cpu()
        yield b, lp


# Allocation failures: CUDA's own error, and the CPU allocator's (a RuntimeError whose text is
# all that tells it apart).
_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


@contextmanager
def out_of_memory(b: Batch, what: str) -> Iterator[None]:
    """Running out of memory on micro-batch `b` → one line naming its size and the options
    that shrink it (RuntimeFailure, exit 1), not a traceback asking for some tensor's bytes."""
    from marscli.errors import RuntimeFailure

    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not isinstance(e, torch.OutOfMemoryError) \
                and not any(m in str(e) for m in _CPU_OOM):
            raise
        rows, width = b.tensors["input_ids"].shape
        raise RuntimeFailure(
            f"out of memory in the {what} of a micro-batch of {rows} row(s) x {width} tokens "
            f"({b.n_tokens} real, {int(b.loss_mask.sum())} under the loss) — lower "
            "--micro-batch-tokens (a longer row trains alone) or --logp-chunk, add "
            "--gradient-checkpointing or GPUs; `marscli plan` shows what fits") from None
