//! With the `prebuilt-kernels` feature (on in the wheel: pyproject.toml), compile rsccl's
//! kernels (csrc_kernels/*.cu) with nvcc into one fat binary per family and embed them
//! (src/cuda/kernels/fatbin.rs, `prebuilt`): SASS for every arch of TARGETS and PTX of the newest,
//! so that no GPU machine compiles anything at init_process_group. Without the feature
//! (`cargo test`, `cargo build`) nothing is compiled and the runtime uses NVRTC.
//!
//! nvcc: `$RSCCL_NVCC`, else the `nvidia-cuda-nvcc` package of the Python that builds the
//! wheel (pyproject's build requires pin it to 13.0, whose output loads on driver 580),
//! else `$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH.
//!
//! Every (family, arch) pair is its own job (nvcc to PTX, ptxas to SASS), run $NUM_JOBS at a
//! time (cargo's -j: every core), the largest families first; `fatbinary` then bundles each
//! family's images.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

mod abi {
    include!("build_abi.rs");
}

/// SASS targets; the last one's PTX is embedded too (for GPUs newer than all of them).
const SASS_DEFAULT: [u32; 4] = [80, 90, 100, 120];

/// The SASS targets of this build: `RSCCL_KERNEL_ARCHS` ("90", "80,90": a developer's build
/// for the GPU at hand, a quarter of the nvcc time), else every one of SASS_DEFAULT. A GPU
/// the list does not cover gets NVRTC at run time, as any other.
fn sass_targets() -> Vec<u32> {
    match std::env::var("RSCCL_KERNEL_ARCHS") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|a| {
                a.trim()
                    .trim_start_matches("sm_")
                    .parse()
                    .unwrap_or_else(|_| panic!("RSCCL_KERNEL_ARCHS={v:?}: expected arch numbers such as 90,100"))
            })
            .collect(),
        _ => SASS_DEFAULT.to_vec(),
    }
}

