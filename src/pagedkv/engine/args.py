"""`EngineArgs`: every engine option, defined once.

`LLM(model, **kwargs)`, `LLMEngine.from_engine_args`, the engine builder and the flags of
`pagedkv serve` / `generate` all read this dataclass: a field added here becomes a keyword
of `LLM`, a flag (`block_size` -> `--block-size`) and a line of both their helps. Each
field's type decides its flag: `int` takes a number, `int | str` a size such as "4GiB",
`bool` a pair `--enable-x` / `--no-x`, and a field with `choices` a fixed set.

Standard library only: `pagedkv --help` builds its parsers from it without torch.
"""

from __future__ import annotations

import argparse
import inspect
import os
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

from pagedkv.config import CPU_KV_MEMORY_CAP, CacheConfig, SchedulerConfig, parse_size
from pagedkv.runtime.quant.formats import QUANTIZATIONS

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8")
PREEMPTION_MODES = ("recompute", "swap")
# The names `pagedkv.ops.backend` registers (this module imports no torch to read them).
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "reference")
# The step's token budget when `max_num_batched_tokens` is None; longer prefills are chunked.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
_Args = TypeVar("_Args", bound="EngineArgs")


def _option(default: Any = MISSING, help: str = "", **metadata: Any) -> Any:
    """A field with its help text (and optional `choices` / `metavar`) in its metadata."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(frozen=True)
class EngineArgs:
    """Every option of an engine; `LLM`'s keywords and the CLI's flags are its fields.

    Sizes (`kv_cache_memory`, `swap_space`) may be given as "4GiB" and are stored as bytes.

    Raises:
        ValueError: a field of the wrong type, outside its range or not one of its choices.
    """

    model: str = _option(
        help="a local Hugging Face model directory (config.json, *.safetensors, "
        "tokenizer.json) or a GGUF file",
        metavar="DIR",
    )
    dtype: str = _option(
        "auto", "weights and KV cache dtype; auto is the checkpoint's", choices=DTYPES
    )
    quantization: str = _option(
        "auto",
        "weights in GGML blocks on the CPU: auto keeps a GGUF file's formats (Q8_0, Q4_0, "
        "Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), none dequantizes them, q8_0 / q4_0 quantize every "
        "projection at load",
        choices=QUANTIZATIONS,
    )
    device: str = _option("auto", "auto (CUDA when available), cpu, cuda, cuda:1, ...")
    kv_cache_dtype: str = _option(
        "auto",
        "KV cache storage: auto (the model's dtype) or int8 (symmetric, a float16 scale per "
        "token and KV head computed as the token is written: about half of bfloat16's bytes)",
        choices=KV_CACHE_DTYPES,
    )
    block_size: int = _option(16, "tokens per KV block")
    num_blocks: int | None = _option(None, "fix the KV pool size in blocks")
    kv_cache_memory: int | str | None = _option(
        None,
        "size the KV pool by memory, e.g. 4GiB, when num_blocks is unset (per device under "
        "tensor parallelism; default: a share of the memory free after loading the weights, "
        f"on the CPU at most {CPU_KV_MEMORY_CAP >> 30}GiB)",
    )
    swap_space: int | str = _option(0, "host memory for swapped-out blocks, e.g. 1GiB")
    max_num_seqs: int = _option(256, "sequences in one step at most")
    max_num_batched_tokens: int | None = _option(
        None,
        f"tokens in one step at most; longer prefills are chunked "
        f"(default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    enable_prefix_caching: bool = _option(True, "reuse the KV of identical leading prompt blocks")
    kv_cache_groups: bool = _option(
        True, "give sliding-window layers their own blocks, freed as they leave the window"
    )
    prefix_cache_dir: str | None = _option(
        None,
        "save cached blocks the pool evicts to this directory and read them back for later "
        "prompts, across restarts (needs prefix caching; off by default)",
        metavar="DIR",
    )
    prefix_cache_disk_size: int | str = _option(
        "20GiB",
        "bytes of block files kept in prefix_cache_dir, by every process using it together "
        "(least recently used go)",
    )
    # Off by default, as vLLM's --kv-offloading-size is (and LMCache's CPU buffer is sized
    # by whoever turns LMCache on): the tier takes its host memory up front, page-locked
    # on a GPU, which is the machine's owner to give. On the CPU the pool is host memory
    # already, so a larger pool (kv_cache_memory) serves better than a tier beside it.
    prefix_cache_host_size: int | str = _option(
        0,
        "host memory for cached blocks the pool evicts, a tier before prefix_cache_dir, "
        "e.g. 8GiB (needs prefix caching; 0: off)",
    )
    preemption_mode: str = _option(
        "recompute",
        "what a preempted sequence does when the pool runs out",
        choices=PREEMPTION_MODES,
    )
    seed: int = _option(0, "seeds the requests that bring no seed of their own")
    max_model_len: int | None = _option(
        None, "longest sequence, prompt + output (default: the model's max positions)"
    )
    max_preemptions: int = _option(
        4, "a request preempted more often than this is resumed before newer ones"
    )
    attention_backend: str = _option(
        "auto",
        "attention kernels: auto (cpu on the CPU, triton on CUDA); triton on the CPU needs "
        "TRITON_INTERPRET=1 before triton is imported (its interpreter, for tests)",
        choices=ATTENTION_BACKENDS,
    )
    tensor_parallel_size: int = _option(
        1,
        "split the model over this many processes (the heads, the MLP and the vocabulary; "
        "gloo on the CPU, NCCL on CUDA, one GPU each); under torchrun, WORLD_SIZE of them",
    )
    pack_weights: bool = _option(
        True,
        "multiply past the few rows with oneDNN on the CPU, on the weights as loaded (each "
        "held once; off: torch's matmul, MKL's in float32)",
    )
    cpu_matvec: bool = _option(
        True,
        "multiply a decode step of a few sequences in pagedkv's matrix-vector kernel, not "
        "torch's matmul (on the CPU; how many rows: the tuning file, see `pagedkv tune`)",
    )
    cpu_fused_decode: bool = _option(
        True,
        "send a decode step of a few sequences through every layer in one compiled call "
        "(on the CPU; the same operations and roundings as the layer-by-layer path)",
    )
    token_buckets: bool = _option(
        True,
        "pad each step's matmuls to one of ~4 row counts per doubling (same outputs): "
        "oneDNN caches a kernel per shape, and unbounded shapes grow the process for good",
    )

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for spec in fields(self):
            value = _checked(spec, hints[spec.name], getattr(self, spec.name))
            object.__setattr__(self, spec.name, value)
        if not self.model:
            raise ValueError("model: expected a model directory, got ''")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size: expected an int >= 1, got {self.tensor_parallel_size}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len: expected > 0, got {self.max_model_len}")
        if self.prefix_cache_dir is not None and not self.enable_prefix_caching:
            raise ValueError(
                "prefix_cache_dir: expected enable_prefix_caching on (the tier holds cached "
                f"blocks), got a directory {self.prefix_cache_dir!r} with prefix caching off"
            )
        if self.prefix_cache_host_size and not self.enable_prefix_caching:
            raise ValueError(
                "prefix_cache_host_size: expected enable_prefix_caching on (the tier holds "
                f"cached blocks), got {self.prefix_cache_host_size} bytes with it off"
            )
        # The layer configs check their own ranges (block_size > 0, ...).
        self.create_cache_config()
        self.create_scheduler_config()

    def create_cache_config(self) -> CacheConfig:
        """The KV cache's part of these options."""
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_cache_memory=typing.cast("int | None", self.kv_cache_memory),
            swap_space=typing.cast(int, self.swap_space),
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_groups=self.kv_cache_groups,
            prefix_cache_dir=self.prefix_cache_dir,
            prefix_cache_disk_size=typing.cast(int, self.prefix_cache_disk_size),
            prefix_cache_host_size=typing.cast(int, self.prefix_cache_host_size),
        )

    def create_scheduler_config(self) -> SchedulerConfig:
        """The scheduler's part of these options."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
            max_preemptions=self.max_preemptions,
        )

    @classmethod
    def from_kwargs(
        cls: type[_Args], model: str | os.PathLike[str], kwargs: Mapping[str, Any]
    ) -> _Args:
        """`cls(model=model, **kwargs)`, naming every valid option when a keyword is unknown.

        Raises:
            TypeError: a keyword that is not a field (the message lists the fields).
            ValueError: a bad value (see the class).
        """
        names = [spec.name for spec in fields(cls) if spec.name != "model"]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(
                f"unexpected keyword argument {unknown[0]!r}: expected one of "
                f"{', '.join(names)} (the fields of {cls.__name__})"
            )
        return cls(model=os.fspath(model), **kwargs)

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        *,
        model_required: bool = True,
        include: Collection[str] | None = None,
    ) -> None:
        """Add one flag per field to `parser` (`block_size` -> `--block-size`).

        Args:
            parser: where the flags go (an argument group is added).
            model_required: whether `--model` must be given.
            include: only these fields (default: all of them).
        """
        group = parser.add_argument_group(
            f"engine options (the fields of {cls.__name__}, the keyword arguments of LLM)"
        )
        hints = typing.get_type_hints(cls)
        for spec in fields(cls):
            if include is None or spec.name in include:
                _add_flag(group, spec, hints[spec.name], model_required)

    @classmethod
    def from_cli_args(cls: type[_Args], namespace: argparse.Namespace, **overrides: Any) -> _Args:
        """The options parsed by `add_cli_args`, with `overrides` on top.

        Raises:
            ValueError: a bad value (see the class).
        """
        values = {
            s.name: getattr(namespace, s.name) for s in fields(cls) if hasattr(namespace, s.name)
        }
        return cls(**{**values, **overrides})


def engine_args_signature(
    cls: type[EngineArgs] = EngineArgs, *, method: bool = False
) -> inspect.Signature:
    """`(model, *, dtype: str = 'auto', ...)`: the fields of `cls` as a call signature.

    Args:
        cls: `EngineArgs` or a subclass.
        method: start with `self` (for an `__init__` that takes these options).
    """
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", kind)] if method else []
    params.append(inspect.Parameter("model", kind, annotation="str | os.PathLike[str]"))
    hints = typing.get_type_hints(cls)
    keyword = inspect.Parameter.KEYWORD_ONLY
    params += [
        inspect.Parameter(spec.name, keyword, default=spec.default, annotation=hints[spec.name])
        for spec in fields(cls)
        if spec.name != "model"
    ]
    return inspect.Signature(params)


def engine_args_help(indent: str = "    ") -> str:
    """One `name: help (choices) (default)` line per `EngineArgs` field but `model`."""
    return "\n".join(
        f"{indent}{spec.name}: {_help_text(spec)}"
        for spec in fields(EngineArgs)
        if spec.name != "model"
    )


def _help_text(spec: Field[Any]) -> str:
    """The field's help, its choices and its default (unless the help already gives one)."""
    text = spec.metadata.get("help", "")
    if "choices" in spec.metadata:
        text += f"; one of {', '.join(spec.metadata['choices'])}"
    if spec.default not in (MISSING, None) and "(default:" not in text:
        default = spec.default
        if isinstance(default, bool):
            default = "on" if default else "off"
        text += f" (default: {default})"
    return text


