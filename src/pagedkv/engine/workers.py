"""Tensor parallelism across processes: rank 0 is the engine, ranks 1..N-1 are workers.

One scheduler and one `KVCacheManager`, on rank 0. A block id means the same block on every
rank (each rank's pool holds its own KV heads of every block), so the step that the
scheduler hands to rank 0's runner is all any rank needs; it crosses once per step, and
each layer's collectives run inside the model::

    rank 0 (engine process)                        rank r (worker process)
    step = scheduler.schedule()
    broadcast(step) ─────────────────────────────► step
    runner.execute(step)    ◄── all-reduce x 2 ──► runner.execute(step)    per layer
    logits (all-gather) ──► sample                 logits (all-gather), not sampled
    scheduler.update(...)                          wait for the next step

Workers are started with torch.multiprocessing (spawn) on this machine, or by `torchrun`
on several (ranks > 0 then call `run_worker`). A worker that fails reports its error on a
pipe and exits; rank 0 sees the broken collective or the exit code and raises
`WorkerFailed` naming the rank, and the engine stops for good.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.cache import PagedKVCache
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import SampleResult
from pagedkv.engine.scheduler_output import SchedulerOutput
from pagedkv.errors import WorkerFailed
from pagedkv.models import CausalLM, resolve_device
from pagedkv.models.parallel import TensorParallel

if TYPE_CHECKING:
    from pagedkv.engine.structured.manager import TokenBitmask

logger = logging.getLogger(__name__)

# Workers wait in a collective for the next step for as long as the engine is idle.
_IDLE_TIMEOUT = timedelta(days=365)
# How long rank 0 waits for a failed collective's worker to show its exit.
_EXIT_GRACE_S = 5.0


@dataclass
class Worker:
    """A spawned worker process and the pipe it reports a failure on."""

    rank: int
    process: Any
    errors: Connection

    def failure(self) -> str | None:
        """Why the worker stopped (its reported error, else its exit code); None if alive."""
        message = None
        try:
            if self.errors.poll():
                message = self.errors.recv()
        except (EOFError, OSError):
            pass  # exited without a report (killed): the exit code tells
        if message is None and self.process.is_alive():
            return None
        return message or f"exited with code {self.process.exitcode}"


def first_failure(workers: list[Worker]) -> WorkerFailed | None:
    """The first worker that has stopped, as the error to raise; None if all are alive."""
    for worker in workers:
        reason = worker.failure()
        if reason is not None:
            return WorkerFailed(worker.rank, reason)
    return None


@dataclass(frozen=True)
class Launch:
    """How this process joins the group: its rank, the group size and the rendezvous."""

    rank: int
    size: int
    init_method: str
    local_rank: int

    @classmethod
    def from_environment(cls, size: int) -> Launch | None:
        """The rank `torchrun` gave this process (RANK, WORLD_SIZE, MASTER_ADDR, ...), or
        None when not launched so (rank 0 then spawns its workers).

        Raises:
            ValueError: WORLD_SIZE differs from `size`.
        """
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"tensor_parallel_size: expected WORLD_SIZE={world} of the launcher, got {size}"
            )
        return cls(int(os.environ["RANK"]), world, "env://", int(os.environ.get("LOCAL_RANK", 0)))


ServeSteps = Callable[[EngineArgs, Launch], None]
"""What a worker rank runs: build its share of the engine, then run rank 0's steps until
told to stop (`pagedkv.engine.builder.serve_rank`)."""


def launched_rank() -> int:
    """This process's rank under `torchrun` (0 when not launched by it)."""
    return int(os.environ.get("RANK", "0"))


