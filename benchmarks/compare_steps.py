"""Two commits' decode steps, interleaved in one process: an older commit against this tree.

`compare_commits.py` runs each side in its own process, and on a shared virtual machine one
side's runs move by 10-25 % from minute to minute, more than a kernel change is worth. Here
the older commit's `src/pagedkv` is exported (`git archive`) into a temporary directory as
the package `pagedkv_old` (the word `pagedkv` renamed throughout its sources, so that both
load side by side, each with its own compiled kernels), both load the same model, get the
same requests, and then take one engine step each in turn (the order alternating every
step): a drift of the machine falls on both sides within milliseconds. Reported per dtype
and batch: the median decode step of each side, the speed ratio (> 1: this tree is faster),
and whether every request's tokens were the same on both sides.

Both sides share one process's thread policy and torch state, so this does not see
process-wide differences (start-up, the OpenMP policy); `compare_commits.py` does.

    python benchmarks/compare_steps.py --old HEAD~1
    python benchmarks/compare_steps.py --old HEAD~1 --model DIR --dtype float32 --batches 1 8
"""

from __future__ import annotations

from pagedkv.threads import apply_thread_policy

apply_thread_policy()  # before torch loads its OpenMP runtime

import argparse  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

from _common import print_table, write_results  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.demo import find_demo_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OLD_NAME = "pagedkv_old"


def export_old(rev: str, into: Path) -> ModuleType:
    """The package of commit `rev` imported as `OLD_NAME` from a copy under `into`."""
    archive = subprocess.run(["git", "archive", rev, "src/pagedkv"], cwd=ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
    word = re.compile(r"\bpagedkv\b")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = into / OLD_NAME / Path(member.name).relative_to("src/pagedkv")
            path.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if path.suffix == ".py":
                data = word.sub(OLD_NAME, data.decode()).encode()
            path.write_bytes(data)
    sys.path.insert(0, str(into))
    return importlib.import_module(OLD_NAME)


def interleaved(
    packages: dict[str, ModuleType], model: str, dtype: str, batch: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One engine per side, `args.rounds` batches of `batch` requests decoded step by step
    in turn; each side's decode steps (from the third of a round) in seconds."""
    options = {"dtype": dtype, "block_size": 16, "seed": 0, "max_num_seqs": max(batch, 8),
               "enable_prefix_caching": False}  # fmt: skip
    engines = {name: package.LLM(model, **options).engine for name, package in packages.items()}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 10_000) for _ in range(args.prompt_len)] for _ in range(batch)]
    steps: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    for r in range(args.rounds + 1):  # round 0 compiles and warms up, untimed
        for name, engine in engines.items():
            params = packages[name].SamplingParams(
                temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True
            )
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{r}-{i}", {"prompt_token_ids": prompt}, params)
        order = list(engines)
        for step in range(args.new_tokens):
            for name in order if step % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                outputs = engines[name].step()
                if r > 0 and step >= 2:
                    steps[name].append(time.perf_counter() - start)
                for output in outputs:
                    if output.finished:
                        tokens[name][output.request_id] = list(output.outputs[0].token_ids)
        if any(engine.has_unfinished_requests() for engine in engines.values()):
            raise RuntimeError("a request outlived its max_tokens")
    old, new = (statistics.median(steps[name]) for name in ("old", "new"))
    return {
        "dtype": dtype, "batch": batch, "old_step_ms": round(old * 1e3, 2),
        "new_step_ms": round(new * 1e3, 2), "speed_new_over_old": round(old / new, 3),
        "steps_per_side": len(steps["new"]), "same_tokens": tokens["old"] == tokens["new"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the commit to compare with (git rev)")
    parser.add_argument("--model", default=None, help="HF directory or GGUF (default: SmolLM2)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per case")
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    model = args.model or find_demo_model()
    if model is None:
        parser.error("--model: expected a model path (the demo model is not installed)")
    old_sha = subprocess.run(["git", "rev-parse", "--short", args.old], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        packages = {"old": export_old(args.old, Path(tmp)), "new": pagedkv}
        rows = [
            interleaved(packages, str(model), dtype, batch, args)
            for dtype in args.dtype
            for batch in args.batches
        ]
    print(f"old = {old_sha}, new = this tree; median decode step per side")
    print_table(rows)
    config = vars(args) | {"old_sha": old_sha, "model": str(model)}
    out_dir = None if args.output is None else args.output.parent
    name = "compare_steps" if args.output is None else args.output.stem
    print(f"wrote {write_results(name, config=config, results=rows, out_dir=out_dir)}")


if __name__ == "__main__":
    main()
