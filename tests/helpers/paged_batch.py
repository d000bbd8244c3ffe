"""A paged batch for model tests: sequences' block tables drawn from a shuffled pool, each
step's inputs built as the runner builds them; the model variants the tests run."""

from __future__ import annotations

import random

import torch

from pagedkv.cache import PagedKVCache
from pagedkv.models import CausalLM
from pagedkv.ops import AttentionMetadata

BLOCK_SIZE = 5  # not a power of two: block boundaries fall mid-prompt
NUM_BLOCKS = 48  # room for a step of more rows than the compiled decoder stack takes


class PagedBatch:
    """Sequences' block tables drawn from a shuffled pool; builds each step's inputs."""

    def __init__(
        self, model: CausalLM, seed: int = 0, cache_dtype: torch.dtype | None = None
    ) -> None:
        """`cache_dtype`: the cache's (torch.int8: quantized); default the model's."""
        config = model.config
        self.device = model.device
        self.cache = PagedKVCache(
            config.num_layers,
            NUM_BLOCKS,
            BLOCK_SIZE,
            config.num_kv_heads,
            config.head_dim,
            dtype=cache_dtype or model.dtype,
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
        logits = model(ids_t, positions_t, self.cache, metadata).logits.cpu()
        return list(logits.split(query_lens))


# (arch, config overrides): the families, plus Qwen2 with a window on layer 1 only.
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "gemma3": ("gemma3", {}),
    "phi3": ("phi3", {}),
    "phi4": ("phi4", {}),
    "smollm3": ("smollm3", {}),
}


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(length)]
