"""Preemption (recompute or swap), resumption of swapped requests and the thrash bound:
the half of `Scheduler` that takes requests off the device and brings them back.

Standard library only (no torch), like the scheduler it is part of.
"""

from __future__ import annotations

from collections import deque

from pagedkv.config import SchedulerConfig
from pagedkv.engine.planning import PlanningMixin, StepBudget
from pagedkv.engine.request import Request, RequestStatus, Sequence
from pagedkv.engine.scheduler_output import SchedulerOutput


class PreemptionMixin(PlanningMixin):
    """Preemption and resumption for `Scheduler`, on top of its planning half."""

    config: SchedulerConfig
    num_blocks: int
    waiting: deque[Request]
    swapped: deque[Request]
    num_preemptions: int
    num_swapped_out: int

    def _preempt(
        self, request: Request, out: SchedulerOutput, budget: StepBudget, *, visited: bool = False
    ) -> None:
        """Take `request` (never appended to in this step) off the device.

        `visited`: its plan already released its decode reservations.
        """
        self.running.remove(request)
        if not visited:
            decodes = sum(1 for s in request.seqs if s.is_decode and not s.is_finished)
            assert budget.reserved_decodes is not None, "preempting before decodes counted"
            budget.reserved_decodes = max(0, budget.reserved_decodes - decodes)
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_request_ids.append(request.request_id)
        held = [s for s in request.seqs if s.is_allocated]
        if self.config.preemption_mode == "swap" and self._can_swap_out(held):
            for seq in held:
                pairs = self.kv.swap_out(seq.seq_id)
                out.swap_out.extend(pairs)
                seq.is_allocated, seq.is_swapped = False, True
                seq.num_swapped_blocks = len(pairs)
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
        return need <= self.kv.num_free_host_blocks and need <= self.num_blocks

    def _resume_swapped(self, out: SchedulerOutput, budget: StepBudget) -> None:
        while self.swapped:
            request = self.swapped[0]
            seqs = [s for s in request.seqs if s.is_swapped]
            # Room for the blocks plus each sequence's next token.
            margin = len(request.unfinished_seqs()) if self.running else 0
            need = sum(s.num_swapped_blocks for s in seqs) + margin
            if need > self.kv.num_free_blocks and (not self.running or need > self.num_blocks):
                # Swapped siblings come back unshared: if they cannot fit even in an empty
                # pool, recompute instead (the prefix cache shares their prompt again).
                self.swapped.popleft()
                self._recompute(request)
                continue
            if (
                need > self.kv.num_free_blocks
                or self._num_running_seqs() + request.num_unfinished_target
                > self.config.max_num_seqs
            ):
                return
            for seq in seqs:
                out.swap_in.extend(self.kv.swap_in(seq.seq_id))
                seq.is_allocated, seq.is_swapped = True, False
            self.swapped.popleft()
            self._start_running(request)
            plan = self._plan(request, budget)
            if self._blocks_needed(plan) <= self.kv.num_free_blocks:
                self._run_plan(request, plan, out, budget)
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
        return request.num_preemptions > self.config.max_preemptions

    def _num_running_seqs(self) -> int:
        return sum(r.num_unfinished_target for r in self.running)
