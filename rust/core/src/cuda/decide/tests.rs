//! decide.rs's choices, tested without a GPU.

use super::*;
use crate::cuda::kernels::LL_MAX_BYTES as LL;

/// Every kind has one kernel, one NCCL call and words, and they agree with its facts.
#[test]
fn every_kind_has_a_kernel_and_an_nccl_call() {
    for k in Kind::ALL {
        let kern = kernel(k, 64, 1, 2, 0, 0);
        assert_eq!(kern.shape() == kernels::Shape::Peer, k.is_p2p(), "{k:?}");
        assert_eq!(nccl_call(k) == NcclCall::P2p, k.is_p2p(), "{k:?}");
        assert_eq!(matches!(kern, Kernel::Reduce(_)), k.has_op(), "{k:?}");
        assert_eq!(matches!(nccl_call(k), NcclCall::AllReduce | NcclCall::ReduceScatter | NcclCall::Reduce), k.has_op(), "{k:?}");
        assert!(call_in_words(k, "float32", "SUM", 1, 8).starts_with(k.name()), "{k:?}");
    }
    assert_eq!(kernel(Kind::AllReduce, 32 << 20, 2, 2, 0, LL), Kernel::Reduce(Family::TwoShot));
    assert_eq!(kernel(Kind::AllReduce, 2048, 2, 2, 0, LL), Kernel::Reduce(Family::LowLatency));
    assert_eq!(kernel(Kind::AllReduce, 64 << 10, 2, 2, 0, LL), Kernel::Reduce(Family::OneShot));
    assert_eq!(cuda_count(Kind::ReduceScatter, 4096, 1024, 4), 256);
    assert_eq!(cuda_count(Kind::Scatter, 400, 100, 8), 100);
}

