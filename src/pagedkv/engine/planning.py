"""Planning and running one request's work in a step: the half of `Scheduler` that turns
a running (or newly admitted) request into scheduled chunks.

`_schedule_decodes` takes the step's common case with a handful of operations per
sequence: a request with one sequence whose decode token fits without a
preemption (`KVCacheManager.append_token`: no new block but every `block_size` tokens,
and the block table handed out as the same list until it changes). It makes exactly the
decisions and the rows of the general path (`_plan`, `_blocks_needed`, `_run_plan`), each
as a compact `DecodeRow` tuple instead of a `ScheduledSequence`; the general path handles
everything else: prefill chunks, n > 1 samples, a block that is not free.

Standard library only (no torch), like the scheduler it is part of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from pagedkv.engine.request import Request, SeqId, Sequence
from pagedkv.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedkv.errors import OutOfBlocks
from pagedkv.memory import KVCacheManager

# One planned piece of work: (sequence, first position to compute, tokens to compute).
Plan = list[tuple[Sequence, int, int]]


@dataclass
class StepBudget:
    """Tokens left in one step. Decode tokens of running requests not yet visited are
    reserved, so prefill chunks only take what the decodes leave."""

    tokens: int
    # Decode tokens of running requests not yet visited; None until first needed (a step
    # of decodes alone never counts them: see `PlanningMixin._schedule_running_requests`).
    reserved_decodes: int | None = None

    @property
    def prefill_tokens(self) -> int:
        assert self.reserved_decodes is not None, "reserved decodes read before counted"
        return max(0, self.tokens - self.reserved_decodes)

    def refund(self, plan: Plan) -> None:
        """Give back the tokens of a plan that will not run (its decodes stay unreserved:
        its request has been visited)."""
        self.tokens += sum(num for _, _, num in plan)


class PlanningMixin:
    """Per-request planning for `Scheduler`, which owns the queues and preempts."""

    kv: KVCacheManager
    running: list[Request]
    requests: dict[str, Request]

    # Preemption and finishing live in Scheduler; declared for type checking only.
    _preempt: Callable[..., None]
    finish_sequence: Callable[..., None]

    # Tests turn the decode fast path off to compare it with the general path.
    decode_fast_path = True

    def _schedule_running_requests(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """Visit every running request in order; some may be preempted (see `Scheduler`).

        Runs of requests the decode fast path takes (`_schedule_decodes`) alternate with
        single requests for the general path (`_schedule_running`).
        """
        running = self.running
        i = 0
        while True:
            if self.decode_fast_path:
                i = self._schedule_decodes(i, out, budget)
            if i >= len(running):
                return
            if budget.reserved_decodes is None:
                # Counted when the general path first needs them: every request before i
                # has been visited, so they are exactly those of running[i:] (a victim
                # leaves from the end).
                budget.reserved_decodes = sum(
                    1
                    for r in islice(running, i, None)
                    for s in r.seqs
                    if s.is_decode and s.finish_reason is None
                )
            if self._schedule_running(i, out, budget):
                i += 1

    def _schedule_decodes(self, first: int, out: SchedulerOutput, budget: StepBudget) -> int:
        """Schedule running[first:] while each is the step's common case (see the module
        docstring), each exactly as `_schedule_running` would. Nothing is preempted here, so
        `running` does not change.

        Returns:
            The index of the first request left to the general path (it is unchanged), or
            ``len(running)``.
        """
        rows = out.decode_rows
        block_size, append_token, emit = self.kv.block_size, self.kv.append_token, rows.append
        num_before = len(rows)
        # One token each, so the budget bounds the run (what is left sees it spent).
        for request in islice(self.running, first, first + max(budget.tokens, 0)):
            seqs = request.seqs
            if request.n != 1 or len(seqs) != 1:
                break
            seq = seqs[0]
            tokens, start = seq.token_ids, seq.num_computed
            # `is_decode` and unfinished, spelled out.
            if (
                len(tokens) - start != 1
                or start < seq.prompt_len
                or not seq.is_allocated
                or seq.finish_reason is not None
            ):
                break
            seq_id, token = seq.seq_id, tokens[start]
            table = append_token(seq_id, token)
            if table is None:  # a block is needed and not free: the general path preempts
                break
            seq.num_computed = start + 1
            request.metrics.num_computed_tokens += 1
            slot = table[start // block_size] * block_size + start % block_size
            # A `DecodeRow`: past the prompt, so no prompt logprob targets.
            emit((seq_id, token, start, table, slot, request.params, request.seed))
        num_rows = len(rows) - num_before
        budget.tokens -= num_rows
        if budget.reserved_decodes:  # counted (not None) and positive: one per row
            budget.reserved_decodes = max(0, budget.reserved_decodes - num_rows)
        return first + num_rows

    def _schedule_running(self, index: int, out: SchedulerOutput, budget: StepBudget) -> bool:
        """Schedule running[index]; False when it left `running` (preempted or ended)."""
        request = self.running[index]
        plan = self._plan(request, budget)
        if not plan:
            return True
        need = self._blocks_needed(plan)
        while need > self.kv.num_free_blocks:
            victim = self.running[-1]
            if victim is not request:
                self._preempt(victim, out, budget)
                continue
            if index > 0:
                budget.refund(plan)
                self._preempt(request, out, budget, visited=True)
                return False
            # Alone in the pool: what does not fit now never will (see _run_alone).
            return self._run_alone(request, plan, out, budget)
        self._run_plan(request, plan, out, budget)
        return True

    def _run_alone(
        self, request: Request, plan: Plan, out: SchedulerOutput, budget: StepBudget
    ) -> bool:
        """Run what fits now of a request that is alone on the device.

        Chunks that do not fit wait for its other samples to finish. If nothing fits at
        all, the pool is smaller than the request: its newest blocked sample ends with
        "length", so every step makes progress.
        """
        blocked: list[Sequence] = []
        for seq, start, num in plan:
            if self._blocks_needed([(seq, start, num)]) <= self.kv.num_free_blocks:
                self._run_plan(request, [(seq, start, num)], out, budget)
            else:
                budget.tokens += num
                blocked.append(seq)
        if blocked and len(blocked) == len(plan):
            self.finish_sequence(blocked[-1], "length")
        if request.is_finished:
            out.finished_request_ids.append(request.request_id)
            return False
        return True

    def _plan(self, request: Request, budget: StepBudget) -> Plan:
        """Pick each unfinished sequence's tokens for this step and charge the budget."""
        plan: Plan = []
        for seq in request.unfinished_seqs():
            if seq.is_decode:
                budget.reserved_decodes = max(0, (budget.reserved_decodes or 0) - 1)
                if budget.tokens >= 1:
                    plan.append((seq, seq.num_computed, 1))
                    budget.tokens -= 1
                continue
            if seq.is_allocated:
                start = seq.num_computed
            elif not _uses_prefix_cache(request):
                start = 0
            else:
                start = self.kv.num_cached_tokens(seq.token_ids, salt=request.params.cache_salt)
            num = min(len(seq.token_ids) - start, budget.prefill_tokens)
            if num > 0:
                plan.append((seq, start, num))
                budget.tokens -= num
        return plan

    def _blocks_needed(self, plan: Plan) -> int:
        """Blocks the plan takes at most (copy-on-write of shared blocks included)."""
        need = 0
        for seq, start, num in plan:
            if seq.is_allocated:
                need += self.kv.num_blocks_to_append(seq.seq_id, num)
            else:
                request = self.requests[seq.seq_id[0]]
                need += self.kv.num_blocks_to_allocate(
                    seq.token_ids[: start + num],
                    use_prefix_cache=_uses_prefix_cache(request),
                    salt=request.params.cache_salt,
                )
        return need

    def _run_plan(
        self, request: Request, plan: Plan, out: SchedulerOutput, budget: StepBudget
    ) -> None:
        """Allocate or append each planned chunk and emit it. A chunk that no longer fits
        (the conservative count was not enough) waits for the next step."""
        for seq, start, num in plan:
            end = start + num
            try:
                if seq.is_allocated:
                    self.kv.append(seq.seq_id, seq.token_ids[start:end])
                else:
                    start = self.kv.allocate(
                        seq.seq_id,
                        seq.token_ids[:end],
                        use_prefix_cache=_uses_prefix_cache(request),
                        salt=request.params.cache_salt,
                    )
                    seq.is_allocated = True
                    if request.metrics.num_computed_tokens == 0 and seq.index == 0:
                        request.metrics.num_cached_tokens = start
            except OutOfBlocks:
                budget.tokens += num
                continue
            seq.num_computed = end
            request.metrics.num_computed_tokens += end - start
            if end < len(seq.token_ids):
                sample_ids: list[SeqId] = []
            elif request.is_forked:
                sample_ids = [seq.seq_id]
            else:  # the prompt's last row samples all n, which the fork then separates
                sample_ids = [(request.request_id, i) for i in range(request.n)]
            out.add(
                ScheduledSequence(
                    seq.seq_id,
                    seq.token_ids[start:end],
                    start,
                    self.kv.block_table(seq.seq_id),
                    self.kv.slot_mapping(seq.seq_id, start, end),
                    sample_ids,
                    request.params,
                    request.seed,
                    _prompt_logprob_targets(request, seq, start, end),
                )
            )


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
