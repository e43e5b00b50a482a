//! The warm-up of the flat and cross communicators at group creation: NCCL connects
//! peers and allocates each algorithm's buffers at their first use, so every collective
//! (and the flat one's sends and receives) runs once before the group is handed out.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nc;

use super::bound::Bound;
use super::WARM_BYTES;
use crate::cuda::driver::{check, Device, Event, Stream};
use crate::cuda::nccl::NcclComm;
use crate::error::{Error, Result};

/// The collectives a communicator will run, once each at a small and a large size, and
/// (`p2p`) sends and receives with every rank, on the internal stream, then wait (at most
/// until the deadline, or until a local rank exits: `bound`): NCCL connects peers and allocates the buffers of each algorithm and
/// protocol at their first use, so this moves that to group creation. `warm` holds
/// WARM_BYTES, `scratch` SCRATCH_BYTES; `stream` is a stream of `dev`.
pub(super) fn warm_up(comm: &NcclComm, dev: &Arc<Device>, stream: &Stream, warm: u64, scratch: u64, p2p: bool, bound: Bound) -> Result<()> {
    let f = comm.fns();
    let raw = comm.raw();
    let s = stream.raw() as nc::cudaStream_t;
    let n = comm.nranks;
    let f32_ = nc::ncclDataType_t::ncclFloat32;
    let u8_ = nc::ncclDataType_t::ncclUint8;
    let sum = nc::ncclRedOp_t::ncclSum;
    let (w, sc) = (warm as *mut c_void, scratch as *mut c_void);
    let big = WARM_BYTES / 4; // floats
    let per_rank = (WARM_BYTES / n) & !255; // bytes per rank of the gathers
    let mine = (warm + (comm.rank * per_rank) as u64) as *mut c_void;
    // SAFETY: a live communicator and stream; every call stays inside the warm buffer
    // (WARM_BYTES) or the scratch (one float).
    let calls: [(&str, nc::ncclResult_t); 6] = unsafe {
        [
            ("all_reduce", (f.all_reduce)(sc, sc, 1, f32_, sum, raw, s)),
            ("all_reduce", (f.all_reduce)(w, w, big, f32_, sum, raw, s)),
            // In place, as NCCL defines it: this rank's block of the whole buffer.
            ("all_gather", (f.all_gather)(mine, w, per_rank, u8_, raw, s)),
            ("reduce_scatter", (f.reduce_scatter)(w, mine, per_rank / 4, f32_, sum, raw, s)),
            ("broadcast", (f.broadcast)(w, w, WARM_BYTES, u8_, 0, raw, s)),
            ("reduce", (f.reduce)(w, w, big, f32_, sum, 0, raw, s)),
        ]
    };
    for (what, r) in calls {
        comm.check(r, &format!("NCCL {what} (warm-up at group creation)"))?;
    }
    // gather, scatter and all_to_all (flat communicator only: `p2p`) are NCCL groups of
    // sends and receives, whose point-to-point connections NCCL makes (and whose buffers
    // it allocates) at the first send or receive with each peer: one group with a send to
    // and a receive from every rank, this one included (as all_to_all and the rooted calls
    // do), connects them all now, once with a tiny message and once with a larger one
    // (NCCL picks its protocol by size).
    for per_peer in [1usize, p2p_warm_bytes(n)].into_iter().filter(|_| p2p) {
        comm.check(warm_p2p(comm, stream, warm, per_peer), "NCCL send/recv (warm-up at group creation)")?;
    }
    let ev = Event::new(dev)?;
    // SAFETY: valid event and stream.
    let recorded = check(unsafe { cu::cuEventRecord(ev.raw(), stream.raw()) }, "cuEventRecord");
    let mut result = recorded;
    if result.is_ok() {
        loop {
            // SAFETY: valid event.
            match unsafe { cu::cuEventQuery(ev.raw()) } {
                cu::CUresult::CUDA_SUCCESS => break,
                cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < bound.deadline => {
                    if let Err(e) = comm.async_error().and_then(|_| bound.peers_alive("the NCCL warm-up at group creation")) {
                        result = Err(e);
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                cu::CUresult::CUDA_ERROR_NOT_READY => {
                    result = Err(Error::Timeout(
                        "the NCCL warm-up at group creation did not finish within the group timeout: a rank stopped during creation".into(),
                    ));
                    break;
                }
                e => {
                    result = check(e, "cuEventQuery (NCCL warm-up)");
                    break;
                }
            }
        }
    }
    if result.is_err() {
        // Ends the warm-up kernels, so the buffers can be freed under them.
        comm.abort();
    }
    // Dropping `ev` destroys it: the warm-up finished or was aborted.
    result
}

/// Bytes per peer of the larger point-to-point warm-up: the sends read the first half of
/// the warm buffer, the receives write the second, `n` pieces each, in 256-byte units
/// (at least 1 byte, for very large groups).
pub fn p2p_warm_bytes(n: usize) -> usize {
    ((WARM_BYTES / 2 / n.max(1)) & !255).max(1)
}

/// One NCCL group of a `per_peer`-byte send to and receive from every rank of `comm` (self
/// included), on `stream`: sends from the first half of `warm`, receives into the second.
fn warm_p2p(comm: &NcclComm, stream: &Stream, warm: u64, per_peer: usize) -> nc::ncclResult_t {
    let (f, raw, s) = (comm.fns(), comm.raw(), stream.raw() as nc::cudaStream_t);
    let u8_ = nc::ncclDataType_t::ncclUint8;
    let half = (WARM_BYTES / 2) as u64;
    f.group(|first| {
        for peer in 0..comm.nranks {
            let at = (peer * per_peer) as u64 % half;
            // SAFETY: a live communicator and stream; every piece lies in its half of the
            // warm buffer: at + per_peer <= half, since per_peer x nranks <= half when
            // per_peer comes from p2p_warm_bytes(nranks) (or per_peer = 1 and at < half).
            // Pieces of 1 byte may coincide in very large groups: the warm-up's data is
            // never read.
            unsafe {
                first.keep((f.send)((warm + at) as *const c_void, per_peer, u8_, peer as i32, raw, s));
                first.keep((f.recv)((warm + half + at) as *mut c_void, per_peer, u8_, peer as i32, raw, s));
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p2p_warm_up_pieces_fit_their_half_of_the_warm_buffer() {
        for n in [1usize, 2, 3, 4, 7, 16, 1000, 16 << 10, 1 << 20] {
            let b = p2p_warm_bytes(n);
            assert!(b >= 1);
            assert!(b * n <= WARM_BYTES / 2 || b == 1, "{n} ranks x {b} bytes");
            assert!(b == 1 || b % 256 == 0);
        }
        assert_eq!(p2p_warm_bytes(4), 1 << 20);
    }
}
