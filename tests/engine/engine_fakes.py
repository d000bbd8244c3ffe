"""A model-free token source for scheduler tests (standard library only).

`ChainRunner` plays the KV cache: every slot holds a value standing for the KV of its token,
the hash of the token prefix through it (chained: value_p = H(value_{p-1}, token_p)). A step
reads the previous value *through the block table*, so a block whose KV was never written,
a missed copy-on-write or swap, or a wrong prefix hit changes the chain and with it every
later token. The next token is a function of the last value (and the sample index), so the
correct output of a request is known without any scheduling: `reference_outputs`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from pagedkv.engine.request import Request, SeqId
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
EOS = 7


def chain(previous: int, token: int) -> int:
    digest = hashlib.blake2b(f"{previous}:{token}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def next_token(value: int, index: int) -> int:
    return chain(value, 1000 + index) % VOCAB


class ChainRunner:
    """Device and host block memory as dicts: block id -> {offset: value}."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, dict[int, int]] = {}
        self.host: dict[int, dict[int, int]] = {}

    def execute(self, step: SchedulerOutput) -> dict[SeqId, int]:
        bs = self.block_size
        for device_block, host_block in step.swap_out:
            self.host[host_block] = dict(self.device[device_block])
        for host_block, device_block in step.swap_in:
            self.device[device_block] = dict(self.host[host_block])
        for src, dst in step.copies:
            self.device[dst] = dict(self.device[src])
        sampled: dict[SeqId, int] = {}
        # rows(): the step left as scheduled (its decode rows stay compact for update).
        for seq in step.rows():
            table = seq.block_table
            assert len(table) * bs >= seq.seq_len, "block table shorter than the sequence"
            # Every cached position must have been written (KeyError otherwise).
            for pos in range(seq.start_pos):
                _ = self.device[table[pos // bs]][pos % bs]
            value = self._read(table, seq.start_pos - 1) if seq.start_pos else 0
            # New KV goes where the step's slot mapping says; reads go through the table.
            for offset, (token, slot) in enumerate(
                zip(seq.token_ids, seq.slot_mapping, strict=True)
            ):
                pos = seq.start_pos + offset
                assert slot == table[pos // bs] * bs + pos % bs, "slot disagrees with table"
                value = chain(value, token)
                self.device.setdefault(slot // bs, {})[slot % bs] = value
            for seq_id in seq.sample_seq_ids:
                sampled[seq_id] = next_token(value, seq_id[1])
        return sampled

    def _read(self, table: list[int], pos: int) -> int:
        return self.device[table[pos // self.block_size]][pos % self.block_size]


def reference_outputs(
    prompt: list[int], params: SamplingParams, max_model_len: int = 10**9
) -> list[list[int]]:
    """What each of the request's samples must generate, computed without a cache."""
    results = []
    for index in range(params.n):
        tokens, value = list(prompt), 0
        for token in tokens:
            value = chain(value, token)
        out: list[int] = []
        while True:
            token = next_token(value, index)
            out.append(token)
            tokens.append(token)
            if (
                (not params.ignore_eos and token == EOS)
                or len(out) >= params.max_tokens
                or len(tokens) >= max_model_len
            ):
                break
            value = chain(value, token)
        results.append(out)
    return results


def run_to_completion(
    scheduler: Scheduler,
    runner: ChainRunner,
    requests: Iterable[Request],
    *,
    max_steps: int = 100_000,
) -> dict[str, list[list[int]]]:
    """Drive schedule -> execute -> update with `check()` after every step."""
    requests = list(requests)
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        scheduler.update(step, runner.execute(step))
        scheduler.kv.check()
        steps += 1
        assert steps < max_steps, "no progress: the scheduler livelocked"
    return {r.request_id: [s.output_token_ids for s in r.seqs] for r in requests}
