//! NVRTC: the kernels compiled for the GPU's arch at group creation, cached on disk.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::sys as nv;

use super::{HEADERS, MODULES};
use crate::error::{Error, Result};

// -- NVRTC ----------------------------------------------------------------------------------

fn nvrtc_check(r: nv::nvrtcResult, what: &str) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: returns a pointer to a static string.
    let s = unsafe { CStr::from_ptr(nv::nvrtcGetErrorString(r)) }.to_string_lossy().into_owned();
    Err(Error::Cuda(format!("{what} failed: {s}")))
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: out-pointers to locals.
    nvrtc_check(unsafe { nv::nvrtcVersion(&mut a, &mut b) }, "nvrtcVersion")?;
    Ok((a, b))
}

fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "-default-device".into(), "--std=c++17".into(), "-lineinfo".into()]
}

fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen NVRTC by its usual names.
    if !unsafe { nv::is_culib_present() } {
        return Err(Error::Cuda("NVRTC (libnvrtc.so.13) is not loadable: rsccl finds it in torch's nvidia-cuda-nvrtc package".into()));
    }
    Ok(())
}

/// Compile one module (`name`, `source`) for `arch` ("sm_90") to a cubin. Needs libnvrtc
/// (loaded by the Python layer from torch's CUDA packages), not a GPU.
pub fn compile_module(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    nvrtc_present()?;
    let src = CString::new(source).map_err(|_| Error::Internal("kernel source has a NUL".into()))?;
    let file = CString::new(format!("{name}.cu")).unwrap();
    let hnames: Vec<CString> = HEADERS.iter().map(|h| CString::new(h.0).unwrap()).collect();
    let hsrcs: Vec<CString> = HEADERS.iter().map(|h| CString::new(h.1).unwrap()).collect();
    let hname_ptrs: Vec<*const std::ffi::c_char> = hnames.iter().map(|h| h.as_ptr()).collect();
    let hsrc_ptrs: Vec<*const std::ffi::c_char> = hsrcs.iter().map(|h| h.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings; the header arrays have HEADERS.len() entries
    // and outlive the call.
    nvrtc_check(
        unsafe {
            nv::nvrtcCreateProgram(&mut prog, src.as_ptr(), file.as_ptr(), HEADERS.len() as i32, hsrc_ptrs.as_ptr(), hname_ptrs.as_ptr())
        },
        "nvrtcCreateProgram",
    )?;
    struct Prog(nv::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: destroys the program created above exactly once.
            unsafe { nv::nvrtcDestroyProgram(&mut self.0) };
        }
    }
    let prog = Prog(prog);
    let opts: Vec<CString> = options(arch).into_iter().map(|o| CString::new(o).unwrap()).collect();
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `ptrs` holds valid C strings that outlive the call.
    let r = unsafe { nv::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        let mut n = 0usize;
        // SAFETY: out-pointer; then a buffer of the reported size.
        unsafe { nv::nvrtcGetProgramLogSize(prog.0, &mut n) };
        let mut log = vec![0u8; n.max(1)];
        // SAFETY: `log` has the size NVRTC asked for.
        unsafe { nv::nvrtcGetProgramLog(prog.0, log.as_mut_ptr() as *mut std::ffi::c_char) };
        let text = String::from_utf8_lossy(&log).trim_end_matches('\0').to_string();
        return Err(Error::Cuda(format!("compiling rsccl's kernels ({name}.cu) for {arch} failed:\n{text}")));
    }
    let mut n = 0usize;
    // SAFETY: out-pointer to a local.
    nvrtc_check(unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut n) }, "nvrtcGetCUBINSize")?;
    let mut cubin = vec![0u8; n];
    // SAFETY: `cubin` has the size NVRTC reported.
    nvrtc_check(unsafe { nv::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut std::ffi::c_char) }, "nvrtcGetCUBIN")?;
    Ok(cubin)
}

/// Compile every module for `arch`, in parallel (one thread per module, at most the
/// machine's cores at once, the largest first): (module, cubin) in MODULES order.
pub fn compile(arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    nvrtc_present()?;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(MODULES.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = parking_lot::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((name, src)) = MODULES.get(i) else { break };
                let r = compile_module(name, src, arch);
                done.lock().push((i, r));
            });
        }
    });
    let mut done = done.into_inner();
    done.sort_by_key(|d| d.0);
    done.into_iter().map(|(i, r)| r.map(|c| (MODULES[i].0, c))).collect()
}

/// FNV-1a: a stable hash for the cache key (no new dependency for one checksum).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Where compiled kernels are cached (config::kernel_cache_dir).
pub fn cache_dir() -> Option<PathBuf> {
    crate::config::kernel_cache_dir(&|k| std::env::var_os(k))
}

