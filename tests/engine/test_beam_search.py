"""Beam search on the paged cache: transformers' `generate(num_beams=k)` is the oracle.

Random tiny models (initializer_range 0.2 so that distributions are not flat). A near-tie
(two ranked candidates within 1e-4) makes the choice arbitrary in float arithmetic: such a
prompt is not compared, and most prompts must be compared for a test to pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_hf_model, make_tokenizer

from pagedkv.engine.beam_search import Beam, BeamSearchRun, BeamSelector, beam_search
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams

transformers = pytest.importorskip("transformers")

NEAR_TIE = 1e-4
INIT = 0.2  # initializer_range: peaked enough that near-ties are rare


def _prompts(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def _hf_beams(model, prompt, k, max_tokens, eos, early_stopping=False, length_penalty=1.0):
    """transformers' k beams (generated ids, EOS-padding cut) and scores, best first."""
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
        return_dict_in_generate=True,
        output_scores=True,
    )
    beams = []
    for ids in out.sequences[:, len(prompt) :].tolist():
        beams.append(ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids)
    return beams, out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("beam"), "llama", initializer_range=INIT)


@pytest.fixture(scope="module")
def hf_llama(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()


@torch.no_grad()
def _select_with_hf_logits(model, prompt, k, max_tokens, eos, early_stopping, length_penalty):
    """Drive a BeamSelector with logits from full (cache-free) HF forwards."""
    selector = BeamSelector(k, max_tokens, [eos], length_penalty, early_stopping)
    beams = [Beam(("hf", 0))]
    while True:
        logits = model(torch.tensor([prompt + b.token_ids for b in beams])).logits[:, -1]
        values, ids = torch.log_softmax(logits.float(), -1).topk(selector.num_candidates)
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
        running = selector.step(beams, tops)
        if selector.is_done:
            return selector
        beams = [
            Beam(
                ("hf", 0),
                [*beams[c.parent].token_ids, c.token_id],
                [*beams[c.parent].logprobs, c.logprob],
                c.cum_logprob,
            )
            for c in running
        ]


def test_selector_follows_transformers_rules_with_eos(hf_llama):
    """EOS ends beams; early_stopping and length_penalty decide the ranking and the end."""
    prompt = _prompts([13], seed=1)[0]
    best, _ = _hf_beams(hf_llama, prompt, 3, 10, None)
    eos = best[0][3]  # a token the best beam emits: beams end early and at many lengths
    compared = num_eos = 0
    for early_stopping, penalty in [
        (False, 1.0),
        (True, 1.0),
        ("never", 1.0),
        (False, 0.0),
        (False, 2.0),
        ("never", 2.0),
        (True, -1.0),
        (False, -1.0),
    ]:
        selector = _select_with_hf_logits(hf_llama, prompt, 3, 10, eos, early_stopping, penalty)
        if selector.min_margin < NEAR_TIE:
            continue
        ref, ref_scores = _hf_beams(hf_llama, prompt, 3, 10, eos, early_stopping, penalty)
        ours = selector.finished
        assert [list(h.token_ids) for h in ours] == ref, (early_stopping, penalty)
        assert [h.score for h in ours] == pytest.approx(ref_scores, rel=1e-4, abs=1e-4)
        num_eos += any(h.ended_with_eos for h in ours)
        compared += 1
    assert compared >= 6 and num_eos >= 3


@pytest.mark.parametrize(
    ("arch", "block_size", "k", "early_stopping", "length_penalty"),
    [("llama", 16, 4, False, 1.0), ("llama", 5, 2, True, 0.5), ("qwen3", 7, 3, "never", 2.0)],
)
def test_engine_beam_search_equals_transformers(
    tmp_path, arch, block_size, k, early_stopping, length_penalty
):
    """EOS ignored: every beam, its tokens and score, as transformers ranks them."""
    model_dir = make_hf_model(tmp_path, arch, initializer_range=INIT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine = LLMEngine.from_engine_args(
        str(model_dir), block_size=block_size, num_blocks=400, max_num_batched_tokens=48
    )
    prompts = _prompts([1, 9, 40, 75], seed=2)
    max_tokens = 12
    params = BeamSearchParams(k, max_tokens, ignore_eos=True, length_penalty=length_penalty)
    run = BeamSearchRun(engine, prompts, params, early_stopping=early_stopping)
    outputs = run.run()
    compared = 0
    for prompt, output, margin in zip(prompts, outputs, run.min_margins, strict=True):
        assert output.prompt_token_ids == prompt and len(output.sequences) == k
        assert all(s.tokens == prompt + s.token_ids for s in output.sequences)
        assert all(len(s.token_ids) == max_tokens for s in output.sequences)
        assert all(s.finish_reason == "length" for s in output.sequences)
        if margin < NEAR_TIE:
            continue
        ref, ref_scores = _hf_beams(hf, prompt, k, max_tokens, None, early_stopping, length_penalty)
        assert [s.token_ids for s in output.sequences] == ref
        assert [s.score for s in output.sequences] == pytest.approx(ref_scores, abs=2e-4)
        for s in output.sequences:
            assert s.cum_logprob == pytest.approx(sum(s.logprobs), abs=1e-6)
            assert s.score == pytest.approx(s.cum_logprob / max_tokens**length_penalty)
        compared += 1
    assert compared >= 3
    # Beams share their prompt blocks: fewer blocks than k separate sequences per prompt.
    separate = sum(k * -(-(len(p) + max_tokens) // block_size) for p in prompts)
    assert run.peak_num_used_blocks < separate
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_cow_copies"] > 0  # siblings diverged inside a shared partial block


def test_engine_beam_search_with_eos_and_early_stopping(tmp_path, hf_llama, llama_dir):
    prompt = _prompts([11], seed=3)[0]
    best, _ = _hf_beams(hf_llama, prompt, 3, 10, None)
    eos = best[0][2]
    model_dir = make_hf_model(tmp_path, "llama", initializer_range=INIT, eos_token_id=eos)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine = LLMEngine.from_engine_args(str(model_dir), block_size=4, num_blocks=100)
    num_ended = 0
    for early_stopping, penalty in [(False, 1.0), (True, 0.5), ("never", 2.0)]:
        run = BeamSearchRun(
            engine,
            [prompt],
            BeamSearchParams(3, 10, length_penalty=penalty),
            early_stopping=early_stopping,
        )
        (output,) = run.run()
        assert run.min_margins[0] >= NEAR_TIE
        ref, ref_scores = _hf_beams(hf, prompt, 3, 10, eos, early_stopping, penalty)
        assert [s.token_ids for s in output.sequences] == ref
        assert [s.score for s in output.sequences] == pytest.approx(ref_scores, abs=2e-4)
        ended = [s for s in output.sequences if s.finish_reason == "stop"]
        assert all(s.token_ids[-1] == eos for s in ended)
        num_ended += len(ended)
    assert num_ended > 0
    assert engine.stats()["num_used_blocks"] == 0


def test_width_one_is_greedy_and_engine_keeps_serving(llama_dir):
    engine = LLMEngine.from_engine_args(str(llama_dir), block_size=8, num_blocks=64)
    prompts = _prompts([6, 30], seed=4)
    beams = beam_search(engine, prompts, BeamSearchParams(1, 8, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"g{i}", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
    greedy = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                greedy[out.request_id] = out.outputs[0].token_ids
    assert [b.sequences[0].token_ids for b in beams] == [greedy["g0"], greedy["g1"]]


def test_small_pool_runs_prompts_in_turn(llama_dir):
    """A pool too small for all prompts at once admits them as blocks allow: same beams."""
    prompts = _prompts([20, 33, 8, 50], seed=5)
    params = BeamSearchParams(3, 6, ignore_eos=True)
    roomy = beam_search(
        LLMEngine.from_engine_args(str(llama_dir), block_size=4, num_blocks=300), prompts, params
    )
    small_engine = LLMEngine.from_engine_args(str(llama_dir), block_size=4, num_blocks=24)
    run = BeamSearchRun(small_engine, prompts, params)
    small = run.run()
    assert [[s.token_ids for s in o.sequences] for o in small] == [
        [s.token_ids for s in o.sequences] for o in roomy
    ]
    assert run.peak_num_used_blocks <= 24
    assert small_engine.stats()["num_used_blocks"] == 0


def test_text_and_prompt_forms(llama_dir):
    make_tokenizer(llama_dir)
    engine = LLMEngine.from_engine_args(str(llama_dir), block_size=8, num_blocks=64)
    outputs = beam_search(
        engine, ["hello world", {"prompt": "the cat"}], BeamSearchParams(2, 5, ignore_eos=True)
    )
    assert [o.prompt for o in outputs] == ["hello world", "the cat"]
    for output in outputs:
        best = output.sequences[0]
        assert best.text == engine.tokenizer.decode(best.token_ids)
        assert output.sequences[0].score >= output.sequences[1].score


def test_bad_input(llama_dir):
    engine = LLMEngine.from_engine_args(str(llama_dir), block_size=4, num_blocks=10)
    with pytest.raises(ValueError, match="blocks"):
        beam_search(engine, [list(range(3, 40))], BeamSearchParams(4, 16))
    with pytest.raises(ValueError, match="token"):
        beam_search(engine, [[]], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        beam_search(engine, [[5]], BeamSearchParams(2, 5000))
    engine.add_request("busy", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle"):
        beam_search(engine, [[5]], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSelector(2, 4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)


def test_failed_step_frees_every_block(llama_dir, monkeypatch):
    engine = LLMEngine.from_engine_args(str(llama_dir), block_size=4, num_blocks=64)
    prompts = _prompts([9, 14], seed=6)
    params = BeamSearchParams(3, 6, ignore_eos=True)
    expected = beam_search(engine, prompts, params)
    execute, calls = engine.runner.execute, []

    def failing_execute(step, token_bitmask=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return execute(step)

    monkeypatch.setattr(engine.runner, "execute", failing_execute)
    with pytest.raises(RuntimeError, match="device lost"):
        beam_search(engine, prompts, params)
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_cached_blocks"] == 0
    engine.kv_manager.check()
    again = beam_search(engine, prompts, params)
    assert [o.sequences[0].token_ids for o in again] == [o.sequences[0].token_ids for o in expected]


def test_llm_beam_search_public_api(llama_dir):
    from pagedkv import LLM

    llm = LLM(str(llama_dir), block_size=8, num_blocks=64)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    direct = beam_search(llm.engine, [[5, 6, 7, 8, 9]], params)
    (via_llm,) = llm.beam_search([5, 6, 7, 8, 9], params)
    assert len(via_llm.sequences) == 3
    assert [s.token_ids for s in via_llm.sequences] == [s.token_ids for s in direct[0].sequences]
    scores = [s.score for s in via_llm.sequences]
    assert scores == sorted(scores, reverse=True)
    assert llm.stats()["num_used_blocks"] == 0