/// The copy engines take all_gather, reduce_scatter, broadcast, send and recv from the
/// setting's size on (reduce_scatter's input bytes, not its output elements),
/// never at 0, never without peers; rounds cover every byte once, in order, none larger
/// than a half.
#[test]
fn copy_engine_choice_and_rounds() {
    assert!(copy_engine(Kind::AllGather, 4 << 20, 4, 4 << 20));
    assert!(!copy_engine(Kind::AllGather, (4 << 20) - 1, 4, 4 << 20));
    assert!(!copy_engine(Kind::AllGather, 1 << 30, 4, 0));
    assert!(!copy_engine(Kind::AllGather, 1 << 30, 1, 1));
    assert!(copy_engine(Kind::AllGather, 1, 2, 1));
    assert!(copy_engine(Kind::Broadcast, 4 << 20, 2, 4 << 20));
    // reduce_scatter: the input's bytes (output elements x dtype x ranks), as on_copy_engines
    // passes them: 128 Ki bf16 elements per rank at 4 ranks is 1 MiB of input.
    let rs = message_bytes(Kind::ReduceScatter, 128 << 10, 2, 4);
    assert_eq!(rs, 1 << 20);
    assert!(copy_engine(Kind::ReduceScatter, rs, 4, 1 << 20));
    assert!(!copy_engine(Kind::ReduceScatter, rs - 1, 4, 1 << 20));
    assert!(copy_engine(Kind::ReduceScatter, 1, 2, 1));
    assert!(!copy_engine(Kind::ReduceScatter, 1 << 30, 4, 0));
    assert!(!copy_engine(Kind::ReduceScatter, 1 << 30, 1, 1));
    // send/recv: each side from its own message's bytes, so equal sizes choose alike.
    for k in [Kind::Send, Kind::Recv] {
        assert!(copy_engine(k, 4 << 20, 2, 4 << 20), "{k:?}");
        assert!(copy_engine(k, 1, 2, 1), "{k:?}");
        assert!(!copy_engine(k, (4 << 20) - 1, 2, 4 << 20), "{k:?}");
        assert!(!copy_engine(k, 1 << 30, 2, 0), "{k:?}");
        assert!(!copy_engine(k, 1 << 30, 1, 1), "{k:?}");
        let bytes = message_bytes(k, 4 << 20, 2, 4);
        assert!(copy_engine(k, bytes, 4, 4 << 20), "{k:?}: bytes, not elements");
    }
    for k in
        Kind::ALL.into_iter().filter(|&k| !matches!(k, Kind::AllGather | Kind::ReduceScatter | Kind::Broadcast | Kind::Send | Kind::Recv))
    {
        assert!(!copy_engine(k, 1 << 30, 4, 1), "{k:?}");
    }
    for (per_rank, slot) in [
        (0u64, 16u64),
        (1, 16),
        (16, 16),
        (17, 16),
        (100, 7),
        (1 << 28, 32 << 20),
        (3 << 20, 64 << 20),
        (16 << 20, 64 << 20),
        (64 << 20, 21 << 20),
        (1 << 30, 21 << 20),
        ((16 << 20) + 3, 64 << 20),
        ((64 << 20) + 24, 21 << 20),
        (3 * (1 << 20) + 8, 256),
    ] {
        let r: Vec<_> = copy_rounds(per_rank, slot).collect();
        assert_eq!(r.iter().map(|x| x.1).sum::<u64>(), per_rank);
        assert!(r.iter().all(|&(_, n)| n > 0 && n <= slot));
        assert!(r.first().is_none_or(|f| f.0 == 0) && r.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
        let fewest = per_rank.div_ceil(slot);
        let want = if per_rank >= COPY_MIN_ROUNDS * COPY_MIN_STEP {
            fewest.max(COPY_MIN_ROUNDS)
        } else {
            fewest.max(per_rank.div_ceil(COPY_MIN_STEP))
        };
        assert_eq!(r.len() as u64, want, "{per_rank} bytes, slot {slot}");
        // reduce_scatter's rounds are reduced by element (rs_ce_reduce): with a slot in
        // 256-byte units, as staging_slot makes it, every round starts and ends on an
        // element of any dtype (8 bytes at most) when the block is whole elements.
        if slot % 256 == 0 && per_rank % 8 == 0 {
            assert!(r.iter().all(|&(o, n)| o % 8 == 0 && n % 8 == 0), "{per_rank} bytes, slot {slot}");
        }
    }
}

/// Each engine answers for what it runs: NCCL reduces float64, int8 and uint8, which
/// rsccl's kernels do not; neither reduces bool or bitwise ops; operations that move
/// bytes run on any dtype on both. (Seen: a float64 all_reduce across hosts was refused
/// with rsccl's kernel table and aborted the group.)
#[test]
fn each_device_engine_answers_for_what_it_reduces() {
    // NCCL's ncclDataType_t less bool (moved as uint8, never reduced) and the fp8 types
    // (rsccl has none); its ncclRedOp_t (no bitwise ops). The tables must say so.
    const NCCL_DTYPES: [DType; 8] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I8, DType::U8, DType::I32, DType::I64];
    const NCCL_OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];
    assert_eq!(DType::ALL.into_iter().filter(|d| d.nccl_reduces()).collect::<Vec<_>>(), NCCL_DTYPES);
    assert_eq!(ReduceOp::ALL.into_iter().filter(|o| o.in_nccl()).collect::<Vec<_>>(), NCCL_OPS);
    use DeviceEngine::{Nccl, Rsccl};
    for k in Kind::ALL {
        for d in DType::ALL {
            for o in ReduceOp::ALL {
                let (r, n) = (can_run(Rsccl, k, d, o, 2), can_run(Nccl, k, d, o, 2));
                if !k.has_op() {
                    assert!(r.is_ok() && n.is_ok(), "{k:?} moves bytes of any dtype");
                    continue;
                }
                assert_eq!(r.is_ok(), kernels::REDUCE_DTYPES.contains(&d) && kernels::REDUCE_OPS.contains(&o) && o.check(d).is_ok());
                let nccl = NCCL_DTYPES.contains(&d) && NCCL_OPS.contains(&o) && o.check(d).is_ok();
                assert_eq!(n.is_ok(), nccl, "{k:?} {d:?} {o:?}");
                for e in [r, n].into_iter().filter_map(|x| x.err()) {
                    assert!(matches!(&e, Error::InvalidType(m) if m.starts_with(&format!("{}: rank 2 ", k.name()))), "{e}");
                }
            }
        }
    }
    for d in [DType::F64, DType::I8, DType::U8] {
        assert!(can_run(Nccl, Kind::AllReduce, d, ReduceOp::Sum, 2).is_ok(), "{d:?}");
        assert!(can_run(Rsccl, Kind::AllReduce, d, ReduceOp::Sum, 2).is_err(), "{d:?}");
    }
    let e = can_run(Rsccl, Kind::AllReduce, DType::F64, ReduceOp::Sum, 2).unwrap_err().to_string();
    assert!(e.contains("all_reduce: rank 2 passed float64; rsccl's CUDA reductions take float32, float16, bfloat16, int32, int64"), "{e}");
    let e = can_run(Nccl, Kind::Reduce, DType::Bool, ReduceOp::Sum, 2).unwrap_err().to_string();
    assert!(e.contains("reduce: rank 2 passed bool; NCCL") && e.contains("reduces float32, float64"), "{e}");
    let e = can_run(Nccl, Kind::ReduceScatter, DType::I32, ReduceOp::BAnd, 2).unwrap_err().to_string();
    assert!(e.contains("reduce_scatter: rank 2 passed ReduceOp.BAND on int32; NCCL"), "{e}");
    let e = can_run(Nccl, Kind::AllReduce, DType::I64, ReduceOp::Avg, 2).unwrap_err().to_string();
    assert!(e.contains("all_reduce: rank 2 ReduceOp.AVG is not defined on dtype int64"), "{e}");
    assert!(can_run(Nccl, Kind::AllGather, DType::Bool, ReduceOp::BXor, 2).is_ok());
}

