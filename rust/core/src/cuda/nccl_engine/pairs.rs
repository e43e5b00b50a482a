//! The pair communicators of CUDA send/recv (see PairComm): their creation by rounds of
//! ncclCommSplit, their warm-up, and the launch of one message on one of them.

use std::ffi::{c_void, CString};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nc;

use super::bound::{free_bytes, Bound};
use super::pair_rounds::p2p_split_rounds;
use super::{NcclEngine, PairComm, PAIR_WARM_BYTES, PAIR_WARM_RECV_AT};
use crate::bootstrap::Topology;
use crate::collective::Kind;
use crate::config::Config;
use crate::cuda::driver::{check, Device, Event, Stream};
use crate::cuda::nccl::NcclComm;
use crate::cuda::order::Launch;
use crate::cuda::CudaEvent;
use crate::error::{Error, Result};

/// Create this rank's pair communicators (see PairComm): every rank of the group runs
/// every round of `p2p_split_rounds` (ncclCommSplit of the flat communicator is
/// collective), passing as colour its pair's index in the round and as key 0 to send, 1
/// to receive, or NCCL_SPLIT_NOCOLOR when it has no pair in the round. Then warm them up
/// (`warm_pairs`). Returns them, the device memory the splits and the warm-up took, and
/// their names. On failure every pair communicator made is aborted and its stream freed.
///
/// Not bounded by the deadline between rounds: a rank that gave up would leave the
/// others inside the next (blocking) split; as with ncclCommInitRank, a rank that dies
/// during creation leaves its peers there.
pub(super) fn make_pairs(
    flat: &NcclComm,
    dev: &Arc<Device>,
    topo: &Topology,
    cfg: &Config,
    same_host: bool,
    warm: u64,
    bound: Bound,
) -> Result<(Vec<PairComm>, u64, Vec<CString>)> {
    let me = topo.rank;
    let rounds = p2p_split_rounds(&topo.hosts, same_host);
    let _ctx = dev.bind()?;
    let before = free_bytes()?;
    // The streams first: once the splits have started, a rank must not fail alone.
    let mine = rounds.iter().filter(|r| r.iter().any(|&(s, d)| s == me || d == me)).count();
    let mut streams = (0..mine).map(|_| Stream::non_blocking(dev, "cuStreamCreate")).collect::<Result<Vec<Stream>>>()?.into_iter();
    let mut pairs: Vec<PairComm> = Vec::with_capacity(mine);
    let mut names = Vec::with_capacity(mine);
    let mut made = || -> Result<()> {
        for round in &rounds {
            let slot = round.iter().position(|&(s, d)| s == me || d == me);
            let (sending, peer) = match slot.map(|i| round[i]) {
                Some((s, d)) => (s == me, if s == me { d } else { s }),
                None => (false, 0),
            };
            let name = CString::new(match slot {
                Some(_) if sending => format!("rsccl-p2p-r{me}-to-r{peer}"),
                Some(_) => format!("rsccl-p2p-r{peer}-to-r{me}"),
                None => "rsccl-p2p-none".to_string(),
            })
            .map_err(|_| Error::Internal("NUL in a name".into()))?;
            let comm = flat.split(slot, if sending { 0 } else { 1 }, 2, cfg.nccl_p2p_max_ctas, &name)?;
            match (comm, slot) {
                (Some(comm), Some(_)) => {
                    // One stream was made per round with a slot for this rank.
                    let Some(stream) = streams.next() else {
                        comm.abort();
                        return Err(Error::Internal("a pair communicator without its stream".into()));
                    };
                    pairs.push(PairComm { peer, sending, comm, stream });
                    names.push(name);
                }
                (None, None) => {}
                (Some(comm), None) => {
                    comm.abort();
                    return Err(Error::Internal("ncclCommSplit made a communicator for NCCL_SPLIT_NOCOLOR".into()));
                }
                (None, Some(_)) => {
                    return Err(Error::Internal(format!("ncclCommSplit made no communicator for rank {me} and rank {peer}")))
                }
            }
        }
        warm_pairs(dev, &pairs, warm, bound)
    };
    let result = made();
    if let Err(e) = result {
        for p in &pairs {
            p.comm.abort();
        }
        // The aborts ended the pairs' kernels: their streams drain, then go with `pairs`
        // (the streams not handed to a pair have nothing queued).
        for p in &pairs {
            p.stream.synchronize();
        }
        return Err(e);
    }
    let bytes = before.saturating_sub(free_bytes()?);
    Ok((pairs, bytes, names))
}

