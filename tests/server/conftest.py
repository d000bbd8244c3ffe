"""Fixtures: a tiny random Llama with a trained tokenizer, and a live server on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import make_hf_model, make_tokenizer
from live_server import LiveServer, start_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = make_hf_model(tmp_path_factory.mktemp("server-model"), "llama")
    make_tokenizer(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """128 blocks of 4 tokens (512-token pool) under a 1024-token context."""
    with start_server(tiny_model_dir, max_num_seqs=32, max_waiting_requests=256) as live:
        yield live
