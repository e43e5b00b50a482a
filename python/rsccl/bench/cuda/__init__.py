"""`python -m rsccl.bench --device cuda`: rsccl, NCCL and torch's symmetric memory side by
side on the GPUs of one host, in one run.

What runs: for each world size (--world-sizes, default 2,4, those above the number of
visible GPUs left out), the parent hosts a TCPStore and spawns one process per GPU; rank r
uses GPU r. Each rank joins the default group on rsccl (`init_process_group("rsccl")`,
with --rsccl-options as its rsccl.Options), a gloo group (the harness's own barriers and
agreements, CPU only), an NCCL group (`new_group(backend="nccl", device_id=...)`, created
after rsccl's memory was measured, so NCCL connects eagerly as in the baseline), and for
all_reduce torch's symmetric memory on the NCCL group's name (one_shot_all_reduce_out and
two_shot_all_reduce_, never the multicast variants). With --sweep-one-shot, all_reduce
also runs on two more rsccl groups whose one-shot threshold is 1 byte (rsccl-2shot) and 1 GiB
(rsccl-1shot).

In place (unless --no-pool): all_reduce, all_gather_into_tensor and reduce_scatter_tensor at
the sizes >= 1 MiB also run as "rsccl-pool": the same default rsccl group, on buffers from
rsccl.mem_pool() (the all_reduce tensor, the all_gather OUTPUT, the reduce_scatter INPUT;
the other buffer from torch's allocator), allocated in the same order on every rank so that
their offsets agree, next to "rsccl" (torch's buffers: the staged path) and NCCL. For that
the default group is created with cuda_pool_bytes = 2 x the largest message + 64 MiB (plus,
with the overlap section, 2 x the sum of its sizes: its pool buffers, all live at once) and
max_cuda_va_bytes = world x (cuda_buffer_bytes + pool) + 1 GiB, at least rsccl's default
16 GiB (fields given with --rsccl-options are kept; nothing else about the group changes; if
rsccl refuses these options the group is created without them and the rows are left out).

FSDP2 (--fsdp, the default for --device cuda unless --quick; --no-fsdp skips it): after the
collectives, a transformer (--fsdp-layers 8, --fsdp-dim 2048, seq 1024, batch 4 per rank,
bf16 params and float32 reductions, AdamW at 3e-4, scaled by 2048 / d_model above 2048 or
--fsdp-lr, reached by a linear warm-up over the untimed steps) is trained --fsdp-warmup 5 +
--fsdp-steps 20 steps with
fully_shard over a new NCCL group, then over a new rsccl group, --fsdp-repeats 3 times each
in ABBA order (the step time: the median of a backend's runs, with their spread); rsccl's pool
(--fsdp-pool-bytes, default sized from the model) holds FSDP's all-gather outputs
(rsccl.fsdp.use_pool: a custom all-gather on every FSDP module; its reduce-scatter buffers
come from torch's allocator; --fsdp-pool-comms both puts those in the pool too); same seed
and data for both. Details: rsccl/bench/fsdp.py.

Overlap (--overlap, the default for --device cuda, reduced with --quick; --no-overlap skips
it): after the collectives and before FSDP2, a loop of bf16 matmuls (--overlap-matmul 8192,
--overlap-matmuls 20) on the compute stream while a side stream runs --overlap-rounds 16
rounds of all_gather_into_tensor and reduce_scatter_tensor (--overlap-collectives: one of
them alone) at each of --overlap-bytes (64, 128, 256 MiB), per backend (rsccl, rsccl-pool, NCCL), --overlap-repeats 3 runs each in
ABBA order: matmuls alone, collectives alone, both; medians with min-max, total / matmul alone,
rsccl total / NCCL total (target <= 0.95x). Details: rsccl/bench/cuda/overlap.py.

SMs: the CTAs (grid) of each collective's kernel, rsccl's as its engine reports them
(rsccl.memory_stats(): cuda_blocks, cuda_p2p_blocks for send/recv), NCCL's only as bounded by
NCCL_MIN/MAX_CTAS or NCCL_MIN/MAX_NCHANNELS when set; and, last (--ctas-profile, the default;
--no-ctas-profile skips it), both as a torch.profiler trace of 3 calls per collective at its
smallest and largest size shows them (rsccl/bench/cuda/ctas.py).

all_to_all_single (even splits) runs from --min-bytes to 256 MiB per rank; send_recv (rank 0
sends with dist.send, rank 1 receives with dist.recv, the other ranks idle; async: isend/
irecv + wait) at 1 MiB, 16 MiB and 256 MiB. Both on the default rsccl group and on NCCL, as
the other collectives; their targets (all_to_all_single busbw >= NCCL's from 16 MiB, eager
latency <= 0.5x NCCL's up to 256 KiB, send_recv >= 340 GB/s at 256 MiB) get their own
lines in the summary and a "Targets" section in the Markdown.

Message size: the bytes of the all_reduce (and broadcast) tensor = the all_gather_into_tensor
OUTPUT = the reduce_scatter_tensor INPUT = the all_to_all_single input = the message sent,
per rank, as nccl-tests define it.

Method, per (backend, collective, size):
- check (sizes <= --check-max-bytes): the collective on the same seeded random data, on
  each rsccl group and symmetric-memory op and on NCCL; results must match NCCL's (exactly
  for gathers and broadcast, within a bf16 tolerance for reductions); a mismatch is printed
  loudly and the row says WRONG.
- eager: --warmup calls, then per repeat: synchronize, gloo barrier, CUDA events around N
  back-to-back blocking calls (async_op=False); N is 50 up to 16 MiB, then fewer (at least
  5) or --iters. A repeat's time is the slowest rank's; the median of --repeats is reported
  per call. async: the same with async_op=True and wait() on each call.
- graph (sizes <= --graph-max-bytes, unless --no-graph; run after every eager measurement,
  so a failed capture cannot disturb them): warm-up on a side stream, capture 20 calls into
  one torch.cuda.CUDAGraph (capture_error_mode="thread_local"), replay it 5 times per repeat,
  timed with events, per call. A capture that fails on any rank is recorded as "fail" (the
  reason in the log), and that backend is not captured again.
- busbw from the eager time: all_reduce 2(n-1)/n * bytes / t; all_gather, reduce_scatter,
  all_to_all (n-1)/n * bytes / t; broadcast and send_recv bytes / t.
- memory per rank: device memory used (total - free from torch.cuda.mem_get_info, after
  torch.cuda.synchronize(); device-wide) and mapped virtual address space (/proc/self/maps),
  before any group (after a CUDA context and the probe tensors exist), after rsccl's init,
  after its first all_reduce, all_gather and reduce_scatter (1 MiB probes), then the same for
  NCCL, then after the symmetric-memory buffer's rendezvous. rsccl.memory_stats() is logged.
  rsccl's figures include the default group's pool when there are rsccl-pool rows (the
  Markdown says how much).
- in place vs staged: every rsccl-pool row is checked against NCCL like the others, and
  rsccl.memory_stats() is read before and after each of its checks and measurements: the
  deltas of cuda_inplace_collectives and cuda_staged_collectives give its note, "inplace",
  "STAGED" or "MIXED", so a fallback to the staged path is visible. The summary gives rsccl
  eager time / rsccl-pool eager time per size >= 16 MiB (target >= 1.1x).
- FSDP2 step: CUDA events around each step (forward, backward, optimizer step, zero_grad),
  slowest rank's mean; per backend torch.cuda.max_memory_reserved() (peak stats reset before
  its run), device memory in use (mem_get_info; device-wide, so rsccl's whole pool and NCCL's
  own buffers count, which torch's reserved figure leaves out) and what the run added to it,
  the final loss (both must agree within 2%), and for rsccl the in-place/staged counts.
  Targets: step time rsccl <= NCCL, peak reserved rsccl <= NCCL. The section gets 300 s
  on top of --timeout; a failure there is recorded, and everything else is still written.

Outputs in --out-dir: bench_cuda_w<world>.md per world size (tables, memory, stats, the
in-place table, CTAs per collective, the overlap table, the FSDP2 table), bench_cuda.csv (all worlds; rsccl-pool rows' note column
says inplace/STAGED), bench_cuda.png when matplotlib imports. The last lines printed
are a compact summary (one line per size), since only the tail of a GPU run's output may
come back.
"""
