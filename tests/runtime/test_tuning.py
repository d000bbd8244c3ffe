"""The CPU knobs (`runtime.tuning.CpuTuning`): defaults without a file, the file's values
where there is one, a clear error for a bad one; the engine takes them at start-up; the
compiled code takes them as arguments; `pagedkv tune` writes a file they load from."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import make_hf_model

from pagedkv import LLM
from pagedkv.cli import main
from pagedkv.cli.tune import FUSED_CANDIDATES, MATVEC_CANDIDATES, TILE_CANDIDATES, tile_rows
from pagedkv.runtime import matvec, tuning
from pagedkv.runtime.linear import can_pack
from pagedkv.runtime.products import linear_rows
from pagedkv.runtime.tuning import CpuTuning, tuning_path


def test_defaults_where_there_is_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    assert tuning_path() == tmp_path / "cpu-tuning.json"
    assert CpuTuning.load() == CpuTuning()


def test_the_file_s_values_and_defaults_for_the_rest(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"matvec_rows_float32": 3, "fused_decode_rows": 0}))
    assert CpuTuning.load(path) == CpuTuning(matvec_rows_float32=3, fused_decode_rows=0)
    values = CpuTuning(spin_ticks=7, prefetch_bytes=0)
    assert CpuTuning.load(values.save(path)) == values


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "expected a JSON object of CPU tuning"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"fused_decode_rows": -1}', r"fused_decode_rows: expected an int >= 0, got -1"),
        ('{"matvec_rows_bfloat16": "4"}', r"matvec_rows_bfloat16: expected an int >= 0, got '4'"),
        ('{"spin_ticks": 1.5}', r"spin_ticks: expected an int >= 0, got 1.5"),
    ],
)
def test_a_bad_file_is_an_error_naming_it_and_the_field(tmp_path, text, match):
    path = tmp_path / "tuning.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        CpuTuning.load(path)
    assert str(path) in str(info.value)


def test_an_unknown_field_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"fused_decode_rows": 5, "retired_knob": 1}))
    with pytest.warns(RuntimeWarning, match="ignoring unknown fields"):
        assert CpuTuning.load(path) == CpuTuning(fused_decode_rows=5)


def test_the_engine_runs_with_the_machine_s_tuning(tmp_path, monkeypatch):
    path = CpuTuning(matvec_rows_float32=3, fused_decode_rows=2).save(tmp_path / "tuning.json")
    monkeypatch.setattr(tuning, "tuning_path", lambda: path)  # the kernels' cache stays
    llm = LLM(str(make_hf_model(tmp_path, "llama")), dtype="float32", device="cpu", num_blocks=32)
    model = llm.engine.runner.model
    assert model.executor.max_rows == 2
    assert model.model.layers[0].mlp.down_proj.few_rows == 3
    llm.close()


def test_the_kernels_take_the_knobs_as_arguments():
    """Another prefetch distance is an argument value, not new machine code: the same
    compiled variant, the same bits."""
    weight, x = torch.randn(64, 96), torch.randn(2, 96)
    outputs = [linear_rows(weight, None, CpuTuning(prefetch_bytes=n))(x) for n in (0, 4096)]
    variants = len(matvec.matvec.signatures)
    outputs.append(linear_rows(weight, None, CpuTuning(prefetch_bytes=512))(x))
    assert len(matvec.matvec.signatures) == variants
    assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_tune_writes_a_file_the_engine_reads(tmp_path, capsys):
    path = tmp_path / "tuning.json"
    assert main(["tune", "--repeats", "1", "--output", str(path)]) == 0
    measured = CpuTuning.load(path)
    assert measured.matvec_rows_float32 in (0, *MATVEC_CANDIDATES)
    assert measured.fused_decode_rows in (0, *FUSED_CANDIDATES)
    if can_pack(torch.bfloat16, torch.device("cpu")):
        tiles, few = measured.tile_rows_bfloat16, measured.matvec_rows_bfloat16
        assert tiles in (0, *TILE_CANDIDATES) and (tiles == 0 or tiles > few)
    else:
        assert measured.tile_rows_bfloat16 == CpuTuning().tile_rows_bfloat16
    untouched = {"parallel_work", "prefetch_bytes", "spin_ticks", "long_wait_ticks"}
    for name in untouched:
        assert getattr(measured, name) == getattr(CpuTuning(), name)
    out = capsys.readouterr().out
    assert str(path) in out
    assert all(spec.name in out for spec in dataclasses.fields(measured))


def test_no_tiled_rows_where_the_matrix_vector_kernel_takes_none():
    assert tile_rows(CpuTuning(matvec_rows_bfloat16=0), repeats=1) == 0


def test_tune_refuses_a_bad_repeat_count(capsys):
    assert main(["tune", "--repeats", "0"]) == 2
    assert "--repeats: expected an int >= 1, got 0" in capsys.readouterr().err