/// GPUs that cannot reach each other are refused at creation, naming both ranks and
/// GPUs and the way out, on every rank alike; ranks sharing a GPU and peers a rank
/// cannot see pass.
#[test]
fn gpus_without_peer_access_are_named() {
    use Reach::{No, SameGpu, Unknown, Yes};
    let gpu = |rank: usize, ordinal: i32| LocalGpu { rank, ordinal, bus: format!("0000:{:02x}:00.0", 0x14 + rank) };
    let gpus: Vec<LocalGpu> = (0..4).map(|r| gpu(r + 4, r as i32)).collect();
    let all = |r: Reach| vec![vec![r; 4]; 4];
    assert!(check_peer_access(&gpus, &all(Yes)).is_ok());
    assert!(check_peer_access(&gpus, &all(SameGpu)).is_ok(), "ranks sharing one GPU (allow_shared_gpu)");
    assert!(check_peer_access(&gpus, &all(Unknown)).is_ok(), "GPUs a rank cannot see: the mapping will tell");
    // A rank's answer about itself is never an obstacle.
    let mut reach = all(Yes);
    reach[2][2] = No;
    assert!(check_peer_access(&gpus, &reach).is_ok());
    // One direction is enough to refuse: the kernels read and write both ways.
    reach[3][1] = No;
    let e = check_peer_access(&gpus, &reach).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(
        m.starts_with(
            "the GPU of rank 7 (cuda:3, PCI 0000:1b:00.0) cannot access the memory of the GPU of rank 5 (cuda:1, PCI 0000:19:00.0)"
        ),
        "{m}"
    );
    assert!(m.contains("cuDeviceCanAccessPeer") && m.contains("backend=\"cpu:rsccl,cuda:nccl\""), "{m}");
    // Every rank reports the first pair in the same order, whichever rank finds it.
    reach[0][2] = No;
    assert!(check_peer_access(&gpus, &reach).unwrap_err().to_string().starts_with("the GPU of rank 4 (cuda:0"));
    for r in [SameGpu, Yes, No, Unknown] {
        assert_eq!(Reach::from_code(r as u8), r);
    }
    assert_eq!(Reach::from_code(9), Unknown);
}

