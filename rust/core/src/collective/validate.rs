//! The argument rules every engine and front end applies, as pure functions: each takes
//! what a rank passed and the group's size, and returns the checked value or the one
//! `InvalidArgument` that describes it. Each message is made here alone, so the host
//! engine, the CUDA engines and rsccl-tch refuse the same argument in the same words.
//!
//! Which rank passed the value is added where the error travels (the host engine's
//! agreement names each failing rank, `Error::naming_rank` the rest), except in the peer
//! rule, whose message needs the caller's own rank to say what a valid peer is.

use crate::error::{Error, Result};

/// A root (src/dst) rank of the collective `what` as the caller gave it, in a group of `n`
/// ranks. Negative roots are refused before they become an index.
pub fn root(what: &str, root: i64, n: usize) -> Result<usize> {
    match usize::try_from(root) {
        Ok(r) if r < n => Ok(r),
        _ => Err(Error::InvalidArgument(format!("{what}: root/src rank {root} is out of range for a group of size {n}"))),
    }
}

/// The peer of a send or recv (`what`) that rank `me` of a group of `n` passed: another
/// rank of the group (rsccl does not send to itself).
pub fn peer(what: &str, me: usize, peer: i64, n: usize) -> Result<usize> {
    match usize::try_from(peer) {
        Ok(p) if p < n && p != me => Ok(p),
        _ => Err(Error::InvalidArgument(format!(
            "{what}: rank {me} passed peer {peer}; give another rank of this group of {n} (rsccl does not send to itself)"
        ))),
    }
}

/// The block-per-rank size rule of all_gather and reduce_scatter (`what`): the buffer
/// named `whole` (all_gather's output, reduce_scatter's input) holds `n` of the buffer
/// named `part`. Sizes are in bytes, compared as such, and reported in elements of
/// `elem` bytes (1 where the caller counts elements already).
pub fn blocks_per_rank(what: &str, n: usize, elem: u64, whole: (&str, u64), part: (&str, u64)) -> Result<()> {
    let ((w, wb), (p, pb)) = (whole, part);
    match pb.checked_mul(n as u64) {
        Some(expected) if expected == wb => Ok(()),
        expected => {
            let (we, pe) = (wb / elem.max(1), pb / elem.max(1));
            Err(Error::InvalidArgument(match expected {
                Some(x) => format!("{what}: {w} has {we} elements, expected group size {n} x {p} {pe} = {}", x / elem.max(1)),
                None => format!("{what}: {w} has {we} elements, expected group size {n} x {p} {pe} (more than 2^64 bytes)"),
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid_argument(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn a_root_is_a_rank_of_the_group() {
        assert_eq!(root("broadcast", 0, 3).unwrap(), 0);
        assert_eq!(root("gather", 2, 3).unwrap(), 2);
        for (r, n) in [(3, 3), (-1, 3), (i64::MIN, 4), (i64::MAX, 8)] {
            let m = invalid_argument(root("scatter", r, n));
            assert_eq!(m, format!("scatter: root/src rank {r} is out of range for a group of size {n}"));
        }
    }

    #[test]
    fn a_peer_is_another_rank_of_the_group() {
        assert_eq!(peer("send", 0, 3, 4).unwrap(), 3);
        assert_eq!(peer("recv", 3, 0, 4).unwrap(), 0);
        for (me, p, n) in [(1, 1, 4), (1, 4, 4), (2, -2, 4), (0, i64::MAX, 2)] {
            let m = invalid_argument(peer("send", me, p, n));
            assert!(m.starts_with(&format!("send: rank {me} passed peer {p}; ")), "{m}");
            assert!(m.contains(&format!("group of {n}")), "{m}");
        }
        assert!(invalid_argument(peer("recv", 1, 1, 4)).contains("does not send to itself"));
    }

    #[test]
    fn a_block_per_rank_buffer_holds_the_group_size_of_the_other() {
        assert!(blocks_per_rank("all_gather", 3, 4, ("output", 48), ("input", 16)).is_ok());
        assert!(blocks_per_rank("reduce_scatter", 1, 2, ("input", 0), ("output", 0)).is_ok());
        let m = invalid_argument(blocks_per_rank("all_gather", 3, 1, ("output", 13), ("input", 4)));
        assert_eq!(m, "all_gather: output has 13 elements, expected group size 3 x input 4 = 12");
        // float32: bytes in, elements out.
        let m = invalid_argument(blocks_per_rank("reduce_scatter", 2, 4, ("input", 40), ("output", 16)));
        assert_eq!(m, "reduce_scatter: input has 10 elements, expected group size 2 x output 4 = 8");
        let m = invalid_argument(blocks_per_rank("reduce_scatter", 4, 1, ("input", 7), ("output", u64::MAX)));
        assert!(m.contains("input has 7 elements") && m.contains("more than 2^64"), "{m}");
    }
}
