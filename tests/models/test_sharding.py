"""Each tensor-parallel rank loads exactly its part of every weight, and no more."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model

from pagedkv.models import load_model
from pagedkv.models.parallel import TensorParallel

GROUP = object()  # loading runs no collective: any stand-in for the process group will do


@pytest.mark.parametrize(
    ("arch", "overrides"),
    # Phi-3's checkpoint fuses q|k|v and gate|up: each rank still reads its heads and rows.
    [("qwen2", {"vocab_size": 509}), ("llama", {"num_key_value_heads": 1}), ("phi3", {})],
)
def test_ranks_hold_their_slices_of_the_whole_model(tmp_path, arch, overrides):
    model_dir = make_hf_model(tmp_path, arch, **overrides)
    whole = load_model(model_dir, dtype="float32")
    config = whole.config
    d, vocab = config.head_dim, config.vocab_size
    for rank in (0, 1):
        part = load_model(model_dir, dtype="float32", tp=TensorParallel(rank, 2, GROUP))
        attn, full_attn = part.model.layers[0].self_attn, whole.model.layers[0].self_attn
        heads = range(rank * 2, rank * 2 + 2)
        kv = [0] if config.num_kv_heads == 1 else [rank]
        q_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])
        k_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv])
        q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
        expected_qkv = torch.cat([
            full_attn.qkv_proj.weight[q_rows],
            full_attn.qkv_proj.weight[q_size + k_rows],
            full_attn.qkv_proj.weight[q_size + kv_size + k_rows],
        ])  # fmt: skip
        assert torch.equal(attn.qkv_proj.weight, expected_qkv)
        if config.attention_bias:
            assert torch.equal(attn.qkv_proj.bias[: len(q_rows)], full_attn.qkv_proj.bias[q_rows])
        assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, q_rows])
        mlp, full_mlp = part.model.layers[0].mlp, whole.model.layers[0].mlp
        width = config.intermediate_size // 2
        mine = slice(rank * width, (rank + 1) * width)
        assert torch.equal(mlp.down_proj.weight, full_mlp.down_proj.weight[:, mine])
        gate, up = full_mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate[mine], up[mine]]))
        rows = -(-vocab // 2)
        table = part.model.embed_tokens.weight
        assert table.shape[0] == rows
        real = min(rows, vocab - rank * rows)
        assert torch.equal(
            table[:real], whole.model.embed_tokens.weight[rank * rows : rank * rows + real]
        )
        assert not table[real:].any()  # the padding rows past the vocabulary
        assert torch.equal(part.model.norm.weight, whole.model.norm.weight)
