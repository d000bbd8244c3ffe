"""`benchmarks/bench_drift.py`: its drift figures, and a whole run on a quantized file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import make_hf_model, make_tokenizer
from helpers.gguf_models import write_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_drift  # noqa: E402


def test_drift_counts_top_changes_and_the_chosen_tokens_change():
    sequences = [[5, 6, 7], [5, 8, 9]]
    expected = [[{}, {6: -0.1, 1: -3.0}, {7: -0.2, 2: -2.0}],
                [{}, {8: -0.5, 3: -1.0}, {9: -0.4, 4: -1.5}]]  # fmt: skip
    got = [[{}, {6: -0.3, 1: -2.0}, {7: -0.2, 2: -2.5}],
           [{}, {8: -1.5, 3: -0.2}, {9: -0.4, 4: -1.5}]]  # fmt: skip
    found = bench_drift.drift(sequences, expected, got, new_tokens=2)
    assert found["positions"] == 4
    assert found["top_changes"] == 1  # the second sequence's first position: 3 over 8
    assert found["mean_abs_delta"] == pytest.approx((0.2 + 0.0 + 1.0 + 0.0) / 4)
    assert found["max_abs_delta"] == pytest.approx(1.0)
    got[0][2] = {2: -0.1}
    with pytest.raises(ValueError, match="expected token 7 at position 2"):
        bench_drift.drift(sequences, expected, got, new_tokens=2)


def test_a_q8_0_file_drifts_little_on_both_paths(tmp_path):
    hf_dir = make_hf_model(tmp_path / "hf", "llama")
    make_tokenizer(hf_dir)
    gguf = tmp_path / "model.gguf"
    write_gguf(hf_dir, gguf, "Q8_0", tokenizer_dir=hf_dir)
    out = tmp_path / "drift.json"
    bench_drift.main(["--model", str(gguf), "--new-tokens", "4", "--output", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [row["weights"] for row in rows] == ["file, few rows", "file, tiles"]
    for row in rows:
        assert row["positions"] == 4 * len(bench_drift.PROMPTS)
        assert row["top_changes"] <= 1 and row["mean_abs_delta"] < 0.01, row
