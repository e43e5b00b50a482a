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

/// NVRTC's options for `arch`; `lineinfo` (RSCCL_KERNEL_LINEINFO=1, config::kernel_lineinfo)
/// adds line info, which makes the image 3x larger, so it is off by default.
fn options(arch: &str, lineinfo: bool) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "-default-device".into(), "--std=c++17".into()];
    if lineinfo {
        o.push("-lineinfo".into());
    }
    o
}

fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen NVRTC by its usual names.
    if !unsafe { nv::is_culib_present() } {
        return Err(Error::Cuda("NVRTC (libnvrtc.so.13) is not loadable: rsccl finds it in torch's nvidia-cuda-nvrtc package".into()));
    }
    Ok(())
}

/// Compile one module (`name`, `source`) for `arch` ("sm_90") to a cubin, with line info
/// where `lineinfo`. Needs libnvrtc (loaded by the Python layer from torch's CUDA
/// packages), not a GPU.
pub fn compile_module(name: &str, source: &str, arch: &str, lineinfo: bool) -> Result<Vec<u8>> {
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
    let opts: Vec<CString> = options(arch, lineinfo).into_iter().map(|o| CString::new(o).unwrap()).collect();
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
/// machine's cores at once, the largest first): (module, cubin) in MODULES order. Line
/// info as RSCCL_KERNEL_LINEINFO says.
pub fn compile(arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    compile_with(arch, crate::config::kernel_lineinfo_from_env()?)
}

fn compile_with(arch: &str, lineinfo: bool) -> Result<Vec<(&'static str, Vec<u8>)>> {
    nvrtc_present()?;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(MODULES.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = parking_lot::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((name, src)) = MODULES.get(i) else { break };
                let r = compile_module(name, src, arch, lineinfo);
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

/// The hash naming `arch`'s cache files: every source, NVRTC's version and the options
/// (line info or not among them).
fn cache_key(arch: &str, lineinfo: bool) -> Result<u64> {
    Ok(key_of(arch, lineinfo, nvrtc_version()?))
}

/// `cache_key` for NVRTC `version`.
fn key_of(arch: &str, lineinfo: bool, version: (i32, i32)) -> u64 {
    let opts = options(arch, lineinfo).join(" ");
    let mut parts: Vec<&[u8]> = vec![arch.as_bytes(), opts.as_bytes()];
    let (ma, mi) = (version.0.to_le_bytes(), version.1.to_le_bytes());
    parts.extend([&ma[..], &mi[..]]);
    parts.extend(HEADERS.iter().chain(MODULES.iter()).flat_map(|(n, s)| [n.as_bytes(), s.as_bytes()]));
    fnv1a(&parts)
}

/// The cache file of `module` for `arch`, in `dir`.
fn cache_file(dir: &Path, key: u64, module: &str, arch: &str) -> PathBuf {
    dir.join(format!("kernels-{key:016x}-{module}-{arch}.cubin"))
}

/// The cache files of `arch`'s kernels, one per module (None if there is no cache
/// directory).
pub fn cache_paths(arch: &str) -> Result<Option<Vec<PathBuf>>> {
    let key = cache_key(arch, crate::config::kernel_lineinfo_from_env()?)?;
    Ok(cache_dir().map(|d| MODULES.iter().map(|(m, _)| cache_file(&d, key, m, arch)).collect()))
}

/// Every module's cubin from the cache, or None if any is missing or fails its seal.
fn read_cached(dir: &Path, key: u64, arch: &str) -> Option<Vec<(&'static str, Vec<u8>)>> {
    MODULES.iter().map(|(m, _)| std::fs::read(cache_file(dir, key, m, arch)).ok().and_then(unseal).map(|b| (*m, b))).collect()
}

/// The trailer of a cache file: SEAL, then the cubin's FNV-1a, little-endian.
const SEAL: &[u8; 8] = b"rsccl-cb";

/// A cubin as the cache stores it: its bytes, then SEAL and their hash. The driver does not
/// always refuse a damaged image cleanly (a truncated cached cubin crashed a rank with SIGSEGV
/// at start-up on H100s, tests/gpu/test_gpu_kernels.py, 2026-11-26), so no cached file reaches it unchecked.
fn seal(cubin: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(cubin.len() + 16);
    b.extend_from_slice(cubin);
    b.extend_from_slice(SEAL);
    b.extend_from_slice(&fnv1a(&[cubin]).to_le_bytes());
    b
}

/// The cubin of a cache file, None when it is empty, truncated or changed since `seal`.
fn unseal(mut file: Vec<u8>) -> Option<Vec<u8>> {
    let body = file.len().checked_sub(16).filter(|&n| n > 0)?;
    let (cubin, trailer) = file.split_at(body);
    (trailer[..8] == SEAL[..] && trailer[8..] == fnv1a(&[cubin]).to_le_bytes()).then(|| {
        file.truncate(body);
        file
    })
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

/// Each family's name and cubin.
pub type Cubins = Vec<(&'static str, Vec<u8>)>;

/// Each family's name and image, as a loader takes them.
pub type Images<'a> = [(&'static str, &'a [u8])];

/// Where a set of cubins is cached: the directory (None: no cache) and the key of its
/// files (`cache_key`).
struct Cache<'a> {
    dir: Option<&'a Path>,
    key: u64,
    arch: &'a str,
}

impl Cache<'_> {
    fn file(&self, dir: &Path, module: &str) -> PathBuf {
        cache_file(dir, self.key, module, self.arch)
    }

    fn lock_path(&self, dir: &Path) -> PathBuf {
        dir.join(format!("kernels-{:016x}-{}.lock", self.key, self.arch))
    }

    /// The cubins from the cache, or compiled by `compile` (then cached: each written to a
    /// temporary name and renamed, so no process reads a partial file), and whether they
    /// came from the cache. Compilation happens under the lock file
    /// `kernels-<key>-<arch>.lock` of the cache directory: the first process compiles, the
    /// others wait for the lock and then read its files. `rejected`: cubins read from the
    /// cache that did not load here; cached files equal to them are not taken again but
    /// replaced (files another process has replaced meanwhile are taken).
    fn cubins(&self, compile: &dyn Fn() -> Result<Cubins>, rejected: Option<&Cubins>) -> Result<(Cubins, bool)> {
        let Some(dir) = self.dir else {
            return Ok((compile()?, false));
        };
        let usable = |c: Option<Cubins>| c.filter(|c| Some(c) != rejected);
        if let Some(c) = usable(read_cached(dir, self.key, self.arch)) {
            return Ok((c, true));
        }
        if let Err(e) = std::fs::create_dir_all(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "rsccl: cannot create the kernel cache directory; compiling without a cache");
            return Ok((compile()?, false));
        }
        let _lock = match lock_file(&self.lock_path(dir), self.arch) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(error = %e, "rsccl: cannot lock the kernel cache; compiling without waiting for other processes");
                None
            }
        };
        // Another process may have compiled them while this one waited (or replaced the
        // rejected ones).
        match read_cached(dir, self.key, self.arch) {
            Some(c) if Some(&c) == rejected => {
                for (m, _) in &c {
                    let p = self.file(dir, m);
                    if let Err(e) = std::fs::remove_file(&p) {
                        tracing::warn!(path = %p.display(), error = %e, "rsccl: could not delete a cached kernel file that did not load");
                    }
                }
            }
            Some(c) => return Ok((c, true)),
            None => {}
        }
        let cubins = compile()?;
        for (m, cubin) in &cubins {
            let p = self.file(dir, m);
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, seal(cubin)).and_then(|_| std::fs::rename(&tmp, &p)).is_err() {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!(path = %p.display(), "rsccl: could not cache compiled kernels");
            }
        }
        Ok((cubins, false))
    }

    /// The cubins made into what `load` makes of them (the loaded modules). Cached cubins
    /// that `load` refuses (a truncated or damaged file, one another tool wrote) are
    /// replaced by a fresh compilation, once: a bad file does not fail every later group.
    /// Returns what `load` made, the cubins' bytes, and whether they came from the cache.
    fn load<M>(&self, compile: &dyn Fn() -> Result<Cubins>, load: impl Fn(&Images<'_>) -> Result<M>) -> Result<(M, usize, bool)> {
        fn images(c: &Cubins) -> Vec<(&'static str, &[u8])> {
            c.iter().map(|(m, b)| (*m, b.as_slice())).collect()
        }
        let bytes = |c: &Cubins| c.iter().map(|c| c.1.len()).sum::<usize>();
        let (cubins, cached) = self.cubins(compile, None)?;
        let refused = match load(&images(&cubins)) {
            Ok(m) => return Ok((m, bytes(&cubins), cached)),
            Err(e) if cached => e,
            Err(e) => return Err(e),
        };
        tracing::warn!(arch = self.arch, key = format!("{:016x}", self.key), error = %refused, "rsccl: the cached kernels did not load; compiling them again");
        let (fresh, cached) = self.cubins(compile, Some(&cubins))?;
        match load(&images(&fresh)) {
            Ok(m) => Ok((m, bytes(&fresh), cached)),
            Err(e) => Err(Error::Cuda(format!(
                "{e} (kernels {} for {}, after the cached ones did not load: {refused})",
                if cached { "replaced in the cache by another process" } else { "compiled again with NVRTC" },
                self.arch
            ))),
        }
    }
}

