"""The engine benchmark on two commits, side by side: an older commit against this tree.

Runs `bench_engine.py` (this tree's script, pagedkv runs only) alternately with this
tree's `src/` and with a git worktree of `--old` on `PYTHONPATH`, on one shared random
checkpoint, and reports each (dtype, workload)'s best time per side and their ratio. Each
side first runs the quick workload once, so kernel compilation is never timed. Rounds
alternate the order (old, new, new, old, ...) so slow drifts of a shared machine fall on both
sides alike.

    python benchmarks/compare_commits.py --old HEAD~1 --rounds 2 --dtype both --workload all
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import print_table, write_results

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_engine.py"
_SHIM = """
import runpy, sys
from pagedkv import LLM
if not hasattr(LLM, "close"):  # older commits free the engine when it is collected
    LLM.close = lambda self: None
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""Runs this tree's bench_engine.py on either side, adapted to older commits' LLM."""


def _run(src: Path, args: list[str], out: Path) -> dict[tuple[str, str], float]:
    """One bench_engine run against the pagedkv in `src`: (dtype, workload) -> seconds."""
    env = os.environ | {"PYTHONPATH": str(src)}
    cmd = [sys.executable, "-c", _SHIM, str(BENCH), "--skip-hf", "--skip-pressure",
           "--skip-parallel", "--skip-bound", "--output", str(out), *args]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["results"]["throughput"]
    return {(r["dtype"], r["workload"]): r["seconds"] for r in rows if r["system"] == "pagedkv"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the commit to compare with (git rev)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    parser.add_argument("--workload", default="all", choices=["fixed", "variable", "long",
                                                              "both", "all"])  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke run")
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    old_sha = subprocess.run(["git", "rev-parse", args.old], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), old_sha], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
        try:
            sides = {"old": tree / "src", "new": ROOT / "src"}
            model = ["--model-dir", str(Path(tmp) / "model")]
            bench = [*model, "--dtype", args.dtype, "--workload", args.workload]
            if args.quick:
                bench.append("--quick")
            warm = ["--model-dir", str(Path(tmp) / "quick"), "--quick", "--dtype", args.dtype]
            for name, src in sides.items():  # compile and load once, untimed
                _run(src, warm, Path(tmp) / f"{name}.json")
            times: dict[str, list[dict[tuple[str, str], float]]] = {"old": [], "new": []}
            for r in range(args.rounds):
                for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    out = Path(tmp) / f"{name}{r}.json"
                    times[name].append(_run(sides[name], bench, out))
                    print(f"round {r + 1} {name}: {times[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for key in times["new"][0]:
        old = [t[key] for t in times["old"]]
        new = [t[key] for t in times["new"]]
        rows.append({"dtype": key[0], "workload": key[1], "old_best_s": min(old),
                     "new_best_s": min(new), "old_s": old, "new_s": new,
                     "new_speed_vs_old": min(old) / min(new)})  # fmt: skip
    print_table(rows, ["dtype", "workload", "old_best_s", "new_best_s", "new_speed_vs_old"])
    out_dir = None if args.output is None else args.output.parent
    name = "compare_commits" if args.output is None else args.output.stem
    config = {"old": old_sha, "rounds": args.rounds, "dtype": args.dtype,
              "workload": args.workload}  # fmt: skip
    print(f"wrote {write_results(name, config=config, results=rows, out_dir=out_dir)}")


if __name__ == "__main__":
    main()
