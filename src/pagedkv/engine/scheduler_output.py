"""What one `Scheduler.schedule()` hands the runner: everything the step needs, as plain data.

Token ids, positions, slots, block tables and, for the rows that sample, their
`SamplingParams` and seed: the runner needs nothing else (no live `Request`). Standard
library only, never tensors: the simulator consumes the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.request import SeqId
from pagedkv.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    """Tokens of one sequence computed in this step.

    `token_ids` sit at positions `start_pos .. start_pos + len(token_ids) - 1`; their KV is
    written to `slot_mapping` (one slot per token, `block_id * block_size + offset`) and
    attention reads the whole context through `block_table`. When `sample_seq_ids` is not
    empty, the last row's logits are sampled once for each id in it (more than one only for
    the fork of n > 1) with `sampling_params`; sample `(request_id, index)` draws from the
    generator of `(seed, index)`. `prompt_logprob_token_ids[i]` is the prompt token after
    row i: the runner returns its logprob (and the top `sampling_params.prompt_logprobs`)
    from row i's logits; empty unless the request asks for prompt logprobs. `block_table` may
    be the very list a later step hands out again (replaced, not changed, when the blocks
    change): read it, never mutate it.

    Raises:
        ValueError: `slot_mapping` does not have one slot per token, or a sampling
            sequence has no `sampling_params`.
    """

    seq_id: SeqId
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    slot_mapping: list[int]
    sample_seq_ids: list[SeqId] = field(default_factory=list)
    sampling_params: SamplingParams | None = None
    seed: int = 0
    prompt_logprob_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.slot_mapping) != len(self.token_ids):
            raise ValueError(
                f"slot_mapping: expected {len(self.token_ids)} slots (one per token), "
                f"got {len(self.slot_mapping)}"
            )
        if self.sample_seq_ids and self.sampling_params is None:
            raise ValueError(
                f"sampling_params: expected SamplingParams for {self.seq_id!r}, which samples, "
                "got None"
            )
        if len(self.prompt_logprob_token_ids) > len(self.token_ids):
            raise ValueError(
                f"prompt_logprob_token_ids: expected at most one per token "
                f"({len(self.token_ids)}), got {len(self.prompt_logprob_token_ids)}"
            )

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached tokens plus the new ones)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's work for the runner. Apply `swap_out`, then `swap_in`, then `copies`
    to the KV tensors before the forward pass."""

    seqs: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that ended inside schedule() (no room to grow even alone in the pool).
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in
