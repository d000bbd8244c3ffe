"""A decode step in one compiled call on the CPU: every layer, the final norm and the LM
head (`pagedkv.runtime.decode.decode_layers`, the same operations and roundings as the
torch layers, no Python between them), from plain weights or from GGML blocks (the products
and the quantized activations of `Linear`'s few-row path). Steps it does not take run layer
by layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from pagedkv.models.decoder import DecoderLayer, Rope
from pagedkv.models.executor import LayerExecutor, LogitsFn, ModelOutput, select_rows
from pagedkv.ops import step_plan
from pagedkv.ops.cpu import CpuPlan
from pagedkv.runtime.decode import DecoderWeights, decode_layers
from pagedkv.runtime.quant.weight import QuantWeight
from pagedkv.runtime.tuning import CpuTuning

if TYPE_CHECKING:
    from pagedkv.cache import PagedKVCache
    from pagedkv.ops import AttentionMetadata


class FusedDecodeExecutor:
    """Takes a step of at most `max_rows` rows whose every row is a kernel row of the CPU
    attention backend's plan (a decode step); gives any other to `layers`.

    The LM head joins the compiled call at most at `head_rows` rows, as it would go to the
    few-row product outside it (`CpuTuning.few_rows`); for more, `logits` runs it after.
    """

    def __init__(
        self,
        layers: LayerExecutor,
        weights: DecoderWeights,
        logits: LogitsFn,
        *,
        max_rows: int,
        head_rows: int,
        knobs: tuple[int, int, int],
    ) -> None:
        self.layers, self.weights, self.logits = layers, weights, logits
        self.max_rows, self.head_rows, self.knobs = max_rows, head_rows, knobs
        attention = layers.layers[0].self_attn
        self.num_heads, self.window, self.scale = (
            attention.num_heads, attention.sliding_window, attention.scale,
        )  # fmt: skip

    @classmethod
    def create(
        cls,
        layers: LayerExecutor,
        head: Tensor | QuantWeight,
        logits: LogitsFn,
        tuning: CpuTuning,
    ) -> FusedDecodeExecutor:
        """The executor over `layers`' weights, plain or in blocks (read in place), and
        `head`, [vocab, hidden], held as they are, with `tuning`'s rows (`fused_decode_rows`,
        or `block_decode_rows` in blocks) and knobs."""
        weights = DecoderWeights.create(
            [_layer_weights(layer) for layer in layers.layers], layers.norm.weight, head,
            layers.norm.eps,
        )  # fmt: skip
        in_blocks = isinstance(head, QuantWeight)
        return cls(
            layers, weights, logits,
            max_rows=tuning.block_decode_rows if in_blocks else tuning.fused_decode_rows,
            head_rows=tuning.few_rows(str(weights.dtype).removeprefix("torch."), in_blocks),
            knobs=tuning.kernel_knobs(),
        )  # fmt: skip

    def run(
        self,
        hidden: Tensor,
        rope: Rope,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
        logit_rows: Sequence[int] | None,
    ) -> ModelOutput:
        """See `Executor.run`."""
        rows, num_real = hidden.shape[0], attn_metadata.num_tokens
        if rows <= self.max_rows:
            plan = step_plan(
                attn_metadata, kv_cache.key_caches[0], kv_cache.value_caches[0],
                self.num_heads, self.window,
            ).state  # fmt: skip
            if isinstance(plan, CpuPlan) and plan.is_decode_only(num_real):
                with_head = rows <= self.head_rows
                ((cos, sin),) = rope  # one rotary kind over whole heads (`fused_decode_applies`)
                final, logits = decode_layers(
                    hidden, cos, sin, attn_metadata.slot_mapping[:num_real], self.weights,
                    kv_cache.key_pool, kv_cache.value_pool, plan, self.scale, with_head,
                    self.knobs, _scale_pools(kv_cache),
                )  # fmt: skip
                if logits is None:
                    return ModelOutput(final, self.logits(final, logit_rows))
                return ModelOutput(final, select_rows(logits, logit_rows))
        return self.layers.run(hidden, rope, kv_cache, attn_metadata, logit_rows)


def _scale_pools(kv_cache: PagedKVCache) -> tuple[Tensor, Tensor] | None:
    """The int8 cache's scale pools, or None for a float cache."""
    key, value = kv_cache.key_scale_pool, kv_cache.value_scale_pool
    return None if key is None or value is None else (key, value)


def _layer_weights(layer: DecoderLayer) -> dict[str, Tensor | QuantWeight | None]:
    attention, mlp = layer.self_attn, layer.mlp
    return {
        "in_norm": layer.input_layernorm.weight,
        "qkv": attention.qkv_proj.held,
        "qkv_bias": attention.qkv_proj.bias,
        "q_norm": None if attention.q_norm is None else attention.q_norm.weight,
        "k_norm": None if attention.k_norm is None else attention.k_norm.weight,
        "o_proj": attention.o_proj.held,
        "post_norm": layer.post_attention_layernorm.weight,
        "gate_up": mlp.gate_up_proj.held,
        "down": mlp.down_proj.held,
    }
