"""An asyncio front for the (single-threaded) `LLMEngine`.

One engine thread owns the engine: it steps continuous batching while requests exist and
sleeps on a condition otherwise. Requests and aborts reach it through a command list
guarded by that condition; each request's deltas go back to its asyncio queue with
`loop.call_soon_threadsafe`. Nothing but the engine thread touches the engine, so the engine
needs no locks, and an abort frees the request's blocks at the engine thread's next turn
(before its next step).

    event loop (HTTP handlers)            engine thread
    add_request ── ("add", fut) ──────▶   engine.add_request -> fut result / ValueError
    stream.abort ── ("abort") ────────▶   engine.abort_request (blocks back to the pool)
    queue.get() ◀── call_soon_threadsafe ─ engine.step() -> DeltaTracker.update

Shutdown is bounded: `begin_shutdown(timeout)` stops admission at once (new requests get
`EngineShuttingDown`), lets the running requests go on, and once `timeout` seconds have
passed aborts whatever is left, each stream ending with `EngineShuttingDown`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import EngineFailed
from pagedkv.server.streaming import DeltaTracker, RequestDelta

logger = logging.getLogger(__name__)
# An idle engine thread wakes this often to ask whether the engine can still step.
_HEALTH_CHECK_S = 1.0


class EngineOverloaded(RuntimeError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine thread stopped (shut down or crashed); no request can be served."""


class EngineShuttingDown(EngineDead):
    """The server is shutting down: no new request is admitted, running ones are bounded."""


@dataclass
class _Add:
    stream: RequestStream
    prompt: Any
    params: Any
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


