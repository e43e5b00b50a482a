//! Thin, checked access to the CUDA driver API (through cudarc's raw bindings, loaded at
//! run time). Nothing here panics when CUDA is absent: `available()` says whether the
//! driver library loads, and every call returns `Error::Cuda` naming the call on failure.

use std::ffi::CStr;
use std::sync::OnceLock;

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