def _union_members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _is_size(members: tuple[Any, ...]) -> bool:
    return int in members and str in members


def _checked(spec: Field[Any], hint: Any, value: Any) -> Any:
    """`value` checked against the field's type and choices; sizes become bytes."""
    members = _union_members(hint)
    name = spec.name
    if value is None:
        if type(None) in members:
            return None
        raise ValueError(f"{name}: expected a value, got None")
    if _is_size(members):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if str in members and isinstance(value, os.PathLike):
        value = os.fspath(value)
    expected = [m for m in members if m is not type(None)]
    if not any(_is_instance(value, m) for m in expected):
        names = " or ".join(getattr(m, "__name__", str(m)) for m in expected)
        raise ValueError(f"{name}: expected {names}, got {value!r}")
    choices = spec.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _is_instance(value: Any, member: Any) -> bool:
    if member is int:  # bool is an int subclass, but True is no block count
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(member, type) and isinstance(value, member)


def _add_flag(
    group: argparse._ArgumentGroup, spec: Field[Any], hint: Any, model_required: bool
) -> None:
    flag = "--" + spec.name.replace("_", "-")
    help_text = _help_text(spec)
    members = _union_members(hint)
    if bool in members:
        # --enable-prefix-caching / --no-prefix-caching (vLLM's and this CLI's spellings).
        stem = flag.removeprefix("--").removeprefix("enable-")
        group.add_argument(
            flag, dest=spec.name, action="store_true", default=spec.default, help=help_text
        )
        group.add_argument(
            f"--no-{stem}", dest=spec.name, action="store_false", help=f"turn {flag} off"
        )
        return
    kwargs: dict[str, Any] = {"dest": spec.name, "help": help_text, "default": spec.default}
    if spec.name == "model":
        kwargs.update(required=model_required, default=None)
    if _is_size(members):
        kwargs["metavar"] = "BYTES"  # parsed (and checked) by EngineArgs
    elif int in members:
        kwargs["type"], kwargs["metavar"] = int, "N"
    if "choices" in spec.metadata:
        kwargs["choices"] = spec.metadata["choices"]
        kwargs["help"] = spec.metadata.get("help", "") + f" (default: {spec.default})"
    if "metavar" in spec.metadata:
        kwargs["metavar"] = spec.metadata["metavar"]
    group.add_argument(flag, **kwargs)