@dataclass
class RequestStream:
    """One admitted request: iterate it for `RequestDelta`s; `abort()` if you stop early.

    The engine thread makes the deltas (`_tracker`) and puts them on `_queue` in `_loop`.
    """

    request_id: str
    _engine: AsyncEngine
    _loop: asyncio.AbstractEventLoop
    _tracker: DeltaTracker
    _queue: asyncio.Queue[RequestDelta | BaseException] = field(default_factory=asyncio.Queue)
    is_finished: bool = False

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        try:
            while not self.is_finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.is_finished = True
                    raise item
                self.is_finished = item.finished
                yield item
        finally:
            self.abort()  # a no-op once finished

    def abort(self) -> None:
        """Abort the request (idempotent); its blocks go back to the pool at once."""
        if not self.is_finished:
            self.is_finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs an `LLMEngine` on its own thread and serves requests to asyncio code.

    Args:
        engine: an `LLMEngine` (duck-typed: add_request, abort_request, step,
            has_unfinished_requests, stats, check_health, close, tokenizer, model_config,
            max_model_len).
        max_waiting_requests: at most this many admitted requests may wait for the engine;
            more raise `EngineOverloaded` instead of queueing without bound. None: no bound.
    """

    def __init__(self, engine: Any, max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests: expected >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._cond = threading.Condition()
        self._commands: list[_Add | str] = []  # an add, or the id of a request to abort
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._num_pending_adds = 0  # guarded by _cond
        self._stats: dict[str, Any] = {}
        self._is_stopping = False
        # Set once by begin_shutdown (plain assignment: it may run in a signal handler).
        self._drain_deadline: float | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        """The engine thread serves and admits requests (False once shutdown began)."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._is_stopping
            and self._drain_deadline is None
        )

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still in flight end with `EngineDead`), then
        close the engine (its worker processes, if any)."""
        with self._cond:
            self._is_stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # only the engine thread may touch it while it runs

    def begin_shutdown(self, timeout: float) -> None:
        """Stop admitting now; abort the requests still running after `timeout` seconds.

        Safe from a signal handler (it only assigns a deadline); idempotent: the first
        call's deadline stands.
        """
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + max(0.0, timeout)

    def stats(self) -> dict[str, Any]:
        """The engine's `stats()` as of its last step or abort (safe from any thread)."""
        return dict(self._stats)

    async def add_request(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: Any
    ) -> RequestStream:
        """Admit a request to the engine; returns its stream once the engine accepted it.

        Raises:
            ValueError: the engine rejected the request (bad or impossible; the message says).
            EngineOverloaded: `max_waiting_requests` requests are already waiting.
            EngineDead: the engine thread is not running.
        """
        tracker = DeltaTracker(stop=params.stop_strings)
        stream = RequestStream(request_id, self, asyncio.get_running_loop(), tracker)
        with self._cond:
            if self._drain_deadline is not None:
                raise EngineShuttingDown("the server is shutting down: retry elsewhere")
            if not self.is_running:
                raise self._stopped_error()
            num_waiting = int(self._stats.get("num_requests_waiting", 0)) + self._num_pending_adds
            if self.max_waiting_requests is not None and num_waiting >= self.max_waiting_requests:
                raise EngineOverloaded(
                    f"server overloaded: {num_waiting} requests waiting "
                    f"(max_waiting_requests={self.max_waiting_requests}); retry later"
                )
            self._num_pending_adds += 1
            add = _Add(stream, prompt, params)
            self._commands.append(add)
            self._cond.notify()
        try:
            await asyncio.wrap_future(add.future)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added before the cancellation
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are ignored."""
        with self._cond:
            self._commands.append(request_id)
            self._cond.notify()

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                has_work = self.engine.has_unfinished_requests()
                with self._cond:
                    while not (self._commands or has_work or self._is_stopping):
                        # Idle, but a part of the engine may still fail (a worker dies).
                        if not self._cond.wait(_HEALTH_CHECK_S):
                            self.engine.check_health()
                    commands, self._commands = self._commands, []
                    if self._is_stopping:
                        break
                self._apply(commands)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._abort_after_deadline()
                self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - the thread must report, never vanish
            logger.exception("engine thread crashed")
            self.error = exc
        finally:
            with self._cond:
                self._is_stopping = True
            self._fail_all(self._stopped_error())

    def _apply(self, commands: list[_Add | str]) -> None:
        for cmd in commands:
            if isinstance(cmd, str):
                if self._streams.pop(cmd, None) is not None:
                    self.engine.abort_request(cmd)
                continue
            try:
                self.engine.add_request(cmd.stream.request_id, cmd.prompt, cmd.params)
            except Exception as exc:  # noqa: BLE001 - a bad request must not stop the loop
                cmd.future.set_exception(exc)
            else:
                self._streams[cmd.stream.request_id] = cmd.stream
                cmd.future.set_result(None)
            finally:
                with self._cond:
                    self._num_pending_adds -= 1
        if commands:
            self._refresh_stats()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineFailed:
            raise  # the engine cannot go on: `_run` ends and fails every request with it
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            logger.exception("engine step failed; aborting %d requests", len(self._streams))
            self._abort_all(RuntimeError(f"engine step failed: {exc}"))
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while its step ran
            delta = stream._tracker.update(output)
            if delta.finished:
                del self._streams[output.request_id]
            if delta.samples or delta.finished:
                _deliver(stream, delta)

    def _abort_after_deadline(self) -> None:
        deadline = self._drain_deadline
        if deadline is None or time.monotonic() < deadline or not self._streams:
            return
        logger.warning("shutdown timeout: aborting %d running requests", len(self._streams))
        self._abort_all(EngineShuttingDown("the server shut down before this request finished"))

    def _refresh_stats(self) -> None:
        try:
            self._stats = dict(self.engine.stats())  # one swap: readers see a whole snapshot
        except Exception:  # noqa: BLE001 - stale metrics beat a dead server
            logger.exception("engine.stats() failed")

    def _stopped_error(self) -> BaseException:
        """What a request meets once the thread stopped: the failure that stopped it (a 500),
        else `EngineDead` (a 503: shut down)."""
        if isinstance(self.error, EngineFailed):
            return EngineFailed(f"the engine failed: {self.error}")
        return EngineDead("the engine is not running")

    def _abort_all(self, exc: BaseException) -> None:
        """Abort every running request in the engine; each stream ends with `exc`."""
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            _deliver(self._streams.pop(request_id), exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            _deliver(stream, exc)
        self._streams.clear()
        with self._cond:
            commands, self._commands = self._commands, []
        for cmd in commands:
            if isinstance(cmd, _Add) and not cmd.future.done():
                cmd.future.set_exception(exc)


def _deliver(stream: RequestStream, item: RequestDelta | BaseException) -> None:
    try:
        stream._loop.call_soon_threadsafe(stream._queue.put_nowait, item)
    except RuntimeError:
        pass  # the client's event loop is closed: nobody is listening any more
