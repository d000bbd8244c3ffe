"""The decoder blocks of the Llama family: attention over the paged cache, the gated MLP,
a pre-norm layer of both, and the stack with its embedding table and final norm.

Each block takes one step's flat batch `[num_tokens, hidden]` (see `pagedkv.models.llama`),
and under tensor parallelism holds its rank's share (`pagedkv.models.parallel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.config import ModelConfig
from pagedkv.models.layers import RMSNorm, apply_rotary_
from pagedkv.models.parallel import NO_PARALLEL, TensorParallel
from pagedkv.ops import paged_attention_from_metadata, write_kv
from pagedkv.runtime.linear import Linear

if TYPE_CHECKING:
    from pagedkv.cache import PagedKVCache
    from pagedkv.ops import AttentionMetadata

_Device = torch.device | str | None
Rope = Sequence[tuple[Tensor, Tensor]]
"""A step's rotary tables: per rotary kind, (cos, sin), each [T, rotary_dim // 2]."""


class Attention(nn.Module):
    """Fused-QKV grouped-query attention over the paged KV cache of one layer."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        rope_index: int | None,
        dtype: torch.dtype,
        device: _Device,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        """`rope_index`: which of the step's rotary tables rotates this layer (None: none)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = len(tp.heads(config.num_heads))
        self.num_kv_heads = len(tp.kv_heads(config.num_heads, config.num_kv_heads))
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim**-0.5
        windows = config.sliding_windows
        self.sliding_window = windows[layer_idx] if windows else None
        self.rope_index = rope_index
        self.rotary_dim = config.rotary_dim
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=config.attention_bias,
            **factory,
        )
        # Row-parallel: each rank's product is a partial sum over its heads.
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False, **factory)
        norm = {"offset": config.norm_offset, **factory}
        self.q_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, **norm) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, **norm) if config.qk_norm else None
        )

    def forward(
        self,
        hidden: Tensor,
        rope: Rope,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
    ) -> Tensor:
        """hidden: [T, hidden_size] -> [T, hidden_size]; writes the T tokens' K/V."""
        num_tokens, heads = hidden.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj.forward(hidden)
        # qkv: (T, (H + 2 KV) * D), a fresh buffer we may rotate in; q, k, v are views of it
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KV, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KV, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        if self.rope_index is not None:
            cos, sin, rot = *rope[self.rope_index], self.rotary_dim
            if self.q_norm is None:
                # q and k heads sit side by side in each row: rotate all of them in one pass.
                qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim)
                apply_rotary_(qk[..., :rot], cos, sin)
            else:
                apply_rotary_(q[..., :rot], cos, sin)
                apply_rotary_(k[..., :rot], cos, sin)
        key_cache = kv_cache.key_caches[self.layer_idx]
        value_cache = kv_cache.value_caches[self.layer_idx]
        # This layer's KV cache group: its block tables and slots.
        attn_metadata = attn_metadata.group(kv_cache.group_of[self.layer_idx])
        # int8 caches: their scales (None for a float cache)
        scales = dict(
            key_scales=kv_cache.key_scales[self.layer_idx],
            value_scales=kv_cache.value_scales[self.layer_idx],
        )
        # Rows past the step's tokens only pad the matmuls' shape (see `CausalLM.forward`).
        num_real = attn_metadata.num_tokens
        write_kv(
            k[:num_real], v[:num_real], key_cache, value_cache, attn_metadata.slot_mapping,
            backend=attn_metadata.backend, **scales,
        )  # fmt: skip
        # The metadata variant reuses the backend's per-step plan across layers.
        out = paged_attention_from_metadata(
            q[:num_real],
            key_cache,
            value_cache,
            attn_metadata,
            scale=self.scale,
            sliding_window=self.sliding_window,
            **scales,
        )
        out = out.reshape(num_real, self.q_size)
        if num_real < num_tokens:
            out = F.pad(out, (0, 0, 0, num_tokens - num_real))
        return self.tp.all_reduce(self.o_proj.forward(out))


