"""The matrix-vector kernel for a few rows: torch's products to rounding, the same bits on one
thread or on all, the same tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import make_hf_model
from numba.core import codegen

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from pagedkv.ops import cpu
from pagedkv.runtime import products
from pagedkv.runtime.linear import Linear, can_pack
from pagedkv.runtime.products import linear_rows
from pagedkv.runtime.tuning import CpuTuning

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12], [8, 9], list(range(20, 60))]


@pytest.mark.parametrize("rows", [1, 2, 4, 7])  # 7: a block of four rows and three more
@pytest.mark.parametrize("shape", [(80, 96), (7, 33), (1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_matches_torch_float32(rows, shape, bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=generator)
    x = torch.randn(rows, shape[1], generator=generator)
    b = torch.randn(shape[0], generator=generator) if bias else None
    out = linear_rows(weight, b)(x)
    assert out.dtype == torch.float32 and out.shape == (rows, shape[0])
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 6, 9])
@pytest.mark.parametrize("shape", [(64, 200), (65, 256), (33, 75)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_bfloat16_is_the_float32_sum_rounded_once(rows, shape, bias):
    """Products of bfloat16 values are exact in float32; the sum (bias included) is rounded
    once at the end, so the result is within half a bfloat16 step of the float64 value.
    Row sizes with and without a tail past the last 32 elements (`bf16.dot32`'s groups)."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, shape[1], generator=generator).to(torch.bfloat16)
    b = torch.randn(shape[0], generator=generator).to(torch.bfloat16) if bias else None
    out = linear_rows(weight, b)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    step = exact.abs().clamp_min(1e-30) * 2.0**-8
    assert ((out.double() - exact).abs() <= step * 1.01 + 1e-5).all()


def test_linear_rows_refuses_inputs_of_another_dtype():
    product = linear_rows(torch.zeros(4, 8, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="x: expected the weight's dtype torch.bfloat16"):
        product(torch.zeros(1, 8))


def test_linear_rows_bfloat16_without_a_dot_product_instruction():
    """A CPU without AVX512-BF16 widens each element by itself: the same test, compiled for
    this CPU with the feature off (a process of its own: Numba reads the setting at start)."""
    features = codegen.get_host_cpu_features().replace("+avx512bf16", "-avx512bf16")
    here = Path(__file__).parent
    # this module, `helpers`, and the package where it is taken from a path
    paths = (here, here.parent, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    path = os.pathsep.join(str(p) for p in paths)
    env = {**os.environ, "NUMBA_CPU_FEATURES": features, "PYTHONPATH": path}
    code = (
        "from pagedkv.ops.cpu import bf16; assert not bf16.HAS_DOT\n"
        "import test_matvec as t\n"
        "for rows, shape in ((1, (64, 200)), (6, (65, 256))):\n"
        "    t.test_linear_rows_bfloat16_is_the_float32_sum_rounded_once(rows, shape, True)\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [1, 2, 7, 96])
def test_linear_rows_on_every_thread_gives_the_same_bits(dtype, out_features):
    """The parallel kernel cuts the weight's rows into one share per thread (shares of
    unequal size and empty ones included) and computes each output as the serial one."""
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 200, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype)
    x = torch.randn(5, 200, generator=generator).to(dtype)
    serial = linear_rows(weight, b, parallel=False)(x)
    assert torch.equal(linear_rows(weight, b, parallel=True)(x), serial)


def test_linear_rows_is_parallel_where_the_workers_spin_or_the_product_is_large(monkeypatch):
    calls = []
    monkeypatch.setattr(products, "sync_threads", lambda: 2)
    monkeypatch.setattr(products, "matvec", SimpleNamespace(
        matvec=lambda *args: calls.append("serial"),
        matvec_parallel=lambda *args: calls.append(f"parallel {args[-2]}"),  # parts, prefetch
    ))  # fmt: skip
    weight, x = torch.zeros(4, 8), torch.zeros(1, 8)
    for policy in ("PASSIVE", "active"):
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        linear_rows(weight, None)(x)
    # Sleeping workers: split from `parallel_work` multiply-adds (rows x weight elements) on.
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    product = linear_rows(weight, None, CpuTuning(parallel_work=2 * weight.numel()))
    product(x)
    product(torch.zeros(2, 8))
    monkeypatch.setattr(products, "sync_threads", lambda: 1)
    linear_rows(weight, None)(x)  # one thread: nothing to split
    assert calls == ["serial", "parallel 2", "serial", "parallel 2", "serial"]


def test_a_layer_uses_the_kernel_up_to_its_rows_only(monkeypatch):
    layer = Linear(24, 10)
    calls = []

    def kernel(weight, bias, tuning):
        def product(x):
            calls.append(x.shape[0])
            return F.linear(x, weight, bias)

        return product

    monkeypatch.setattr(products, "linear_rows", kernel)
    limit = CpuTuning().matvec_rows("float32")
    layer.use_products(limit, onednn=False)
    for rows in (1, limit, limit + 1):
        layer.forward(torch.randn(rows, 24))
    assert calls == [1, limit]


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bfloat16")
def test_the_kernel_and_onednn_read_the_same_plain_weight(tmp_path):
    model_dir = make_hf_model(tmp_path, "llama", dtype=torch.bfloat16)
    plain = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    both = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    both.use_cpu_runtime(matvec=True, fused_decode=False, onednn=True)
    layer, reference = both.model.layers[0].mlp.gate_up_proj, plain.model.layers[0].mlp.gate_up_proj
    assert layer.onednn and not layer.weight.is_mkldnn
    limit = CpuTuning().matvec_rows("bfloat16")
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, plain.config.hidden_size).to(torch.bfloat16)
        expected = (
            linear_rows(reference.weight, None)(x)
            if rows <= limit
            else F.linear(x, reference.weight)  # oneDNN's product gives the same bits
        )
        assert torch.equal(layer.forward(x), expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied LM head; tied, with q/k/v bias
def test_engine_tokens_match_torch_matmuls_float32(tmp_path, arch, monkeypatch):
    model_dir = make_hf_model(tmp_path, arch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [*p, i]} for p in PROMPTS for i in range(3)]
    for module in (cpu, products):  # a share per thread even on one
        monkeypatch.setattr(module, "sync_threads", lambda: 2)
    tokens = {}
    # torch's matmuls; the kernel on one thread; on every thread (the workers' policy is read
    # when a model takes the kernel; the runtime keeps the one it loaded with).
    for matvec, policy in ((False, "PASSIVE"), (True, "PASSIVE"), (True, "ACTIVE")):
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        llm = LLM(str(model_dir), dtype="float32", device="cpu", num_blocks=64, block_size=8,
                  cpu_matvec=matvec)  # fmt: skip
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert (layer.matvec is not None) == matvec
        # One at a time (the kernel's rows) and all nine together (torch's: past the limit).
        single = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        together = llm.generate(prompts, params, use_tqdm=False)
        tokens[matvec, policy] = [o.outputs[0].token_ids for o in single + together]
    assert tokens[True, "PASSIVE"] == tokens[False, "PASSIVE"] == tokens[True, "ACTIVE"]


def test_engine_logits_match_torch_matmuls_bfloat16(tmp_path):
    """bfloat16 sums in another order round differently now and then: the logits agree to
    bfloat16 precision, not bit for bit (tokens may differ where two logits nearly tie)."""
    model_dir = make_hf_model(tmp_path, "llama", dtype=torch.bfloat16)
    plain = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    fast = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    fast.use_cpu_runtime(matvec=True, fused_decode=False, onednn=False)
    hidden = torch.randn(2, plain.config.hidden_size).to(torch.bfloat16)
    torch.testing.assert_close(fast.compute_logits(hidden), plain.compute_logits(hidden),
                               rtol=2e-2, atol=2e-2)  # fmt: skip
