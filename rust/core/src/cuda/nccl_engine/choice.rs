//! The NCCL engine's pure choices: flat or hierarchical for each collective, host-major
//! ranks, and when a launch is late. Functions of values every rank has alike (so every
//! rank takes the same path), tested without a GPU.

use std::time::{Duration, Instant};

use crate::collective::Kind;
use crate::dtype::ReduceOp;

/// How a CUDA collective of a group that spans hosts runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrossHost {
    /// One NCCL collective over every rank.
    Flat,
    /// rsccl's kernels inside each host, NCCL across hosts among ranks of the same local
    /// index, rsccl's kernels again (all_reduce: reduce-scatter, all_reduce, all_gather).
    Hierarchical,
}

/// Whether a group has a hierarchical path at all (the local rsccl engine and the cross
/// communicators are made only then): two hosts or more, each with the same number L >= 2
/// of the group's ranks.
pub fn hierarchical_layout(ranks_per_host: &[usize]) -> bool {
    ranks_per_host.len() >= 2 && ranks_per_host[0] >= 2 && ranks_per_host.windows(2).all(|w| w[0] == w[1])
}

/// The choice between flat NCCL and the hierarchical path: a pure function of the
/// collective, its message bytes and the topology. Hierarchical needs every host to have
/// the same number (>= 2) of ranks, applies to all_reduce, all_gather and reduce_scatter,
/// and pays off only for messages large enough that the host-local phases' extra launches
/// and barriers are small against the bytes moved (`min_bytes`).
pub fn choose_cross_host(kind: Kind, bytes: u64, ranks_per_host: &[usize], min_bytes: u64) -> CrossHost {
    use Kind as K;
    let eligible = matches!(kind, K::AllReduce | K::AllGather | K::ReduceScatter);
    if hierarchical_layout(ranks_per_host) && eligible && bytes >= min_bytes {
        CrossHost::Hierarchical
    } else {
        CrossHost::Flat
    }
}

/// How a CUDA all_reduce of `count` elements of `elem` bytes with `op` runs, and why (a
/// pure function of values every rank has alike, so every rank takes the same path).
/// Hierarchical needs: the same number L >= 2 of ranks on every host and at least
/// `min_bytes` (`choose_cross_host`), an op whose partial results compose (not AVG: the
/// cross-host step would divide by the number of hosts, not of ranks), rsccl's kernels for
/// the dtype and op, and shards (count / L elements) that are whole multiples of 16 bytes,
/// so every phase works on aligned, equal pieces.
pub fn all_reduce_path(
    count: u64,
    elem: usize,
    op: ReduceOp,
    kernels_support: bool,
    ranks_per_host: &[usize],
    min_bytes: u64,
) -> (CrossHost, &'static str) {
    let bytes = count * elem as u64;
    if choose_cross_host(Kind::AllReduce, bytes, ranks_per_host, min_bytes) == CrossHost::Flat {
        return (CrossHost::Flat, "small message, or hosts with unequal or single GPUs");
    }
    if !matches!(op, ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max) {
        return (CrossHost::Flat, "AVG (and ops whose partial results do not compose) run flat");
    }
    if !kernels_support {
        return (CrossHost::Flat, "rsccl's kernels do not reduce this dtype with this op");
    }
    let l = ranks_per_host[0] as u64;
    if count % l != 0 || (count / l * elem as u64) % 16 != 0 {
        return (CrossHost::Flat, "the message does not split into 16-byte-aligned shards per local rank");
    }
    (CrossHost::Hierarchical, "large message, same number of GPUs on every host")
}

/// Whether the group's ranks are host-major: host h (hosts numbered by their lowest rank, as
/// Topology does) holds ranks h * L .. h * L + L - 1, every host the same number L. Then a
/// host's ranks own one contiguous block of a rank-ordered buffer (all_gather output,
/// reduce_scatter input), and a rank's index in its cross communicator is its host index.
pub fn host_major(hosts: &[Vec<usize>]) -> bool {
    let Some(l) = hosts.first().map(|h| h.len()) else { return false };
    hosts.iter().enumerate().all(|(h, ranks)| ranks.len() == l && ranks.iter().enumerate().all(|(i, &r)| r == h * l + i))
}

