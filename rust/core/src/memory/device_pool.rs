//! The symmetric pool: one VMM allocation per local rank, mapped by every local rank.
//!
//! Each rank creates its block with cuMemCreate (POSIX-fd shareable), zeroes it, exports
//! the descriptor and sends it to the other local ranks over the group's Unix mesh
//! (SCM_RIGHTS). Every rank reserves ONE virtual range of `nranks * block` bytes, with an
//! explicit cap (`max_cuda_va_bytes`), and maps block j at `va + j * block`, so kernels
//! reach every peer's memory with plain loads and stores over NVLink. Nothing else
//! reserves VA: no cudaMemPool (which would reserve twice the GPU's memory).

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys as cu;

use crate::bootstrap::LocalMesh;
use crate::cuda::driver::{check, Device};
use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"RSV1";

/// Round `n` up to a multiple of `g` (g > 0).
pub fn round_up(n: usize, g: usize) -> usize {
    n.div_ceil(g) * g
}

/// The virtual range one group needs on each GPU, checked against the cap. A pure
/// function, so the arithmetic and the message are tested without a GPU.
pub fn va_needed(nranks: usize, block_bytes: usize, granularity: usize, cap: usize) -> Result<(usize, usize)> {
    let block = round_up(block_bytes.max(1), granularity.max(1));
    let total = block.checked_mul(nranks).ok_or_else(|| Error::Config(format!("{nranks} ranks x {block} bytes overflows")))?;
    if total > cap {
        return Err(Error::Config(format!(
            "the CUDA pool needs {total} bytes of virtual address space ({nranks} local ranks x {block} bytes \
             of cuda_buffer_bytes + cuda_pool_bytes, each rounded to the {granularity}-byte granularity), \
             over the cap max_cuda_va_bytes = {cap} (RSCCL_MAX_CUDA_VA_BYTES): raise the cap or lower \
             cuda_buffer_bytes / cuda_pool_bytes"
        )));
    }
    Ok((block, total))
}

pub struct SymmetricPool {
    dev: Arc<Device>,
    /// Start of the reserved range; local rank j's block is at `va + j * block`.
    pub va: u64,
    pub block: usize,
    pub nranks: usize,
    pub me: usize,
    /// Where the pool (rsccl.mem_pool) starts inside a block, and its size (0: none).
    pub pool_off: usize,
    pub pool_bytes: usize,
    /// Per block: its handle (0: none) and whether it is mapped; behind a lock so the
    /// peers' blocks can be let go early (release_peers) while this rank's stays.
    blocks: parking_lot::Mutex<Vec<(cu::CUmemGenericAllocationHandle, bool)>>,
    reserved: usize,
    access_set: bool,
}

