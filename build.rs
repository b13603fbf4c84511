//! Build script: with the `tch` feature, makes this package's own binaries, tests, examples
//! and benches find libtorch at run time.
//!
//! torch-sys (`links = "tch"`) exports the libtorch `lib` folder it linked against as
//! `DEP_TCH_LIBTORCH_LIB` to crates that depend on it directly. `rustc-link-arg` only reaches
//! this package's own link steps, so a downstream program needs the same lines in its own
//! build script (see the README, "tch backend"). Default builds emit nothing and need no
//! libtorch.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        println!(
            "cargo:warning=the `tch` feature is on but torch-sys exported no DEP_TCH_LIBTORCH_LIB; \
             set LD_LIBRARY_PATH to libtorch's lib folder to run what links it"
        );
        return;
    };
    // The rpath lets the executables find libtorch*.so without LD_LIBRARY_PATH.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    // Link libtorch.so itself even though no symbol is taken from it directly: it is the
    // umbrella that pulls in libtorch_cpu (and the CUDA libraries of a CUDA build), and
    // --as-needed would otherwise drop it.
    println!("cargo:rustc-link-arg=-L{lib}");
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch");
}
