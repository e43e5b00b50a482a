//! The hierarchical algorithms: rsccl's kernels inside each host, NCCL across hosts among
//! the ranks of one local index.
//!
//! `Hierarchical` composes the two: the host-local engine (rsccl's `CudaEngine` over this
//! host's ranks) and the cross communicator (NCCL among the ranks of this local index, one
//! per host), with where this rank sits (`HierLayout`). It decides which calls it takes
//! (`path`, from the pure choices in choice.rs) and enqueues them (`enqueue`) on the
//! stream it is given. The NCCL engine owns both parts (its watchdog follows the cross
//! communicator and the local engine like its other ones) and orders, tracks and bounds
//! a hierarchical launch as any other: `Hierarchical` is a view it makes per call.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::nccl::sys as nc;

use super::choice::{all_gather_path, all_reduce_path, reduce_scatter_path, CrossHost};
use crate::collective::Kind;
use crate::cuda::driver::DeviceBuffer;
use crate::cuda::nccl::{nccl_dtype, nccl_op, NcclComm};
use crate::cuda::{CudaCall, CudaEngine};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// What the hierarchical algorithms need besides their two engines: where this rank sits
/// among the hosts, the threshold, and the reduce_scatter's scratch. Fixed at creation.
pub(super) struct HierLayout {
    pub(super) local_index: usize,
    pub(super) host_index: usize,
    /// See `host_major`: all_gather and reduce_scatter run hierarchically only then.
    pub(super) host_major: bool,
    pub(super) ranks_per_host: Vec<usize>,
    /// nccl_hierarchical_min_bytes.
    pub(super) min_bytes: u64,
    /// The hierarchical reduce_scatter's buffer (None: none) and its bytes.
    pub(super) scratch: Option<DeviceBuffer>,
    pub(super) scratch_bytes: u64,
}

/// The hierarchical path of one group: its host-local engine, its cross communicator and
/// its layout (see the module doc).
pub(super) struct Hierarchical<'a> {
    local: &'a Arc<CudaEngine>,
    cross: &'a NcclComm,
    at: &'a HierLayout,
}

