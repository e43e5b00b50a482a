//! What an operation is: the one list of rsccl's collectives and point-to-point calls,
//! shared by every engine (host, CUDA, NCCL) and by the Python layer (through
//! `rsccl._rsccl.KINDS`). Every match on `Kind` is exhaustive, so adding a variant makes
//! the compiler list each place that must learn it (docs/internals.md).

/// The kind table: one row per operation and every fact of it. Columns: the variant and
/// its code (the discriminant: it travels in the host engine's headers and in the CUDA
/// kernels' descriptors, which only compare it, and Python passes it to
/// `Communicator.run`; codes are never reused), torch's name (as error messages and
/// profiler events name it), and five facts: it takes a reduce op (`op`: peers must agree
/// on it), it has a root (`root`: src/dst, peers must agree on it), it involves one peer
/// only (`p2p`: a rank with bad arguments raises without joining, `Group::run`), the
/// CUDA engines run it on bytes (`bytes`: any dtype, no op; the descriptor carries
/// uint8/SUM, so ranks that pass different dtypes of the same bytes agree), its sizes are
/// per peer (`chunks`: the op carries a chunk per rank, `Op::splits`). `-`: no.
macro_rules! kinds {
    ($($(#[$doc:meta])* $v:ident = $code:literal, $name:literal, $op:tt, $root:tt, $p2p:tt, $bytes:tt, $chunks:tt;)*) => {
        /// One kind of operation (the table above).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Kind {
            $($(#[$doc])* $v = $code,)*
        }

        impl Kind {
            pub const ALL: [Kind; [$($code),*].len()] = [$(Kind::$v),*];

            /// torch's spelling, as error messages and profiler events name it.
            pub fn name(self) -> &'static str {
                match self {
                    $(Kind::$v => $name,)*
                }
            }

            /// Whether it takes a reduce op (peers must agree on it).
            pub fn has_op(self) -> bool {
                match self {
                    $(Kind::$v => fact!($op),)*
                }
            }

            /// Whether it has a root (src/dst) rank (peers must agree on it).
            pub fn has_root(self) -> bool {
                match self {
                    $(Kind::$v => fact!($root),)*
                }
            }

            /// Whether it involves one peer only (send, recv): a rank with bad arguments
            /// raises without joining (`Group::run`), as there is no call of the whole
            /// group to join.
            pub fn is_p2p(self) -> bool {
                match self {
                    $(Kind::$v => fact!($p2p),)*
                }
            }

            /// Whether the CUDA engines run it on bytes (any dtype, no op): the descriptor
            /// then carries uint8/SUM, so ranks that pass different dtypes of the same
            /// bytes agree.
            pub fn moves_bytes(self) -> bool {
                match self {
                    $(Kind::$v => fact!($bytes),)*
                }
            }

            /// Whether its sizes are per peer: the op carries a chunk per rank of the group
            /// (`Op::splits`: sent and received), which the device engines take as the
            /// call's shape (`CudaCall::chunks`).
            pub fn has_chunks(self) -> bool {
                match self {
                    $(Kind::$v => fact!($chunks),)*
                }
            }
        }
    };
}

/// A fact cell: set (its column's name) or `-`.
macro_rules! fact {
    (-) => {
        false
    };
    ($x:ident) => {
        true
    };
}

kinds! {
    // variant = code, torch name, reduce op, root, p2p, bytes on CUDA, chunks per peer
    AllReduce = 1, "all_reduce", op, -, -, -, -;
    ReduceScatter = 2, "reduce_scatter", op, -, -, -, -;
    AllGather = 3, "all_gather", -, -, -, bytes, -;
    Broadcast = 4, "broadcast", -, root, -, bytes, -;
    Barrier = 5, "barrier", -, -, -, -, -;
    /// This rank's arguments were invalid: on CUDA it takes part in the first barrier only,
    /// so every peer learns of it (descriptor mismatch) instead of waiting.
    Invalid = 6, "an invalid call", -, -, -, -, -;
    /// Rooted: bytes per rank (gather, scatter) or elements (reduce).
    Gather = 7, "gather", -, root, -, bytes, -;
    Scatter = 8, "scatter", -, root, -, bytes, -;
    Reduce = 9, "reduce", op, root, -, -, -;
    /// Bytes per peer travel in the op's splits.
    AllToAll = 10, "all_to_all", -, -, -, bytes, chunks;
    /// Point to point with one peer.
    Send = 11, "send", -, -, p2p, bytes, -;
    Recv = 12, "recv", -, -, p2p, bytes, -;
}

impl Kind {
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

    /// The facts as the table gives them (a changed cell is a changed protocol).
    #[test]
    fn facts_follow_the_table() {
        let with = |f: fn(Kind) -> bool| Kind::ALL.into_iter().filter(|k| f(*k)).map(|k| k.name()).collect::<Vec<_>>();
        assert_eq!(with(Kind::has_op), ["all_reduce", "reduce_scatter", "reduce"]);
        assert_eq!(with(Kind::has_root), ["broadcast", "gather", "scatter", "reduce"]);
        assert_eq!(with(Kind::is_p2p), ["send", "recv"]);
        assert_eq!(with(Kind::moves_bytes), ["all_gather", "broadcast", "gather", "scatter", "all_to_all", "send", "recv"]);
        assert_eq!(with(Kind::has_chunks), ["all_to_all"]);
    }
}
