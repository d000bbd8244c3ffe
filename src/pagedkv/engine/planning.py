"""Turning one request's work in a step into block-manager calls and rows of the step.

`StepBuilder` plans each unfinished sequence's chunk (a decode token or the next prompt
chunk) under the step's `StepBudget`, counts the blocks the plan needs, and runs it:
`KVCacheManager.allocate` or `append`, then one row per chunk in the `SchedulerOutput`.
`Scheduler` decides which requests run and preempts; beam search builds its steps with the
same builder. The common case, a request with one sequence decoding one token, takes the
same calls as every other: each is cheap when nothing but a token changes.

Standard library only (no torch), like the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.scheduler_output import SchedulerOutput
from pagedkv.errors import OutOfBlocks
from pagedkv.memory import KVCacheManager

# One planned piece of work: (sequence, first position to compute, tokens to compute).
Plan = list[tuple[Sequence, int, int]]


@dataclass(slots=True)
class StepBudget:
    """Tokens left in one step. Decode tokens of running requests not yet visited are
    reserved, so prefill chunks only take what the decodes leave."""

    tokens: int
    # Decode tokens of running requests not yet visited; None until a prefill chunk first
    # needs them (a step of decodes alone never counts them).
    reserved_decodes: int | None = None

    @property
    def prefill_tokens(self) -> int:
        assert self.reserved_decodes is not None, "reserved decodes read before counted"
        return max(0, self.tokens - self.reserved_decodes)

    def refund(self, plan: Plan) -> None:
        """Give back the tokens of a plan that will not run (its decodes stay unreserved:
        its request has been visited)."""
        self.tokens += sum(num for _, _, num in plan)


def num_decodes(requests: Iterable[Request]) -> int:
    """Unfinished sequences of `requests` whose next step is a decode."""
    return sum(1 for r in requests for s in r.seqs if s.is_decode and s.finish_reason is None)


class StepBuilder:
    """Plans and runs one request's chunks of a step on `kv`.

    Args:
        kv: the block manager the rows' blocks come from.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def plan(
        self,
        request: Request,
        budget: StepBudget,
        running: Iterable[Request] = (),
        first: int = 0,
    ) -> Plan:
        """Pick each unfinished sequence's tokens for this step and charge the budget.

        ``running[first:]``: the running requests visited after `request`, whose decodes a
        prefill chunk reserves when the budget has not counted them yet.
        """
        plan: Plan = []
        for i, seq in enumerate(request.seqs):
            if seq.finish_reason is not None:
                continue
            start = seq.num_computed
            num_tokens = len(seq.token_ids)
            if num_tokens - start == 1 and seq.is_allocated and num_tokens > seq.prompt_len:
                if budget.reserved_decodes:  # this decode is no longer reserved
                    budget.reserved_decodes -= 1
                if budget.tokens >= 1:
                    plan.append((seq, start, 1))
                    budget.tokens -= 1
                continue
            if budget.reserved_decodes is None:  # this request's later decodes too
                later_seqs = [s for s in request.seqs[i + 1 :] if s.is_decode and not s.is_finished]
                others = islice(running, first, None)
                budget.reserved_decodes = num_decodes(others) + len(later_seqs)
            if not seq.is_allocated:
                start = self._num_cached(request, seq)
            num = min(num_tokens - start, budget.prefill_tokens)
            if num > 0:
                plan.append((seq, start, num))
                budget.tokens -= num
        return plan

    def fork(self, request: Request, parent: Sequence) -> None:
        """Add sequences 1..n-1 to `request`, each sharing every block of `parent` (no copy).

        A child starts with the parent's tokens and computed count; a shared partial last
        block is copied on the first append to either (queued for the next step's copies).
        """
        for index in range(1, request.n):
            child = Sequence(
                (request.request_id, index),
                list(parent.token_ids),
                parent.prompt_len,
                num_computed=parent.num_computed,
                is_allocated=True,
            )
            self.kv.fork(parent.seq_id, child.seq_id)
            request.seqs.append(child)

    def _num_cached(self, request: Request, seq: Sequence) -> int:
        """Leading tokens of an unallocated `seq` found cached under the request's salt."""
        if not _uses_prefix_cache(request):
            return 0
        return self.kv.num_cached_tokens(seq.token_ids, salt=request.params.cache_salt)

    def blocks_needed(self, request: Request, plan: Plan) -> int:
        """Blocks the plan takes at most (copy-on-write of shared blocks included)."""
        need = 0
        for seq, start, num in plan:
            if seq.is_allocated:
                need += self.kv.num_blocks_to_append(seq.seq_id, num)
            else:
                need += self.kv.num_blocks_to_allocate(
                    seq.token_ids,
                    use_prefix_cache=_uses_prefix_cache(request),
                    num_tokens=start + num,
                    salt=request.params.cache_salt,
                )
        return need

    def run(self, request: Request, plan: Plan, out: SchedulerOutput, budget: StepBudget) -> None:
        """Run each planned chunk (`run_chunk`). A chunk that no longer fits (the
        conservative count was not enough) waits for the next step."""
        for chunk in plan:
            try:
                self.run_chunk(request, chunk, out)
            except OutOfBlocks:
                budget.tokens += chunk[2]

    def run_chunk(
        self, request: Request, chunk: tuple[Sequence, int, int], out: SchedulerOutput
    ) -> None:
        """Allocate or append one planned chunk and add its row.

        Raises:
            OutOfBlocks: its blocks are not free; nothing changed.
        """
        seq, start, num = chunk
        end = start + num
        if seq.is_allocated:
            token_ids = seq.token_ids[start:end]
            table = self.kv.append(seq.seq_id, token_ids)
        else:
            start = self._allocate(request, seq, end)
            table = self.kv.block_table(seq.seq_id)
            token_ids = seq.token_ids[start:end]
        seq.num_computed = end
        request.metrics.num_computed_tokens += end - start
        if end < len(seq.token_ids):
            num_samples = 0
        else:  # the prompt's last row of an unforked request samples all n
            num_samples = 1 if len(request.seqs) == request.n else request.n
        targets = None
        if request.prompt_logprobs is not None:
            targets = _prompt_logprob_targets(request, seq, start, end)
        out.add_row(seq.seq_id, token_ids, start, table, num_samples,
                    request.params, request.seed, targets)  # fmt: skip

    def _allocate(self, request: Request, seq: Sequence, end: int) -> int:
        """Allocate `seq` with its first `end` tokens; returns the first position to compute."""
        start = self.kv.allocate(
            seq.seq_id,
            seq.token_ids[:end],
            use_prefix_cache=_uses_prefix_cache(request),
            salt=request.params.cache_salt,
        )
        seq.is_allocated = True
        if request.metrics.num_computed_tokens == 0 and seq.index == 0:
            request.metrics.num_cached_tokens = start
        return start

    def run_alone(
        self, request: Request, plan: Plan, out: SchedulerOutput, budget: StepBudget
    ) -> Sequence | None:
        """Run what fits now of a request that is alone on the device.

        Chunks that do not fit wait for its other samples to finish. If nothing fits at
        all, the pool is smaller than the request.

        Returns:
            The newest blocked sample when nothing fit (to end with "length", so every step
            makes progress), else None.
        """
        blocked: list[Sequence] = []
        for chunk in plan:
            if self.blocks_needed(request, [chunk]) <= self.kv.num_free_blocks:
                self.run(request, [chunk], out, budget)
            else:
                budget.tokens += chunk[2]
                blocked.append(chunk[0])
        return blocked[-1] if blocked and len(blocked) == len(plan) else None


def _uses_prefix_cache(request: Request) -> bool:
    """A request asking for prompt logprobs takes no prefix-cache hit: a cached block has
    no logits, so its whole prompt is computed (its full blocks still enter the cache)."""
    return request.params.prompt_logprobs is None


def _prompt_logprob_targets(request: Request, seq: Sequence, start: int, end: int) -> list[int]:
    """The prompt tokens that follow rows start..end-1, while prompt logprobs are missing."""
    logprobs = request.prompt_logprobs
    if logprobs is None or seq.index != 0 or len(logprobs) >= seq.prompt_len:
        return []
    return seq.token_ids[start + 1 : min(end, seq.prompt_len - 1) + 1]
