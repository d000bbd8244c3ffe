"""The Llama-family model on the paged KV cache against HF transformers' forward (float32)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_hf_model

from pagedkv.cache import PagedKVCache
from pagedkv.models import CausalLM, load_model
from pagedkv.ops import AttentionMetadata

BLOCK_SIZE = 5  # not a power of two: block boundaries fall mid-prompt
NUM_BLOCKS = 48  # room for a step of more rows than the compiled decoder stack takes
TOL = {"atol": 2e-5, "rtol": 1e-4}


class PagedBatch:
    """Sequences' block tables drawn from a shuffled pool; builds each step's inputs."""

    def __init__(self, model: CausalLM, seed: int = 0) -> None:
        config = model.config
        self.device = model.device
        self.cache = PagedKVCache(
            config.num_layers,
            NUM_BLOCKS,
            BLOCK_SIZE,
            config.num_kv_heads,
            config.head_dim,
            dtype=model.dtype,
            device=self.device,
        )
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, model: CausalLM, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Run new tokens of several sequences in one flat forward; logits per sequence."""
        ids, positions, slots, tables, seq_lens, query_lens = [], [], [], [], [], []
        for seq, tokens in chunks.items():
            table, start = self.tables.setdefault(seq, []), self.lens.get(seq, 0)
            for pos in range(start, start + len(tokens)):
                if pos // BLOCK_SIZE == len(table):
                    table.append(self.free.pop())
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += tokens
            positions += range(start, start + len(tokens))
            self.lens[seq] = start + len(tokens)
            tables.append(list(table))
            seq_lens.append(self.lens[seq])
            query_lens.append(len(tokens))
        metadata = AttentionMetadata.build(tables, seq_lens, query_lens, slots, device=self.device)
        ids_t, positions_t = (torch.tensor(x, device=self.device) for x in (ids, positions))
        logits = model.compute_logits(model(ids_t, positions_t, self.cache, metadata)).cpu()
        return list(logits.split(query_lens))


def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of HF's own forward over the whole sequence."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


# (arch, config overrides): the four families, plus Qwen2 with a window on layer 1 only.
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request, tmp_path_factory):
    import transformers

    arch, overrides = VARIANTS[request.param]
    model_dir = make_hf_model(tmp_path_factory.mktemp("hf"), arch, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return load_model(model_dir), hf.eval()


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(length)]


@torch.inference_mode()
def test_prefill_then_decode_matches_hf(models):
    model, hf = models
    tokens = _prompt(21, seed=1)  # 5 blocks of 5, longer than mistral's window of 8
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
    a, b = _prompt(13, seed=2), _prompt(11, seed=3)
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
    assert model16.dtype == torch.bfloat16 and model16.rotary_emb.inv_freq.dtype == torch.float32
    tokens = _prompt(12, seed=4)
    (logits,) = PagedBatch(model16).step(model16, {0: tokens})
    assert logits.dtype == torch.float32
    # bf16 keeps ~3 significant digits; compare against float32 loosely.
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=0.05, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cuda_mixed_batch_matches_hf(models, tmp_path, dtype):
    _, hf = models
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=dtype, device="cuda")
    a, b = _prompt(30, seed=5), _prompt(9, seed=6)
    batch = PagedBatch(model, seed=2)
    tol = {"atol": 1e-3, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
    out_a, out_b = batch.step(model, {0: a, 1: b[:3]})
    torch.testing.assert_close(out_a, hf_logits(hf, a), **tol)
    a.append(int(out_a[-1].argmax()))
    out_a, out_b = batch.step(model, {0: a[-1:], 1: b[3:]})
    torch.testing.assert_close(out_a[-1], hf_logits(hf, a)[-1], **tol)
    torch.testing.assert_close(out_b, hf_logits(hf, b)[3:], **tol)