#[test]
fn low_latency_slots_shrink_with_the_group() {
    // A slot per sender in each buffer (abi.cuh): 64 KiB up to 4 local ranks, 32 KiB up to
    // 8, 16 KiB up to 16; the engine bounds the setting by it.
    use crate::cuda::kernels::ll_max_bytes;
    assert_eq!([2, 3, 4].map(ll_max_bytes), [LL; 3]);
    assert_eq!([5, 8].map(ll_max_bytes), [32 << 10; 2]);
    assert_eq!([9, 16].map(ll_max_bytes), [16 << 10; 2]);
    assert_eq!(LL, 64 << 10);
}

#[test]
fn allreduce_algorithm_follows_threshold() {
    assert_eq!(choose_allreduce(1024, 4, 256 << 10, LL), Family::LowLatency);
    assert_eq!(choose_allreduce(LL, 4, 0, LL), Family::LowLatency);
    assert_eq!(choose_allreduce(LL + 2, 4, 0, LL), Family::OneShot);
    assert_eq!(choose_allreduce(1024, 4, 512, LL), Family::TwoShot);
    // cuda_low_latency_max_bytes lowers the bound; 0 turns the low-latency kernel off.
    assert_eq!(choose_allreduce(4096, 4, 0, 4096), Family::LowLatency);
    assert_eq!(choose_allreduce(4098, 4, 0, 4096), Family::OneShot);
    assert_eq!(choose_allreduce(1024, 4, 0, 0), Family::OneShot);
    assert_eq!(choose_allreduce(0, 4, 0, 0), Family::OneShot);
    assert_eq!(kernel(Kind::AllReduce, 2048, 2, 2, 0, 0), Kernel::Reduce(Family::OneShot));
    assert_eq!(choose_allreduce(256 << 10, 4, 256 << 10, LL), Family::OneShot);
    assert_eq!(choose_allreduce((256 << 10) + 2, 4, 256 << 10, LL), Family::TwoShot);
    assert_eq!(choose_allreduce(2, 2, 1, LL), Family::TwoShot);
    // Auto: the measured crossover per number of ranks.
    assert_eq!(choose_allreduce(2 << 20, 2, 0, LL), Family::OneShot);
    assert_eq!(choose_allreduce(4 << 20, 2, 0, LL), Family::TwoShot);
    assert_eq!(choose_allreduce(1 << 20, 4, 0, LL), Family::TwoShot);
    assert_eq!(choose_allreduce(512 << 10, 4, 0, LL), Family::OneShot);
    assert_eq!(choose_allreduce(512 << 10, 8, 0, LL), Family::TwoShot);
}

/// `kernels_of` lists every kernel `kernel` picks for a kind, whatever the size and the
/// settings, with no repeat.
#[test]
fn kernels_of_a_kind_cover_every_choice() {
    for k in Kind::ALL {
        let all = kernels_of(k);
        for (i, x) in all.iter().enumerate() {
            assert!(!all[i + 1..].contains(x), "{k:?}: {x:?} twice");
        }
        for count in [0u64, 1, 4096, 1 << 20, 1 << 30] {
            for (one_shot, ll) in [(0, LL), (0, 0), (1, LL), (1 << 40, LL), (1 << 40, 0)] {
                for ranks in [2, 4, 8] {
                    let got = kernel(k, count, 2, ranks, one_shot, ll);
                    assert!(all.contains(&got), "{k:?} of {count} at {ranks} ranks ({one_shot}, {ll}): {got:?} not in {all:?}");
                }
            }
        }
    }
}

