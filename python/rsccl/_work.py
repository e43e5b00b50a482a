"""Work objects returned by rsccl's ProcessGroup: one job each."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


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
