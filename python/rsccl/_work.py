"""Work objects returned by rsccl's ProcessGroup: one job each.

Tensor lifetime without marking tensors on streams: a Work keeps the tensors an operation
reads and writes until it completed (RsWork, host memory) or until the consumer is ordered
after it (CudaWork): `wait()` makes the caller's current stream wait on the collective's
end event, and from then on the caching allocator can reuse the memory safely (later work
on that stream runs after the collective). A CudaWork nobody waits on stays in its group's
pending list until its end event has completed.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._cuda import raw_stream


class RsWork(dist._Work):
    """Completion of one or more engine operations, then of the Python-side finishing
    step (`post`: copies back into non-contiguous or list outputs).

    The tensors the engine reads and writes are referenced by `_keep` until the finishing
    step ran, so they outlive the operation even if the caller drops this Work: that is
    how rsccl keeps memory alive without marking it on streams. `_on_done` runs on one of
    rsccl's completion threads once each operation completes; Works complete in no
    particular order relative to each other.
    """

    def __init__(self, parts: Sequence[Any], result: Any, keep: Any = None, post: Callable[[], None] | None = None):
        super().__init__()
        self._parts = list(parts)
        # c10d's futures carry a list of tensors.
        self._result = [result] if isinstance(result, torch.Tensor) else (result if result is not None else [])
        self._keep = keep
        self._post = post
        self._exc: BaseException | None = None
        self._fut: torch.futures.Future | None = None
        self._settled = False
        self._lock = threading.Lock()
        self._remaining = len(self._parts)
        self._done = threading.Event()
        if not self._parts:
            self._finish()
        for p in self._parts:
            p.add_done_callback(self._on_done)

    def _on_done(self, exc: BaseException | None) -> None:
        with self._lock:
            if exc is not None and self._exc is None:
                self._exc = exc
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        if self._exc is None and self._post is not None:
            try:
                self._post()
            except BaseException as e:  # noqa: BLE001 - reported through wait()/the future
                self._exc = e
        self._post = None
        self._keep = None
        with self._lock:
            self._done.set()
            fut = self._fut
        if fut is not None:
            self._settle(fut)

    def _settle(self, fut: torch.futures.Future) -> None:
        with self._lock:  # _finish and get_future may both get here
            if self._settled:
                return
            self._settled = True
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        limit = seconds if seconds > 0 else None
        # Errors surface from _on_done; waiting on every part first means no part is
        # still writing into the caller's tensors when wait() raises.
        for p in list(self._parts):
            try:
                p.wait(limit)
            except Exception:  # noqa: BLE001 - an operation's own error is raised below
                if not p.is_completed():
                    raise  # this wait timed out; the operation goes on

        if not self._done.wait(limit):
            raise TimeoutError(f"rsccl: Work.wait: Timed out after {seconds} s")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._fut is None:
                self._fut = torch.futures.Future()
            fut = self._fut
        if self._done.is_set():
            self._settle(fut)
        return fut


class RecvAnyWork(RsWork):
    """A recv from any source: also names the sender (torch's dist.recv asks)."""

    def __init__(self, source: Any, *args: Any):
        super().__init__(*args)
        self._source = source

    def _source_rank(self) -> int:
        rank = self._source.rank()
        if rank is None:
            raise RuntimeError("rsccl: _source_rank() of a recv from any source that has not received a message")
        return rank


class DoneWork(dist._Work):
    """The Work of a blocking call that already completed on the caller's thread."""

    def __init__(self, result: Any):
        super().__init__()
        self._result = [result] if isinstance(result, torch.Tensor) else (result if result is not None else [])

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class CudaWork(dist._Work):
    """An asynchronous CUDA collective: its end event, and the tensors it uses."""

    def __init__(
        self, pg: Any, device: int, event: Any, result: Any, keep: Any, post: Callable[[], None] | None = None, stream: int | None = None
    ):
        super().__init__()
        self._pg = pg
        self._device = device
        # The stream current at launch: its allocations (staging copies) are in `keep`.
        self._stream = stream
        self._event = event
        self._result = [result] if isinstance(result, torch.Tensor) else (result if result is not None else [])
        self._keep = keep
        self._post = post
        self._ordered = False

    def _order_current_stream(self) -> None:
        if not self._ordered:
            current = raw_stream(self._device)
            self._event.wait_on(current)
            if self._stream is not None and self._stream != current:
                # Temporaries made at launch belong to the launch stream's pool: order it too.
                self._event.wait_on(self._stream)
            self._ordered = True
            if self._post is not None:
                post, self._post = self._post, None
                post()
                if self._stream is not None and self._stream != current and not torch.cuda.is_current_stream_capturing():
                    # The copies just queued on the current stream read temporaries from the
                    # launch stream's pool: that stream waits for them before it can reuse
                    # the memory (freed below).
                    done = torch.cuda.Event()
                    done.record()
                    torch.cuda.ExternalStream(self._stream, device=torch.device("cuda", self._device)).wait_event(done)
            # The consumer stream now runs after the collective: the memory may be reused.
            self._keep = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._order_current_stream()
        self._pg._comm.cuda_health()
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> BaseException | None:
        try:
            self._pg._comm.cuda_health()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            return e
        return None

    def result(self) -> Any:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self._order_current_stream()
        self._event.synchronize()
        self._pg._comm.cuda_health()

    def get_future(self) -> torch.futures.Future:
        # A CUDA-aware future: set_result records the current stream, which now waits on
        # the collective, and consumers of the value wait on that.
        self._order_current_stream()
        fut: torch.futures.Future = torch.futures.Future(devices=[torch.device("cuda", self._device)])
        fut.set_result(self._result)
        return fut

    def _release_if_done(self) -> bool:
        """Drop the tensors once the collective finished on the GPU; True if released."""
        if self._keep is None:
            return True
        if self._event.query():
            self._keep = None
            return True
        return False


class Pending:
    """Asynchronous Works not yet known to be finished, oldest first."""

    def __init__(self) -> None:
        self.works: collections.deque[CudaWork] = collections.deque()

    def add(self, w: CudaWork) -> None:
        self.works.append(w)
        if len(self.works) > 1 and not torch.cuda.is_current_stream_capturing():
            # Works on one stream finish in order: stop at the first one still running.
            while self.works and self.works[0]._release_if_done():
                self.works.popleft()
