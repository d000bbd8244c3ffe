"""Beam selection, torch-free: which continuations survive a step (transformers' rules).

`BeamSelector` follows Hugging Face transformers' `generate(num_beams=k, do_sample=False)`
step for step (its vectorized `_beam_search`), per prompt:

    candidates  top K = max(2, 1 + num_eos) x k of (beam cum_logprob + logprob of next token)
                over every live beam and the whole vocabulary (each beam's top K suffice)
    running     the best k candidates that do not end (EOS, or max_tokens reached)
    finished    ending candidates ranked < k, scored cum_logprob / generated_len ** length_penalty
                (EOS counted), merged with earlier ones, best k kept
    stop        when no running beam can beat the worst of k finished (early_stopping False:
                at the current length; "never": at max_tokens if length_penalty > 0), when
                k are finished (early_stopping True), or at max_tokens

The paged machinery that runs the beams (fork, free, append) lives in `beam_search.py`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pagedkv.engine.request import SeqId

EarlyStopping = bool | Literal["never"]


@dataclass
class Beam:
    """A live beam: a sequence in the KV cache manager and the tokens it generated."""

    seq_id: SeqId  # (the search's request id, serial)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """A beam extended by one token."""

    cum_logprob: float
    parent: int  # index into the live beams
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Hypothesis:
    """A finished candidate with its length-penalized score."""

    score: float
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cum_logprob: float
    ended_with_eos: bool


class BeamSelector:
    """One prompt's beam bookkeeping, by the rules above.

    Args:
        beam_width: k, the number of beams.
        max_tokens: new tokens per beam at most.
        eos_token_ids: tokens that end a beam (empty when EOS is ignored).
        length_penalty: exponent of the generated length in the final score.
        early_stopping: True, False or "never", as in `GenerationConfig.early_stopping`.

    Raises:
        ValueError: `early_stopping` is not one of those.
    """

    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        eos_token_ids: Sequence[int] = (),
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
    ) -> None:
        if early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping: expected True, False or 'never', got {early_stopping!r}"
            )
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        # Keep more candidates than beams so that k survive even if the top k all end.
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * beam_width
        self.finished: list[Hypothesis] = []  # best first, at most beam_width
        self.num_generated = 0
        self.is_done = False
        # Smallest gap between adjacent ranked scores that decided anything: below float
        # rounding the choice is arbitrary (other implementations may pick the other one).
        self.min_margin = math.inf

    def step(
        self, beams: Sequence[Beam], top_logprobs: Sequence[Sequence[tuple[int, float]]]
    ) -> list[Candidate]:
        """Advance one token: rank the candidates, record the finished ones, pick the runners.

        Args:
            beams: the live beams (all with `num_generated` tokens).
            top_logprobs: per beam, its best `num_candidates` (token id, logprob) pairs, best
                first (fewer only when the vocabulary is smaller).

        Returns:
            The candidates that keep running, best first (empty once `is_done`).

        Raises:
            ValueError: `beams` and `top_logprobs` disagree in length, or the search is done.
        """
        if self.is_done:
            raise ValueError("expected a running beam search, got a finished one")
        if len(beams) != len(top_logprobs) or not beams:
            raise ValueError(
                f"expected top logprobs for each of {len(beams)} beams, got {len(top_logprobs)}"
            )
        ranked = sorted(
            (
                Candidate(beam.cum_logprob + lp, i, token, lp)
                for i, (beam, pairs) in enumerate(zip(beams, top_logprobs, strict=True))
                for token, lp in pairs
            ),
            key=lambda c: -c.cum_logprob,
        )[: self.num_candidates]
        length = self.num_generated + 1
        ends = [c.token_id in self.eos_token_ids or length >= self.max_tokens for c in ranked]
        self._record_finished(beams, ranked, ends, length)
        kept = [i for i, end in enumerate(ends) if not end][: self.beam_width]
        running = [ranked[i] for i in kept]
        # The ranking decided which candidates finish (top k) and where the runners stop.
        last = max(self.beam_width, kept[-1] + 1 if kept else len(ranked))
        self._note_margins([c.cum_logprob for c in ranked[: last + 1]])
        self.num_generated = length
        full = len(self.finished) == self.beam_width
        self.is_done = (
            not running or not self._can_improve(running) or (full and self.early_stopping is True)
        )
        return [] if self.is_done else running

    def _record_finished(
        self, beams: Sequence[Beam], ranked: list[Candidate], ends: list[bool], length: int
    ) -> None:
        # Only candidates ranked within the top k may finish; the rest are spares that let
        # k beams keep running.
        new = [
            Hypothesis(
                c.cum_logprob / length**self.length_penalty,
                (*beams[c.parent].token_ids, c.token_id),
                (*beams[c.parent].logprobs, c.logprob),
                c.cum_logprob,
                c.token_id in self.eos_token_ids,
            )
            for c, end in zip(ranked[: self.beam_width], ends[: self.beam_width], strict=True)
            if end
        ]
        if new:
            merged = sorted(self.finished + new, key=lambda h: -h.score)
            self._note_margins([h.score for h in merged[: self.beam_width + 1]])
            self.finished = merged[: self.beam_width]

    def _note_margins(self, scores: list[float]) -> None:
        gaps = [a - b for a, b in itertools.pairwise(scores)]
        self.min_margin = min([self.min_margin, *gaps])

    def _can_improve(self, running: list[Candidate]) -> bool:
        # transformers' early-stop heuristic: once k beams are finished, stop when the best
        # running beam cannot beat the worst finished one at the most favourable length.
        if len(self.finished) < self.beam_width:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        best_possible = running[0].cum_logprob / best_length**self.length_penalty
        return best_possible > self.finished[-1].score