class MLP(nn.Module):
    """Gated MLP (SiLU, or tanh GELU for GeGLU) with gate and up projections fused into
    one matmul."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: _Device,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        super().__init__()
        self.tp = tp
        size = len(tp.rows(config.intermediate_size))
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, bias=False, **factory)
        self.down_proj = Linear(size, config.hidden_size, bias=False, **factory)
        self.hidden_act = config.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        """x: [T, hidden_size] -> [T, hidden_size]."""
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        if self.hidden_act == "gelu_tanh":
            gated = F.gelu(gate, approximate="tanh")
        else:
            gated = F.silu(gate)
        return self.tp.all_reduce(self.down_proj.forward(gated.mul_(up)))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    With `config.sandwich_norm` (Gemma) each block's output is normed too:
    x + norm(attn(norm(x))), then x + norm(mlp(norm(x))). The names are the checkpoint's:
    Llama's `post_attention_layernorm` is the norm before the MLP, Gemma's the one after
    attention (its norm before the MLP is `pre_feedforward_layernorm`).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        rope_index: int | None,
        dtype: torch.dtype,
        device: _Device,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(
            config, layer_idx, rope_index=rope_index, dtype=dtype, device=device, tp=tp
        )
        self.mlp = MLP(config, dtype=dtype, device=device, tp=tp)
        self.input_layernorm = create_norm(config, dtype=dtype, device=device)
        self.post_attention_layernorm = create_norm(config, dtype=dtype, device=device)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norm:
            self.pre_feedforward_layernorm = create_norm(config, dtype=dtype, device=device)
            self.post_feedforward_layernorm = create_norm(config, dtype=dtype, device=device)

    def forward(
        self,
        hidden: Tensor,
        rope: Rope,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
    ) -> Tensor:
        """hidden: [T, hidden_size] -> [T, hidden_size], updated in place (residual adds)."""
        # `.forward` directly: these modules never carry hooks (see `Attention.forward`).
        normed = self.input_layernorm.forward(hidden)
        attended = self.self_attn.forward(normed, rope, kv_cache, attn_metadata)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden += attended
            hidden += self.mlp.forward(self.post_attention_layernorm.forward(hidden))
            return hidden
        hidden += self.post_attention_layernorm.forward(attended)
        out = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden))
        hidden += self.post_feedforward_layernorm.forward(out)
        return hidden


def create_norm(config: ModelConfig, *, dtype: torch.dtype, device: _Device) -> RMSNorm:
    """An RMSNorm over the hidden size, in the family's style (`config.norm_offset`)."""
    return RMSNorm(
        config.hidden_size, config.rms_norm_eps, offset=config.norm_offset,
        dtype=dtype, device=device,
    )  # fmt: skip


class DecoderModel(nn.Module):
    """Embeddings, the decoder stack and the final norm (HF's `model.` prefix)."""

    def __init__(
        self,
        config: ModelConfig,
        rope_indices: Sequence[int | None],
        *,
        dtype: torch.dtype,
        device: _Device,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        """`rope_indices`: per layer, its rotary table in the step's `Rope` (None: none)."""
        super().__init__()
        # Vocabulary-parallel: this rank's rows of the table (all of it with one rank). The
        # table is given, not initialized: the checkpoint fills it, and `reset_parameters`
        # (`init.normal_`) would import torch._dynamo at every start.
        rows = tp.vocab_part(config.vocab_size)
        self.embed_tokens = nn.Embedding(
            rows, config.hidden_size,
            _weight=torch.empty(rows, config.hidden_size, dtype=dtype, device=device),
        )  # fmt: skip
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rope_index=index, dtype=dtype, device=device, tp=tp)
            for i, index in enumerate(rope_indices)
        )
        self.norm = create_norm(config, dtype=dtype, device=device)
