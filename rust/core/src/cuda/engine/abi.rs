//! The kernels' argument blocks and error codes, as the kernel source defines them.

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
    pub(super) pad: u32,
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

pub(super) const ERR_TIMEOUT: u32 = 1;
pub(super) const ERR_ABORTED: u32 = 2;
pub(super) const ERR_MISMATCH: u32 = 3;
pub(super) const ERR_PEER: u32 = 4;
pub(super) const ERR_P2P_SIZE: u32 = 5;
pub(super) const ERR_A2A: u32 = 6;

#[cfg(test)]
mod tests {
    use super::super::super::kernels::{MAX_BLOCKS, POISON_OFF, STAGE_OFF, STATS_OFF};
    use super::*;

    #[test]
    fn args_layout_matches_the_kernel_source() {
        // 16 peers + 11 u64 fields + 4 u32 fields, as in `struct Args` of the .cu file.
        assert_eq!(std::mem::size_of::<Args>(), 16 * 8 + 11 * 8 + 16);
        let src = crate::cuda::kernels::SOURCE;
        assert!(src.contains("u64 desc1;") && src.contains("u64 place_in;") && src.contains("u64 place_out;"));
        assert!(src.contains(&format!("#define STAGE_OFF {STAGE_OFF}")) && src.contains(&format!("#define STATS_OFF {STATS_OFF}")));
        // The all_to_all and send/recv blocks: Args then their own fields.
        assert_eq!(std::mem::size_of::<A2aArgs>(), std::mem::size_of::<Args>() + 4 * MAX_RANKS * 8);
        assert_eq!(std::mem::size_of::<P2pArgs>(), std::mem::size_of::<Args>() + 16);
        assert!(src.contains("struct A2aArgs {\n    Args a;\n    u64 send[MAX_RANKS];\n    u64 send_n[MAX_RANKS];\n    u64 recv[MAX_RANKS];\n    u64 recv_n[MAX_RANKS];"));
        assert!(src.contains("struct P2pArgs {\n    Args a;\n    u64 inbox_off;"));
    }

    #[test]
    fn control_areas_do_not_overlap() {
        // The block's control areas as the kernel source defines them, in order, each with
        // its size: flags, stats (+ poison word), counters, descriptors, send/recv, tables.
        let src = crate::cuda::kernels::SOURCE;
        let def = |name: &str| -> usize {
            let line = src.lines().find(|l| l.starts_with(&format!("#define {name} "))).expect(name);
            line.split_whitespace().nth(2).unwrap().parse().expect(name)
        };
        let (max_blocks, max_ranks) = (MAX_BLOCKS as usize, MAX_RANKS);
        let areas = [
            (0, max_blocks * max_ranks * 4),
            (STATS_OFF, 256 + 4),
            (def("CTR_OFF"), max_blocks * 8),
            (def("DESC_OFF"), 2 * max_blocks * max_ranks * def("DESC_WORDS") * 8),
            (def("P2P_OFF"), 4 * 4096 + max_blocks * max_ranks * 2 * 8),
            (def("A2A_OFF"), 2 * max_blocks * 2 * max_ranks * 8),
        ];
        for w in areas.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
        }
        let last = areas[areas.len() - 1];
        assert!(last.0 + last.1 <= STAGE_OFF);
        assert!(src.contains("#define POISON_OFF (STATS_OFF + 256)") && POISON_OFF == STATS_OFF + 256);
    }
}