impl SymmetricPool {
    /// Each block is the staging buffer (`buffer_bytes`) then the pool (`pool_bytes`), each
    /// rounded up to the allocation granularity.
    pub fn create(
        dev: Arc<Device>,
        mesh: &LocalMesh,
        buffer_bytes: usize,
        pool_bytes: usize,
        va_cap: usize,
        deadline: Instant,
    ) -> Result<SymmetricPool> {
        let nranks = mesh.size();
        let me = mesh.local_index();
        let _ctx = dev.bind()?;
        // SAFETY: zeroed is a valid bit pattern for this plain C struct; fields set below.
        let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev.ordinal;
        let mut gran = 0usize;
        // SAFETY: out-pointer to a local; prop is fully initialized.
        check(
            unsafe {
                cu::cuMemGetAllocationGranularity(
                    &mut gran,
                    &prop,
                    cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            },
            "cuMemGetAllocationGranularity",
        )?;
        let pool_off = round_up(buffer_bytes.max(1), gran);
        let pool_bytes = round_up(pool_bytes, gran);
        let (block, total) = va_needed(nranks, pool_off + pool_bytes, gran, va_cap)?;
        let mut pool = SymmetricPool {
            dev: dev.clone(),
            va: 0,
            block,
            nranks,
            me,
            pool_off,
            pool_bytes,
            blocks: parking_lot::Mutex::new(vec![(0, false); nranks]),
            reserved: 0,
            access_set: false,
        };
        let mut own: cu::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer to a local; prop is initialized; size is a granularity multiple.
        check(unsafe { cu::cuMemCreate(&mut own, block, &prop, 0) }, "cuMemCreate (the rank's CUDA buffer)")?;
        pool.blocks.get_mut()[me].0 = own;
        let mut va: cu::CUdeviceptr = 0;
        // SAFETY: reserves `total` bytes of VA (no memory), aligned to the granularity.
        check(unsafe { cu::cuMemAddressReserve(&mut va, total, gran, 0, 0) }, "cuMemAddressReserve")?;
        pool.va = va;
        pool.reserved = total;
        // Map and zero our own block before anyone else can see it: peers write into it
        // (barrier flags) only after they imported our descriptor, which we send below.
        pool.map(me, own)?;
        // SAFETY: the range was just mapped read-write for this device.
        check(unsafe { cu::cuMemsetD8_v2(pool.block_addr(me), 0, block) }, "cuMemsetD8 (zeroing the CUDA buffer)")?;
        // SAFETY: waits for the memset on the legacy stream; no other work is pending on it.
        check(unsafe { cu::cuCtxSynchronize() }, "cuCtxSynchronize")?;
        let mut raw_fd: i32 = -1;
        // SAFETY: for POSIX-fd handles the driver writes an int descriptor at the pointer.
        check(
            unsafe {
                cu::cuMemExportToShareableHandle(
                    &mut raw_fd as *mut i32 as *mut std::ffi::c_void,
                    own,
                    cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            "cuMemExportToShareableHandle",
        )?;
        // SAFETY: the driver returned a fresh descriptor that we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw_fd) };
        let mut msg = [0u8; 64];
        msg[..4].copy_from_slice(MAGIC);
        msg[4..12].copy_from_slice(&(block as u64).to_le_bytes());
        let got = mesh.all_gather(&msg, Some(fd.as_raw_fd()), deadline)?;
        drop(fd);
        for (j, (m, fd)) in got.into_iter().enumerate() {
            if j == me {
                continue;
            }
            let size = u64::from_le_bytes(m[4..12].try_into().unwrap()) as usize;
            if &m[..4] != MAGIC || size != block {
                return Err(Error::PeerFailure(format!(
                    "local rank {j} created a {size}-byte CUDA buffer, this rank {block}: are RSCCL_CUDA_* \
                     settings the same on every rank?"
                )));
            }
            let fd = fd.ok_or_else(|| Error::PeerFailure(format!("local rank {j} sent no CUDA buffer descriptor")))?;
            let mut h: cu::CUmemGenericAllocationHandle = 0;
            let raw = fd.into_raw_fd();
            // SAFETY: the driver takes the descriptor number as the "handle" argument and
            // does not keep it; we close it right after.
            let r = unsafe {
                cu::cuMemImportFromShareableHandle(
                    &mut h,
                    raw as usize as *mut std::ffi::c_void,
                    cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            };
            // SAFETY: we own `raw` (taken from the OwnedFd above).
            unsafe { libc::close(raw) };
            check(r, &format!("cuMemImportFromShareableHandle (local rank {j}'s buffer)"))?;
            pool.blocks.get_mut()[j].0 = h;
            pool.map(j, h)?;
        }
        let desc = cu::CUmemAccessDesc {
            location: cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev.ordinal },
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole range is mapped; one descriptor for this device.
        check(
            unsafe { cu::cuMemSetAccess(pool.va, total, &desc, 1) },
            "cuMemSetAccess (this GPU's access to the local peers' buffers; GPUs without peer access need NCCL: \
             backend=\"cpu:rsccl,cuda:nccl\")",
        )?;
        pool.access_set = true;
        Ok(pool)
    }

    fn map(&mut self, j: usize, h: cu::CUmemGenericAllocationHandle) -> Result<()> {
        // SAFETY: maps a whole allocation of `block` bytes into our reserved range.
        check(unsafe { cu::cuMemMap(self.block_addr(j), self.block, 0, h, 0) }, "cuMemMap")?;
        self.blocks.get_mut()[j].1 = true;
        if j == self.me {
            let desc = cu::CUmemAccessDesc {
                location: cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: self.dev.ordinal },
                flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the block was just mapped; one descriptor for this device.
            check(unsafe { cu::cuMemSetAccess(self.block_addr(j), self.block, &desc, 1) }, "cuMemSetAccess")?;
        }
        Ok(())
    }

    pub fn block_addr(&self, j: usize) -> u64 {
        self.va + (j * self.block) as u64
    }

    pub fn reserved_bytes(&self) -> usize {
        self.reserved
    }

    /// Unmap and release the peers' blocks, keeping this rank's: once the group's kernels
    /// are done, only this rank's pool tensors (still held by torch) need a mapping.
    pub fn release_peers(&self) {
        let Ok(_ctx) = self.dev.bind() else { return };
        let mut blocks = self.blocks.lock();
        for (j, b) in blocks.iter_mut().enumerate() {
            if j != self.me {
                self.unmap_release(j, b);
            }
        }
    }

    fn unmap_release(&self, j: usize, b: &mut (cu::CUmemGenericAllocationHandle, bool)) {
        if b.1 {
            // SAFETY: block j was mapped by `map`, and no kernel of the group runs any more
            // (callers: Drop, and release_peers after the engine drained).
            unsafe { cu::cuMemUnmap(self.block_addr(j), self.block) };
            b.1 = false;
        }
        if b.0 != 0 {
            // SAFETY: releases the handle created or imported in `create`, once.
            unsafe { cu::cuMemRelease(b.0) };
            b.0 = 0;
        }
    }
}

impl Drop for SymmetricPool {
    fn drop(&mut self) {
        let Ok(_ctx) = self.dev.bind() else { return };
        // Unmap and release every block; the physical memory of a peer's block goes when
        // the last process holding it releases it, so order between ranks does not matter.
        let mut blocks = std::mem::take(self.blocks.get_mut());
        for (j, b) in blocks.iter_mut().enumerate() {
            self.unmap_release(j, b);
        }
        if self.reserved > 0 {
            // SAFETY: frees the range reserved in `create`, now unmapped.
            unsafe { cu::cuMemAddressFree(self.va, self.reserved) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn va_is_capped_and_rounded() {
        let (block, total) = va_needed(4, (32 << 20) + 1, 2 << 20, 4 << 30).unwrap();
        assert_eq!(block, 34 << 20);
        assert_eq!(total, 4 * (34 << 20));
        let e = va_needed(8, 1 << 30, 2 << 20, 4 << 30).unwrap_err().to_string();
        assert!(e.contains("max_cuda_va_bytes") && e.contains("RSCCL_MAX_CUDA_VA_BYTES"), "{e}");
    }
}