/// reduce_scatter and all_gather take their low-latency kernels by what each rank sends
/// each peer (reduce_scatter: its output shard, in elements; all_gather: its input, in
/// bytes), up to the setting; never at 0. Those kernels run on the small grid whatever the
/// message, and never in place.
#[test]
fn low_latency_kernels_follow_the_bytes_per_sender() {
    let rs = Kernel::Reduce(Family::ReduceScatterLowLatency);
    assert_eq!(kernel(Kind::ReduceScatter, (LL / 2) as u64, 2, 8, 0, LL), rs);
    assert_eq!(kernel(Kind::ReduceScatter, (LL / 2 + 1) as u64, 2, 8, 0, LL), Kernel::Reduce(Family::ReduceScatter));
    assert_eq!(kernel(Kind::ReduceScatter, 16, 4, 8, 0, 0), Kernel::Reduce(Family::ReduceScatter));
    assert_eq!(kernel(Kind::AllGather, LL as u64, 2, 8, 0, LL), Kernel::AllGatherLowLatency);
    assert_eq!(kernel(Kind::AllGather, LL as u64 + 1, 1, 8, 0, LL), Kernel::AllGather);
    assert_eq!(kernel(Kind::AllGather, 16, 1, 8, 0, 0), Kernel::AllGather);
    for k in [rs, Kernel::AllGatherLowLatency, Kernel::Reduce(Family::LowLatency)] {
        assert!(k.is_low_latency(), "{k:?}");
        // An all_gather of 16 KiB per rank at 8 ranks gathers 128 KiB: still the small grid.
        assert_eq!(grid(k, message_bytes(Kind::AllGather, LL as u64, 1, 8), 64), SMALL_GRID, "{k:?}");
        assert_eq!(grid(k, 1024, 8), 8, "{k:?}: never more than the group's grid");
    }
    for k in [Kernel::Reduce(Family::OneShot), Kernel::Reduce(Family::ReduceScatter), Kernel::AllGather, Kernel::Barrier] {
        assert!(!k.is_low_latency(), "{k:?}");
    }
}

#[test]
fn placement_offers_only_eligible_pool_buffers() {
    // A pool at [1000, 1000 + 100 MiB) of a block starting at 0.
    let pool = |ptr: u64, len: u64| (ptr >= 1000 && ptr + len <= 1000 + (100 << 20)).then_some(ptr);
    let call = |kind, count, inp, out| CudaCall {
        kind,
        dtype: DType::BF16,
        op: ReduceOp::Sum,
        root: 0,
        inp,
        out,
        count,
        chunks: None,
        stream: 0,
        asynchronous: false,
    };
    let mib = 1u64 << 20;
    let two = Kernel::Reduce(Family::TwoShot);
    // all_reduce: both buffers in the pool, two-shot, over the threshold.
    let ar = call(Kind::AllReduce, 4 * mib / 2, 2048, 2048);
    assert_eq!(placement(&ar, two, 4, mib, &pool), (2049, 2049));
    assert_eq!(placement(&ar, Kernel::Reduce(Family::OneShot), 4, mib, &pool), (0, 0));
    assert_eq!(placement(&ar, two, 4, 8 * mib, &pool), (0, 0), "under the threshold");
    assert_eq!(placement(&call(Kind::AllReduce, 4 * mib / 2, 2048, 1 << 40), two, 4, mib, &pool), (0, 0));
    // From ALLREDUCE_IN_PLACE_MAX_BYTES on, all_reduce is staged above 2 ranks, in place at 2.
    let big = call(Kind::AllReduce, 64 * mib / 2, 2048, 2048);
    assert_eq!(placement(&big, two, 4, mib, &pool), (0, 0));
    assert_eq!(placement(&big, two, 3, mib, &pool), (0, 0));
    assert_eq!(placement(&big, two, 2, mib, &pool), (2049, 2049));
    let under = call(Kind::AllReduce, 64 * mib / 2 - 8, 2048, 2048);
    assert_eq!(placement(&under, two, 4, mib, &pool), (2049, 2049));
    // A buffer that runs past the end of the pool is not in it.
    assert_eq!(placement(&call(Kind::AllReduce, 60 * mib, 2048, 2048), two, 4, mib, &pool), (0, 0));
    // reduce_scatter offers its input (world x count elements), all_gather and
    // broadcast their output.
    let rs = call(Kind::ReduceScatter, mib, 4096, 1 << 40);
    assert_eq!(placement(&rs, Kernel::Reduce(Family::ReduceScatter), 4, mib, &pool), (4097, 0));
    assert_eq!(placement(&rs, Kernel::Reduce(Family::ReduceScatterLowLatency), 4, mib, &pool), (0, 0), "low latency: never in place");
    let ag = call(Kind::AllGather, mib, 1 << 40, 4096);
    assert_eq!(placement(&ag, Kernel::AllGather, 4, 4 * mib, &pool), (0, 4097), "the output is 4 MiB");
    assert_eq!(placement(&ag, Kernel::AllGatherLowLatency, 4, mib, &pool), (0, 0));
    let bc = call(Kind::Broadcast, 2 * mib, 8192, 8192);
    assert_eq!(placement(&bc, Kernel::Broadcast, 2, mib, &pool), (0, 8193));
    assert_eq!(placement(&call(Kind::Barrier, 0, 0, 0), Kernel::Barrier, 2, 0, &pool), (0, 0));
    assert_eq!(message_bytes(Kind::ReduceScatter, 10, 2, 4), 80);
}

