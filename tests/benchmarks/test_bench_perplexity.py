"""`benchmarks/bench_perplexity.py`: llama-perplexity's windows and scored positions, and
the perplexity pagedkv gives through them equal to transformers' on the same windows."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_hf_model, make_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_perplexity  # noqa: E402
import llamacpp_runner  # noqa: E402

N_CTX = 64
BOS = 1  # make_tokenizer's <s>, which its post-processor puts first


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A wide initializer makes the next-token distributions far from uniform, so that
    # scoring other positions than llama-perplexity's changes the figure.
    path = make_hf_model(tmp_path_factory.mktemp("ppl"), "llama", seed=5, initializer_range=0.3)
    make_tokenizer(path)
    return path


def _reference_nlls(model_dir: Path, text: str) -> list[list[float]]:
    """transformers' loss on each window: the text's ids (BOS first) cut into runs of
    N_CTX, BOS first in each, labels masked up to and including position N_CTX // 2."""
    import transformers
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    assert ids[0] == BOS
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for k in range(len(ids) // N_CTX):
        window = torch.tensor([[BOS, *ids[k * N_CTX + 1 : (k + 1) * N_CTX]]])
        with torch.no_grad():
            logits = model(window).logits[0].double()
        nll = -torch.log_softmax(logits[:-1], -1).gather(1, window[0, 1:, None])[:, 0]
        out.append(nll[N_CTX // 2 :].tolist())  # targets N_CTX // 2 + 1 .. N_CTX - 1
    return out


def test_windows_are_whole_runs_of_n_ctx_with_bos_first():
    ids = list(range(100, 100 + 2 * 8 + 5))
    assert bench_perplexity.windows(ids, 8, None) == [ids[:8], ids[8:16]]
    assert bench_perplexity.windows(ids, 8, 1) == [[1, *ids[1:8]], [1, *ids[9:16]]]
    with pytest.raises(ValueError, match="at least 16 tokens"):
        bench_perplexity.windows(ids[:15], 8, None)


def test_estimate_is_llama_perplexity_figure_and_error():
    ppl, err = bench_perplexity.estimate([1.0, 2.0, 3.0])
    # mean 2, variance 14/3 - 4 = 2/3, error ppl * sqrt(variance / (count - 1))
    assert ppl == pytest.approx(math.exp(2.0))
    assert err == pytest.approx(math.exp(2.0) * math.sqrt(1 / 3))
    assert bench_perplexity.running([[1.0], [3.0, 5.0]]) == pytest.approx([math.e, math.exp(3.0)])


def test_perplexity_equals_transformers_on_the_same_windows(model_dir):
    text = bench_perplexity.TEXT.read_text()[:900]
    reference = _reference_nlls(model_dir, text)
    assert len(reference) >= 3
    found = bench_perplexity.pagedkv_perplexity(model_dir, "float32", text, N_CTX)
    assert found["bos"] == BOS
    nlls = [v for window in reference for v in window]
    ppl, err = bench_perplexity.estimate(nlls)
    assert found["ppl"] == pytest.approx(ppl, rel=1e-5)
    assert found["err"] == pytest.approx(err, rel=1e-4)
    per_window = [math.exp(sum(w) / len(w)) for w in reference]
    assert per_window[0] == pytest.approx(found["running"][0], rel=1e-5)
    # Tokens' NLLs far apart: scoring other positions would move the figure.
    assert statistics.pstdev(nlls) > 1.0


def test_llama_perplexity_log_is_parsed():
    log = (
        "0.01.5 I perplexity: calculating perplexity over 3 chunks, n_ctx=512\n"
        "[1]30.6807,[2]24.6249,[3]26.8390,\n"
        "0.47.0 I Final estimate: PPL = 26.8390 +/- 2.02631\n"
    )
    found = llamacpp_runner.parse_perplexity(log)
    assert found == {"ppl": 26.839, "err": 2.02631, "running": [30.6807, 24.6249, 26.839]}
    with pytest.raises(RuntimeError, match="final estimate"):
        llamacpp_runner.parse_perplexity("[1]30.6807,")
