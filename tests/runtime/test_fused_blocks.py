"""A decode step of a model held in GGML blocks through the compiled decoder stack: the same
products and quantized activations as the layer-by-layer path, in every block format and in
the mixes of a K-quant file (q|k|v and gate|up parts in different formats)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model
from helpers.gguf_models import K_QUANT_MIX, random_blocks, use_k_quant_blocks, write_gguf
from helpers.paged_batch import PagedBatch, prompt

from pagedkv.models import load_model
from pagedkv.models.executor import LayerExecutor
from pagedkv.models.fused_executor import FusedDecodeExecutor
from pagedkv.runtime import decode, stack
from pagedkv.runtime.quant.formats import FORMATS
from pagedkv.runtime.quant.weight import QuantPart, QuantWeight
from pagedkv.runtime.tuning import CpuTuning

pytest.importorskip("gguf")

# Both paths quantize the same activations, but the norms' statistic is summed in another
# order than torch's: an activation may land one integer step apart now and then, and in
# bfloat16 a value one rounding step. Relative to the tensor's largest magnitude.
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


def _pair(path, dtype, k_quants):
    """The model in blocks with the layer executor and with the compiled stack."""
    models = [load_model(path, dtype=dtype) for _ in range(2)]
    for model in models:
        if k_quants:
            use_k_quant_blocks(model)
    plain, fused = models
    assert not plain.use_cpu_runtime(fused_decode=False, onednn=False)
    assert fused.use_cpu_runtime(fused_decode=True, onednn=False)
    assert isinstance(plain.executor, LayerExecutor)
    assert isinstance(fused.executor, FusedDecodeExecutor)
    assert fused.model.layers[0].mlp.down_proj.blocks is not None
    return plain, fused


def _decode_both(plain, fused, dtype, lengths=(13, 21)):
    """A prefill of sequences of `lengths` tokens, then decode steps of them all; the logits
    and caches of each step compared, the tokens the same."""
    batches = [PagedBatch(model, seed=3) for model in (plain, fused)]
    prompts = {seq: prompt(n, seed=5 + seq) for seq, n in enumerate(lengths)}
    for _ in range(6):
        logits = [
            batch.step(model, prompts) for batch, model in zip(batches, (plain, fused), strict=True)
        ]
        for a, b in zip(*logits, strict=True):
            _assert_close(b, a, dtype)
            assert torch.equal(b[-1].argmax(), a[-1].argmax())
        for pool in ("key_pool", "value_pool"):
            got, want = (getattr(batch.cache, pool) for batch in batches[::-1])
            _assert_close(got, want, dtype)
        prompts = {seq: [int(out[-1].argmax())] for seq, out in enumerate(logits[0])}


def _assert_close(got, want, dtype):
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got, want, atol=TOL[dtype] * scale, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_decode_steps_in_blocks_match_layer_by_layer(tmp_path, arch, qtype, count_fused):
    path = tmp_path / "model.gguf"
    write_gguf(make_hf_model(tmp_path, arch), path, qtype)
    plain, fused = _pair(path, torch.float32, k_quants=False)
    assert fused.model.layers[0].mlp.down_proj.blocks.format_names == [qtype]
    _decode_both(plain, fused, torch.float32)
    assert count_fused == [2] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_mixed_k_quant_parts_match_layer_by_layer(tmp_path, dtype, count_fused):
    # K-quant blocks hold 256 weights: every input size a multiple of 256.
    sizes = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    path = tmp_path / "model.gguf"
    write_gguf(make_hf_model(tmp_path, "qwen2", **sizes), path, "Q8_0")
    plain, fused = _pair(path, dtype, k_quants=True)
    assert fused.model.layers[1].self_attn.qkv_proj.blocks.format_names == list(
        K_QUANT_MIX["qkv_proj"]
    )
    _decode_both(plain, fused, dtype)
    assert count_fused == [2] * 5


@torch.inference_mode()
def test_the_head_joins_the_stack_up_to_block_rows(tmp_path, count_fused):
    """Eight decode rows: past the matrix-vector kernel's rows, within `block_rows`, so
    the LM head's integer products run inside the compiled call; the layer path's head
    takes the same products (`Linear.few_rows`)."""
    path = tmp_path / "model.gguf"
    write_gguf(make_hf_model(tmp_path, "llama"), path, "Q8_0")
    plain, fused = _pair(path, torch.bfloat16, k_quants=False)
    rows = CpuTuning().block_rows
    assert CpuTuning().matvec_rows("bfloat16") < 8 <= rows
    assert fused.executor.head_rows == rows
    head = plain.lm_head if plain.lm_head is not None else plain.tied_head
    assert head.blocks is not None and head.few_rows == rows
    _decode_both(plain, fused, torch.bfloat16, lengths=range(6, 14))
    assert count_fused == [8] * 5


@torch.inference_mode()
def test_steps_past_fused_decode_rows_run_the_stack_in_blocks(tmp_path, count_fused):
    """Twenty decode rows: past `fused_decode_rows` and `block_rows`, within
    `block_decode_rows`: the layers in the compiled call, the LM head's tiles after it."""
    path = tmp_path / "model.gguf"
    write_gguf(make_hf_model(tmp_path, "llama"), path, "Q4_0")
    plain, fused = _pair(path, torch.float32, k_quants=False)
    tuning = CpuTuning()
    assert max(tuning.fused_decode_rows, tuning.block_rows) < 20 <= tuning.block_decode_rows
    assert fused.executor.max_rows == tuning.block_decode_rows
    _decode_both(plain, fused, torch.float32, lengths=(3, 4) * 10)
    assert count_fused == [20] * 5


def test_projections_and_head_are_all_plain_or_all_in_blocks():
    fmt = FORMATS["Q8_0"]
    blocks = QuantWeight([QuantPart(fmt, random_blocks(fmt, 32, 32))], 32)
    layer = {"in_norm": torch.zeros(32), "qkv": torch.zeros(96, 32), "qkv_bias": None,
             "q_norm": None, "k_norm": None, "o_proj": blocks, "post_norm": torch.zeros(32),
             "gate_up": blocks, "down": blocks}  # fmt: skip
    with pytest.raises(ValueError, match="qkv: expected GGML blocks, as the LM head"):
        decode.DecoderWeights.create([layer], torch.zeros(32), blocks, 1e-6)
    with pytest.raises(ValueError, match="o_proj: expected a tensor, as the LM head"):
        decode.DecoderWeights.create([layer], torch.zeros(32), torch.zeros(5, 32), 1e-6)


@torch.inference_mode()
def test_warmup_compiles_the_variant_a_model_in_blocks_runs(tmp_path, count_fused):
    path = tmp_path / "model.gguf"
    write_gguf(make_hf_model(tmp_path, "qwen2"), path, "Q4_1")  # with q|k|v biases
    _, fused = _pair(path, torch.float32, k_quants=False)  # `use_cpu_runtime` warms up
    compiled = set(stack.decode_layers.signatures)
    assert any("uint8" in str(signature) for signature in compiled)
    batch = PagedBatch(fused)
    batch.step(fused, {0: prompt(6, seed=1)})
    batch.step(fused, {0: [7]})
    assert count_fused == [1]
    assert set(stack.decode_layers.signatures) == compiled
