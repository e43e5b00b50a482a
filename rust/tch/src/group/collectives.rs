//! The collectives and send/recv of `ProcessGroup` on `tch::Tensor`s: each checks its
//! tensors and builds one `Op` (a `Plan`), which the seam of group/mod.rs runs through
//! `Group::run`. Sizes, roots, peers and what the engine reduces are checked by the core.

use rsccl_core::collective::op::{Chunks, Op, Place as OpPlace, Span};
use rsccl_core::collective::Kind;
use rsccl_core::dtype::{DType, ReduceOp};
use rsccl_core::{Error, Result};
use tch::Tensor;

use super::*;

/// A `kind` op with this call's fields still to fill in; the seam sets its place.
fn op(kind: Kind) -> Op {
    Op::new(kind, OpPlace::Host)
}

/// A root or peer as the op carries it (an index past i64 is out of range there too).
fn rank_arg(r: usize) -> i64 {
    i64::try_from(r).unwrap_or(i64::MAX)
}

impl ProcessGroup {
    /// Reduce `t` across ranks in place with `op`.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_impl(t, op, true)?.wait()
    }

    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        self.all_reduce_impl(t, op, false)
    }

    fn all_reduce_impl(&self, t: &Tensor, op_: ReduceOp, blocking: bool) -> Result<Work> {
        let place = tensor::place_of(&[t]);
        self.run(Kind::AllReduce, place, blocking, || {
            let a = self.arg(t, "all_reduce tensor", place)?;
            let (c, post) = tensor::in_place(t, "all_reduce")?;
            let s = tensor::span(&c, a.dtype);
            Ok(Plan::new(Op { inp: s, out: s, dtype: a.dtype, op: op_, ..op(Kind::AllReduce) }, vec![t.shallow_clone(), c], post))
        })
    }

    /// Copy `root`'s `t` into every rank's `t`.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        self.broadcast_impl(t, root, true)?.wait()
    }

    pub fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Work> {
        self.broadcast_impl(t, root, false)
    }

    fn broadcast_impl(&self, t: &Tensor, root: usize, blocking: bool) -> Result<Work> {
        let place = tensor::place_of(&[t]);
        self.run(Kind::Broadcast, place, blocking, || {
            let a = self.arg(t, "broadcast tensor", place)?;
            let (c, post) = tensor::in_place(t, "broadcast")?;
            let s = tensor::span(&c, a.dtype);
            let root = rank_arg(root);
            Ok(Plan::new(Op { inp: s, out: s, dtype: a.dtype, root, ..op(Kind::Broadcast) }, vec![t.shallow_clone(), c], post))
        })
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
            Err(e) => self.run(Kind::AllGather, tensor::place_of(&[input]), blocking, || Err(e)),
        }
    }

    fn all_gather_impl(&self, output: &Tensor, input: &Tensor, extra: Option<CopyBack>, blocking: bool) -> Result<Work> {
        let place = tensor::place_of(&[input]);
        self.run(Kind::AllGather, place, blocking, || {
            let InOut { arg: a, inp: i, out: o, post } = self.in_out("all_gather", input, output, place)?;
            let (inp, out) = (tensor::span(&i, a.dtype), tensor::span(&o, a.dtype));
            let keep = vec![input.shallow_clone(), output.shallow_clone(), i, o];
            Ok(Plan::new(Op { inp, out, dtype: a.dtype, ..op(Kind::AllGather) }, keep, CopyBack::chain(post, extra)))
        })
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
            Err(e) => self.run(Kind::ReduceScatter, tensor::place_of(&[output]), blocking, || Err(e)),
        }
    }

    fn reduce_scatter_impl(&self, output: &Tensor, input: &Tensor, op_: ReduceOp, blocking: bool) -> Result<Work> {
        let place = tensor::place_of(&[input]);
        self.run(Kind::ReduceScatter, place, blocking, || {
            let InOut { arg: a, inp: i, out: o, post } = self.in_out("reduce_scatter", input, output, place)?;
            let (inp, out) = (tensor::span(&i, a.dtype), tensor::span(&o, a.dtype));
            let keep = vec![input.shallow_clone(), output.shallow_clone(), i, o];
            Ok(Plan::new(Op { inp, out, dtype: a.dtype, op: op_, ..op(Kind::ReduceScatter) }, keep, post))
        })
    }

    /// Rows (dim 0) of `input` to every rank: `input_splits[r]` rows to rank r, and
    /// `output_splits[r]` rows from rank r into `output` (empty splits: equal parts).
    pub fn all_to_all_single(&self, output: &Tensor, input: &Tensor, output_splits: &[i64], input_splits: &[i64]) -> Result<()> {
        self.all_to_all_single_impl(output, input, output_splits, input_splits, None, true)?.wait()
    }

    pub fn all_to_all_single_async(&self, output: &Tensor, input: &Tensor, output_splits: &[i64], input_splits: &[i64]) -> Result<Work> {
        self.all_to_all_single_impl(output, input, output_splits, input_splits, None, false)
    }

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
        let place = tensor::place_of(&[input]);
        self.run(Kind::AllToAll, place, blocking, || {
            let dtype = tensor::dtype_of_kind(input.f_kind().map_err(|e| tensor::torch_err("all_to_all", e))?).unwrap_or(DType::U8);
            let InOut { arg: a, inp: i, out: o, post } = self.in_out("all_to_all", input, output, place)?;
            let send = tensor::split_bytes(input, dtype, in_splits, n, &format!("all_to_all: rank {me}'s input"))?;
            let recv = tensor::split_bytes(output, dtype, out_splits, n, &format!("all_to_all: rank {me}'s output"))?;
            // Each peer's chunk where it lies (the host engine reads the byte counts only).
            let (inp, out) = (tensor::span(&i, a.dtype), tensor::span(&o, a.dtype));
            let splits = Chunks {
                send: tensor::offsets(&send).iter().map(|x| inp.ptr + x).collect(),
                send_bytes: send,
                recv: tensor::offsets(&recv).iter().map(|x| out.ptr + x).collect(),
                recv_bytes: recv,
            };
            let keep = vec![input.shallow_clone(), output.shallow_clone(), i, o];
            Ok(Plan::new(Op { inp, out, dtype: a.dtype, splits: Some(splits), ..op(Kind::AllToAll) }, keep, CopyBack::chain(post, extra)))
        })
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
                let a = self.arg(t, "all_to_all tensor", place)?;
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
            Err(e) => self.run(Kind::AllToAll, place, blocking, || Err(e)),
        }
    }

    /// Block until every rank got here (with a CUDA engine: and every rank's GPU work
    /// queued on its current stream before it finished, as NCCL's barrier).
    pub fn barrier(&self) -> Result<()> {
        if let Some(d) = self.inner.cuda_device {
            // The barrier kernel runs after the current stream's earlier work; its end event
            // completing means both are done. synchronize() is bounded by the group timeout.
            let stream = crate::cuda::current_stream(d)?;
            if let Ran::Event(ev) = self.inner.group.run(Op::new(Kind::Barrier, OpPlace::Cuda { stream }))? {
                ev.wait_on(stream)?;
                ev.synchronize()?;
            }
            return self.inner.group.cuda_health();
        }
        self.run(Kind::Barrier, Place::Cpu, true, || Ok(Plan::new(op(Kind::Barrier), vec![], None)))?.wait()
    }

    /// With a CUDA engine this is `barrier()` (it waits on the CPU, as NCCL's does).
    pub fn barrier_async(&self) -> Result<Work> {
        if self.inner.cuda_device.is_some() {
            self.barrier()?;
            return Ok(Work::done());
        }
        self.run(Kind::Barrier, Place::Cpu, false, || Ok(Plan::new(op(Kind::Barrier), vec![], None)))
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

    /// Always asynchronous underneath: the blocking forms wait on the Work. A bad argument
    /// raises on this rank alone (only it and its peer are involved; `Group::run`).
    fn p2p(&self, t: &Tensor, peer: usize, tag: i64, send: bool) -> Result<Work> {
        let kind = if send { Kind::Send } else { Kind::Recv };
        let place = tensor::place_of(&[t]);
        self.run(kind, place, false, || {
            let what = kind.name();
            let a = self.arg(t, &format!("{what} tensor"), place)?;
            let (c, post) = if send { (tensor::contiguous(t, what)?, None) } else { tensor::output(t, what)? };
            let s = tensor::span(&c, a.dtype);
            let (inp, out) = if send { (s, Span::default()) } else { (Span::default(), s) };
            Ok(Plan::new(Op { inp, out, dtype: a.dtype, root: rank_arg(peer), tag, ..op(kind) }, vec![t.shallow_clone(), c], post))
        })
    }
}
