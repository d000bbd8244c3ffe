"""lm-evaluation-harness end to end: a tiny offline multiple-choice task scored through the
server (`local-completions`, token-id requests) and through transformers (`hf`) on the same
random-weight checkpoint gives the same accuracy and the same per-choice loglikelihoods."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

# Everything is local: a JSONL file and a task YAML written by the test.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval[api]: its `local-completions` model needs it
pytest.importorskip("accelerate")  # lm-eval[hf]: its `hf` model needs it

from live_server import MODEL_NAME, start_server  # noqa: E402

TASK = "pagedkv_tiny_mc"
WORDS = "quick brown fox jumps over lazy dog paged cache stores keys values blocks".split()


def _write_task(root: Path) -> Path:
    """10 questions of 2-4 random-word choices as JSONL, and a task YAML reading it."""
    rng = random.Random(0)
    docs = []
    for _ in range(10):
        choices = [
            " ".join(rng.choices(WORDS, k=rng.randint(1, 3))) for _ in range(rng.randint(2, 4))
        ]
        question = " ".join(rng.choices(WORDS, k=rng.randint(3, 8)))
        docs.append(
            {"question": question, "choices": choices, "label": rng.randrange(len(choices))}
        )
    data = root / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task_dir = root / "tasks"
    task_dir.mkdir()
    (task_dir / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Q: {{question}}\\nA:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return task_dir


def _evaluate(model: str, model_args: dict, task_dir: Path) -> tuple[float, list[list[float]]]:
    """Accuracy and, per doc (in doc order), each choice's loglikelihood."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    loglikelihoods = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return results["results"][TASK]["acc,none"], loglikelihoods


def _evaluate_server(url: str, model_dir: Path, task_dir: Path) -> tuple[float, list[list[float]]]:
    """`_evaluate` through the server at `url` (token-id requests)."""
    return _evaluate(
        "local-completions",
        {
            "add_bos_token": True,
            "model": MODEL_NAME,
            "base_url": f"{url}/v1/completions",
            "tokenizer": str(model_dir),
            "tokenized_requests": True,
            "batch_size": 4,
            "max_retries": 1,
        },
        task_dir,
    )


def test_server_accuracy_equals_transformers(tiny_model_dir, tmp_path):
    task_dir = _write_task(tmp_path)
    common = {"add_bos_token": True}
    with start_server(tiny_model_dir, max_num_seqs=8) as live:
        server_acc, server_lls = _evaluate_server(live.url, tiny_model_dir, task_dir)
    hf_acc, hf_lls = _evaluate(
        "hf",
        {
            **common,
            "pretrained": str(tiny_model_dir),
            "dtype": "float32",
            "device": "cpu",
            "batch_size": 8,
        },
        task_dir,
    )
    assert len(server_lls) == len(hf_lls) == 10
    for server_doc, hf_doc in zip(server_lls, hf_lls, strict=True):
        assert server_doc == pytest.approx(hf_doc, abs=2e-3)
        # The chosen answer: the argmax over choices, as `acc` scores it.
        assert server_doc.index(max(server_doc)) == hf_doc.index(max(hf_doc))
    assert server_acc == hf_acc


def test_int8_kv_cache_gives_the_same_answers(tiny_model_dir, tmp_path):
    """The task through the server over an int8 KV cache: the float cache's answers on at
    least 9 of the 10 questions."""
    task_dir = _write_task(tmp_path)
    answers = []
    for kv_cache_dtype in ("auto", "int8"):
        with start_server(tiny_model_dir, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype) as live:
            _, lls = _evaluate_server(live.url, tiny_model_dir, task_dir)
        answers.append([doc.index(max(doc)) for doc in lls])
    assert sum(a == b for a, b in zip(*answers, strict=True)) >= 9
