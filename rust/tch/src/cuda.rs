//! What rsccl needs from libtorch's CUDA side that tch does not offer: loading
//! libtorch_cuda (tch's link line may drop it, and then libtorch sees no GPU), the current
//! CUDA stream of a device (every collective is ordered after it), and making a device
//! current. Looked up at run time in libc10_cuda, so a CPU-only libtorch needs none of it.

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use rsccl_core::{Error, Result};

/// c10::cuda::CUDAStream as libtorch 2.11 lays it out (a c10::Stream: device type, device
/// index, stream id). Trivially copyable, so the Itanium ABI returns it in registers like
/// this #[repr(C)] struct.
#[repr(C)]
#[derive(Clone, Copy)]
struct CudaStreamRepr {
    device_type: i8,
    device_index: i8,
    id: i64,
}

struct Fns {
    /// c10::cuda::getCurrentCUDAStream(c10::DeviceIndex)
    current: unsafe extern "C" fn(i8) -> CudaStreamRepr,
    /// c10::cuda::CUDAStream::stream() const
    raw: unsafe extern "C" fn(*const CudaStreamRepr) -> *mut c_void,
    /// c10::cuda::set_device(c10::DeviceIndex, bool force)
    set_device: unsafe extern "C" fn(i8, bool),
}

fn dlsym(lib: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `lib` is a handle from dlopen; `name` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

fn fns() -> Option<&'static Fns> {
    static FNS: OnceLock<Option<Fns>> = OnceLock::new();
    FNS.get_or_init(|| {
        load_torch_cuda();
        // SAFETY: dlopen with a NUL-terminated name; RTLD_NOLOAD only finds a library that
        // is loaded already (libtorch_cuda pulls libc10_cuda in).
        let lib = unsafe { libc::dlopen(c"libc10_cuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if lib.is_null() {
            return None;
        }
        let current = dlsym(lib, c"_ZN3c104cuda20getCurrentCUDAStreamEa")?;
        let raw = dlsym(lib, c"_ZNK3c104cuda10CUDAStream6streamEv")?;
        let set_device = dlsym(lib, c"_ZN3c104cuda10set_deviceEab")?;
        // SAFETY: the symbols are these functions of libtorch 2.11 (names mangled from the
        // signatures above); the repr matches their argument and return types.
        unsafe {
            Some(Fns {
                current: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(i8) -> CudaStreamRepr>(current),
                raw: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const CudaStreamRepr) -> *mut c_void>(raw),
                set_device: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(i8, bool)>(set_device),
            })
        }
    })
    .as_ref()
}

/// Load libtorch_cuda (found on the library path, beside libtorch) if it is not loaded:
/// its static initializers register CUDA with libtorch. Linkers that drop unused libraries
/// (--as-needed, the default on most distributions) leave it out of tch programs, and
/// `tch::Cuda::is_available()` is then false on a GPU machine. Returns whether it is loaded.
pub fn load_torch_cuda() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| {
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process.
        !unsafe { libc::dlopen(c"libtorch_cuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null()
    })
}

fn missing() -> Error {
    Error::Cuda(
        "libtorch's CUDA library (libc10_cuda.so / libtorch_cuda.so) is not loaded: put torch's lib/ directory on \
         LD_LIBRARY_PATH, with a CUDA build of libtorch"
            .into(),
    )
}

/// The raw handle of libtorch's current CUDA stream on `device` (what
/// `torch.cuda.current_stream(device).cuda_stream` is in Python).
pub fn current_stream(device: i32) -> Result<u64> {
    let f = fns().ok_or_else(missing)?;
    let idx = i8::try_from(device).map_err(|_| Error::InvalidArgument(format!("CUDA device {device} is out of range")))?;
    // SAFETY: libtorch's functions (see `fns`); `s` lives across the call that reads it.
    let s = unsafe { (f.current)(idx) };
    Ok(unsafe { (f.raw)(&s) } as u64)
}

/// Make `device` libtorch's current device (torch.cuda.set_device).
pub fn set_device(device: i32) -> Result<()> {
    let f = fns().ok_or_else(missing)?;
    let idx = i8::try_from(device).map_err(|_| Error::InvalidArgument(format!("CUDA device {device} is out of range")))?;
    // SAFETY: libtorch's function (see `fns`); it raises no C++ exception for a valid index,
    // which the caller checked against the device count.
    unsafe { (f.set_device)(idx, false) };
    Ok(())
}
