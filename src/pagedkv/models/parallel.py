"""Tensor parallelism inside the model: which share of the heads, the MLP and the vocabulary a
rank holds, and the two collectives that put the ranks' partial results back together.

Megatron's split, as vLLM and SGLang use it. Per layer, one all-reduce after each of the two
row-parallel matmuls; per step, one all-gather of the logits::

    hidden ──► qkv_proj (columns: this rank's q and kv heads) ──► attention over this rank's
               heads of the paged KV pool ──► o_proj (rows) ──► all_reduce ──► + residual
           ──► gate_up_proj (columns) ──► SiLU * up ──► down_proj (rows) ──► all_reduce
    embed_tokens: this rank's vocabulary rows, zeros elsewhere ──► all_reduce
    lm_head: logits of this rank's vocabulary rows ──► all_gather ──► [n, vocab_size]

Rank r of `size` holds query heads [r * H/size, (r+1) * H/size) and the KV heads they read:
its own H_kv/size when size divides H_kv, else one KV head replicated size/H_kv times.

A rank loads only its part of each checkpoint tensor (`shard_of`; safetensors slices are read
lazily), so no process ever holds the whole model. Column-parallel weights are split along
their output rows, row-parallel ones along their input columns, the vocabulary along its
rows; norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pagedkv.config import ModelConfig


def check_split(config: ModelConfig, size: int) -> None:
    """Raise unless `config` splits evenly over `size` ranks.

    Raises:
        ValueError: `size` does not divide the attention heads or the MLP width, or it and
            the KV heads do not divide one another (named as `tensor_parallel_size`).
    """
    config.kv_heads_per_rank(size)
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size: expected a divisor of the MLP width "
            f"{config.intermediate_size}, got {size}"
        )


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group.

    Attributes:
        rank: 0 <= rank < size; rank 0 also runs the scheduler and samples.
        size: ranks in the group (1: no parallelism, no collectives).
        group: the torch.distributed process group of the device collectives (gloo on the
            CPU, NCCL on CUDA); None when size is 1.
        cpu_group: a gloo group over the same ranks for Python objects (the step); the
            same group as `group` on the CPU.
        store: the group's rendezvous store (hosted by rank 0, or by torchrun's agent),
            where ranks > 0 record that they left the group; None when size is 1.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    cpu_group: Any = None
    store: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"tensor parallel: expected 0 <= rank < size, got {self.rank}/{self.size}"
            )
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor parallel: size {self.size} needs a process group, got None")

    def heads(self, num_heads: int) -> range:
        """The query heads of this rank."""
        return self.rows(num_heads)

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> range:
        """The KV heads this rank's query heads read (replicated when fewer than `size`)."""
        if num_kv_heads >= self.size:
            return self.rows(num_kv_heads)
        first_query_head = self.heads(num_heads).start
        group_size = num_heads // num_kv_heads
        kv_head = first_query_head // group_size
        return range(kv_head, kv_head + 1)

    def rows(self, total: int) -> range:
        """An even split of `total` (a multiple of `size`): this rank's part."""
        part = total // self.size
        return range(self.rank * part, (self.rank + 1) * part)

    def vocab_rows(self, vocab_size: int) -> range:
        """This rank's vocabulary rows: `vocab_part(vocab_size)` each, the last rank's cut
        short when `size` does not divide the vocabulary (its padding rows stay zero)."""
        part = self.vocab_part(vocab_size)
        start = min(self.rank * part, vocab_size)
        return range(start, min(start + part, vocab_size))

    def vocab_part(self, vocab_size: int) -> int:
        """Rows of every rank's embedding and LM head shard: ceil(vocab_size / size)."""
        return -(-vocab_size // self.size)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over the ranks in place; returns `x` (unchanged with one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_object(self, value: Any = None) -> Any:
        """Rank 0's `value` (pickled) on every rank; `value` itself with one rank."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank got here (no-op with one rank)."""
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def gather_columns(self, x: Tensor) -> Tensor:
        """[n, part] on each rank -> [n, size * part], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


NO_PARALLEL = TensorParallel()


# Checkpoint projection -> (dimension split, what is split).
_SPLITS = {
    "q_proj": (0, "heads"),
    "k_proj": (0, "kv_heads"),
    "v_proj": (0, "kv_heads"),
    "o_proj": (1, "heads"),
    "gate_proj": (0, "mlp"),
    "up_proj": (0, "mlp"),
    "down_proj": (1, "mlp"),
    "embed_tokens": (0, "vocab"),
    "lm_head": (0, "vocab"),
}


def shard_of(name: str, config: ModelConfig, tp: TensorParallel) -> tuple[int, range] | None:
    """The (dimension, index range) of checkpoint tensor `name` (an HF checkpoint name such
    as `model.layers.3.self_attn.k_proj.weight`) that rank `tp.rank` holds; `config` is the
    whole model's.

    Returns:
        None when the rank holds the whole tensor (no parallelism, norms), else the
        dimension to cut and the range of it to read. A vocabulary range may be shorter
        than the rank's rows (the last rank's padding).
    """
    if tp.size == 1:
        return None
    module = name.rsplit(".", 2)[-2]  # ...self_attn.k_proj.weight -> k_proj
    split = _SPLITS.get(module)
    if split is None:
        return None
    dim, what = split
    if what == "mlp":
        return dim, tp.rows(config.intermediate_size)
    if what == "vocab":
        return dim, tp.vocab_rows(config.vocab_size)
    if what == "heads":
        heads = tp.heads(config.num_heads)
    else:
        heads = tp.kv_heads(config.num_heads, config.num_kv_heads)
    return dim, range(heads.start * config.head_dim, heads.stop * config.head_dim)
