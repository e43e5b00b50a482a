"""torch.profiler events for rsccl's collectives, as gloo records them.

While a torch profiler (torch.profiler.profile or torch.autograd.profiler.profile) is on,
every call of the ProcessGroup methods in `EVENTS` (the fast paths of all_reduce,
all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single, which are not
wrapped, step aside for them while a profiler runs) opens a RecordFunction named
"rsccl:<collective>" with the call's input tensors (their shapes show with
record_shapes=True), and closes it when the operation completes, from another thread: the
event is asynchronous and spans issue to completion, as gloo's "gloo:all_reduce" does. On
CUDA tensors, completion is the end of the collective on the GPU. With the profiler off a
call costs one check.

While profiling, a blocking call (asyncOp False) is issued as an asynchronous one (torch
waits on its Work right after, so the caller sees no difference): its completion then has
a thread and, on CUDA, an event to end the record.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._work import DoneWork

# ProcessGroup method -> (event name after "rsccl:", index of the argument whose tensors
# the event records, or None). The names are gloo's (its tests match them).
EVENTS: dict[str, tuple[str, int | None]] = {
    "_allreduce": ("all_reduce", 0),  # allreduce's fast path skips itself while profiling
    "allreduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "allgather": ("all_gather", 1),
    "allgather_coalesced": ("all_gather", 1),
    "_allgather_into": ("all_gather_into_tensor", 1),  # _allgather_base's fast path skips itself too
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 1),
    "reduce_scatter": ("reduce_scatter", 0),
    "_reduce_scatter_into": ("reduce_scatter_tensor", 0),  # as _reduce_scatter_base's
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 0),
    "_alltoall_full": ("all_to_all", 1),  # as _allgather_into
    "alltoall": ("all_to_all", 1),
    "gather": ("gather", 1),
    "scatter": ("scatter", 0),
    "barrier": ("barrier", None),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recvAnySource", 0),
}

_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled


def _tensors(arg: Any) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


class _Closer:
    """One thread that completes the records whose operation completed on the caller's
    own thread (a record ended on the thread that opened it would not count as async), or
    that must wait for a CUDA event. Started at the first use."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], None], Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, done: Callable[[], None], event: Any = None) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rsccl-profiler", daemon=True)
                self._thread.start()
        self._q.put((done, event))

    def _run(self) -> None:
        while True:
            done, event = self._q.get()
            try:
                if event is not None:
                    event.synchronize()  # the collective's end on the GPU (GIL released)
            except Exception:  # noqa: BLE001, S110 - the Work reports the failure; the record just ends
                pass
            done()


_closer = _Closer()


class ProfiledWork(dist._Work):
    """The Work of a call made while profiling: the operation's Work, plus the end of its
    record. wait() and the future complete once both did, so a profiler closed right
    after wait() has the event. On CUDA, wait() keeps its meaning (the caller's stream is
    ordered, the CPU does not block) and the record ends when the GPU finished."""

    def __init__(self, inner: Any, ended: torch.futures.Future):
        super().__init__()
        self._inner = inner
        self._ended = ended
        self._cuda = getattr(inner, "_event", None) is not None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._inner.wait(timeout)
        if not self._cuda:
            self._ended.wait()
        return True

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed()) and (self._cuda or self._ended.done())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> BaseException | None:
        return self._inner.exception()

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        return self._inner.get_future() if self._cuda else self._ended

    def _source_rank(self) -> int:
        return self._inner._source_rank()  # a recv from any source (dist._Work has its own)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _settle(fut: torch.futures.Future, src: torch.futures.Future | None, value: Any) -> None:
    if src is None:
        fut.set_result(value)
        return
    try:
        fut.set_result(src.value())
    except BaseException as e:  # noqa: BLE001 - the record ends either way
        fut.set_exception(e)


def _end_when_done(work: Any, fut: torch.futures.Future) -> None:
    """Complete `fut` (which ends the record) once `work` completed, on another thread
    than this one."""
    caller = threading.get_ident()
    value = list(getattr(work, "_result", []) or [])
    event = getattr(work, "_event", None)
    if event is not None:  # CudaWork: ends when the GPU finished it
        _closer.put(lambda: _settle(fut, None, value), event)
    elif work is None or isinstance(work, DoneWork):
        _closer.put(lambda: _settle(fut, None, value))
    else:

        def end(src: torch.futures.Future) -> None:
            if threading.get_ident() == caller:
                _closer.put(lambda: _settle(fut, src, value))
            else:
                _settle(fut, src, value)

        work.get_future().then(end)


def _recorded(fn: Callable[..., Any], title: str, arg: int | None) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _enabled() or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
            return fn(self, *args, **kwargs)
        inputs = _tensors(args[arg]) if arg is not None and arg < len(args) else []
        handle = torch._C._autograd._record_function_with_args_enter(title, *inputs)
        fut: torch.futures.Future = torch.futures.Future()
        # Ends the record (with the profiler's state of this thread) when `fut` completes;
        # `ended` completes after that, with fut's value.
        ended = torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction(handle, fut)
        flipped = [a for a in args if getattr(a, "asyncOp", None) is False]
        for a in flipped:
            a.asyncOp = True
        try:
            work = fn(self, *args, **kwargs)
        except BaseException:
            fut.set_result(None)
            raise
        finally:
            for a in flipped:
                a.asyncOp = False
        _end_when_done(work, fut)
        return ProfiledWork(work, ended)

    return method


def instrument(cls: type) -> None:
    """Wrap the methods of `cls` named in EVENTS (aliases included)."""
    for name, (event, arg) in EVENTS.items():
        setattr(cls, name, _recorded(getattr(cls, name), "rsccl:" + event, arg))
