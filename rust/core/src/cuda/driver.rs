//! Thin, checked access to the CUDA driver API (through cudarc's raw bindings, loaded at
//! run time). Nothing here panics when CUDA is absent: `available()` says whether the
//! driver library loads, and every call returns `Error::Cuda` naming the call on failure.

use std::ffi::CStr;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys as cu;

use crate::error::{Error, Result};

pub use cu::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUstream};

/// Whether libcuda loads in this process (cached). cudarc panics if a call is made without
/// it, so every entry point checks this first.
pub fn available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the driver library by its usual names.
    *PRESENT.get_or_init(|| unsafe { cu::is_culib_present() })
}

/// Turn a driver result into `Error::Cuda` naming `what` and the driver's own message.
pub fn check(r: cu::CUresult, what: &str) -> Result<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null).
    unsafe { cu::cuGetErrorString(r, &mut name) };
    let text = if name.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null results point at NUL-terminated static strings owned by the driver.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    };
    Err(Error::Cuda(format!("{what} failed: {text} ({r:?})")))
}

/// The primary context of one device (the one the CUDA runtime, hence torch, uses).
pub struct Device {
    pub ordinal: i32,
    pub dev: CUdevice,
    pub ctx: CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver synchronizes), and
// `Device` only hands it to driver calls.
unsafe impl Send for Device {}
// SAFETY: as above; `Device` has no interior mutability.
unsafe impl Sync for Device {}

