//! Collective operations as data: what each rank passed, the header that every rank
//! checks against every other rank's, and the algorithm choice (a pure function).

mod kind;
pub mod op;
pub mod reduce;
pub mod validate;

pub use kind::Kind;

use op::Op;

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::memory::layout::{CollHeader, ERROR_TEXT_BYTES, MAX_LOCAL_RANKS};

/// A caller's buffer: torch storage the Python side keeps alive until the Work completes.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a Buf is an address the engine thread reads or writes while the owning Python
// Work holds the tensor; nothing else writes it during the collective (torch semantics).
unsafe impl Send for Buf {}

impl Buf {
    pub fn empty() -> Buf {
        Buf { ptr: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8, len: 0 }
    }
}

/// One collective as one rank called it. Element counts are in elements of `dtype`.
#[derive(Debug)]
pub enum Collective {
    AllReduce {
        buf: Buf,
        dtype: DType,
        op: ReduceOp,
    },
    Broadcast {
        buf: Buf,
        dtype: DType,
        root: usize,
    },
    Reduce {
        buf: Buf,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    },
    /// `output` holds group-size copies of `input`, in rank order.
    AllGather {
        input: Buf,
        output: Buf,
        dtype: DType,
    },
    /// `input` holds group-size blocks of `output`'s size; rank r receives block r reduced.
    ReduceScatter {
        input: Buf,
        output: Buf,
        dtype: DType,
        op: ReduceOp,
    },
    /// Bytes sent to / received from each rank, packed in rank order in input / output.
    AllToAll {
        input: Buf,
        output: Buf,
        dtype: DType,
        send_bytes: Vec<u64>,
        recv_bytes: Vec<u64>,
    },
    /// `output` (root only) holds group-size blocks of `input`'s size.
    Gather {
        input: Buf,
        output: Option<Buf>,
        dtype: DType,
        root: usize,
    },
    /// `input` (root only) holds group-size blocks of `output`'s size.
    Scatter {
        input: Option<Buf>,
        output: Buf,
        dtype: DType,
        root: usize,
    },
    Barrier,
    /// This rank's arguments were wrong: it still takes part in the agreement step so that
    /// every rank raises `error` instead of waiting for it.
    Invalid {
        kind: Kind,
        error: Error,
    },
}

impl Collective {
    /// The host engine's description of the op `o` of `rank` in a group of `n` ranks.
    /// Errors are this rank's bad arguments, which it then submits as `Collective::Invalid`.
    pub fn from_op(o: &Op, rank: usize, n: usize) -> Result<Collective> {
        let (inp, out, dtype, op) = (o.inp.buf(), o.out.buf(), o.dtype, o.op);
        let root = || validate::root(o.kind.name(), o.root, n);
        Ok(match o.kind {
            Kind::AllReduce => Collective::AllReduce { buf: out, dtype, op },
            Kind::Broadcast => Collective::Broadcast { buf: out, dtype, root: root()? },
            Kind::Reduce => Collective::Reduce { buf: out, dtype, op, root: root()? },
            Kind::AllGather => Collective::AllGather { input: inp, output: out, dtype },
            Kind::ReduceScatter => Collective::ReduceScatter { input: inp, output: out, dtype, op },
            Kind::AllToAll => {
                let s = o.splits.as_ref().ok_or_else(|| Error::Internal("all_to_all without splits".into()))?;
                Collective::AllToAll { input: inp, output: out, dtype, send_bytes: s.send_bytes.clone(), recv_bytes: s.recv_bytes.clone() }
            }
            Kind::Gather => {
                let root = root()?;
                Collective::Gather { input: inp, output: (rank == root).then_some(out), dtype, root }
            }
            Kind::Scatter => {
                let root = root()?;
                Collective::Scatter { input: (rank == root).then_some(inp), output: out, dtype, root }
            }
            Kind::Barrier => Collective::Barrier,
            Kind::Send | Kind::Recv | Kind::Invalid => {
                return Err(Error::Internal(format!("{} is not a collective of the host engine", o.kind.name())))
            }
        })
    }

    pub fn kind(&self) -> Kind {
        match self {
            Collective::AllReduce { .. } => Kind::AllReduce,
            Collective::Broadcast { .. } => Kind::Broadcast,
            Collective::Reduce { .. } => Kind::Reduce,
            Collective::AllGather { .. } => Kind::AllGather,
            Collective::ReduceScatter { .. } => Kind::ReduceScatter,
            Collective::AllToAll { .. } => Kind::AllToAll,
            Collective::Gather { .. } => Kind::Gather,
            Collective::Scatter { .. } => Kind::Scatter,
            Collective::Barrier => Kind::Barrier,
            Collective::Invalid { kind, .. } => *kind,
        }
    }