#[test]
fn staging_split_fits_the_buffer() {
    for (buf, blocks) in [(32usize << 20, 32u32), (2 << 20, 64), (4 << 20, 1)] {
        let spb = stage_per_block(buf, blocks);
        assert!(spb > 0 && spb % 256 == 0);
        assert!(STAGE_OFF + 2 * blocks as usize * spb <= buf);
    }
}

#[test]
fn p2p_inbox_split() {
    // 16 MiB among 3 peers x 32 blocks x 4 inbox slots (P2P_DEPTH): 43520 bytes (a 256 multiple).
    assert_eq!(crate::cuda::kernels::abi::P2P_DEPTH, 4);
    assert_eq!(p2p_chunk(16 << 20, 4, 32).unwrap(), 43520);
    assert!(p2p_chunk(16 << 20, 4, 32).unwrap() * 3 * 32 * 4 <= 16 << 20);
    // One rank: one slot, never divided by zero.
    assert!(p2p_chunk(1 << 20, 1, 1).is_ok());
    // The smallest inbox at 4 ranks with the 22 blocks that fit beside a 64-block collective
    // (as with two slots and a 4 KiB floor before).
    assert_eq!(p2p_chunk(1 << 20, 4, 22).unwrap(), 3840);
    let e = p2p_chunk(1 << 20, 16, 64).unwrap_err().to_string();
    assert!(e.contains("cuda_p2p_bytes") && e.contains("cuda_p2p_blocks"), "{e}");
}

