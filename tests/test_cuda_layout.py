"""The buffer layouts of the CUDA path's coalesced and all_to_all calls, on CPU tensors and
without processes: the collective is simulated (all_gather = the ranks' blocks back to back,
reduce_scatter = the sum of the ranks' buffers, block r to rank r), so a wrong offset or a
rank-major/tensor-major mix-up shows here, not only on a GPU machine."""

import pytest
import torch
from rsccl._plan import (
    ArgumentError,
    _gather_layout,
    _gathered,
    _offsets,
    _pack_bytes,
    _reduce_scatter_pack,
    _split_bytes,
)

# Mixed dtypes and sizes, a 0-element input and a 0-dim one: every input of a coalesced
# all_gather must come back at its own offset, with its own dtype.
SHAPES = [
    ((7,), torch.float32),
    ((0,), torch.int64),
    ((3, 5), torch.bfloat16),
    ((), torch.int64),
    ((13,), torch.bool),
    ((33,), torch.uint8),
    ((2, 2), torch.float64),
]


def _rand(g: torch.Generator, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_coalesced_all_gather_layout(seed, world):
    g = torch.Generator().manual_seed(seed)
    inputs = [[_rand(g, s, dt) for s, dt in SHAPES] for _ in range(world)]
    offsets, total = _gather_layout(inputs[0])
    assert total % 16 == 0 and all(o % 16 == 0 for o in offsets)
    # A non-contiguous input (same values, column-major) packs the same bytes.
    strided = [t.t().contiguous().t() if t.dim() == 2 else t for t in inputs[0]]
    assert not strided[2].is_contiguous()
    a, b = _pack_bytes(strided, offsets, total), _pack_bytes(inputs[0], offsets, total)
    nb = inputs[0][2].numel() * inputs[0][2].element_size()
    assert torch.equal(a[offsets[2] : offsets[2] + nb], b[offsets[2] : offsets[2] + nb])
    gathered = torch.cat([_pack_bytes(ins, offsets, total) for ins in inputs])  # what all_gather returns
    views = _gathered(gathered, world, offsets, total, inputs[0])
    for k, (shape, dt) in enumerate(SHAPES):
        assert views[k].dtype == dt and views[k].shape == (world, inputs[0][k].numel())
        for r in range(world):
            assert torch.equal(views[k][r].view(shape), inputs[r][k]), f"input {k} of rank {r} (seed {seed})"
        # all_gather_into_tensor_coalesced's output k is rank-major: rank r's input at [r * n, (r + 1) * n).
        out = torch.empty(world * inputs[0][k].numel(), dtype=dt)
        out.view(world, views[k].shape[1]).copy_(views[k])
        assert torch.equal(out, torch.cat([inputs[r][k].reshape(-1) for r in range(world)]))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_coalesced_reduce_scatter_layout(seed, world):
    g = torch.Generator().manual_seed(seed)
    numels = [5, 0, 17, 1]
    inputs = [[torch.randint(-50, 50, (world * m,), generator=g, dtype=torch.int64) for m in numels] for _ in range(world)]
    packed = [_reduce_scatter_pack(ins, numels, world) for ins in inputs]
    total = sum(numels)
    assert all(p.shape == (world * total,) and p.is_contiguous() for p in packed)
    reduced = torch.stack(packed).sum(0)  # what every rank's reduce_scatter block comes from
    for me in range(world):
        block = reduced[me * total : (me + 1) * total]
        for k, (m, off) in enumerate(zip(numels, _offsets(numels))):
            want = sum(inputs[r][k][me * m : (me + 1) * m] for r in range(world))
            assert torch.equal(block[off : off + m], want), f"output {k} of rank {me} (seed {seed})"


def test_all_to_all_split_bytes():
    t = torch.empty(12, 3, dtype=torch.float16)  # 6 bytes per row
    assert _split_bytes(t, [], 4, "x") == [18] * 4
    assert _split_bytes(t, [0, 12, 0, 0], 4, "x") == [0, 72, 0, 0]
    assert _split_bytes(torch.empty(0, 5), [0, 0], 2, "x") == [0, 0]
    assert _offsets([3, 0, 5]) == [0, 3, 3]
    with pytest.raises(ArgumentError, match="rank 1's input split sizes \\[1, 2\\] do not divide its 12 rows"):
        _split_bytes(t, [1, 2], 2, "all_to_all_single: rank 1's input")
    with pytest.raises(ArgumentError, match="12 rows, not divisible by group size 5"):
        _split_bytes(t, [], 5, "x")
    with pytest.raises(ArgumentError, match="split sizes"):
        _split_bytes(t, [13, -1], 2, "x")


def test_all_to_all_fast_path_splits_agree_with_the_full_path():
    """The blocking all_to_all_single's fast path computes the same bytes per peer as the
    full path wherever the splits are valid, and declines (None) wherever the full path
    would raise, so that the full path reports the error."""
    t = torch.empty(12, 3, dtype=torch.float16)
    for splits, n in [([], 4), ([0, 12, 0, 0], 4), ([5, 7], 2), ([], 1), ([1, 2, 3, 6], 4)]:
        assert _split_bytes(t, splits, n, None) == _split_bytes(t, splits, n, "x")
    for splits, n in [([1, 2], 2), ([], 5), ([13, -1], 2), ([12], 2)]:
        assert _split_bytes(t, splits, n, None) is None
        with pytest.raises(ArgumentError):
            _split_bytes(t, splits, n, "x")
    assert _split_bytes(torch.empty(0, 5), [0, 0], 2, None) is None, "empty: the full path handles it"
