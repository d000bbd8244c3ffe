"""Continuous batching over the paged KV cache (standard library only: no torch).

One `schedule()` call decides one step:

1. running requests, in `running` order (admission order, except that a request past the
   thrash bound sits ahead of the others): each unfinished sequence gets its decode token
   or its next prefill chunk. The decode tokens of requests not yet visited are reserved
   out of the token budget, so a prefill chunk only takes what they leave. When the blocks
   a request needs are not free, the last request in `running` (the newest) is preempted
   (recompute or swap), repeatedly, until they are; if that is the request asking, it is
   preempted itself, unless it is alone: then what fits runs, and if nothing does its
   newest blocked sample ends with "length".
2. if nothing was preempted: swapped-out requests come back in the order they left
   (protected ones first) while their blocks and `max_num_seqs` allow; one that could not
   fit even an empty pool is recomputed instead,
3. then, once none is left swapped out, waiting requests are admitted from the head of the
   queue (recompute-preempted ones were put back at its head) while the token budget,
   `max_num_seqs` and the free blocks (less a 1 % watermark next to running requests)
   allow; the first that does not fit stops admission. Admission takes only the blocks of
   the first chunk, after the prefix cache.
4. the copy-on-write copies queued by the appends close the step.

Invariant: preemptions are decided before appending to a sequence in a step. Running
requests are visited in order and victims come from the end, so a victim was never
appended to in this call. `append` makes full blocks prefix-cacheable at once; a freed
block whose KV was never written must not stay in the prefix cache.

Per-request planning, with the decode fast path that keeps a step of 1,024 decoding
sequences cheap, lives in `pagedkv.engine.planning`; preemption and swapping in
`pagedkv.engine.preemption`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pagedkv.config import SchedulerConfig
from pagedkv.engine.outputs import FinishReason
from pagedkv.engine.planning import StepBudget
from pagedkv.engine.preemption import PreemptionMixin
from pagedkv.engine.request import Request, RequestStatus, SeqId, Sequence
from pagedkv.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedkv.engine.stop import check_stop, stop_bounds

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerOutput"]


class Scheduler(PreemptionMixin):
    """Decides, step by step, which tokens run and which blocks they use."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: Any,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        detokenize: Callable[[Sequence], str] | None = None,
    ) -> None:
        """Start with empty queues over `kv_manager`.

        Args:
            config: batch limits, preemption mode, thrash bound.
            kv_manager: a `pagedkv.memory.KVCacheManager` (the scheduler owns its seq ids).
            num_blocks, block_size: the device pool, to reject requests that never fit.
            max_model_len: longest sequence (prompt + output) the model accepts.
            eos_token_ids: tokens that end a completion unless `ignore_eos`.
            detokenize: the text of a sequence's newest token; `update` appends it to
                `Sequence.text` before the stop checks. None (no tokenizer): no text, and
                stop strings never match.
        """
        self.config = config
        self.kv = kv_manager
        self.num_blocks = num_blocks
        self.block_size = block_size
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
        self._watermark = max(1, num_blocks // 100)

    # ---- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            ValueError: duplicate id, empty prompt, or a prompt that can never run
                (no room for one new token within `max_model_len` or the whole pool).
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("expected a prompt of at least one token, got an empty prompt")
        if prompt_len + 1 > self.max_model_len:
            raise ValueError(
                f"expected prompt + 1 token <= max_model_len "
                f"({self.max_model_len}), got {prompt_len} prompt tokens"
            )
        blocks = -(-(prompt_len + 1) // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"expected a prompt that fits the pool with one new token "
                f"({self.num_blocks} blocks of {self.block_size} tokens), got "
                f"{prompt_len} prompt tokens needing {blocks} blocks"
            )
        if request.n > self.config.max_num_seqs:
            raise ValueError(
                f"expected n <= max_num_seqs ({self.config.max_num_seqs}), got n={request.n}"
            )
        self._set_stop_bounds(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

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
        out = SchedulerOutput()
        budget = StepBudget(self.config.max_num_batched_tokens)
        self._schedule_running_requests(out, budget)
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
        touched: list[Request] = []
        rows = output.decode_rows
        for lo, hi, scheduled in output.segments():
            if hi > lo:  # plain decodes: one sample each, the row's own sequence
                self._update_samples([row[0] for row in rows[lo:hi]], sampled, touched)
            if scheduled is not None and scheduled.sample_seq_ids:
                request = self.requests[scheduled.seq_id[0]]
                if not request.is_forked:
                    self._fork(request, request.seq(scheduled.seq_id[1]))
                self._update_samples(scheduled.sample_seq_ids, sampled, touched)
        return touched

    def _fork(self, request: Request, parent: Sequence) -> None:
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

    def _update_samples(
        self, seq_ids: list[SeqId], sampled: Mapping[SeqId, int], touched: list[Request]
    ) -> None:
        """`update` of the samples `seq_ids`, in step order."""
        requests, detokenize = self.requests, self.detokenize
        for seq_id in seq_ids:
            request = requests[seq_id[0]]
            seq = request.seqs[0]
            if seq.seq_id != seq_id:
                seq = request.seq(seq_id[1])
            token = int(sampled[seq_id])
            seq.token_ids.append(token)
            text_start = len(seq.text)
            if detokenize is not None:
                seq.text += detokenize(seq)
            bounds = request.stop_bounds  # skips `check_stop` when it cannot stop
            if bounds is None or token in bounds[0] or len(seq.token_ids) >= bounds[1]:
                stop = check_stop(
                    seq,
                    request.params,
                    eos_token_ids=self._eos_token_ids,
                    max_model_len=self.max_model_len,
                    text_start=text_start,
                )
                if stop is not None:
                    self.finish_sequence(seq, stop.reason, stop.stop_reason)
            touched.append(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
        while self.waiting and budget.prefill_tokens > 0:
            request = self.waiting[0]
            if self._num_running_seqs() + request.num_unfinished_target > self.config.max_num_seqs:
                return
            plan = self._plan(request, budget)
            is_alone = not self.running
            watermark = 0 if is_alone else self._watermark
            fits = bool(plan) and self._blocks_needed(plan) + watermark <= self.kv.num_free_blocks
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
            self._run_plan(request, plan, out, budget)
