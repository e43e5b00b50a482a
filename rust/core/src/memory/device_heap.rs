//! The pool behind `rsccl.mem_pool(group)`: the part of each rank's symmetric block after
//! the staging buffer, handed to torch's caching allocator through a
//! `CUDAPluggableAllocator` (a pair of C functions: alloc(size, device, stream) and
//! free(ptr, size, device, stream)).
//!
//! Tensors in it are used in place by the kernels, which reach a peer's copy at the same
//! offset in the peer's block. So offsets must agree across ranks: the allocator is
//! deterministic (first fit at the lowest offset, freed ranges merged), and a program that
//! makes the same allocations in the same order on every rank gets the same offsets.
//! When they do not agree, the kernels notice and stage (NOTE [In place] in csrc_kernels/common.cuh).
//!
//! Memory here is mapped when the group is created (no driver call on allocation, so it
//! also works under CUDA graph capture). A full pool returns null: torch raises its usual
//! OutOfMemoryError. Torch may hand segments back after the group is gone (its MemPool
//! outlives the group, or empty_cache runs late): the mapping stays until the last one
//! comes back, so a tensor that outlives its group never points at unmapped memory.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::Arc;

use parking_lot::Mutex;

use super::device_pool::SymmetricPool;
use crate::error::{Error, Result};

/// Offsets and sizes are multiples of this (torch's caching allocator asks for 2 MiB
/// multiples; 512 bytes is its smallest block).
pub const ALIGN: u64 = 512;

/// The allocation state: a pure data structure, tested without a GPU.
#[derive(Debug, Default)]
pub struct Ranges {
    size: u64,
    /// Free ranges, offset -> length, never adjacent (merged on free).
    free: BTreeMap<u64, u64>,
    /// Live allocations, offset -> length.
    live: HashMap<u64, u64>,
    pub allocated: u64,
    pub peak: u64,
}

impl Ranges {
    pub fn new(size: u64) -> Ranges {
        let size = size / ALIGN * ALIGN;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        Ranges { size, free, live: HashMap::new(), allocated: 0, peak: 0 }
    }

    /// The lowest free offset that fits `len` bytes (rounded up to ALIGN), or None.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        let len = len.checked_add(ALIGN - 1)? / ALIGN * ALIGN;
        let (&off, &have) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&off);
        if have > len {
            self.free.insert(off + len, have - len);
        }
        self.live.insert(off, len);
        self.allocated += len;
        self.peak = self.peak.max(self.allocated);
        Some(off)
    }

    /// Give back the allocation at `off`; false if there is none.
    pub fn free(&mut self, off: u64) -> bool {
        let Some(len) = self.live.remove(&off) else { return false };
        self.allocated -= len;
        let (mut start, mut end) = (off, off + len);
        if let Some((&prev, &plen)) = self.free.range(..off).next_back() {
            if prev + plen == off {
                self.free.remove(&prev);
                start = prev;
            }
        }
        if let Some(nlen) = self.free.remove(&end) {
            end += nlen;
        }
        self.free.insert(start, end - start);
        true
    }

    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    pub fn capacity(&self) -> u64 {
        self.size
    }
}

/// One group's pool on this rank.
pub struct Heap {
    /// Address of the pool's first byte in this process (inside the rank's own block).
    pub start: u64,
    pub device: i32,
    capacity: u64,
    /// Allocations and whether the group is gone, under one lock: an allocation and the
    /// group's closing cannot interleave (no pointer handed out into an unmapped range).
    state: Mutex<HeapState>,
    /// Keeps the block mapped while the group lives or torch holds allocations.
    mapping: Mutex<Option<Arc<SymmetricPool>>>,
}

struct HeapState {
    ranges: Ranges,
    closed: bool,
}

