"""Figures for `pagedkv simulate --plot DIR` (matplotlib and numpy, imported only here).

- `memory_use.png`: per policy, KV memory holding tokens and reserved over time.
- `memory_map.png`: per policy, address x time. Dark: holding tokens; light: reserved but
  empty; red: free holes too small for the request waiting at the head of the queue (free
  memory nobody can use); pale: free and usable.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pagedkv.sim.simulator import PolicyResult  # noqa: E402

HELD, RESERVED, HOLE, FREE = "#1f4e79", "#f6b26b", "#d62728", "#f3f3f3"
_ADDRESS_CELLS = 720
_MAX_POINTS = 3000


def write_plots(
    results: list[PolicyResult], out_dir: Path, title: str, bytes_per_token: int
) -> None:
    """Write `memory_use.png` and `memory_map.png` into `out_dir` (created if missing).

    Args:
        results: policies run with `record=True` (each carries a `Timeline`).
        title: the figure title (model, workload, memory).
        bytes_per_token: KV bytes per token, to label axes in GiB.

    Raises:
        ValueError: a result without a timeline.
    """
    if any(r.timeline is None for r in results):
        raise ValueError("plots: expected results simulated with record=True")
    out_dir.mkdir(parents=True, exist_ok=True)
    gib = bytes_per_token / 2**30
    _memory_use(results, out_dir / "memory_use.png", title, gib)
    _memory_map(results, out_dir / "memory_map.png", title, gib)


def _memory_use(results: list[PolicyResult], path: Path, title: str, gib: float) -> None:
    fig, axes = plt.subplots(
        len(results), 1, figsize=(11, 2.3 * len(results) + 0.8), sharex=True, squeeze=False
    )
    for ax, result in zip(axes[:, 0], results, strict=True):
        tl = result.timeline
        assert tl is not None  # `write_plots` checked
        stride = max(1, len(tl.steps) // _MAX_POINTS)
        steps = np.asarray(tl.steps[::stride])
        held = np.asarray(tl.held[::stride]) * gib
        reserved = np.asarray(tl.reserved[::stride]) * gib
        ax.fill_between(steps, 0, held, color=HELD, lw=0, step="post", label="holding tokens")
        ax.fill_between(
            steps, held, reserved, color=RESERVED, lw=0, step="post", label="reserved, empty"
        )
        ax.axhline(tl.capacity * gib, color="black", lw=1, ls="--", label="KV memory")
        ax.set_ylim(0, tl.capacity * gib * 1.08)
        ax.set_ylabel("GiB")
        ax.set_title(
            f"{result.policy}: drained at step {result.steps:,}, mean concurrency "
            f"{result.mean_concurrency:,.0f}, utilization "
            f"{result.mean_kv_utilization:.0%}",
            loc="left",
            fontsize=10,
        )
        ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    axes[-1, 0].set_xlabel("simulated step (one token per running request)")
    fig.suptitle(f"KV memory over time: {title}", fontsize=12)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _coverage(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Tokens of the union-free ranges [starts, ends) falling in each cell between `edges`.

    Uses sum_i clip(x - a_i, 0, len_i) = F_end(x) - F_start(x) with F_p(x) = sum_i min(x, p_i),
    evaluated for all edges at once from sorted cumulative sums.
    """

    def f(points: np.ndarray) -> np.ndarray:
        points = np.sort(points)
        below = np.searchsorted(points, edges)
        csum = np.concatenate(([0], np.cumsum(points, dtype=np.float64)))
        return csum[below] + edges * (len(points) - below)

    covered = f(ends.astype(np.float64)) - f(starts.astype(np.float64))
    return np.diff(covered)


def _map_column(
    regions: list[tuple[int, int, int]], need: int, capacity: int, edges: np.ndarray
) -> np.ndarray:
    """RGB of one snapshot: [cells, 3] in 0..1."""
    cell = np.diff(edges)
    if regions:
        arr = np.unique(np.asarray(regions, dtype=np.int64), axis=0)  # shared blocks once
        starts, reserved, held = arr[:, 0], arr[:, 1], np.minimum(arr[:, 2], arr[:, 1])
    else:
        starts = reserved = held = np.zeros(0, dtype=np.int64)
    r = _coverage(starts, starts + reserved, edges) / cell
    h = _coverage(starts, starts + held, edges) / cell
    # Free ranges between reservations; those smaller than the waiting head's need are holes.
    order = np.argsort(starts)
    lo = np.concatenate(([0], (starts + reserved)[order]))
    hi = np.concatenate((starts[order], [capacity]))
    small = (hi > lo) & (hi - lo < need)
    hole = _coverage(lo[small], hi[small], edges) / cell
    colours = [matplotlib.colors.to_rgb(c) for c in (HELD, RESERVED, HOLE, FREE)]
    weights = np.stack([h, r - h, hole, np.clip(1 - r - hole, 0, 1)], axis=1)
    return np.clip(weights @ np.asarray(colours), 0, 1)


def _memory_map(results: list[PolicyResult], path: Path, title: str, gib: float) -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(3.4 * len(results) + 1, 5.2), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        tl = result.timeline
        assert tl is not None  # `write_plots` checked
        # Each policy on its own axes: paged capacity is rounded down to whole blocks, and
        # the memory-use figure already compares the makespans on one time axis.
        edges = np.linspace(0, tl.capacity, _ADDRESS_CELLS + 1)
        if not tl.snapshots:
            continue
        image = np.stack(
            [_map_column(regions, need, tl.capacity, edges) for _, regions, need in tl.snapshots],
            axis=1,
        )  # (cells, time, 3)
        steps = np.asarray([s for s, _, _ in tl.snapshots], dtype=np.float64)
        x = np.concatenate((steps, [steps[-1] + tl.snapshot_every]))
        ax.pcolormesh(x, edges * gib, image, shading="flat", rasterized=True)
        ax.set_title(
            f"{result.policy}\nstalls {result.fragmentation_stalls:,}, "
            f"ext. frag {result.external_fragmentation:.1%}",
            fontsize=10,
        )
        ax.set_xlabel("simulated step")
    axes[0, 0].set_ylabel("address in KV memory (GiB)")
    handles = [
        Patch(color=HELD, label="holding tokens"),
        Patch(color=RESERVED, label="reserved, empty"),
        Patch(color=HOLE, label="free hole too small for the waiting request"),
        Patch(color=FREE, label="free, usable"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle(f"KV memory map (address x time): {title}", fontsize=12)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
