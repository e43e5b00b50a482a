"""The op vocabulary shared with the Rust core, resolved once at import: kind, dtype and
reduce-op codes and routes (the tables live in Rust: rust/core/src/collective/kind.rs,
dtype.rs, group.rs) and the classes of argument errors. The hot path passes these small ints to
`Communicator.run`; nothing here is looked up by string per call.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import _rsccl

KINDS: dict[str, int] = dict(_rsccl.KINDS)
KIND_NAMES: dict[int, str] = {code: name for name, code in KINDS.items()}

# One int constant per kind, named as the kind in upper case (ALL_REDUCE, REDUCE_SCATTER,
# ALL_GATHER, BROADCAST, BARRIER, GATHER, SCATTER, REDUCE, ALL_TO_ALL, SEND, RECV), made
# from the Rust table: a new kind (collective/kind.rs) needs no line here.
globals().update({name.upper(): code for name, code in KINDS.items() if name.isidentifier()})

# torch dtype -> rsccl dtype code, for every dtype rsccl moves (by torch's name).
DTYPE_CODES: dict[torch.dtype, int] = {getattr(torch, name): code for name, code in _rsccl.DTYPES}
UINT8 = DTYPE_CODES[torch.uint8]

# ReduceOp name -> rsccl op code.
OP_CODES: dict[str, int] = dict(_rsccl.OPS)
OP_NAMES: dict[int, str] = {code: name for name, code in OP_CODES.items()}
SUM = OP_CODES["SUM"]

# Where a group's calls go, from the Rust table (group.rs `Route`): HOST or GLOO for CPU
# tensors, RSCCL or NCCL for CUDA tensors. A member's value is its Rust name, so it
# compares equal to that name ("nccl"). ROUTE_OF maps the codes Communicator.route and
# .cuda_route return to members.
Route = enum.Enum("Route", [(name.upper(), name) for name, _ in _rsccl.ROUTES], type=str, module=__name__)  # type: ignore[misc]
ROUTE_OF: dict[int, Any] = {code: Route(name) for name, code in _rsccl.ROUTES}

# torch's RedOpType value -> rsccl op code (or torch's name, for ops rsccl lacks: the core
# refuses those with a message naming them). Built once: reading .name of a pybind enum on
# every call costs microseconds a small collective cannot spare.
_TORCH_OPS: dict[int, int | str] = {int(v): OP_CODES.get(k, k) for k, v in dist.ReduceOp.RedOpType.__members__.items()}


_TORCH_SUM = dist.ReduceOp.SUM


def op_code(op: Any) -> int | str:
    """torch passes a ReduceOp (with .op) or a RedOpType. SUM, nearly every call's op, is
    told by one comparison: reading a ReduceOp's .op costs about a microsecond (a pybind
    property), the comparison half that (and PREMUL_SUM does not compare equal to SUM)."""
    if op == _TORCH_SUM:
        return SUM
    inner = getattr(op, "op", op)
    try:
        return _TORCH_OPS[int(inner)]
    except (KeyError, TypeError, ValueError):
        return getattr(inner, "name", str(inner))


def _hash_is_op() -> bool:
    """Whether hash() of a ReduceOp is its RedOpType value, as torch's binding defines it
    (`__hash__` returns `op_`): then all_reduce's fast path keys its table by it, the
    cheapest read of an op (0.15 us, where `op == SUM` takes 0.2 and `.op` 0.3)."""
    o = dist.AllreduceOptions()
    try:
        for v in dist.ReduceOp.RedOpType.__members__.values():
            if v != dist.ReduceOp.RedOpType.PREMUL_SUM:
                o.reduceOp = v
                if hash(o.reduceOp) != int(v):
                    return False
    except Exception:  # noqa: BLE001 - another torch: key by op_code
        return False
    return True


fast_op_key: Callable[[Any], Any] = hash if _hash_is_op() else op_code


def fast_op_keys(names: Iterable[str]) -> dict[Any, int]:
    """`fast_op_key` of each torch ReduceOp named in `names` -> its rsccl op code."""
    o, keys = dist.AllreduceOptions(), {}
    for name in names:
        o.reduceOp = dist.ReduceOp.RedOpType.__members__[name]
        keys[fast_op_key(o.reduceOp)] = OP_CODES[name]
    return keys


def op_name(code: int | str) -> str:
    return OP_NAMES.get(code, str(code)) if isinstance(code, int) else code


def dtype_code(t: torch.Tensor) -> int | str:
    """The rsccl code of `t`'s dtype, or torch's name of one rsccl lacks (refused by the core)."""
    code = DTYPE_CODES.get(t.dtype)
    return code if code is not None else str(t.dtype).removeprefix("torch.")


class ErrorClass(enum.IntEnum):
    """The class of an argument error: the Rust core's error class code, and the Python
    exception it becomes (rust/bindings/src/errors.rs)."""

    VALUE = dict(_rsccl.ERROR_CLASSES)["value"]
    TYPE = dict(_rsccl.ERROR_CLASSES)["type"]

    @property
    def exception(self) -> type[Exception]:
        return TypeError if self is ErrorClass.TYPE else ValueError


class ArgumentError(Exception):
    """Raised while preparing a collective; carries the class of error to report."""

    def __init__(self, message: str, cls: ErrorClass = ErrorClass.VALUE):
        super().__init__(message)
        self.cls = cls

    def to_raise(self) -> Exception:
        """The exception this rank raises for it ("rsccl: " and the message)."""
        return self.cls.exception(f"rsccl: {self}")