    fn dtype(&self) -> Option<DType> {
        match self {
            Collective::AllReduce { dtype, .. }
            | Collective::Broadcast { dtype, .. }
            | Collective::Reduce { dtype, .. }
            | Collective::AllGather { dtype, .. }
            | Collective::ReduceScatter { dtype, .. }
            | Collective::AllToAll { dtype, .. }
            | Collective::Gather { dtype, .. }
            | Collective::Scatter { dtype, .. } => Some(*dtype),
            _ => None,
        }
    }

    /// Check what this rank alone can check. The result travels in the header.
    pub fn check_local(&self, rank: usize, n: usize) -> Result<()> {
        let dt = self.dtype();
        let elems = |b: &Buf| b.len / dt.map_or(1, |d| d.size());
        let elem = dt.map_or(1, |d| d.size()) as u64;
        let bad = |msg: String| Err(Error::InvalidArgument(msg));
        let root_ok = |root: usize| validate::root(self.kind().name(), root as i64, n).map(|_| ());
        match self {
            Collective::AllReduce { dtype, op, .. } => op.check(*dtype)?,
            Collective::Reduce { dtype, op, root, .. } => {
                op.check(*dtype)?;
                root_ok(*root)?
            }
            Collective::ReduceScatter { dtype, op, input, output } => {
                op.check(*dtype)?;
                validate::blocks_per_rank("reduce_scatter", n, elem, ("input", input.len as u64), ("output", output.len as u64))?;
            }
            Collective::Broadcast { root, .. } => root_ok(*root)?,
            Collective::AllGather { input, output, .. } => {
                validate::blocks_per_rank("all_gather", n, elem, ("output", output.len as u64), ("input", input.len as u64))?;
            }
            Collective::Gather { input, output, root, .. } => {
                root_ok(*root)?;
                if rank == *root {
                    match output {
                        Some(o) if o.len == input.len * n => {}
                        Some(o) => return bad(format!("gather: root's output has {} elements, expected {n} x {}", elems(o), elems(input))),
                        None => return bad("gather: the root passed no gather_list".into()),
                    }
                }
            }
            Collective::Scatter { input, output, root, .. } => {
                root_ok(*root)?;
                if rank == *root {
                    match input {
                        Some(i) if i.len == output.len * n => {}
                        Some(i) => {
                            return bad(format!("scatter: root's input has {} elements, expected {n} x {}", elems(i), elems(output)))
                        }
                        None => return bad("scatter: the root passed no scatter_list".into()),
                    }
                }
            }
            Collective::AllToAll { input, output, send_bytes, recv_bytes, dtype } => {
                if send_bytes.len() != n || recv_bytes.len() != n {
                    return bad(format!(
                        "all_to_all: {} input and {} output splits for a group of size {n}",
                        send_bytes.len(),
                        recv_bytes.len()
                    ));
                }
                let sum = |v: &[u64]| v.iter().try_fold(0u64, |a, x| a.checked_add(*x)).unwrap_or(u64::MAX);
                let (s, r) = (sum(send_bytes), sum(recv_bytes));
                let es = dtype.size() as u64;
                if s != input.len as u64 || r != output.len as u64 {
                    return bad(format!(
                        "all_to_all: splits add up to {} input and {} output elements, but the \
                         tensors have {} and {}",
                        s / es,
                        r / es,
                        input.len as u64 / es,
                        output.len as u64 / es
                    ));
                }
            }
            Collective::Barrier => {}
            Collective::Invalid { error, .. } => return Err(error.clone()),
        }
        if n > MAX_LOCAL_RANKS {
            return Err(Error::Internal("group too large for a host engine".into()));
        }
        Ok(())
    }

