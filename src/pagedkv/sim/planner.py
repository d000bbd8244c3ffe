"""Memory planner: how much KV cache a model leaves on a GPU, in bytes, tokens and sequences.

Standard library only. The arithmetic, per GPU under tensor parallelism `tp`:

    weight_bytes       = ceil(num_parameters x dtype_bytes / tp), or with a quantization
                         ceil(bytes of every matrix in its block format / tp) (weight_formats.py)
    kv_heads_per_gpu   = num_kv_heads / tp, or 1 when tp > num_kv_heads (heads replicated)
    kv_bytes_per_token = 2 (K and V) x num_layers x kv_heads_per_gpu
                         x (head_dim x kv_dtype_bytes + scale bytes)   (int8: a float16 scale
                                                                       per token and KV head)
    kv_bytes_per_block = 2 x layers_per_group x kv_heads_per_gpu
                         x (head_dim x kv_dtype_bytes + scale bytes) x block_size
    margin_bytes       = memory x activation_margin      (ACTIVATION_MARGIN by default)
    kv_budget_bytes    = memory - weight_bytes - margin_bytes
    num_blocks         = kv_budget_bytes // kv_bytes_per_block
    max_kv_tokens      = (num_blocks // num_groups) x block_size
    blocks_per_sequence = sum over KV cache groups of ceil(context / block_size), at most
                          ceil(window / block_size) + 1 in a sliding-window group

The layers form KV cache groups as the engine forms them (`pagedkv.memory.groups`): a block
covers the layers of one group, and a sliding-window group keeps only its window's blocks.

"Weights fit" and "a full-context sequence fits" are separate answers: 70B weights can fit
on a GPU that then holds no 128K-token sequence. A context beyond the model's
`max_position_embeddings` is planned as asked, with a warning.
"""

from __future__ import annotations

import importlib.resources
import math
from dataclasses import dataclass
from pathlib import Path

from pagedkv.config import DTYPE_BYTES, ModelConfig
from pagedkv.memory.groups import group_layers, sequence_blocks
from pagedkv.sim.weight_formats import weight_bytes_by_format

ACTIVATION_MARGIN = 0.10
"""Share of each GPU's memory held back from the KV cache for what the plan does not count
one by one: a step's activations (hidden states, attention and MLP intermediates, logits),
the CUDA context and the caching allocator's slack. 0.10 is the headroom of vLLM's default
`gpu_memory_utilization=0.9`; a plan with little to spare should be checked on the device."""

_CONFIGS = importlib.resources.files("pagedkv.sim") / "model_configs"


def builtin_models() -> list[str]:
    """Names of the model configs shipped with pagedkv (`llama-2-70b`, `qwen3-8b`, ...)."""
    return sorted(p.name[: -len(".json")] for p in _CONFIGS.iterdir() if p.name.endswith(".json"))