#[test]
fn p2p_grid_fits_beside_a_collective() {
    // H200: 132 SMs, 2 send/recv blocks of 512 threads per SM (about 52 registers), a
    // collective of 32 blocks at one per SM: 100 SMs, 200 slots for 2 x (L - 1) kernels.
    let fit = |setting, l, sms, p2p, coll, coll_sm| p2p_blocks_that_fit(setting, l, sms, p2p, coll, coll_sm);
    assert_eq!(fit(32, 2, 132, 2, 32, 1), 32, "2 kernels: the setting fits");
    assert_eq!(fit(32, 4, 132, 2, 32, 1), 32, "6 x 32 = 192 <= 200");
    assert_eq!(fit(64, 4, 132, 2, 32, 1), 33, "6 x 64 does not fit; 6 x 33 = 198 does");
    assert_eq!(fit(32, 8, 132, 2, 32, 1), 14, "14 kernels x 14 = 196 <= 200");
    assert_eq!(fit(32, 16, 132, 2, 32, 1), 6, "30 x 6 = 180");
    assert_eq!(fit(32, 4, 132, 2, 32, 2), 32, "two collective blocks per SM: 16 SMs taken");
    assert_eq!(fit(64, 8, 132, 2, 64, 1), 9, "64 collective blocks leave 68 SMs: 136 / 14");
    for (setting, l, sms, p2p, coll, coll_sm) in
        [(32, 8, 132, 2, 64, 1), (64, 4, 132, 2, 64, 1), (7, 5, 20, 3, 17, 2), (64, 16, 132, 1, 64, 1)]
    {
        let b = fit(setting, l, sms, p2p, coll, coll_sm);
        let free = (sms - coll.div_ceil(coll_sm)) * p2p;
        assert!(b <= setting);
        assert!(2 * (l as u32 - 1) * b <= free, "{setting} {l} {sms} {p2p} {coll}: {b}");
        assert!(2 * (l as u32 - 1) * (b + 1) > free || b == setting, "the most that fit");
    }
    // Nothing fits: 0 (creation fails with a message), never a wrap-around.
    assert_eq!(fit(32, 8, 16, 2, 64, 1), 0);
    assert_eq!(fit(32, 8, 132, 0, 64, 1), 0, "a send/recv kernel that cannot run at all");
    assert_eq!(fit(32, 8, 132, 2, 64, 0), 0, "a collective that cannot run at all");
    assert_eq!(fit(32, 16, 20, 2, 8, 1), 0, "30 kernels on 24 slots");
    // One rank: no send/recv, the setting stands.
    assert_eq!(fit(32, 1, 1, 1, 64, 1), 32);
    // The inbox follows the effective grid: fewer blocks, larger chunks, same capacity.
    let (eff, set) = (fit(64, 4, 132, 2, 32, 1), 64);
    let (c_eff, c_set) = (p2p_chunk(16 << 20, 4, eff).unwrap(), p2p_chunk(16 << 20, 4, set).unwrap());
    assert!(c_eff > c_set && c_eff % 256 == 0 && c_eff * 3 * 4 * eff as usize <= 16 << 20);
}

#[test]
fn shared_gpu_grids_fit_in_each_ranks_share() {
    // A GPU of its own: the collective grid is the setting, send/recv as before.
    let g = |blocks, p2p, l, sms, p2p_sm, coll_sm, sharers| grids_that_fit(blocks, p2p, l, sms, p2p_sm, coll_sm, sharers);
    assert_eq!(g(64, 32, 4, 132, 2, 1, 1), (64, p2p_blocks_that_fit(32, 4, 132, 2, 64, 1)));
    assert_eq!(g(64, 32, 8, 16, 2, 1, 1), (64, 0), "unshared and too small: refused, as before");
    // H100 (132 SMs), 2 send/recv and 1 collective block per SM: 2 ranks get 66 SMs
    // each, 4 get 33, 8 get 16 (the measured-safe 4 x 8 and 8 x 4 blocks are below these).
    assert_eq!(g(64, 32, 2, 132, 2, 1, 2), (64, 2), "66 SMs: 1 for send/recv, 64 collective, 2 left");
    assert_eq!(g(64, 32, 4, 132, 2, 1, 4), (30, 1), "33 SMs: 3 for 6 send/recv kernels");
    assert_eq!(g(64, 32, 8, 132, 2, 1, 8), (9, 1), "16 SMs: 7 for 14 send/recv kernels");
    assert_eq!(g(64, 32, 16, 132, 2, 1, 16), (0, 0), "8 SMs cannot hold 30 send/recv kernels");
    assert_eq!(g(4, 32, 4, 132, 2, 1, 4), (4, (33 - 4) * 2 / 6), "a smaller setting stands");
    assert_eq!(g(64, 32, 4, 132, 0, 1, 4), (0, 0), "a send/recv kernel that cannot run");
    // The invariant: every co-located rank's collective and send/recv kernels fit on the
    // GPU together, each at least one block, collective blocks taking whole SMs.
    for sms in [1u32, 7, 20, 78, 108, 132, 144] {
        for l in 2..=16usize {
            for sharers in 2..=l as u32 {
                for (p2p_sm, coll_sm) in [(1, 1), (2, 1), (3, 2), (4, 1)] {
                    for (blocks, p2p) in [(64, 32), (8, 4), (1, 1)] {
                        let (c, p) = g(blocks, p2p, l, sms, p2p_sm, coll_sm, sharers);
                        if c == 0 || p == 0 {
                            assert_eq!((c, p), (0, 0));
                            continue;
                        }
                        assert!(c <= blocks && p <= p2p);
                        let sms_per_rank = c.div_ceil(coll_sm) + (2 * (l as u32 - 1) * p).div_ceil(p2p_sm);
                        assert!(sharers * sms_per_rank <= sms, "{sms} SMs, {l} ranks, {sharers} sharers: {c} + {p}");
                    }
                }
            }
        }
    }
}

