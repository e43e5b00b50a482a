//! config.rs's table and parsing, tested.

use super::*;

#[test]
fn kernel_source_names_the_variable_on_a_bad_value() {
    let env = |v: &'static str| move |k: &str| (k == KERNELS_ENV).then(|| OsString::from(v));
    assert_eq!(KernelSource::resolve(&|_| None).unwrap(), KernelSource::Auto);
    assert_eq!(KernelSource::resolve(&env("NVRTC")).unwrap(), KernelSource::Nvrtc);
    assert_eq!(KernelSource::resolve(&env("prebuilt")).unwrap(), KernelSource::Prebuilt);
    let e = KernelSource::resolve(&env("fatbin")).unwrap_err().to_string();
    assert!(e.contains("RSCCL_KERNELS") && e.contains("fatbin"), "{e}");
}

#[test]
fn kernel_lineinfo_is_off_unless_asked_and_names_the_variable_on_a_bad_value() {
    let env = |v: std::result::Result<&'static str, &'static [u8]>| {
        move |k: &str| {
            (k == KERNEL_LINEINFO_ENV).then(|| v.map(str::to_string).map_err(|b| std::os::unix::ffi::OsStringExt::from_vec(b.to_vec())))
        }
    };
    assert!(!kernel_lineinfo(&|_| None).unwrap());
    assert!(!kernel_lineinfo(&env(Ok(""))).unwrap());
    assert!(!kernel_lineinfo(&env(Ok("0"))).unwrap());
    assert!(kernel_lineinfo(&env(Ok("1"))).unwrap());
    assert!(kernel_lineinfo(&env(Ok(" 1 "))).unwrap());
    for bad in ["yes", "2", "true"] {
        let e = kernel_lineinfo(&env(Ok(bad))).unwrap_err();
        assert!(matches!(&e, Error::Config(m) if m.contains("RSCCL_KERNEL_LINEINFO") && m.contains(bad)), "{e}");
    }
    let e = kernel_lineinfo(&env(Err(b"\xff1"))).unwrap_err();
    assert!(matches!(&e, Error::Config(m) if m.contains("RSCCL_KERNEL_LINEINFO") && m.contains("UTF-8")), "{e}");
}

#[test]
fn kernel_cache_dir_rule() {
    let env = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|p| p.0 == k).map(|p| OsString::from(p.1));
    assert_eq!(kernel_cache_dir(&env(&[("RSCCL_CACHE_DIR", "/c"), ("HOME", "/h")])).unwrap(), std::path::PathBuf::from("/c"));
    assert_eq!(kernel_cache_dir(&env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])).unwrap(), std::path::PathBuf::from("/x/rsccl"));
    assert_eq!(kernel_cache_dir(&env(&[("HOME", "/h")])).unwrap(), std::path::PathBuf::from("/h/.cache/rsccl"));
    assert!(kernel_cache_dir(&env(&[])).is_none());
}

#[test]
fn every_setting_lands_in_its_field() {
    let env = |k: &str| match k {
        "RSCCL_CUDA_POOL_BYTES" => Some(OsString::from("1GiB")),
        "RSCCL_CUDA_WARMUP" => Some(OsString::from("0")),
        "RSCCL_CUDA_INPLACE_MIN_BYTES" => Some(OsString::from("3MiB")),
        "RSCCL_CUDA_SYNC_STREAM" => Some(OsString::from("0")),
        _ => None,
    };
    let c = Config::resolve(&[], &env).unwrap();
    assert_eq!((c.cuda_pool_bytes, c.cuda_inplace_min_bytes), (1 << 30, 3 << 20));
    assert!(!c.cuda_warmup && !c.cuda_sync_stream);
    assert_eq!(c.max_cuda_va_bytes, 16 << 30);
}