fn main() {
    // Read when the script runs, not baked in when it is compiled: worktrees that share one
    // target directory share this script's binary.
    let kdir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../csrc_kernels");
    println!("cargo:rerun-if-changed={}", kdir.display());
    for v in ["RSCCL_NVCC", "RSCCL_KERNEL_ARCHS", "CUDA_HOME", "PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    abi::generate(&kdir.join("abi.cuh"), &out);
    let sass = sass_targets();
    let ptx_arch = *sass.last().unwrap();
    let targets: Vec<String> = sass.iter().map(|a| format!("sm_{a}")).chain([format!("compute_{ptx_arch}")]).collect();
    let rs = out.join("prebuilt_kernels.rs");
    if std::env::var_os("CARGO_FEATURE_PREBUILT_KERNELS").is_none() {
        write_rs(&rs, &[], "", &targets);
        return;
    }
    let nvcc = find_nvcc().unwrap_or_else(|| {
        panic!(
            "rsccl's prebuilt-kernels feature needs nvcc: `pip install .` brings it (pyproject.toml's build \
             requires: nvidia-cuda-nvcc 13.0); else set RSCCL_NVCC to an nvcc of CUDA 13.0"
        )
    });
    let version = nvcc_version(&nvcc);
    if !version.starts_with("13.0") {
        println!(
            "cargo:warning=rsccl: building kernels with nvcc {version} ({}); code from a CUDA newer than 13.0 may not load on driver 580",
            nvcc.display()
        );
    }
    let mut families: Vec<(String, u64)> = std::fs::read_dir(&kdir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name()?.to_str()?.strip_suffix(".cu")?.to_string();
            Some((name, p.metadata().ok()?.len()))
        })
        .collect();
    // Largest first (source size stands for compile time), so the long jobs start early.
    families.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let work = out.join("kernels");
    std::fs::create_dir_all(&work).unwrap();
    let mut jobs: Vec<(String, u32)> = Vec::new();
    for (f, _) in &families {
        for &a in &sass {
            jobs.push((f.clone(), a));
        }
    }
    let t0 = std::time::Instant::now();
    let threads: usize = std::env::var("NUM_JOBS").ok().and_then(|n| n.parse().ok()).unwrap_or(1).max(1);
    let next = AtomicUsize::new(0);
    let errors = Mutex::new(Vec::new());
    let times: Mutex<Vec<(f64, String)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((family, arch)) = jobs.get(i) else { break };
                let t = std::time::Instant::now();
                match compile_job(&nvcc, &kdir, &work, family, *arch) {
                    Ok(()) => times.lock().unwrap().push((t.elapsed().as_secs_f64(), format!("{family} sm_{arch}"))),
                    Err(e) => errors.lock().unwrap().push(e),
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    if !errors.is_empty() {
        panic!("compiling rsccl's kernels failed:\n{}", errors.join("\n"));
    }
    let fatbinary = nvcc.with_file_name("fatbinary");
    let mut images = Vec::new();
    for (f, _) in &families {
        let fatbin = work.join(format!("{f}.fatbin"));
        let mut cmd = Command::new(&fatbinary);
        cmd.arg(format!("--create={}", fatbin.display())).arg("-64");
        for &a in &sass {
            cmd.arg(format!("--image3=kind=elf,sm={a},file={}", work.join(format!("{f}.sm_{a}.cubin")).display()));
        }
        cmd.arg(format!("--image3=kind=ptx,sm={ptx_arch},file={}", work.join(format!("{f}.compute_{ptx_arch}.ptx")).display()));
        run(&mut cmd).unwrap_or_else(|e| panic!("bundling rsccl's {f} kernels failed: {e}"));
        images.push((f.clone(), fatbin));
    }
    let total: u64 = images.iter().map(|(_, p)| p.metadata().unwrap().len()).sum();
    let mut times = times.into_inner().unwrap();
    times.sort_by(|a, b| b.0.total_cmp(&a.0));
    let busy: f64 = times.iter().map(|t| t.0).sum();
    let slowest: Vec<String> = times.iter().take(3).map(|(s, j)| format!("{j} {s:.0} s")).collect();
    println!(
        "cargo:warning=rsccl: built kernels with nvcc {version} for {} in {:.0} s on {threads} threads ({busy:.0} s of jobs; slowest: {}; {total} bytes of fat binaries)",
        targets.join(", "),
        t0.elapsed().as_secs_f64(),
        slowest.join(", ")
    );
    write_rs(&rs, &images, &version, &targets);
}

/// One family for one arch: nvcc to PTX (the front end), ptxas to SASS (what
/// `nvcc -cubin -arch=sm_XX` runs, in two steps so the PTX of the newest arch is kept).
fn compile_job(nvcc: &Path, kdir: &Path, work: &Path, family: &str, arch: u32) -> Result<(), String> {
    let src = kdir.join(format!("{family}.cu"));
    let ptx = work.join(format!("{family}.compute_{arch}.ptx"));
    let cubin = work.join(format!("{family}.sm_{arch}.cubin"));
    run(Command::new(nvcc).args(["-ptx", "-std=c++17", &format!("-arch=compute_{arch}"), "-o"]).arg(&ptx).arg(&src))
        .map_err(|e| format!("{family}.cu for compute_{arch}: {e}"))?;
    let ptxas = nvcc.with_file_name("ptxas");
    run(Command::new(ptxas).args([&format!("-arch=sm_{arch}"), "-m64", "-o"]).arg(&cubin).arg(&ptx))
        .map_err(|e| format!("{family}.cu for sm_{arch}: {e}"))
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?}: {}\n{}{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

fn write_rs(path: &Path, images: &[(String, PathBuf)], version: &str, targets: &[String]) {
    let mut s = String::from("// Generated by rust/core/build.rs.\n");
    // Statics, not consts: a const's bytes would be copied into every codegen unit that
    // uses it (seen: the fat binaries twice in .rodata).
    s += &format!("pub static NVCC: &str = {version:?};\n");
    s += &format!("pub static TARGETS: &[&str] = &{targets:?};\n");
    s += "pub static IMAGES: &[(&str, &[u8])] = &[\n";
    for (name, p) in images {
        s += &format!("    ({name:?}, include_bytes!({:?})),\n", p.display().to_string());
    }
    s += "];\n";
    std::fs::write(path, s).unwrap();
}

/// "13.0.88" from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88").
fn nvcc_version(nvcc: &Path) -> String {
    let out = Command::new(nvcc).arg("--version").output().unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    text.split(", V")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .map(str::to_string)
        .unwrap_or_else(|| panic!("unexpected `nvcc --version` output:\n{text}"))
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RSCCL_NVCC") {
        return Some(PathBuf::from(p));
    }
    // The Python building the wheel (maturin names it; pip's isolated build environment
    // is on its sys.path): the nvidia-cuda-nvcc package's nvcc.
    let pythons =
        ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"].iter().filter_map(std::env::var_os).map(PathBuf::from).chain([PathBuf::from("python3")]);
    let probe = "import os, sys\nfor d in sys.path:\n    p = os.path.join(d, 'nvidia', 'cu13', 'bin', 'nvcc')\n    if os.path.isfile(p):\n        print(p)\n        break\n";
    for py in pythons {
        if let Ok(out) = Command::new(&py).args(["-c", probe]).output() {
            let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if out.status.success() && !p.is_empty() {
                return Some(PathBuf::from(p));
            }
        }
    }
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        let p = PathBuf::from(h).join("bin").join("nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    std::env::var_os("PATH").and_then(|path| std::env::split_paths(&path).map(|d| d.join("nvcc")).find(|p| p.is_file()))
}
