"""`LLMEngine`: requests in, one step at a time, `RequestOutput`s out.

A step is three calls: `scheduler.schedule()` -> `runner.execute(step)` -> postprocess
(`scheduler.update` appends the tokens and their text and decides every stop; the engine
adds logprobs and builds the outputs). The server drives `step()` in a loop;
`LLM.generate` drives it until every request is done.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any

from pagedkv.config import EngineConfig, ModelConfig
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.prefix_tier import create_prefix_tier, prefix_tier_applies
from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import SampleResult
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.memory import KVCacheManager
from pagedkv.models.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from pagedkv.engine.structured.manager import StructuredOutputManager

PromptType = str | list[int] | dict[str, Any]
logger = logging.getLogger(__name__)


class LLMEngine:
    """The serving core: a scheduler over a `KVCacheManager`, a model runner, a tokenizer."""

    def __init__(
        self, config: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer | None
    ) -> None:
        """Prefer `from_engine_args`; this wires already-built parts together.

        Args:
            config: the engine's configuration (model, cache, scheduler, max_model_len).
            runner: owns the model and the KV tensors (of every rank, under tensor
                parallelism).
            tokenizer: None serves token-id prompts only.
        """
        self.config = config
        self.runner = runner
        tiered = prefix_tier_applies(config, runner.kv_cache)
        self.kv_manager = KVCacheManager(
            runner.kv_cache.num_blocks,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            num_host_blocks=runner.kv_cache.num_host_blocks,
            windows=runner.kv_cache.groups.windows,
            hash_contents=tiered,
        )
        # The prefix cache's host and disk tiers (None: off or unusable).
        self.prefix_tier = (
            create_prefix_tier(config, self.kv_manager, runner.kv_cache, runner.model.tp)
            if tiered
            else None
        )
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len
        eos = set(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_manager,
            max_model_len=config.max_model_len,
            eos_token_ids=eos,
            detokenize=self._detokenize if tokenizer is not None else None,
        )
        self.stop_token_ids = sorted(eos)
        # Built on the first constrained request (it loads xgrammar and the vocabulary).
        self._structured: StructuredOutputManager | None = None
        self._rng = random.Random(config.seed)
        self._arrivals = 0
        # PAGEDKV_DEBUG=1: check the KV manager's invariants after every step.
        self.debug = os.environ.get("PAGEDKV_DEBUG", "") not in ("", "0")
        self.num_steps = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs | str, **kwargs: Any) -> LLMEngine:
        """Load the model directory `args.model` names and size the KV cache.

        Args:
            args: every engine option. A model directory with `EngineArgs`' fields as
                keywords (`from_engine_args("DIR", block_size=8)`) is accepted too.
            kwargs: those fields, only with a model directory.

        Raises:
            TypeError: an unknown keyword, or keywords next to an `EngineArgs`.
            ValueError: a bad option, or a model directory that cannot be loaded.
        """
        from pagedkv.engine.builder import build_engine_parts

        if not isinstance(args, EngineArgs):
            args = EngineArgs.from_kwargs(args, kwargs)
        elif kwargs:
            raise TypeError(f"from_engine_args: expected EngineArgs alone, got also {kwargs}")
        return cls(*build_engine_parts(args))

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (needs a tokenizer), token ids, or {"prompt_token_ids": [...]}
                / {"prompt": "..."}.
            arrival_time: for metrics (default: now, `time.monotonic()`).

        Raises:
            ValueError: a bad prompt or params, a duplicate id, or a request that can never
                fit the model or the KV pool. The engine keeps serving the others.
        """
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: expected a str, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        vocab = self.config.model.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(
                f"logit_bias: expected token ids in [0, {vocab}), got {max(params.logit_bias)}"
            )
        text, token_ids = self.tokenize_prompt(prompt)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(
            request_id,
            token_ids,
            params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            arrival_index=self._arrivals,
            prompt=text,
            seed=seed,
        )
        if params.structured_outputs is not None and self.structured_outputs.add(request):
            self._arrivals += 1  # scheduled once its grammar compiled (`step`)
            return
        if self.prefix_tier is not None:
            self.scheduler.check_request(request)
            if self.prefix_tier.start_load(request):
                self._arrivals += 1  # scheduled once its blocks are read (`step`)
                return
        self.scheduler.add_request(request)
        self._arrivals += 1

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Resolve any accepted prompt form to (text or None, token ids).

        Raises:
            ValueError: an empty or malformed prompt, or text without a tokenizer.
        """
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, prompt = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(
                    f"prompt: expected a dict with 'prompt_token_ids' or "
                    f"'prompt', got keys {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: expected token ids (this model dir has no tokenizer), got a string"
                )
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(
                f"prompt: expected a string, token ids or a dict, got {type(prompt).__name__}"
            )
        vocab = self.config.model.vocab_size
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(f"prompt: expected token ids in [0, {vocab}), got {token!r}")
        return text, list(prompt)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """Grammar compiles, per-step token masks and matchers of constrained requests.

        Raises:
            ValueError: the model has no tokenizer (a grammar is over its vocabulary).
        """
        if self._structured is None:
            from pagedkv.engine.structured.manager import create_structured_output_manager

            if self.tokenizer is None:
                raise ValueError("structured_outputs: expected a model with a tokenizer, got none")
            self._structured = create_structured_output_manager(
                self.tokenizer, self.config.model.vocab_size, self.stop_token_ids
            )
        return self._structured

    def abort_request(self, request_id: str) -> None:
        """End a request now; its blocks go back to the pool. Unknown ids are ignored."""
        if self._structured is not None and self._structured.abort(request_id) is not None:
            return
        if self.prefix_tier is not None and self.prefix_tier.abort(request_id) is not None:
            return
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self.runner.release(request_id)
            request.metrics.finished_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._num_compiling > 0

    @property
    def _num_compiling(self) -> int:
        """Requests not yet scheduled: compiling their grammar or reading their blocks."""
        num_loading = 0 if self.prefix_tier is None else len(self.prefix_tier)
        return num_loading + (0 if self._structured is None else len(self._structured.pending))

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests not running, those whose grammar compiles (or blocks load) included."""
        return self.scheduler.num_waiting + self._num_compiling

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess.

        Returns:
            The cumulative output of every request that got tokens or finished this step.
        """
        failed = self._admit_compiled() if self._structured is not None else []
        if self.prefix_tier is not None:
            idle = not self.scheduler.has_unfinished_requests()
            failed += self._admit(self.prefix_tier.pop_loaded(wait_one=idle), [])
        # Taken before schedule(): a request can end inside it (no room to grow).
        live = dict(self.scheduler.requests)
        step = self.scheduler.schedule()
        if self.prefix_tier is not None:  # evicted blocks leave before the step writes
            self.prefix_tier.save_evicted()
        bitmask = None if self._structured is None else self._structured.prepare(step)
        try:
            # Without constrained samples the runner is called as any runner can be.
            results = (
                self.runner.execute(step) if bitmask is None else self.runner.execute(step, bitmask)
            )
        except Exception:
            self._drop_failed_step(step)
            raise
        for seq_id, (start, rows) in self.runner.pop_prompt_logprobs().items():
            live[seq_id[0]].add_prompt_logprobs(start, rows)
        outputs = failed + self._postprocess(step, results, live)
        if self.debug:
            self.kv_manager.check()
        self.num_steps += 1
        return outputs

    def _drop_failed_step(self, step: SchedulerOutput) -> None:
        """After the runner failed: abort the step's requests (their blocks go back) and
        forget the prefix cache, whose newest blocks were indexed but never written."""
        for request_id in dict.fromkeys(seq_id[0] for seq_id in step.seq_ids):
            self.abort_request(request_id)
        if not self.kv_manager.reset_prefix_cache():
            if self.prefix_tier is not None:
                self.prefix_tier.stop_writes("a step failed while other requests held blocks")
            logger.warning(
                "a step failed while other requests hold blocks: the prefix cache may "
                "index blocks of that step whose KV was never written"
            )

    def _postprocess(
        self, step: SchedulerOutput, results: dict[Any, SampleResult], live: dict[str, Request]
    ) -> list[RequestOutput]:
        now = time.monotonic()
        for seq_id in step.seq_ids:
            metrics = live[seq_id[0]].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        touched = self.scheduler.update(step, {k: r.token_id for k, r in results.items()})
        if self._structured is not None:  # a sample whose grammar ended stops there
            for seq in self._structured.advance(results, live):
                self.scheduler.finish_sequence(seq, "stop")
        for (request_id, index), result in results.items():  # the new tokens' logprobs
            if result.logprob is not None and result.top_logprobs is not None:
                seq = live[request_id].seq(index)
                seq.cumulative_logprob += result.logprob
                seq.logprobs.append(result.top_logprobs)
        ended = [live[r] for r in step.finished_request_ids]
        outputs = []
        for request in dict.fromkeys([*touched, *ended]):
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if request.is_finished:
                request.metrics.finished_time = now
                self.runner.release(request.request_id)
            outputs.append(request.output())
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar compiled; end those whose compile failed
        (finish reason "abort") and return their outputs."""
        assert self._structured is not None, "called only with structured outputs"
        idle = not self.scheduler.has_unfinished_requests() and not self.prefix_tier
        ready, failed = self._structured.pop_compiled(wait=idle)
        tier = self.prefix_tier
        if tier is not None:  # those whose blocks the tiers hold wait for them first
            ready = [request for request in ready if not tier.start_load(request)]
        return self._admit(ready, failed)

    def _admit(
        self, ready: list[Request], failed: list[tuple[Request, BaseException]]
    ) -> list[RequestOutput]:
        """Schedule the `ready` requests; end the `failed` ones and any the scheduler
        rejects (finish reason "abort"), returning their outputs."""
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except ValueError as exc:
                failed.append((request, exc))
        now, outputs = time.monotonic(), []
        for request, error in failed:
            logger.warning("request %s ended: %s", request.request_id, error)
            request.seqs[0].finish_reason = "abort"
            request.metrics.finished_time = now
            outputs.append(request.output())
        return outputs

    def _detokenize(self, seq: Sequence) -> str:
        """The text of `seq`'s newest token (the scheduler's `detokenize`)."""
        assert self.tokenizer is not None, "detokenize is only passed with a tokenizer"
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids[:-1])
        return seq.detokenizer.add(seq.token_ids[-1])

    # ---- life cycle ---------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise if the engine can no longer step (a tensor-parallel worker died).

        Raises:
            EngineFailed: naming what failed.
        """
        self.runner.check_health()

    def close(self) -> None:
        """Release what outlives garbage collection (tensor-parallel worker processes)."""
        if self._structured is not None:
            self._structured.close()
        if self.prefix_tier is not None:
            self.prefix_tier.close()
        self.runner.close()

    # ---- observability ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Pool, prefix-cache, preemption and queue counters."""
        return dict(
            self.kv_manager.stats(),
            block_size=self.config.cache.block_size,
            num_preemptions=self.scheduler.num_preemptions,
            num_swapped_out=self.scheduler.num_swapped_out,
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            num_requests_swapped=self.scheduler.num_swapped,
            num_steps=self.num_steps,
            **(self.prefix_tier.stats() if self.prefix_tier is not None else {}),
        )
