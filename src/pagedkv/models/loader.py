"""Load Llama-family weights from safetensors, and write random checkpoints.

Only `safetensors` is needed at run time (no transformers). Every checkpoint tensor is
validated by name and shape against what the config implies before it is copied into the
(possibly fused) parameter it belongs to; whatever is missing or extra is reported by name.
Under tensor parallelism a rank reads only its part of each tensor (`parallel.shard_of`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedkv.cache.huge_pages import empty_on_huge_pages
from pagedkv.cache.kv_cache import DTYPES_BY_NAME
from pagedkv.config import ModelConfig
from pagedkv.gguf_file import GGUFFile, is_gguf_path, read_gguf
from pagedkv.models.checkpoint_layout import canonical_tensors, with_fused_names
from pagedkv.models.decoder import Attention
from pagedkv.models.gguf import block_weights, iter_gguf_tensors, rope_divisors
from pagedkv.models.gguf_tokenizer import load_gguf_tokenizer
from pagedkv.models.layers import RotaryEmbedding
from pagedkv.models.llama import CausalLM
from pagedkv.models.parallel import NO_PARALLEL, TensorParallel, shard_of
from pagedkv.models.quantized import (
    FUSED,
    TIED_HEAD,
    BlockPlan,
    BlockTensor,
    check_quantization,
    layer_of,
)
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.runtime.linear import Linear
from pagedkv.runtime.quant.weight import QuantWeight

# Buffers some checkpoints carry that are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig | None = None) -> torch.dtype:
    """Map "auto" (the config's dtype), a name such as "bfloat16", or a torch.dtype.

    Raises:
        ValueError: not float32, bfloat16 or float16.
    """
    name = str(dtype).removeprefix("torch.")  # a torch.dtype by its name
    if name == "auto":
        name = (config.dtype if config is not None else "float32").removeprefix("torch.")
    if name not in DTYPES_BY_NAME:
        raise ValueError(
            f"dtype: expected 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}"
        )
    return DTYPES_BY_NAME[name]


def resolve_device(device: torch.device | str) -> str:
    """The device's name, with `auto` as CUDA when available, else the CPU."""
    if str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF-layout checkpoint of `config` holds, with its shape.

    `lm_head.weight` is listed only for untied models.
    """
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            shapes[f"{p}self_attn.{name}.weight"] = (rows, h)
            if config.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (rows,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, q_size)
        if config.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (d,)
            shapes[f"{p}self_attn.k_norm.weight"] = (d,)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, inter)
        norms = ("input", "post_attention", "pre_feedforward", "post_feedforward")
        for norm in norms[: 4 if config.sandwich_norm else 2]:
            shapes[f"{p}{norm}_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _target(model: CausalLM, name: str) -> torch.Tensor:
    """The slice of `model`'s parameters that checkpoint tensor `name` fills."""
    module_path, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.q_proj, weight
    parent, _, proj = module_path.rpartition(".")
    if proj not in FUSED:
        return model.get_parameter(name)
    fused_name, part = FUSED[proj]
    fused = model.get_parameter(f"{parent}.{fused_name}.{leaf}")
    if fused_name == "qkv_proj":
        attn = cast(Attention, model.get_submodule(parent))
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
    else:
        sizes = [fused.shape[0] // 2] * 2
    start = sum(sizes[:part])
    return fused.data[start : start + sizes[part]]


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map', got {weight_map!r}")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir}: expected model.safetensors or "
            f"model.safetensors.index.json, found neither"
        )
    for path in files:
        if not path.is_file():
            raise ValueError(f"{model_dir}: the index names {path.name}, which is missing")
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice): a slice reads only the part it is indexed with."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if not name.endswith(_IGNORED_SUFFIXES):
                    yield name, f.get_slice(name)


