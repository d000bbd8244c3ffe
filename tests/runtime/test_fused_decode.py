"""A decode step through the whole decoder stack in one compiled call (`FusedDecodeExecutor`):
the layer executor's hidden states, logits and K/V, the same tokens through the engine, and
where it does not apply."""

from __future__ import annotations

import pytest
import torch
from helpers import make_hf_model
from helpers.gguf_models import use_k_quant_blocks, write_gguf
from helpers.paged_batch import BLOCK_SIZE, VARIANTS, PagedBatch, prompt

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from pagedkv.models.executor import LayerExecutor
from pagedkv.models.fused_executor import FusedDecodeExecutor
from pagedkv.ops import AttentionMetadata, cpu
from pagedkv.runtime import decode, products
from pagedkv.runtime.tuning import CpuTuning

# Sums over a row (the norms' statistic) run in another order than torch's: float32 moves
# by rounding, and bfloat16 (rounded where torch rounds) may now and then move by one step.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


def _pair(model_dir, dtype):
    """The same model with the layer executor and with the fused one where it applies (both
    with the matrix-vector kernel); whether it applies."""
    plain, fused = (load_model(model_dir, dtype=dtype) for _ in range(2))
    assert not plain.use_cpu_runtime(fused_decode=False, onednn=False)
    applies = fused.use_cpu_runtime(fused_decode=True, onednn=False)
    assert isinstance(plain.executor, LayerExecutor)
    assert isinstance(fused.executor, FusedDecodeExecutor if applies else LayerExecutor)
    return plain, fused, applies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.inference_mode()
def test_decode_steps_match_layer_by_layer(tmp_path, variant, dtype, count_fused):
    arch, overrides = VARIANTS[variant]
    plain, fused, applies = _pair(make_hf_model(tmp_path, arch, **overrides), dtype)
    # Two windows over the layers (qwen2-window): one plan cannot serve them, so it refuses;
    # so it does for the layer options it lacks: Gemma 3's norms, GeGLU, logit cap and two
    # rotary tables, Phi-4's partial rotary, SmolLM3's layers without rotary.
    assert applies == (variant not in ("qwen2-window", "gemma3", "phi4", "smollm3"))
    _assert_steps_match(plain, fused, dtype)
    assert count_fused == ([2] * 5 if applies else [])


@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_q_k_v_in_chunks_of_several_heads_matches_layer_by_layer(
    tmp_path, threads, monkeypatch, count_fused
):
    # 12 + 4 + 4 heads: chunks of 3 heads on one thread (the last one of 2), of 2 on two
    model_dir = make_hf_model(tmp_path, "qwen3", num_attention_heads=12, num_key_value_heads=4)
    monkeypatch.setattr(decode, "sync_threads", lambda: threads)
    monkeypatch.setattr(decode, "_team", decode.TeamBackoff())
    plain, fused, applies = _pair(model_dir, torch.float32)
    assert applies
    _assert_steps_match(plain, fused, torch.float32)
    assert count_fused == [2] * 5


def _assert_steps_match(plain, fused, dtype) -> None:
    """A prefill, then decodes of two sequences across block ends: the same logits and K/V
    from both models (within `TOL`)."""
    batches = [PagedBatch(model, seed=3) for model in (plain, fused)]
    prompts = {0: prompt(13, seed=5), 1: prompt(21, seed=6)}
    for _ in range(6):
        logits = [
            batch.step(model, prompts) for batch, model in zip(batches, (plain, fused), strict=True)
        ]
        for a, b in zip(*logits, strict=True):
            torch.testing.assert_close(b, a, **TOL[dtype])
        torch.testing.assert_close(
            batches[1].cache.key_pool, batches[0].cache.key_pool, **TOL[dtype]
        )
        torch.testing.assert_close(
            batches[1].cache.value_pool, batches[0].cache.value_pool, **TOL[dtype]
        )
        prompts = {seq: [int(out[-1].argmax())] for seq, out in enumerate(logits[0])}


