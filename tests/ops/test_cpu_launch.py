"""The C++ launcher of the CPU decode kernels (`cpu_launch`): taken once loaded, bit for bit
the Python fast paths' results, and every call it does not take left to the general path,
which names the error or runs the prefill."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from paged_cases import expected, make_case

from pagedkv.ops import (
    AttentionMetadata,
    cpu,
    cpu_kernels,
    cpu_launch,
    paged_attention,
    paged_attention_from_metadata,
)


@pytest.fixture(scope="module")
def launcher() -> cpu_launch.Launcher:
    if os.environ.get(cpu_launch.DISABLE_ENV) == "0":
        pytest.skip(f"{cpu_launch.DISABLE_ENV}=0")
    loaded = cpu_launch.load()
    assert loaded is not None, "the launcher did not build (a C++ compiler and ninja?)"
    return loaded


def _case(dtype: torch.dtype, *, lens: list[int], queries: list[int], seed: int = 0, **geometry):
    """A case whose cache pair takes the launcher (a fresh memo, made now)."""
    params = dict(block_size=16, num_heads=8, num_kv_heads=2, head_dim=64) | geometry
    return make_case(lens, queries, dtype=dtype, seed=seed, **params)


def _python_twin(case, monkeypatch: pytest.MonkeyPatch):
    """Copies of the case's caches whose memo is made without the launcher: they take the
    Python fast paths."""
    key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
    with monkeypatch.context() as patch:
        patch.setattr(cpu_launch, "loaded", lambda: None)
        cpu._flat_views(key_cache, value_cache)
    assert key_cache.__dict__[cpu._FLAT_MEMO][3].launch is None
    return key_cache, value_cache


def _metadata(case, lens: list[int], queries: list[int]) -> AttentionMetadata:
    tables = [[b for b in row if b >= 0] for row in case.block_tables.tolist()]
    return AttentionMetadata.build(tables, lens, queries, list(range(sum(queries))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lens", "queries", "geometry"),
    [
        ([1, 37, 700, 3000], [1, 1, 2, 4], {}),  # split rows, multi-token decode rows
        ([5, 17, 16], [1, 1, 1], dict(block_size=5, num_heads=6, num_kv_heads=2, head_dim=40)),
        ([600], [1], dict(block_size=32, num_heads=32, num_kv_heads=8, head_dim=128)),
        ([90, 33], [1, 1], dict(block_size=1, num_heads=4, num_kv_heads=4, head_dim=80)),
    ],
)
@pytest.mark.parametrize("window", [None, 300])
def test_launcher_matches_the_python_fast_paths(
    launcher, dtype, lens, queries, geometry, window, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain and planned calls give the Python fast paths' bits, and the reference's values;
    the launcher's own paths are taken (the Python ones are made to fail)."""
    case = _case(dtype, lens=lens, queries=queries, **geometry)
    python_caches = _python_twin(case, monkeypatch)
    md_python, md = _metadata(case, lens, queries), _metadata(case, lens, queries)
    index = (case.block_tables, case.seq_lens, case.query_start_loc)
    want_plain = paged_attention(case.query, *python_caches, *index, sliding_window=window)
    want_planned = [
        paged_attention_from_metadata(case.query, *python_caches, md_python, sliding_window=window)
        for _layer in range(2)
    ]
    first = paged_attention_from_metadata(
        case.query, case.key_cache, case.value_cache, md, sliding_window=window
    )  # plans the step (general path)
    assert next(iter(md.plans.values())).launch_block is not None

    def python_path(*args, **kwargs):
        raise AssertionError("took a Python path with the launcher loaded")

    for name in ("decode", "plan_and_decode"):
        monkeypatch.setattr(cpu_kernels, name, python_path)
    monkeypatch.setattr(cpu, "_make_plan", python_path)
    monkeypatch.setattr(cpu, "_run", python_path)
    plain = paged_attention(
        case.query, case.key_cache, case.value_cache, *index, sliding_window=window
    )
    later = paged_attention_from_metadata(
        case.query, case.key_cache, case.value_cache, md, sliding_window=window
    )
    for out, want in ((plain, want_plain), (first, want_planned[0]), (later, want_planned[1])):
        assert out.dtype == dtype and out.shape == case.query.shape
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(plain.double(), expected(case, window), rtol=tol, atol=tol)


