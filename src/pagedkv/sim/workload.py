"""Workloads for the simulator: JSONL traces and seeded synthetic loads.

Standard library only. Times are simulated steps (one token per running request per step).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("sharegpt", "long-context", "chat")
# Each built-in workload's mix, as `pagedkv simulate --help` lists it.
WORKLOAD_MIXES = {
    "sharegpt": "ShareGPT-like chat: lognormal prompts (mean ~161 tokens) and outputs "
    "(mean ~338), all at step 0",
    "long-context": "10% 128K-token, 30% 64K-token and 60% 512-token requests (outputs 64 "
    "to 4,096 tokens), Poisson arrivals at 0.01 per step",
    "chat": "4 shared system prompts of 500-2,000 tokens, each request one of them plus a "
    "ShareGPT-like turn and answer, all at step 0",
}
# Old names still accepted: {old: new}.
DEPRECATED_WORKLOADS = {"seed": "long-context"}


@dataclass(frozen=True, slots=True)
class Request:
    """One request: arrives at step `arrival`, holds `prompt_len + output_len` tokens at the end.

    Requests of one `prefix_group` share their first `prefix_len` prompt tokens.
    """

    arrival: float
    prompt_len: int
    output_len: int
    prefix_group: int | None = None
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if not (self.arrival >= 0 and math.isfinite(self.arrival)):
            raise ValueError(f"arrival: expected a finite number >= 0, got {self.arrival!r}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"prompt_len and output_len: expected >= 1, got "
                f"{self.prompt_len} and {self.output_len}"
            )
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(
                f"prefix_len: expected 0..prompt_len ({self.prompt_len}), got {self.prefix_len}"
            )
        if self.prefix_group is not None and self.prefix_group < 0:
            raise ValueError(f"prefix_group: expected an integer >= 0, got {self.prefix_group}")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError(f"prefix_len {self.prefix_len} needs a prefix_group")

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def load_trace(path: str | Path) -> list[Request]:
    """Read a JSONL trace: one object per line with `arrival`, `prompt_len`, `output_len` and
    optionally `prefix_group` (int) and `prefix_len`. Blank lines are skipped.

    Returns:
        The requests sorted by arrival (stable, so ties keep file order).

    Raises:
        ValueError: an unreadable file or a bad line (the message names the line).
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc.strerror}") from None
    requests = [
        _parse_line(line, f"{path}:{number}")
        for number, line in enumerate(lines, 1)
        if line.strip()
    ]
    if not requests:
        raise ValueError(f"trace {path}: expected at least one request, got none")
    return sorted(requests, key=lambda r: r.arrival)


def _parse_line(line: str, where: str) -> Request:
    try:
        item = json.loads(line)
        if not isinstance(item, dict):
            raise ValueError(f"expected a JSON object, got {type(item).__name__}")
        unknown = set(item) - {"arrival", "prompt_len", "output_len", "prefix_group", "prefix_len"}
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        group = item.get("prefix_group")
        return Request(
            arrival=float(item.get("arrival", 0.0)),
            prompt_len=_int(item, "prompt_len"),
            output_len=_int(item, "output_len"),
            prefix_group=None if group is None else _int(item, "prefix_group"),
            prefix_len=_int(item, "prefix_len", 0),
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _int(item: dict, key: str, default: int | None = None) -> int:
    value = item.get(key, default)
    if value is None:
        raise ValueError(f"missing {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    return int(value)


def _arrivals(rng: random.Random, n: int, rate: float | None) -> list[float]:
    """All at step 0 (offline batch) when `rate` is None, else a Poisson process."""
    if rate is None:
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate: expected > 0 requests per step, got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _lognormal_int(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    # mu chosen so that the uncapped mean is `mean`: E[X] = exp(mu + sigma^2 / 2).
    mu = math.log(mean) - sigma * sigma / 2
    return min(high, max(low, round(rng.lognormvariate(mu, sigma))))


def _sharegpt_lengths(rng: random.Random) -> tuple[int, int]:
    """(prompt, output) lengths from lognormals fit to ShareGPT's published statistics (vLLM
    paper, Fig. 11: mean input ~161 tokens, mean output ~338 tokens), capped at 4,096 each.
    """
    return _lognormal_int(rng, 161, 1.1, 4, 4096), _lognormal_int(rng, 338, 0.9, 4, 4096)


def make_workload(
    name: str, num_requests: int, seed: int = 0, rate: float | None = None
) -> list[Request]:
    """A built-in workload by name (`WORKLOADS`, described in `WORKLOAD_MIXES`; the old name
    `seed` is `long-context`). `rate`: Poisson arrivals per step; by default all arrive at
    step 0, but long-context ones at 0.01 per step.

    Raises:
        ValueError: an unknown name, a non-positive count or a non-positive rate.
    """
    if num_requests <= 0:
        raise ValueError(f"num_requests: expected > 0, got {num_requests}")
    name = DEPRECATED_WORKLOADS.get(name, name)
    if name not in WORKLOADS:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {name!r}")
    if name == "long-context" and rate is None:
        rate = 0.01
    rng = random.Random(seed)
    arrivals = _arrivals(rng, num_requests, rate)
    if name == "sharegpt":
        return [Request(a, *_sharegpt_lengths(rng)) for a in arrivals]
    requests = []
    if name == "long-context":
        # Outputs of 64 to 4,096 tokens make requests end at different times, leaving holes.
        for a in arrivals:
            total = rng.choices((131072, 65536, 512), weights=(1, 3, 6))[0]
            output = rng.randint(64, 256 if total == 512 else 4096)
            requests.append(Request(arrival=a, prompt_len=total - output, output_len=output))
        return requests
    system = [rng.randint(500, 2000) for _ in range(4)]  # chat: prefix group = system prompt
    for a in arrivals:
        group = rng.randrange(len(system))
        user, output = _sharegpt_lengths(rng)
        requests.append(
            Request(a, system[group] + user, output, prefix_group=group, prefix_len=system[group])
        )
    return requests