def start_workers(args: EngineArgs, serve: ServeSteps) -> tuple[TensorParallel, list[Worker], str]:
    """Join (torchrun) or create (spawn) the group of `args.tensor_parallel_size` ranks as
    rank 0; return it, the spawned workers (none under torchrun) and rank 0's device. Each
    spawned worker runs `serve(args, launch)` meanwhile: it builds its share of the engine
    and runs the steps rank 0 broadcasts.

    Raises:
        WorkerFailed: a worker died before the group formed.
    """
    size = args.tensor_parallel_size
    launch = Launch.from_environment(size)
    workers: list[Worker] = []
    if launch is None:
        launch = Launch(0, size, f"tcp://127.0.0.1:{_free_port()}", 0)
        context = mp.get_context("spawn")
        for rank in range(1, size):
            receiver, sender = context.Pipe(duplex=False)
            child = Launch(rank, size, launch.init_method, rank)
            process = context.Process(
                target=_worker_main, args=(serve, args, child, sender), name=f"pagedkv-tp{rank}"
            )
            process.daemon = True  # never outlive the engine's process
            process.start()
            sender.close()
            workers.append(Worker(rank, process, receiver))
    elif launch.rank != 0:
        raise ValueError(f"start_workers: expected rank 0, got rank {launch.rank}; call run_worker")
    device = rank_device(args.device, launch)
    return join_group(launch, device, workers), workers, device


def rank_device(device: str, launch: Launch) -> str:
    """The device of a rank: its own GPU (`cuda:LOCAL_RANK`) or the CPU."""
    device = resolve_device(device)
    return f"cuda:{launch.local_rank}" if device.startswith("cuda") else device


def share_cpu_threads(size: int) -> None:
    """Give each of the `size` ranks on this machine its share of the cores."""
    threads = max(1, (os.cpu_count() or 1) // size)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: sends each step to the workers, then runs its own share."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        workers: list[Worker],
        num_threads: int,
        **options: Any,
    ) -> None:
        """Args:
        model, kv_cache, options: as `ModelRunner`'s, rank 0's share.
        workers: the spawned worker processes (none under torchrun).
        num_threads: torch's thread count before the ranks shared the cores; `close`
            gives it back.
        """
        super().__init__(model, kv_cache, **options)
        self.tp = model.tp
        self.workers = workers
        # The failure that ended the group, if any; shared with the finalizer, so that an
        # engine dropped without `close` still stops its workers and leaves the group (and
        # another one can start in this process).
        self._state: dict[str, WorkerFailed | None] = {"error": None}
        self._finalizer = weakref.finalize(
            self, _shut_down, self.tp, workers, num_threads, self._state
        )

    def execute(
        self, step: SchedulerOutput, token_bitmask: TokenBitmask | None = None
    ) -> dict[Any, SampleResult]:
        """Run `step` on every rank; rank 0 samples.

        Raises:
            WorkerFailed: a rank died or failed (now or earlier); the engine cannot go on,
                since the ranks no longer run the same collectives in the same order.
        """
        self.check_health()
        try:
            self.tp.broadcast_object(step)
            return super().execute(step, token_bitmask)
        except Exception as exc:
            error = self._state["error"] = self._failure_after(exc)
            raise error from exc

    def check_health(self) -> None:
        """Raise `WorkerFailed` if any worker has stopped (cheap: no collective)."""
        error = self._state["error"] or first_failure(self.workers)
        if error is not None:
            self._state["error"] = error
            raise error

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        self._finalizer()

    def _failure_after(self, exc: Exception) -> WorkerFailed:
        """The rank behind a failed step: rank 0 itself for its own error, else the first
        worker to exit within a grace period (a broken collective names no rank)."""
        if not isinstance(exc, RuntimeError):
            return WorkerFailed(0, f"{type(exc).__name__}: {exc}")
        deadline = time.monotonic() + _EXIT_GRACE_S
        while time.monotonic() < deadline:
            error = first_failure(self.workers)
            if error is not None:
                return error
            time.sleep(0.05)
        return WorkerFailed(None, f"a collective failed: {exc}")


