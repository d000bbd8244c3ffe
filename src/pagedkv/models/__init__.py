"""Llama-family models on the paged KV cache, their safetensors loader and tokenizer.

`CausalLM.forward(input_ids, positions, kv_cache, attn_metadata, logit_rows)` runs one flat
batch of tokens and returns a `ModelOutput` (hidden states and the rows' logits);
`load_model(dir)` builds and loads it from a Hugging Face model directory.
"""

from __future__ import annotations

from pagedkv.models.llama import CausalLM
from pagedkv.models.loader import (
    checkpoint_shapes,
    load_model,
    resolve_device,
    resolve_dtype,
    save_random_checkpoint,
)

__all__ = [
    "CausalLM",
    "checkpoint_shapes",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "save_random_checkpoint",
]