impl Heap {
    pub fn new(mapping: Arc<SymmetricPool>, device: i32) -> Heap {
        let start = mapping.block_addr(mapping.me) + mapping.pool_off as u64;
        let ranges = Ranges::new(mapping.pool_bytes as u64);
        Heap {
            start,
            device,
            capacity: ranges.capacity(),
            state: Mutex::new(HeapState { ranges, closed: false }),
            mapping: Mutex::new(Some(mapping)),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// (bytes handed out now, most ever handed out at once).
    pub fn usage(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.ranges.allocated, st.ranges.peak)
    }

    /// Whether [ptr, ptr + len) lies inside this pool.
    pub fn contains(&self, ptr: u64, len: u64) -> bool {
        ptr >= self.start && ptr.checked_add(len).is_some_and(|end| end <= self.start + self.capacity)
    }

    fn alloc(&self, size: u64, device: i32) -> *mut c_void {
        if device != self.device {
            return std::ptr::null_mut();
        }
        let mut st = self.state.lock();
        if st.closed {
            return std::ptr::null_mut();
        }
        match st.ranges.alloc(size) {
            Some(off) => (self.start + off) as *mut c_void,
            None => std::ptr::null_mut(),
        }
    }

    /// Returns false if `ptr` is not an allocation of this pool.
    fn free(&self, ptr: u64) -> bool {
        if ptr < self.start {
            return false;
        }
        let (known, last) = {
            let mut st = self.state.lock();
            let known = st.ranges.free(ptr - self.start);
            (known, known && st.closed && st.ranges.live_count() == 0)
        };
        if last {
            self.release();
        }
        known
    }

    /// The group is going away: unmap now if torch holds nothing, else at the last free
    /// (meanwhile only this rank's own block stays mapped: the peers' blocks, which hold
    /// their GPUs' memory, are let go now).
    pub fn close(self: &Arc<Self>) {
        let empty = {
            let mut st = self.state.lock();
            st.closed = true;
            st.ranges.live_count() == 0
        };
        if empty {
            self.release();
        } else {
            if let Some(m) = self.mapping.lock().as_ref() {
                m.release_peers();
            }
            tracing::info!("rsccl: a group's pool still has tensors: its memory stays mapped until torch frees them");
        }
    }

    /// Unmap. The slot keeps the (closed) heap: torch may still hold this pool's allocator,
    /// and its allocations must keep failing rather than reach another group's pool.
    fn release(&self) {
        let pool = self.mapping.lock().take();
        drop(pool);
    }
}

// ---------------------------------------------------------------------------------------
// The C functions torch calls. torch's allocator passes no context, so each pool gets a
// slot with its own alloc function; free finds the pool by address. A slot is never given
// to another pool (a closed heap stays in it), so a process can create SLOT_COUNT pools.

const SLOT_COUNT: usize = 32;
static SLOTS: Mutex<[Option<Arc<Heap>>; SLOT_COUNT]> = parking_lot::const_mutex([const { None }; SLOT_COUNT]);

fn slot_alloc(slot: usize, size: isize, device: i32) -> *mut c_void {
    // No panic may cross into C++: a failure is a null pointer (torch raises its OOM).
    std::panic::catch_unwind(|| {
        let heap = SLOTS.lock()[slot].clone();
        match (heap, u64::try_from(size)) {
            (Some(h), Ok(n)) => h.alloc(n, device),
            _ => std::ptr::null_mut(),
        }
    })
    .unwrap_or(std::ptr::null_mut())
}

macro_rules! alloc_fns {
    ($($name:ident = $slot:expr),*) => {
        $(extern "C" fn $name(size: isize, device: i32, _stream: *mut c_void) -> *mut c_void {
            slot_alloc($slot, size, device)
        })*
        const ALLOC_FNS: [extern "C" fn(isize, i32, *mut c_void) -> *mut c_void; SLOT_COUNT] = [$($name),*];
    };
}
alloc_fns!(
    alloc0 = 0,
    alloc1 = 1,
    alloc2 = 2,
    alloc3 = 3,
    alloc4 = 4,
    alloc5 = 5,
    alloc6 = 6,
    alloc7 = 7,
    alloc8 = 8,
    alloc9 = 9,
    alloc10 = 10,
    alloc11 = 11,
    alloc12 = 12,
    alloc13 = 13,
    alloc14 = 14,
    alloc15 = 15,
    alloc16 = 16,
    alloc17 = 17,
    alloc18 = 18,
    alloc19 = 19,
    alloc20 = 20,
    alloc21 = 21,
    alloc22 = 22,
    alloc23 = 23,
    alloc24 = 24,
    alloc25 = 25,
    alloc26 = 26,
    alloc27 = 27,
    alloc28 = 28,
    alloc29 = 29,
    alloc30 = 30,
    alloc31 = 31
);

extern "C" fn pool_free(ptr: *mut c_void, _size: usize, _device: i32, _stream: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        let heaps: Vec<Arc<Heap>> = SLOTS.lock().iter().flatten().cloned().collect();
        if !heaps.iter().any(|h| h.free(ptr as u64)) {
            tracing::error!("rsccl: torch freed {ptr:?}, which no rsccl pool allocated; ignored");
        }
    });
}

