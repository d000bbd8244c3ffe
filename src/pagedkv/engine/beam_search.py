"""Beam search on the paged KV cache: beams share blocks through `fork`, dropped beams are freed.

`BeamSelector` picks the beams as transformers does. Each prompt is a `Request` whose
sequences are its live beams; every step is built by the scheduler's `StepBuilder` (prompt
chunks and one decode token per beam, the blocks they take). Memory: each surviving
candidate forks its parent's blocks to a new sequence, then every old beam is freed, and
the next step appends each new beam's token. A parent with one survivor thus hands over its
blocks without a copy; siblings share all blocks up to where they diverge and the shared
partial last block is copied on write (`KVCacheManager.pop_copies`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from math import inf
from typing import TYPE_CHECKING, Literal

from pagedkv.engine.beam_selector import Beam, BeamSelector, EarlyStopping
from pagedkv.engine.planning import StepBudget, StepBuilder
from pagedkv.engine.request import Request, SeqId
from pagedkv.engine.request import Sequence as BeamSequence
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedkv.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    import torch

    from pagedkv.engine.engine import LLMEngine, PromptType
    from pagedkv.engine.sampler import SampleResult
    from pagedkv.engine.structured.manager import TokenBitmask
    from pagedkv.engine.structured.state import BeamMatchers


@dataclass
class BeamSearchSequence:
    """One finished beam.

    Attributes:
        tokens: prompt + generated token ids (vLLM's `BeamSearchSequence.tokens`).
        token_ids: the generated token ids (an ending EOS is kept).
        logprobs: per generated token, its logprob (float32 log-softmax of the raw logits).
        cum_logprob: sum of `logprobs`.
        score: `cum_logprob / len(token_ids) ** length_penalty`, the ranking key.
        text: the detokenized generated tokens ("" without a tokenizer).
        finish_reason: "stop" (ended with EOS) or "length" (reached max_tokens).
    """

    tokens: list[int]
    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: Literal["stop", "length"] = "length"


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (`sequences[0]` is the answer)."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


@dataclass
class _PromptSearch:
    """One prompt's search: `request.seqs` are the live beams' sequences (`beams` in the
    same order), its params what the runner samples their rows with."""

    prompt: str | None
    request: Request
    selector: BeamSelector
    num_reserved_blocks: int
    beams: list[Beam] = field(default_factory=list)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_prefilling(self) -> bool:
        return self.request.seqs[0].num_computed < len(self.prompt_token_ids)


class BeamSearchRun:
    """Runs beam search for a batch of prompts on an idle engine, step by step.

    Every step schedules one decode token per live beam (all prompts together) and prompt
    chunks of newly admitted prompts under the token budget (the scheduler's `StepBuilder`),
    runs them through the engine's `ModelRunner` in one forward pass (applying copy-on-write
    copies first), and advances each prompt's `BeamSelector`. A prompt is admitted only
    when the blocks it could need in the worst case (no sharing after the prompt) fit beside
    those of the admitted ones, so `append` never runs out of blocks.

    Args and Raises: as `beam_search`.

    Attributes:
        peak_num_used_blocks: most blocks held at once (after any step).
        num_steps: forward passes run.
        min_margins: per prompt, its selector's `min_margin` (closest call it made).
    """

    def __init__(
        self,
        engine: LLMEngine,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        *,
        early_stopping: EarlyStopping = False,
    ) -> None:
        if engine.has_unfinished_requests():
            raise ValueError("beam_search: expected an idle engine, got unfinished requests")
        self.engine = engine
        self.params = params
        self.early_stopping = early_stopping
        self.manager = engine.kv_manager
        self.builder = StepBuilder(self.manager)
        self.block_size = self.manager.block_size
        self.max_num_batched_tokens = engine.config.scheduler.max_num_batched_tokens
        # One row per live beam, each a sequence of the step.
        self.max_num_beams = min(engine.config.scheduler.max_num_seqs, self.max_num_batched_tokens)
        # A constrained beam ends where its grammar does: only EOS is allowed there.
        self.matchers = _beam_matchers(engine, params)
        ends = not params.ignore_eos or self.matchers is not None
        eos = tuple(sorted(engine.scheduler.eos_token_ids)) if ends else ()
        self._searches = [self._new_search(i, p, eos) for i, p in enumerate(prompts)]
        self._serial = itertools.count()
        self.peak_num_used_blocks = 0
        self.num_steps = 0

    def _new_search(self, index: int, prompt: PromptType, eos: tuple[int, ...]) -> _PromptSearch:
        text, token_ids = self.engine.tokenize_prompt(prompt)  # same prompt forms as generate()
        if not token_ids:
            raise ValueError(f"prompt {index}: expected at least one token, got none")
        k, num_new = self.params.beam_width, self.params.max_tokens
        if len(token_ids) + num_new > self.engine.max_model_len:
            raise ValueError(
                f"prompt {index}: expected prompt + max_tokens <= "
                f"{self.engine.max_model_len} (max_model_len), "
                f"got {len(token_ids)} + {num_new}"
            )
        # Full prompt blocks are shared by every beam; past them each beam may own blocks.
        reserved = self.manager.num_groups * (
            len(token_ids) // self.block_size
            + k * -(-(len(token_ids) % self.block_size + num_new) // self.block_size)
        )
        if reserved > self.manager.num_blocks:
            raise ValueError(
                f"beam_search: prompt {index} needs up to {reserved} blocks for "
                f"{k} beams, expected at most {self.manager.num_blocks} (the pool)"
            )
        selector = BeamSelector(k, num_new, eos, self.params.length_penalty, self.early_stopping)
        num_logprobs = min(selector.num_candidates, self.engine.model_config.vocab_size)
        # Greedy with the top logprobs: the runner hands back each beam's candidates.
        params = SamplingParams(
            temperature=0.0, max_tokens=num_new, logprobs=num_logprobs, ignore_eos=True
        )
        request_id = f"beam-search-{id(self)}-{index}"
        request = Request(request_id, token_ids, params, arrival_time=0.0, arrival_index=index)
        return _PromptSearch(text, request, selector, reserved)

    def run(self) -> list[BeamSearchOutput]:
        """Search every prompt to the end; every block is free again afterwards.

        Returns:
            Per prompt, in input order, its beams best first.

        Raises:
            Whatever the model run raises; the beams' blocks are freed first and the prefix
            cache is reset (it may index blocks whose KV that step never wrote).
        """
        waiting = deque(self._searches)
        active: list[_PromptSearch] = []
        try:
            while waiting or active:
                self._admit(waiting, active)
                step = self._schedule(active)
                if self.engine.prefix_tier is not None:  # evicted blocks out before writes
                    self.engine.prefix_tier.save_evicted()
                results = self.engine.runner.execute(step, self._bitmask(step))
                self.num_steps += 1
                for search in [s for s in active if s.beams and s.beams[0].seq_id in results]:
                    self._advance(search, results)
                    if search.selector.is_done:
                        self._release(search)
                        active.remove(search)
                used = self.manager.num_blocks - self.manager.num_free_blocks
                self.peak_num_used_blocks = max(self.peak_num_used_blocks, used)
                if self.engine.debug:
                    self.manager.check()
        except BaseException:
            for search in active:
                self._release(search)
            self.manager.reset_prefix_cache()
            raise
        return [self._output(s) for s in self._searches]

    @property
    def min_margins(self) -> list[float]:
        return [s.selector.min_margin for s in self._searches]

    def _admit(self, waiting: deque[_PromptSearch], active: list[_PromptSearch]) -> None:
        reserved = sum(s.num_reserved_blocks for s in active)
        while waiting:
            search = waiting[0]
            fits = (
                reserved + search.num_reserved_blocks <= self.manager.num_blocks
                and (len(active) + 1) * self.params.beam_width <= self.max_num_beams
            )
            if active and not fits:
                return
            waiting.popleft()
            active.append(search)
            reserved += search.num_reserved_blocks
            search.beams = [Beam((search.request_id, next(self._serial)))]
            if self.matchers is not None:
                self.matchers.start(search.beams[0].seq_id)
            prompt = search.prompt_token_ids
            search.request.seqs = [BeamSequence(search.beams[0].seq_id, list(prompt), len(prompt))]

    def _schedule(self, active: list[_PromptSearch]) -> SchedulerOutput:
        """Decode tokens of every live beam first, then prompt chunks under the budget."""
        out = SchedulerOutput(self.block_size, num_groups=self.manager.num_groups)
        budget = StepBudget(self.max_num_batched_tokens, reserved_decodes=0)
        for search in sorted(active, key=lambda s: s.is_prefilling):  # stable: decodes first
            request = search.request
            self.builder.run(request, self.builder.plan(request, budget), out, budget)
        out.copies = self.manager.pop_copies()
        return out

    def _advance(self, search: _PromptSearch, results: Mapping[SeqId, SampleResult]) -> None:
        """Select the next beams; fork survivors, free the old beams, append the new tokens."""
        # A token the grammar refuses has logprob -inf in a constrained beam's top list.
        tops = [
            sorted(
                ((t, lp) for t, lp in (results[b.seq_id].top_logprobs or {}).items() if lp > -inf),
                key=lambda pair: -pair[1],
            )
            for b in search.beams
        ]
        running = search.selector.step(search.beams, tops)
        if search.selector.is_done:
            return
        new_beams, prompt = [], search.prompt_token_ids
        for candidate in running:
            parent = search.beams[candidate.parent]
            child = Beam(
                (search.request_id, next(self._serial)),
                [*parent.token_ids, candidate.token_id],
                [*parent.logprobs, candidate.logprob],
                candidate.cum_logprob,
            )
            self.manager.fork(parent.seq_id, child.seq_id)
            if self.matchers is not None:
                self.matchers.fork(parent.seq_id, child.seq_id, candidate.token_id)
            new_beams.append(child)
        # Free before the next step appends: a block only the child still holds is then
        # written in place, and only blocks shared by surviving siblings are copied.
        for beam in search.beams:
            self._free(beam.seq_id)
        search.beams = new_beams
        search.request.seqs = [
            BeamSequence(
                b.seq_id,
                [*prompt, *b.token_ids],
                len(prompt),
                len(prompt) + len(b.token_ids) - 1,
                is_allocated=True,
            )
            for b in new_beams
        ]

    def _release(self, search: _PromptSearch) -> None:
        for beam in search.beams:
            if beam.seq_id in self.manager:
                self._free(beam.seq_id)
        search.beams = []

    def _free(self, seq_id: SeqId) -> None:
        self.manager.free(seq_id)
        if self.matchers is not None:
            self.matchers.drop(seq_id)

    def _bitmask(self, step: SchedulerOutput) -> TokenBitmask | None:
        """The allowed tokens of each beam's row, when the search is constrained."""
        if self.matchers is None:
            return None
        from pagedkv.engine.structured.manager import TokenBitmask

        seq_ids = [seq_id for _, seq_id, _, _ in step.sample_rows()]
        future: Future[torch.Tensor] = Future()
        future.set_result(
            self.matchers.fill(seq_ids, self.engine.structured_outputs.compiler.vocab_size)
        )
        return TokenBitmask(future, list(range(len(seq_ids))), ranks_allowed_only=True)

    def _output(self, search: _PromptSearch) -> BeamSearchOutput:
        tokenizer = self.engine.tokenizer
        sequences = [
            BeamSearchSequence(
                tokens=[*search.prompt_token_ids, *h.token_ids],
                token_ids=list(h.token_ids),
                logprobs=list(h.logprobs),
                cum_logprob=h.cum_logprob,
                score=h.score,
                text=tokenizer.decode(list(h.token_ids)) if tokenizer is not None else "",
                finish_reason="stop" if h.ended_with_eos else "length",
            )
            for h in search.selector.finished
        ]
        return BeamSearchOutput(search.prompt, search.prompt_token_ids, sequences)


def _beam_matchers(engine: LLMEngine, params: BeamSearchParams) -> BeamMatchers | None:
    """The beams' matchers of a constrained search (its grammar compiled now), else None."""
    if params.structured_outputs is None:
        return None
    from pagedkv.engine.structured.state import BeamMatchers

    return BeamMatchers(engine.structured_outputs.compiler.compile(params.structured_outputs))


def beam_search(
    engine: LLMEngine,
    prompts: Sequence[PromptType],
    params: BeamSearchParams,
    *,
    early_stopping: EarlyStopping = False,
) -> list[BeamSearchOutput]:
    """Beam search over `prompts` on `engine`'s model and paged KV cache.

    Args:
        engine: an idle `LLMEngine` (no unfinished requests).
        prompts: a list of prompts: text, token ids, {"prompt_token_ids": [...]} or
            {"prompt": str}.
        early_stopping: transformers' `early_stopping` (True, False or "never").

    Returns:
        Per prompt, in input order, a `BeamSearchOutput` whose `sequences` are its
        `beam_width` beams, best (highest length-penalized score) first.

    Raises:
        ValueError: bad prompt, busy engine, a prompt whose beams cannot fit the pool, or
            a constraint that does not compile.
    """
    if isinstance(prompts, (str, dict)):
        raise ValueError(f"prompts: expected a list of prompts, got {type(prompts).__name__}")
    return BeamSearchRun(engine, prompts, params, early_stopping=early_stopping).run()
