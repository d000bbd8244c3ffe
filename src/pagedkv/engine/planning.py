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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice

from pagedkv.engine.request import Request, SeqId, Sequence
from pagedkv.engine.scheduler_output import SchedulerOutput, sample_ids
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
    return sum(num_decodes_of(r.seqs) for r in requests)


def num_decodes_of(seqs: Iterable[Sequence]) -> int:
    """Unfinished sequences of `seqs` whose next step is a decode."""
    return sum(1 for s in seqs if s.is_decode and s.finish_reason is None)


class StepBuilder:
    """Plans and runs one request's chunks of a step on `kv`.

    Args:
        kv: the block manager the rows' blocks come from.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def plan(self, request: Request, budget: StepBudget) -> Plan:
        """Pick each unfinished sequence's tokens for this step and charge the budget (a
        request with no running request after it: see `plan_fitting`)."""
        _, _, chunks, rest = self.plan_fitting([request], 0, budget, 0)
        return chunks if rest is None else rest

    def _plan_prefill(
        self, request: Request, seq: Sequence, budget: StepBudget, later: Iterable[Request]
    ) -> tuple[Sequence, int, int] | None:
        """`seq`'s next prompt chunk under the budget (None: no token left for it); the
        decodes of `later` requests and of `request`'s sequences after `seq` are reserved
        first when the budget has not counted them yet."""
        if budget.reserved_decodes is None:
            seqs = request.seqs
            after = next(i for i, s in enumerate(seqs) if s is seq) + 1
            budget.reserved_decodes = num_decodes(later) + num_decodes_of(seqs[after:])
        start = seq.num_computed
        if not seq.is_allocated:
            start = self.kv.num_cached_tokens(seq.token_ids) if _uses_prefix_cache(request) else 0
        num = min(len(seq.token_ids) - start, budget.prefill_tokens)
        if num <= 0:
            return None
        budget.tokens -= num
        return seq, start, num

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

    def fork_samples(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> list[SeqId]:
        """The samples of `output`'s rows in order (`requests` by id), after forking
        sequence 0 of each n > 1 prompt whose last row samples all n."""
        samples: list[SeqId] = []
        for seq_id, num in zip(output.seq_ids, output.num_samples, strict=True):
            if num == 1:  # a sequence's own sample
                samples.append(seq_id)
            elif num:  # the prompt's last row of n > 1: fork, then every sample
                request = requests[seq_id[0]]
                if not request.is_forked:
                    self.fork(request, request.seq(seq_id[1]))
                samples += sample_ids(seq_id, num)
        return samples

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
                )
        return need

    def plan_fitting(
        self, requests: list[Request], first: int, budget: StepBudget, free: int
    ) -> tuple[int, list[Request], Plan, Plan | None]:
        """Plan ``requests[first:]`` in order while their chunks surely fit `free` blocks,
        each counted at its most (a chunk of `num` tokens touches at most
        ``(num + B - 2) // B + 1`` blocks needing a new or copied block). A prefill chunk
        reserves the decodes of the requests after its own (see `StepBudget`).

        Returns:
            ``(num_fitting, chunk_requests, chunks, rest)``: how many requests surely fit
            together, their chunks (each beside its request in `chunk_requests`), and the
            plan of the request after them, which may not fit or allocates (None if all fit).
        """
        block_size, plan_prefill = self.kv.block_size, self._plan_prefill
        chunk_requests: list[Request] = []
        chunks: Plan = []
        for i in range(first, len(requests)):
            request = requests[i]
            num_before = len(chunks)
            for seq in request.seqs:
                if seq.finish_reason is not None:
                    continue
                start = seq.num_computed
                num_tokens = len(seq.token_ids)
                if num_tokens - start == 1 and seq.is_allocated and num_tokens > seq.prompt_len:
                    if budget.reserved_decodes:  # this decode is no longer reserved
                        budget.reserved_decodes -= 1
                    if budget.tokens >= 1:
                        chunks.append((seq, start, 1))
                        chunk_requests.append(request)
                        budget.tokens -= 1
                        free -= 1
                    continue
                chunk = plan_prefill(request, seq, budget, islice(requests, i + 1, None))
                if chunk is not None:
                    chunks.append(chunk)
                    chunk_requests.append(request)
                    if seq.is_allocated:
                        free -= (chunk[2] + block_size - 2) // block_size + 1
                    else:  # an allocation is counted exactly, on its own
                        free = -1
            if free < 0:
                rest = chunks[num_before:]
                del chunks[num_before:], chunk_requests[num_before:]
                return i - first, chunk_requests, chunks, rest
        return len(requests) - first, chunk_requests, chunks, None

    def run(
        self, request: Request, plan: Plan, out: SchedulerOutput, budget: StepBudget | None = None
    ) -> Plan:
        """Run `request`'s planned chunks in order and add their rows. A chunk whose blocks
        are not free changes nothing; with a `budget` it gets its tokens back (it waits for
        the next step). Returns those chunks."""
        failed: Plan = []
        for chunk in plan:
            seq, start, num = chunk
            if seq.is_allocated:
                failed += self.run_appends([request], [chunk], out)
                continue
            try:
                chunk = seq, start, num = self._allocate(request, seq, start, num)
            except OutOfBlocks:
                failed.append(chunk)
                continue
            tokens, table = seq.token_ids[start : start + num], self.kv.block_table(seq.seq_id)
            _add_rows([request], [chunk], [tokens], [table], out)
        if budget is not None:
            budget.refund(failed)
        return failed

    def run_appends(self, requests: list[Request], chunks: Plan, out: SchedulerOutput) -> Plan:
        """Run chunks of allocated sequences (``chunks[i]`` of ``requests[i]``) in order, in
        one `KVCacheManager.append_many` while their blocks are free, and add their rows.
        Returns the chunks whose blocks were not free (nothing changed for them)."""
        seq_ids = [seq.seq_id for seq, _, _ in chunks]
        new_tokens = [seq.token_ids[start : start + num] for seq, start, num in chunks]
        failed: Plan = []
        done = 0
        while done < len(chunks):
            tables = self.kv.append_many(seq_ids[done:], new_tokens[done:])
            end = done + len(tables)
            _add_rows(requests[done:end], chunks[done:end], new_tokens[done:end], tables, out)
            if end < len(chunks):
                failed.append(chunks[end])
            done = end + 1
        return failed

    def _allocate(
        self, request: Request, seq: Sequence, start: int, num: int
    ) -> tuple[Sequence, int, int]:
        """Allocate `seq` with its first ``start + num`` tokens.

        Returns:
            The chunk left to compute, from the first position not cached.

        Raises:
            OutOfBlocks: its blocks are not free; nothing changed.
        """
        end = start + num
        start = self.kv.allocate(
            seq.seq_id, seq.token_ids[:end], use_prefix_cache=_uses_prefix_cache(request)
        )
        seq.is_allocated = True
        if request.metrics.num_computed_tokens == 0 and seq.index == 0:
            request.metrics.num_cached_tokens = start
        return seq, start, end - start

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


def _add_rows(requests: list[Request], chunks: Plan, token_ids: list[list[int]],
              tables: list[list[int]], out: SchedulerOutput) -> None:  # fmt: skip
    """Record computed chunks (``chunks[i]`` of ``requests[i]``: tokens ``token_ids[i]`` in
    blocks ``tables[i]``) and add their rows."""
    num_samples: list[int] = []
    targets: dict[int, list[int]] = {}
    for i, (request, (seq, start, num)) in enumerate(zip(requests, chunks, strict=True)):
        end = seq.num_computed = start + num
        request.metrics.num_computed_tokens += num
        if end < len(seq.token_ids):
            num_samples.append(0)
        else:  # the prompt's last row of an unforked request samples all n
            num_samples.append(1 if len(request.seqs) == request.n else request.n)
        if request.prompt_logprobs is not None:
            targets[i] = _prompt_logprob_targets(request, seq, start, end)
    out.add_rows([seq.seq_id for seq, _, _ in chunks], token_ids,
                 [start for _, start, _ in chunks], tables, num_samples,
                 [r.params for r in requests], [r.seed for r in requests],
                 {i: t for i, t in targets.items() if t})  # fmt: skip


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