/// One small and one larger message on every pair communicator, sent or received on its
/// stream, all in one NCCL group (NCCL connects the communicators of one group in
/// parallel, one thread each, so no pair waits for another's connection), then wait for
/// every stream (at most until the deadline, watching each communicator's asynchronous
/// error and the local ranks: `bound`). NCCL connects a peer and allocates its buffers at the first send/recv; this
/// moves that to group creation. The sends read the start of `warm`, the receives all
/// land at PAIR_WARM_RECV_AT (what they write is never read). On failure the caller
/// aborts the pairs.
fn warm_pairs(dev: &Arc<Device>, pairs: &[PairComm], warm: u64, bound: Bound) -> Result<()> {
    let Some(first) = pairs.first() else { return Ok(()) };
    let f = first.comm.fns();
    let u8_ = nc::ncclDataType_t::ncclUint8;
    let r = f.group(|first_error| {
        for p in pairs {
            let raw = p.comm.raw();
            let s = p.stream.raw() as nc::cudaStream_t;
            for n in PAIR_WARM_BYTES {
                // SAFETY: live communicators and streams of this device; every message lies
                // inside the warm buffer (WARM_BYTES: sends at its start, receives at
                // PAIR_WARM_RECV_AT, PAIR_WARM_BYTES at most 1 MiB each).
                first_error.keep(unsafe {
                    if p.sending {
                        (f.send)(warm as *const c_void, n, u8_, 1, raw, s)
                    } else {
                        (f.recv)((warm + PAIR_WARM_RECV_AT) as *mut c_void, n, u8_, 0, raw, s)
                    }
                });
            }
        }
    });
    first.comm.check(r, "NCCL send/recv (warm-up of the pair communicators at group creation)")?;
    let mut events = Vec::with_capacity(pairs.len());
    let mut result = Ok(());
    for p in pairs {
        match Event::new(dev) {
            Ok(ev) => {
                // SAFETY: valid event and stream.
                let recorded = check(unsafe { cu::cuEventRecord(ev.raw(), p.stream.raw()) }, "cuEventRecord");
                events.push(ev);
                if let Err(e) = recorded {
                    result = Err(e);
                    break;
                }
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    'wait: while result.is_ok() {
        let mut pending = false;
        for ev in &events {
            // SAFETY: valid event.
            match unsafe { cu::cuEventQuery(ev.raw()) } {
                cu::CUresult::CUDA_SUCCESS => {}
                cu::CUresult::CUDA_ERROR_NOT_READY => pending = true,
                e => {
                    result = check(e, "cuEventQuery (NCCL pair warm-up)");
                    break 'wait;
                }
            }
        }
        if !pending {
            break;
        }
        if let Some(e) = pairs.iter().find_map(|p| p.comm.async_error().err()) {
            result = Err(e);
            break;
        }
        if let Err(e) = bound.peers_alive("the warm-up of the NCCL pair communicators (send/recv) at group creation") {
            result = Err(e);
            break;
        }
        if Instant::now() > bound.deadline {
            result = Err(Error::Timeout(
                "the warm-up of the NCCL pair communicators (send/recv) at group creation did not finish within the group \
                 timeout: a rank stopped during creation"
                    .into(),
            ));
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // Dropping `events` destroys them; a pending record is harmless (the caller aborts the
    // pairs).
    result
}

impl NcclEngine {
    /// The NCCL part of launch_p2p: `pair`'s stream waits for the caller's, then one
    /// ncclSend to NCCL rank 1 (or ncclRecv from NCCL rank 0) on it, tracked by the
    /// watchdog, then its end event. An empty message makes no NCCL call (both sides skip
    /// it, as they agree on the size).
    pub(super) fn launch_pair(&self, pair: &PairComm, ptr: u64, bytes: u64, caller: u64, asynchronous: bool) -> Result<Option<CudaEvent>> {
        let sh = &self.sh;
        let _ctx = sh.dev.bind()?;
        let l = Launch::send_recv(caller, pair.stream.raw() as u64, asynchronous);
        // The pair's handle is read (`live()`) under this, so no abort or close frees it
        // meanwhile (Shared::abort_comms).
        let _gate = sh.gate.read();
        let mut o = sh.order.lock();
        o.begin(&l, &sh.stop)?;
        // As in launch_inner: the watchdog ages a send/recv from its start on the GPU.
        let start = sh.track_start(&mut o, l.target)?;
        if bytes > 0 {
            let raw = pair.comm.live()?;
            let f = pair.comm.fns();
            let (u8_, s) = (nc::ncclDataType_t::ncclUint8, l.target as nc::cudaStream_t);
            // SAFETY: `raw` is a live communicator (aborts wait for the gate held shared
            // here, see Shared::abort_comms); `ptr` is a device buffer of `bytes` bytes that
            // the Python layer checked and keeps alive until the end event; `s` is the
            // pair's stream, on the communicator's device.
            let r = unsafe {
                if pair.sending {
                    (f.send)(ptr as *const c_void, bytes as usize, u8_, 1, raw, s)
                } else {
                    (f.recv)(ptr as *mut c_void, bytes as usize, u8_, 0, raw, s)
                }
            };
            let what = if pair.sending { format!("NCCL send to rank {}", pair.peer) } else { format!("NCCL recv from rank {}", pair.peer) };
            pair.comm.check(r, &what)?;
        }
        self.p2p_messages.fetch_add(1, Ordering::Relaxed);
        let kind = if pair.sending { Kind::Send } else { Kind::Recv };
        o.end(&l, |o| sh.track_end(o, start, l.target, (kind, bytes, Some(pair.peer))))
    }
}