def _shut_down(
    tp: TensorParallel,
    workers: list[Worker],
    num_threads: int,
    state: dict[str, WorkerFailed | None],
) -> None:
    """Rank 0's end of the group: a None step ends the workers' loop (unless one failed:
    the others may be stuck in a collective, and are terminated), then the group goes and
    torch gets its threads back.

    Rank 0 leaves last. A rank whose peer closes its connections while it is itself
    tearing the group down (or exiting) can abort in gloo's threads ("terminate called
    without an active exception"); one that is merely waiting sees the close and goes on.
    So the workers leave first, and rank 0 waits until each has recorded in the rendezvous
    store that it left."""
    if state["error"] is None and dist.is_initialized():
        try:
            tp.broadcast_object(None)
            tp.store.wait(
                [left_key(rank) for rank in range(1, tp.size)], timedelta(seconds=_EXIT_GRACE_S)
            )
        except RuntimeError:
            pass  # a worker already gone (or too slow to leave): nothing left to wait for
    for worker in workers:
        worker.process.join(timeout=_EXIT_GRACE_S)
        if worker.process.is_alive():
            worker.process.terminate()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(num_threads)


def run_worker(args: EngineArgs, serve: ServeSteps) -> NoReturn:
    """Serve as rank RANK of a `torchrun` launch (`serve(args, launch)`) until rank 0 closes
    the engine, then end the process (exit status 0).

    The process ends as a spawned worker's does (multiprocessing ends its children with
    `os._exit`): once the rank has left the group nothing remains to save, and an ordinary
    exit runs the interpreter's and C++ runtime's teardown, where a thread of
    torch.distributed still being stopped now and then aborts the process ("terminate
    called without an active exception").

    Raises:
        ValueError: not launched by torchrun, or as rank 0.
    """
    launch = Launch.from_environment(args.tensor_parallel_size)
    if launch is None or launch.rank == 0:
        raise ValueError("run_worker: expected RANK >= 1 and WORLD_SIZE from torchrun")
    serve(args, launch)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker_main(serve: ServeSteps, args: EngineArgs, launch: Launch, errors: Connection) -> None:
    """A spawned worker: join the group, build this rank's share, run steps until told to
    stop. Any failure is reported on `errors` before the process exits non-zero."""
    try:
        serve(args, launch)
    except BaseException as exc:  # noqa: BLE001 - rank 0 must learn why, whatever it was
        errors.send(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def left_key(rank: int) -> str:
    """The store key a worker sets once it has left the group (rank 0 waits for it)."""
    return f"pagedkv/left/{rank}"


def join_group(launch: Launch, device: str, workers: list[Worker]) -> TensorParallel:
    """`init_process_group` on a helper thread, so that rank 0 can give up when a worker
    dies before the rendezvous completes (the call itself would wait for it)."""
    if dist.is_initialized():
        raise ValueError(
            "tensor_parallel_size: this process is already in a torch.distributed group "
            "(one tensor-parallel engine per process)"
        )
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(launch.local_rank)
    backend = "nccl" if on_gpu else "gloo"
    errors: list[BaseException] = []
    stores: list[dist.Store] = []

    def init() -> None:
        try:
            # The rendezvous as init_process_group makes it, but keeping the store (the
            # group's keys under the same prefix): it tells rank 0 when the others left.
            rendezvous = dist.rendezvous(
                launch.init_method, launch.rank, launch.size, timeout=_IDLE_TIMEOUT
            )
            store, _, _ = next(rendezvous)
            store.set_timeout(_IDLE_TIMEOUT)
            stores.append(store)
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("default_pg", store),
                rank=launch.rank,
                world_size=launch.size,
                timeout=_IDLE_TIMEOUT,
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=init, name="pagedkv-tp-init", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        error = first_failure(workers)
        if error is not None:
            raise error
    if errors:
        raise errors[0]
    logger.info("tensor parallel: rank %d of %d joined (%s)", launch.rank, launch.size, backend)
    world = dist.group.WORLD
    # Steps are Python objects: they cross over gloo even when the tensors use NCCL.
    cpu_group = dist.new_group(backend="gloo") if on_gpu else world
    return TensorParallel(launch.rank, launch.size, world, cpu_group, stores[0])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