/// The (alloc, free) function addresses for torch._C._cuda_customAllocator, taking a
/// slot for `heap` on first use.
pub fn allocator_fns(heap: &Arc<Heap>) -> Result<(usize, usize)> {
    let mut slots = SLOTS.lock();
    let i = match slots.iter().position(|s| s.as_ref().is_some_and(|h| Arc::ptr_eq(h, heap))) {
        Some(i) => i,
        None => {
            let i = slots.iter().position(|s| s.is_none()).ok_or_else(|| {
                Error::Config(format!("at most {SLOT_COUNT} groups with a pool can call rsccl.mem_pool() in one process"))
            })?;
            slots[i] = Some(heap.clone());
            i
        }
    };
    Ok((ALLOC_FNS[i] as usize, pool_free as *const () as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_is_deterministic_and_merges() {
        let mut r = Ranges::new(10 * ALIGN);
        let a = r.alloc(2 * ALIGN).unwrap();
        let b = r.alloc(1).unwrap(); // rounded up to ALIGN
        let c = r.alloc(3 * ALIGN).unwrap();
        assert_eq!((a, b, c), (0, 2 * ALIGN, 3 * ALIGN));
        assert_eq!(r.allocated, 6 * ALIGN);
        assert_eq!(r.alloc(5 * ALIGN), None, "only 4 units left");
        assert!(r.free(b));
        assert!(!r.free(b), "double free is refused");
        // b's hole is the lowest fit for one unit
        assert_eq!(r.alloc(ALIGN), Some(2 * ALIGN));
        assert!(r.free(2 * ALIGN));
        assert!(r.free(a));
        assert!(r.free(c));
        assert_eq!(r.allocated, 0);
        assert_eq!(r.peak, 6 * ALIGN);
        // Everything merged back into one range.
        assert_eq!(r.alloc(10 * ALIGN), Some(0));
    }

    #[test]
    fn merge_with_both_neighbours() {
        let mut r = Ranges::new(3 * ALIGN);
        let (a, b, c) = (r.alloc(ALIGN).unwrap(), r.alloc(ALIGN).unwrap(), r.alloc(ALIGN).unwrap());
        assert!(r.free(a) && r.free(c) && r.free(b));
        assert_eq!(r.free.len(), 1);
        assert_eq!(r.alloc(3 * ALIGN), Some(0));
    }

    #[test]
    fn same_sequence_same_offsets() {
        // Two "ranks" replaying the same allocations and frees get the same offsets.
        let run = || {
            let mut r = Ranges::new(1 << 30);
            let mut got = vec![];
            let mut live = vec![];
            for i in 0..200u64 {
                if i % 3 == 2 {
                    let off = live.remove((i as usize * 7) % live.len());
                    r.free(off);
                } else {
                    let off = r.alloc((i % 5 + 1) * (2 << 20) / 4).unwrap();
                    live.push(off);
                    got.push(off);
                }
            }
            got
        };
        assert_eq!(run(), run());
    }
}