impl<'a> Hierarchical<'a> {
    /// The path of a group that has both engines (None: it runs everything flat).
    pub(super) fn new(local: Option<&'a Arc<CudaEngine>>, cross: Option<&'a NcclComm>, at: &'a HierLayout) -> Option<Hierarchical<'a>> {
        Some(Hierarchical { local: local?, cross: cross?, at })
    }

    /// How `c` runs: hierarchical only where choice.rs says so (every rank decides alike).
    pub(super) fn path(&self, c: &CudaCall) -> CrossHost {
        let (hosts, major, min) = (&self.at.ranks_per_host, self.at.host_major, self.at.min_bytes);
        match c.kind {
            Kind::AllReduce => {
                let ok = self.local.supports_reduce_scatter(c.dtype, c.op);
                all_reduce_path(c.count, c.dtype.size(), c.op, ok, hosts, min).0
            }
            Kind::AllGather => all_gather_path(c.count, hosts, major, min).0,
            Kind::ReduceScatter => {
                let ok = self.local.supports_reduce_scatter(c.dtype, c.op);
                reduce_scatter_path(c.count, c.dtype.size(), c.op, ok, hosts, major, min, self.at.scratch_bytes).0
            }
            _ => CrossHost::Flat,
        }
    }

    /// Enqueue `c`, which `path` chose hierarchical for, on `stream`.
    pub(super) fn enqueue(&self, c: &CudaCall, stream: u64) -> Result<()> {
        match c.kind {
            Kind::AllReduce => self.all_reduce(c, stream),
            Kind::AllGather => self.all_gather(c, stream),
            Kind::ReduceScatter => self.reduce_scatter(c, stream),
            k => Err(Error::Internal(format!("no hierarchical {}", k.name()))),
        }
    }

    /// all_gather (count = n bytes per rank; `out` holds world x n bytes in rank order)
    /// in two phases on `stream`, for host-major ranks (rank r = h * L + l):
    ///   1. across hosts, among the ranks of my local index l (one per host, cross rank =
    ///      host index): one NCCL group of H broadcasts, root h sending its piece, which
    ///      every member receives at its place in `out`, (h * L + l) * n. After it, my
    ///      `out` holds the pieces of local index l of every host. Each rank sends and
    ///      receives only n bytes per host across hosts, as a flat ring would.
    ///   2. inside the host, for every host h: rsccl's all_gather of the piece at
    ///      (h * L + l) * n (in place: it is my slot of host h's block) into host h's
    ///      block `out + h * L * n`, filling the pieces of the other local indices.
    ///
    /// H host-local launches (each with its barrier): hosts >= 2, messages >=
    /// nccl_hierarchical_min_bytes keep their cost small against the bytes moved.
    fn all_gather(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let (local, cross, raw) = (self.local, self.cross, self.cross.live()?);
        let l = local.local_size() as u64;
        let hosts = self.at.ranks_per_host.len() as u64;
        let (me, li, n) = (self.at.host_index as u64, self.at.local_index as u64, c.count);
        let piece = |h: u64| c.out + (h * l + li) * n;
        let fatal =
            |e: Error| if e.keeps_group_usable() { Error::Aborted(format!("a hierarchical all_gather failed part-way: {e}")) } else { e };
        let f = cross.fns();
        let s = stream as nc::cudaStream_t;
        let r = f.group(|first| {
            for h in 0..hosts {
                let dst = piece(h);
                let src = if h == me { c.inp } else { dst };
                // SAFETY: a live communicator (see enqueue_flat); every piece lies inside
                // `out` (world x n bytes: h < H, l < L); `inp` holds n bytes; a live stream.
                // Non-root members ignore the send buffer; the root copies into its own
                // piece (or nothing, when the input already is that piece: in place).
                first.keep(unsafe {
                    (f.broadcast)(src as *const c_void, dst as *mut c_void, n as usize, nc::ncclDataType_t::ncclUint8, h as i32, raw, s)
                });
            }
        });
        cross.check(r, "NCCL broadcast (cross-host phase of a hierarchical all_gather)").map_err(fatal)?;
        for h in 0..hosts {
            let call = CudaCall {
                kind: Kind::AllGather,
                dtype: DType::U8,
                op: c.op,
                root: 0,
                inp: piece(h),
                out: c.out + h * l * n,
                count: n,
                chunks: None,
                stream,
                asynchronous: false,
            };
            local.launch(&call).map_err(fatal)?;
        }
        Ok(())
    }

    /// reduce_scatter (count = m output elements; `inp` holds world x m in rank order) in
    /// two phases on `stream`, for host-major ranks (rank r = h * L + l):
    ///   1. inside the host, for every host h: rsccl's reduce_scatter of host h's block of
    ///      the input (L x m elements at h * L * m) into the scratch at h * m. After it, my
    ///      scratch holds, for every h, the sum over my host's ranks of block h * L + l.
    ///   2. across hosts, among the ranks of my local index l (cross rank = host index):
    ///      NCCL reduce_scatter of the scratch (H x m) into `out` (m): cross rank h gets
    ///      the sum over hosts of their partial sums of block h * L + l, i.e. the sum over
    ///      every rank of my block. Each rank sends and receives (H - 1) x m elements across
    ///      hosts, as a flat ring would.
    ///
    /// The scratch (hosts x m elements, checked by reduce_scatter_path) is reused by the
    /// next call: the launches are ordered (one stream, joins across streams), so that
    /// call's first phase runs after this one's NCCL step read it.
    fn reduce_scatter(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let (local, cross, raw) = (self.local, self.cross, self.cross.live()?);
        let l = local.local_size() as u64;
        let hosts = self.at.ranks_per_host.len() as u64;
        let mb = c.count * c.dtype.size() as u64;
        let scratch = match &self.at.scratch {
            Some(b) if hosts * mb <= self.at.scratch_bytes => b.ptr(),
            _ => return Err(Error::Internal("hierarchical reduce_scatter without room in its scratch".into())),
        };
        let fatal = |e: Error| {
            if e.keeps_group_usable() {
                Error::Aborted(format!("a hierarchical reduce_scatter failed part-way: {e}"))
            } else {
                e
            }
        };
        for h in 0..hosts {
            let call = CudaCall {
                kind: Kind::ReduceScatter,
                dtype: c.dtype,
                op: c.op,
                root: 0,
                inp: c.inp + h * l * mb,
                out: scratch + h * mb,
                count: c.count,
                chunks: None,
                stream,
                asynchronous: false,
            };
            local.launch(&call).map_err(fatal)?;
        }
        let dt = nccl_dtype(c.dtype).ok_or_else(|| Error::Internal("checked dtype".into()))?;
        let op = nccl_op(c.op).ok_or_else(|| Error::Internal("checked op".into()))?;
        // SAFETY: a live communicator (see enqueue_flat); the scratch holds hosts x m
        // elements (checked above), `out` m elements (checked by the Python layer); a live
        // stream.
        let r = unsafe {
            (cross.fns().reduce_scatter)(
                scratch as *const c_void,
                c.out as *mut c_void,
                c.count as usize,
                dt,
                op,
                raw,
                stream as nc::cudaStream_t,
            )
        };
        cross.check(r, "NCCL reduce_scatter (cross-host phase of a hierarchical reduce_scatter)").map_err(fatal)
    }

    /// all_reduce in three phases on `stream`: rsccl's reduce-scatter over the host's
    /// GPUs into this rank's shard of `out`, NCCL all_reduce of that shard (in place)
    /// among the ranks of the same local index on every host, rsccl's all-gather of the
    /// shards into `out`. The local engine orders its kernels after what `stream` holds
    /// and `stream` after them (a blocking call to it), so the phases run in order.
    fn all_reduce(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let (local, cross) = (self.local, self.cross);
        let l = local.local_size() as u64;
        let shard = c.count / l;
        let shard_bytes = shard * c.dtype.size() as u64;
        let mine = c.out + self.at.local_index as u64 * shard_bytes;
        let call = |kind, dtype, inp, out, count| CudaCall {
            kind,
            dtype,
            op: c.op,
            root: 0,
            inp,
            out,
            count,
            chunks: None,
            stream,
            asynchronous: false,
        };
        // Any error once a phase may have started leaves the peers of the other phases
        // waiting: it makes the group unusable (the caller aborts it).
        let fatal =
            |e: Error| if e.keeps_group_usable() { Error::Aborted(format!("a hierarchical all_reduce failed part-way: {e}")) } else { e };
        local.launch(&call(Kind::ReduceScatter, c.dtype, c.inp, mine, shard)).map_err(fatal)?;
        let raw = cross.live()?;
        let dt = nccl_dtype(c.dtype).ok_or_else(|| Error::Internal("checked dtype".into()))?;
        let op = nccl_op(c.op).ok_or_else(|| Error::Internal("checked op".into()))?;
        // SAFETY: a live communicator (see enqueue_flat); `mine` is this rank's shard of
        // `out` (shard elements, inside the count the caller checked); a live stream.
        let r = unsafe {
            (cross.fns().all_reduce)(mine as *const c_void, mine as *mut c_void, shard as usize, dt, op, raw, stream as nc::cudaStream_t)
        };
        cross.check(r, "NCCL all_reduce (cross-host phase of a hierarchical all_reduce)")?;
        local.launch(&call(Kind::AllGather, DType::U8, mine, c.out, shard_bytes)).map_err(fatal)?;
        Ok(())
    }
}