/// Small calls run on SMALL_GRID blocks (fewer where the group has fewer), larger ones and
/// every all_to_all on the group's grid; the barrier and the invalid call (no bytes) are
/// small.
#[test]
fn small_calls_take_the_small_grid() {
    let kernels = [
        Kernel::Reduce(Family::OneShot),
        Kernel::Reduce(Family::TwoShot),
        Kernel::Reduce(Family::ReduceScatter),
        Kernel::Reduce(Family::Reduce),
        Kernel::AllGather,
        Kernel::Broadcast,
        Kernel::Gather,
        Kernel::Scatter,
    ];
    for k in kernels {
        assert_eq!(grid(k, 1, 64), SMALL_GRID, "{k:?}");
        assert_eq!(grid(k, SMALL_GRID_MAX_BYTES, 64), SMALL_GRID, "{k:?}");
        assert_eq!(grid(k, SMALL_GRID_MAX_BYTES + 1, 64), 64, "{k:?}");
        assert_eq!(grid(k, 1 << 30, 32), 32, "{k:?}");
        assert_eq!(grid(k, 1024, 8), 8, "{k:?}: never more than the group's grid");
    }
    for k in [Kind::Barrier, Kind::Invalid] {
        assert_eq!(grid(kernel(k, 0, 1, 4, 0, LL), 0, 64), SMALL_GRID, "{k:?}");
    }
    assert_eq!(grid(Kernel::AllToAll, 0, 64), 64);
    // The sizes the bench names are message_bytes: a 64 KiB reduce_scatter input is small,
    // a 128 KiB all_gather output is not.
    let rs = Kernel::Reduce(Family::ReduceScatter);
    assert_eq!(grid(rs, message_bytes(Kind::ReduceScatter, 8 << 10, 2, 4), 64), SMALL_GRID);
    assert_eq!(grid(Kernel::AllGather, message_bytes(Kind::AllGather, 32 << 10, 2, 4), 64), 64);
}

#[test]
fn large_reduce_scatter_and_two_shot_all_reduce_take_the_ring() {
    let (rs, ar, min) = (Kernel::Reduce(Family::ReduceScatter), Kernel::Reduce(Family::TwoShot), 64u64 << 20);
    assert!(ring(rs, min, 4, min));
    assert!(!ring(rs, min - 1, 4, min), "below the setting: the direct kernel");
    assert!(ring(ar, 1 << 30, 2, min));
    assert!(!ring(ar, 1 << 30, 1, min), "no peer to send to");
    assert!(!ring(ar, 1 << 30, 4, 0), "0: never");
    for k in [
        Kernel::AllGather,
        Kernel::Reduce(Family::OneShot),
        Kernel::Reduce(Family::LowLatency),
        Kernel::Reduce(Family::ReduceScatterLowLatency),
        Kernel::Reduce(Family::Reduce),
        Kernel::AllToAll,
        Kernel::Broadcast,
    ] {
        assert!(!ring(k, 1 << 30, 4, 1), "{k:?} has no ring schedule");
    }
}
