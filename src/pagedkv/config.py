"""Frozen configuration dataclasses, one per layer, composed into `EngineConfig`.

Standard library only: the planner and simulator import this without torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from pagedkv.families import HIDDEN_ACTS, family_options, is_gemma3, layer_types, rope_options
from pagedkv.gguf_file import hf_config_from_gguf, is_gguf_path, read_gguf

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

DTYPE_BYTES = {
    **dict.fromkeys(("float32", "fp32"), 4),
    **dict.fromkeys(("bfloat16", "bf16", "float16", "fp16", "half"), 2),
    **dict.fromkeys(("float8", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"), 1),
}

# "k" and "kb" are powers of 1000, "kib" of 1024 (likewise m, g, t).
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{prefix + b: 1000**n for n, prefix in enumerate("kmgt", 1) for b in ("", "b")},
    **{prefix + "ib": 1024**n for n, prefix in enumerate("kmgt", 1)},
}


def parse_size(value: int | float | str) -> int:
    """Parse a byte count: ``4096``, ``"4GiB"``, ``"1.5 GB"``, ``"512MiB"``.

    Raises:
        ValueError: the value is negative or not a size.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"expected a non-negative size in bytes, got {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 4096, '4GiB' or '1.5GB', got {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_count(value: int | str) -> int:
    """Parse a token count such as ``131072``, ``"128k"`` (x1024) or ``"1m"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    else:
        match = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", str(value))
        if match is None:
            raise ValueError(f"expected a token count such as 4096 or '128k', got {value!r}")
        count = int(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
    if count <= 0:
        raise ValueError(f"expected a positive token count, got {value!r}")
    return count


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family model's shape, normalized once from its Hugging Face `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # One entry per layer: the sliding window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    # The family's layer options (`pagedkv.models.families` sets them from config.json).
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): 1 for Gemma
    sandwich_norm: bool = False  # norms after attention and MLP too (Gemma's four per layer)
    hidden_act: str = "silu"  # the MLP gate: "silu" or "gelu_tanh"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    embedding_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    final_logit_softcapping: float | None = None
    partial_rotary_factor: float = 1.0  # share of each head's dimensions that is rotated
    rope_local_theta: float | None = None  # base of sliding layers' plain rotary (Gemma)
    # One entry per layer: whether it rotates q and k (SmolLM3's layers without position).
    rope_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: expected {name} > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config: expected num_attention_heads ({self.num_heads}) to be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("sliding_windows", "rope_layers"):
            values = getattr(self, name)
            if values and len(values) != self.num_layers:
                raise ValueError(
                    f"config: expected {self.num_layers} entries of {name}, got {len(values)}"
                )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"config: expected hidden_act in {sorted(HIDDEN_ACTS)}, got {self.hidden_act!r}"
            )
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"config: expected partial_rotary_factor in (0, 1], "
                f"got {self.partial_rotary_factor}"
            )

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each q and k head that are rotated (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | Path) -> ModelConfig:
        """Build from a `config.json` dict, file or model directory, or a `.gguf` file.

        Raises:
            ValueError: unsupported architecture, or a missing or broken field.
        """
        if not isinstance(config, dict):
            path = Path(config)
            if is_gguf_path(path):
                return _model_config_from_dict(hf_config_from_gguf(read_gguf(path)))
            if path.is_dir():
                path = path / "config.json"
            try:
                config = cast("dict[str, Any]", json.loads(path.read_text()))
            except FileNotFoundError:
                raise ValueError(f"no config.json at {path}") from None
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not valid JSON: {exc}") from None
        return _model_config_from_dict(config)

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def num_parameters(self) -> int:
        """Parameters in the checkpoint (embeddings and the LM head counted once if tied)."""
        h, kv_dim = self.hidden_size, self.num_kv_heads * self.head_dim
        q_dim = self.num_heads * self.head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.attention_bias:
            attention += q_dim + 2 * kv_dim
        norms = (4 if self.sandwich_norm else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attention + 3 * h * self.intermediate_size + norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def kv_heads_per_rank(self, tp: int, name: str = "tensor_parallel_size") -> int:
        """KV heads each of `tp` tensor-parallel ranks holds.

        The query heads are split evenly. With tp <= num_kv_heads the KV heads are split
        too; with more ranks than KV heads each rank still needs the one KV head its query
        heads read, so every KV head is replicated tp / num_kv_heads times. `name` is the
        option errors name (`tp` for the planner).

        Raises:
            ValueError: tp < 1, tp does not divide the query heads, or tp and the KV heads
                do not divide one another.
        """
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {tp!r}")
        if self.num_heads % tp:
            raise ValueError(
                f"{name}: expected a divisor of the {self.num_heads} attention heads, got {tp}"
            )
        kv = self.num_kv_heads
        if kv % tp and tp % kv:
            raise ValueError(
                f"{name}: expected a divisor or multiple of the {kv} KV heads, got {tp}"
            )
        return max(1, kv // tp)

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers: 2 x L x kv_heads x d x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes


def _first(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def _model_config_from_dict(config: dict[str, Any]) -> ModelConfig:
    if isinstance(config.get("text_config"), dict):
        # A multimodal checkpoint: the language model's own config, under its architecture.
        config = {**config["text_config"], "architectures": config.get("architectures")}
    architectures = config.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        architecture = _MODEL_TYPE_TO_ARCH.get(config.get("model_type", ""))
    if architecture is None:
        raise ValueError(
            f"unsupported architecture {architectures or config.get('model_type')!r}: "
            f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        num_heads = int(config["num_attention_heads"])
        num_layers = int(config["num_hidden_layers"])
        head_dim = int(_first(config, "head_dim", default=config["hidden_size"] // num_heads))
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(_first(config, "num_key_value_heads", default=num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(_first(config, "rms_norm_eps", default=1e-6)),
            max_position_embeddings=int(_first(config, "max_position_embeddings", default=4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            qk_norm=architecture == "Qwen3ForCausalLM" or is_gemma3(architecture),
            sliding_windows=_sliding_windows(config, architecture, num_layers),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=str(_first(config, "dtype", "torch_dtype", default="float32")),
            **rope_options(config, architecture),
            **family_options(config, architecture, num_layers),
        )
    except KeyError as exc:  # only the required sizes are read with []
        raise ValueError(f"config.json is missing {exc.args[0]}") from None
    except TypeError as exc:
        raise ValueError(f"config.json has a broken field: {exc}") from None


def _sliding_windows(
    config: dict[str, Any], architecture: str, num_layers: int
) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return (int(window) if window else None,) * num_layers
    types = layer_types(config, num_layers, default_pattern=6 if is_gemma3(architecture) else None)
    if types and window and config.get("use_sliding_window", True):
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if window and config.get("use_sliding_window"):
        # Qwen2 before layer_types: layers from max_window_layers on use the window.
        first = int(config.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


CPU_KV_MEMORY_CAP = 4 << 30
"""The most a CPU pool takes without `num_blocks` or `kv_cache_memory`, as in vLLM's CPU
backend: the pool is committed when it is made, so a share of a large machine's memory would
slow every start and hold more than a CPU's decode rate fills."""


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, pool sizing, host swap pool, prefix caching."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; used when num_blocks is None
    swap_space: int = 0  # bytes of host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    # Sliding-window layers keep their own blocks (KV cache groups); False: one block table
    # holds every layer's KV, the whole context of each.
    kv_cache_groups: bool = True
    # A directory for evicted cached blocks (the disk tier), and its size in bytes.
    prefix_cache_dir: str | None = None
    prefix_cache_disk_size: int = 20 << 30
    # Bytes of host memory for evicted cached blocks, a tier before the disk (0: none).
    prefix_cache_host_size: int = 0

    def __post_init__(self) -> None:
        if self.prefix_cache_disk_size <= 0:
            raise ValueError(
                f"prefix_cache_disk_size: expected > 0 bytes, got {self.prefix_cache_disk_size}"
            )
        if self.prefix_cache_host_size < 0:
            raise ValueError(
                f"prefix_cache_host_size: expected >= 0 bytes, got {self.prefix_cache_host_size}"
            )
        if self.block_size <= 0:
            raise ValueError(f"block_size: expected > 0, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks: expected > 0, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: expected > 0 bytes, got {self.kv_cache_memory}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space: expected >= 0 bytes, got {self.swap_space}")


PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: how many sequences and tokens one step may hold."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: PreemptionMode = "recompute"
    # A request preempted more often than this is resumed before newer ones (thrash bound).
    max_preemptions: int = 4

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs: expected > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens: expected > 0, got {self.max_num_batched_tokens}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode: expected 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.max_preemptions < 0:
            raise ValueError(f"max_preemptions: expected >= 0, got {self.max_preemptions}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; each layer is handed only its own part."""

    model: ModelConfig
    max_model_len: int  # longest sequence, prompt + output
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    tensor_parallel_size: int = 1
