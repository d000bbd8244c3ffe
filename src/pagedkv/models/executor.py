"""How a model's layers run, chosen once when the model is set up (`CausalLM.use_cpu_runtime`):
every layer as torch modules (`LayerExecutor`, any device and step), or a decode step in
one compiled call on the CPU (`pagedkv.models.fused_executor`). Either returns what it
computed, hidden states and logits together (`ModelOutput`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from pagedkv.models.decoder import DecoderLayer, Rope
from pagedkv.models.layers import RMSNorm

if TYPE_CHECKING:
    from pagedkv.cache import PagedKVCache
    from pagedkv.ops import AttentionMetadata

LogitsFn = Callable[[Tensor, "Sequence[int] | None"], Tensor]
"""`CausalLM.compute_logits`: (hidden [T, hidden_size], rows) -> float32 [n, vocab_size]."""


@dataclass(frozen=True)
class ModelOutput:
    """A forward's results.

    Attributes:
        hidden: [num_tokens, hidden_size] final-norm hidden states in the model dtype.
        logits: float32 [n, vocab_size], the logits of the rows asked for, in that order.
    """

    hidden: Tensor
    logits: Tensor


class Executor(Protocol):
    def run(
        self,
        hidden: Tensor,
        rope: Rope,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
        logit_rows: Sequence[int] | None,
    ) -> ModelOutput:
        """hidden: [T, hidden_size] embedded tokens (the residual stream, updated in place);
        rope: the step's rotary tables (`decoder.Rope`); logit_rows: the rows whose logits
        are returned (None: every row)."""


class LayerExecutor:
    """Every layer as torch modules, one after the other; then the final norm and the head."""

    def __init__(self, layers: Sequence[DecoderLayer], norm: RMSNorm, logits: LogitsFn) -> None:
        self.layers, self.norm, self.logits = layers, norm, logits

    def run(
        self,
        hidden: Tensor,
        rope: Rope,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
        logit_rows: Sequence[int] | None,
    ) -> ModelOutput:
        """See `Executor.run`."""
        for layer in self.layers:
            hidden = layer.forward(hidden, rope, kv_cache, attn_metadata)
        hidden = self.norm.forward(hidden)
        return ModelOutput(hidden, self.logits(hidden, logit_rows))


def select_rows(t: Tensor, rows: Sequence[int] | None) -> Tensor:
    """t's `rows` (every row where None); a view where they are its first rows in order
    (a decode step's: no gather, which after the compiled stack would run from cold code)."""
    if rows is None:
        return t
    if list(rows) == list(range(len(rows))):
        return t[: len(rows)]
    return t.index_select(0, torch.tensor(rows, dtype=torch.int64, device=t.device))
