//! CUDA graphs that hold this group's kernels keep what those kernels use alive: a graph
//! captured with an rsccl collective may be replayed after destroy_process_group, or still
//! run on a user's stream while the group shuts down. Without this its kernels would touch
//! an unmapped pool and an unloaded module (an illegal address, which ends the CUDA
//! context). With it the memory, the modules and the status page live until the last graph
//! that uses them is destroyed, and a replay after the group's destroy stops at its entry
//! with a message (NOTE [Kernel entry], POISON_DESTROYED) instead of computing.
//!
//! How: each launch captured into a graph gives that graph a CUDA user object owning an
//! `Arc` of each (cuUserObjectCreate, cuGraphRetainUserObject with the reference moved).
//! The driver calls the destructor when the graph (and every executable instance made from
//! it) is destroyed, on a thread of its own where no CUDA call is allowed; dropping the
//! last `Arc` of the pool makes CUDA calls, so the destructor only hands the references to
//! a thread of rsccl's (`releaser`) that drops them.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys as cu;
use parking_lot::Mutex;

use super::status::Shared;
use super::CudaEngine;
use crate::cuda::driver::check;
use crate::cuda::kernels::Kernels;
use crate::error::Result;
use crate::memory::device_pool::SymmetricPool;

/// What a graph's kernels use, held for as long as the graph lives.
struct GraphKeep {
    _pool: Arc<SymmetricPool>,
    _kernels: Arc<Kernels>,
    _sh: Arc<Shared>,
}

/// The thread that drops what destroyed graphs held (started at the first capture).
fn releaser() -> &'static Mutex<Sender<Box<GraphKeep>>> {
    static TX: OnceLock<Mutex<Sender<Box<GraphKeep>>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = channel::<Box<GraphKeep>>();
        let spawned = std::thread::Builder::new().name("rsccl-graph-release".into()).spawn(move || {
            for keep in rx {
                drop(keep);
            }
        });
        if let Err(e) = spawned {
            // Without the thread the references are never dropped: memory kept, not freed
            // under a kernel.
            tracing::warn!("rsccl: could not start the thread that releases CUDA graphs' references ({e}); they are kept");
        }
        Mutex::new(tx)
    })
}

/// The user object's destructor (a driver thread; no CUDA call here).
unsafe extern "C" fn release_keep(p: *mut std::ffi::c_void) {
    // SAFETY: `p` is the Box::into_raw of `keep_for_graph`, handed to exactly one user object
    // whose one reference the graph owns: the driver calls this once.
    let keep = unsafe { Box::from_raw(p as *mut GraphKeep) };
    if let Err(back) = releaser().lock().send(keep) {
        // The releaser is gone (process exit): keep the memory rather than make CUDA
        // calls on this thread.
        std::mem::forget(back.0);
    }
}

impl CudaEngine {
    /// After a launch on `stream`: if the stream is being captured into a graph, the graph
    /// takes a reference to the pool, the kernels and the status page (see the module doc).
    pub(super) fn keep_for_graph(&self, stream: u64) -> Result<()> {
        let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut graph: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; the optional outputs are null; querying the
        // capture of a stream is legal during its capture.
        check(
            unsafe {
                cu::cuStreamGetCaptureInfo_v3(
                    stream as cu::CUstream,
                    &mut status,
                    std::ptr::null_mut(),
                    &mut graph,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            },
            "cuStreamGetCaptureInfo",
        )?;
        if status != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null() {
            return Ok(());
        }
        let keep =
            Box::into_raw(Box::new(GraphKeep { _pool: Arc::clone(&self.pool), _kernels: Arc::clone(&self.kernels), _sh: self.sh.clone() }));
        let mut obj: cu::CUuserObject = std::ptr::null_mut();
        // SAFETY: `keep` is a live Box pointer that the object owns from here on (freed by
        // `release_keep`, which the driver calls when the object's last reference goes);
        // the flag is the one the API requires.
        let made = check(
            unsafe {
                cu::cuUserObjectCreate(
                    &mut obj,
                    keep as *mut std::ffi::c_void,
                    Some(release_keep),
                    1,
                    cu::CUuserObject_flags_enum::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32,
                )
            },
            "cuUserObjectCreate",
        );
        if let Err(e) = made {
            // SAFETY: the object was not made, so nobody else owns `keep`.
            drop(unsafe { Box::from_raw(keep) });
            return Err(e);
        }
        // SAFETY: `graph` is the capture's graph (alive during capture); the one reference
        // `obj` was made with moves to it.
        let r = check(
            unsafe { cu::cuGraphRetainUserObject(graph, obj, 1, cu::CUuserObjectRetain_flags_enum::CU_GRAPH_USER_OBJECT_MOVE as u32) },
            "cuGraphRetainUserObject",
        );
        if r.is_err() {
            // SAFETY: the reference was not moved: ours to release (the destructor runs).
            unsafe { cu::cuUserObjectRelease(obj, 1) };
        }
        r
    }
}
