"""Turning requests' work in a step into block-manager calls and rows of the step.

`StepBuilder` plans each unfinished sequence's chunk (a decode token or the next prompt
chunk) under the step's `StepBudget`, and runs the chunks of requests that surely fit the
free blocks together: one `KVCacheManager.append_many`, then their rows a column at a time.
`Scheduler` decides which requests run and preempts; beam search builds its steps with the
same builder. Standard library only (no torch), like the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain, islice

from pagedkv.engine.request import Request, SeqId, Sequence
from pagedkv.engine.scheduler_output import SchedulerOutput, sample_ids
from pagedkv.errors import OutOfBlocks
from pagedkv.memory import KVCacheManager

# One planned piece of work: (sequence, first position to compute, tokens to compute).
Chunk = tuple[Sequence, int, int]
Plan = list[Chunk]


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


def num_decodes(seqs: Iterable[Sequence]) -> int:
    """Unfinished sequences of `seqs` whose next step is a decode."""
    return sum(1 for s in seqs if s.is_decode and s.finish_reason is None)


class StepBuilder:
    """Plans and runs requests' chunks of a step on `kv`, the block manager of their rows."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def plan(self, request: Request, budget: StepBudget) -> Plan:
        """Pick each unfinished sequence's tokens for this step and charge the budget (a
        request with no running request after it: see `plan_fitting`)."""
        _, _, chunks, rest = self.plan_fitting([request], 0, budget, 0)
        return chunks if rest is None else rest

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

    def fitting_part(self, request: Request, chunk: Chunk, free: int) -> Chunk:
        """The longest leading part of `chunk` whose blocks fit `free` blocks (0 tokens:
        none): a sliding window frees old blocks as a prefill goes, so a part may fit."""
        seq, start, num = chunk
        while num and self.blocks_needed(request, [(seq, start, num)]) > free:
            num //= 2
        return seq, start, num

    def plan_fitting(
        self, requests: list[Request], first: int, budget: StepBudget, free: int
    ) -> tuple[int, list[Request], Plan, Plan | None]:
        """Plan ``requests[first:]`` in order (each unfinished sequence's decode token or
        next prompt chunk, charged to the budget) while their chunks surely fit `free`
        blocks, each counted at its most: a chunk of `num` tokens takes at most
        ``(num + B - 2) // B + 1`` new or copied blocks (1 for a decode token) in each of the
        manager's KV cache groups.

        Returns:
            ``(num_fitting, chunk_requests, chunks, rest)``: how many requests surely fit,
            their chunks (each beside its request in `chunk_requests`), and the plan of the
            request after them, which may not fit or allocates (None if all fit).
        """
        block_size, num_groups = self.kv.block_size, self.kv.num_groups
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
                    if budget.tokens < 1:
                        continue
                    budget.tokens -= 1
                    free -= num_groups
                    chunk = (seq, start, 1)
                else:  # a prompt chunk, after reserving the decodes not yet visited
                    if budget.reserved_decodes is None:
                        after = next(j for j, s in enumerate(request.seqs) if s is seq) + 1
                        later = (r.seqs for r in islice(requests, i + 1, None))
                        budget.reserved_decodes = num_decodes(chain(request.seqs[after:], *later))
                    if not seq.is_allocated:
                        start = self._num_cached(request, seq)
                    num = min(num_tokens - start, budget.prefill_tokens)
                    if num <= 0:
                        continue
                    budget.tokens -= num
                    if not seq.is_allocated:  # an allocation is counted exactly, alone
                        free = -1
                    free -= ((num + block_size - 2) // block_size + 1) * num_groups
                    chunk = (seq, start, num)
                chunks.append(chunk)
                chunk_requests.append(request)
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
            try:  # `allocate` returns the tokens cached: the row starts after them
                cached = self.kv.allocate(seq.seq_id, seq.token_ids[: start + num],
                                          use_prefix_cache=_uses_prefix_cache(request),
                                          salt=request.params.cache_salt)  # fmt: skip
            except OutOfBlocks:
                failed.append(chunk)
                continue
            seq.is_allocated = True
            if request.metrics.num_computed_tokens == 0 and seq.index == 0:
                request.metrics.num_cached_tokens = cached
            tokens, table = seq.token_ids[cached : start + num], self.kv.block_table(seq.seq_id)
            row = [(seq, cached, start + num - cached)]
            _add_rows([request], row, [seq.seq_id], [tokens], [table], out)
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
            rows = slice(done, end)
            _add_rows(requests[rows], chunks[rows], seq_ids[rows], new_tokens[rows], tables, out)
            if end < len(chunks):
                failed.append(chunks[end])
            done = end + 1
        return failed


def _add_rows(requests: list[Request], chunks: Plan, seq_ids: list[SeqId],
              token_ids: list[list[int]], tables: list[list[int]],
              out: SchedulerOutput) -> None:  # fmt: skip
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
    out.add_rows(seq_ids, token_ids,
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
