"""Fixtures of the runtime's tests."""

from __future__ import annotations

import pytest

from pagedkv.models import fused_executor


@pytest.fixture
def count_fused(monkeypatch):
    """The rows of each step that the compiled decoder stack ran, in order."""
    calls = []
    run = fused_executor.decode_layers

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return run(*args, **kwargs)

    monkeypatch.setattr(fused_executor, "decode_layers", counted)
    return calls
