"""Two commits' decode steps, interleaved in one process: an older commit against this tree.

`compare_commits.py` runs each side in its own process, and on a shared virtual machine one
side's runs move by 10-25 % from minute to minute, more than a kernel change is worth. Here
the older commit's `src/pagedkv` is exported (`git archive`) into a temporary directory as
the package `pagedkv_old` (the word `pagedkv` renamed throughout its sources, so that both
load side by side, each with its own compiled kernels), both load the same model, get the
same requests, and then take one engine step each in turn (the order alternating every
step): a drift of the machine falls on both sides within milliseconds. Reported per dtype
and case: each side's median decode step (`--batches`: requests of random prompts) or time
over `bench_engine.py`'s workload (`--workloads`, continuous batching on its 125M random
model), the speed ratio (> 1: this tree is faster), and whether every request's tokens
were the same on both sides.

Both sides share one process's thread policy and torch state, so this does not see
process-wide differences (start-up, the OpenMP policy); `compare_commits.py` does.

    python benchmarks/compare_steps.py --old HEAD~1
    python benchmarks/compare_steps.py --old HEAD~1 --model DIR --dtype float32 --batches 1 8
    python benchmarks/compare_steps.py --old HEAD~1 --batches --workloads fixed variable
"""

from __future__ import annotations

from pagedkv.runtime.threads import apply_thread_policy

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
from pagedkv.cli.demo import find_demo_model  # noqa: E402

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
    packages: dict[str, ModuleType],
    model: str,
    dtype: str,
    requests: list[tuple[list[int], int]],
    rounds: int,
) -> dict[str, Any]:
    """One engine per side; `rounds` times (after one untimed round that compiles and warms
    up) both get `requests` (prompt ids, new tokens), and each takes a step in turn (the
    order alternating) until both are done. Per side: every timed round's step times, and
    each request's tokens."""
    options = {"dtype": dtype, "block_size": 16, "seed": 0,
               "max_num_seqs": max(len(requests), 8), "enable_prefix_caching": False,
               "num_blocks": sum(-(-(len(p) + n) // 16) for p, n in requests) + 64}  # fmt: skip
    engines = {name: package.LLM(model, **options).engine for name, package in packages.items()}
    steps: dict[str, list[list[float]]] = {name: [] for name in engines}
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    for r in range(rounds + 1):
        for name, engine in engines.items():
            steps[name].append([])
            for i, (prompt, new_tokens) in enumerate(requests):
                params = packages[name].SamplingParams(
                    temperature=0.0, max_tokens=new_tokens, ignore_eos=True
                )
                engine.add_request(f"{r}-{i}", {"prompt_token_ids": prompt}, params)
        order = list(engines)
        while any(engine.has_unfinished_requests() for engine in engines.values()):
            order.reverse()
            for name in order:
                if not engines[name].has_unfinished_requests():
                    continue
                start = time.perf_counter()
                outputs = engines[name].step()
                steps[name][-1].append(time.perf_counter() - start)
                for output in outputs:
                    if output.finished:
                        tokens[name][output.request_id] = list(output.outputs[0].token_ids)
    return {"steps": {name: rounds_[1:] for name, rounds_ in steps.items()}, "tokens": tokens}


def latency_case(
    packages: dict[str, ModuleType], model: str, dtype: str, batch: int, args: argparse.Namespace
) -> dict[str, Any]:
    """`batch` requests of random prompts: the median decode step of each side (from each
    round's third step: its first is the prefill)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 10_000) for _ in range(args.prompt_len)] for _ in range(batch)]
    run = interleaved(packages, model, dtype, [(p, args.new_tokens) for p in prompts], args.rounds)
    old, new = (
        statistics.median(t for steps in run["steps"][name] for t in steps[2:])
        for name in ("old", "new")
    )
    return {"dtype": dtype, "case": f"batch {batch}", "old_ms": round(old * 1e3, 2),
            "new_ms": round(new * 1e3, 2), "speed_new_over_old": round(old / new, 3),
            "same_tokens": run["tokens"]["old"] == run["tokens"]["new"]}  # fmt: skip


def workload_case(
    packages: dict[str, ModuleType], model: str, dtype: str, name: str, args: argparse.Namespace
) -> dict[str, Any]:
    """`bench_engine.py`'s workload `name` (continuous batching): each side's time per
    round, the sum of its steps (median over rounds)."""
    from bench_engine import FULL_MODEL, make_workloads

    workload = make_workloads(FULL_MODEL["vocab_size"], quick=False)[name]
    requests = list(zip(workload.prompts, workload.max_tokens, strict=True))
    run = interleaved(packages, model, dtype, requests, args.rounds)
    old, new = (statistics.median(map(sum, run["steps"][side])) for side in ("old", "new"))
    return {"dtype": dtype, "case": name, "old_ms": round(old * 1e3, 1),
            "new_ms": round(new * 1e3, 1), "speed_new_over_old": round(old / new, 3),
            "same_tokens": run["tokens"]["old"] == run["tokens"]["new"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the commit to compare with (git rev)")
    parser.add_argument("--model", default=None, help="HF directory or GGUF (default: SmolLM2)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--batches", nargs="*", type=int, default=[1])
    parser.add_argument("--workloads", nargs="*", default=[], choices=["fixed", "variable", "long"],
                        help="bench_engine.py's, on its 125M random model")  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per case")
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    model = args.model or find_demo_model()
    if args.batches and model is None:
        parser.error("--model: expected a model path (the demo model is not installed)")
    old_sha = subprocess.run(["git", "rev-parse", "--short", args.old], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        packages = {"old": export_old(args.old, Path(tmp)), "new": pagedkv}
        for dtype in args.dtype:
            rows += [latency_case(packages, str(model), dtype, b, args) for b in args.batches]
        if args.workloads:
            from bench_engine import FULL_MODEL

            from pagedkv.models import save_random_checkpoint

            bench_model = Path(tmp) / "bench-model"
            save_random_checkpoint(bench_model, FULL_MODEL, seed=0)
            for dtype in args.dtype:
                rows += [workload_case(packages, str(bench_model), dtype, w, args)
                         for w in args.workloads]  # fmt: skip
    print(f"old = {old_sha}, new = this tree; batches: median decode step, workloads: time")
    print_table(rows)
    config = vars(args) | {"old_sha": old_sha, "model": str(model)}
    out_dir = None if args.output is None else args.output.parent
    name = "compare_steps" if args.output is None else args.output.stem
    print(f"wrote {write_results(name, config=config, results=rows, out_dir=out_dir)}")


if __name__ == "__main__":
    main()
