//! Host symmetric regions: one anonymous shared-memory file (memfd) per group and host,
//! created by the host's first rank, handed to the others as a descriptor, and mapped by
//! every local rank. Nothing is named in /dev/shm or the filesystem, so nothing can leak
//! there, whatever happens to the processes.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// One mapping of a shared region. Unmapped on drop.
pub struct HostRegion {
    base: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory; concurrent access to it goes through raw
// pointers, atomics and UnsafeCells under the protocols of `memory::layout`.
unsafe impl Send for HostRegion {}
// SAFETY: as above; `&HostRegion` only hands out raw pointers.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Create a region of `len` bytes with its memory allocated now (so no collective
    /// ever faults in new pages), sealed against resizing (a peer cannot shrink it under
    /// us and turn our accesses into SIGBUS).
    pub fn create(len: usize) -> Result<HostRegion> {
        let name = c"rsccl-host-region";
        // SAFETY: `name` is a valid C string; flags are valid for memfd_create.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(Error::last_os("memfd_create for the host region"));
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscalls on a descriptor we own.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
                return Err(Error::last_os(format!("sizing the host region to {len} bytes")));
            }
            let rc = libc::fallocate(fd.as_raw_fd(), 0, 0, len as libc::off_t);
            if rc != 0 {
                return Err(Error::last_os(format!(
                    "allocating {len} bytes of shared memory for the host region (is /dev/shm or memory too small?)"
                )));
            }
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
                return Err(Error::last_os("sealing the host region"));
            }
        }
        Self::map(fd, len)
    }

    /// Map a region received from the rank that created it; checks its size first.
    pub fn open(fd: OwnedFd, len: usize) -> Result<HostRegion> {
        // SAFETY: stat is plain old data; fstat writes it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is a valid descriptor and `st` is writable.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::last_os("inspecting the host region received from the local leader"));
        }
        if st.st_size as usize != len {
            return Err(Error::Internal(format!(
                "host region is {} bytes, expected {len}: local ranks disagree on the layout",
                st.st_size
            )));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<HostRegion> {
        // SAFETY: mapping a descriptor we own for `len` bytes, which its size covers.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os(format!("mapping the {len}-byte host region")));
        }
        let base = NonNull::new(p as *mut u8).ok_or_else(|| Error::Internal("mmap returned null".into()))?;
        Ok(HostRegion { base, len, fd })
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Pointer `offset` bytes into the region. Panics (a bug) if out of bounds.
    pub fn at(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len, "region offset {offset} beyond {}", self.len);
        // SAFETY: within the mapping, checked above.
        unsafe { self.base.as_ptr().add(offset) }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `map`; nothing uses it after
        // drop (the engine owning this region has stopped its threads).
        unsafe {
            libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_share_and_reopen() {
        let r = HostRegion::create(1 << 16).unwrap();
        // SAFETY: test-only writes within the mapping.
        unsafe { *r.at(100) = 42 };
        // SAFETY: dup of a valid descriptor, owned by the OwnedFd.
        let dup = unsafe { OwnedFd::from_raw_fd(libc::dup(r.fd().as_raw_fd())) };
        let r2 = HostRegion::open(dup, 1 << 16).unwrap();
        // SAFETY: test-only read within the mapping.
        assert_eq!(unsafe { *r2.at(100) }, 42);
        // SAFETY: dup of a valid descriptor.
        let dup = unsafe { OwnedFd::from_raw_fd(libc::dup(r.fd().as_raw_fd())) };
        assert!(HostRegion::open(dup, 1 << 20).is_err());
        // Sealed: the region cannot be shrunk.
        // SAFETY: plain syscall on a valid descriptor.
        assert_ne!(unsafe { libc::ftruncate(r.fd().as_raw_fd(), 0) }, 0);
    }
}
