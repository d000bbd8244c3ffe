"""The engine's side of structured outputs: requests waiting for their grammar, the
bitmask of each step's constrained samples, and the matchers' advance after sampling.

Nothing here runs per step while no live request carries a constraint.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from pagedkv.engine.request import Request, SeqId, Sequence
from pagedkv.engine.scheduler_output import SchedulerOutput
from pagedkv.engine.structured.compiler import StructuredOutputCompiler, create_tokenizer_info
from pagedkv.engine.structured.state import GrammarState
from pagedkv.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# How long an idle engine waits for a compile before its step returns (and runs again).
_IDLE_WAIT_S = 0.05


class TokenBitmask:
    """The allowed tokens of a step's constrained samples, filled while the model runs.

    Attributes:
        indices: the sample rows (positions in `SchedulerOutput.sample_rows()`) it masks.
        ranks_allowed_only: the rows' top logprobs list allowed tokens only (beam search
            ranks its candidates by them); otherwise they are the raw logits' top tokens.
    """

    def __init__(
        self, future: Future[torch.Tensor], indices: list[int], *, ranks_allowed_only: bool = False
    ) -> None:
        self._future = future
        self.indices = indices
        self.ranks_allowed_only = ranks_allowed_only

    def apply(self, logits: torch.Tensor) -> None:
        """Set the refused tokens' logits to -inf, in place.

        Args:
            logits: [num_samples, vocab], float32 on the CPU: one row per sample; the
                bitmask covers `vocab` columns (a padded LM head's extra ids included).
        """
        bitmask = self._future.result()  # [num_samples, ceil(vocab / 32)] int32
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=self.indices
        )


class StructuredOutputManager:
    """Holds requests until their grammar compiled, builds each step's bitmask, and
    advances the matchers with the sampled tokens."""

    def __init__(self, compiler: StructuredOutputCompiler) -> None:
        self.compiler = compiler
        # request id -> (request, its compile) while the grammar compiles
        self.pending: dict[str, tuple[Request, Future[xgr.CompiledGrammar]]] = {}
        # constrained requests in the scheduler, until they finish
        self._live: dict[str, Request] = {}
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-bitmask")

    def add(self, request: Request) -> bool:
        """Start `request`'s compile; True when it must wait (held in `pending`), False
        when its grammar is ready and the request can be scheduled now. A failed compile
        waits too: the next `pop_compiled` reports it."""
        params = request.params.structured_outputs
        assert params is not None, "only constrained requests come here"
        future = self.compiler.submit(params)
        if not future.done() or future.exception() is not None:
            self.pending[request.request_id] = (request, future)
            return True
        self._attach(request, future.result())
        return False

    def pop_compiled(
        self, *, wait: bool = False
    ) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """The pending requests whose compile ended: (ready to schedule, failed with why).

        Args:
            wait: first wait a moment for a compile to end (the engine has nothing else to
                run: without it, its loop would spin).
        """
        if wait and self.pending:
            futures = [future for _, future in self.pending.values()]
            concurrent.futures.wait(futures, _IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        ready: list[Request] = []
        failed: list[tuple[Request, BaseException]] = []
        for request_id, (request, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[request_id]
            error = future.exception()
            if error is None:
                self._attach(request, future.result())
                ready.append(request)
            else:
                failed.append((request, error))
        return ready, failed

    def abort(self, request_id: str) -> Request | None:
        """Drop a pending request; None when it is not pending."""
        entry = self.pending.pop(request_id, None)
        return None if entry is None else entry[0]

    def _attach(self, request: Request, grammar: xgr.CompiledGrammar) -> None:
        request.grammar = GrammarState(grammar)
        self._live[request.request_id] = request

    def prepare(self, step: SchedulerOutput) -> TokenBitmask | None:
        """Start filling the bitmask of `step`'s constrained samples (None: there are none).

        The fill runs in a thread while the model runs; `TokenBitmask.apply` waits for it.
        """
        if not self._live:
            return None
        self._live = {k: r for k, r in self._live.items() if not r.is_finished}
        samples = step.sample_rows()
        jobs = [
            (k, self._live[seq_id[0]], seq_id[1])
            for k, (_, seq_id, _, _) in enumerate(samples)
            if seq_id[0] in self._live
        ]
        if not jobs:
            return None
        future = self._fill_pool.submit(_fill, jobs, len(samples), self.compiler.vocab_size)
        return TokenBitmask(future, [k for k, _, _ in jobs])

    def advance(
        self, sampled: Mapping[SeqId, Any], requests: Mapping[str, Request]
    ) -> list[Sequence]:
        """Feed the sampled tokens (already appended by the scheduler) to their matchers.

        Returns:
            The unfinished sequences whose grammar has ended (their matcher terminated, or
            it refused a token): the engine finishes them.
        """
        done: list[Sequence] = []
        if not self._live:
            return done
        for request_id, index in sampled:
            request = requests[request_id]
            state = request.grammar
            if state is None or index >= len(request.seqs):
                continue
            seq = request.seqs[index]
            matcher = state.matcher(index, seq.output_token_ids)
            if index in state.refused:
                logger.error("request %s sample %d: a token its grammar refused", request_id, index)
            if not seq.is_finished and (matcher.is_terminated() or index in state.refused):
                done.append(seq)
        return done

    def close(self) -> None:
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
        self.compiler.close()


def _fill(jobs: list[tuple[int, Request, int]], num_samples: int, vocab_size: int) -> torch.Tensor:
    """The bitmask [num_samples, ceil(vocab_size / 32)] int32: row k from sample k's
    matcher (a sample not yet forked, n > 1, starts from no output)."""
    bitmask = xgr.allocate_token_bitmask(num_samples, vocab_size)
    for k, request, index in jobs:
        state = request.grammar
        assert state is not None, "attached before the request was scheduled"
        tokens = request.seqs[index].output_token_ids if index < len(request.seqs) else []
        state.matcher(index, tokens).fill_next_token_bitmask(bitmask, k)
    return bitmask


def create_structured_output_manager(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]
) -> StructuredOutputManager:
    """A manager over `tokenizer`'s vocabulary for logits of `vocab_size` columns; the
    grammars allow `stop_token_ids` (the model's EOS tokens) only where they may end."""
    info = create_tokenizer_info(
        tokenizer.backend, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    return StructuredOutputManager(StructuredOutputCompiler(info))
