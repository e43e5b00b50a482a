//! tch tensors as rsccl's engines see them: an element type, a device, and contiguous bytes.
//! Every check returns an error naming the rank and what it passed; nothing here panics
//! (tch's accessors panic on undefined or sparse tensors, so those are refused first).

use rsccl_core::collective::op::Span;
use rsccl_core::dtype::DType;
use rsccl_core::{Error, Result};
use tch::{Device, Kind, Tensor};

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    Cpu,
    Cuda(i32),
}

macro_rules! tch_kinds {
    ($($v:ident = $code:literal, $name:literal, $size:literal, $float:literal, $tag:tt, $nccl:tt, $tch:ident;)*) => {
        /// rsccl's element type of a tch kind: the tch column of rsccl's dtype table
        /// (rsccl-core's dtype.rs, `dtype_rows!`).
        pub(crate) fn dtype_of_kind(k: Kind) -> Option<DType> {
            match k {
                $(Kind::$tch => Some(DType::$v),)*
                _ => None,
            }
        }
    };
}
rsccl_core::dtype_rows!(tch_kinds);

/// A checked tensor argument.
pub(crate) struct Arg {
    pub dtype: DType,
    pub kind: Kind,
    pub place: Place,
}

/// Check that `t` (called `what` in messages) is a tensor rsccl can move: defined, dense,
/// of a supported dtype, on the CPU or a CUDA device.
pub(crate) fn check(t: &Tensor, what: &str, rank: usize) -> Result<Arg> {
    if !t.defined() {
        return Err(Error::InvalidArgument(format!("rank {rank}: {what} is an undefined tensor (e.g. a gradient before backward)")));
    }
    if t.is_sparse() || t.is_mkldnn() {
        return Err(Error::InvalidType(format!("rank {rank}: {what} is not a dense (strided) tensor; rsccl needs dense tensors")));
    }
    let kind = t.f_kind().map_err(|e| Error::InvalidType(format!("rank {rank}: {what} has a dtype rsccl does not support ({e})")))?;
    let dtype = dtype_of_kind(kind).ok_or_else(|| {
        Error::InvalidType(format!(
            "rank {rank}: {what} has dtype {kind:?}; rsccl supports {}",
            DType::ALL.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
        ))
    })?;
    let place = match t.device() {
        Device::Cpu => Place::Cpu,
        Device::Cuda(i) => Place::Cuda(i as i32),
        other => return Err(Error::InvalidType(format!("rank {rank}: {what} is on {other:?}; rsccl takes CPU and CUDA tensors"))),
    };
    Ok(Arg { dtype, kind, place })
}

/// The place a call goes to: that of its first defined tensor (CPU if none is defined:
/// the host engine then reports the bad argument to every rank).
pub(crate) fn place_of(ts: &[&Tensor]) -> Place {
    ts.iter()
        .find(|t| t.defined())
        .map(|t| match t.device() {
            Device::Cuda(i) => Place::Cuda(i as i32),
            _ => Place::Cpu,
        })
        .unwrap_or(Place::Cpu)
}

pub(crate) fn torch_err(what: &str, e: tch::TchError) -> Error {
    Error::InvalidArgument(format!("{what}: libtorch refused it: {e}"))
}

pub(crate) fn nbytes(t: &Tensor, dtype: DType) -> usize {
    t.numel() * dtype.size()
}

/// The op's view of a contiguous tensor `t` (address and bytes), which the caller keeps
/// alive until the operation completed.
pub(crate) fn span(t: &Tensor, dtype: DType) -> Span {
    Span { ptr: ptr(t), bytes: nbytes(t, dtype) as u64 }
}

pub(crate) fn ptr(t: &Tensor) -> u64 {
    t.data_ptr() as u64
}

/// `t` itself if contiguous, else a contiguous copy.
pub(crate) fn contiguous(t: &Tensor, what: &str) -> Result<Tensor> {
    if t.is_contiguous() {
        Ok(t.shallow_clone())
    } else {
        t.f_contiguous().map_err(|e| torch_err(what, e))
    }
}

/// A contiguous tensor an in-place operation reads and writes for `t`: `t` itself, or a
/// contiguous copy whose result the returned copy-back step writes into `t`.
pub(crate) fn in_place(t: &Tensor, what: &str) -> Result<(Tensor, Option<CopyBack>)> {
    let c = contiguous(t, what)?;
    let post = (!t.is_contiguous()).then(|| CopyBack { dst: vec![t.shallow_clone()], src: vec![c.shallow_clone()] });
    Ok((c, post))
}

/// A new contiguous tensor of `t`'s shape, dtype and device (a checked tensor).
fn empty(t: &Tensor, what: &str) -> Result<Tensor> {
    let kind = t.f_kind().map_err(|e| torch_err(what, e))?;
    Tensor::f_empty(t.size(), (kind, t.device())).map_err(|e| torch_err(what, e))
}

