"""A checkpoint the server may hold, and its weights moved into the running vLLM engine.

`check_complete` and `tensor_difference` vet a checkpoint before any weight moves (a refused one
leaves the engine as it was); `load_weights` and `wake_weights` put its weights into the engine
in place (vLLM's `reload_weights` on every worker: no restart, no new graph capture), then clear
every cache computed with the old ones. vLLM is imported only inside the workers' function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from marscli.errors import BadInput


def _weight_files(path: str) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def tensor_shapes(path: str) -> dict[str, list[int]]:
    """name → shape of every tensor of a checkpoint's safetensors files (headers only)."""
    from marscli.qwen.policy import safetensors_header

    shapes: dict[str, list[int]] = {}
    for f in _weight_files(path):
        header = safetensors_header(f, "--policy")
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_complete(path: str) -> None:
    """BadInput unless `path` is a complete checkpoint: folder, config, headers and sizes of
    the weight files, at least one of them."""
    from marscli.qwen.policy import check_checkpoint

    check_checkpoint(path)
    if not _weight_files(path):
        raise BadInput(f"--policy: {path}: no *.safetensors weights")


def tensor_difference(path: str, held: dict[str, list[int]] | None) -> list[str]:
    """The tensors whose names or shapes differ from the held ones, sorted (a checkpoint of
    another architecture or size cannot go into this engine); none when `held` is None (a
    server that has held nothing yet takes any)."""
    if held is None:
        return []
    shapes = tensor_shapes(path)
    if shapes == held:
        return []
    return sorted(set(shapes) ^ set(held)) or sorted(k for k in shapes if shapes[k] != held[k])


def load_weights(llm: Any, path: str) -> None:
    """`path`'s weights into a running engine, then the caches of what the old ones computed
    cleared."""
    load_in_place(llm, path)
    clear_caches(llm)


def wake_weights(llm: Any, path: str | None) -> None:
    """Wake a sleeping engine (vLLM's sleep mode), `path`'s weights loaded when given, in
    vLLM's documented order for RL (vllm-project/vllm, its sleep-mode page, features/
    sleep_mode.md, "RLHF weight updates"; verl's workers/sharding_manager/fsdp_vllm.py and
    TRL's trl/generation/vllm_generation.py do the same): the weights' memory first, the new
    weights into it, and only then the KV cache, so the peak is the weights alone. Never an
    update into a sleeping engine (a weight update sent to one crashes some vLLM versions).
    Level 1 without `path`: the weights come back from host memory as they were."""
    llm.wake_up(tags=["weights"])
    if path is not None:
        load_in_place(llm, path)
    llm.wake_up(tags=["kv_cache"])
    clear_caches(llm)


def load_in_place(llm: Any, path: str) -> None:
    """`path`'s weights into every worker's model in place (vLLM's `reload_weights`: loaded
    layer by layer and processed into its kernels' layout, as at start-up)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.collective_rpc(_repack_lm_head)


def clear_caches(llm: Any) -> None:
    """No KV block, processed image or image feature computed with the old weights survives:
    the prefix cache, the multimodal processor cache, the encoder cache."""
    llm.reset_prefix_cache()
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()


def _repack_lm_head(worker: Any) -> None:
    """Runs in each vLLM worker (module level: it is pickled to worker processes). A tied LM
    head has no tensor of its own in the checkpoint, so the in-place reload skips it; on CPU
    its kernel holds a packed copy of the OLD embedding (measured: generations stayed those
    of the old weights). Processing it again packs the new one (a no-op on GPUs)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in worker.get_model().modules():
        if isinstance(module, ParallelLMHead) and module.weight.numel():
            module.quant_method.process_weights_after_loading(module)

