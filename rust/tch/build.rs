//! Link this package's own test and example binaries to libtorch_cuda when libtorch has
//! it. Linkers that drop unused libraries (--as-needed, the default on most distributions)
//! leave it out of tch programs, and libtorch then sees no GPU. Downstream programs get
//! the same from `rsccl_tch::cuda::load_torch_cuda()` at run time, or from these two lines
//! in their own build script (docs/rust.md).
fn main() {
    // torch-sys (links = "tch") reports where libtorch is.
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        if std::path::Path::new(&dir).join("libtorch_cuda.so").exists() {
            for kind in ["tests", "examples"] {
                println!("cargo:rustc-link-arg-{kind}=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
            }
        }
    }
}