def test_launcher_leaves_errors_to_the_general_path(launcher) -> None:
    """Calls the launcher does not take reach the general path and get its messages."""
    case = _case(torch.float32, lens=[5, 20], queries=[1, 1], block_size=8)
    args = case.args()
    tables = case.block_tables.clone()
    tables[1, 2] = case.key_cache.shape[0]
    with pytest.raises(ValueError, match=r"^block_tables: expected block ids in \[0, "):
        paged_attention(*args[:3], tables, *args[4:])
    long_lens = case.seq_lens.clone()
    long_lens[0] = 1000
    with pytest.raises(ValueError, match=r"seq_lens"):
        paged_attention(*args[:4], long_lens, args[5])
    with pytest.raises(ValueError, match=r"^seq_lens: expected torch.int32"):
        paged_attention(*args[:4], case.seq_lens.long(), args[5])
    with pytest.raises(ValueError, match=r"^query: expected head_dim 64"):
        paged_attention(case.query[..., :32], *args[1:])
    with pytest.raises(ValueError, match=r"^scale"):
        paged_attention(*args, scale=float("nan"))
    with pytest.raises(ValueError, match=r"^sliding_window"):
        paged_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match=r"^query: expected"):
        paged_attention(case.query.double(), *args[1:])
    # A non-tensor argument: the extension's argument conversion fails, the general path names it.
    with pytest.raises(ValueError, match=r"^block_tables"):
        paged_attention(*args[:3], case.block_tables.tolist(), *args[4:])


def test_launcher_leaves_prefills_and_odd_scales_to_the_general_path(launcher) -> None:
    """A batch with a prefill sequence, and an int scale, still get the right values."""
    lens, queries = [40, 30, 9], [1, 12, 9]
    case = _case(torch.float32, lens=lens, queries=queries)
    out = paged_attention(*case.args())
    torch.testing.assert_close(out.double(), expected(case, None), rtol=1e-5, atol=1e-5)
    decode = _case(torch.float32, lens=[40, 9], queries=[1, 1])
    as_int = paged_attention(*decode.args(), scale=1)
    as_float = paged_attention(*decode.args(), scale=1.0)
    torch.testing.assert_close(as_int, as_float, rtol=0, atol=0)


def test_launcher_notices_a_cache_given_new_storage(launcher) -> None:
    """The CACHES block holds the caches' addresses: after `set_` the launcher declines and
    the general path rebuilds the memo over the new storage."""
    case = _case(torch.float32, lens=[40, 9], queries=[1, 1])
    paged_attention(*case.args())
    moved = case.key_cache.clone()
    old_address = case.key_cache.data_ptr()
    case.key_cache.set_(moved.untyped_storage(), 0, moved.shape, moved.stride())
    assert case.key_cache.data_ptr() != old_address
    out = paged_attention(*case.args())
    torch.testing.assert_close(out.double(), expected(case, None), rtol=1e-5, atol=1e-5)
    memo = case.key_cache.__dict__[cpu._FLAT_MEMO]
    assert memo[1] == case.key_cache.data_ptr() and memo[3].launch is not None


def test_launcher_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_launch.DISABLE_ENV, "0")
    monkeypatch.setattr(cpu_launch, "_state", {})
    assert cpu_launch.load() is None and cpu_launch.loaded() is None


def test_launcher_build_failure_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.delenv(cpu_launch.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_launch, "_state", {})
    monkeypatch.setattr(cpu_launch, "_build", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"C\+\+ launcher .* unavailable \(Ninja is required"):
        assert cpu_launch.load() is None
    assert cpu_launch.load() is None  # once: no second build attempt or warning
    case = _case(torch.float32, lens=[40, 9], queries=[1, 1])
    out = paged_attention(*case.args())
    assert case.key_cache.__dict__[cpu._FLAT_MEMO][3].launch is None
    torch.testing.assert_close(out.double(), expected(case, None), rtol=1e-5, atol=1e-5)


