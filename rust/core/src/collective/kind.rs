//! What an operation is: the one list of rsccl's collectives and point-to-point calls,
//! shared by every engine (host, CUDA, NCCL) and by the Python layer (through
//! `rsccl._rsccl.KINDS`). Every match on `Kind` is exhaustive, so adding a variant makes
//! the compiler list each place that must learn it (docs/internals.md).

/// One kind of operation. The discriminant is its code: it travels in the host engine's
/// headers and in the CUDA kernels' descriptors (which only compare it), and Python passes
/// it to `Communicator.run`. Codes are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    Barrier = 5,
    /// This rank's arguments were invalid: on CUDA it takes part in the first barrier only,
    /// so every peer learns of it (descriptor mismatch) instead of waiting.
    Invalid = 6,
    /// Rooted: bytes per rank (gather, scatter) or elements (reduce).
    Gather = 7,
    Scatter = 8,
    Reduce = 9,
    /// Bytes per peer travel in the op's splits.
    AllToAll = 10,
    /// Point to point with one peer.
    Send = 11,
    Recv = 12,
}

impl Kind {
    pub const ALL: [Kind; 12] = [
        Kind::AllReduce,
        Kind::ReduceScatter,
        Kind::AllGather,
        Kind::Broadcast,
        Kind::Barrier,
        Kind::Invalid,
        Kind::Gather,
        Kind::Scatter,
        Kind::Reduce,
        Kind::AllToAll,
        Kind::Send,
        Kind::Recv,
    ];

    /// torch's spelling, as error messages and profiler events name it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllGather => "all_gather",
            Kind::Broadcast => "broadcast",
            Kind::Barrier => "barrier",
            Kind::Invalid => "an invalid call",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::Reduce => "reduce",
            Kind::AllToAll => "all_to_all",
            Kind::Send => "send",
            Kind::Recv => "recv",
        }
    }

    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The code as a CUDA kernel descriptor's low byte.
    pub fn code(self) -> u64 {
        self as u64
    }

    pub fn from_code(c: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == c)
    }

    /// Whether it takes a reduce op (peers must agree on it).
    pub fn has_op(self) -> bool {
        match self {
            Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter => true,
            Kind::AllGather
            | Kind::Broadcast
            | Kind::Barrier
            | Kind::Invalid
            | Kind::Gather
            | Kind::Scatter
            | Kind::AllToAll
            | Kind::Send
            | Kind::Recv => false,
        }
    }

    /// Whether it has a root (src/dst) rank (peers must agree on it).
    pub fn has_root(self) -> bool {
        match self {
            Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter => true,
            Kind::AllReduce
            | Kind::ReduceScatter
            | Kind::AllGather
            | Kind::Barrier
            | Kind::Invalid
            | Kind::AllToAll
            | Kind::Send
            | Kind::Recv => false,
        }
    }

    /// Whether it involves one peer only (send, recv): a rank with bad arguments raises
    /// without joining (`Group::run`), as there is no call of the whole group to join.
    pub fn is_p2p(self) -> bool {
        match self {
            Kind::Send | Kind::Recv => true,
            Kind::AllReduce
            | Kind::ReduceScatter
            | Kind::AllGather
            | Kind::Broadcast
            | Kind::Barrier
            | Kind::Invalid
            | Kind::Gather
            | Kind::Scatter
            | Kind::Reduce
            | Kind::AllToAll => false,
        }
    }

    /// Whether the CUDA engines run it on bytes (any dtype, no op): the descriptor then
    /// carries uint8/SUM, so ranks that pass different dtypes of the same bytes agree.
    pub fn moves_bytes(self) -> bool {
        match self {
            Kind::AllGather | Kind::Broadcast | Kind::Gather | Kind::Scatter | Kind::AllToAll | Kind::Send | Kind::Recv => true,
            Kind::AllReduce | Kind::ReduceScatter | Kind::Reduce | Kind::Barrier | Kind::Invalid => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry: every kind has one code, one name, and comes back from both.
    #[test]
    fn every_kind_is_named_and_coded_once() {
        let mut codes: Vec<u8> = Kind::ALL.iter().map(|k| *k as u8).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), Kind::ALL.len(), "duplicate code");
        for k in Kind::ALL {
            assert_eq!(Kind::from_code(k as u8), Some(k));
            assert_eq!(Kind::from_name(k.name()), Some(k));
            assert_eq!(k.code(), k as u64);
        }
        assert_eq!(Kind::from_code(0), None);
        assert_eq!(Kind::from_code(13), None);
    }
}