@torch.inference_mode()
@pytest.mark.parametrize(
    ("dtype", "num_seqs"),
    # 3 float32 rows: the head runs in the stack; 6 bfloat16 rows (past the matrix-vector
    # kernel's rows): after it
    [(torch.float32, 3), (torch.bfloat16, 6)],
)
def test_both_executors_return_the_hidden_states_and_the_logits_of_the_rows_asked_for(
    tmp_path, count_fused, dtype, num_seqs
):
    plain, fused, applies = _pair(make_hf_model(tmp_path, "qwen2"), dtype)
    assert applies
    outputs = []
    for model in (plain, fused):
        batch = PagedBatch(model, seed=3)
        batch.step(model, {i: prompt(9 - i, seed=1 + i) for i in range(num_seqs)})
        slots, tables, lens = [], [], []
        for seq, token_count in batch.lens.items():  # each sequence's next token by hand
            table = batch.tables[seq]
            if token_count // BLOCK_SIZE == len(table):
                table.append(batch.free.pop())
            slots.append(table[token_count // BLOCK_SIZE] * BLOCK_SIZE + token_count % BLOCK_SIZE)
            tables.append(table)
            lens.append(token_count + 1)
        metadata = AttentionMetadata.build(tables, lens, [1] * num_seqs, slots)
        positions = torch.tensor([n - 1 for n in lens])
        ids = torch.tensor(range(7, 7 + num_seqs))
        # The same step three times (it writes the same K/V), asking for other rows each time.
        outputs.append([
            model(ids, positions, batch.cache, metadata, rows) for rows in ([2, 0], [0, 1], None)
        ])  # fmt: skip
    assert count_fused == [num_seqs] * 3
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(b.hidden, a.hidden, **TOL[dtype])
        torch.testing.assert_close(b.logits, a.logits, **TOL[dtype])
    assert outputs[1][0].logits.shape == (2, plain.config.vocab_size)
    assert outputs[1][2].logits.shape == (num_seqs, plain.config.vocab_size)
    # The logits are those of the hidden states it returned.
    last = outputs[1][2]
    torch.testing.assert_close(fused.compute_logits(last.hidden), last.logits, **TOL[dtype])


@torch.inference_mode()
def test_more_rows_than_the_products_take_run_layer_by_layer(tmp_path, count_fused):
    _, fused, _ = _pair(make_hf_model(tmp_path, "llama"), torch.bfloat16)
    batch = PagedBatch(fused)
    limit = CpuTuning().fused_decode_rows
    batch.step(fused, {seq: prompt(4, seed=seq) for seq in range(limit + 1)})
    batch.step(fused, {seq: [7] for seq in range(limit + 1)})  # one row too many
    batch.step(fused, {seq: [7] for seq in range(limit)})
    assert count_fused == [limit]


@torch.inference_mode()
def test_a_slot_past_the_pool_is_refused_before_any_write(tmp_path):
    _, fused, _ = _pair(make_hf_model(tmp_path, "llama"), torch.float32)
    batch = PagedBatch(fused)
    batch.step(fused, {0: prompt(6, seed=1)})
    before = batch.cache.key_pool.clone()
    num_slots = batch.cache.num_blocks * batch.cache.block_size
    table = batch.tables[0]
    metadata = AttentionMetadata.build([table], [7], [1], [num_slots])
    with pytest.raises(ValueError, match="slot"):
        fused(torch.tensor([3]), torch.tensor([6]), batch.cache, metadata)
    assert torch.equal(batch.cache.key_pool, before)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_engine_tokens_match_layer_by_layer_float32(tmp_path, arch, monkeypatch, count_fused):
    model_dir = make_hf_model(tmp_path, arch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt(n, seed=n)} for n in (3, 9, 17, 30)]
    for module in (cpu, decode, products):  # a share per thread even on one
        monkeypatch.setattr(module, "sync_threads", lambda: 2)
    monkeypatch.setattr(cpu, "SERIAL_BYTES", 0)  # attention items on every thread
    tokens = {}
    for fused, policy in ((False, "PASSIVE"), (True, "PASSIVE"), (True, "ACTIVE")):
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        llm = LLM(str(model_dir), dtype="float32", device="cpu", num_blocks=64, block_size=8,
                  cpu_fused_decode=fused)  # fmt: skip
        # One at a time, and all four together (four decode rows a step).
        single = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        together = llm.generate(prompts, params, use_tqdm=False)
        tokens[fused, policy] = [o.outputs[0].token_ids for o in single + together]
    assert tokens[True, "PASSIVE"] == tokens[False, "PASSIVE"] == tokens[True, "ACTIVE"]
    assert len(count_fused) > 2 * 5 * 11  # both fused engines decoded through it


@pytest.mark.parametrize(
    ("dtype", "in_blocks"), [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
)
@torch.inference_mode()
def test_a_step_shared_by_two_threads_gives_the_bits_of_one(
    tmp_path, dtype, in_blocks, monkeypatch, count_fused
):
    # Each output is computed by whichever thread claims its chunk, the same way: the
    # logits and the cache must not depend on the split (nor on a thread arriving late).
    if in_blocks:  # K-quant parts of several formats (every input size a multiple of 256)
        pytest.importorskip("gguf")
        sizes = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
        model_dir = tmp_path / "model.gguf"
        write_gguf(make_hf_model(tmp_path, "qwen3", **sizes), model_dir, "Q8_0")
    else:
        model_dir = make_hf_model(tmp_path, "qwen3", dtype=dtype)
    results = []
    for threads in (1, 2):
        model = load_model(model_dir, dtype=dtype)
        if in_blocks:
            use_k_quant_blocks(model)
        assert model.use_cpu_runtime(onednn=False)
        monkeypatch.setattr(decode, "sync_threads", lambda n=threads: n)
        monkeypatch.setattr(decode, "_team", decode.TeamBackoff())
        batch = PagedBatch(model, seed=3)
        prompts = {0: prompt(13, seed=5), 1: prompt(21, seed=6)}
        logits = []
        for _ in range(6):  # a prefill, then five decode steps of two rows
            logits.append(batch.step(model, prompts))
            prompts = {seq: [int(out[-1].argmax())] for seq, out in enumerate(logits[-1])}
        results.append((logits, batch.cache.key_pool.clone(), batch.cache.value_pool.clone()))
    (logits_1, keys_1, values_1), (logits_2, keys_2, values_2) = results
    for a, b in zip(logits_1, logits_2, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(keys_1, keys_2) and torch.equal(values_1, values_2)
    assert count_fused == [2] * 10


def test_after_a_step_finished_alone_the_next_ones_run_on_one_thread_for_longer_each_time():
    team = decode.TeamBackoff()
    assert team.threads(2) == 2
    team.record(2, went_alone=True)
    assert [team.threads(2) for _ in range(5)] == [1, 1, 1, 1, 2]
    team.record(2, went_alone=True)
    assert [team.threads(2) for _ in range(9)] == [1] * 8 + [2]
    team.record(2, went_alone=False)  # shared without trouble: the backoff ends
    team.record(2, went_alone=True)
    assert [team.threads(2) for _ in range(5)] == [1, 1, 1, 1, 2]
    for _ in range(20):
        team.record(2, went_alone=True)
    assert team.alone_left == team.MAX_ALONE
