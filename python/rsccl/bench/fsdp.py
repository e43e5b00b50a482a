"""The FSDP2 section of `python -m rsccl.bench --device cuda` (see rsccl/bench/cuda/__init__.py,
"What runs"): a small transformer trained for a few steps with fully_shard over an rsccl group
(FSDP's all-gather outputs from the group's pool, in place: rsccl.fsdp.use_pool; all its
communication buffers with --fsdp-pool-comms both) and over an NCCL group, in
the benchmark's rank processes, after the collective measurements.

Per backend: a group of its own is created (new_group, so that what the library allocates
at creation and at first use counts in that backend's figures), the same seeded model is
sharded over DeviceMesh.from_group(group, "cuda") with MixedPrecisionPolicy(bfloat16 params,
float32 reductions), and trained --fsdp-warmup untimed then --fsdp-steps timed steps on
the same data. The backends run `repeats` times each in ABBA order, NCCL first (each run
starts with what the earlier ones left behind, see fsdp_report.fsdp_markdown); a backend's
step time is the median of its runs, reported with their spread. Each step of each phase is agreed among the
ranks (over the harness's gloo group), so a failure is recorded for that backend and the
other still runs.
"""

from __future__ import annotations

import copy
import gc
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..fsdp import use_pool
from .common import GRANULE, POOL_VA_FLOOR, abba_order, describe, resolved, round_up, spread

MiB = 1 << 20
FSDP_ALLOWANCE_S = 150.0  # added to --timeout per repeat, for a world size that runs this section
GROUP_TIMEOUT_S = 120.0  # the section's own groups: a hang ends within this
LOSS_RTOL = 0.02  # final losses of the two backends (same weights, same data) must agree this well
RUN_ORDER = ("nccl", "rsccl")
# Step times on the GPU machines drift by 10-30% between runs minutes apart (NCCL's own
# FSDP2 step measured 30-40 ms at 4 ranks across runs of one day), so each backend runs
# `repeats` times (--fsdp-repeats, 3 by default: medians and a spread, as issue 26 asks),
# in ABBA order (abba_order), and the reported step time is the median of its runs. Memory
# is the first run's (the later ones run with the earlier runs' groups still alive).
REPEATS_DEFAULT = 3


@dataclass(frozen=True)
class FsdpConfig:
    """What the section runs; picklable, it travels to the ranks inside the bench's Config."""

    layers: int = 8
    dim: int = 2048
    seq: int = 1024
    batch: int = 4  # per rank
    vocab: int = 8192
    ffn_mult: int = 4
    steps: int = 20
    warmup: int = 5
    lr: float = 0.0  # AdamW's rate after the warm-up; 0: `learning_rate()`'s default for the width
    pool_bytes: int = 0  # cuda_pool_bytes of the rsccl group; 0: pool_bytes_for()
    repeats: int = REPEATS_DEFAULT  # runs per backend, ABBA
    pool_comms: str = "all_gather"  # rsccl.fsdp.use_pool's comms: FSDP's buffers from rsccl's pool (rsccl run)

    def order(self) -> list[str]:
        """The section's runs, backend by backend: RUN_ORDER, then reversed, `repeats` times."""
        return abba_order(RUN_ORDER, self.repeats)

    def allowance_s(self) -> float:
        """What the section adds to --timeout for a world size: FSDP_ALLOWANCE_S per repeat."""
        return FSDP_ALLOWANCE_S * self.repeats

    @property
    def head_dim(self) -> int:
        return 128 if self.dim % 128 == 0 else 64

    @property
    def heads(self) -> int:
        return self.dim // self.head_dim

    def layer_params(self) -> int:
        """qkv, out projection, MLP up and down (no biases), two LayerNorms."""
        return (4 + 2 * self.ffn_mult) * self.dim**2 + 4 * self.dim

    def root_params(self) -> int:
        """What the root FSDP module owns: embedding, output head, final LayerNorm."""
        return 2 * self.vocab * self.dim + 2 * self.dim

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def learning_rate(self) -> float:
        """AdamW's rate after the warm-up: `lr` if given, else 3e-4 up to d_model 2048 and
        3e-4 x 2048 / d_model above (Adam's step moves each weight by about the rate, so a
        layer's output moves with its width: scaled so, a wider model takes steps of the
        same size as the default one). With 3e-4 at d_model 4096 and 12 layers the model
        trained chaotically on 2 H100s (final losses 1.89 to 5.25 over four runs of the two
        backends, issue 26), which made the loss check meaningless there."""
        return self.lr if self.lr > 0 else 3e-4 * min(1.0, 2048 / self.dim)

    def lr_factor(self, step: int) -> float:
        """The rate's factor at optimizer step `step` (0-based): a linear warm-up over the
        untimed warm-up steps, then 1, so the timed steps all run at the same rate."""
        return min(1.0, (step + 1) / self.warmup) if self.warmup > 0 else 1.0

    def describe(self) -> str:
        return (
            f"{self.layers} layers, d_model {self.dim}, {self.heads} heads, FFN {self.ffn_mult * self.dim}, "
            f"vocab {self.vocab}, seq {self.seq}, batch {self.batch} per rank, "
            f"{self.params() / 1e6:.0f}M parameters, AdamW lr {self.learning_rate():.2g} after {self.warmup} warm-up steps"
            + ("; rsccl's pool for all of FSDP's communication buffers" if self.pool_comms == "both" else "")
        )


