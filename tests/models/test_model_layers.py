"""RMSNorm, rotary frequencies and rotation against transformers' own functions."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_config

from pagedkv.config import ModelConfig
from pagedkv.models.layers import RMSNorm, RotaryEmbedding, apply_rotary_, compute_inv_freq

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_inv_freq_matches_transformers(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = hf_config("llama", rope_scaling=SCALINGS[kind], rope_theta=500000.0)
    config = ModelConfig.from_hf(hf.to_dict())
    ours = compute_inv_freq(
        config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
    )
    if kind == "default":
        expected = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0]
    else:
        expected = ROPE_INIT_FUNCTIONS[kind](hf)[0]
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)
    if kind != "default":
        assert not torch.equal(ours, compute_inv_freq(config.head_dim, config.rope_theta))


def test_unknown_rope_type_and_missing_field():
    with pytest.raises(ValueError, match="expected rope_type"):
        compute_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="expected field 'factor'"):
        compute_inv_freq(16, 10000.0, {"rope_type": "linear"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_exactly(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 48, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(48, generator=generator)).to(dtype)
    ours, theirs = RMSNorm(48, 1e-5, dtype=dtype), LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=0)


@torch.inference_mode()
def test_rotation_in_place_on_a_strided_view_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    num_tokens, heads, head_dim = 9, 6, 16
    generator = torch.Generator().manual_seed(1)
    # Rows of a wider buffer, as the heads sit inside the fused QKV output.
    buffer = torch.randn(num_tokens, (heads + 2) * head_dim, generator=generator)
    view = buffer[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    original, tail = view.clone(), buffer[:, heads * head_dim :].clone()
    positions = torch.tensor([0, 1, 2, 3, 7, 8, 100, 5, 6])
    cos, sin = RotaryEmbedding(compute_inv_freq(head_dim, 10000.0))(positions, torch.float32)
    apply_rotary_(view, cos, sin)
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    expected, _ = apply_rotary_pos_emb(original, original, full_cos, full_sin, unsqueeze_dim=1)
    torch.testing.assert_close(view, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(buffer[:, heads * head_dim :], tail)  # v part untouched