    /// The header this rank publishes; `local` is the result of `check_local`.
    pub fn header(&self, seq: u64, local: &Result<()>) -> CollHeader {
        // SAFETY: CollHeader is plain old data (integers and byte arrays); zero is valid.
        let mut h: CollHeader = unsafe { std::mem::zeroed() };
        h.seq = seq;
        h.kind = self.kind() as u8;
        h.dtype = self.dtype().map_or(255, |d| d as u8);
        h.root = -1;
        let elems = |b: &Buf| (b.len / self.dtype().map_or(1, |d| d.size())) as u64;
        match self {
            Collective::AllReduce { buf, op, .. } => {
                h.count = elems(buf);
                h.op = *op as u8;
            }
            Collective::Broadcast { buf, root, .. } => {
                h.count = elems(buf);
                h.root = *root as i32;
            }
            Collective::Reduce { buf, op, root, .. } => {
                h.count = elems(buf);
                h.op = *op as u8;
                h.root = *root as i32;
            }
            Collective::AllGather { input, .. } => h.count = elems(input),
            Collective::ReduceScatter { output, op, .. } => {
                h.count = elems(output);
                h.op = *op as u8;
            }
            Collective::Gather { input, root, .. } => {
                h.count = elems(input);
                h.root = *root as i32;
            }
            Collective::Scatter { output, root, .. } => {
                h.count = elems(output);
                h.root = *root as i32;
            }
            Collective::AllToAll { send_bytes, recv_bytes, .. } => {
                for (i, v) in send_bytes.iter().enumerate().take(MAX_LOCAL_RANKS) {
                    h.send_bytes[i] = *v;
                }
                for (i, v) in recv_bytes.iter().enumerate().take(MAX_LOCAL_RANKS) {
                    h.recv_bytes[i] = *v;
                }
            }
            Collective::Barrier | Collective::Invalid { .. } => {}
        }
        if let Err(e) = local {
            h.error_class = e.class_code();
            let text = e.to_string();
            let b = text.as_bytes();
            let n = b.len().min(ERROR_TEXT_BYTES);
            h.error_text[..n].copy_from_slice(&b[..n]);
            h.error_len = n as u32;
        }
        h
    }
}

fn error_text(h: &CollHeader) -> String {
    String::from_utf8_lossy(&h.error_text[..(h.error_len as usize).min(ERROR_TEXT_BYTES)]).into_owned()
}