/// A contiguous copy of `t` (an input that overlaps its output).
pub(crate) fn copy(t: &Tensor, what: &str) -> Result<Tensor> {
    let mut c = empty(t, what)?;
    c.f_copy_(t).map_err(|e| torch_err(what, e))?;
    Ok(c)
}

/// A contiguous tensor the engine writes for `t`: `t` itself, or a stand-in whose result
/// the returned copy-back step writes into `t`.
pub(crate) fn output(t: &Tensor, what: &str) -> Result<(Tensor, Option<CopyBack>)> {
    if t.is_contiguous() {
        return Ok((t.shallow_clone(), None));
    }
    let o = empty(t, what)?;
    Ok((o.shallow_clone(), Some(CopyBack { dst: vec![t.shallow_clone()], src: vec![o] })))
}

/// Copies into the caller's tensors once an operation completed (non-contiguous outputs,
/// lists of outputs).
pub(crate) struct CopyBack {
    pub dst: Vec<Tensor>,
    pub src: Vec<Tensor>,
}

impl CopyBack {
    pub fn run(self) -> Result<()> {
        for (mut d, s) in self.dst.into_iter().zip(self.src) {
            let shape = d.size();
            let s = s.f_view(shape.as_slice()).map_err(|e| torch_err("copying the result back", e))?;
            d.f_copy_(&s).map_err(|e| torch_err("copying the result back", e))?;
        }
        Ok(())
    }

    /// `flat`'s consecutive pieces into `dsts`, in order.
    pub fn split(flat: &Tensor, dsts: &[Tensor]) -> Result<CopyBack> {
        let mut src = Vec::with_capacity(dsts.len());
        let flat = flat.f_reshape([-1]).map_err(|e| torch_err("splitting the result", e))?;
        let mut off = 0i64;
        for d in dsts {
            let n = d.numel() as i64;
            src.push(flat.f_narrow(0, off, n).map_err(|e| torch_err("splitting the result", e))?);
            off += n;
        }
        Ok(CopyBack { dst: dsts.iter().map(|d| d.shallow_clone()).collect(), src })
    }

    pub fn chain(a: Option<CopyBack>, b: Option<CopyBack>) -> Option<CopyBack> {
        match (a, b) {
            (None, x) | (x, None) => x,
            (Some(mut a), Some(b)) => {
                a.dst.extend(b.dst);
                a.src.extend(b.src);
                Some(a)
            }
        }
    }
}

/// `ts` flattened and concatenated (contiguous, on their device).
pub(crate) fn flat_cat(ts: &[Tensor], what: &str) -> Result<Tensor> {
    let flat: Vec<Tensor> = ts.iter().map(|t| t.f_reshape([-1])).collect::<std::result::Result<_, _>>().map_err(|e| torch_err(what, e))?;
    Tensor::f_cat(&flat, 0).map_err(|e| torch_err(what, e))
}

/// Whether two tensors may share memory (same storage): a collective must not read what
/// it writes, so such an input is copied first.
pub(crate) fn may_overlap(a: &Tensor, b: &Tensor, dtype: DType) -> bool {
    let (la, lb) = (nbytes(a, dtype) as u64, nbytes(b, dtype) as u64);
    if la == 0 || lb == 0 {
        return false;
    }
    let (pa, pb) = (ptr(a), ptr(b));
    pa < pb + lb && pb < pa + la
}

/// Bytes per peer of an all_to_all_single buffer: `splits` counts rows (dim 0) per peer;
/// empty splits the rows evenly. `what` starts the error message.
pub(crate) fn split_bytes(t: &Tensor, dtype: DType, splits: &[i64], n: usize, what: &str) -> Result<Vec<u64>> {
    let size = t.size();
    let rows = size.first().copied().unwrap_or(t.numel() as i64);
    let row_bytes = if rows > 0 { nbytes(t, dtype) as u64 / rows as u64 } else { 0 };
    let splits: Vec<i64> = if splits.is_empty() {
        if rows % n as i64 != 0 {
            return Err(Error::InvalidArgument(format!("{what} has {rows} rows, not divisible by group size {n}")));
        }
        vec![rows / n as i64; n]
    } else {
        splits.to_vec()
    };
    if splits.len() != n || splits.iter().any(|s| *s < 0) || splits.iter().sum::<i64>() != rows {
        return Err(Error::InvalidArgument(format!("{what} split sizes {splits:?} do not divide its {rows} rows among {n} ranks")));
    }
    Ok(splits.iter().map(|s| *s as u64 * row_bytes).collect())
}

/// Offsets of pieces laid out back to back.
pub(crate) fn offsets(sizes: &[u64]) -> Vec<u64> {
    let mut total = 0;
    sizes
        .iter()
        .map(|s| {
            let o = total;
            total += s;
            o
        })
        .collect()
}
