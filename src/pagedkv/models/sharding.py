"""Which part of each checkpoint tensor a tensor-parallel rank loads.

A rank reads only its part (safetensors slices are read lazily), so no process ever holds
the whole model. Column-parallel weights are split along their output rows, row-parallel
ones along their input columns, the vocabulary along its rows; norms are replicated.
"""

from __future__ import annotations

from pagedkv.config import ModelConfig
from pagedkv.models.parallel import TensorParallel

# Checkpoint projection -> (dimension split, what is split).
_SPLITS = {
    "q_proj": (0, "heads"),
    "k_proj": (0, "kv_heads"),
    "v_proj": (0, "kv_heads"),
    "o_proj": (1, "heads"),
    "gate_proj": (0, "mlp"),
    "up_proj": (0, "mlp"),
    "down_proj": (1, "mlp"),
    "embed_tokens": (0, "vocab"),
    "lm_head": (0, "vocab"),
}


def shard_of(name: str, config: ModelConfig, tp: TensorParallel) -> tuple[int, range] | None:
    """The (dimension, index range) of checkpoint tensor `name` (an HF checkpoint name such
    as `model.layers.3.self_attn.k_proj.weight`) that rank `tp.rank` holds; `config` is the
    whole model's.

    Returns:
        None when the rank holds the whole tensor (no parallelism, norms), else the
        dimension to cut and the range of it to read. A vocabulary range may be shorter
        than the rank's rows (the last rank's padding).
    """
    if tp.size == 1:
        return None
    module = name.rsplit(".", 2)[-2]  # ...self_attn.k_proj.weight -> k_proj
    split = _SPLITS.get(module)
    if split is None:
        return None
    dim, what = split
    if what == "mlp":
        return dim, tp.rows(config.intermediate_size)
    if what == "vocab":
        return dim, tp.vocab_rows(config.vocab_size)
    if what == "heads":
        heads = tp.heads(config.num_heads)
    else:
        heads = tp.kv_heads(config.num_heads, config.num_kv_heads)
    return dim, range(heads.start * config.head_dim, heads.stop * config.head_dim)