/// How a CUDA all_gather of `bytes_per_rank` runs, and why (pure; every rank evaluates it
/// alike). Hierarchical needs what `choose_cross_host` needs (on the output's bytes),
/// host-major ranks (so rank r's piece lands at r * bytes_per_rank through host blocks)
/// and pieces that are whole multiples of 16 bytes (aligned for the host-local kernel).
pub fn all_gather_path(bytes_per_rank: u64, ranks_per_host: &[usize], host_major: bool, min_bytes: u64) -> (CrossHost, &'static str) {
    let world = ranks_per_host.iter().sum::<usize>() as u64;
    if choose_cross_host(Kind::AllGather, bytes_per_rank * world, ranks_per_host, min_bytes) == CrossHost::Flat {
        return (CrossHost::Flat, "small message, or hosts with unequal or single GPUs");
    }
    if !host_major {
        return (CrossHost::Flat, "ranks are not host-major (rank = host index x GPUs per host + local index)");
    }
    if bytes_per_rank == 0 || bytes_per_rank % 16 != 0 {
        return (CrossHost::Flat, "a rank's piece is empty or not a whole multiple of 16 bytes");
    }
    (CrossHost::Hierarchical, "large message, same number of GPUs on every host, host-major ranks")
}

/// How a CUDA reduce_scatter of `count` output elements of `elem` bytes with `op` runs,
/// and why (pure, as above). Hierarchical needs what `all_gather_path` needs (on the
/// input's bytes, world x count elements), an op whose partial results compose and
/// rsccl's kernels for it (as `all_reduce_path`), and room in the scratch for the host's
/// partial sums: hosts x count elements, at most `scratch_bytes`.
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter_path(
    count: u64,
    elem: usize,
    op: ReduceOp,
    kernels_support: bool,
    ranks_per_host: &[usize],
    host_major: bool,
    min_bytes: u64,
    scratch_bytes: u64,
) -> (CrossHost, &'static str) {
    let piece = count * elem as u64;
    let world = ranks_per_host.iter().sum::<usize>() as u64;
    if choose_cross_host(Kind::ReduceScatter, piece * world, ranks_per_host, min_bytes) == CrossHost::Flat {
        return (CrossHost::Flat, "small message, or hosts with unequal or single GPUs");
    }
    if !host_major {
        return (CrossHost::Flat, "ranks are not host-major (rank = host index x GPUs per host + local index)");
    }
    if !matches!(op, ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max) {
        return (CrossHost::Flat, "AVG (and ops whose partial results do not compose) run flat");
    }
    if !kernels_support {
        return (CrossHost::Flat, "rsccl's kernels do not reduce this dtype with this op");
    }
    if piece == 0 || piece % 16 != 0 {
        return (CrossHost::Flat, "the output is empty or not a whole multiple of 16 bytes");
    }
    if piece * ranks_per_host.len() as u64 > scratch_bytes {
        return (CrossHost::Flat, "the hosts' partial sums (output bytes x hosts) exceed nccl_hierarchical_scratch_bytes");
    }
    (CrossHost::Hierarchical, "large message, same number of GPUs on every host, host-major ranks")
}

