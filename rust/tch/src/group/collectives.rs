//! The collectives and send/recv of `ProcessGroup` on `tch::Tensor`s: each checks its
//! tensors, builds one plan and hands it to the host or CUDA seam of group/mod.rs.

use rsccl_core::collective::{validate, Collective, Kind};
use rsccl_core::cuda::{AllToAll, CudaKind};
use rsccl_core::dtype::{DType, ReduceOp};
use rsccl_core::engine::P2p;
use rsccl_core::{Error, Result};
use tch::Tensor;

use super::*;

impl ProcessGroup {
    /// Reduce `t` across ranks in place with `op`.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_impl(t, op, true)?.wait()
    }

    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        self.all_reduce_impl(t, op, false)
    }

    fn all_reduce_impl(&self, t: &Tensor, op: ReduceOp, blocking: bool) -> Result<Work> {
        let me = self.rank();
        match tensor::place_of(&[t]) {
            Place::Cpu => self.host(Kind::AllReduce, blocking, || {
                let a = check(t, "all_reduce tensor", me)?;
                let c = tensor::contiguous(t, "all_reduce")?;
                let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
                Ok(op_plan(Collective::AllReduce { buf: tensor::buf(&c, a.dtype), dtype: a.dtype, op }, vec![t.shallow_clone(), c], post))
            }),
            Place::Cuda(d) => {
                self.refuse_unrunnable(t, Kind::AllReduce, op, d)?;
                self.cuda_coll(d, blocking, || {
                    let a = self.cuda_arg(t, "all_reduce tensor", Some((Kind::AllReduce, op)))?;
                    let c = tensor::contiguous(t, "all_reduce")?;
                    let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
                    let p = tensor::ptr(&c);
                    Ok(op_plan(
                        Self::cuda_call(CudaKind::AllReduce, a.dtype, op, 0, p, p, c.numel() as u64),
                        vec![t.shallow_clone(), c],
                        post,
                    ))
                })
            }
        }
    }

    /// Copy `root`'s `t` into every rank's `t`.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        self.broadcast_impl(t, root, true)?.wait()
    }

    pub fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Work> {
        self.broadcast_impl(t, root, false)
    }

    fn broadcast_impl(&self, t: &Tensor, root: usize, blocking: bool) -> Result<Work> {
        let me = self.rank();
        match tensor::place_of(&[t]) {
            Place::Cpu => self.host(Kind::Broadcast, blocking, || {
                let a = check(t, "broadcast tensor", me)?;
                let c = tensor::contiguous(t, "broadcast")?;
                let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
                Ok(op_plan(Collective::Broadcast { buf: tensor::buf(&c, a.dtype), dtype: a.dtype, root }, vec![t.shallow_clone(), c], post))
            }),
            Place::Cuda(d) => self.cuda_coll(d, blocking, || {
                let a = self.cuda_arg(t, "broadcast tensor", None)?;
                self.check_root(root, "broadcast")?;
                let c = tensor::contiguous(t, "broadcast")?;
                let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
                let p = tensor::ptr(&c);
                let bytes = tensor::nbytes(&c, a.dtype) as u64;
                Ok(op_plan(
                    Self::cuda_call(CudaKind::Broadcast, DType::U8, ReduceOp::Sum, root, p, p, bytes),
                    vec![t.shallow_clone(), c],
                    post,
                ))
            }),
        }
    }

    /// Every rank's `input`, in rank order, into `output` (group size x input's elements).
    pub fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.all_gather_impl(output, input, None, true)?.wait()
    }

    pub fn all_gather_into_tensor_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        self.all_gather_impl(output, input, None, false)
    }

    /// Every rank's `input` into `outputs[rank]` (one tensor per rank, each like `input`).
    pub fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<()> {
        self.all_gather_list(outputs, input, true)?.wait()
    }

    pub fn all_gather_async(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        self.all_gather_list(outputs, input, false)
    }

    fn all_gather_list(&self, outputs: &[Tensor], input: &Tensor, blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let checked = (|| {
            let a = check(input, "all_gather input", me)?;
            if outputs.len() != n {
                return Err(Error::InvalidArgument(format!("all_gather: rank {me} passed {} outputs for a group of {n}", outputs.len())));
            }
            for (i, o) in outputs.iter().enumerate() {
                let b = check(o, "all_gather output", me)?;
                if b.dtype != a.dtype || o.numel() != input.numel() || b.place != a.place {
                    return Err(Error::InvalidArgument(format!(
                        "all_gather: rank {me} passed outputs[{i}] {}[{}] on {:?} for input {}[{}] on {:?}",
                        b.dtype.name(),
                        o.numel(),
                        o.device(),
                        a.dtype.name(),
                        input.numel(),
                        input.device()
                    )));
                }
            }
            let flat =
                Tensor::f_empty([(n * input.numel()) as i64], (a.kind, input.device())).map_err(|e| tensor::torch_err("all_gather", e))?;
            let post = CopyBack::split(&flat, outputs)?;
            Ok((flat, post))
        })();
        match checked {
            Ok((flat, post)) => self.all_gather_impl(&flat, input, Some(post), blocking),
            Err(e) => match tensor::place_of(&[input]) {
                Place::Cpu => self.host(Kind::AllGather, blocking, || Err(e)),
                Place::Cuda(d) => Err(self.cuda_failed(d, e)),
            },
        }
    }

    fn all_gather_impl(&self, output: &Tensor, input: &Tensor, extra: Option<CopyBack>, blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let pair = |cuda: bool| {
            self.in_out("all_gather", input, output, cuda, None, || {
                validate::blocks_per_rank("all_gather", n, 1, ("output", output.numel() as u64), ("input", input.numel() as u64))
                    .map_err(|e| e.naming_rank(me))
            })
        };
        match tensor::place_of(&[input]) {
            Place::Cpu => self.host(Kind::AllGather, blocking, || {
                let InOut { arg: a, inp: i, out: o, post } = pair(false)?;
                let c = Collective::AllGather { input: tensor::buf(&i, a.dtype), output: tensor::buf(&o, a.dtype), dtype: a.dtype };
                Ok(op_plan(c, vec![input.shallow_clone(), output.shallow_clone(), i, o], CopyBack::chain(post, extra)))
            }),
            Place::Cuda(d) => self.cuda_coll(d, blocking, || {
                let InOut { arg: a, inp: i, out: o, post } = pair(true)?;
                let bytes = tensor::nbytes(&i, a.dtype) as u64;
                let l = Self::cuda_call(CudaKind::AllGather, DType::U8, ReduceOp::Sum, 0, tensor::ptr(&i), tensor::ptr(&o), bytes);
                Ok(op_plan(l, vec![input.shallow_clone(), output.shallow_clone(), i, o], CopyBack::chain(post, extra)))
            }),
        }
    }

    /// Reduce `input` (group size x output's elements) across ranks with `op`; rank r
    /// gets block r in `output`.
    pub fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_impl(output, input, op, true)?.wait()
    }

    pub fn reduce_scatter_tensor_async(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        self.reduce_scatter_impl(output, input, op, false)
    }

    /// Reduce `inputs[r]` across ranks with `op` into rank r's `output`.
    pub fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_list(output, inputs, op, true)?.wait()
    }

    pub fn reduce_scatter_async(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        self.reduce_scatter_list(output, inputs, op, false)
    }

    fn reduce_scatter_list(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp, blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let checked = (|| {
            let a = check(output, "reduce_scatter output", me)?;
            if inputs.len() != n {
                return Err(Error::InvalidArgument(format!("reduce_scatter: rank {me} passed {} inputs for a group of {n}", inputs.len())));
            }
            for (i, t) in inputs.iter().enumerate() {
                let b = check(t, "reduce_scatter input", me)?;
                if b.dtype != a.dtype || t.numel() != output.numel() || b.place != a.place {
                    return Err(Error::InvalidArgument(format!(
                        "reduce_scatter: rank {me} passed inputs[{i}] {}[{}] on {:?} for output {}[{}] on {:?}",
                        b.dtype.name(),
                        t.numel(),
                        t.device(),
                        a.dtype.name(),
                        output.numel(),
                        output.device()
                    )));
                }
            }
            tensor::flat_cat(inputs, "reduce_scatter")
        })();
        match checked {
            Ok(flat) => self.reduce_scatter_impl(output, &flat, op, blocking),
            Err(e) => match tensor::place_of(&[output]) {
                Place::Cpu => self.host(Kind::ReduceScatter, blocking, || Err(e)),
                Place::Cuda(d) => Err(self.cuda_failed(d, e)),
            },
        }
    }

    fn reduce_scatter_impl(&self, output: &Tensor, input: &Tensor, op: ReduceOp, blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let pair = |cuda: bool| {
            self.in_out("reduce_scatter", input, output, cuda, Some((Kind::ReduceScatter, op)), || {
                validate::blocks_per_rank("reduce_scatter", n, 1, ("input", input.numel() as u64), ("output", output.numel() as u64))
                    .map_err(|e| e.naming_rank(me))
            })
        };
        match tensor::place_of(&[input]) {
            Place::Cpu => self.host(Kind::ReduceScatter, blocking, || {
                let InOut { arg: a, inp: i, out: o, post } = pair(false)?;
                let c = Collective::ReduceScatter { input: tensor::buf(&i, a.dtype), output: tensor::buf(&o, a.dtype), dtype: a.dtype, op };
                Ok(op_plan(c, vec![input.shallow_clone(), output.shallow_clone(), i, o], post))
            }),
            Place::Cuda(d) => {
                self.refuse_unrunnable(input, Kind::ReduceScatter, op, d)?;
                self.cuda_coll(d, blocking, || {
                    let InOut { arg: a, inp: i, out: o, post } = pair(true)?;
                    let l = Self::cuda_call(CudaKind::ReduceScatter, a.dtype, op, 0, tensor::ptr(&i), tensor::ptr(&o), o.numel() as u64);
                    Ok(op_plan(l, vec![input.shallow_clone(), output.shallow_clone(), i, o], post))
                })
            }
        }
    }

    /// Rows (dim 0) of `input` to every rank: `input_splits[r]` rows to rank r, and
    /// `output_splits[r]` rows from rank r into `output` (empty splits: equal parts).
    pub fn all_to_all_single(&self, output: &Tensor, input: &Tensor, output_splits: &[i64], input_splits: &[i64]) -> Result<()> {
        self.all_to_all_single_impl(output, input, output_splits, input_splits, None, true)?.wait()
    }

    pub fn all_to_all_single_async(&self, output: &Tensor, input: &Tensor, output_splits: &[i64], input_splits: &[i64]) -> Result<Work> {
        self.all_to_all_single_impl(output, input, output_splits, input_splits, None, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn all_to_all_single_impl(
        &self,
        output: &Tensor,
        input: &Tensor,
        out_splits: &[i64],
        in_splits: &[i64],
        extra: Option<CopyBack>,
        blocking: bool,
    ) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let prep = |cuda: bool| -> Result<(InOut, Vec<u64>, Vec<u64>)> {
            let mut splits = None;
            let st = self.in_out("all_to_all", input, output, cuda, None, || {
                let dtype = tensor::dtype_of_kind(input.f_kind().map_err(|e| tensor::torch_err("all_to_all", e))?).unwrap_or(DType::U8);
                let send = tensor::split_bytes(input, dtype, in_splits, n, &format!("all_to_all: rank {me}'s input"))?;
                let recv = tensor::split_bytes(output, dtype, out_splits, n, &format!("all_to_all: rank {me}'s output"))?;
                splits = Some((send, recv));
                Ok(())
            })?;
            let (send, recv) = splits.expect("set by the size check");
            Ok((st, send, recv))
        };
        match tensor::place_of(&[input]) {
            Place::Cpu => self.host(Kind::AllToAll, blocking, || {
                let (InOut { arg: a, inp: i, out: o, post }, send, recv) = prep(false)?;
                let c = Collective::AllToAll {
                    input: tensor::buf(&i, a.dtype),
                    output: tensor::buf(&o, a.dtype),
                    dtype: a.dtype,
                    send_bytes: send,
                    recv_bytes: recv,
                };
                Ok(op_plan(c, vec![input.shallow_clone(), output.shallow_clone(), i, o], CopyBack::chain(post, extra)))
            }),
            Place::Cuda(d) => self.cuda_coll(d, blocking, || {
                let (InOut { inp: i, out: o, post, .. }, send, recv) = prep(true)?;
                if send[me] != recv[me] {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_all: rank {me} sends itself {} bytes but expects {} bytes from itself",
                        send[me], recv[me]
                    )));
                }
                let (ip, op) = (tensor::ptr(&i), tensor::ptr(&o));
                let x = AllToAll {
                    send: tensor::offsets(&send).iter().map(|x| ip + x).collect(),
                    send_bytes: send,
                    recv: tensor::offsets(&recv).iter().map(|x| op + x).collect(),
                    recv_bytes: recv,
                };
                Ok(op_plan(
                    DeviceCall::AllToAll { chunks: x, stream: 0, asynchronous: false },
                    vec![input.shallow_clone(), output.shallow_clone(), i, o],
                    CopyBack::chain(post, extra),
                ))
            }),
        }
    }

    /// `inputs[r]` to rank r; rank r's tensor for this rank into `outputs[r]` (one dtype).
    pub fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor]) -> Result<()> {
        self.all_to_all_impl(outputs, inputs, true)?.wait()
    }

    pub fn all_to_all_async(&self, outputs: &[Tensor], inputs: &[Tensor]) -> Result<Work> {
        self.all_to_all_impl(outputs, inputs, false)
    }

    fn all_to_all_impl(&self, outputs: &[Tensor], inputs: &[Tensor], blocking: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let first: Vec<&Tensor> = inputs.iter().chain(outputs).collect();
        let place = tensor::place_of(&first);
        let cuda = matches!(place, Place::Cuda(_));
        // One flat input and output; splits of one row per element (1-D views).
        let prep = || -> Result<(Tensor, Tensor, Splits, CopyBack)> {
            if outputs.len() != n || inputs.len() != n {
                return Err(Error::InvalidArgument(format!(
                    "all_to_all: rank {me} passed {} inputs and {} outputs; expected group size {n} of each",
                    inputs.len(),
                    outputs.len()
                )));
            }
            let mut dtype = None;
            for t in inputs.iter().chain(outputs) {
                let a = if cuda { self.cuda_arg(t, "all_to_all tensor", None)? } else { check(t, "all_to_all tensor", me)? };
                if a.place != Place::Cpu && !cuda || dtype.is_some_and(|d| d != a.kind) {
                    return Err(Error::InvalidType(format!(
                        "all_to_all: rank {me} passed tensors of several dtypes or devices; give one of each"
                    )));
                }
                dtype = Some(a.kind);
            }
            let kind = dtype.unwrap_or(tch::Kind::Float);
            let device = inputs.first().map(|t| t.device()).unwrap_or(tch::Device::Cpu);
            let flat_in = tensor::flat_cat(inputs, "all_to_all")?;
            let total: usize = outputs.iter().map(|t| t.numel()).sum();
            let flat_out = Tensor::f_empty([total as i64], (kind, device)).map_err(|e| tensor::torch_err("all_to_all", e))?;
            let post = CopyBack::split(&flat_out, outputs)?;
            let splits = Splits {
                output: outputs.iter().map(|t| t.numel() as i64).collect(),
                input: inputs.iter().map(|t| t.numel() as i64).collect(),
            };
            Ok((flat_in, flat_out, splits, post))
        };
        match prep() {
            Ok((fi, fo, sp, post)) => self.all_to_all_single_impl(&fo, &fi, &sp.output, &sp.input, Some(post), blocking),
            Err(e) => match place {
                Place::Cpu => self.host(Kind::AllToAll, blocking, || Err(e)),
                Place::Cuda(d) => Err(self.cuda_failed(d, e)),
            },
        }
    }

    /// Block until every rank got here (with a CUDA engine: and every rank's GPU work
    /// queued on its current stream before it finished, as NCCL's barrier).
    pub fn barrier(&self) -> Result<()> {
        if let Some(d) = self.inner.cuda_device {
            // The barrier kernel runs after the current stream's earlier work; its end event
            // completing means both are done. synchronize() is bounded by the group timeout.
            let stream = crate::cuda::current_stream(d)?;
            if let Ran::Event(ev) =
                self.inner.group.run_device(DeviceCall::Collective(CudaCall::bare(CudaKind::Barrier, 0, stream, true)))?
            {
                ev.wait_on(stream)?;
                ev.synchronize()?;
            }
            return self.inner.group.cuda_health();
        }
        self.host(Kind::Barrier, true, || Ok(op_plan(Collective::Barrier, vec![], None)))?.wait()
    }

    /// With a CUDA engine this is `barrier()` (it waits on the CPU, as NCCL's does).
    pub fn barrier_async(&self) -> Result<Work> {
        if self.inner.cuda_device.is_some() {
            self.barrier()?;
            return Ok(Work::done());
        }
        self.host(Kind::Barrier, false, || Ok(op_plan(Collective::Barrier, vec![], None)))
    }

    /// Send `t` to group rank `dst` (matched with its `recv` of the same size; on CPU also
    /// by `tag`; CUDA ignores the tag, as NCCL does: messages between two ranks match in order).
    pub fn send(&self, t: &Tensor, dst: usize, tag: i64) -> Result<()> {
        self.p2p(t, dst, tag, true)?.wait()
    }

    pub fn send_async(&self, t: &Tensor, dst: usize, tag: i64) -> Result<Work> {
        self.p2p(t, dst, tag, true)
    }

    /// Receive into `t` from group rank `src`.
    pub fn recv(&self, t: &Tensor, src: usize, tag: i64) -> Result<()> {
        self.p2p(t, src, tag, false)?.wait()
    }

    pub fn recv_async(&self, t: &Tensor, src: usize, tag: i64) -> Result<Work> {
        self.p2p(t, src, tag, false)
    }

    /// Always asynchronous underneath: the blocking forms wait on the Work.
    fn p2p(&self, t: &Tensor, peer: usize, tag: i64, send: bool) -> Result<Work> {
        let (me, n) = (self.rank(), self.size());
        let what = if send { "send" } else { "recv" };
        let a = check(t, &format!("{what} tensor"), me)?;
        validate::peer(what, me, peer as i64, n)?;
        let (c, post) = if send { (tensor::contiguous(t, what)?, None) } else { tensor::output(t, what)? };
        match a.place {
            Place::Cpu => {
                if self.inner.group.kind == EngineKind::Gloo {
                    return Err(Error::InvalidArgument(format!(
                        "{what}: rank {me}: CPU send/recv in a group that spans hosts is not supported by rsccl-tch; use CUDA tensors"
                    )));
                }
                let buf = tensor::buf(&c, a.dtype);
                let op = if send { P2p::Send { buf, dtype: a.dtype, peer, tag } } else { P2p::Recv { buf, dtype: a.dtype, peer, tag } };
                let state = self.inner.group.submit_p2p(op, None)?;
                Ok(Work::host(state, vec![t.shallow_clone(), c], post))
            }
            Place::Cuda(d) => {
                self.cuda_arg(t, &format!("{what} tensor"), None)?;
                let (ptr, bytes) = (tensor::ptr(&c), tensor::nbytes(&c, a.dtype) as u64);
                self.cuda(
                    d,
                    false,
                    op_plan(DeviceCall::P2p { send, ptr, bytes, peer, stream: 0, asynchronous: false }, vec![t.shallow_clone(), c], post),
                )
            }
        }
    }
}