def _read(source: Any, shard: tuple[int, range] | None) -> torch.Tensor:
    """All of `source`, or the part `shard` (dimension, range) names."""
    if shard is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    dim, rows = shard
    index = (slice(None),) * dim + (slice(rows.start, rows.stop),)
    return source[index]


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    tp: TensorParallel = NO_PARALLEL,
    quantization: str = "auto",
) -> CausalLM:
    """Build the model `model_dir/config.json` describes and load its safetensors weights,
    or the model of a `.gguf` file (needs the `gguf` package).

    Args:
        model_dir: a directory with config.json and model.safetensors (or a sharded
            checkpoint with model.safetensors.index.json), or a `.gguf` file.
        dtype: "auto" (the config's dtype, float32 if absent), "float32", "bfloat16",
            "float16" or a torch.dtype; weights are cast to it.
        device: where the parameters live ("auto": CUDA when available, else CPU).
        tp: load only rank `tp.rank`'s share of a model split over `tp.size` ranks.
        quantization: which projections stay in (or go into) GGML blocks on the CPU
            (`pagedkv.models.quantized`): "auto" (a GGUF file's formats), "none", "q8_0",
            "q4_0".

    Returns:
        The model (or this rank's share) in eval mode.

    Raises:
        ValueError: no or broken config.json, an unsupported architecture, no weight files,
            a missing, unexpected or misshapen weight (named, with expected/got shape), a
            model that does not split over `tp.size` ranks, an unknown `quantization`, or
            one that needs the CPU elsewhere.
    """
    model_dir = Path(model_dir)
    gguf_file = read_gguf(model_dir) if is_gguf_path(model_dir) else None
    if gguf_file is None and not model_dir.is_dir():
        raise ValueError(f"model dir: expected a directory or a .gguf file, got {str(model_dir)!r}")
    config = ModelConfig.from_hf(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    device = resolve_device(device)
    plan = _block_plan(check_quantization(quantization), gguf_file, config, device)
    if gguf_file is None:
        tensors = _iter_tensors(_checkpoint_files(model_dir))
    else:
        names = {n for n in checkpoint_shapes(config) if plan.takes(n, config)}
        tensors = iter_gguf_tensors(gguf_file, config, with_fused_names(names))
    tensors = canonical_tensors(tensors, config)
    # Parameters start on the meta device: no time spent on a random init that the
    # checkpoint overwrites, and no second copy of the weights in memory.
    with torch.device("meta"):
        model = CausalLM(config, dtype=torch_dtype, tp=tp)
        if TIED_HEAD in plan.layers:
            rows = tp.vocab_part(config.vocab_size)
            model.tied_head = Linear(config.hidden_size, rows, bias=False, dtype=torch_dtype)
    # The rotary buffers, no checkpoint tensors, are computed on the CPU even here: the huge
    # pages placement keeps them, `to_empty` leaves them uninitialized.
    rotary = {name: b.clone() for name, b in model.rotary_embs.named_buffers()}
    if torch.device(device).type == "cpu":
        _place_on_huge_pages(model, skip=plan.weight_names())
    else:
        model.to_empty(device=device)
        for name, buffer in model.rotary_embs.named_buffers():
            buffer.copy_(rotary[name])
    if tp.vocab_part(config.vocab_size) * tp.size != config.vocab_size:
        # The last rank's vocabulary rows past the real vocabulary: never looked up, and
        # their logits are cut off, but they must not hold NaN from uninitialized memory.
        model.model.embed_tokens.weight.data.zero_()
        if model.lm_head is not None:
            model.lm_head.weight.data.zero_()
    divisors = rope_divisors(gguf_file) if gguf_file is not None else None
    if divisors is not None:
        for embedding in model.rotary_embs.modules():
            if isinstance(embedding, RotaryEmbedding):
                embedding.inv_freq.div_(divisors.to(embedding.inv_freq.device))
    with torch.no_grad():
        for name, source in checked_tensors(tensors, config):
            tensor = _read(source, shard_of(name, config, tp))
            if plan.takes(name, config):
                plan.add(name, tensor, config, _rows(model, name, tensor))
                if layer_of(name, config) != (TIED_HEAD, 0):
                    continue
                tensor = _dense(tensor)  # the embedding table, beside the head's blocks
            # A vocabulary shard may be cut short (the last rank's padding rows).
            _target(model, name)[: tensor.shape[0]].copy_(tensor)
    plan.finish(model)
    return model.eval()


def _block_plan(
    quantization: str, gguf_file: GGUFFile | None, config: ModelConfig, device: str
) -> BlockPlan:
    """The layers held in blocks (`pagedkv.models.quantized`): only on the CPU."""
    if quantization == "none" or (quantization == "auto" and gguf_file is None):
        return BlockPlan({}, None)
    if torch.device(device).type != "cpu":
        if quantization == "auto":
            return BlockPlan({}, None)  # other devices multiply dequantized weights
        raise ValueError(
            f"quantization: expected 'auto' or 'none' on {device}, got {quantization!r}"
        )
    if quantization == "auto":
        assert gguf_file is not None, "auto quantization without a GGUF file"
        layers = block_weights(gguf_file, config)
        quantizer = None
    else:
        layers = {}
        for name in checkpoint_shapes(config):
            layer = layer_of(name, config)
            if layer is not None:
                layers[layer[0]] = layers.get(layer[0], 0) + 1
        quantizer = quantization
    if config.tie_word_embeddings:
        layers.pop("lm_head", None)  # a stored copy of the tied head is never read
    return BlockPlan(layers, quantizer)


def _rows(model: CausalLM, name: str, tensor: Any) -> int:
    """The rows of the layer part `name` fills: the tensor's, or a vocabulary shard's."""
    if name in ("lm_head.weight", "model.embed_tokens.weight"):
        return model.tp.vocab_part(model.config.vocab_size)
    return int(tensor.get_shape()[0] if isinstance(tensor, BlockTensor) else tensor.shape[0])


def _dense(tensor: Any) -> torch.Tensor:
    """A float tensor, or a `BlockTensor` dequantized (float32)."""
    if not isinstance(tensor, BlockTensor):
        return tensor
    rows = tensor.get_shape()[0]
    return QuantWeight([tensor.part(rows)], tensor.in_features).dequantize()


def _place_on_huge_pages(model: torch.nn.Module, skip: Collection[str] = ()) -> None:
    """Give every parameter and persistent buffer of `model` (on the meta device) but those
    named in `skip` (weights held in blocks) its place in one mapping on huge pages.

    A decode step reads every weight once, and with the products at the speed of memory
    the bfloat16 ones then stream faster (benchmarks.md). The views are assigned straight
    from the meta device: no storage is made and dropped, and no meta kernel runs
    (`to_empty` would initialize torch's meta-kernel machinery at every start).
    """
    tensors = {k: t for k, t in model.state_dict(keep_vars=True).items() if k not in skip}
    aligned = {name: -(-t.nbytes // 64) * 64 for name, t in tensors.items()}  # cache lines
    memory = empty_on_huge_pages(sum(aligned.values()))
    views, offset = {}, 0
    for name, t in tensors.items():
        views[name] = memory[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        offset += aligned[name]
    model.load_state_dict(views, assign=True, strict=not skip)


def checked_tensors(
    tensors: Iterable[tuple[str, Any]], config: ModelConfig
) -> Iterator[tuple[str, Any]]:
    """The (checkpoint name, tensor or lazy safetensors slice) pairs of `tensors`, each
    checked by name and shape against `checkpoint_shapes(config)`; a tied model's stored
    LM head is left out.

    Raises:
        ValueError: an unexpected or misshapen tensor (named, with expected/got shape), or,
            once `tensors` is exhausted, missing ones (the first five named).
    """
    expected = checkpoint_shapes(config)
    seen: set[str] = set()
    for name, source in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints still store the (identical) head
        shape = tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
        if name not in expected:
            raise ValueError(
                f"unexpected weight {name!r} (shape {shape}) for {config.architecture}"
            )
        if shape != expected[name]:
            raise ValueError(f"weight {name!r}: expected shape {expected[name]}, got {shape}")
        seen.add(name)
        yield name, source
    missing = [n for n in expected if n not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"missing weight(s) in checkpoint: {shown}")


def save_random_checkpoint(
    model_dir: str | Path, config: dict[str, Any], *, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write config.json and model.safetensors with random weights (no transformers needed)
    into `model_dir` (created if needed) and return it as a Path.

    Matrices are drawn with std 0.02 (HF's initializer range); norm weights are 1 and
    biases 0, so activations keep a sensible scale through many layers.

    Args:
        config: an HF-style config dict (`architectures` or `model_type`, sizes, ...).
        seed: seeds a private generator; the same seed gives the same weights.
        dtype: "float32", "bfloat16" or "float16"; recorded in config.json.

    Raises:
        ValueError: the config is invalid or unsupported, or the dtype unknown.
    """
    model_dir = Path(model_dir)
    torch_dtype = resolve_dtype(dtype)
    config = dict(config)
    model_config = ModelConfig.from_hf(config)
    if not config.get("architectures"):
        config["architectures"] = [model_config.architecture]
    config["dtype"] = str(torch_dtype).removeprefix("torch.")
    config.setdefault("model_type", model_config.model_type)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(model_config).items():
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        elif name.endswith(".bias"):
            value = torch.zeros(shape)
        else:
            value = torch.randn(shape, generator=generator) * 0.02
        tensors[name] = value.to(torch_dtype).contiguous()
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The model dir's tokenizer, or None when it has no tokenizer.json; for a `.gguf` file,
    the tokenizer in its metadata (None when it has none).

    Raises:
        ValueError: a tokenizer file exists but is broken.
        ImportError: a `.gguf` file, and transformers (its tokenizer converter) is missing.
    """
    if is_gguf_path(model_dir):
        return load_gguf_tokenizer(read_gguf(model_dir))
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(model_dir)
