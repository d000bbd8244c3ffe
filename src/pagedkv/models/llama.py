"""Llama, Mistral, Qwen2 and Qwen3 in one implementation, switched by `ModelConfig` flags.

Every forward is one flat batch: the new tokens of all sequences of a step (prefill chunks
and decode tokens alike) concatenated into `[num_tokens, hidden]`, no padding. Each layer
writes its new K/V through `attn_metadata.slot_mapping` and attends through the block tables.

Differences within the family, all from the config:
    attention_bias   q/k/v projections carry a bias (Qwen2)
    qk_norm          RMSNorm over each q and k head before RoPE (Qwen3)
    head_dim         may differ from hidden_size // num_heads (Qwen3)
    sliding_windows  per-layer attention window (Mistral; Qwen2 layer_types)
    tie_word_embeddings  the LM head reuses the embedding matrix (no `lm_head` weight)

Under tensor parallelism (`tp`, see `pagedkv.models.parallel`) every module holds its rank's
share and the sizes (`num_heads`, `q_size`, ...) are that share's. The decoder blocks are in
`pagedkv.models.decoder`; here the model around them and its CPU fast paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.config import ModelConfig
from pagedkv.models.decoder import DecoderLayer, DecoderModel
from pagedkv.models.layers import (
    FUSED_DECODE_ROWS,
    MATVEC_ROWS,
    RotaryEmbedding,
    can_pack_linear,
    compute_inv_freq,
    linear,
    pack_linear_,
    use_matvec_,
)
from pagedkv.models.parallel import NO_PARALLEL, TensorParallel, check_split
from pagedkv.ops import plan as plan_attention

if TYPE_CHECKING:
    from pagedkv.cache import PagedKVCache
    from pagedkv.ops import AttentionMetadata
    from pagedkv.runtime.decode import DecoderWeights

_Device = torch.device | str | None


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
        self.model = DecoderModel(config, dtype=dtype, device=device, tp=tp)
        inv_freq = compute_inv_freq(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        self.rotary_emb = RotaryEmbedding(inv_freq, device=device)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            vocab = tp.vocab_part(config.vocab_size)
            self.lm_head = nn.Linear(
                config.hidden_size, vocab, bias=False, dtype=dtype, device=device
            )
        # A tied LM head as a layer of its own (`use_matvec`, `pack_weights`), made on demand.
        self.tied_head: nn.Linear | None = None
        self.decoder_weights: DecoderWeights | None = None  # set by `use_fused_decode`
        # The last forward's output and logits where the compiled stack computed both.
        self._stack_logits: tuple[Tensor, Tensor | None] | None = None

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
    ) -> Tensor:
        """Run one step's tokens through the model, writing their K/V into `kv_cache`.

        Args:
            input_ids: [num_tokens] int64, every sequence's new tokens back to back, in the
                order of `attn_metadata.query_start_loc`; rows past
                `attn_metadata.num_tokens` are padding (a bucketed matmul shape): they pass
                the matmuls and norms, never `write_kv` or attention.
            positions: [num_tokens] int64, each token's position in its sequence.
            kv_cache: the paged K/V pools, one pair per layer.
            attn_metadata: block tables, lengths and slot mapping of this step.

        Returns:
            [num_tokens, hidden_size] final-norm hidden states in the model dtype.

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
        self._stack_logits = None
        hidden = self._embed(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        self._stack_logits = self._decode_fused(hidden, cos, sin, kv_cache, attn_metadata)
        if self._stack_logits is not None:
            return self._stack_logits[0]
        for layer in self._layers():
            hidden = layer.forward(hidden, cos, sin, kv_cache, attn_metadata)
        return self.model.norm.forward(hidden)

    def _decode_fused(
        self,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[Tensor, Tensor | None] | None:
        """Every layer, the final norm and the LM head in one compiled call where
        `use_fused_decode` applies to this step (a few rows, all decoding, on the CPU
        backend): the final hidden states and float32 logits; None where it does not.
        The head joins the call at most at `MATVEC_ROWS` rows, as it would go to the
        matrix-vector kernel outside it; for more, oneDNN's matmul runs it after the call
        (logits None)."""
        if self.decoder_weights is None or hidden.shape[0] > FUSED_DECODE_ROWS:
            return None
        from pagedkv.ops import cpu
        from pagedkv.runtime import decode

        attention = self._layers()[0].self_attn
        window = attention.sliding_window
        if window not in attn_metadata.plans:
            plan_attention(
                attn_metadata, kv_cache.key_caches[0], kv_cache.value_caches[0],
                attention.num_heads, window,
            )  # fmt: skip
        _, _, _, backend, plan = attn_metadata.plans[window]
        num_real = attn_metadata.num_tokens
        if backend is not cpu or not cpu.is_decode_only(plan, num_real):
            return None
        return decode.decode_layers(
            hidden, cos, sin, attn_metadata.slot_mapping[:num_real], self.decoder_weights,
            kv_cache.key_pool, kv_cache.value_pool, plan, attention.scale,
            hidden.shape[0] <= MATVEC_ROWS[hidden.dtype],
        )  # fmt: skip

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
        dtype (as HF does), only the result is upcast. Where `hidden` is the output of the
        last forward and the compiled stack ran it, the stack computed the logits too: they
        are returned as it did. Under tensor parallelism every rank computes its vocabulary
        rows' logits and every rank gets all of them (a collective: each rank must call
        this with the same rows).
        """
        stack = self._stack_logits
        if stack is not None and stack[1] is not None and hidden is stack[0]:
            return _select_rows(stack[1], rows)
        hidden = _select_rows(hidden, rows)
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = linear(hidden, head)
        if self.tp.size > 1:
            logits = self.tp.gather_columns(logits)[:, : self.config.vocab_size]
        return logits.float()

    def pack_weights(self) -> bool:
        """Send every matmul through oneDNN (`layers.pack_linear_`; a tied LM head gets a
        packed copy, as the embedding table stays plain for lookups). Returns whether it
        applies (`layers.can_pack_linear`).
        """
        if not can_pack_linear(self.dtype, self.device):
            return False
        self._make_tied_head()
        for module in list(self.modules()):
            if isinstance(module, nn.Linear):
                pack_linear_(module)
        return True

    def use_matvec(self) -> bool:
        """Multiply at most `MATVEC_ROWS[dtype]` rows (a decode step of a few sequences) with
        the CPU's matrix-vector kernel (`runtime.decode.linear_rows`), every other batch
        through torch. Call it before `pack_weights`, which then holds a second, packed copy
        of each weight. Returns whether it applies (float32 or bfloat16 weights on the CPU).
        """
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return False
        from pagedkv.runtime.decode import linear_rows  # Numba: loaded only where it runs

        self._make_tied_head()
        for module in self.modules():
            if isinstance(module, nn.Linear) and not module.weight.is_mkldnn:
                use_matvec_(module, linear_rows)
        return True

    def use_fused_decode(self) -> bool:
        """Send a decode step of at most `FUSED_DECODE_ROWS` rows through every layer, the
        final norm and the LM head in one compiled call (`runtime.decode.decode_layers`: the
        same operations and roundings, no Python between them; `compute_logits` returns
        its logits). Call it before `pack_weights`: it reads the plain weights. Returns
        whether it applies: float32 or bfloat16 on the CPU, one rank, and one sliding window
        (or none) for every layer.
        """
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return False
        windows = {layer.self_attn.sliding_window for layer in self._layers()}
        if self.tp.size > 1 or len(windows) > 1:
            return False
        from pagedkv.runtime.decode import DecoderWeights  # Numba: loaded only where it runs

        layers = []
        for layer in self._layers():
            attention, mlp = layer.self_attn, layer.mlp
            layers.append({
                "in_norm": layer.input_layernorm.weight,
                "qkv": attention.qkv_proj.weight,
                "qkv_bias": attention.qkv_proj.bias,
                "q_norm": None if attention.q_norm is None else attention.q_norm.weight,
                "k_norm": None if attention.k_norm is None else attention.k_norm.weight,
                "o_proj": attention.o_proj.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "gate_up": mlp.gate_up_proj.weight,
                "down": mlp.down_proj.weight,
            })  # fmt: skip
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        self.decoder_weights = DecoderWeights.create(
            layers, self.model.norm.weight, head.weight, self.config.rms_norm_eps
        )
        return True

    def _layers(self) -> Sequence[DecoderLayer]:
        """The decoder layers, typed (an `nn.ModuleList` yields plain modules)."""
        return cast("Sequence[DecoderLayer]", self.model.layers)

    def _make_tied_head(self) -> None:
        """A tied LM head as a layer whose weight is the embedding table (the same tensor)."""
        if self.lm_head is None and self.tied_head is None:
            rows = self.model.embed_tokens.weight.shape[0]
            head = nn.Linear(self.config.hidden_size, rows, bias=False, device="meta")
            del head.weight
            head.register_buffer("weight", self.model.embed_tokens.weight.detach())
            self.tied_head = head


def _select_rows(t: Tensor, rows: Sequence[int] | None) -> Tensor:
    """t's `rows` (every row where None); a view where they are its first rows in order
    (a decode step's: no gather, which after the compiled stack would run from cold code)."""
    if rows is None:
        return t
    if list(rows) == list(range(len(rows))):
        return t[: len(rows)]
    return t.index_select(0, torch.tensor(rows, dtype=torch.int64, device=t.device))
