//! Where everything lives in a group's host region. Every local rank computes the same
//! layout from (local ranks, Config), so offsets never travel between processes.
//!
//! ```text
//! [ControlBlock                     CONTROL_BYTES]
//! [CollHeader  x 2 parities x N ranks             ]   agreement check of each collective
//! [coll data   x N ranks x 2 parities (halves)    ]   staging, double-buffered
//! [p2p channel x N*(N-1) ordered pairs            ]   send/recv, each: ChannelCtrl + 2 halves
//! ```

use std::cell::UnsafeCell;
use std::sync::atomic::AtomicU32;

use crate::config::Config;
use crate::error::{Error, Result};

/// Ranks of one group on one host that a region can hold.
pub const MAX_LOCAL_RANKS: usize = 64;
pub const CONTROL_BYTES: usize = 16 << 10;
pub const HEADER_BYTES: usize = 4 << 10;
pub const CHANNEL_CTRL_BYTES: usize = 4 << 10;
pub const MAGIC: u64 = 0x7273_6363_6c5f_6831; // "rsccl_h1"
pub const ERROR_TEXT_BYTES: usize = 480;

/// A u32 alone on its cache line, so ranks polling different words do not contend.
#[repr(C, align(64))]
pub struct PaddedU32(pub AtomicU32);

/// Shared state of a group on one host.
///
/// Barrier protocol (`barrier`): a monotonic arrival counter. Barrier k (1-based) is
/// passed by a rank that has done `barrier.fetch_add(1, AcqRel)` and then observed
/// `barrier >= k * nranks` with an Acquire load (wrapping u32 arithmetic; no two ranks are
/// ever more than one barrier apart, so differences stay far below 2^31). Ordering: every
/// write a rank made before its fetch_add is released by it; the fetch_adds form one
/// release sequence on `barrier`, so the Acquire load that sees the final count
/// synchronises with every rank's fetch_add, and all their earlier writes to the region
/// are visible after the barrier. The last arriver wakes futex sleepers.
///
/// Abort protocol: a rank that fails mid-collective writes `abort_text` and `abort_rank`,
/// then stores `abort_flag = 1` (Release) and wakes every futex word; waiters poll
/// `abort_flag` (Acquire) between sleeps and then read the text.
///
/// Doorbells: `doorbells[r]` is bumped (fetch_add, Release) and futex-woken by anyone who
/// changed a p2p channel that rank r is waiting on; rank r's p2p thread reads it (Acquire)
/// before checking its channels and sleeps on the value it read, so no wake-up is lost.
#[repr(C)]
pub struct ControlBlock {
    pub magic: u64,
    pub nranks: u32,
    pub _pad0: u32,
    pub region_bytes: u64,
    pub _pad1: [u8; 40],
    pub barrier: PaddedU32,
    pub abort_flag: PaddedU32,
    pub abort_rank: UnsafeCell<u32>,
    pub abort_len: UnsafeCell<u32>,
    /// `Error::class_code` of the abort's cause, so a timeout stays a timeout everywhere.
    pub abort_class: UnsafeCell<u32>,
    pub abort_text: UnsafeCell<[u8; 512]>,
    /// Barriers each rank has arrived at: names the missing ranks on a timeout.
    pub arrivals: [PaddedU32; MAX_LOCAL_RANKS],
    pub doorbells: [PaddedU32; MAX_LOCAL_RANKS],
    /// Per rank, the peer (+1; 0 = none) its oldest pending send or recv waits for,
    /// written by that rank's send/recv thread (Relaxed: a diagnostic read only to name
    /// whom a peer waits for in a timeout message, never to synchronize).
    pub waits_for: [PaddedU32; MAX_LOCAL_RANKS],
}

/// Per-rank description of a collective, written before the collective's first barrier
/// and read by every rank after it: all ranks check the same headers, so they all reach
/// the same verdict and raise the same error.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollHeader {
    pub seq: u64,
    pub kind: u8,
    pub dtype: u8,
    pub op: u8,
    /// 0: no local error; else `Error::class_code` of the error this rank hit locally.
    pub error_class: u8,
    pub root: i32,
    /// Elements per rank: the meaning per kind is in `collective::Collective::count`.
    pub count: u64,
    pub error_len: u32,
    pub _pad: u32,
    pub error_text: [u8; ERROR_TEXT_BYTES],
    /// all_to_all: bytes this rank sends to / receives from each rank.
    pub send_bytes: [u64; MAX_LOCAL_RANKS],
    pub recv_bytes: [u64; MAX_LOCAL_RANKS],
}

const _: () = assert!(std::mem::size_of::<CollHeader>() <= HEADER_BYTES);
const _: () = assert!(std::mem::size_of::<ControlBlock>() <= CONTROL_BYTES);

