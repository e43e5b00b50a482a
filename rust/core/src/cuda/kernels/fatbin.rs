//! The fat binaries build.rs embeds (the `prebuilt-kernels` feature): what they hold, which
//! image the driver will pick for a GPU, and whether they cover it.

use super::KernelSource;
use crate::error::{Error, Result};

/// What build.rs embedded: `IMAGES` (module name, fat binary), empty when built without
/// the `prebuilt-kernels` feature; `NVCC` (the compiler's version) and `TARGETS`.
mod prebuilt {
    include!(concat!(env!("OUT_DIR"), "/prebuilt_kernels.rs"));
}

// -- The fat binary ------------------------------------------------------------------------

/// One image of a fat binary: SASS (an ELF cubin) for `sm_<arch>`, or PTX for
/// `compute_<arch>` (arch 90 = 9.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FatEntry {
    pub ptx: bool,
    pub arch: u32,
    /// Bytes of the payload (as stored: PTX may be compressed).
    pub bytes: usize,
}

impl FatEntry {
    pub fn name(&self) -> String {
        format!("{}_{}", if self.ptx { "compute" } else { "sm" }, self.arch)
    }
}

const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// The entries of a fat binary as the `fatbinary` tool writes it: a 16-byte header
/// {u32 magic, u16 version, u16 header size, u64 size of the entries}, then entries, each
/// {u16 kind (1 PTX, 2 ELF), u16, u32 header size, u64 payload size, ..., u32 arch at +28}
/// followed by its payload. Several fat binaries may follow each other.
pub fn fatbin_entries(data: &[u8]) -> Result<Vec<FatEntry>> {
    let bad = |what: &str| Error::Internal(format!("rsccl's embedded fat binary is malformed: {what}"));
    let u16_at = |p: usize| data.get(p..p + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |p: usize| data.get(p..p + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    let u64_at = |p: usize| data.get(p..p + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 16 <= data.len() {
        if u32_at(pos) != Some(FATBIN_MAGIC) {
            return Err(bad(&format!("no magic at offset {pos}")));
        }
        let hsize = u16_at(pos + 6).ok_or_else(|| bad("short header"))?;
        let size = u64_at(pos + 8).ok_or_else(|| bad("short header"))?;
        let (mut p, end) = (pos + hsize, pos + hsize + size);
        if end > data.len() {
            return Err(bad("entries run past the end"));
        }
        while p < end {
            let kind = u16_at(p).ok_or_else(|| bad("short entry"))?;
            let ehsize = u32_at(p + 4).ok_or_else(|| bad("short entry"))? as usize;
            let bytes = u64_at(p + 8).ok_or_else(|| bad("short entry"))?;
            let arch = u32_at(p + 28).ok_or_else(|| bad("short entry"))?;
            if !(kind == 1 || kind == 2) || ehsize < 32 {
                return Err(bad(&format!("entry of kind {kind} at offset {p}")));
            }
            out.push(FatEntry { ptx: kind == 1, arch, bytes });
            p += ehsize + bytes;
        }
        pos = end;
    }
    Ok(out)
}

/// What the driver runs on a GPU of compute capability `cc` (90 = 9.0) from `entries`:
/// SASS of the same major version and a minor version no higher (the newest such), else
/// PTX of an arch no higher (the newest), JIT-compiled at load; None: nothing runs there.
pub fn pick(entries: &[FatEntry], cc: u32) -> Option<FatEntry> {
    let sass = entries.iter().filter(|e| !e.ptx && e.arch / 10 == cc / 10 && e.arch <= cc).max_by_key(|e| e.arch);
    let ptx = || entries.iter().filter(|e| e.ptx && e.arch <= cc).max_by_key(|e| e.arch);
    sass.or_else(ptx).copied()
}

/// The fat binaries built into this build (empty without the `prebuilt-kernels` feature).
pub fn prebuilt_images() -> &'static [(&'static str, &'static [u8])] {
    prebuilt::IMAGES
}

/// The version of the nvcc that built them ("" if none).
pub fn prebuilt_nvcc() -> &'static str {
    prebuilt::NVCC
}

/// The archs of the prebuilt code: (SASS archs, PTX archs), taken from the images.
pub fn prebuilt_archs() -> Result<(Vec<u32>, Vec<u32>)> {
    let mut sass = Vec::new();
    let mut ptx = Vec::new();
    for (_, img) in prebuilt_images() {
        for e in fatbin_entries(img)? {
            let v = if e.ptx { &mut ptx } else { &mut sass };
            if !v.contains(&e.arch) {
                v.push(e.arch);
            }
        }
    }
    sass.sort_unstable();
    ptx.sort_unstable();
    Ok((sass, ptx))
}

fn arch_list(archs: &[u32], prefix: &str) -> String {
    archs.iter().map(|a| format!("{prefix}_{a}")).collect::<Vec<_>>().join(", ")
}

/// Whether the prebuilt code runs on compute capability `cc`: Ok((what runs, bytes of the
/// device code that loads: the picked SASS of every module)), or Err(why not), a sentence.
pub fn prebuilt_coverage(cc: u32) -> std::result::Result<(String, usize), String> {
    if prebuilt_images().is_empty() {
        return Err("this build of rsccl has no prebuilt kernels (built without nvcc: the `prebuilt-kernels` feature was off)".into());
    }
    let mut bytes = 0;
    let mut what = String::new();
    for (module, img) in prebuilt_images() {
        let entries = fatbin_entries(img).map_err(|e| e.to_string())?;
        match pick(&entries, cc) {
            Some(e) => {
                bytes += e.bytes;
                what = if e.ptx { format!("{} PTX, compiled by the driver at load", e.name()) } else { format!("{} SASS", e.name()) };
            }
            None => {
                let (sass, ptx) = prebuilt_archs().map_err(|e| e.to_string())?;
                return Err(format!(
                    "rsccl's prebuilt kernels hold no code for sm_{cc} (module {module}: SASS for {}, PTX for {})",
                    arch_list(&sass, "sm"),
                    arch_list(&ptx, "compute")
                ));
            }
        }
    }
    Ok((what, bytes))
}

/// The build's targets ("sm_80", ..., "compute_120"): what build.rs was asked to embed.
pub fn prebuilt_targets() -> &'static [&'static str] {
    prebuilt::TARGETS
}

