"""The op records the ProcessGroup hands to the Rust core (`Communicator.run`), for every
torch method, on CPU tensors and without processes: a recording stand-in for the
Communicator checks each op's kind, buffers, dtype, op, root and splits, and the CUDA
paths run on CPU tensors dressed as CUDA ones (the launch is recorded, not made), so the
CUDA plans are exercised on a machine without a GPU. The registry test checks that every
kind of the Rust core is named, routed and covered here."""

import random
from pathlib import Path

import pytest
import rsccl._backend as backend
import rsccl._plans as plans
import torch
import torch.distributed as dist
from rsccl import _ops, _rsccl
from torch._C._distributed_c10d import AllgatherOptions


class _Cuda(torch.Tensor):
    """A CPU tensor that the ProcessGroup takes for a CUDA tensor of its device."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = True


class _OtherDevice(torch.Tensor):
    """A CPU tensor whose get_device() is the index the ProcessGroup takes for its GPU's,
    as another accelerator's tensor may be, but not a CUDA tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = False


class _DoneWork:
    """What the Communicator returns for an asynchronous host op: here, already done."""

    def add_done_callback(self, cb) -> None:
        cb(None)

    def wait(self, timeout_s=None) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class _EndEvent:
    """What the Communicator returns for an asynchronous CUDA op: its end event."""


class _Pending:
    """Stands in for the group's list of pending CUDA Works (which asks the GPU)."""

    def __init__(self) -> None:
        self.works: list = []

    def add(self, w) -> None:
        self.works.append(w)