/// Whether a launch that started on the GPU at `started` (None: not yet) and has not
/// finished is past the group timeout `now` (pure: tested without a GPU).
pub fn launch_timed_out(started: Option<Instant>, now: Instant, timeout: Duration) -> bool {
    started.is_some_and(|t| now.saturating_duration_since(t) > timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::Topology;

    #[test]
    fn launches_age_from_their_start_on_the_gpu() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        // Queued behind an hour of compute: not started, never late.
        assert!(!launch_timed_out(None, t0 + Duration::from_secs(3600), timeout));
        let started = Some(t0 + Duration::from_secs(3600));
        assert!(!launch_timed_out(started, t0 + Duration::from_secs(3605), timeout), "5 s since its start");
        assert!(!launch_timed_out(started, t0 + Duration::from_secs(3610), timeout), "exactly the timeout");
        assert!(launch_timed_out(started, t0 + Duration::from_secs(3611), timeout));
        assert!(!launch_timed_out(started, t0, timeout), "a clock read before the start counts as 0");
    }

    #[test]
    fn hierarchical_all_reduce_only_where_it_is_exact_and_aligned() {
        let mib = 1u64 << 20;
        let two_by_two = [2usize, 2];
        let path = |count, elem, op, ok, hosts: &[usize]| all_reduce_path(count, elem, op, ok, hosts, mib).0;
        use CrossHost::{Flat, Hierarchical};
        assert_eq!(path(mib, 2, ReduceOp::Sum, true, &two_by_two), Hierarchical);
        assert_eq!(path(mib, 4, ReduceOp::Max, true, &two_by_two), Hierarchical);
        assert_eq!(path(mib / 4, 2, ReduceOp::Sum, true, &two_by_two), Flat, "under the threshold");
        assert_eq!(path(mib, 2, ReduceOp::Avg, true, &two_by_two), Flat, "AVG would divide by the hosts");
        assert_eq!(path(mib, 2, ReduceOp::Sum, false, &two_by_two), Flat, "no kernel");
        assert_eq!(path(mib + 1, 2, ReduceOp::Sum, true, &two_by_two), Flat, "odd count");
        assert_eq!(path(mib + 2, 2, ReduceOp::Sum, true, &two_by_two), Flat, "shard of 2 MiB + 2 bytes: unaligned");
        assert_eq!(path(mib + 16, 2, ReduceOp::Sum, true, &two_by_two), Hierarchical, "shard of 2 MiB + 16 bytes");
        assert_eq!(path(mib, 2, ReduceOp::Sum, true, &[1, 1]), Flat, "one GPU per host");
        assert_eq!(path(mib * 3, 2, ReduceOp::Sum, true, &[3, 3]), Hierarchical);
        assert_eq!(path(mib, 2, ReduceOp::Sum, true, &[2, 3]), Flat, "uneven hosts");
    }

    #[test]
    fn host_major_means_each_host_holds_one_contiguous_block() {
        assert!(host_major(&[vec![0, 1], vec![2, 3]]));
        assert!(host_major(&[vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8]]));
        assert!(host_major(&[vec![0], vec![1]]), "one GPU per host is trivially host-major");
        assert!(!host_major(&[vec![0, 2], vec![1, 3]]), "round-robin placement");
        assert!(!host_major(&[vec![0, 1], vec![2, 3, 4]]), "unequal hosts");
        assert!(!host_major(&[vec![0, 1, 3], vec![2, 4, 5]]), "interleaved");
        assert!(!host_major(&[]));
        // What Topology builds from RSCCL_HOST_ID = "emul-host-{rank // 2}" and from hosts
        // that take turns.
        use crate::bootstrap::RankInfo;
        let i = |h: &str| RankInfo { pid: 1, host_id: h.into(), ..Default::default() };
        let emul = Topology::from_infos(0, &[i("h0"), i("h0"), i("h1"), i("h1")]);
        assert!(host_major(&emul.hosts));
        let turns = Topology::from_infos(0, &[i("h0"), i("h1"), i("h0"), i("h1")]);
        assert!(!host_major(&turns.hosts));
    }

    #[test]
    fn hierarchical_all_gather_only_for_host_major_aligned_large_calls() {
        let mib = 1u64 << 20;
        use CrossHost::{Flat, Hierarchical};
        let two_by_two = [2usize, 2];
        // bytes per rank; the threshold applies to the output (world x bytes per rank).
        assert_eq!(all_gather_path(mib / 4, &two_by_two, true, mib).0, Hierarchical, "4 x 256 KiB = 1 MiB output");
        assert_eq!(all_gather_path(mib / 4 - 16, &two_by_two, true, mib).0, Flat, "under the threshold");
        assert_eq!(all_gather_path(mib, &two_by_two, false, mib).0, Flat, "not host-major");
        assert_eq!(all_gather_path(mib + 8, &two_by_two, true, mib).0, Flat, "unaligned pieces");
        assert_eq!(all_gather_path(mib + 16, &two_by_two, true, mib).0, Hierarchical);
        assert_eq!(all_gather_path(0, &two_by_two, true, 0).0, Flat, "empty");
        assert_eq!(all_gather_path(16, &two_by_two, true, 0).0, Hierarchical, "threshold 0: every aligned call");
        assert_eq!(all_gather_path(mib, &[1, 1], true, mib).0, Flat, "one GPU per host");
        assert_eq!(all_gather_path(mib, &[2, 3], true, mib).0, Flat, "uneven hosts");
        assert_eq!(all_gather_path(mib, &[4], true, mib).0, Flat, "one host");
        assert_eq!(all_gather_path(mib, &[4, 4, 4], true, mib).0, Hierarchical);
    }

    #[test]
    fn hierarchical_reduce_scatter_needs_a_composable_op_and_room_in_the_scratch() {
        let mib = 1u64 << 20;
        use CrossHost::{Flat, Hierarchical};
        let two_by_two = [2usize, 2];
        let scratch = 32 * mib;
        let path = |count, elem, op, ok, hosts: &[usize], major| reduce_scatter_path(count, elem, op, ok, hosts, major, mib, scratch).0;
        // count = output elements; the threshold applies to the input (world x count).
        assert_eq!(path(mib / 8, 2, ReduceOp::Sum, true, &two_by_two, true), Hierarchical, "input 4 x 256 KiB");
        assert_eq!(path(mib / 16, 2, ReduceOp::Sum, true, &two_by_two, true), Flat, "input 512 KiB: under the threshold");
        assert_eq!(path(mib, 4, ReduceOp::Max, true, &two_by_two, true), Hierarchical);
        assert_eq!(path(mib, 4, ReduceOp::Avg, true, &two_by_two, true), Flat, "AVG would divide by the hosts");
        assert_eq!(path(mib, 4, ReduceOp::Sum, false, &two_by_two, true), Flat, "no kernel");
        assert_eq!(path(mib, 4, ReduceOp::Sum, true, &two_by_two, false), Flat, "not host-major");
        assert_eq!(path(mib + 2, 4, ReduceOp::Sum, true, &two_by_two, true), Flat, "output of 4 MiB + 8 bytes: unaligned");
        assert_eq!(path(mib + 4, 4, ReduceOp::Sum, true, &two_by_two, true), Hierarchical, "4 MiB + 16 bytes");
        // The scratch holds hosts x output bytes.
        assert_eq!(path(4 * mib, 4, ReduceOp::Sum, true, &two_by_two, true), Hierarchical, "2 hosts x 16 MiB = 32 MiB: fits");
        assert_eq!(path(4 * mib + 4, 4, ReduceOp::Sum, true, &two_by_two, true), Flat, "2 x (16 MiB + 16 bytes): does not fit");
        assert_eq!(path(4 * mib, 4, ReduceOp::Sum, true, &[2, 2, 2], true), Flat, "3 hosts x 16 MiB: does not fit");
        assert_eq!(reduce_scatter_path(mib, 4, ReduceOp::Sum, true, &two_by_two, true, mib, 0).0, Flat, "no scratch");
        assert_eq!(path(mib, 4, ReduceOp::Sum, true, &[1, 1], true), Flat, "one GPU per host");
        assert_eq!(path(mib, 4, ReduceOp::Sum, true, &[2, 3], false), Flat, "uneven hosts");
        assert_eq!(reduce_scatter_path(0, 4, ReduceOp::Sum, true, &two_by_two, true, 0, scratch).0, Flat, "empty");
    }

    #[test]
    fn a_hierarchical_path_needs_several_hosts_with_the_same_gpus() {
        assert!(hierarchical_layout(&[2, 2]));
        assert!(hierarchical_layout(&[8, 8, 8]));
        assert!(!hierarchical_layout(&[1, 1]), "one GPU per host");
        assert!(!hierarchical_layout(&[2, 3]), "uneven hosts");
        assert!(!hierarchical_layout(&[3, 2, 2]), "uneven hosts, the first larger");
        assert!(!hierarchical_layout(&[4]), "one host");
        assert!(!hierarchical_layout(&[]));
    }

    #[test]
    fn hierarchical_only_where_it_can_pay() {
        let mib = 1u64 << 20;
        let two_by_two = [2usize, 2];
        assert_eq!(choose_cross_host(Kind::AllReduce, 16 * mib, &two_by_two, mib), CrossHost::Hierarchical);
        assert_eq!(choose_cross_host(Kind::AllGather, mib, &two_by_two, mib), CrossHost::Hierarchical);
        assert_eq!(choose_cross_host(Kind::AllReduce, mib - 1, &two_by_two, mib), CrossHost::Flat, "small");
        assert_eq!(choose_cross_host(Kind::Broadcast, 16 * mib, &two_by_two, mib), CrossHost::Flat, "not eligible");
        assert_eq!(choose_cross_host(Kind::AllReduce, 16 * mib, &[1, 1, 1, 1], mib), CrossHost::Flat, "one GPU per host");
        assert_eq!(choose_cross_host(Kind::AllReduce, 16 * mib, &[2, 3], mib), CrossHost::Flat, "uneven hosts");
        assert_eq!(choose_cross_host(Kind::AllReduce, 16 * mib, &[4], mib), CrossHost::Flat, "one host");
    }
}