def test_plan_block_is_made_only_for_decode_only_plans(launcher) -> None:
    decode = _case(torch.float32, lens=[40, 9], queries=[1, 2])
    mixed = _case(torch.float32, lens=[40, 9], queries=[1, 9])
    for case, lens, queries, want in (
        (decode, [40, 9], [1, 2], True),
        (mixed, [40, 9], [1, 9], False),
    ):
        md = _metadata(case, lens, queries)
        paged_attention_from_metadata(case.query, case.key_cache, case.value_cache, md)
        plan = next(iter(md.plans.values()))
        assert (plan.launch_block is not None) == want
        if want:
            block = plan.launch_block.numpy()
            assert block[0] == sum(queries) and block[1] == plan.block_tables.ctypes.data
            assert np.array_equal(plan.block_tables.shape, block[2:4])


def test_launcher_keeps_the_plain_calls_plan_alive(launcher) -> None:
    """A plain call's items are allocated by the planner inside the entry point and read by
    the workers through their address; freed at their last use before the parallel region
    (Numba's reference counting), they were overwritten by the partial states and the
    workers read garbage ranges (wrong rows or a crash; the item table is
    larger than a worker's scratch here, so the main thread's scratch reuses it)."""
    case = _case(torch.float32, lens=[60] * 256, queries=[1] * 256, num_heads=12, num_kv_heads=4)
    want = expected(case, None)
    for _call in range(10):
        out = paged_attention(*case.args())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_a_stale_build_lock_is_removed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's builder waits forever on a lock left by a build that died; an old one goes."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = cpu_launch._build_directory()
    assert directory.parent == tmp_path and torch.__version__ in directory.name
    lock = directory / "lock"
    lock.touch()
    cpu_launch._build_directory()
    assert lock.exists()  # a build may be running
    old = lock.stat().st_mtime - cpu_launch.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    cpu_launch._build_directory()
    assert not lock.exists()


@pytest.mark.parametrize(
    ("dtype", "num_kv_heads", "head_dim"),
    [(torch.float32, 2, 16), (torch.bfloat16, 2, 16), (torch.float16, 1, 3), (torch.float32, 1, 3)],
)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_launcher_writes_as_the_python_path(
    launcher, dtype, num_kv_heads, head_dim, slot_dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`write_kv` through the launcher: the Python path's bytes (whole words, or bytes for
    rows of 6 and 12 bytes), padding slots skipped, strided inputs copied first, never the
    Python kernel call; a slot past the end still gets the general path's message."""
    from pagedkv.ops import write_kv

    def caches():
        return (torch.zeros(4, 5, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))

    gen = torch.Generator().manual_seed(0)
    shape = (head_dim, 7, num_kv_heads)  # strided: a transposed view
    key = torch.randn(shape, generator=gen).to(dtype).permute(1, 2, 0)
    value = torch.randn(shape, generator=gen).to(dtype).permute(1, 2, 0)
    slots = torch.tensor([3, -1, 19, 0, 7, -5, 12], dtype=slot_dtype)
    python_caches = tuple(caches())
    with monkeypatch.context() as patch:
        patch.setattr(cpu_launch, "loaded", lambda: None)
        write_kv(key[:1], value[:1], *python_caches, slots[:1])  # the pair's memo, no launcher
        write_kv(key, value, *python_caches, slots)
    launcher_caches = tuple(caches())
    write_kv(key[:1], value[:1], *launcher_caches, slots[:1])  # the pair's first: general path
    assert launcher_caches[0].__dict__[cpu._ROWS_MEMO][3][5] is not None

    def python_path(*args, **kwargs):
        raise AssertionError("took the Python write with the launcher loaded")

    monkeypatch.setattr(cpu_kernels, "write_rows", python_path)
    write_kv(key, value, *launcher_caches, slots)
    for got, want in zip(launcher_caches, python_caches, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    bad = slots.clone()
    bad[4] = 20
    with pytest.raises(
        ValueError, match=r"^slot_mapping: expected slots < .* = 20, got slot_mapping\[4\] = 20"
    ):
        write_kv(key, value, *launcher_caches, bad)
    with pytest.raises(ValueError, match=r"^slot_mapping"):
        write_kv(key, value, *launcher_caches, slots.float())