/// The hash naming `arch`'s cache files: every source, NVRTC's version and the options.
fn cache_key(arch: &str) -> Result<u64> {
    let (ma, mi) = nvrtc_version()?;
    let opts = options(arch).join(" ");
    let mut parts: Vec<&[u8]> = vec![arch.as_bytes(), opts.as_bytes()];
    let (ma, mi) = (ma.to_le_bytes(), mi.to_le_bytes());
    parts.extend([&ma[..], &mi[..]]);
    parts.extend(HEADERS.iter().chain(MODULES.iter()).flat_map(|(n, s)| [n.as_bytes(), s.as_bytes()]));
    Ok(fnv1a(&parts))
}

/// The cache file of `module` for `arch`, in `dir`.
fn cache_file(dir: &Path, key: u64, module: &str, arch: &str) -> PathBuf {
    dir.join(format!("kernels-{key:016x}-{module}-{arch}.cubin"))
}

/// The cache files of `arch`'s kernels, one per module (None if there is no cache
/// directory).
pub fn cache_paths(arch: &str) -> Result<Option<Vec<PathBuf>>> {
    let key = cache_key(arch)?;
    Ok(cache_dir().map(|d| MODULES.iter().map(|(m, _)| cache_file(&d, key, m, arch)).collect()))
}

/// Every module's cubin from the cache, or None if any is missing.
fn read_cached(dir: &Path, key: u64, arch: &str) -> Option<Vec<(&'static str, Vec<u8>)>> {
    MODULES.iter().map(|(m, _)| std::fs::read(cache_file(dir, key, m, arch)).ok().filter(|b| !b.is_empty()).map(|b| (*m, b))).collect()
}

/// An exclusive flock on `path`, held until the file is dropped (and released by the
/// kernel if the process dies): one process per host compiles a set of kernels.
fn lock_file(path: &Path, arch: &str) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| Error::os(format!("opening {}", path.display()), e))?;
    let lock = |how: i32| loop {
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), how) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    match lock(libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            tracing::info!(arch, lock = %path.display(), "rsccl: another process of this host compiles the kernels; waiting for its files");
            lock(libc::LOCK_EX).map_err(|e| Error::os(format!("locking {}", path.display()), e))?;
        }
        Err(e) => return Err(Error::os(format!("locking {}", path.display()), e)),
    }
    Ok(f)
}

/// The cubins of `arch`'s modules, from the disk cache or compiled with NVRTC (then cached:
/// each written to a temporary name and renamed, so no process reads a partial file).
/// Compilation happens under the lock file `kernels-<key>-<arch>.lock` of the cache
/// directory: the first process compiles, the others wait for the lock and then read its
/// files. Returns the cubins and whether they came from the cache.
/// Each family's name and cubin.
pub type Cubins = Vec<(&'static str, Vec<u8>)>;

pub fn cubin_for(arch: &str) -> Result<(Cubins, bool)> {
    let key = cache_key(arch)?;
    let Some(dir) = cache_dir() else {
        return Ok((compile_logged(arch)?, false));
    };
    if let Some(c) = read_cached(&dir, key, arch) {
        return Ok((c, true));
    }
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "rsccl: cannot create the kernel cache directory; compiling without a cache");
        return Ok((compile_logged(arch)?, false));
    }
    let _lock = match lock_file(&dir.join(format!("kernels-{key:016x}-{arch}.lock")), arch) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(error = %e, "rsccl: cannot lock the kernel cache; compiling without waiting for other processes");
            None
        }
    };
    // Another process may have compiled them while this one waited.
    if let Some(c) = read_cached(&dir, key, arch) {
        return Ok((c, true));
    }
    let cubins = compile_logged(arch)?;
    for (m, cubin) in &cubins {
        let p = cache_file(&dir, key, m, arch);
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, cubin).and_then(|_| std::fs::rename(&tmp, &p)).is_err() {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %p.display(), "rsccl: could not cache compiled kernels");
        }
    }
    Ok((cubins, false))
}

fn compile_logged(arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let t = std::time::Instant::now();
    let cubins = compile(arch)?;
    let bytes: usize = cubins.iter().map(|c| c.1.len()).sum();
    tracing::info!(arch, ms = t.elapsed().as_millis() as u64, bytes, "rsccl: compiled the kernels with NVRTC");
    Ok(cubins)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_lock_makes_a_second_process_wait() {
        // flock locks belong to the open file, so two opens in one process exclude each
        // other as two processes' do.
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = std::env::temp_dir().join(format!("rsccl-lock-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kernels-test-sm_90.lock");
        let first = lock_file(&path, "sm_90").unwrap();
        let released = AtomicBool::new(false);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let _second = lock_file(&path, "sm_90").unwrap();
                released.load(Ordering::SeqCst)
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            released.store(true, Ordering::SeqCst);
            drop(first);
            assert!(waiter.join().unwrap(), "the second lock was granted while the first was held");
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cache_key_changes_with_input() {
        assert_ne!(fnv1a(&[b"a", b"b"]), fnv1a(&[b"ab"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