def pool_bytes_for(fc: FsdpConfig, world: int) -> int:
    """cuda_pool_bytes for the rsccl FSDP group: what FSDP2 takes from it at once, x 1.15.
    FSDP2 allocates there (ProcessGroupAllocMixin) the all-gather outputs (bf16; the root's
    stays unsharded from forward to backward, and about two layers' are live at the peak)
    and the reduce-scatter inputs (float32; one layer's at the peak) and outputs, and the
    float32 gradient shards are views of those outputs, so all of them live there until
    zero_grad. Measured (4 H100s, 2026-11-27): 12 layers at d_model 4096 peaked at 4066 MiB
    of the pool (gradient shards 2368 MiB + 1698), the same with a pool of 6802 or 4864
    MiB; this gives 4786. A pool too small is not an error: the allocations that do not fit
    come from torch's allocator, with a warning, and those collectives are staged."""
    if fc.pool_bytes:
        return fc.pool_bytes
    unit = max(fc.layer_params(), fc.root_params())
    need = 2 * fc.root_params() + 2 * 2 * fc.layer_params() + 128 * MiB  # all-gather outputs
    # With pool_comms "all_gather" (rsccl.fsdp.use_pool's default) that is all: no gradient
    # shard, no reduce-scatter buffer (4 H100s, 2026-11-28: 12 layers at d_model 4096 peaked
    # at 902 MiB of the 1178 this gives).
    if fc.pool_comms != "all_gather":
        need += 4 * fc.params() // world + 4 * unit  # gradient shards, reduce-scatter input
    return -(-int(need * 1.15) // (2 * MiB)) * (2 * MiB)


# -- the model ----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, fc: FsdpConfig):
        super().__init__()
        d = fc.dim
        self.heads = fc.heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, fc.ffn_mult * d, bias=False)
        self.down = nn.Linear(fc.ffn_mult * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class Transformer(nn.Module):
    def __init__(self, fc: FsdpConfig):
        super().__init__()
        self.embed = nn.Embedding(fc.vocab, fc.dim)
        self.layers = nn.ModuleList(Block(fc) for _ in range(fc.layers))
        self.norm = nn.LayerNorm(fc.dim)
        self.head = nn.Linear(fc.dim, fc.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_of(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# -- inside a rank ------------------------------------------------------------------------------


class PhaseError(RuntimeError):
    """A phase failed on some rank; every rank raises it with the same message."""


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def used_bytes(dev: torch.device) -> int:
    """Device memory in use, device-wide (total - free), or 0 off CUDA."""
    if dev.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(dev)
    return total - free


def phase(r: Any, what: str, fn: Callable[[], Any], section: str = "FSDP2") -> Any:
    """fn() on every rank, then the device synchronized; if it raised on any rank, every rank
    raises PhaseError naming the first failing rank (its traceback goes to its stderr, under
    `section`'s name). No collective of the harness's gloo group may run inside fn."""
    result, err = None, ""
    try:
        result = fn()
        sync(r.dev)
    except Exception as e:  # noqa: BLE001 - agreed below, recorded by the caller
        err = describe(e)
        print(f"rank {r.rank}: {section} {what} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    errs = r.agree.gather(err)
    bad = [(k, e) for k, e in enumerate(errs) if e]
    if bad:
        # The cause, rather than the other ranks' timeouts waiting for the rank that failed.
        echoes = ("TimeoutError", "PeerFailureError", "GroupAbortedError", "DistBackendError")
        k, msg = next(((k, m) for k, m in bad if not m.startswith(echoes)), bad[0])
        more = f" ({len(bad)} ranks failed)" if len(bad) > 1 else ""
        raise PhaseError(f"{what}: rank {k}: {msg}{more}")
    return result


def rsccl_options(r: Any, pool: int) -> dict[str, Any]:
    """The rsccl FSDP group's options: --rsccl-options, the pool, a VA cap that fits it."""
    user = dict(r.cfg.rsccl_options)
    # cuda_buffer_bytes as rsccl resolves it (the option, else RSCCL_CUDA_BUFFER_BYTES, else the
    # default); None where rsccl would refuse the options (the group's creation then says why).
    settings = resolved(user)
    buf = settings["cuda_buffer_bytes"] if settings else None
    need = r.world * round_up(pool + (buf if buf is not None else 4 << 30), GRANULE)
    return {**user, "cuda_pool_bytes": pool, "max_cuda_va_bytes": max(POOL_VA_FLOOR, need + (1 << 30))}


def new_group(r: Any, backend: str, pool: int) -> Any:
    from datetime import timedelta

    timeout = timedelta(seconds=min(GROUP_TIMEOUT_S, r.cfg.timeout_s))
    if backend == "rsccl":
        from rsccl import Options

        return dist.new_group(backend="rsccl", timeout=timeout, pg_options=Options(**rsccl_options(r, pool)))
    if r.dev.type == "cuda":
        from .._cuda import nccl_baseline

        g = dist.new_group(backend="nccl", timeout=timeout, device_id=r.dev)
        if r.rank == 0:
            print(f'FSDP2 bench: backend "nccl" is {nccl_baseline(g)}', flush=True)
        return g
    return dist.new_group(backend="gloo", timeout=timeout)  # the CPU dry run of this module


def rsccl_counts(group: Any) -> dict[str, int]:
    """The rsccl group's in-place/staged counters and pool figures ({} if memory_stats() fails:
    they are only reported). Synchronizes the device."""
    import rsccl

    try:
        st = rsccl.memory_stats(group)
    except Exception as e:  # noqa: BLE001
        print(f"rsccl.memory_stats(FSDP2 group) failed: {e!r}", file=sys.stderr, flush=True)
        return {}
    keys = ("cuda_inplace_collectives", "cuda_staged_collectives", "cuda_pool_bytes", "cuda_pool_peak_bytes")
    return {k: int(st[k]) for k in keys if k in st}


def train_one(r: Any, backend: str, master: Transformer, ids: torch.Tensor, targets: torch.Tensor, pool: int) -> dict:
    """One backend's run on this rank: its figures (this rank's), or PhaseError."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fc: FsdpConfig = r.cfg.fsdp
    dev = r.dev
    cuda = dev.type == "cuda"
    out: dict[str, Any] = {}
    gc.collect()
    sync(dev)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        out["reserved_start"] = torch.cuda.memory_reserved(dev)
    out["used_start"] = used_bytes(dev)
    group = phase(r, "group creation", lambda: new_group(r, backend, pool))
    out["used_after_group"] = used_bytes(dev)
    state: dict[str, Any] = {}

    def shard() -> None:
        model = copy.deepcopy(master)
        mesh = DeviceMesh.from_group(group, dev.type)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        if backend == "rsccl":
            use_pool(model, group, fc.pool_comms)
            try:
                state["pool_alloc"] = bool(group._get_backend(dev).supports_tensor_alloc(dev))
            except Exception:  # noqa: BLE001 - only reported; FSDP's own call decides
                state["pool_alloc"] = None
        state["model"] = model
        state["opt"] = opt = torch.optim.AdamW(model.parameters(), lr=fc.learning_rate(), foreach=True)
        state["sched"] = torch.optim.lr_scheduler.LambdaLR(opt, fc.lr_factor)

    phase(r, "fully_shard", shard)
    out["pool_alloc"] = state.get("pool_alloc")
    model, opt, sched = state["model"], state["opt"], state["sched"]

    def step() -> torch.Tensor:
        loss = loss_of(model, ids, targets)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    before = rsccl_counts(group) if backend == "rsccl" else {}
    phase(r, f"{fc.warmup} warm-up steps", lambda: [step() for _ in range(fc.warmup)])
    out["used_after_warmup"] = used_bytes(dev)
    r.agree.barrier()

    def timed() -> tuple[list[float], float, list[float]]:
        losses = []
        if cuda:
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(fc.steps)]
            for start, end in evs:
                start.record()
                losses.append(step())
                end.record()
            torch.cuda.synchronize(dev)
            per_step = [s.elapsed_time(e) for s, e in evs]
            total = evs[0][0].elapsed_time(evs[-1][1])
        else:
            per_step, t0 = [], time.perf_counter()
            for _ in range(fc.steps):
                t = time.perf_counter()
                losses.append(step())
                per_step.append((time.perf_counter() - t) * 1e3)
            total = (time.perf_counter() - t0) * 1e3
        return per_step, total, torch.stack(losses).float().cpu().tolist()

    per_step, total, losses = phase(r, f"{fc.steps} timed steps", timed)
    out.update(step_ms=per_step, mean_ms=total / fc.steps, losses=losses, used_after_steps=used_bytes(dev))
    if cuda:
        out["peak_reserved"] = torch.cuda.max_memory_reserved(dev)
        out["reserved_end"] = torch.cuda.memory_reserved(dev)
    if backend == "rsccl":
        after = rsccl_counts(group)
        for k in ("cuda_inplace_collectives", "cuda_staged_collectives"):
            if k in before and k in after:
                out[k.removeprefix("cuda_")] = after[k] - before[k]
        out["pool_bytes"] = after.get("cuda_pool_bytes")
        out["pool_peak_bytes"] = after.get("cuda_pool_peak_bytes")
    state.clear()
    model = opt = sched = None  # the model, its gradients and optimizer state go before the next run
    gc.collect()
    sync(dev)
    if cuda:
        torch.cuda.empty_cache()
    return out


def combine(per_rank: list[dict]) -> dict:
    """The ranks' figures as one row: times and memory of the worst rank, losses averaged."""

    def mx(key: str) -> Any:
        vals = [p[key] for p in per_rank if p.get(key) is not None]
        return max(vals) if vals else None

    steps = [max(col) for col in zip(*(p["step_ms"] for p in per_rank))]
    used_peak = [max(p["used_after_warmup"], p["used_after_steps"]) for p in per_rank]
    row = {
        "mean_ms": mx("mean_ms"),
        "step_min_ms": min(steps),
        "step_max_ms": max(steps),
        "median_ms": sorted(steps)[len(steps) // 2],
        "peak_reserved": mx("peak_reserved"),
        "reserved_start": mx("reserved_start"),
        "used_peak": max(used_peak),
        "used_start": mx("used_start"),
        "used_added": max(u - p["used_start"] for u, p in zip(used_peak, per_rank)),
        "group_init": max(p["used_after_group"] - p["used_start"] for p in per_rank),
        "loss_first": sum(p["losses"][0] for p in per_rank) / len(per_rank),
        "loss_final": sum(p["losses"][-1] for p in per_rank) / len(per_rank),
        "pool_alloc": per_rank[0].get("pool_alloc"),
        "inplace": per_rank[0].get("inplace_collectives"),
        "staged": per_rank[0].get("staged_collectives"),
        "pool_bytes": per_rank[0].get("pool_bytes"),
        "pool_peak_bytes": mx("pool_peak_bytes"),
        "ranks": len(per_rank),
    }
    # Every rank counts the same collectives; say so if they did not agree.
    counts = {(p.get("inplace_collectives"), p.get("staged_collectives")) for p in per_rank}
    if len(counts) > 1:
        row["counts_per_rank"] = sorted(counts, key=str)
    return row


def add_run(runs: dict[str, dict], backend: str, row: dict) -> dict:
    """Count one run of `backend` (its `combine`d row) in `runs`: a backend's entry is its
    first run's row (memory, losses, counts) with every run's mean step time in `round_ms`
    and their spread() (median, min, max) in `step`. Returns the entry."""
    entry = runs.get(backend)
    if entry is None:
        entry = runs[backend] = {**row, "round_ms": []}
    entry["round_ms"].append(row["mean_ms"])
    entry["step"] = spread(entry["round_ms"])
    return entry


def run_fsdp(r: Any) -> None:
    """The section, on every rank: results in r.meta["fsdp"] (rank 0's are saved)."""
    fc: FsdpConfig = r.cfg.fsdp
    pool = pool_bytes_for(fc, r.world)
    res: dict[str, Any] = {
        "config": {**asdict(fc), "lr": fc.learning_rate()},
        "describe": fc.describe(),
        "pool_bytes": pool,
        "runs": {},
        "errors": {},
        "order": fc.order(),
    }
    r.meta["fsdp"] = res
    r.log(f"FSDP2: {fc.describe()}; rsccl group pool {pool / MiB:.0f} MiB")
    dev = r.dev
    holder: dict[str, Any] = {}

    def prepare() -> None:
        # The same weights for both backends (and on every rank: fully_shard keeps each rank's
        # shard of its own copy), built on the GPU, kept on the CPU.
        torch.manual_seed(r.cfg.seed)
        with torch.device(dev):
            master = Transformer(fc)
        holder["master"] = master.to("cpu")
        gen = torch.Generator(device=dev).manual_seed(r.cfg.seed * 1009 + r.rank + 7)
        holder["ids"] = torch.randint(0, fc.vocab, (fc.batch, fc.seq), generator=gen, device=dev)
        holder["targets"] = torch.randint(0, fc.vocab, (fc.batch, fc.seq), generator=gen, device=dev)
        # Load the kernels and make the math libraries' handles and workspaces now, so that
        # neither backend's run pays for them: one layer, unsharded, forward and backward.
        with torch.device(dev):
            warm = Transformer(replace(fc, layers=1)).to(torch.bfloat16)
        for _ in range(2):
            loss_of(warm, holder["ids"], holder["targets"]).backward()
        del warm

    try:
        phase(r, "model", prepare)
    except PhaseError as e:
        res["errors"]["setup"] = str(e)
        r.log(f"FSDP2 FAILED before training: {e}")
        return
    for backend in fc.order():
        start = time.perf_counter()
        if backend in res["errors"]:
            continue
        try:
            mine = train_one(r, backend, holder["master"], holder["ids"], holder["targets"], pool)
            row = combine(r.agree.gather(mine))
            add_run(res["runs"], backend, row)
            r.log(
                f"FSDP2 {backend}: {row['mean_ms']:.2f} ms per step, peak reserved {mib(row['peak_reserved'])} MiB, "
                f"device used {mib(row['used_peak'])} MiB, final loss {row['loss_final']:.4f}, in place / staged "
                f"{calls_text(row)} ({time.perf_counter() - start:.1f} s)"
            )
        except PhaseError as e:
            res["errors"][backend] = str(e)
            r.log(f"FSDP2 {backend} FAILED: {e}")
        r.save()


# -- cells, also used by fsdp_report.py (the section's report, in the parent) -----------------


def mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / MiB:.0f}"


def calls_text(row: dict) -> str:
    i, s = row.get("inplace"), row.get("staged")
    if i is None or s is None:
        return "n/a"
    flag = "" if s == 0 and i > 0 else (" STAGED" if i == 0 else " MIXED")
    return f"{i} / {s}{flag}"
