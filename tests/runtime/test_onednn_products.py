"""Products through oneDNN (`runtime.linear.Linear`): bfloat16 weights give torch's logits
bit for bit, float32 ones the same logits up to rounding, both the same tokens; the loaded
weights stay in place, each held once whichever kernels read it, and no module gains an
attribute."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from pagedkv.runtime.linear import Linear, can_pack

needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bfloat16 on this CPU"
)
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12], [8, 9], list(range(20, 60))]


def _layer(bias: bool, seed: int = 0) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(96, 80, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=generator))
        if bias:
            layer.bias.copy_(torch.randn(80, generator=generator))
    return layer


@needs_bf16
def test_a_biased_bfloat16_linear_stays_with_torch():
    layer = _layer(bias=True)
    layer.use_products(0, onednn=True)
    assert not layer.onednn


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 64, 512])
def test_onednn_linear_gives_torchs_bits_on_the_weight_in_place(rows):
    layer = _layer(bias=False, seed=rows)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.weight)
    plain = layer.weight.detach()
    layer.use_products(0, onednn=True)
    assert layer.onednn and layer.weight.data_ptr() == plain.data_ptr()
    assert _held_bytes(layer) == plain.nbytes
    assert torch.equal(layer.forward(x), expected)


def _attribute_names(module: torch.nn.Module) -> set[str]:
    return {*vars(module), *module._parameters, *module._buffers, *module._modules}


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct buffers behind every tensor a module holds: its parameters,
    buffers and tensor attributes (a oneDNN-packed tensor would have a buffer of its own)."""
    buffers: dict[object, int] = {}
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_mkldnn:
                buffers[id(t)] = torch.ops.mkldnn._nbytes(t)
            else:
                buffers[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(buffers.values())


def _storages(model: torch.nn.Module) -> dict[str, tuple[int, bool]]:
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: (0 if t.is_mkldnn else t.data_ptr(), t.is_mkldnn) for name, t in tensors.items()}


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied LM head; tied, with q/k/v bias
def test_the_runtime_reads_the_loaded_weights_in_place_and_tags_no_module(tmp_path, arch, dtype):
    """With every CPU product on, the kernels and oneDNN read the loaded tensors in place
    (none is copied, none packed); every module keeps the attributes it was built with."""
    model = load_model(make_hf_model(tmp_path, arch), dtype=dtype, device="cpu")
    names = {name: _attribute_names(m) for name, m in model.named_modules()}
    weights = _storages(model)
    assert model.use_cpu_runtime(matvec=True, fused_decode=True, onednn=True)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    after = {name: _attribute_names(m) for name, m in model.named_modules()}
    assert after == {**names, **({"tied_head": after["tied_head"]} if arch == "qwen2" else {})}
    assert _storages(model) == weights
    assert any(isinstance(m, Linear) and m.onednn for m in model.modules())
    if arch == "qwen2":  # the tied head is the embedding table itself
        assert model.tied_head.weight is model.model.embed_tokens.weight


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied LM head; tied, with q/k/v bias
@pytest.mark.parametrize("matvec, fused", [(True, True), (True, False), (False, False)])
def test_every_weight_is_held_once(tmp_path, arch, dtype, matvec, fused):
    """Whichever kernels read the weights, the model holds the bytes it loaded, no more."""
    model = load_model(make_hf_model(tmp_path, arch), dtype=dtype, device="cpu")
    loaded = _held_bytes(model)
    model.use_cpu_runtime(matvec=matvec, fused_decode=fused, onednn=True)
    assert _held_bytes(model) == loaded
    assert any(isinstance(m, Linear) and m.onednn for m in model.modules())


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_weights_stay_in_place_and_the_logits_move_only_by_rounding(tmp_path, arch):
    model_dir = make_hf_model(tmp_path, arch)
    plain = load_model(model_dir, dtype=torch.float32, device="cpu")
    marked = load_model(model_dir, dtype=torch.float32, device="cpu")
    weights = _storages(marked)
    marked.use_cpu_runtime(matvec=False, fused_decode=False, onednn=True)
    assert _storages(marked) == weights  # no copy: every weight is the tensor it was, plain
    layer = marked.model.layers[0].mlp.down_proj
    assert layer.onednn
    x = torch.randn(7, layer.in_features)
    torch.testing.assert_close(layer.forward(x), torch.nn.functional.linear(x, layer.weight))
    hidden = torch.randn(5, plain.config.hidden_size)
    torch.testing.assert_close(marked.compute_logits(hidden), plain.compute_logits(hidden))


@needs_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied LM head; tied, with q/k/v bias
def test_onednn_keeps_the_bfloat16_logits(tmp_path, arch):
    model_dir = make_hf_model(tmp_path, arch, dtype=torch.bfloat16)
    plain = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    onednn = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    onednn.use_cpu_runtime(matvec=False, fused_decode=False, onednn=True)
    assert onednn.model.layers[0].mlp.down_proj.onednn
    hidden = torch.randn(5, plain.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(onednn.compute_logits(hidden), plain.compute_logits(hidden))


@pytest.mark.parametrize(
    "dtype",
    [pytest.param("bfloat16", marks=needs_bf16), pytest.param("float32", marks=needs_onednn)],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_tokens_match_the_plain_path(tmp_path, arch, dtype):
    model_dir = make_hf_model(tmp_path, arch, dtype=getattr(torch, dtype))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = {}
    for pack in (False, True):
        llm = LLM(str(model_dir), dtype=dtype, device="cpu", num_blocks=64, block_size=8,
                  pack_weights=pack, cpu_matvec=False, cpu_fused_decode=False)  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[pack] = [o.outputs[0].token_ids for o in outputs]
    assert tokens[True] == tokens[False]