def load_model(model: str | Path) -> ModelConfig:
    """Resolve a built-in name, a model directory or a `config.json` path to a `ModelConfig`.

    Raises:
        ValueError: an unknown name, a missing file, or an unsupported or broken config.
    """
    text = str(model)
    name = text.lower()
    if name in builtin_models():
        return ModelConfig.from_hf(Path(str(_CONFIGS / f"{name}.json")))
    path = Path(text)
    if path.exists():
        return ModelConfig.from_hf(path)
    raise ValueError(
        f"unknown model {text!r}: expected a model directory, a config.json or one of "
        f"{', '.join(builtin_models())}"
    )


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as `bf16`, `float16` or `fp8`.

    Raises:
        ValueError: an unknown dtype name.
    """
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"expected a dtype in {', '.join(sorted(DTYPE_BYTES))}, got {dtype!r}"
        ) from None


KV_SCALE_BYTES = {"int8": 2}
"""Bytes of the scale an int8 cache keeps per token and KV head (the engine's float16,
`pagedkv.cache.kv_cache.SCALE_DTYPE`); other KV dtypes keep none."""


def kv_heads_per_gpu(model: ModelConfig, tp: int) -> int:
    """KV heads each GPU stores under tensor parallelism `tp`: `ModelConfig.kv_heads_per_rank`
    (the rule the engine shards by, and its ValueErrors) with errors naming `tp`."""
    return model.kv_heads_per_rank(tp, name="tp")


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "bf16", tp: int = 1) -> int:
    """KV bytes one token takes on each GPU: 2 x layers x kv_heads_per_gpu x (head_dim x
    bytes + the scale's bytes of an int8 cache).

    Raises:
        ValueError: an unknown dtype or an impossible `tp`.
    """
    heads = kv_heads_per_gpu(model, tp)
    per_head = model.head_dim * dtype_bytes(kv_dtype) + KV_SCALE_BYTES.get(kv_dtype.lower(), 0)
    return 2 * model.num_layers * heads * per_head


def kv_bytes_per_block(model: ModelConfig, kv_dtype: str, tp: int, block_size: int) -> int:
    """KV bytes of one block on each GPU: a block covers the layers of one KV cache group.

    Raises:
        ValueError: an unknown dtype or an impossible `tp`.
    """
    layers = group_layers(model.sliding_windows, model.num_layers).layers_per_group
    return kv_bytes_per_token(model, kv_dtype, tp) // model.num_layers * layers * block_size


@dataclass(frozen=True)
class Plan:
    """Per-GPU memory plan; every byte figure is for one GPU."""

    model: str
    num_parameters: int
    dtype: str
    kv_dtype: str
    quantization: str
    weight_formats: tuple[tuple[str, int], ...]  # (format, bytes per GPU), largest first
    tp: int
    block_size: int
    context: int
    max_position_embeddings: int
    context_exceeds_model: bool
    memory_bytes: int
    weight_bytes: int
    activation_margin: float
    activation_margin_bytes: int
    kv_heads_per_gpu: int
    kv_heads_replicated: bool
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_budget_bytes: int
    num_blocks: int
    max_kv_tokens: int
    blocks_per_sequence: int
    max_sequences_at_context: int
    weights_fit: bool
    full_context_sequence_fits: bool
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # Per KV cache group: (window or None, layers, blocks of one full-context sequence).
    kv_groups: tuple[tuple[int | None, int, int], ...] = ()


def plan_memory(
    model: ModelConfig,
    memory_bytes: int,
    *,
    name: str = "model",
    context: int | None = None,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    tp: int = 1,
    block_size: int = 16,
    activation_margin: float = ACTIVATION_MARGIN,
    quantization: str = "none",
) -> Plan:
    """Split one GPU's memory into weights and KV cache for `model`.

    Args:
        memory_bytes: memory of one GPU, bytes.
        name: label for the output.
        context: tokens per full-context sequence; default the model's max positions.
        dtype: weight dtype name; `kv_dtype` defaults to it.
        tp: tensor-parallel degree (weights and KV heads are split over `tp` GPUs).
        block_size: tokens per KV block.
        activation_margin: share of `memory_bytes` kept from the KV cache (see
            `ACTIVATION_MARGIN`).
        quantization: the weights' storage (`weight_formats.QUANTIZATIONS`, e.g. "q4_k_m"
            as llama.cpp mixes it); "none": every weight in `dtype`.

    Returns:
        The plan: `weights_fit` is False when the weights and the margin exceed the memory,
        `full_context_sequence_fits` when no sequence of `context` tokens fits the KV budget;
        `warnings` says when `context` is beyond the model's positions.

    Raises:
        ValueError: a non-positive size, a margin outside [0, 1), an unknown dtype or
            quantization, or an impossible `tp`.
    """
    if memory_bytes <= 0:
        raise ValueError(f"memory: expected > 0 bytes, got {memory_bytes}")
    if block_size <= 0:
        raise ValueError(f"block_size: expected > 0, got {block_size}")
    max_positions = model.max_position_embeddings
    context = max_positions if context is None else context
    if context <= 0:
        raise ValueError(f"context: expected > 0 tokens, got {context}")
    if not 0 <= activation_margin < 1:
        raise ValueError(f"activation_margin: expected in [0, 1), got {activation_margin}")
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    heads = kv_heads_per_gpu(model, tp)
    dtype_bytes(dtype)  # an unknown dtype's error names the choices
    by_format = weight_bytes_by_format(model, quantization, dtype)
    per_format = sorted(by_format.items(), key=lambda item: -item[1])
    weight_bytes = math.ceil(sum(by_format.values()) / tp)
    per_token = kv_bytes_per_token(model, kv_dtype, tp)
    groups = kv_groups(model, context, block_size)
    per_block = kv_bytes_per_block(model, kv_dtype, tp, block_size)
    margin_bytes = math.ceil(memory_bytes * activation_margin)
    budget = max(0, memory_bytes - weight_bytes - margin_bytes)
    num_blocks = budget // per_block
    blocks_per_seq = sum(blocks for _, _, blocks in groups)
    warnings = []
    if context > max_positions:
        warnings.append(
            f"context {context:,} exceeds the model's max_position_embeddings "
            f"({max_positions:,}): it was not trained for sequences this long"
        )
    return Plan(
        model=name,
        num_parameters=model.num_parameters(),
        dtype=dtype,
        kv_dtype=kv_dtype,
        quantization=quantization.lower(),
        weight_formats=tuple((name, math.ceil(size / tp)) for name, size in per_format),
        tp=tp,
        block_size=block_size,
        context=context,
        max_position_embeddings=max_positions,
        context_exceeds_model=context > max_positions,
        memory_bytes=memory_bytes,
        weight_bytes=weight_bytes,
        activation_margin=activation_margin,
        activation_margin_bytes=margin_bytes,
        kv_heads_per_gpu=heads,
        kv_heads_replicated=tp > model.num_kv_heads,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        kv_budget_bytes=budget,
        num_blocks=num_blocks,
        max_kv_tokens=num_blocks // len(groups) * block_size,
        blocks_per_sequence=blocks_per_seq,
        max_sequences_at_context=num_blocks // blocks_per_seq,
        weights_fit=weight_bytes + margin_bytes <= memory_bytes,
        full_context_sequence_fits=num_blocks >= blocks_per_seq,
        warnings=tuple(warnings),
        notes=_notes(model, tp, heads),
        kv_groups=groups,
    )


def kv_groups(
    model: ModelConfig, context: int, block_size: int
) -> tuple[tuple[int | None, int, int], ...]:
    """Per KV cache group of `model`: its window (None: full attention), its layers, and the
    blocks one sequence of `context` tokens holds in it (at most the window's)."""
    groups = group_layers(model.sliding_windows, model.num_layers)
    blocks = sequence_blocks(groups.windows, context, block_size)
    return tuple(zip(groups.windows, map(len, groups.layers), blocks, strict=True))


def _notes(model: ModelConfig, tp: int, heads: int) -> tuple[str, ...]:
    notes = []
    if tp > model.num_kv_heads:
        notes.append(
            f"tp={tp} > {model.num_kv_heads} KV heads: each GPU holds {heads} KV "
            f"head, replicated {tp // model.num_kv_heads}x across GPUs"
        )
    windows = {w for w in model.sliding_windows if w is not None}
    if windows:
        notes.append(
            f"sliding window {min(windows)}: its layers keep only the blocks their window "
            "reaches (a KV cache group of their own)"
        )
    return tuple(notes)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"


def _formats(plan: Plan) -> str:
    parts = ", ".join(f"{name} {_gib(size)}" for name, size in plan.weight_formats)
    bits = plan.weight_bytes * plan.tp * 8 / plan.num_parameters
    return f"{plan.quantization}: {parts} ({bits:.2f} bits per weight)"


def format_plan(plan: Plan) -> str:
    """A two-column table of the plan, then its warnings and notes, for the terminal."""
    sequence_bytes = plan.blocks_per_sequence * plan.kv_bytes_per_block
    rows = [
        ("model", f"{plan.model} ({plan.num_parameters / 1e9:,.2f}B parameters)"),
        ("dtype / kv dtype", f"{plan.dtype} / {plan.kv_dtype}"),
        ("tensor parallel", f"{plan.tp} (KV heads per GPU: {plan.kv_heads_per_gpu})"),
        ("memory per GPU", _gib(plan.memory_bytes)),
        ("weights per GPU", _gib(plan.weight_bytes)),
        ("weight formats", _formats(plan)),
        (
            "activation margin",
            f"{_gib(plan.activation_margin_bytes)} ({plan.activation_margin:.0%} of memory: "
            "activations, CUDA context, allocator slack)",
        ),
        (
            "KV per token",
            f"{plan.kv_bytes_per_token:,} B ({plan.kv_bytes_per_token / 1024:,.1f} KiB)",
        ),
        ("KV per block", f"{plan.kv_bytes_per_block:,} B ({plan.block_size} tokens)"),
        ("KV budget", _gib(plan.kv_budget_bytes)),
        ("KV blocks", f"{plan.num_blocks:,}"),
        ("max KV tokens", f"{plan.max_kv_tokens:,}"),
        (
            "context",
            f"{plan.context:,} tokens (model maximum {plan.max_position_embeddings:,}); "
            f"KV {_gib(sequence_bytes)} per sequence",
        ),
        *[
            (
                f"KV group {g}",
                f"{'full attention' if window is None else f'window {window:,}'}, {layers} "
                f"layers: {blocks:,} blocks ({_gib(blocks * plan.kv_bytes_per_block)}) "
                "per sequence",
            )
            for g, (window, layers, blocks) in enumerate(plan.kv_groups)
        ],
        (f"sequences of {plan.context:,}", f"{plan.max_sequences_at_context:,}"),
        (
            "weights fit",
            "yes" if plan.weights_fit else "NO: the weights and the margin exceed the memory",
        ),
        (
            "a full-context sequence fits",
            "yes"
            if plan.full_context_sequence_fits
            else f"NO: one needs {_gib(sequence_bytes)} of KV, the budget is "
            f"{_gib(plan.kv_budget_bytes)}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"warning: {w}" for w in plan.warnings]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
