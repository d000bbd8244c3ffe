"""Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3 and SmolLM3 in one implementation, switched
by `ModelConfig` flags.

Every forward is one flat batch: the new tokens of all sequences of a step (prefill chunks
and decode tokens alike) concatenated into `[num_tokens, hidden]`, no padding. Each layer
writes its new K/V through `attn_metadata.slot_mapping` and attends through the block tables.

Differences within the family, all from the config:
    attention_bias   q/k/v projections carry a bias (Qwen2)
    qk_norm          RMSNorm over each q and k head before RoPE (Qwen3)
    head_dim         may differ from hidden_size // num_heads (Qwen3)
    sliding_windows  per-layer attention window (Mistral; Qwen2 layer_types)
    tie_word_embeddings  the LM head reuses the embedding matrix (no `lm_head` weight)
    norm_offset, sandwich_norm, hidden_act, attention_scale, embedding_scale,
    final_logit_softcapping  Gemma 3's layer options (`pagedkv.families`)
    partial_rotary_factor, rope_local_theta, rope_layers, rope_scaling
                     which dimensions of which layers rotate, by which table (Phi-3,
                     Gemma 3, SmolLM3; `rotary_kinds`)

Under tensor parallelism (`tp`, see `pagedkv.models.parallel`) every module holds its rank's
share and the sizes (`num_heads`, `q_size`, ...) are that share's. The decoder blocks are in
`pagedkv.models.decoder`, how they run in `pagedkv.models.executor`; here the model around
them, which picks its executor and products once (`use_cpu_runtime`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.config import ModelConfig
from pagedkv.models.decoder import DecoderLayer, DecoderModel
from pagedkv.models.executor import Executor, LayerExecutor, ModelOutput, select_rows
from pagedkv.models.layers import RotaryEmbedding, create_rotary
from pagedkv.models.parallel import NO_PARALLEL, TensorParallel, check_split
from pagedkv.runtime.linear import Linear
from pagedkv.runtime.quant.weight import QuantWeight
from pagedkv.runtime.tuning import CpuTuning

if TYPE_CHECKING:
    from pagedkv.cache import PagedKVCache
    from pagedkv.ops import AttentionMetadata

_Device = torch.device | str | None
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CausalLM(nn.Module):
    """A Llama-family causal language model running on a paged KV cache.

    Parameter names mirror HF's with two fusions (`qkv_proj` = q|k|v, `gate_up_proj` =
    gate|up); `pagedkv.models.loader` maps checkpoint names onto them.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: _Device = None,
        tp: TensorParallel = NO_PARALLEL,
    ) -> None:
        """Build the (uninitialized) modules of `config`, or of rank `tp.rank`'s share.

        Raises:
            ValueError: `config` does not split evenly over `tp.size` ranks.
        """
        super().__init__()
        check_split(config, tp.size)
        self.config = config
        self.tp = tp
        kinds, rope_indices = rotary_kinds(config)
        self.model = DecoderModel(config, rope_indices, dtype=dtype, device=device, tp=tp)
        self.rotary_embs = nn.ModuleList(
            create_rotary(
                config.rotary_dim, theta, scaling, config.max_position_embeddings, device=device
            )
            for theta, scaling in kinds
        )
        self.embedding_scale: float | None = None
        if config.embedding_scale is not None:
            # HF multiplies by the scale rounded to the model dtype.
            rounded = torch.tensor(config.embedding_scale, device="cpu").to(dtype)
            self.embedding_scale = float(rounded)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            vocab = tp.vocab_part(config.vocab_size)
            self.lm_head = Linear(config.hidden_size, vocab, bias=False, dtype=dtype, device=device)
        # A tied LM head as a layer of its own, sharing the embedding table (`use_cpu_runtime`)
        # or its blocks (`pagedkv.models.quantized`).
        self.tied_head: Linear | None = None
        self.executor: Executor = LayerExecutor(
            self._layers(), self.model.norm, self.compute_logits
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
        logit_rows: Sequence[int] | None = None,
    ) -> ModelOutput:
        """Run one step's tokens through the model, writing their K/V into `kv_cache`.

        Args:
            input_ids: [num_tokens] int64, every sequence's new tokens back to back, in the
                order of `attn_metadata.query_start_loc`; rows past
                `attn_metadata.num_tokens` are padding (a bucketed matmul shape): they pass
                the matmuls and norms, never `write_kv` or attention.
            positions: [num_tokens] int64, each token's position in its sequence.
            kv_cache: the paged K/V pools, one pair per layer.
            attn_metadata: block tables, lengths and slot mapping of this step.
            logit_rows: the rows whose logits to compute, in order (None: every row). Under
                tensor parallelism every rank must pass the same rows (a collective).

        Returns:
            hidden: [num_tokens, hidden_size] final-norm hidden states in the model dtype;
            logits: float32 [len(logit_rows), vocab_size].

        Raises:
            ValueError: `input_ids` and `positions` differ in shape, are not 1-D or hold
                fewer rows than `attn_metadata.num_tokens`.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"expected input_ids and positions of shape [num_tokens], "
                f"got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if input_ids.shape[0] < attn_metadata.num_tokens:
            raise ValueError(
                f"input_ids: expected at least attn_metadata.num_tokens="
                f"{attn_metadata.num_tokens} rows, got {input_ids.shape[0]}"
            )
        hidden = self._embed(input_ids)
        if self.embedding_scale is not None:
            hidden.mul_(self.embedding_scale)
        return self.executor.run(
            hidden, self._rope(positions, hidden.dtype, attn_metadata), kv_cache, attn_metadata,
            logit_rows,
        )  # fmt: skip

    def _rope(
        self, positions: Tensor, dtype: torch.dtype, attn_metadata: AttentionMetadata
    ) -> list[tuple[Tensor, Tensor]]:
        """The step's rotary tables, one (cos, sin) per kind (`decoder.Rope`)."""
        embeddings = cast("Sequence[RotaryEmbedding]", self.rotary_embs)
        seq_lens = None
        if any(embedding.needs_seq_lens for embedding in embeddings):
            seq_lens = token_seq_lens(attn_metadata, positions.shape[0])
        return [embedding(positions, dtype, seq_lens) for embedding in embeddings]

    def _embed(self, input_ids: Tensor) -> Tensor:
        """[T] -> [T, hidden_size]; under tensor parallelism each rank looks up the ids in
        its rows, zeros the others, and the all-reduce assembles the rows."""
        table = self.model.embed_tokens.weight
        if self.tp.size == 1:
            return F.embedding(input_ids, table)
        rows = self.tp.vocab_rows(self.config.vocab_size)
        local = input_ids - rows.start
        outside = (local < 0) | (local >= len(rows))
        hidden = F.embedding(local.masked_fill(outside, 0), table)
        return self.tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: Tensor, rows: Sequence[int] | None = None) -> Tensor:
        """Float32 logits [n, vocab_size] of hidden's `rows` (every row where None).

        hidden: [num_tokens, hidden_size] in the model dtype. The matmul runs in the model
        dtype (as HF does), only the result is upcast. Under tensor parallelism every rank
        computes its vocabulary rows' logits and every rank gets all of them (a collective:
        each rank must call this with the same rows).
        """
        if rows is not None and not rows:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        hidden = select_rows(hidden, rows)
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = head.forward(hidden)
        if self.tp.size > 1:
            logits = self.tp.gather_columns(logits)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap  # in the model dtype, as HF does
        return logits.float()

    def use_cpu_runtime(
        self,
        *,
        matvec: bool = True,
        fused_decode: bool = True,
        onednn: bool = True,
        tuning: CpuTuning | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> bool:
        """Choose, once, how this model runs on the CPU (`pagedkv.runtime`); call it after
        the weights are loaded. Elsewhere, or in a dtype the kernels lack, only `onednn`
        can apply (and on a GPU nothing does).

        Args:
            matvec: products of a few rows (`tuning.matvec_rows`) in the matrix-vector
                kernel, on one thread or on all.
            fused_decode: decode steps of at most `tuning.fused_decode_rows` rows
                (`block_decode_rows` on weights in GGML blocks) through every layer, the
                final norm and the LM head in one compiled call, where `fused_decode_applies`
                (one rank, and Llama's layer in every layer).
            onednn: every other product through oneDNN (`runtime.linear.Linear`).
            tuning: the knobs (default: `CpuTuning()`).
            kv_cache_dtype: the KV cache's dtype where it is not the model's (int8), so that
                the warm-up compiles the decode step over it.

        Returns:
            Whether the compiled decode step applies.
        """
        tuning = tuning or CpuTuning()
        kernels = self.device.type == "cpu" and self.dtype in _KERNEL_DTYPES
        fused = fused_decode and kernels and self.tp.size == 1 and fused_decode_applies(self.config)
        dtype_name = str(self.dtype).removeprefix("torch.")
        few_rows = tuning.matvec_rows(dtype_name) if matvec and kernels else 0
        if self.lm_head is None and self.tied_head is None and (few_rows or onednn):
            embedding = self.model.embed_tokens.weight
            vocab, hidden = embedding.shape
            self.tied_head = Linear(hidden, vocab, bias=False, weight=embedding)
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_products(few_rows, onednn, tuning=tuning)
        head = self.lm_head if self.lm_head is not None else self.tied_head
        head_weight = head.held if head is not None else self.model.embed_tokens.weight
        in_blocks = isinstance(head_weight, QuantWeight)
        # The compiled stack reads the projections and the head all plain or all in blocks:
        # a model mixing them runs layer by layer.
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        fused &= all((m.blocks is not None) == in_blocks for m in linears)
        if fused:
            from pagedkv.models.fused_executor import FusedDecodeExecutor  # Numba

            layers = LayerExecutor(self._layers(), self.model.norm, self.compute_logits)
            self.executor = FusedDecodeExecutor.create(
                layers, head_weight, self.compute_logits, tuning
            )
        if few_rows or fused:
            from pagedkv.runtime.decode import warmup, warmup_blocks  # Numba

            # the runtime's kernels, before the first request
            warmup(self.dtype, kv_cache_dtype if fused else None)
            if fused and in_blocks:
                warmup_blocks(self.dtype)
        return fused

    def _layers(self) -> Sequence[DecoderLayer]:
        """The decoder layers, typed (an `nn.ModuleList` yields plain modules)."""
        return cast("Sequence[DecoderLayer]", self.model.layers)


def fused_decode_applies(config: ModelConfig) -> bool:
    """Whether the compiled decode step (`pagedkv.runtime.decode`) computes what the layers
    do: it has Llama's layer only (plain RMSNorm, two norms, SiLU, no logit cap), one
    rotary table over whole heads for every layer, and one window or none for all."""
    kinds, indices = rotary_kinds(config)
    return (
        config.norm_offset == 0.0
        and not config.sandwich_norm
        and config.hidden_act == "silu"
        and config.final_logit_softcapping is None
        and config.rotary_dim == config.head_dim
        and len(kinds) == 1
        and None not in indices
        and len(set(config.sliding_windows or (None,))) == 1
    )


RotaryKind = tuple[float, "dict[str, Any] | None"]
"""A rotary table's (base, scaling)."""


def rotary_kinds(config: ModelConfig) -> tuple[list[RotaryKind], list[int | None]]:
    """The distinct rotary tables of `config` and, per layer, the index of its own (None for
    a layer without rotary: SmolLM3's `rope_layers`). Gemma 3's sliding layers rotate with
    `rope_local_theta`, unscaled; every other layer with `rope_theta` and `rope_scaling`."""
    kinds: list[RotaryKind] = []
    indices: list[int | None] = []
    windows = config.sliding_windows or (None,) * config.num_layers
    rotated = config.rope_layers or (True,) * config.num_layers
    for window, is_rotated in zip(windows, rotated, strict=True):
        if not is_rotated:
            indices.append(None)
            continue
        kind: RotaryKind = (config.rope_theta, config.rope_scaling)
        if window is not None and config.rope_local_theta is not None:
            kind = (config.rope_local_theta, None)
        if kind not in kinds:
            kinds.append(kind)
        indices.append(kinds.index(kind))
    return kinds, indices


def token_seq_lens(attn_metadata: AttentionMetadata, num_rows: int) -> Tensor:
    """[num_rows] int64: each token's sequence length at the end of the step (0 for the
    padding rows past `attn_metadata.num_tokens`)."""
    query_lens = attn_metadata.query_start_loc.diff()
    num_real = attn_metadata.num_tokens
    lens = attn_metadata.seq_lens.long().repeat_interleave(query_lens, output_size=num_real)
    return F.pad(lens, (0, num_rows - num_real))
