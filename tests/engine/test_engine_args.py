"""`EngineArgs`: validation, and `LLM`, `LLMEngine` and the CLI all derived from its fields."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from pagedkv.cache import PagedKVCache
from pagedkv.cli import build_parser, main
from pagedkv.cli import serve as commands
from pagedkv.config import CPU_KV_MEMORY_CAP, CacheConfig, SchedulerConfig
from pagedkv.engine import builder
from pagedkv.engine import llm as llm_module
from pagedkv.engine.args import EngineArgs, engine_args_signature
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import LLM


def _parse(argv: list[str]) -> EngineArgs:
    return commands.EngineArgs.from_cli_args(build_parser().parse_args(argv))


def test_sizes_become_bytes_and_defaults_hold() -> None:
    args = EngineArgs(model="m", kv_cache_memory="4GiB", swap_space="1.5 KiB")
    assert args.kv_cache_memory == 4 * 2**30 and args.swap_space == 1536
    assert args.create_cache_config().kv_cache_memory == 4 * 2**30
    assert args.create_scheduler_config().max_num_batched_tokens == 2048
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("block_size", 0, "expected > 0, got 0"),
        ("num_blocks", True, "expected int, got True"),
        ("max_num_seqs", "8", "expected int, got '8'"),
        ("dtype", "int4", "expected one of 'auto', 'float32', 'bfloat16', 'float16', got 'int4'"),
        ("preemption_mode", "drop", "got 'drop'"),
        ("kv_cache_memory", "lots", "expected a size"),
        ("swap_space", -1, "non-negative"),
        ("enable_prefix_caching", "yes", "expected bool, got 'yes'"),
        ("max_model_len", 0, "expected > 0, got 0"),
        ("max_preemptions", -1, "expected >= 0, got -1"),
    ],
)
def test_bad_values_name_field_expected_and_got(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: .*{expected}"):
        EngineArgs(model="m", **{field: value})


def test_llm_signature_is_the_fields() -> None:
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    params = inspect.signature(LLM).parameters
    assert list(params) == names
    assert params["block_size"].default == 16 and params["block_size"].kind.name == "KEYWORD_ONLY"
    for name in names[1:]:
        assert f"{name}: " in LLM.__init__.__doc__, name


def test_unknown_keyword_lists_the_valid_ones() -> None:
    with pytest.raises(TypeError, match="'blocksize'.*block_size, num_blocks"):
        LLM("no-model-needed", blocksize=16)
    with pytest.raises(TypeError, match="alone"):
        LLMEngine.from_engine_args(EngineArgs(model="m"), block_size=8)


def test_cli_defaults_and_flag_spellings() -> None:
    assert _parse(["serve", "--model", "m"]) == EngineArgs(model="m")
    args = _parse(
        [
            "generate",
            "--prompt",
            "x",
            "--model",
            "m",
            "--no-prefix-caching",
            "--kv-cache-memory",
            "4GiB",
            "--swap-space",
            "1GiB",
            "--preemption-mode",
            "swap",
            "--max-num-batched-tokens",
            "64",
        ]
    )
    assert not args.enable_prefix_caching
    assert (args.kv_cache_memory, args.swap_space) == (4 * 2**30, 2**30)
    assert (args.preemption_mode, args.max_num_batched_tokens) == ("swap", 64)
    assert _parse(["serve", "--model", "m", "--enable-prefix-caching"]).enable_prefix_caching


# A made-up option, added to EngineArgs alone: everything else must pick it up.
PatchedEngineArgs = dataclasses.make_dataclass(
    "PatchedEngineArgs",
    [
        ("draft_tokens", int, dataclasses.field(default=3, metadata={"help": "made-up knob"})),
        ("enable_turbo", bool, dataclasses.field(default=False, metadata={"help": "made up"})),
    ],
    bases=(EngineArgs,),
    frozen=True,
)


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> list[EngineArgs]:
    """Swap in `PatchedEngineArgs` where `LLM` and the CLI read `EngineArgs`; record what
    reaches `LLMEngine.from_engine_args` instead of loading a model."""
    monkeypatch.setattr(llm_module, "EngineArgs", PatchedEngineArgs)
    monkeypatch.setattr(commands, "EngineArgs", PatchedEngineArgs)
    received: list[EngineArgs] = []

    def fake_from_engine_args(cls: type, args: EngineArgs) -> LLMEngine:
        received.append(args)
        raise ValueError("stop before loading")

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(fake_from_engine_args))
    return received


def test_a_new_field_is_an_llm_keyword(patched: list[EngineArgs]) -> None:
    with pytest.raises(ValueError, match="stop before loading"):
        LLM("dir", draft_tokens=5, enable_turbo=True, block_size=8)
    assert (patched[0].draft_tokens, patched[0].enable_turbo) == (5, True)  # type: ignore[attr-defined]
    assert patched[0].block_size == 8
    with pytest.raises(TypeError, match="draft_tokens"):
        LLM("dir", draft_tokenz=5)
    with pytest.raises(ValueError, match="draft_tokens: expected int"):
        LLM("dir", draft_tokens="five")
    signature = engine_args_signature(PatchedEngineArgs)
    assert signature.parameters["draft_tokens"].default == 3


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_new_field_is_a_flag(patched: list[EngineArgs], command: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "--draft-tokens N" in out and "made-up knob (default: 3)" in out
    assert "--enable-turbo" in out and "--no-turbo" in out


def test_generate_hands_a_new_flag_to_the_engine(patched: list[EngineArgs], tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({}))
    argv = ["generate", "--model", str(tmp_path), "--prompt", "x", "--draft-tokens", "7"]
    assert main([*argv, "--enable-turbo", "--block-size", "4"]) == 2  # the fake's ValueError
    (args,) = patched
    assert isinstance(args, PatchedEngineArgs)
    assert (args.draft_tokens, args.enable_turbo, args.block_size) == (7, True, 4)


@pytest.mark.parametrize(
    ("device", "free", "num_ranks", "expected_bytes"),
    [
        ("cpu", 1 << 40, 1, CPU_KV_MEMORY_CAP),  # a large machine: the cap
        ("cpu", 1 << 40, 2, CPU_KV_MEMORY_CAP // 2),  # its ranks split it
        ("cpu", 8 << 30, 1, int(0.3 * (8 << 30))),  # a small one: the share
        ("cuda", 1 << 40, 1, int(0.8 * (1 << 40))),  # a device: no cap
    ],
)
def test_default_pool_is_a_share_of_free_memory_capped_on_the_cpu(
    monkeypatch, device, free, num_ranks, expected_bytes
) -> None:
    monkeypatch.setattr(builder, "_free_memory", lambda device: free)
    shape = (32, 16, 8, 128, "float16")  # 2 MiB per block
    per_block = PagedKVCache.bytes_per_block(*shape)
    scheduler = SchedulerConfig(max_num_seqs=1 << 20)  # the full-length cap does not bind
    blocks = builder._num_device_blocks(CacheConfig(), scheduler, shape, 8192, device, num_ranks)
    assert blocks == expected_bytes // per_block
    # Sizes a user gives are taken as they are, beyond the default cap too.
    given = CacheConfig(kv_cache_memory=2 * CPU_KV_MEMORY_CAP)
    assert builder._num_device_blocks(given, scheduler, shape, 8192, device) == (
        2 * CPU_KV_MEMORY_CAP // per_block
    )


def test_engine_args_is_exported_at_the_top_level() -> None:
    import pagedkv

    assert pagedkv.EngineArgs is EngineArgs
    assert "EngineArgs" in pagedkv.__all__
