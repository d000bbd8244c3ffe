"""Runs one scheduled step on the model: KV moves, one forward pass, sampling, and the
prompt logprobs of the rows that ask for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedkv.cache import PagedKVCache
from pagedkv.engine.request import SeqId
from pagedkv.engine.sampler import Sampler, SampleResult, create_generator, top_logprobs
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedkv.models import CausalLM
from pagedkv.ops import AttentionMetadata, warmup
from pagedkv.ops import plan as plan_attention

if TYPE_CHECKING:
    from pagedkv.engine.structured.manager import TokenBitmask

# Prompt rows whose logits are computed at once (bounds [rows, vocab] float32 memory).
_LOGIT_ROWS = 256


def bucket_num_tokens(num_tokens: int) -> int:
    """The row count (>= `num_tokens` >= 0) a matmul over `num_tokens` rows runs at when
    steps are bucketed.

    Exact up to 8, then rounded up to a multiple of a quarter of the power of two below
    (9 -> 10, 17 -> 20, 100 -> 112): four sizes per doubling, at most 25 % padding; past
    512, an eighth (1025 -> 1152, 1589 -> 1664): at most 12.5 %, where padding rows cost
    whole prefill rows of arithmetic. oneDNN (bfloat16 on the CPU) builds and caches a
    primitive per matmul shape; a step's token count is new almost every step, and past
    its cache's capacity the churn grows the process without bound. Bucketed, a
    2048-token budget gives ~50 sizes.
    """
    if num_tokens <= 8:
        return num_tokens
    fraction_bits = 4 if num_tokens > 512 else 3
    step = 1 << ((num_tokens - 1).bit_length() - fraction_bits)
    return -(-num_tokens // step) * step


class ModelRunner:
    """Owns the model and its paged KV cache; executes `SchedulerOutput`s."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        *,
        attention_backend: str = "auto",
        token_buckets: bool = False,
    ) -> None:
        """Wrap a loaded model and its KV pools.

        Args:
            model: forward(input_ids, positions, kv_cache, attn_metadata, logit_rows) ->
                `ModelOutput`, and compute_logits for prompt rows.
            kv_cache: the K/V pools the scheduler's block ids index.
            attention_backend: passed to `AttentionMetadata` ("auto", "cpu", "triton", ...).
            token_buckets: run every matmul at `bucket_num_tokens` rows: the step's padding
                rows (token 0 at position 0) pass the matmuls and norms but not `write_kv`
                or attention, and are never sampled.
        """
        self.model = model
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.device = kv_cache.device
        self.sampler = Sampler()
        self.token_buckets = token_buckets
        self.num_heads = model.config.num_heads // model.tp.size  # this rank's query heads
        # Per request id, per sample index: its generator, created on first use and kept
        # across steps (and preemptions) until `release`.
        self._generators: dict[str, dict[int, torch.Generator]] = {}
        # The last step's prompt logprobs, until `pop_prompt_logprobs`.
        self._prompt_logprobs: dict[SeqId, tuple[int, list[dict[int, float]]]] = {}
        # Compile the attention kernels now, not in the middle of serving a request.
        warmup(
            kv_cache.key_caches[0],
            kv_cache.value_caches[0],
            self.num_heads,
            backend=attention_backend,
        )
        # Under tensor parallelism every rank runs the whole step (logits are a
        # collective) and rank 0 alone samples.
        self.is_driver = model.tp.rank == 0

    @torch.inference_mode()
    def execute(
        self, step: SchedulerOutput, token_bitmask: TokenBitmask | None = None
    ) -> dict[SeqId, SampleResult]:
        """Apply the step's block moves, run its tokens, and sample where asked.

        Order matters: swap-outs read blocks the step may hand to others, swap-ins fill
        blocks before copies read them, and copies land before the forward writes new KV.

        Args:
            step: the scheduler's decision; it carries everything the step needs (tokens,
                positions, slots, block tables, sampling parameters and seeds).
            token_bitmask: the allowed tokens of the step's constrained samples.

        Returns:
            For each id in any `sample_seq_ids`, its sampled token and logprobs.
        """
        self.kv_cache.swap_out(step.swap_out)
        self.kv_cache.swap_in(step.swap_in)
        self.kv_cache.copy_blocks(step.copies)
        if not step.num_rows:
            return {}
        input_ids, positions, slots, tables, seq_lens, query_lens = step.model_inputs()
        num_padding = self._num_rows(len(input_ids)) - len(input_ids)
        input_ids.extend([0] * num_padding)
        positions.extend([0] * num_padding)
        metadata = self._metadata(step, tables, seq_lens, query_lens, slots)
        samples = step.sample_rows()  # (row, seq_id, params, seed) per sample
        rows = [sample[0] for sample in samples]
        output = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache,
            metadata,
            self._padded_rows(rows),
        )
        self._prompt_logprobs = {
            seq.seq_id: (seq.start_pos, self._prompt_rows(seq, output.hidden, first_row))
            for first_row, seq in step.first_rows()  # decode rows take no prompt logprobs
            if seq.prompt_logprob_token_ids
        }
        return self._sample(samples, output.logits[: len(rows)], token_bitmask)

    def _metadata(self, step: SchedulerOutput, tables: list[list[int]], seq_lens: list[int],
                  query_lens: list[int], slots: list[int]) -> AttentionMetadata:  # fmt: skip
        """The step's attention metadata, one per KV cache group (the first group's with the
        others' in `other_groups`), each planned for its group's window."""
        groups = self.kv_cache.groups
        inputs = [(slots, tables)] + [step.group_inputs(g) for g in range(1, groups.num_groups)]
        made = [
            AttentionMetadata.build(group_tables, seq_lens, query_lens, group_slots,
                                    device=self.device, backend=self.attention_backend)
            for group_slots, group_tables in inputs
        ]  # fmt: skip
        for metadata, window in zip(made, groups.windows, strict=True):
            plan_attention(metadata, self.kv_cache.key_caches[0], self.kv_cache.value_caches[0],
                           self.num_heads, window)  # fmt: skip
        made[0].other_groups = tuple(made[1:])
        return made[0]

    def pop_prompt_logprobs(self) -> dict[SeqId, tuple[int, list[dict[int, float]]]]:
        """The prompt logprobs of the last `execute`, then forgotten.

        Returns:
            Per sequence that asked (`prompt_logprob_token_ids`): its step's `start_pos` and,
            per row i, token id -> logprob (float32 log-softmax of the raw logits) of the
            top `prompt_logprobs` tokens and of `prompt_logprob_token_ids[i]`.
        """
        out, self._prompt_logprobs = self._prompt_logprobs, {}
        return out

    def _prompt_rows(
        self, seq: ScheduledSequence, hidden: torch.Tensor, first_row: int
    ) -> list[dict[int, float]]:
        """hidden: [num_tokens, hidden_size]. Logits in slices of rows: a whole prompt's
        [rows, vocab] at once could take gigabytes."""
        assert seq.sampling_params is not None, "every scheduled sequence carries its params"
        k = seq.sampling_params.prompt_logprobs or 0
        targets = seq.prompt_logprob_token_ids
        rows: list[dict[int, float]] = []
        for begin in range(0, len(targets), _LOGIT_ROWS):
            ids = targets[begin : begin + _LOGIT_ROWS]
            start = first_row + begin
            logits = self._compute_logits(hidden, list(range(start, start + len(ids))))
            if not self.is_driver:
                continue
            index = torch.tensor(ids, dtype=torch.int64, device=logits.device)
            rows += top_logprobs(torch.log_softmax(logits, dim=-1), index, [k] * len(ids))
        return rows

    def _sample(
        self,
        samples: list[tuple[int, SeqId, SamplingParams, int]],
        logits: torch.Tensor,
        token_bitmask: TokenBitmask | None,
    ) -> dict[SeqId, SampleResult]:
        """samples: (row, seq_id, params, seed) each; logits: float32 [len(samples), vocab]."""
        if not samples or not self.is_driver:
            return {}
        _, seq_ids, params, seeds = map(list, zip(*samples, strict=True))
        generators = [
            None if p.is_greedy else self._generator(seq_id, seed, logits.device)
            for seq_id, p, seed in zip(seq_ids, params, seeds, strict=True)
        ]
        sampled = self.sampler(logits, params, generators, token_bitmask)
        return dict(zip(seq_ids, sampled, strict=True))

    def _num_rows(self, num_tokens: int) -> int:
        return bucket_num_tokens(num_tokens) if self.token_buckets else num_tokens

    def _padded_rows(self, rows: list[int]) -> list[int]:
        """`rows` and, as padding, row 0 again up to the bucketed row count, at which the LM
        head's matmul runs (the padding's logits are dropped)."""
        return rows + [0] * (self._num_rows(len(rows)) - len(rows))

    def _compute_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Float32 logits [n, vocab_size] of the forward's output `rows`."""
        return self.model.compute_logits(hidden, self._padded_rows(rows))[: len(rows)]

    def _generator(self, seq_id: SeqId, seed: int, device: torch.device) -> torch.Generator:
        request_id, index = seq_id
        generators = self._generators.setdefault(request_id, {})
        if index not in generators:
            generators[index] = create_generator(seed, index, device)
        return generators[index]

    def release(self, request_id: str) -> None:
        """Forget a finished request's generators (unknown ids are ignored)."""
        self._generators.pop(request_id, None)

    def check_health(self) -> None:
        """Nothing to check in one process (`TensorParallelRunner` checks its workers)."""

    def close(self) -> None:
        """Nothing to release beyond what garbage collection frees."""