/// The cubins of `arch`'s modules, from the disk cache or compiled with NVRTC (then
/// cached), and whether they came from the cache (`Cache::cubins`). Line info as
/// RSCCL_KERNEL_LINEINFO says.
pub fn cubin_for(arch: &str) -> Result<(Cubins, bool)> {
    let lineinfo = crate::config::kernel_lineinfo_from_env()?;
    let dir = cache_dir();
    let cache = Cache { dir: dir.as_deref(), key: cache_key(arch, lineinfo)?, arch };
    cache.cubins(&|| compile_logged(arch, lineinfo), None)
}

/// `arch`'s kernels as NVRTC makes them, loaded by `load` (the caller made the device's
/// context current): from the disk cache, or compiled and cached; cached ones that do not
/// load are compiled again, once (`Cache::load`). Returns what `load` made, the bytes of
/// device code, and whether it came from the cache.
pub fn load<M>(arch: &str, load: impl Fn(&Images<'_>) -> Result<M>) -> Result<(M, usize, bool)> {
    let lineinfo = crate::config::kernel_lineinfo_from_env()?;
    let dir = cache_dir();
    let cache = Cache { dir: dir.as_deref(), key: cache_key(arch, lineinfo)?, arch };
    cache.load(&|| compile_logged(arch, lineinfo), load)
}

fn compile_logged(arch: &str, lineinfo: bool) -> Result<Cubins> {
    let t = std::time::Instant::now();
    let cubins = compile_with(arch, lineinfo)?;
    let bytes: usize = cubins.iter().map(|c| c.1.len()).sum();
    tracing::info!(arch, lineinfo, ms = t.elapsed().as_millis() as u64, bytes, "rsccl: compiled the kernels with NVRTC");
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
        // Line info is opt-in, and a cubin with it is cached under another name.
        assert!(!options("sm_90", false).iter().any(|o| o == "-lineinfo"));
        assert!(options("sm_90", true).iter().any(|o| o == "-lineinfo"));
        assert_ne!(key_of("sm_90", false, (13, 0)), key_of("sm_90", true, (13, 0)));
        assert_eq!(key_of("sm_90", true, (13, 0)), key_of("sm_90", true, (13, 0)));
        assert_ne!(key_of("sm_90", false, (13, 0)), key_of("sm_90", false, (13, 1)));
    }

    /// A scratch cache directory, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(what: &str) -> Scratch {
            let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            let d = std::env::temp_dir().join(format!("rsccl-{what}-{}-{seed}", std::process::id()));
            std::fs::create_dir_all(&d).unwrap();
            Scratch(d)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Cubins whose bytes say what they are ("<tag> <module>"), as a compiler stands-in.
    fn cubins(tag: &str) -> Cubins {
        MODULES.iter().map(|(m, _)| (*m, format!("{tag} {m}").into_bytes())).collect()
    }

    /// A loader stand-in that refuses every image starting with one of `bad`, as the
    /// driver refuses a damaged cubin; it returns the images it loaded.
    fn loader(bad: &'static [&'static str]) -> impl Fn(&Images<'_>) -> Result<Vec<Vec<u8>>> {
        move |images| {
            images
                .iter()
                .map(|(m, b)| {
                    if bad.iter().any(|t| b.starts_with(t.as_bytes())) {
                        Err(Error::Cuda(format!("cuModuleLoadData({m}) failed: CUDA_ERROR_INVALID_IMAGE")))
                    } else {
                        Ok(b.to_vec())
                    }
                })
                .collect()
        }
    }

    /// A cached set that the driver refuses (here one file sealed over bad code) is
    /// compiled again once, the bad files replaced on disk, and the fresh code loaded.
    #[test]
    fn a_cached_image_that_does_not_load_is_compiled_again_once() {
        let dir = Scratch::new("cache-refused");
        let cache = Cache { dir: Some(&dir.0), key: 0x5eed, arch: "sm_90" };
        let compiled = std::sync::atomic::AtomicUsize::new(0);
        let compile = || {
            compiled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(cubins("good"))
        };
        // The first group compiles and caches; the second reads the cache.
        let (m, bytes, cached) = cache.load(&compile, loader(&[])).unwrap();
        assert_eq!((m.len(), cached, compiled.load(std::sync::atomic::Ordering::SeqCst)), (MODULES.len(), false, 1));
        assert_eq!(bytes, cubins("good").iter().map(|c| c.1.len()).sum::<usize>());
        let (_, _, cached) = cache.load(&compile, loader(&[])).unwrap();
        assert_eq!((cached, compiled.load(std::sync::atomic::Ordering::SeqCst)), (true, 1));
        // One file holds code the driver refuses (another driver's, say), sealed as valid.
        let damaged = cache.file(&dir.0, MODULES[3].0);
        std::fs::write(&damaged, seal(b"bad code")).unwrap();
        let (m, _, cached) = cache.load(&compile, loader(&["bad"])).unwrap();
        assert_eq!((cached, compiled.load(std::sync::atomic::Ordering::SeqCst)), (false, 2));
        assert_eq!(m, cubins("good").into_iter().map(|c| c.1).collect::<Vec<_>>(), "the fresh code is what was loaded");
        assert_eq!(std::fs::read(&damaged).unwrap(), seal(format!("good {}", MODULES[3].0).as_bytes()), "the damaged file is replaced");
        // And the next group takes the repaired cache without compiling.
        let (_, _, cached) = cache.load(&compile, loader(&["bad"])).unwrap();
        assert_eq!((cached, compiled.load(std::sync::atomic::Ordering::SeqCst)), (true, 2));
    }

    /// Code that fails to load even when freshly compiled is an error naming both
    /// failures, after one compilation: no loop. Code compiled now that fails is not
    /// compiled again.
    #[test]
    fn a_fresh_compilation_that_does_not_load_either_is_an_error_after_one_retry() {
        let dir = Scratch::new("cache-refused-twice");
        let cache = Cache { dir: Some(&dir.0), key: 0xbad, arch: "sm_90" };
        for (m, _) in MODULES {
            std::fs::write(cache.file(&dir.0, m), seal(b"bad old")).unwrap();
        }
        let compiled = std::sync::atomic::AtomicUsize::new(0);
        let compile = || {
            compiled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(cubins("worse"))
        };
        let e = cache.load(&compile, loader(&["bad", "worse"])).unwrap_err().to_string();
        assert_eq!(compiled.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(e.contains("compiled again with NVRTC") && e.contains("after the cached ones did not load"), "{e}");
        assert!(e.matches("CUDA_ERROR_INVALID_IMAGE").count() == 2, "{e}");
        // Without a cache, a refusal is the error itself, with no second compilation.
        let nocache = Cache { dir: None, key: 0xbad, arch: "sm_90" };
        let e = nocache.load(&compile, loader(&["worse"])).unwrap_err().to_string();
        assert_eq!(compiled.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(e.starts_with("cuModuleLoadData(all_reduce) failed"), "{e}");
    }

    /// A damaged set that another process replaced meanwhile is taken from the cache,
    /// not compiled again; the rejected set is never taken twice.
    #[test]
    fn rejected_cubins_are_not_taken_again_but_a_replacement_is() {
        let dir = Scratch::new("cache-replaced");
        let cache = Cache { dir: Some(&dir.0), key: 0xfeed, arch: "sm_90" };
        let never = || -> Result<Cubins> { panic!("compiled although the cache held usable code") };
        for (m, b) in cubins("other") {
            std::fs::write(cache.file(&dir.0, m), seal(&b)).unwrap();
        }
        let (c, cached) = cache.cubins(&never, Some(&cubins("bad"))).unwrap();
        assert_eq!((c, cached), (cubins("other"), true));
        let compile = || Ok(cubins("new"));
        let (c, cached) = cache.cubins(&compile, Some(&cubins("other"))).unwrap();
        assert_eq!((c, cached), (cubins("new"), false));
        assert_eq!(read_cached(&dir.0, 0xfeed, "sm_90").unwrap(), cubins("new"));
    }

    /// A truncated, changed or unsealed cache file never reaches the loader: the set is
    /// compiled again and the file replaced, without a load that failed first.
    #[test]
    fn a_damaged_cache_file_is_never_loaded() {
        let good = seal(b"good code");
        assert_eq!(unseal(good.clone()).as_deref(), Some(&b"good code"[..]));
        let mut changed = good.clone();
        changed[2] ^= 1;
        for bad in [good[..good.len() - 1].to_vec(), good[..4].to_vec(), changed, b"good code".to_vec(), seal(b"")] {
            assert_eq!(unseal(bad.clone()), None, "{bad:?}");
        }
        let dir = Scratch::new("cache-damaged");
        let cache = Cache { dir: Some(&dir.0), key: 0xd00d, arch: "sm_90" };
        let compile = || Ok(cubins("good"));
        cache.load(&compile, loader(&[])).unwrap();
        let victim = cache.file(&dir.0, MODULES[1].0);
        let whole = std::fs::read(&victim).unwrap();
        std::fs::write(&victim, &whole[..whole.len() / 2]).unwrap();
        let never_bad = |images: &Images<'_>| -> Result<usize> {
            assert!(images.iter().all(|(m, b)| *b == format!("good {m}").as_bytes()), "a damaged image reached the loader");
            Ok(images.len())
        };
        let (_, _, cached) = cache.load(&compile, never_bad).unwrap();
        assert!(!cached, "the damaged set was taken from the cache");
        assert_eq!(std::fs::read(&victim).unwrap(), whole, "the truncated file is replaced by a whole one");
    }
}
