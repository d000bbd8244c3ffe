"""GGUF files: their metadata and tensor table, and the metadata as a `config.json` dict.

GGUF (llama.cpp's format) is a header of typed key/value metadata, a table of tensors (name,
shape, quantization type, offset) and the aligned tensor data. The header is parsed here with
the standard library: `GGUFReader` of the `gguf` package builds an array per token string and
takes seconds on a 49k-token vocabulary, where this takes milliseconds. The tensors are
dequantized by the `gguf` package (`pagedkv.models.gguf`).

llama.cpp keeps the hyper-parameters under its own keys (`llama.block_count`, ...);
`hf_config_from_gguf` maps them to the names `ModelConfig.from_hf` reads, so a GGUF checkpoint
and the directory `pagedkv convert` writes from it share one config path.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.gguf_families import FAMILY_ARCHITECTURES, family_config

GGUF_INSTALL_HINT = 'pip install "pagedkv[gguf]"'
# GGUF `general.architecture` -> the Hugging Face architecture it stores.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **FAMILY_ARCHITECTURES,
}
# `{architecture}.{key}` -> the config.json field.
_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
}
_REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
# `general.file_type` (llama.cpp's LlamaFileType) -> the dtype "auto" loads: the file's own
# for unquantized files, float32 (exact for every dequantized block) otherwise.
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
# GGUF value types -> struct format: 0..7 uint8, int8, uint16, int16, uint32, int32, float32,
# bool; 10..12 uint64, int64, float64 (8 is a string, 9 an array).
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table.

    Attributes:
        shape: GGUF order, fastest dimension first (`[in_features, out_features]` for a
            linear weight; the reverse of torch's).
        type_id: the GGML quantization type (`gguf.GGMLQuantizationType` value).
        offset: bytes from the file's start to the tensor's data.
    """

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: `metadata` key -> value, `tensors` name -> info."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


def is_gguf_path(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its `.gguf` suffix; the file need not exist)."""
    return str(path).lower().endswith(".gguf") and not Path(path).is_dir()


def _shortest_float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (1e-05, not 9.99999974e-06), as
    the value was written in the config the file was converted from."""
    packed = struct.pack("<f", value)
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


class _Cursor:
    def __init__(self, buffer: Any, pos: int) -> None:
        self.buffer, self.pos = buffer, pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return _shortest_float32(value) if fmt == "f" else value

    def string(self) -> str:
        length = self.scalar("Q")
        start, self.pos = self.pos, self.pos + length
        return bytes(self.buffer[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in _SCALARS:  # one unpack for the whole array
                fmt = f"<{count}{_SCALARS[item_type]}"
                values = list(struct.unpack_from(fmt, self.buffer, self.pos))
                self.pos += struct.calcsize(fmt)
                return values
            return [self.value(item_type) for _ in range(count)]
        if type_id not in _SCALARS:
            raise ValueError(f"GGUF metadata: unknown value type {type_id}")
        return self.scalar(_SCALARS[type_id])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of a GGUF file (versions 2 and 3, little-endian).

    Raises:
        FileNotFoundError: no such file.  ValueError: not a GGUF file, or a broken header.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expected a .gguf file, got {str(path)!r} (no such file)")
    stat = path.stat()
    return _read_header(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    """`read_gguf`'s parse, once per file and version: building an engine reads the header
    for its config, weights and tokenizer (size and time key a rewritten file anew)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        if buffer[:4] != b"GGUF":
            raise ValueError(f"{path}: expected a GGUF file (magic 'GGUF'), got {buffer[:4]!r}")
        cursor = _Cursor(buffer, pos=4)  # past the magic
        try:
            version = cursor.scalar("I")
            if version not in (2, 3):
                raise ValueError(f"{path}: expected GGUF version 2 or 3, got {version}")
            num_tensors, num_keys = cursor.scalar("Q"), cursor.scalar("Q")
            metadata = {}
            for _ in range(num_keys):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.scalar("I"))
            table = []
            for _ in range(num_tensors):
                name = cursor.string()
                shape = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
                table.append((name, shape, cursor.scalar("I"), cursor.scalar("Q")))
        except struct.error as exc:
            raise ValueError(f"{path}: truncated GGUF header ({exc})") from None
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {
        name: GGUFTensorInfo(name, shape, type_id, data_start + offset)
        for name, shape, type_id, offset in table
    }
    return GGUFFile(path, metadata, tensors)


def hf_config_from_gguf(file: GGUFFile) -> dict[str, Any]:
    """The `config.json` dict of the model in a GGUF file.

    Raises:
        ValueError: an architecture other than llama (Llama, Mistral), qwen2, qwen3, gemma3,
            phi3 or smollm3, or no token embedding.
    """
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: expected one of {sorted(GGUF_ARCHITECTURES)}"
        )
    missing = [f"{arch}.{key}" for key in _REQUIRED if f"{arch}.{key}" not in meta]
    if missing:
        raise ValueError(f"{file.path}: expected GGUF metadata {', '.join(missing)}, found none")
    config: dict[str, Any] = {}
    for key, name in _KEYS.items():
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, list):
            raise ValueError(f"GGUF key {arch}.{key}: expected one value, got one per layer")
        if value is not None:
            config[name] = value
    if "token_embd.weight" not in file.tensors:
        raise ValueError(f"{file.path}: expected a tensor 'token_embd.weight', found none")
    config["vocab_size"] = file.tensors["token_embd.weight"].shape[-1]  # [hidden, vocab]
    config["tie_word_embeddings"] = "output.weight" not in file.tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    architecture = GGUF_ARCHITECTURES[arch]
    # llama.cpp stores Mistral as "llama"; its name or its window tells them apart.
    name = f"{meta.get('general.name', '')} {meta.get('general.basename', '')}".lower()
    if arch == "llama" and ("mistral" in name or "sliding_window" in config):
        architecture = "MistralForCausalLM"
    config["architectures"] = [architecture]
    config["model_type"] = architecture.removesuffix("ForCausalLM").lower()
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": meta.get(f"{arch}.rope.scaling.factor"),
        }
    eos = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    config["bos_token_id"] = meta.get("tokenizer.ggml.bos_token_id")
    # Stated even when absent: some configs default it past a small vocabulary (Phi-3's).
    config["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    config["dtype"] = _FILE_DTYPES.get(meta.get("general.file_type", -1), "float32")
    config.update(family_config(file, arch, config))
    return config