class _Recorder:
    """Stands in for rsccl._rsccl.Communicator: records each op, runs nothing."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def run(self, *args):
        self.ops.append(args)
        kind, stream, blocking = args[0], args[8], args[9]
        if stream is None:
            return _DoneWork() if not blocking or kind in (_ops.SEND, _ops.RECV) else None
        return None if blocking else _EndEvent()

    def invalid(self, kind, error_class, message, stream=None):
        self.ops.append(("invalid", kind, error_class, message, stream))
        raise _ops.ErrorClass(error_class).exception(f"rsccl: {message}")

    def cuda_health(self) -> None:
        pass


def _group(monkeypatch, rank: int = 1, size: int = 4, cuda: bool = False) -> backend.ProcessGroupRsccl:
    monkeypatch.setattr(backend, "raw_stream", lambda device: 77)
    pg = backend.ProcessGroupRsccl.__new__(backend.ProcessGroupRsccl)
    dist.ProcessGroup.__init__(pg, rank, size)
    pg._comm = _Recorder()
    pg._gloo = None
    pg._cuda_engine = _ops.Route.RSCCL if cuda else None
    pg._cuda_device = -1 if cuda else None  # a CPU tensor's get_device()
    pg._fast_device = pg._cuda_device
    pg._group_size, pg._group_rank = size, rank
    pg._done = backend.DoneWork([])
    pg._coalesced = None
    pg._pending = _Pending()
    if cuda:
        # Device checks need a GPU; they have their own tests (tests/gpu).
        monkeypatch.setattr(pg, "_cuda_check", lambda t, what: None)
    return pg


def _opts(cls, asynchronous: bool = False, **kw):
    o = cls()
    o.asyncOp = asynchronous
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture
def seed():
    s = random.randrange(1 << 30)
    print(f"seed {s}")
    return s


def test_host_ops(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    pg = _group(monkeypatch)
    x = torch.randn(6, 5, generator=g)
    pg.allreduce([x], _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.MAX))
    pg.broadcast([x], _opts(dist.BroadcastOptions, rootRank=2))
    out = torch.empty(4 * 30)
    pg._allgather_base(out, x.reshape(-1), _opts(AllgatherOptions))
    pg._reduce_scatter_base(x.reshape(-1)[:5], out[:20], _opts(dist.ReduceScatterOptions))
    o2 = torch.empty(8, 5)
    pg.alltoall_base(o2, x, [1, 3, 2, 2], [2, 2, 1, 1], _opts(dist.AllToAllOptions))
    ops = pg._comm.ops
    f32, mx, s = _ops.DTYPE_CODES[torch.float32], _ops.OP_CODES["MAX"], _ops.SUM
    assert ops[0] == (_ops.ALL_REDUCE, x.data_ptr(), 120, x.data_ptr(), 120, f32, mx, 0, None, True, None, 0)
    assert ops[1][:1] + ops[1][5:] == (_ops.BROADCAST, f32, s, 2, None, True, None, 0)
    assert ops[2][:5] == (_ops.ALL_GATHER, x.data_ptr(), 120, out.data_ptr(), 480)
    assert ops[3][0] == _ops.REDUCE_SCATTER and ops[3][2] == 80 and ops[3][4] == 20
    # The host engine reads the byte counts of the splits (and ignores the chunk addresses).
    assert ops[4][0] == _ops.ALL_TO_ALL and ops[4][10][1::2] == ([40, 40, 20, 20], [20, 60, 40, 40])
    pg.barrier()
    assert ops[5] == (_ops.BARRIER, 0, 0, 0, 0, _ops.UINT8, s, 0, None, False, None, 0)
    pg.recv([x], 3, 5)
    assert ops[6] == (_ops.RECV, 0, 0, x.data_ptr(), 120, f32, s, 3, None, False, None, 5)
    # Asynchronous host calls take the plan (an RsWork): the fast paths' host side is for
    # blocking calls only.
    for call in (
        lambda: pg._allgather_base(out, x.reshape(-1), _opts(AllgatherOptions, asynchronous=True)),
        lambda: pg._reduce_scatter_base(x.reshape(-1)[:5], out[:20], _opts(dist.ReduceScatterOptions, asynchronous=True)),
    ):
        assert isinstance(call(), backend.RsWork) and ops[-1][8:10] == (None, False)


@pytest.mark.parametrize("cuda", [False, True])
def test_rooted_ops_give_the_root_only_side_its_group_size_blocks(monkeypatch, seed, cuda):
    """gather's output and scatter's input hold a block per rank at the root; a rank other
    than the root passes its own buffer there (the core drops it), on either device."""
    g = torch.Generator().manual_seed(seed)
    dev = (lambda t: t.as_subclass(_Cuda)) if cuda else (lambda t: t)
    for rank in (0, 2):
        pg = _group(monkeypatch, rank=rank, cuda=cuda)
        x = dev(torch.randn(3, generator=g))
        outs = [[dev(torch.empty(3)) for _ in range(4)]]
        pg.gather(outs if rank == 2 else [], [x], _opts(dist.GatherOptions, rootRank=2))
        op = pg._comm.ops[-1]
        assert op[0] == _ops.GATHER and op[7] == 2 and op[1:3] == (x.data_ptr(), 12)
        assert op[4] == 48 if rank == 2 else op[3:5] == (x.data_ptr(), 12)
        out = dev(torch.empty(3))
        ins = [[dev(torch.randn(3, generator=g)) for _ in range(4)]]
        pg.scatter([out], ins if rank == 2 else [], _opts(dist.ScatterOptions, rootRank=2))
        op = pg._comm.ops[-1]
        assert op[0] == _ops.SCATTER and op[7] == 2 and op[3:5] == (out.data_ptr(), 12)
        assert op[2] == 48 if rank == 2 else op[1:3] == (out.data_ptr(), 12)


def test_coalesced_all_gather_is_packed_once_for_both_devices(monkeypatch, seed):
    """The CPU and CUDA plans of a coalesced all_gather make the same block: one layout."""
    g = torch.Generator().manual_seed(seed)
    ins = [torch.randn(7, generator=g), torch.randint(0, 9, (3, 2), generator=g), torch.randn(5, generator=g).bfloat16()]
    blocks = []
    for cuda in (False, True):
        pg = _group(monkeypatch, size=2, cuda=cuda)
        inputs = [t.as_subclass(_Cuda) if cuda else t for t in ins]
        outs = [torch.empty(2 * t.numel(), dtype=t.dtype) for t in ins]
        outs = [t.as_subclass(_Cuda) for t in outs] if cuda else outs
        captured = []
        real_pack = plans._pack_bytes

        def pack(inputs, offsets, total, captured=captured, real_pack=real_pack):
            flat = real_pack(inputs, offsets, total)
            captured.append((list(offsets), total, flat))
            return flat

        monkeypatch.setattr(plans, "_pack_bytes", pack)
        pg.allgather_into_tensor_coalesced(outs, inputs, _opts(AllgatherOptions))
        (op,) = pg._comm.ops
        assert op[0] == _ops.ALL_GATHER and op[5] == _ops.UINT8
        offsets, total, flat = captured[0]
        assert op[2] == total and op[4] == 2 * total
        blocks.append((offsets, total, [flat[o : o + _nbytes(t)] for o, t in zip(offsets, ins)]))
    assert blocks[0][:2] == blocks[1][:2]
    for a, b in zip(blocks[0][2], blocks[1][2]):
        assert torch.equal(a, b)


def test_cuda_ops(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    pg = _group(monkeypatch, cuda=True)
    x = torch.randn(64, generator=g).bfloat16().as_subclass(_Cuda)
    bf16, f32 = _ops.DTYPE_CODES[torch.bfloat16], _ops.DTYPE_CODES[torch.float32]
    # all_reduce's fast path and its full path make the same op, blocking or not.
    pg.allreduce([x], _opts(dist.AllreduceOptions))
    pg._allreduce([x], _opts(dist.AllreduceOptions))
    fast, full = pg._comm.ops
    assert fast == (_ops.ALL_REDUCE, x.data_ptr(), 128, x.data_ptr(), 128, bf16, _ops.SUM, 0, 77, True)
    assert full[:10] == fast
    async_sum = _opts(dist.AllreduceOptions, asynchronous=True)
    _same_work(pg, lambda: pg.allreduce([x], async_sum), lambda: pg._allreduce([x], async_sum), x)
    pg._comm.ops = pg._comm.ops[:2]
    y = torch.randn(8, generator=g).as_subclass(_Cuda)
    pg.broadcast([y], _opts(dist.BroadcastOptions, rootRank=3))
    pg.reduce([y], _opts(dist.ReduceOptions, rootRank=2, reduceOp=dist.ReduceOp.MIN))
    out = torch.empty(32).as_subclass(_Cuda)
    pg._allgather_base(out, y, _opts(AllgatherOptions))
    pg._reduce_scatter_base(y, out, _opts(dist.ReduceScatterOptions))
    b, r, ag, rs = pg._comm.ops[2:]
    # Ops that move bytes pass their tensor's dtype; the core runs them as bytes on CUDA.
    assert b[5:8] == (f32, _ops.SUM, 3) and b[2] == 32
    assert r[0] == _ops.REDUCE and r[5:8] == (f32, _ops.OP_CODES["MIN"], 2)
    assert ag[:5] == (_ops.ALL_GATHER, y.data_ptr(), 32, out.data_ptr(), 128) and ag[5] == f32
    assert rs[:5] == (_ops.REDUCE_SCATTER, out.data_ptr(), 128, y.data_ptr(), 32) and rs[5] == f32
    # all_to_all: the chunks per peer travel as splits.
    o = torch.empty(16).as_subclass(_Cuda)
    i = torch.randn(16, generator=g).as_subclass(_Cuda)
    pg.alltoall_base(o, i, [], [], _opts(dist.AllToAllOptions))
    a2a = pg._comm.ops[-1]
    ip, op_ = i.data_ptr(), o.data_ptr()
    assert a2a[0] == _ops.ALL_TO_ALL and a2a[8:11] == (
        77,
        True,
        ([ip, ip + 16, ip + 32, ip + 48], [16] * 4, [op_, op_ + 16, op_ + 32, op_ + 48], [16] * 4),
    )
    # The full path makes the same op.
    pg._alltoall_full(o, i, [], [], _opts(dist.AllToAllOptions))
    assert pg._comm.ops[-1][:8] == a2a[:8] and pg._comm.ops[-1][10] == a2a[10]
    # send/recv: the peer in the root field.
    pg.send([y], 3)
    assert pg._comm.ops[-1][:8] == (_ops.SEND, y.data_ptr(), 32, 0, 0, f32, _ops.SUM, 3)
    pg.recv([y], 0)
    assert pg._comm.ops[-1][:10] == (_ops.RECV, 0, 0, y.data_ptr(), 32, f32, _ops.SUM, 0, 77, False)
    # The peer is the core's to check (collective/validate.rs): it travels as the rank gave it.
    pg.send([y], 9)
    assert pg._comm.ops[-1][:8] == (_ops.SEND, y.data_ptr(), 32, 0, 0, f32, _ops.SUM, 9)


def _same_work(pg, fast, full, *kept, same_op: bool = True) -> None:
    """An asynchronous call through a fast path (`fast`) and through the full path
    (`full`): the same op, with blocking off, and the same kind of Work, pending in the
    group, on the same device and stream, reporting the same tensors; the fast path's
    keeps `kept` (the tensors the kernel reads and writes) until a stream is ordered after
    it, and has nothing to copy back. `same_op=False` where the plan stages the output
    (all_to_all_single), so that only the Works compare."""
    w = fast()
    op = pg._comm.ops[-1]
    v = full()
    assert op[9] is False and pg._comm.ops[-1][9] is False
    if same_op:
        assert op == pg._comm.ops[-1][: len(op)]
    for x in (w, v):
        assert isinstance(x, backend.CudaWork) and x in pg._pending.works
        assert isinstance(x._event, _EndEvent) and (x._device, x._stream) == (v._device, 77)
    assert len(w._result) == len(v._result) and all(a is b for a, b in zip(w._result, v._result))
    assert all(any(k is t for t in _flatten(w._keep)) for k in kept) and w._post is None


def _flatten(x):
    return [t for y in x for t in _flatten(y)] if isinstance(x, (tuple, list)) else [x]


def test_all_to_all_single_fast_path_agrees_with_the_plan(monkeypatch, seed):
    """all_to_all_single's fast path makes the op the full plan makes (the plan stages the
    output, so only its input side and the byte counts compare), for even splits (no lists)
    and explicit ones, blocking or not, and leaves to the plan what it must not take."""
    g = torch.Generator().manual_seed(seed)
    print(f"seed {seed}")
    pg = _group(monkeypatch, cuda=True)
    rows = 4 * int(torch.randint(1, 6, (1,), generator=g))
    i = torch.randn(rows, 3, generator=g).as_subclass(_Cuda)
    o = torch.empty(rows, 3).as_subclass(_Cuda)
    r = rows // 4
    uneven = [r - 1, r + 2, r, r - 1] if r > 1 else [0, 2, 1, 1]
    for outs, ins in (([], []), ([r] * 4, [r] * 4), (uneven, uneven)):
        pg.alltoall_base(o, i, outs, ins, _opts(dist.AllToAllOptions))
        pg._alltoall_full(o, i, outs, ins, _opts(dist.AllToAllOptions))
        fast, full = pg._comm.ops[-2:]
        assert fast[9] is True and full[9] is True
        assert fast[:3] == full[:3] and fast[4:8] == full[4:8], (outs, ins)
        assert fast[10][0] == full[10][0] and fast[10][1] == full[10][1] and fast[10][3] == full[10][3], (outs, ins)
        assert fast[3] == o.data_ptr() and fast[10][2][0] == o.data_ptr()
        a2a_async = _opts(dist.AllToAllOptions, asynchronous=True)
        fast_call = lambda: pg.alltoall_base(o, i, outs, ins, a2a_async)  # noqa: E731
        _same_work(pg, fast_call, lambda: pg._alltoall_full(o, i, outs, ins, a2a_async), o, i, same_op=False)
        assert pg._comm.ops[-2][:9] + pg._comm.ops[-2][10:] == fast[:9] + fast[10:]
    monkeypatch.setattr(pg, "_alltoall_full", lambda *a, **k: "full")
    blocking = _opts(dist.AllToAllOptions)
    assert isinstance(pg.alltoall_base(o, i, [], [], _opts(dist.AllToAllOptions, asynchronous=True)), backend.CudaWork)
    assert pg.alltoall_base(o[:-1], i[:-1], [], [], blocking) == "full"  # rows not divisible by 4
    assert pg.alltoall_base(o[:-4], i, [], [], blocking) == "full"  # own chunks differ
    assert pg.alltoall_base(i, i, [], [], blocking) == "full"  # in place
    assert pg.alltoall_base(o, i, [r] * 3, [r] * 4, blocking) == "full"  # bad splits
    assert pg.alltoall_base(o.double().as_subclass(_Cuda), i, [], [], blocking) == "full"
    assert pg.alltoall_base(o, i.as_subclass(_OtherDevice), [], [], blocking) == "full"
    assert pg.alltoall_base(o, i, [], [], blocking) is pg._done


def test_cuda_coalesced_all_reduce_is_one_op_per_dtype(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    pg = _group(monkeypatch, cuda=True)
    ts = [torch.randn(5, generator=g), torch.randn(3, generator=g).bfloat16(), torch.randn(4, generator=g)]
    pg.allreduce_coalesced([t.as_subclass(_Cuda) for t in ts], _opts(dist.AllreduceCoalescedOptions))
    ops = pg._comm.ops
    assert [(op[0], op[2], op[5]) for op in ops] == [
        (_ops.ALL_REDUCE, 36, _ops.DTYPE_CODES[torch.float32]),
        (_ops.ALL_REDUCE, 6, _ops.DTYPE_CODES[torch.bfloat16]),
    ]


def test_bad_arguments_join_as_invalid_through_one_owner(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    pg = _group(monkeypatch, cuda=True)
    x = torch.randn(4, generator=g).as_subclass(_Cuda)
    out = torch.empty(12, dtype=torch.float64).as_subclass(_Cuda)
    # A tensor-shaped error (Python's side): the call joins as invalid through the one seam.
    with pytest.raises(TypeError, match=r"rsccl: all_gather: output dtype torch.float64 differs from input dtype torch.float32"):
        pg._allgather_base(out, x, _opts(AllgatherOptions))
    assert pg._comm.ops[-1][:3] == ("invalid", _ops.ALL_GATHER, _ops.ErrorClass.TYPE) and pg._comm.ops[-1][4] == 77
    # Sizes that do not fit are the core's to check (Op::to_cuda, tested in collective/op.rs,
    # as the host engine's check_local): the op reaches it as the rank gave it.
    out = torch.empty(7).as_subclass(_Cuda)
    pg._allgather_base(out, x, _opts(AllgatherOptions))
    assert pg._comm.ops[-1][:5] == (_ops.ALL_GATHER, x.data_ptr(), 16, out.data_ptr(), 28)
    # What the op asks of the kernels (a root, a dtype and op they reduce) is the core's to
    # check (Op::to_cuda, tested in collective/op.rs): the op reaches it as the rank gave it.
    pg.broadcast([x], _opts(dist.BroadcastOptions, rootRank=9))
    assert pg._comm.ops[-1][:8] == (_ops.BROADCAST, x.data_ptr(), 16, x.data_ptr(), 16, _ops.DTYPE_CODES[torch.float32], _ops.SUM, 9)
    xd = x.double().as_subclass(_Cuda)
    pg.allreduce([xd], _opts(dist.AllreduceOptions))
    assert pg._comm.ops[-1][:7] == (_ops.ALL_REDUCE, xd.data_ptr(), 32, xd.data_ptr(), 32, _ops.DTYPE_CODES[torch.float64], _ops.SUM)


def test_registry_every_kind_is_named_routed_and_covered():
    """Every kind of the Rust core (collective/kind.rs) has a constant in rsccl._ops, is
    used by the ProcessGroup, and by this file's checks; every dtype and op has a torch
    counterpart; every error class its exception."""
    src = Path(plans.__file__).read_text() + Path(backend.__file__).read_text()
    here = Path(__file__).read_text()
    for name, code in _rsccl.KINDS:
        if name == "an invalid call":
            continue
        const = name.upper()
        assert getattr(_ops, const) == code, f"rsccl._ops lacks {const}"
        assert src.count(const) >= 2, f"_plans.py/_backend.py do not route {name}"
        assert f"_ops.{const}" in here, f"tests/test_plan.py does not cover {name}"
    assert {getattr(torch, n) for n, _ in _rsccl.DTYPES} == set(_ops.DTYPE_CODES)
    assert set(_ops.OP_CODES) <= set(dist.ReduceOp.RedOpType.__members__)
    assert {c.exception for c in _ops.ErrorClass} == {ValueError, TypeError}


def test_op_code_maps_every_torch_op_by_name():
    """op_code answers SUM by a comparison before reading .op (the hot path): every op
    torch names, given as a ReduceOp (what torch passes in options) or as a RedOpType,
    maps to rsccl's code of that name, or to the name where rsccl lacks the op; PREMUL_SUM
    (a ReduceOp with a factor) is not taken for SUM."""
    for name, member in dist.ReduceOp.RedOpType.__members__.items():
        want = _ops.OP_CODES.get(name, name)
        opts = dist.AllreduceOptions()
        if name == "PREMUL_SUM":
            opts.reduceOp = dist._make_nccl_premul_sum(2.0)
        else:
            opts.reduceOp = getattr(dist.ReduceOp, name)
        assert _ops.op_code(opts.reduceOp) == want, name
        assert _ops.op_code(member) == want, name
    assert _ops.op_code(dist.ReduceOp.SUM) == _ops.SUM


def test_all_reduce_fast_path_takes_what_the_kernels_reduce(monkeypatch, seed):
    """all_reduce's fast path (its table keyed by `fast_op_key`) makes the same op as the
    full path for every dtype and op the CUDA kernels reduce, blocking or not, and leaves to
    the full path what it must not take: PREMUL_SUM, a dtype or op the kernels lack, a
    non-contiguous tensor, another device, and every call while a profiler runs (which
    records it). reduce_scatter's and all_gather's fast paths likewise."""
    g = torch.Generator().manual_seed(seed)
    print(f"seed {seed}")
    pg = _group(monkeypatch, cuda=True)
    dtypes = sorted(backend.REDUCE_DTYPES, key=str)
    for dt in dtypes:
        x = (torch.randn(48, generator=g) * 8).to(dt).as_subclass(_Cuda)
        for name in backend.REDUCE_OPS:
            if name == "AVG" and not dt.is_floating_point:
                continue
            before = len(pg._comm.ops)
            op = getattr(dist.ReduceOp, name)
            pg.allreduce([x], _opts(dist.AllreduceOptions, reduceOp=op))
            pg._allreduce([x], _opts(dist.AllreduceOptions, reduceOp=op))
            fast, full = pg._comm.ops[before : before + 2]
            want = (_ops.ALL_REDUCE, x.data_ptr(), x.nbytes, x.data_ptr(), x.nbytes, _ops.DTYPE_CODES[dt], _ops.OP_CODES[name], 0, 77, True)
            assert fast == want, (dt, name)
            assert full[:10] == want, (dt, name)
            ar_async = _opts(dist.AllreduceOptions, asynchronous=True, reduceOp=op)
            _same_work(pg, lambda: pg.allreduce([x], ar_async), lambda: pg._allreduce([x], ar_async), x)
            assert pg._comm.ops[-1][:10] == want[:9] + (False,), (dt, name)
            # reduce_scatter's fast path takes the same table.
            shard = torch.empty(12, dtype=dt).as_subclass(_Cuda)
            pg._reduce_scatter_base(shard, x, _opts(dist.ReduceScatterOptions, reduceOp=op))
            rs = pg._comm.ops[-1]
            assert rs == (_ops.REDUCE_SCATTER, x.data_ptr(), x.nbytes, shard.data_ptr(), shard.nbytes) + want[5:], (dt, name)
            pg._reduce_scatter_into(shard, x, _opts(dist.ReduceScatterOptions, reduceOp=op))
            assert pg._comm.ops[-1][:10] == rs, (dt, name)
            rs_opts = _opts(dist.ReduceScatterOptions, asynchronous=True, reduceOp=op)
            rs_async = lambda: pg._reduce_scatter_base(shard, x, rs_opts)  # noqa: E731
            _same_work(pg, rs_async, lambda: pg._reduce_scatter_into(shard, x, rs_opts), shard, x)
            assert pg._comm.ops[-1][:10] == rs[:9] + (False,), (dt, name)
    # all_gather's fast path, blocking or not, makes the full path's op.
    y = torch.randn(12, generator=g).as_subclass(_Cuda)
    gathered = torch.empty(48).as_subclass(_Cuda)
    pg._allgather_base(gathered, y, _opts(AllgatherOptions))
    pg._allgather_into(gathered, y, _opts(AllgatherOptions))
    ag, ag_full = pg._comm.ops[-2:]
    assert ag == (_ops.ALL_GATHER, y.data_ptr(), 48, gathered.data_ptr(), 192, _ops.DTYPE_CODES[torch.float32], _ops.SUM, 0, 77, True)
    assert ag_full[:10] == ag
    ag_async = _opts(AllgatherOptions, asynchronous=True)
    _same_work(pg, lambda: pg._allgather_base(gathered, y, ag_async), lambda: pg._allgather_into(gathered, y, ag_async), gathered, y)
    assert pg._comm.ops[-1][:10] == ag[:9] + (False,)
    monkeypatch.setattr(pg, "_allgather_into", lambda *a: "full")
    monkeypatch.setattr(pg, "_reduce_scatter_into", lambda *a: "full")
    assert isinstance(pg._allgather_base(gathered, y, _opts(AllgatherOptions, asynchronous=True)), backend.CudaWork)
    assert isinstance(pg._reduce_scatter_base(y, gathered, _opts(dist.ReduceScatterOptions, asynchronous=True)), backend.CudaWork)
    assert pg._allgather_base(gathered, y.double().as_subclass(_Cuda), _opts(AllgatherOptions, asynchronous=True)) == "full"
    # What the fast path leaves to the full path (which stages, refuses, or records).
    monkeypatch.setattr(pg, "_allreduce", lambda tensors, opts=None: "full")
    x = torch.randn(64, generator=g).as_subclass(_Cuda)
    sum_ = _opts(dist.AllreduceOptions)
    premul = _opts(dist.AllreduceOptions, reduceOp=dist._make_nccl_premul_sum(2.0))
    assert pg.allreduce([x], premul) == "full"
    assert pg.allreduce([x.view(8, 8).t()], sum_) == "full"
    assert isinstance(pg.allreduce([x], _opts(dist.AllreduceOptions, asynchronous=True)), backend.CudaWork)  # fast
    assert pg.allreduce([x.to(torch.complex64).as_subclass(_Cuda)], sum_) == "full"
    assert pg.allreduce([x, x], sum_) == "full" and pg.allreduce([[1.0]], sum_) == "full"
    pg._fast_device = 0  # the group's GPU is another than the tensor's
    assert pg.allreduce([x], sum_) == "full"
    pg._fast_device = -1
    # Not a CUDA tensor, though on the group's device index (another accelerator's).
    assert pg.allreduce([x.as_subclass(_OtherDevice)], sum_) == "full"
    monkeypatch.setattr(backend, "_profiling", lambda: True)
    assert pg.allreduce([x], sum_) == "full"
    monkeypatch.setattr(backend, "_profiling", lambda: False)
    assert pg.allreduce([x], sum_) is pg._done


def test_arguments_too_broken_to_route_join_the_side_of_their_first_tensor(monkeypatch, seed):
    """A rank whose arguments do not even route (two tensors for all_reduce, a list of
    floats) joins as invalid on the side its peers are on: its first tensor's, else the
    CUDA engine's in a group that has one (docs/errors.md)."""
    g = torch.Generator().manual_seed(seed)
    pg = _group(monkeypatch, cuda=True)
    x = torch.randn(5, generator=g)
    cases = [
        ([x.as_subclass(_Cuda), x.as_subclass(_Cuda)], ValueError, 77),  # CUDA tensors: the CUDA side
        ([[1.0, 2.0]], TypeError, 77),  # no tensor at all: the group's CUDA engine
        ([x, x.clone()], ValueError, None),  # CPU tensors: the host engine
    ]
    for tensors, exc, stream in cases:
        with pytest.raises(exc):
            pg.allreduce(tensors, _opts(dist.AllreduceOptions))
        invalid = pg._comm.ops[-1]
        assert invalid[:2] == ("invalid", _ops.ALL_REDUCE) and invalid[4] == stream, (tensors, invalid)
        # On CUDA the core names the rank in its own error (Error::naming_rank, in Group::run).
    # A group without a CUDA engine never guesses CUDA.
    cpu = _group(monkeypatch, cuda=False)
    with pytest.raises(TypeError):
        cpu.allreduce([[1.0, 2.0]], _opts(dist.AllreduceOptions))
    assert cpu._comm.ops[-1][4] is None