impl Device {
    pub fn open(ordinal: i32) -> Result<Device> {
        if !available() {
            return Err(Error::Cuda("the CUDA driver library (libcuda.so.1) is not loadable in this process".into()));
        }
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            check(cu::cuInit(0), "cuInit")?;
            let mut count = 0;
            check(cu::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            if ordinal < 0 || ordinal >= count {
                return Err(Error::InvalidArgument(format!("CUDA device {ordinal} does not exist ({count} visible)")));
            }
            let mut dev: CUdevice = 0;
            check(cu::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            let mut ctx: CUcontext = std::ptr::null_mut();
            check(cu::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            Ok(Device { ordinal, dev, ctx })
        }
    }

    /// Make this device's context current on the calling thread for the guard's life,
    /// restoring the previous one after (the caller's thread may be on another device).
    pub fn bind(&self) -> Result<CtxGuard> {
        let mut cur: CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(unsafe { cu::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
        if cur == self.ctx {
            return Ok(CtxGuard { pushed: false });
        }
        // SAFETY: ctx is a retained primary context, valid until `Drop for Device`.
        check(unsafe { cu::cuCtxPushCurrent_v2(self.ctx) }, "cuCtxPushCurrent")?;
        Ok(CtxGuard { pushed: true })
    }

    pub fn attribute(&self, attr: cu::CUdevice_attribute) -> Result<i32> {
        let mut v = 0;
        // SAFETY: out-pointer to a local; dev is a valid device handle.
        check(unsafe { cu::cuDeviceGetAttribute(&mut v, attr, self.dev) }, "cuDeviceGetAttribute")?;
        Ok(v)
    }

    /// "sm_90" for compute capability 9.0.
    pub fn arch(&self) -> Result<String> {
        let major = self.attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = self.attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok(format!("sm_{major}{minor}"))
    }

    /// The PCI bus id, which names a GPU the same way in every process.
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: buf has the 32 bytes the call may write (NUL-terminated).
        check(unsafe { cu::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.dev) }, "cuDeviceGetPCIBusId")?;
        // SAFETY: the driver NUL-terminated it within the buffer.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// The device at PCI `bus` (another rank's, by `pci_bus_id`); None where that GPU is not
    /// visible to this process (CUDA_VISIBLE_DEVICES).
    pub fn peer_by_bus(&self, bus: &str) -> Option<CUdevice> {
        let name = std::ffi::CString::new(bus).ok()?;
        let mut peer: CUdevice = 0;
        // SAFETY: out-pointer to a local; `name` is NUL-terminated and outlives the call.
        (unsafe { cu::cuDeviceGetByPCIBusId(&mut peer, name.as_ptr()) } == cu::CUresult::CUDA_SUCCESS).then_some(peer)
    }

    /// Whether this GPU can map and access the memory of device `peer`: cuDeviceCanAccessPeer,
    /// which peer mappings (cuMemSetAccess of a peer's allocation) need.
    pub fn can_access_peer(&self, peer: CUdevice) -> Result<bool> {
        let mut can: std::ffi::c_int = 0;
        // SAFETY: out-pointer to a local; both are valid device handles of this process.
        check(unsafe { cu::cuDeviceCanAccessPeer(&mut can, self.dev, peer) }, "cuDeviceCanAccessPeer")?;
        Ok(can != 0)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: releases the reference taken in `open`.
        unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// Pops the context pushed by `Device::bind`, if any.
pub struct CtxGuard {
    pushed: bool,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: CUcontext = std::ptr::null_mut();
            // SAFETY: pops exactly the context this guard pushed on this thread.
            unsafe { cu::cuCtxPopCurrent_v2(&mut old) };
        }
    }
}

/// Whether `stream` (a raw handle, passed as an integer: it is never dereferenced here,
/// only handed to the driver) is being captured into a CUDA graph.
pub fn is_capturing(stream: u64) -> Result<bool> {
    let mut st = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: out-pointer to a local; the driver validates the handle, and querying capture
    // status is legal during capture.
    check(unsafe { cu::cuStreamIsCapturing(stream as CUstream, &mut st) }, "cuStreamIsCapturing")?;
    Ok(st != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

// RAII owners of the driver's handles. Each owns one raw handle, releases it in Drop (with
// its device's context current where the driver needs one), and is the one place that
// declares its kind of handle Send and Sync, so the structs built from them (the
// CUDA engine, its events, its kernels) are Send and Sync by construction.

/// A non-blocking stream of one device, destroyed on drop. Destroying a stream that still
/// has work queued is allowed: the driver releases it once that work is done.
pub struct Stream {
    raw: CUstream,
    dev: Arc<Device>,
}

// SAFETY: a stream handle may be used from any thread (the driver synchronizes its use);
// `Stream` only hands it to driver calls and destroys it once, in Drop.
unsafe impl Send for Stream {}
// SAFETY: as above; `Stream` has no interior mutability.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new stream that does not synchronize with the legacy default stream; `what` names
    /// the call in the error ("cuStreamCreate (send/recv)").
    pub fn non_blocking(dev: &Arc<Device>, what: &str) -> Result<Stream> {
        let _ctx = dev.bind()?;
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a non-blocking stream does not sync with stream 0.
        check(unsafe { cu::cuStreamCreate(&mut raw, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, what)?;
        Ok(Stream { raw, dev: dev.clone() })
    }

    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// Wait for the work queued so far; the caller made the device's context current.
    pub fn synchronize(&self) -> cu::CUresult {
        // SAFETY: a live stream of ours.
        unsafe { cu::cuStreamSynchronize(self.raw) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.dev.bind() {
            // SAFETY: destroys the stream made in `non_blocking`, exactly once.
            unsafe { cu::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// An event of one device (no timing), destroyed on drop. Destroying an event whose record
/// has not completed is allowed: the driver releases it once the record is done.
pub struct Event {
    raw: CUevent,
    dev: Arc<Device>,
}

// SAFETY: an event handle may be used from any thread (the driver synchronizes its use);
// `Event` only hands it to driver calls and destroys it once, in Drop.
unsafe impl Send for Event {}
// SAFETY: as above; `Event` has no interior mutability.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(dev: &Arc<Device>) -> Result<Event> {
        let _ctx = dev.bind()?;
        let mut raw: CUevent = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(unsafe { cu::cuEventCreate(&mut raw, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
        Ok(Event { raw, dev: dev.clone() })
    }

    pub fn raw(&self) -> CUevent {
        self.raw
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.dev.bind() {
            // SAFETY: an event this struct made in `new` and owns, destroyed exactly once.
            unsafe { cu::cuEventDestroy_v2(self.raw) };
        }
    }
}

/// A loaded module (cubin or fat binary), unloaded on drop.
pub struct Module {
    raw: CUmodule,
}

// SAFETY: a module handle may be used from any thread; `Module` only looks functions up in
// it and unloads it once, in Drop.
unsafe impl Send for Module {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for Module {}

impl Module {
    /// Load an image; the caller made the device's context current.
    ///
    /// # Safety
    /// `image` points at a complete cubin or fat binary, 8-byte aligned, alive during the
    /// call (the driver copies what it loads).
    pub unsafe fn load(image: *const std::ffi::c_void, what: &str) -> Result<Module> {
        let mut raw: CUmodule = std::ptr::null_mut();
        // SAFETY: the caller's promise on `image`; out-pointer to a local.
        check(unsafe { cu::cuModuleLoadData(&mut raw, image) }, what)?;
        Ok(Module { raw })
    }

    /// The entry point `name` (valid while this module is loaded).
    pub fn function(&self, name: &CStr, what: &str) -> Result<Function> {
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: the module is loaded; `name` is NUL-terminated.
        check(unsafe { cu::cuModuleGetFunction(&mut f, self.raw, name.as_ptr()) }, what)?;
        Ok(Function(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: a module this struct loaded and still owns; its users (the engine)
        // synchronized before dropping it.
        unsafe { cu::cuModuleUnload(self.raw) };
    }
}

/// An entry point of a loaded `Module`: a handle, not an owner; valid while its module is
/// loaded (`Kernels` keeps the two together).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Function(CUfunction);

// SAFETY: a function handle may be used from any thread (launches and occupancy queries
// are synchronized by the driver); it is never freed (its module is).
unsafe impl Send for Function {}
// SAFETY: as above; a plain handle.
unsafe impl Sync for Function {}

impl Function {
    pub fn raw(self) -> CUfunction {
        self.0
    }
}

/// Device memory of one device (cuMemAlloc), freed on drop. Its owner makes sure that no
/// queued work still uses it by then (the NCCL engine waits for its streams first). The
/// address is a plain integer to the host, so nothing needs declaring Send or Sync here.
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    dev: Arc<Device>,
}

impl DeviceBuffer {
    /// `len` bytes (more than 0), not initialized; `what` names the call in the error.
    pub fn new(dev: &Arc<Device>, len: usize, what: &str) -> Result<DeviceBuffer> {
        let _ctx = dev.bind()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: out-pointer to a local.
        check(unsafe { cu::cuMemAlloc_v2(&mut ptr, len) }, what)?;
        Ok(DeviceBuffer { ptr, dev: dev.clone() })
    }

    /// The buffer's device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.dev.bind() {
            // SAFETY: frees the allocation made in `new`, once; its owner made sure that
            // nothing queued still uses it.
            unsafe { cu::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Pinned host memory mapped into the device's address space (cuMemHostAlloc with
/// DEVICEMAP | PORTABLE), zeroed, freed on drop. The host and the GPU both read and write
/// it, so the host side only gets at it through atomics (`u32_at`, `u64_at`) or as the
/// source or target of a copy engine's DMA (`host_ptr`).
pub struct PinnedPage {
    host: *mut u8,
    dev_ptr: CUdeviceptr,
    len: usize,
    dev: Arc<Device>,
}

// SAFETY: the page is plain memory valid until Drop, reachable from any thread; the host
// only accesses it through atomics, which are Sync, or through the raw address handed to
// the driver.
unsafe impl Send for PinnedPage {}
// SAFETY: as above.
unsafe impl Sync for PinnedPage {}

impl PinnedPage {
    /// `len` bytes (at least 8; the driver's allocation is page-aligned), zeroed.
    pub fn new(dev: &Arc<Device>, len: usize) -> Result<PinnedPage> {
        let _ctx = dev.bind()?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: allocates `len` bytes of pinned, device-mapped host memory into `p`.
        check(unsafe { cu::cuMemHostAlloc(&mut p, len, cu::CU_MEMHOSTALLOC_DEVICEMAP | cu::CU_MEMHOSTALLOC_PORTABLE) }, "cuMemHostAlloc")?;
        // SAFETY: `p` points at `len` writable bytes, used by nothing else yet.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
        // Owned from here, so a failure below frees the page (Drop).
        let mut page = PinnedPage { host: p as *mut u8, dev_ptr: 0, len, dev: dev.clone() };
        // SAFETY: `p` was allocated with DEVICEMAP above.
        check(unsafe { cu::cuMemHostGetDevicePointer_v2(&mut page.dev_ptr, p, 0) }, "cuMemHostGetDevicePointer")?;
        Ok(page)
    }

    /// The page's address in the device's address space.
    pub fn dev_ptr(&self) -> CUdeviceptr {
        self.dev_ptr
    }

    /// The `i`-th u32 of the page. Panics out of bounds.
    pub fn u32_at(&self, i: usize) -> &AtomicU32 {
        assert!((i + 1) * 4 <= self.len, "u32 {i} is outside a pinned page of {} bytes", self.len);
        // SAFETY: in bounds (above) and 4-aligned (the page is page-aligned); the memory
        // lives as long as `&self`, and every host access to it goes through atomics.
        unsafe { AtomicU32::from_ptr(self.host.add(4 * i) as *mut u32) }
    }

    /// The `i`-th u64 of the page. Panics out of bounds.
    pub fn u64_at(&self, i: usize) -> &AtomicU64 {
        assert!((i + 1) * 8 <= self.len, "u64 {i} is outside a pinned page of {} bytes", self.len);
        // SAFETY: as in `u32_at`, 8-aligned.
        unsafe { AtomicU64::from_ptr(self.host.add(8 * i) as *mut u64) }
    }

    /// The host address of byte `off`, for a copy engine's DMA to or from the page. Panics
    /// out of bounds.
    pub fn host_ptr(&self, off: usize) -> *mut std::ffi::c_void {
        assert!(off < self.len, "byte {off} is outside a pinned page of {} bytes", self.len);
        // SAFETY: in bounds (above).
        unsafe { self.host.add(off) as *mut std::ffi::c_void }
    }
}

impl Drop for PinnedPage {
    fn drop(&mut self) {
        let _ctx = self.dev.bind();
        // SAFETY: frees the allocation made in `new`, once; its users (the engine's
        // kernels and copies) finished before the engine dropped it.
        unsafe { cu::cuMemFreeHost(self.host as *mut std::ffi::c_void) };
    }
}
