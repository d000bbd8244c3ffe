"""DeltaTracker: cumulative engine outputs -> stream deltas (stop-string holdback)."""

from __future__ import annotations

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.server.streaming import DeltaTracker


def _output(texts: list[str], num_tokens: list[int], reasons: list[str | None]) -> RequestOutput:
    completions = [
        CompletionOutput(i, text, list(range(n)), -float(n), [{t: -1.0} for t in range(n)], r)
        for i, (text, n, r) in enumerate(zip(texts, num_tokens, reasons, strict=True))
    ]
    return RequestOutput("r", None, [1, 2, 3], completions, all(r is not None for r in reasons))


def test_deltas_concatenate_to_the_text_without_stop_strings():
    tracker = DeltaTracker()
    steps = ["He", "Hell", "Hello", "Hello, w", "Hello, world"]
    deltas = [tracker.update(_output([t], [i + 1], [None])) for i, t in enumerate(steps)]
    deltas.append(tracker.update(_output([steps[-1]], [6], ["length"])))
    texts = [d.samples[0].text for d in deltas if d.samples]
    assert texts == ["He", "ll", "o", ", w", "orld", ""]
    assert deltas[-1].finished and deltas[-1].samples[0].finish_reason == "length"
    assert [len(d.samples[0].token_ids) for d in deltas] == [1, 1, 1, 1, 1, 1]
    assert deltas[2].samples[0].logprobs == [{2: -1.0}]


def test_text_that_may_start_a_stop_string_is_held_back():
    # The engine first reports "abc STO", then finds "STOP" and cuts the text to "abc ".
    tracker = DeltaTracker(stop=["STOP"])
    first = tracker.update(_output(["abc STO"], [3], [None]))
    assert first.samples[0].text == "abc "  # "STO" (len("STOP") - 1 chars) held back
    last = tracker.update(_output(["abc "], [4], ["stop"]))
    assert last.samples[0].text == "" and last.samples[0].finish_reason == "stop"
    assert first.samples[0].text + last.samples[0].text == "abc "


def test_held_back_text_is_released_when_no_stop_string_follows():
    tracker = DeltaTracker(stop=["STOP", "xy"])
    parts = [
        tracker.update(_output([t], [i + 1], [r]))
        for i, (t, r) in enumerate(
            [("ab", None), ("abST", None), ("abSTAR", None), ("abSTARS", "length")]
        )
    ]
    texts = [p.samples[0].text for p in parts if p.samples]
    assert "".join(texts) == "abSTARS"
    assert texts[:3] == ["", "a", "bS"]  # the last len("STOP") - 1 = 3 chars wait


def test_a_finished_sample_is_reported_once():
    tracker = DeltaTracker()
    tracker.update(_output(["a", "b"], [1, 1], [None, None]))
    done0 = tracker.update(_output(["a!", "bb"], [2, 2], ["stop", None]))
    assert [s.finish_reason for s in done0.samples] == ["stop", None]
    later = tracker.update(_output(["a!", "bbb"], [2, 3], ["stop", "length"]))
    assert [s.index for s in later.samples] == [1]
    assert later.finished