/// Check that all ranks called the same collective with compatible arguments. Every rank
/// runs this on the same headers (`ranks[r]` is rank r's), so every rank reaches the same
/// verdict and the group stays in step.
pub fn agree(h: &[CollHeader]) -> Result<()> {
    let failed: Vec<usize> = (0..h.len()).filter(|&r| h[r].error_class != 0).collect();
    if let Some(&first) = failed.first() {
        let msg = failed.iter().map(|&r| format!("rank {r}: {}", error_text(&h[r]))).collect::<Vec<_>>().join("; ");
        return Err(Error::from_class_code(h[first].error_class, msg));
    }
    let kind_name = |c: u8| Kind::from_code(c).map_or("an unknown collective", |k| k.name());
    let dtype_name = |c: u8| DType::from_code(c).map_or("?", |d| d.name());
    let op_name = |c: u8| ReduceOp::from_code(c).map_or("?", |o| o.name());
    let kind = Kind::from_code(h[0].kind).ok_or_else(|| Error::Internal("bad collective code".into()))?;
    for r in 1..h.len() {
        let (a, b) = (&h[0], &h[r]);
        let differ = |what: &str, x: String, y: String| {
            Err(Error::Mismatch(format!("ranks disagree on {}: rank 0 passed {what}={x}, rank {r} passed {what}={y}", kind.name())))
        };
        if a.kind != b.kind {
            return Err(Error::Mismatch(format!(
                "ranks called different collectives: rank 0 called {}, rank {r} called {}",
                kind_name(a.kind),
                kind_name(b.kind)
            )));
        }
        if a.dtype != b.dtype {
            return differ("dtype", dtype_name(a.dtype).into(), dtype_name(b.dtype).into());
        }
        if a.count != b.count {
            let what = match kind {
                Kind::AllGather | Kind::Gather => "input elements",
                Kind::ReduceScatter | Kind::Scatter => "output elements",
                Kind::AllReduce
                | Kind::Broadcast
                | Kind::Reduce
                | Kind::Barrier
                | Kind::Invalid
                | Kind::AllToAll
                | Kind::Send
                | Kind::Recv => "elements",
            };
            return differ(what, a.count.to_string(), b.count.to_string());
        }
        if kind.has_op() && a.op != b.op {
            return differ("op", op_name(a.op).into(), op_name(b.op).into());
        }
        if kind.has_root() && a.root != b.root {
            return differ("root", a.root.to_string(), b.root.to_string());
        }
    }
    if kind.has_chunks() {
        let es = DType::from_code(h[0].dtype).map_or(1, |d| d.size()) as u64;
        for (i, hi) in h.iter().enumerate() {
            for (j, hj) in h.iter().enumerate() {
                if hi.send_bytes[j] != hj.recv_bytes[i] {
                    return Err(Error::Mismatch(format!(
                        "{} split sizes disagree: rank {i} sends {} elements to rank {j}, \
                         but rank {j} expects {} from rank {i}",
                        kind.name(),
                        hi.send_bytes[j] / es,
                        hj.recv_bytes[i] / es
                    )));
                }
            }
        }
    }
    if let Some(r) = (1..h.len()).find(|&r| h[r].seq != h[0].seq) {
        return Err(Error::Mismatch(format!("ranks are out of step: rank 0 is at collective #{}, rank {r} at #{}", h[0].seq, h[r].seq)));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllReduceAlgo {
    /// Every rank stages its input, one barrier, every rank reduces all inputs.
    OneShot,
    /// Per chunk: stage, barrier, each rank reduces its segment, barrier, all gather.
    TwoPhase,
}

/// Pick the all_reduce algorithm; returns the reason for logs and tests.
pub fn choose_allreduce(bytes: usize, nranks: usize, one_shot_max: usize, half_bytes: usize) -> (AllReduceAlgo, &'static str) {
    if bytes > half_bytes {
        (AllReduceAlgo::TwoPhase, "message larger than one staging half: pipelined")
    } else if nranks <= 1 || bytes <= one_shot_max {
        (AllReduceAlgo::OneShot, "small message: one barrier beats two")
    } else {
        (AllReduceAlgo::TwoPhase, "large message: reading every input on every rank costs more than a second barrier")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(len: usize) -> Buf {
        Buf { ptr: std::ptr::null_mut(), len }
    }

    fn hdr(c: &Collective, seq: u64) -> CollHeader {
        c.header(seq, &c.check_local(0, 2))
    }

    #[test]
    fn agreement_names_both_ranks() {
        let a = Collective::AllReduce { buf: buf(16), dtype: DType::F32, op: ReduceOp::Sum };
        let b = Collective::AllReduce { buf: buf(32), dtype: DType::F64, op: ReduceOp::Sum };
        let e = agree(&[hdr(&a, 1), hdr(&b, 1)]).unwrap_err().to_string();
        assert!(e.contains("rank 0 passed dtype=float32") && e.contains("rank 1 passed dtype=float64"), "{e}");
        let c = Collective::Broadcast { buf: buf(16), dtype: DType::F32, root: 0 };
        let e = agree(&[hdr(&a, 1), hdr(&c, 1)]).unwrap_err().to_string();
        assert!(e.contains("rank 0 called all_reduce, rank 1 called broadcast"), "{e}");
        let d = Collective::AllReduce { buf: buf(16), dtype: DType::F32, op: ReduceOp::Max };
        let e = agree(&[hdr(&a, 1), hdr(&d, 1)]).unwrap_err().to_string();
        assert!(e.contains("op=SUM") && e.contains("op=MAX"), "{e}");
        assert!(agree(&[hdr(&a, 1), hdr(&a, 1)]).is_ok());
    }

    #[test]
    fn local_errors_travel_with_their_class() {
        let bad = Collective::Broadcast { buf: buf(4), dtype: DType::F32, root: 5 };
        let ok = Collective::Broadcast { buf: buf(4), dtype: DType::F32, root: 0 };
        let e = agree(&[hdr(&ok, 1), hdr(&bad, 1)]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(e.to_string().starts_with("rank 1: broadcast: root/src rank 5 is out of range"), "{e}");
        let inv = Collective::Invalid { kind: Kind::AllReduce, error: Error::InvalidType("no complex".into()) };
        let e = agree(&[hdr(&ok, 1), hdr(&inv, 1)]).unwrap_err();
        assert!(matches!(e, Error::InvalidType(_)));
    }

    #[test]
    fn all_to_all_splits_must_pair_up() {
        let mk = |s: Vec<u64>, r: Vec<u64>| Collective::AllToAll {
            input: buf(s.iter().sum::<u64>() as usize),
            output: buf(r.iter().sum::<u64>() as usize),
            dtype: DType::I32,
            send_bytes: s,
            recv_bytes: r,
        };
        let r0 = mk(vec![4, 8], vec![4, 12]);
        let r1 = mk(vec![12, 0], vec![8, 0]);
        assert!(agree(&[hdr(&r0, 1), hdr(&r1, 1)]).is_ok());
        let r1bad = mk(vec![16, 0], vec![8, 0]);
        let e = agree(&[hdr(&r0, 1), hdr(&r1bad, 1)]).unwrap_err().to_string();
        assert!(e.contains("rank 1 sends 4 elements to rank 0, but rank 0 expects 3"), "{e}");
    }

    #[test]
    fn allreduce_choice() {
        assert_eq!(choose_allreduce(1024, 4, 65536, 1 << 21).0, AllReduceAlgo::OneShot);
        assert_eq!(choose_allreduce(1 << 20, 4, 65536, 1 << 21).0, AllReduceAlgo::TwoPhase);
        assert_eq!(choose_allreduce(1 << 22, 4, usize::MAX, 1 << 21).0, AllReduceAlgo::TwoPhase);
        // One rank still pipelines what does not fit one half (it once overran the region).
        assert_eq!(choose_allreduce(1 << 22, 1, usize::MAX, 1 << 21).0, AllReduceAlgo::TwoPhase);
        assert_eq!(choose_allreduce(1 << 20, 1, 0, 1 << 21).0, AllReduceAlgo::OneShot);
    }
}
