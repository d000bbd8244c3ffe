"""Turn logits into tokens: logit bias, greedy, temperature, top-k, top-p, min-p, logprobs.

Each sampled row draws its randomness only from its own `torch.Generator`, so a seeded
sequence gets the same tokens whatever else is in the batch. Sampling uses the
exponential race (argmax of p / q with q ~ Exp(1)), which equals drawing from p and lets
the filtering stay vectorized over the batch; only the noise is drawn per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.structured.manager import TokenBitmask


@dataclass
class SampleResult:
    """The sampled token of one row and, where its params ask for logprobs, its logprob
    (float32 log-softmax of the raw logits) and the top `logprobs` tokens' (plus the sampled
    one's)."""

    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float] | None


def create_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of sample `index` of a request seeded with `seed`.

    The pair is mixed through a string-seeded `random.Random` (SHA-512 based, stable
    across runs and processes), so (seed, index) pairs never collide in practice.
    """
    import random

    generator = torch.Generator(device=device)
    generator.manual_seed(random.Random(f"pagedkv:{seed}:{index}").getrandbits(63))
    return generator


class Sampler:
    """Samples one token per row of a logits batch."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        token_bitmask: TokenBitmask | None = None,
    ) -> list[SampleResult]:
        """Sample every row.

        Args:
            logits: [num_rows, vocab], float32 (raw: before temperature).
            params: per row its sampling parameters.
            generators: per row its generator (None only for greedy rows).
            token_bitmask: the tokens each constrained row may take; logprobs stay those
                of the raw logits (refused tokens leave the top list only when the bitmask
                `ranks_allowed_only`).

        Raises:
            ValueError: the lists do not have one entry per row.
        """
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"expected {num_rows} params and generators (one per row), "
                f"got {len(params)} and {len(generators)}"
            )
        if num_rows == 0:
            return []
        logits = logits.float()
        # Only where asked, as in vLLM: otherwise every step computes a full-vocabulary
        # log-softmax that nobody reads.
        asked = any(p.logprobs is not None for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if asked else None
        logits = _apply_logit_bias(logits, params)
        if token_bitmask is not None:  # in place: the logprobs above were taken already
            token_bitmask.apply(logits)
            if logprobs is not None and token_bitmask.ranks_allowed_only:
                token_bitmask.apply(logprobs)
        tokens = _argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            tokens[random_rows] = self._sample_rows(
                logits[random_rows],
                [params[i] for i in random_rows],
                [generators[i] for i in random_rows],
            )
        if logprobs is None:
            return [SampleResult(token, None, None) for token in tokens.tolist()]
        tops = top_logprobs(logprobs, tokens, [p.logprobs or 0 for p in params])
        return [
            SampleResult(token, None, None)
            if p.logprobs is None
            else SampleResult(token, top[token], top)
            for token, top, p in zip(tokens.tolist(), tops, params, strict=True)
        ]

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Sample rows that are not greedy. logits: [rows, vocab] float32 -> [rows] int64."""
        temperature = torch.tensor(
            [p.temperature for p in params], dtype=torch.float32, device=logits.device
        )
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        probs = _filter(probs, params)
        noise = torch.empty_like(probs)
        for row, generator in enumerate(generators):
            if generator is None:
                raise ValueError(f"expected a generator for sampled row {row}, got None")
            noise[row].exponential_(generator=generator)
        return _argmax(probs / noise)


def top_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
) -> list[dict[int, float]]:
    """Per row i of `logprobs` ([rows, vocab]): token id -> logprob of its top `ks[i]`
    tokens and of `token_ids[i]` ([rows] int64).
    """
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    values, ids = (t.tolist() for t in logprobs.topk(max(ks), dim=-1))
    return [
        {**dict(zip(ids[i][:k], values[i][:k], strict=True)), token: chosen[i]}
        for i, (token, k) in enumerate(zip(token_ids.tolist(), ks, strict=True))
    ]


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Add each row's `logit_bias` (a copy when any row has one). logits: [rows, vocab];
    `LLMEngine.add_request` checked the token ids against the vocabulary."""
    biased = [
        (row, token, value)
        for row, p in enumerate(params)
        if p.logit_bias
        for token, value in p.logit_bias.items()
    ]
    if not biased:
        return logits
    rows, ids, values = zip(*biased, strict=True)
    out = logits.clone()
    index = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
    out.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)
    return out


def _argmax(values: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax [rows, vocab] -> [rows] int64 (the first maximum, as torch's).

    On CPU through numpy: torch's CPU argmax does not vectorize and took ~30x longer at
    [32, 32000], a few percent of a decode step.
    """
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(values.numpy().argmax(axis=-1).astype("int64"))
    return values.argmax(dim=-1)


def _filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the tokens top-k, top-p and min-p drop. probs: [rows, vocab] float32.

    Filtered probabilities are not renormalized: the exponential race only compares
    ratios within a row.
    """
    device, vocab = probs.device, probs.shape[-1]
    min_p = [p.min_p for p in params]
    if any(min_p):
        threshold = torch.tensor(min_p, device=device)[:, None] * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    top_k = [vocab if p.top_k < 0 else min(p.top_k, vocab) for p in params]
    top_p = [p.top_p for p in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= torch.tensor(top_k, device=device)[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    if any(p < 1.0 for p in top_p):
        # Keep the smallest prefix whose mass reaches top_p (of the top-k renormalized
        # mass): a token is dropped when the mass before it already reaches top_p.
        mass = sorted_probs.sum(-1, keepdim=True)
        before = (sorted_probs.cumsum(-1) - sorted_probs) / mass
        drop = before >= torch.tensor(top_p, device=device)[:, None]
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