#[test]
fn nccl_settings_resolve() {
    let d = Config::default();
    assert_eq!((d.nccl_max_ctas, d.nccl_hierarchical_min_bytes), (Some(16), 16 << 20));
    assert_eq!(d.nccl_p2p_max_ctas, Some(4), "pair communicators: few channels (memory)");
    assert_eq!(d.nccl_hierarchical_scratch_bytes, 32 << 20);
    let env = |k: &str| match k {
        "RSCCL_NCCL_MAX_CTAS" => Some(OsString::from("0")),
        "RSCCL_NCCL_HIERARCHICAL_MIN_BYTES" => Some(OsString::from("1MiB")),
        _ => None,
    };
    let c = Config::resolve(&[], &env).unwrap();
    assert_eq!((c.nccl_max_ctas, c.nccl_hierarchical_min_bytes), (None, 1 << 20), "0 is NCCL's default");
    let e = Config::resolve(&[("nccl_max_ctas".into(), "65".into())], &|_| None).unwrap_err().to_string();
    assert!(e.contains("nccl_max_ctas") && e.contains("out of range"), "{e}");
    let (_, names) = d.layout_settings();
    assert!(names.iter().any(|(f, _)| *f == "nccl_hierarchical_min_bytes"), "every rank must take the same path");
    assert!(names.iter().any(|(f, _)| *f == "nccl_hierarchical_scratch_bytes"), "every rank must take the same path");
}

#[test]
fn nccl_p2p_is_on_by_default_and_shared() {
    assert!(Config::default().nccl_p2p);
    let off = |k: &str| (k == "RSCCL_NCCL_P2P").then(|| OsString::from("0"));
    assert!(!Config::resolve(&[], &off).unwrap().nccl_p2p);
    assert!(Config::resolve(&[("nccl_p2p".into(), "1".into())], &off).unwrap().nccl_p2p, "Options win over the environment");
    for bad in ["2", "yes", "-1"] {
        let e = Config::resolve(&[("nccl_p2p".into(), bad.into())], &|_| None).unwrap_err().to_string();
        assert!(e.contains("nccl_p2p"), "{bad}: {e}");
    }
    let (_, names) = Config::default().layout_settings();
    assert!(names.iter().any(|(f, _)| *f == "nccl_p2p"), "the splits are collective: every rank must agree");
}

#[test]
fn sizes_parse() {
    assert_eq!(parse_size("4096"), Some(4096));
    assert_eq!(parse_size("4MiB"), Some(4 << 20));
    assert_eq!(parse_size("4 m"), Some(4 << 20));
    assert_eq!(parse_size("1GiB"), Some(1 << 30));
    assert_eq!(parse_size("12KB"), Some(12 << 10));
    assert_eq!(parse_size("MiB"), None);
    assert_eq!(parse_size("-1"), None);
    assert_eq!(parse_size("4 lightyears"), None);
}

#[test]
fn precedence_options_env_default() {
    let env = |k: &str| (k == "RSCCL_HOST_BUFFER_BYTES").then(|| OsString::from("8MiB"));
    let c = Config::resolve(&[], &env).unwrap();
    assert_eq!(c.host_buffer_bytes, 8 << 20);
    let c = Config::resolve(&[("host_buffer_bytes".into(), "2MiB".into())], &env).unwrap();
    assert_eq!(c.host_buffer_bytes, 2 << 20);
    assert_eq!(Config::default().p2p_buffer_bytes, 512 << 10);
}

#[test]
fn bad_values_name_their_source() {
    let env = |k: &str| (k == "RSCCL_SPIN_COUNT").then(|| OsString::from("lots"));
    let e = Config::resolve(&[], &env).unwrap_err().to_string();
    assert!(e.contains("RSCCL_SPIN_COUNT") && e.contains("lots"), "{e}");
    let e = Config::resolve(&[("host_buffer_bytes".into(), "1".into())], &|_| None).unwrap_err().to_string();
    assert!(e.contains("rsccl.Options.host_buffer_bytes") && e.contains("out of range"), "{e}");
    let e = Config::resolve(&[("nope".into(), "1".into())], &|_| None).unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("host_buffer_bytes"), "{e}");
}

#[test]
fn a_value_that_is_not_utf8_is_an_error_naming_the_variable() {
    use std::os::unix::ffi::OsStringExt;
    let bad = || OsString::from_vec(b"\xff\xfe4MiB".to_vec());
    for s in SETTINGS {
        let env = |k: &str| (k == s.env).then(bad);
        let e = Config::resolve(&[], &env).unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{}: {e}", s.env);
        let e = e.to_string();
        assert!(e.contains(s.env) && e.contains("not valid UTF-8") && e.contains("\\xFF\\xFE4MiB"), "{e}");
    }
    let e = KernelSource::resolve(&|k| (k == KERNELS_ENV).then(bad)).unwrap_err().to_string();
    assert!(e.contains(KERNELS_ENV) && e.contains("not valid UTF-8"), "{e}");
}