/// Where a GPU of compute capability `cc` (90 = 9.0) gets its kernels under the current
/// `RSCCL_KERNELS` (what `Kernels::load` does, before it tries to load): ("prebuilt", what
/// runs, device code bytes) or ("nvrtc", why, 0). An error where no source is allowed.
pub fn choice(cc: u32) -> Result<(&'static str, String, usize)> {
    match KernelSource::from_env()? {
        KernelSource::Nvrtc => Ok(("nvrtc", "RSCCL_KERNELS=nvrtc".into(), 0)),
        source => match prebuilt_coverage(cc) {
            Ok((what, bytes)) => Ok(("prebuilt", what, bytes)),
            Err(why) if source == KernelSource::Auto => Ok(("nvrtc", why, 0)),
            Err(why) => Err(Error::Cuda(format!("{why}; RSCCL_KERNELS=prebuilt forbids compiling them with NVRTC (use auto or nvrtc)"))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_follows_the_driver_rules() {
        let e = |ptx, arch| FatEntry { ptx, arch, bytes: 1 };
        let fat = [e(false, 80), e(false, 90), e(false, 100), e(false, 120), e(true, 120)];
        assert_eq!(pick(&fat, 90), Some(e(false, 90)));
        assert_eq!(pick(&fat, 89), Some(e(false, 80)), "sm_80 SASS runs on 8.9");
        assert_eq!(pick(&fat, 86), Some(e(false, 80)));
        assert_eq!(pick(&fat, 103), Some(e(false, 100)));
        assert_eq!(pick(&fat, 121), Some(e(false, 120)));
        assert_eq!(pick(&fat, 130), Some(e(true, 120)), "a newer GPU JIT-compiles the PTX");
        assert_eq!(pick(&fat, 110), None, "11.0: no SASS of its major, PTX too new");
        assert_eq!(pick(&fat, 75), None);
    }

    #[test]
    fn fatbin_entries_reads_a_synthetic_image() {
        // One fat binary with an ELF for sm_90 (8 bytes) and a PTX for compute_120 (4 bytes).
        let entry = |kind: u16, arch: u32, payload: &[u8]| {
            let mut h = vec![0u8; 64];
            h[0..2].copy_from_slice(&kind.to_le_bytes());
            h[4..8].copy_from_slice(&64u32.to_le_bytes());
            h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
            h[28..32].copy_from_slice(&arch.to_le_bytes());
            h.extend_from_slice(payload);
            h
        };
        let body: Vec<u8> = [entry(2, 90, b"\x7fELF0123"), entry(1, 120, b"ptx!")].concat();
        let mut img = Vec::new();
        img.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        img.extend_from_slice(&1u16.to_le_bytes());
        img.extend_from_slice(&16u16.to_le_bytes());
        img.extend_from_slice(&(body.len() as u64).to_le_bytes());
        img.extend_from_slice(&body);
        let got = fatbin_entries(&img).unwrap();
        assert_eq!(got, vec![FatEntry { ptx: false, arch: 90, bytes: 8 }, FatEntry { ptx: true, arch: 120, bytes: 4 }]);
        assert!(fatbin_entries(&img[..40]).is_err());
        assert!(fatbin_entries(b"not a fat binary at all").is_err());
    }

    #[test]
    fn prebuilt_images_cover_the_targets_when_built() {
        // With the prebuilt-kernels feature (the wheel), every module has every target.
        for (module, img) in prebuilt_images() {
            let names: Vec<String> = fatbin_entries(img).unwrap().iter().map(|e| e.name()).collect();
            for t in prebuilt::TARGETS {
                assert!(names.iter().any(|n| n == t), "{module}: {t} missing from {names:?}");
            }
        }
    }
}
