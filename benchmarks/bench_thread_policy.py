"""The OpenMP wait policy on a busy machine: `from pagedkv import LLM` as a user runs it.

Another process spins on one core (a stand-in for whatever else the machine runs) while a
fresh Python process loads a random ~125M Llama and generates 2 prompts x 64 tokens. Three
variants, alternated: OMP_WAIT_POLICY unset (pagedkv sets PASSIVE on import), PASSIVE set by
hand, and ACTIVE (OpenMP's spinning default, what a program gets when torch loads first).

    python benchmarks/bench_thread_policy.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table, write_results

_GENERATE = """
import time, sys
from pagedkv import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32")
prompts = [{"prompt_token_ids": list(range(3, 200))}, {"prompt_token_ids": list(range(7, 90))}]
params = SamplingParams(max_tokens=64, ignore_eos=True)
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print(time.perf_counter() - start)
"""
VARIANTS = {"unset (pagedkv sets PASSIVE)": None, "PASSIVE by hand": "PASSIVE", "ACTIVE": "ACTIVE"}


def _generate_seconds(model: Path, policy: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", _GENERATE, str(model)], env=env, check=True,
                         capture_output=True, text=True, timeout=900).stdout  # fmt: skip
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import FULL_MODEL

    from pagedkv.models import save_random_checkpoint

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(tmp) / "model"
            save_random_checkpoint(model, FULL_MODEL, seed=0)
            _generate_seconds(model, "PASSIVE")  # compile and load once, untimed
            deadline = time.monotonic() + 3600
            for _ in range(args.rounds):
                for name, policy in VARIANTS.items():
                    if time.monotonic() < deadline:
                        times[name].append(_generate_seconds(model, policy))
                        print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    finally:
        spinner.kill()
    rows = [
        {"OMP_WAIT_POLICY": name, "best_s": min(t), "median_s": sorted(t)[len(t) // 2],
         "runs_s": t}
        for name, t in times.items()
    ]  # fmt: skip
    print_table(rows, ["OMP_WAIT_POLICY", "best_s", "median_s"])
    name = "thread_policy" if args.output is None else args.output.stem
    out_dir = None if args.output is None else args.output.parent
    config = {"rounds": args.rounds}
    print(f"wrote {write_results(name, config=config, results=rows, out_dir=out_dir)}")


if __name__ == "__main__":
    main()
