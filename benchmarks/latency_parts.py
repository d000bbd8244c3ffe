"""Where one decode step's time goes: the engine's per-step parts and the model's per-layer
parts, for `bench_latency.py --breakdown`.

Per-step parts come from a real decode run, each entry point wrapped with a timer:
`schedule`, `update` (which includes `detokenize`, also shown alone), the attention metadata
and plan, the forward (with the sampled rows' LM head), the prompt rows' LM head, the
sampler; "engine, other" is the rest of `LLMEngine.step` (outputs, metrics). Per-layer parts
are timed alone on the model's own weights and the step's own metadata, all layers in a row
as the forward runs them: the four matmuls (through the products the model chose), the
two norms, the rotary embedding, `write_kv`, attention, the SiLU gate and residual adds;
"Python and dispatch" is the forward less their sum. Where the model runs its decoder stack
in one compiled call (`FusedDecodeExecutor`), the parts are the matmuls (the same kernels,
timed alone), the stack, and the forward outside it.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import pagedkv.engine.runner as runner_module
from pagedkv import LLM, SamplingParams
from pagedkv.models.fused_executor import FusedDecodeExecutor
from pagedkv.models.layers import apply_rotary_
from pagedkv.ops import paged_attention_from_metadata, write_kv


def timed(fn: Callable[[], Any], repeats: int = 7, inner: int = 5) -> float:
    """Median seconds of one `fn()` call, over `repeats` loops of `inner` calls."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


class _Timers:
    """Wraps attributes with accumulating timers; `restore` puts the originals back."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._saved: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timer(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0

        self._saved.append((owner, name, original))
        setattr(owner, name, timer)

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


class _MetadataProxy:
    """Stands in for `AttentionMetadata` in the runner's module: times `build`."""

    def __init__(self, cls: Any, timers: _Timers) -> None:
        self._cls = cls
        timers.wrap(self, "build", "metadata")

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return self._cls.build(*args, **kwargs)


def step_parts(llm: LLM, prompt: list[int], steps: int) -> tuple[dict[str, float], tuple]:
    """Milliseconds per decode step of each engine part, over `steps` steps of one request.

    Returns:
        (part -> ms per step, the last decode step's forward arguments).
    """
    engine, runner = llm.engine, llm.engine.runner
    model = runner.model
    timers = _Timers()
    captured: list[tuple] = []
    forward = model.forward

    def capturing_forward(*args: Any) -> Any:
        captured[:] = [args]
        return forward(*args)

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request("breakdown", {"prompt_token_ids": prompt}, params)
    engine.step()  # the prefill
    metadata_cls = runner_module.AttentionMetadata
    runner_module.AttentionMetadata = _MetadataProxy(metadata_cls, timers)  # type: ignore[misc]
    model.forward = capturing_forward
    timers.wrap(runner_module, "plan_attention", "metadata")
    for owner, name, key in [
        (engine.scheduler, "schedule", "schedule"),
        (engine.scheduler, "update", "update (with detokenize)"),
        (runner, "execute", "execute"),
        (model, "forward", "forward"),
        (model, "compute_logits", "LM head"),
        (runner, "sampler", "sampler"),
    ]:
        timers.wrap(owner, name, key)
    if engine.scheduler.detokenize is not None:
        timers.wrap(engine.scheduler, "detokenize", "detokenize")
    try:
        t0, count = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            count += 1
        total = time.perf_counter() - t0
    finally:
        timers.restore()
        runner_module.AttentionMetadata = metadata_cls  # type: ignore[misc]
        del model.forward  # the instance attribute; the class's forward shows again
    ms = {key: 1e3 * value / count for key, value in timers.seconds.items()}
    ms.setdefault("LM head", 0.0)  # the sampled rows' logits come with the forward
    inside = ms["forward"] + ms["LM head"] + ms["sampler"] + ms["metadata"]
    parts = {
        "step": 1e3 * total / count,
        "schedule": ms["schedule"],
        "update (with detokenize)": ms["update (with detokenize)"],
        "detokenize": ms.get("detokenize", 0.0),
        "metadata + plan": ms["metadata"],
        "forward": ms["forward"],
        "LM head": ms["LM head"],
        "sampler": ms["sampler"],
        "runner, other": ms["execute"] - inside,
    }
    parts["engine, other"] = (
        parts["step"] - ms["execute"] - ms["schedule"] - ms["update (with detokenize)"]
    )
    return parts, captured[0]


