"""The Llama-family model on the paged KV cache against HF transformers' forward (float32)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_hf_model
from helpers.paged_batch import VARIANTS, PagedBatch, prompt

from pagedkv.models import load_model

TOL = {"atol": 2e-5, "rtol": 1e-4}


def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of HF's own forward over the whole sequence."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    model_dir = make_hf_model(tmp_path_factory.mktemp("hf"), arch, **overrides)
    return load_model(model_dir), load_hf(model_dir)


def load_hf(model_dir) -> torch.nn.Module:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf.eval()


@torch.inference_mode()
def test_prefill_then_decode_matches_hf(models):
    model, hf = models
    tokens = prompt(21, seed=1)  # 5 blocks of 5, longer than mistral's window of 8
    batch = PagedBatch(model)
    (logits,) = batch.step(model, {0: tokens})
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)
    for _ in range(4):  # decode one token at a time, crossing a block boundary
        tokens.append(int(logits[-1].argmax()))
        (logits,) = batch.step(model, {0: tokens[-1:]})
        torch.testing.assert_close(logits[-1], hf_logits(hf, tokens)[-1], **TOL)


@torch.inference_mode()
def test_mixed_batch_of_prefill_chunks_and_decodes(models):
    model, hf = models
    a, b = prompt(13, seed=2), prompt(11, seed=3)
    batch = PagedBatch(model, seed=1)
    # Step 1: all of A and the first chunk of B; step 2: A decodes while B's prefill finishes.
    out_a, out_b = batch.step(model, {0: a, 1: b[:4]})
    torch.testing.assert_close(out_a, hf_logits(hf, a), **TOL)
    torch.testing.assert_close(out_b, hf_logits(hf, b[:4]), **TOL)
    a.append(int(out_a[-1].argmax()))
    out_a, out_b = batch.step(model, {0: a[-1:], 1: b[4:]})
    torch.testing.assert_close(out_a[-1], hf_logits(hf, a)[-1], **TOL)
    torch.testing.assert_close(out_b, hf_logits(hf, b)[4:], **TOL)


@torch.inference_mode()
def test_bfloat16_load_and_forward(models, tmp_path):
    model, hf = models
    hf.save_pretrained(tmp_path)
    model16 = load_model(tmp_path, dtype="bfloat16")
    assert model16.dtype == torch.bfloat16
    assert all(rotary.inv_freq.dtype == torch.float32 for rotary in model16.rotary_embs)
    tokens = prompt(12, seed=4)
    (logits,) = PagedBatch(model16).step(model16, {0: tokens})
    assert logits.dtype == torch.float32
    # bf16 keeps ~3 significant digits; compare against HF in bf16, loosely.
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    torch.testing.assert_close(logits, hf_logits(hf16, tokens), atol=0.05, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cuda_mixed_batch_matches_hf(models, tmp_path, dtype):
    _, hf = models
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=dtype, device="cuda")
    a, b = prompt(30, seed=5), prompt(9, seed=6)
    batch = PagedBatch(model, seed=2)
    tol = {"atol": 1e-3, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
    out_a, out_b = batch.step(model, {0: a, 1: b[:3]})
    torch.testing.assert_close(out_a, hf_logits(hf, a), **tol)
    a.append(int(out_a[-1].argmax()))
    out_a, out_b = batch.step(model, {0: a[-1:], 1: b[3:]})
    torch.testing.assert_close(out_a[-1], hf_logits(hf, a)[-1], **tol)
    torch.testing.assert_close(out_b, hf_logits(hf, b)[3:], **tol)


@pytest.mark.parametrize("arch", ["phi3", "phi4"])
@torch.inference_mode()
def test_longrope_long_factors_past_the_original_length(tmp_path, arch):
    # A prompt past the original 16 positions rotates with the long factors from its first
    # token, and so does every decode step after it, as in transformers.
    model_dir = make_hf_model(tmp_path, arch, original_max_position_embeddings=16)
    hf = load_hf(model_dir)
    model = load_model(model_dir)
    assert model.rotary_embs[0].attention_factor > 1.0
    tokens = prompt(21, seed=7)
    batch = PagedBatch(model)
    (logits,) = batch.step(model, {0: tokens})
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)
    short = load_model(make_hf_model(tmp_path / "short", arch, original_max_position_embeddings=64))
    (short_logits,) = PagedBatch(short).step(short, {0: tokens})
    assert not torch.allclose(short_logits, logits, atol=1e-3)  # the factors matter here
    for _ in range(3):
        tokens.append(int(logits[-1].argmax()))
        (logits,) = batch.step(model, {0: tokens[-1:]})
        torch.testing.assert_close(logits[-1], hf_logits(hf, tokens)[-1], **TOL)


@torch.inference_mode()
def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path):
    # Gemma3ForConditionalGeneration: the text model under `language_model.`, a vision tower
    # beside it (not loaded); text-only prompts give transformers' logits (which this
    # model, unlike Gemma3ForCausalLM, does not cap).
    import transformers
    from helpers.hf_models import hf_config

    config = transformers.Gemma3Config(
        text_config=hf_config("gemma3").to_dict(),
        vision_config={
            "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
        },
        mm_tokens_per_image=4, image_token_index=511, boi_token_index=509, eoi_token_index=510,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.AutoModelForImageTextToText.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.architecture == "Gemma3ForConditionalGeneration"
    tokens = prompt(21, seed=8)
    (logits,) = PagedBatch(model).step(model, {0: tokens})
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)
