//! The kernels' argument blocks and error codes: the Rust mirrors of csrc_kernels/abi.cuh,
//! checked against it at compile time (build.rs generates the check from that file).

use super::super::kernels::abi as kabi;
use super::super::kernels::MAX_RANKS;

/// The kernel argument block (the source's `struct Args`, same layout).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Args {
    pub(super) peer: [u64; MAX_RANKS],
    pub(super) inp: u64,
    pub(super) out: u64,
    pub(super) count: u64,
    pub(super) stage_per_block: u64,
    pub(super) err_host: u64,
    pub(super) abort_host: u64,
    pub(super) timeout_ns: u64,
    pub(super) desc0: u64,
    pub(super) desc1: u64,
    pub(super) place_in: u64,
    pub(super) place_out: u64,
    pub(super) rank: u32,
    pub(super) world: u32,
    pub(super) root: u32,
    pub(super) flags: u32,
}

/// The all_to_all kernel's argument block (the source's `struct A2aArgs`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct A2aArgs {
    pub(super) a: Args,
    pub(super) send: [u64; MAX_RANKS],
    pub(super) send_n: [u64; MAX_RANKS],
    pub(super) recv: [u64; MAX_RANKS],
    pub(super) recv_n: [u64; MAX_RANKS],
}

/// The send/recv kernels' argument block (the source's `struct P2pArgs`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct P2pArgs {
    pub(super) a: Args,
    pub(super) inbox_off: u64,
    pub(super) chunk: u64,
}

/// One round's reduction of reduce_scatter on the copy engines (the source's `struct
/// CeReduceArgs`: rs_ce_reduce, NOTE [Copy engines]).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct CeReduceArgs {
    pub(super) a: Args,
    pub(super) slots: u64,
    pub(super) slot_bytes: u64,
}

// The error kinds the kernels write into the status page (high 16 bits of a word).
pub(super) const ERR_TIMEOUT: u32 = kabi::ERR_TIMEOUT as u32;
pub(super) const ERR_ABORTED: u32 = kabi::ERR_ABORTED as u32;
pub(super) const ERR_MISMATCH: u32 = kabi::ERR_MISMATCH as u32;
pub(super) const ERR_PEER: u32 = kabi::ERR_PEER as u32;
pub(super) const ERR_P2P_SIZE: u32 = kabi::ERR_P2P_SIZE as u32;
pub(super) const ERR_A2A: u32 = kabi::ERR_A2A as u32;
pub(super) const ERR_CONCURRENT: u32 = kabi::ERR_CONCURRENT as u32;
/// Args::flags: a kernel that reports an error holds its stream until the host acts.
pub(super) const FLAG_HOLD_ON_ERROR: u32 = kabi::FLAG_HOLD_ON_ERROR as u32;
pub(super) const FLAG_LL_GRID_SHIFT: u32 = kabi::FLAG_LL_GRID_SHIFT as u32;

// Compile-time: every struct above has the size and field offsets build.rs computed from
// csrc_kernels/abi.cuh (which the kernel compiler checks with its static_asserts).
include!(concat!(env!("OUT_DIR"), "/kernel_abi_check.rs"));

#[cfg(test)]
mod tests {
    use super::super::super::kernels::{MAX_BLOCKS, POISON_OFF, STAGE_OFF, STATS_OFF};
    use super::*;

    #[test]
    fn args_layout_matches_the_kernel_abi() {
        // The compile-time check covers every struct of abi.cuh, and these are all of them.
        let names: Vec<&str> = kabi::STRUCTS.iter().map(|s| s.0).collect();
        assert_eq!(names, ["Args", "A2aArgs", "P2pArgs", "CeReduceArgs"]);
        let size = |n: &str| kabi::STRUCTS.iter().find(|s| s.0 == n).unwrap().1;
        assert_eq!(std::mem::size_of::<Args>(), size("Args"));
        assert_eq!(std::mem::size_of::<A2aArgs>(), size("A2aArgs"));
        assert_eq!(std::mem::size_of::<P2pArgs>(), size("P2pArgs"));
        assert_eq!(std::mem::size_of::<CeReduceArgs>(), size("CeReduceArgs"));
        // 16 peers + 11 u64 fields + 4 u32 fields.
        assert_eq!(size("Args"), 16 * 8 + 11 * 8 + 16);
        assert_eq!(kabi::FIELDS.iter().filter(|f| f.0 == "Args").count(), 16);
    }

    #[test]
    fn control_areas_do_not_overlap() {
        // The block's control areas as abi.cuh defines them, in order, each with its size:
        // flags, stats (+ poison word), counters, busy words, descriptors, ring words, send/recv, tables,
        // the low-latency kernels' slots and headers.
        let def = |v: u64| v as usize;
        let (max_blocks, max_ranks) = (MAX_BLOCKS as usize, MAX_RANKS);
        let areas = [
            (0, def(kabi::FLAGS_BYTES)),
            (STATS_OFF, 256 + 4),
            (def(kabi::CTR_OFF), max_blocks * 8),
            (def(kabi::BUSY_OFF), max_blocks * 4),
            (def(kabi::DESC_OFF), 2 * max_blocks * max_ranks * def(kabi::DESC_WORDS) * 8),
            (def(kabi::RING_OFF), 2 * max_blocks * 4),
            (def(kabi::P2P_OFF), 4 * 4096 + max_blocks * max_ranks * def(kabi::P2P_DEPTH) * 8),
            (def(kabi::A2A_OFF), 2 * max_blocks * 2 * max_ranks * 8),
            (def(kabi::LL_OFF), def(kabi::LL_BUFS) * def(kabi::LL_BUF_BYTES)),
            (def(kabi::LL_HDR_OFF), def(kabi::LL_BUFS) * max_ranks * max_blocks * 16),
        ];
        assert_eq!(areas[0].1, max_blocks * max_ranks * 4);
        for w in areas.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
        }
        let last = areas[areas.len() - 1];
        assert!(last.0 + last.1 <= STAGE_OFF);
        assert_eq!(def(kabi::LL_OFF) + def(kabi::LL_BYTES), STAGE_OFF);
        assert_eq!(STAGE_OFF % 256, 0);
        assert_eq!(POISON_OFF, STATS_OFF + 256);
    }
}
