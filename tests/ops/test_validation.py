"""Bad arguments raise ValueError naming the argument, in the "expected X, got Y" form."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_case

from pagedkv.ops import AttentionMetadata, available_backends, paged_attention, write_kv


@pytest.fixture
def case():
    return make_case([5, 20], [1, 20], block_size=8, num_heads=4, num_kv_heads=2, head_dim=16)


def _call(case, **override):
    args = dict(
        query=case.query,
        key_cache=case.key_cache,
        value_cache=case.value_cache,
        block_tables=case.block_tables,
        seq_lens=case.seq_lens,
        query_start_loc=case.query_start_loc,
    )
    kwargs = {k: override.pop(k) for k in ("scale", "sliding_window", "backend") if k in override}
    args.update(override)
    return paged_attention(*args.values(), **kwargs)


BAD_ATTENTION = [
    ("query", lambda c: dict(query=c.query[0]), "3 dims"),
    ("query", lambda c: dict(query=c.query.double()), "dtype torch.float32"),
    ("query", lambda c: dict(query=c.query[:, :3]), "multiple of num_kv_heads=2"),
    ("query", lambda c: dict(query=c.query[..., :8]), "head_dim 16"),
    ("key_cache", lambda c: dict(key_cache=c.key_cache[0]), "4 dims"),
    ("key_cache", lambda c: dict(key_cache=c.key_cache.int()), "float32, bfloat16"),
    ("value_cache", lambda c: dict(value_cache=c.value_cache[:, :4]), "shape"),
    ("block_tables", lambda c: dict(block_tables=c.block_tables.long()), "torch.int32"),
    ("block_tables", lambda c: dict(block_tables=c.block_tables[:1]), "shape [2, *]"),
    ("seq_lens", lambda c: dict(seq_lens=c.seq_lens.float()), "torch.int32"),
    ("query_start_loc", lambda c: dict(query_start_loc=c.query_start_loc[:2]), "shape [3]"),
    ("query_start_loc", lambda c: dict(query_start_loc=c.query_start_loc - 1), "from 0"),
    (
        "seq_lens",
        lambda c: dict(query_start_loc=torch.tensor([0, 6, 21], dtype=torch.int32)),
        "query_len=6 <= seq_lens[0]",
    ),
    (
        "seq_lens",
        lambda c: dict(seq_lens=torch.tensor([5, 900], dtype=torch.int32)),
        "max_blocks*block_size",
    ),
    (
        "block_tables",
        lambda c: dict(block_tables=torch.full_like(c.block_tables, -1)),
        "block ids in [0,",
    ),
    ("sliding_window", lambda c: dict(sliding_window=0), "positive int"),
    ("scale", lambda c: dict(scale=float("nan")), "finite float"),
    ("backend", lambda c: dict(backend="cuda-magic"), "one of"),
]


@pytest.mark.parametrize("name,make,message", BAD_ATTENTION, ids=[b[2] for b in BAD_ATTENTION])
def test_paged_attention_rejects(case, name: str, make, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}: expected") as err:
        _call(case, **make(case))
    assert message in str(err.value)


BAD_WRITE = [
    ("key", lambda k, v, s: dict(key=k[:, :1]), "shape [num_tokens, 2, 16]"),
    ("value", lambda k, v, s: dict(value=v.double()), "dtype torch.float32"),
    ("value", lambda k, v, s: dict(value=v[:2]), "3 tokens"),
    ("slot_mapping", lambda k, v, s: dict(slot_mapping=s.float()), "torch.int32 or torch.int64"),
    ("slot_mapping", lambda k, v, s: dict(slot_mapping=s[:2]), "shape [3]"),
]


@pytest.mark.parametrize("name,make,message", BAD_WRITE, ids=[b[2] for b in BAD_WRITE])
def test_write_kv_rejects(case, name: str, make, message: str) -> None:
    key = torch.zeros(3, 2, 16)
    args = dict(
        key=key,
        value=key.clone(),
        key_cache=case.key_cache,
        value_cache=case.value_cache,
        slot_mapping=torch.arange(3),
    )
    args.update(make(args["key"], args["value"], args["slot_mapping"]))
    with pytest.raises(ValueError, match=rf"^{name}: expected") as err:
        write_kv(*args.values())
    assert message in str(err.value)


def test_metadata_build_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="^slot_mapping: expected sum"):
        AttentionMetadata.build([[0]], [3], [2], [0, 1, 2])
    with pytest.raises(ValueError, match="^query_lens\\[0\\]: expected"):
        AttentionMetadata.build([[0]], [3], [4], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="^block_tables/query_lens: expected 2"):
        AttentionMetadata.build([[0]], [3, 1], [1, 1], [0, 1])


def test_available_backends_lists_the_cpu_ones() -> None:
    names = available_backends()
    assert {"reference", "cpu"} <= set(names)