@torch.inference_mode()
def layer_parts(model: Any, forward_args: tuple) -> dict[str, float]:
    """Milliseconds per forward of each per-layer part, timed alone (all layers in a row).

    Rewrites the captured step's KV slots (the request is finished).
    """
    input_ids, positions, kv_cache, metadata = forward_args[:4]
    config, dtype = model.config, model.dtype
    layers = list(model.model.layers)
    num_tokens, hidden_size = input_ids.shape[0], config.hidden_size
    attn0 = layers[0].self_attn
    x = torch.randn(num_tokens, hidden_size, dtype=dtype)
    attn_out = torch.randn(num_tokens, attn0.q_size, dtype=dtype)
    inter = torch.randn(num_tokens, config.intermediate_size, dtype=dtype)
    gate_up = torch.randn(num_tokens, 2 * config.intermediate_size, dtype=dtype)
    qkv = torch.randn(num_tokens, attn0.q_size + 2 * attn0.kv_size, dtype=dtype)
    q = torch.randn(num_tokens, attn0.num_heads, attn0.head_dim, dtype=dtype)
    kv = torch.randn(num_tokens, attn0.num_kv_heads, attn0.head_dim, dtype=dtype)
    heads = attn0.num_heads + attn0.num_kv_heads

    def matmuls() -> None:
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv_proj.forward(x)
            a.o_proj.forward(attn_out)
            m.gate_up_proj.forward(x)
            m.down_proj.forward(inter)

    def norms() -> None:
        for layer in layers:
            layer.input_layernorm.forward(x)
            layer.post_attention_layernorm.forward(x)
        model.model.norm.forward(x)

    def rotary() -> None:
        cos, sin = model.rotary_embs[0](positions, dtype)
        for _ in layers:
            view = qkv[:, : attn0.q_size + attn0.kv_size].view(num_tokens, heads, attn0.head_dim)
            apply_rotary_(view, cos, sin)

    def write() -> None:
        for i in range(len(layers)):
            k_cache, v_cache = kv_cache.key_caches[i], kv_cache.value_caches[i]
            write_kv(kv, kv, k_cache, v_cache, metadata.slot_mapping)

    def attention() -> None:
        for i, layer in enumerate(layers):
            a = layer.self_attn
            paged_attention_from_metadata(
                q,
                kv_cache.key_caches[i],
                kv_cache.value_caches[i],
                metadata,
                scale=a.scale,
                sliding_window=a.sliding_window,
            )

    def elementwise() -> None:
        h = x.clone()
        for _ in layers:
            g, u = gate_up.chunk(2, dim=-1)
            F.silu(g).mul_(u)
            h += x
            h += x

    forward = 1e3 * timed(lambda: model.forward(*forward_args))
    if isinstance(model.executor, FusedDecodeExecutor):  # the compiled stack
        rope = [embedding(positions, dtype) for embedding in model.rotary_embs]
        rows = list(range(num_tokens))

        def stack() -> None:
            model.executor.run(x.clone(), rope, kv_cache, metadata, rows)

        ms = {"matmuls": 1e3 * timed(matmuls), "decoder stack": 1e3 * timed(stack)}
        ms["stack less matmuls"] = ms["decoder stack"] - ms["matmuls"]
        ms["embedding, final norm, Python"] = forward - ms["decoder stack"]
        ms["forward"] = forward
        return ms
    parts = {
        "matmuls": matmuls,
        "norms": norms,
        "rotary": rotary,
        "write_kv": write,
        "attention": attention,
        "silu gate, residual adds": elementwise,
    }
    ms = {name: 1e3 * timed(fn) for name, fn in parts.items()}
    ms["Python and dispatch"] = forward - sum(ms.values())
    ms["forward"] = forward
    return ms
