"""Continuous batching over the paged KV cache (standard library only: no torch).

One `schedule()` call decides one step (docs/architecture.md, "One schedule()"):

1. running requests, in `running` order (a request past the thrash bound sits ahead of the
   others), each sequence its decode token or next prefill chunk; the decodes of requests
   not yet visited are reserved out of the token budget. While a request's blocks are not
   free the newest running request is preempted (recompute or swap); the newest itself is
   preempted, unless alone: then what fits runs, and if nothing does its newest blocked
   sample ends with "length".
2. if nothing was preempted: swapped-out requests come back in the order they left;
3. then, once none is left swapped out, waiting requests are admitted from the head of the
   queue while the token budget, `max_num_seqs` and the free blocks (less a 1 % watermark)
   allow, each with the blocks of its first chunk only;
4. the copy-on-write copies queued by the appends close the step.

Invariant: preemptions are decided before appending to a sequence in a step: requests are
visited in order and victims come from the end. `append` makes full blocks prefix-cacheable
at once, so a freed block whose KV was never written must not stay in the prefix cache.
Planning and rows live in `pagedkv.engine.planning` (`StepBuilder`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping

from pagedkv.config import SchedulerConfig
from pagedkv.engine.outputs import FinishReason
from pagedkv.engine.planning import Plan, StepBudget, StepBuilder, num_decodes
from pagedkv.engine.request import Request, RequestStatus, SeqId, Sequence, check_fits
from pagedkv.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedkv.engine.stop import check_stop, stop_bounds
from pagedkv.memory import KVCacheManager

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Decides, step by step, which tokens run and which blocks they use."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        *,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        detokenize: Callable[[Sequence], str] | None = None,
    ) -> None:
        """Start with empty queues over `kv_manager`.

        Args:
            config: batch limits, preemption mode, thrash bound.
            kv_manager: the device pool (the scheduler owns its seq ids); a request that
                never fits it is rejected.
            max_model_len: longest sequence (prompt + output) the model accepts.
            eos_token_ids: tokens that end a completion unless `ignore_eos`.
            detokenize: the text of a sequence's newest token; `update` appends it to
                `Sequence.text` before the stop checks. None (no tokenizer): no text, and
                stop strings never match.
        """
        self.config = config
        self.kv = kv_manager
        self.builder = StepBuilder(kv_manager)
        self.max_model_len = max_model_len
        self._eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swapped_out = 0
        # Keep a little room when admitting next to running requests, so their next decode
        # tokens do not immediately force a preemption.
        self._watermark = max(1, kv_manager.num_blocks // 100)

    # ---- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            ValueError: duplicate id, empty prompt, or a prompt that can never run
                (no room for one new token within `max_model_len` or the whole pool).
        """
        self.check_request(request)
        self._set_stop_bounds(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise as `add_request` would, changing nothing."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        check_fits(
            request,
            max_model_len=self.max_model_len,
            num_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            max_num_seqs=self.config.max_num_seqs,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end a completion unless `ignore_eos` (settable: live requests follow)."""
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids: Iterable[int]) -> None:
        self._eos_token_ids = frozenset(token_ids)
        for request in self.requests.values():
            self._set_stop_bounds(request)

    def _set_stop_bounds(self, request: Request) -> None:
        request.stop_bounds = stop_bounds(
            request.params,
            eos_token_ids=self._eos_token_ids,
            max_model_len=self.max_model_len,
            prompt_len=len(request.prompt_token_ids),
        )

    def abort_request(self, request_id: str) -> Request | None:
        """End a request now and give its blocks back; None for an unknown id."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.unfinished_seqs():
            self.finish_sequence(seq, "abort")
        return request

    def finish_sequence(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Mark `seq` finished and free its blocks; the request leaves once all are done."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.is_allocated or seq.is_swapped:
            self.kv.free(seq.seq_id)
            seq.is_allocated = seq.is_swapped = False
        request = self.requests[seq.seq_id[0]]
        if request.is_finished:
            for queue in (self.running, self.waiting, self.swapped):
                if request in queue:
                    queue.remove(request)
            request.status = RequestStatus.FINISHED
            del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: waiting for admission, preempted, or swapped out."""
        return len(self.waiting) + len(self.swapped)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring for the order)."""
        out = SchedulerOutput(self.kv.block_size, num_groups=self.kv.num_groups)
        budget = StepBudget(self.config.max_num_batched_tokens)
        index = 0
        while index < len(self.running):  # some may be preempted (see the module docstring)
            index = self._schedule_running(index, out, budget)
        budget.reserved_decodes = 0  # every running request has been visited
        if not out.preempted_request_ids:
            self._resume_swapped(out, budget)
            # Swapped-out requests come back before anything newer takes their blocks.
            if not self.swapped:
                self._admit_waiting(out, budget)
        out.copies = self.kv.pop_copies()
        return out

    def update(self, output: SchedulerOutput, sampled: Mapping[SeqId, int]) -> list[Request]:
        """Record the tokens sampled by the step `output` described: the step's postprocess.

        Forks sequence 0 to its siblings when an n > 1 prompt produced its first tokens,
        appends each sampled token and its text (`detokenize`), and finishes the sequences
        `check_stop` ends (EOS, a stop token id, a stop string, `max_tokens`,
        `max_model_len`), freeing their blocks at once.

        Returns:
            The request of each new token, in step order (once per sample).
        """
        samples = output.seq_ids  # when each row is its own sample
        if output.num_samples.count(1) != len(samples):
            samples = self.builder.fork_samples(output, self.requests)
        requests, detokenize = self.requests, self.detokenize
        touched: list[Request] = []
        for seq_id in samples:
            request = requests[seq_id[0]]
            seq = request.seqs[seq_id[1]]
            token = int(sampled[seq_id])
            seq.token_ids.append(token)
            text = seq.text  # before the new token's
            if detokenize is not None:
                seq.text += detokenize(seq)
            bounds = request.stop_bounds  # skips `check_stop` when it cannot stop
            if bounds is None or token in bounds[0] or len(seq.token_ids) >= bounds[1]:
                stop = check_stop(seq, request.params, eos_token_ids=self._eos_token_ids,
                                  max_model_len=self.max_model_len,
                                  text_start=len(text))  # fmt: skip
                if stop is not None:
                    self.finish_sequence(seq, stop.reason, stop.stop_reason)
            touched.append(request)
        return touched

    def _schedule_running(self, index: int, out: SchedulerOutput, budget: StepBudget) -> int:
        """Schedule running[index] and those after it whose chunks surely fit the free
        blocks, together; returns the index of the next request to visit.

        While the blocks of the first that may not fit are not free, the newest running
        request is preempted. A plan of one chunk just tries it (nothing changes when it
        does not fit); one of several is counted first, so no victim was appended to.
        """
        running, builder = self.running, self.builder
        num_fitting, requests, chunks, plan = builder.plan_fitting(
            running, index, budget, self.kv.num_free_blocks
        )
        builder.run_appends(requests, chunks, out)  # all fit: none fails
        index += num_fitting
        if plan is None:
            return index
        request = running[index]
        while plan:
            if len(plan) == 1:
                if not builder.run(request, plan, out):
                    return index + 1
            elif builder.blocks_needed(request, plan) <= self.kv.num_free_blocks:
                builder.run(request, plan, out, budget)
                return index + 1
            victim = running[-1]
            if victim is not request:
                self._preempt(victim, out, budget)
            elif index > 0:
                budget.refund(plan)
                self._preempt(request, out, budget, visited=True)
                return index
            else:  # alone in the pool: what does not fit now never will
                return index + self._run_alone(request, plan, out, budget)
        return index + 1

    def _run_alone(
        self, request: Request, plan: Plan, out: SchedulerOutput, budget: StepBudget
    ) -> bool:
        """Run what fits now of a request alone on the device; the rest waits for its other
        samples to finish. If nothing fits, the pool is smaller than the request: its newest
        blocked sample ends with "length" (every step makes progress). False when it ended."""
        blocked: list[Sequence] = []
        for chunk in plan:
            fitting = self.builder.fitting_part(request, chunk, self.kv.num_free_blocks)
            budget.tokens += chunk[2] - fitting[2]
            if fitting[2]:
                self.builder.run(request, [fitting], out, budget)
            else:
                blocked.append(chunk[0])
        if blocked and len(blocked) == len(plan):
            self.finish_sequence(blocked[-1], "length")
        if request.is_finished:
            out.finished_request_ids.append(request.request_id)
            return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
        while self.waiting and budget.prefill_tokens > 0:
            request = self.waiting[0]
            if self._exceeds_max_num_seqs(request):
                return
            plan = self.builder.plan(request, budget)
            is_alone = not self.running
            watermark = 0 if is_alone else self._watermark
            fits = (
                bool(plan)
                and self.builder.blocks_needed(request, plan) + watermark <= self.kv.num_free_blocks
            )
            if not fits and not (plan and is_alone):
                budget.refund(plan)
                return
            self.waiting.popleft()
            self._start_running(request)
            if not fits:
                # Alone on an idle device, nobody will free blocks for it: run what fits
                # sample by sample (a recomputed n > 1 request's samples share their
                # prompt once the first is allocated), as a running request would.
                self._run_alone(request, plan, out, budget)
                return
            self.builder.run(request, plan, out, budget)

    # ---- preemption, resumption and the thrash bound ------------------------------------

    def _preempt(
        self, request: Request, out: SchedulerOutput, budget: StepBudget, *, visited: bool = False
    ) -> None:
        """Take `request` (never appended to in this step) off the device.

        `visited`: its plan already released its decode reservations.
        """
        self.running.remove(request)
        if not visited and budget.reserved_decodes is not None:  # else counted without it
            budget.reserved_decodes = max(0, budget.reserved_decodes - num_decodes(request.seqs))
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_request_ids.append(request.request_id)
        held = [s for s in request.seqs if s.is_allocated]
        if self.config.preemption_mode == "swap" and self._can_swap_out(held):
            for seq in held:
                out.swap_out.extend(self.kv.swap_out(seq.seq_id))
                seq.is_allocated, seq.is_swapped = False, True
            request.status = RequestStatus.SWAPPED
            request.metrics.num_swaps += 1
            self.num_swapped_out += 1
            if self._is_protected(request):
                self.swapped.appendleft(request)
            else:
                self.swapped.append(request)
            return
        self._recompute(request)

    def _can_swap_out(self, held: list[Sequence]) -> bool:
        # Counts shared blocks once per holder: an upper bound on the host blocks needed.
        need = sum(len(self.kv.block_table(s.seq_id)) for s in held)
        return need <= self.kv.num_free_host_blocks and need <= self.kv.num_blocks

    def _resume_swapped(self, out: SchedulerOutput, budget: StepBudget) -> None:
        while self.swapped:
            request = self.swapped[0]
            seqs = [s for s in request.seqs if s.is_swapped]
            # Room for the blocks plus each sequence's next token (a block in every group).
            margin = len(request.unfinished_seqs()) * self.kv.num_groups if self.running else 0
            need = sum(self.kv.num_blocks_to_swap_in(s.seq_id) for s in seqs) + margin
            if need > self.kv.num_free_blocks and (not self.running or need > self.kv.num_blocks):
                # Swapped siblings come back unshared: if they cannot fit even in an empty
                # pool, recompute instead (the prefix cache shares their prompt again).
                self.swapped.popleft()
                self._recompute(request)
                continue
            if need > self.kv.num_free_blocks or self._exceeds_max_num_seqs(request):
                return
            for seq in seqs:
                out.swap_in.extend(self.kv.swap_in(seq.seq_id))
                seq.is_allocated, seq.is_swapped = True, False
            self.swapped.popleft()
            self._start_running(request)
            plan = self.builder.plan(request, budget)
            if self.builder.blocks_needed(request, plan) <= self.kv.num_free_blocks:
                self.builder.run(request, plan, out, budget)
            else:
                budget.refund(plan)

    def _recompute(self, request: Request) -> None:
        """Free `request`'s device or host blocks and queue it at the head of `waiting`:
        prompt + outputs are prefilled again on resumption."""
        for seq in request.seqs:
            if seq.is_allocated or seq.is_swapped:
                self.kv.free(seq.seq_id)
                seq.is_allocated = seq.is_swapped = False
                seq.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        if not self._is_protected(request):
            self.running.append(request)
            return
        # Thrash bound: a request preempted too often runs ahead of every unprotected one
        # (protected ones among themselves by arrival), so victims come from the others.
        position = 0
        while (
            position < len(self.running)
            and self._is_protected(self.running[position])
            and self.running[position].arrival_index < request.arrival_index
        ):
            position += 1
        self.running.insert(position, request)

    def _is_protected(self, request: Request) -> bool:
        return request.metrics.num_preemptions > self.config.max_preemptions

    def _exceeds_max_num_seqs(self, request: Request) -> bool:
        """Whether running `request` too would take more than `max_num_seqs` sequences."""
        num_running = sum(r.num_unfinished_target for r in self.running)
        return num_running + request.num_unfinished_target > self.config.max_num_seqs
