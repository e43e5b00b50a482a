//! The handle of an asynchronous collective. It holds the tensors the operation reads and
//! writes (never marking them on a stream) until the operation can no longer touch them:
//! - CPU (host engine): until the engine completed it. A Work dropped unwaited hands its
//!   tensors to the completion, which releases them then.
//! - CUDA: until a stream the caching allocator reuses their memory on is ordered after
//!   the collective: `wait` makes libtorch's current stream (and the launch stream) wait
//!   on the collective's end event. A Work dropped unwaited parks its tensors in the
//!   group's pending list until its event completed (see `Inner::release_finished`).

use std::sync::Arc;

use rsccl_core::cuda::CudaEvent;
use rsccl_core::work::WorkState;
use rsccl_core::Result;
use tch::Tensor;

use crate::group::Inner;
use crate::tensor::CopyBack;

enum State {
    Done,
    Host { state: Arc<WorkState>, keep: Vec<Tensor>, post: Option<CopyBack> },
    Cuda { pg: Arc<Inner>, event: CudaEvent, device: i32, stream: u64, keep: Vec<Tensor>, post: Option<CopyBack> },
}

/// An operation in flight. `wait` returns its result; copies into non-contiguous or list
/// outputs are made then, so wait for every Work whose outputs you read.
#[must_use = "an unwaited Work may not have written its outputs yet; call wait()"]
pub struct Work(State);

impl Work {
    pub(crate) fn done() -> Work {
        Work(State::Done)
    }

    pub(crate) fn host(state: Arc<WorkState>, keep: Vec<Tensor>, post: Option<CopyBack>) -> Work {
        Work(State::Host { state, keep, post })
    }

    pub(crate) fn cuda(pg: Arc<Inner>, event: CudaEvent, device: i32, stream: u64, keep: Vec<Tensor>, post: Option<CopyBack>) -> Work {
        Work(State::Cuda { pg, event, device, stream, keep, post })
    }

    /// CPU: block until the operation completed and return its error, if any. CUDA: order
    /// libtorch's current stream after the collective (no CPU wait, as NCCL's Work) and
    /// report an error a kernel has raised so far.
    pub fn wait(mut self) -> Result<()> {
        match std::mem::replace(&mut self.0, State::Done) {
            State::Done => Ok(()),
            State::Host { state, keep, post } => {
                state.wait(None)?;
                if let Some(p) = post {
                    p.run()?;
                }
                drop(keep);
                Ok(())
            }
            State::Cuda { pg, event, device, stream, keep, post } => {
                let current = crate::cuda::current_stream(device)?;
                event.wait_on(current)?;
                if stream != current {
                    // Temporaries made at launch belong to the launch stream: order it too.
                    event.wait_on(stream)?;
                }
                if let Some(p) = post {
                    p.run()?;
                    if stream != current {
                        // The copies just queued on the current stream read launch-stream
                        // temporaries freed below: let them finish first (rare: the caller
                        // changed streams between launch and wait).
                        tch::Cuda::synchronize(device as i64);
                    }
                }
                drop(keep);
                pg.group.cuda_health()
            }
        }
    }

    /// Whether the operation finished (CUDA: on the GPU).
    pub fn is_completed(&self) -> bool {
        match &self.0 {
            State::Done => true,
            State::Host { state, .. } => state.is_completed(),
            State::Cuda { event, .. } => event.query().unwrap_or(true),
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.0, State::Done) {
            State::Done => {}
            State::Host { state, keep, post } => {
                // Released by the completion (on an engine thread: tch tensors are Send).
                state.on_complete(Box::new(move |_| drop((keep, post))));
            }
            State::Cuda { pg, event, keep, post, .. } => pg.park(event, keep, post),
        }
    }
}