/// Control words of one ordered channel src -> dst.
///
/// Protocol: chunks are numbered over the channel's lifetime (wrapping u32). The sender
/// may write chunk g into half g % 2 when `g - acked < 2`; it writes the `MsgHeader` and
/// data, then `sent.store(g + 1, Release)` and rings dst's doorbell. The receiver reads
/// chunk g once `sent.load(Acquire) > g`, copies it out, then `acked.store(g + 1, Release)`
/// and rings src's doorbell. Release/acquire on `sent` makes the data visible to the
/// reader; on `acked` it orders the reader's copy before the writer's reuse of the half.
/// `poisoned` ends the channel: a receiver that finds a mismatching message, or an end
/// that times out mid-message, claims it (compare_exchange 0 -> u32::MAX), writes
/// `error_text`, then stores the error's class code (Release); the other end fails with
/// that text once an Acquire load sees the code.
///
/// Rejection (a message whose size or dtype differs from the recv it matched): the channel
/// stays usable. The receiver writes `reject_class` and `reject_text`, then
/// `rejected.fetch_add(1, Release)`, before it acks the message's first chunk; it then acks
/// the message's remaining chunks without reading them. The sender has one message in the
/// channel at a time and starts the next only after the last one was fully acked, so at
/// most one rejection is unread: once its Acquire load of `acked` covers the message, it
/// compares `rejected` with the count it last saw, and a change means this message was
/// rejected, with that text. The text is not rewritten before then (the next rejection
/// needs the sender's next message).
#[repr(C)]
pub struct ChannelCtrl {
    pub sent: PaddedU32,
    pub acked: PaddedU32,
    pub poisoned: PaddedU32,
    pub error_len: UnsafeCell<u32>,
    pub error_text: UnsafeCell<[u8; ERROR_TEXT_BYTES]>,
    pub headers: [UnsafeCell<MsgHeader>; 2],
    pub rejected: PaddedU32,
    pub reject_class: UnsafeCell<u32>,
    pub reject_len: UnsafeCell<u32>,
    pub reject_text: UnsafeCell<[u8; ERROR_TEXT_BYTES]>,
}

/// What one p2p chunk belongs to; checked by the receiver against its recv.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MsgHeader {
    pub tag: i64,
    pub total_bytes: u64,
    pub dtype: u8,
    pub _pad: [u8; 7],
}

const _: () = assert!(std::mem::size_of::<ChannelCtrl>() <= CHANNEL_CTRL_BYTES);

/// Offsets of one group's region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub nranks: usize,
    pub coll_half: usize,
    pub p2p_half: usize,
    pub headers_at: usize,
    pub coll_at: usize,
    pub p2p_at: usize,
    pub channel_bytes: usize,
    pub total: usize,
}

impl Layout {
    pub fn new(nranks: usize, cfg: &Config) -> Result<Layout> {
        if nranks == 0 || nranks > MAX_LOCAL_RANKS {
            return Err(Error::InvalidArgument(format!("rsccl supports 1 to {MAX_LOCAL_RANKS} ranks of one group per host, got {nranks}")));
        }
        let coll_half = cfg.coll_half_bytes();
        let p2p_half = cfg.p2p_half_bytes();
        let headers_at = CONTROL_BYTES;
        let coll_at = headers_at + 2 * nranks * HEADER_BYTES;
        let p2p_at = coll_at + nranks * 2 * coll_half;
        let channel_bytes = CHANNEL_CTRL_BYTES + 2 * p2p_half;
        let total = p2p_at + nranks * (nranks - 1) * channel_bytes;
        if total > cfg.max_region_bytes {
            return Err(Error::Config(format!(
                "a group of {nranks} local ranks needs a {total}-byte host region \
                 (host_buffer_bytes={} per rank, p2p_buffer_bytes={} per pair), over \
                 max_region_bytes={} (RSCCL_MAX_REGION_BYTES); lower the buffers or raise the cap",
                cfg.host_buffer_bytes, cfg.p2p_buffer_bytes, cfg.max_region_bytes
            )));
        }
        Ok(Layout { nranks, coll_half, p2p_half, headers_at, coll_at, p2p_at, channel_bytes, total })
    }

    pub fn header(&self, parity: usize, rank: usize) -> usize {
        self.headers_at + (parity * self.nranks + rank) * HEADER_BYTES
    }

    pub fn coll_slot(&self, rank: usize, parity: usize) -> usize {
        self.coll_at + (rank * 2 + parity) * self.coll_half
    }

    /// Channel src -> dst (src != dst).
    pub fn channel(&self, src: usize, dst: usize) -> usize {
        debug_assert!(src != dst && src < self.nranks && dst < self.nranks);
        let idx = src * (self.nranks - 1) + if dst > src { dst - 1 } else { dst };
        self.p2p_at + idx * self.channel_bytes
    }

    pub fn channel_half(&self, src: usize, dst: usize, half: usize) -> usize {
        self.channel(src, dst) + CHANNEL_CTRL_BYTES + half * self.p2p_half
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_do_not_overlap() {
        let cfg = Config::default();
        for n in [1usize, 2, 3, 4, 8] {
            let l = Layout::new(n, &cfg).unwrap();
            let mut spans = vec![(0, CONTROL_BYTES)];
            for p in 0..2 {
                for r in 0..n {
                    spans.push((l.header(p, r), HEADER_BYTES));
                    spans.push((l.coll_slot(r, p), l.coll_half));
                }
            }
            for s in 0..n {
                for d in 0..n {
                    if s != d {
                        spans.push((l.channel(s, d), CHANNEL_CTRL_BYTES));
                        spans.push((l.channel_half(s, d, 0), l.p2p_half));
                        spans.push((l.channel_half(s, d, 1), l.p2p_half));
                    }
                }
            }
            spans.sort();
            for w in spans.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "overlap at n={n}: {w:?}");
            }
            let last = spans.last().unwrap();
            assert_eq!(last.0 + last.1, l.total);
            assert!(spans.iter().all(|s| s.0 % 4096 == 0));
        }
    }

    #[test]
    fn cap_is_enforced_with_a_useful_message() {
        let cfg = Config { max_region_bytes: 1 << 20, ..Config::default() };
        let e = Layout::new(4, &cfg).unwrap_err().to_string();
        assert!(e.contains("RSCCL_MAX_REGION_BYTES") && e.contains("4 local ranks"), "{e}");
        assert!(Layout::new(65, &Config::default()).is_err());
    }
}
