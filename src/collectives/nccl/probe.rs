//! Checks, before any cudarc call, that the CUDA driver and NCCL can be loaded.
//!
//! cudarc (with `dynamic-loading`) opens `libcuda` and `libnccl` on first use and **panics**
//! when neither of its candidate names loads, or when a symbol is missing. This module runs
//! the same search first — the names from `cudarc::get_lib_name_candidates`, in cudarc's order,
//! opened with `dlopen(RTLD_LAZY | RTLD_LOCAL)` as `libloading` does — checks the symbols the
//! crate calls, and turns every failure into [`Error::BackendUnavailable`].
//!
//! One gap gets its own message: PyPI's `nvidia-nccl-cu12` wheel ships only `libnccl.so.2`,
//! a name cudarc 0.19 never tries (it tries `libnccl.so`, `libnccl.so.1`, `libnccl.so.12`, …).
//! Pre-loading `libnccl.so.2` does not help — `dlopen("libnccl.so")` matches loaded libraries
//! by file name and soname, not by symbols — so the error tells the user the symlink to create.

use crate::error::{Error, Result};
use std::ffi::{CStr, CString};

/// The driver functions the backend reaches through cudarc (context, stream, memory, events).
pub const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuStreamWaitEvent",
];

/// The NCCL functions the backend calls (`ncclCommSplit` needs NCCL 2.18 or newer).
pub const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommDestroy",
    "ncclCommSplit",
    "ncclAllGather",
    "ncclBroadcast",
    "ncclReduceScatter",
    "ncclAllReduce",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// The file name PyPI's NCCL wheel (and Debian's `libnccl2`) provide.
pub const NCCL_SONAME: &str = "libnccl.so.2";

/// The libraries a successful [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libraries {
    /// The CUDA driver library cudarc will use (path as the loader resolved it).
    pub driver: String,
    /// The NCCL library cudarc will use.
    pub nccl: String,
}

/// The outcome of searching one library under a list of names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// `name` loaded (from `path`); `missing` lists the wanted symbols it lacks.
    Found {
        /// The name that loaded.
        name: String,
        /// Where the loader found it.
        path: String,
        /// Wanted symbols that it does not export.
        missing: Vec<String>,
    },
    /// None of `searched` loaded; `last_error` is the loader's message for the last name.
    NotFound {
        /// The names tried, in order.
        searched: Vec<String>,
        /// `dlerror()` for the last name.
        last_error: String,
    },
}

/// Searches like cudarc: the first of `names` that `dlopen` accepts, then its `symbols`.
pub fn lookup(names: &[String], symbols: &[&str]) -> Lookup {
    let mut last_error = String::from("no names to try");
    for name in names {
        let Ok(cname) = CString::new(name.as_str()) else {
            continue;
        };
        // SAFETY: dlopen/dlsym/dladdr/dlclose on a NUL-terminated name; the handle is closed
        // before returning and no symbol is called. Loading runs the library's constructors,
        // exactly as cudarc's own loading would.
        unsafe {
            let handle = libc::dlopen(cname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if handle.is_null() {
                last_error = dl_error();
                continue;
            }
            let mut path = name.clone();
            let mut missing = Vec::new();
            for sym in symbols {
                let Ok(csym) = CString::new(*sym) else {
                    continue;
                };
                let ptr = libc::dlsym(handle, csym.as_ptr());
                if ptr.is_null() {
                    missing.push(sym.to_string());
                } else if path == *name {
                    let mut info: libc::Dl_info = std::mem::zeroed();
                    if libc::dladdr(ptr, &mut info) != 0 && !info.dli_fname.is_null() {
                        path = CStr::from_ptr(info.dli_fname)
                            .to_string_lossy()
                            .into_owned();
                    }
                }
            }
            libc::dlclose(handle);
            return Lookup::Found {
                name: name.clone(),
                path,
                missing,
            };
        }
    }
    Lookup::NotFound {
        searched: names.to_vec(),
        last_error,
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a thread-local NUL-terminated message.
    unsafe {
        let msg = libc::dlerror();
        if msg.is_null() {
            "unknown dlopen error".into()
        } else {
            CStr::from_ptr(msg).to_string_lossy().into_owned()
        }
    }
}

/// cudarc's candidate names for the driver (`cuda`, then `nvcuda`).
pub fn driver_candidates() -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates("cuda");
    names.extend(cudarc::get_lib_name_candidates("nvcuda"));
    dedup(names)
}

/// Drops repeated names (cudarc lists some twice), keeping the first: the search order and
/// thus the library found are unchanged.
fn dedup(names: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(names.len());
    for n in names {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

/// cudarc's candidate names for NCCL.
pub fn nccl_candidates() -> Vec<String> {
    dedup(cudarc::get_lib_name_candidates("nccl"))
}

/// Checks that cudarc will load the CUDA driver and NCCL without panicking.
///
/// Errors with [`Error::BackendUnavailable`] (backend `nccl`) naming each library that is
/// missing, the names searched, the loader's message and what to install or link.
pub fn probe() -> Result<Libraries> {
    let driver = lookup(&driver_candidates(), DRIVER_SYMBOLS);
    let nccl = lookup(&nccl_candidates(), NCCL_SYMBOLS);
    let nccl_so2 = match nccl {
        Lookup::NotFound { .. } => Some(lookup(&[NCCL_SONAME.to_string()], NCCL_SYMBOLS)),
        Lookup::Found { .. } => None,
    };
    let libs = diagnose(&driver, &nccl, nccl_so2.as_ref(), &ld_library_path())?;
    // Our search mirrors cudarc's; confirm with cudarc's own probes so that a divergence
    // between the two is an error, not a panic later.
    // SAFETY: both only try to load the libraries (dlopen), as the search above did.
    let (driver_ok, nccl_ok) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nccl::sys::is_culib_present(),
        )
    };
    if !driver_ok || !nccl_ok {
        return Err(unavailable(format!(
            "cudarc's own probe does not find {} although {} loads",
            if driver_ok { "NCCL" } else { "the CUDA driver" },
            if driver_ok { &libs.nccl } else { &libs.driver },
        )));
    }
    Ok(libs)
}

fn ld_library_path() -> String {
    std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "<unset>".into())
}

pub(crate) fn unavailable(reason: String) -> Error {
    Error::BackendUnavailable {
        backend: "nccl".into(),
        reason,
    }
}

/// Composes the probe's verdict from the three searches (pure, for tests).
pub fn diagnose(
    driver: &Lookup,
    nccl: &Lookup,
    nccl_so2: Option<&Lookup>,
    ld_library_path: &str,
) -> Result<Libraries> {
    let mut problems = Vec::new();
    let driver_path = match driver {
        Lookup::Found { path, missing, .. } if missing.is_empty() => Some(path.clone()),
        Lookup::Found { path, missing, .. } => {
            problems.push(format!(
                "the CUDA driver {path} lacks {missing:?}: update the NVIDIA driver (CUDA 12.x \
                 driver or newer)"
            ));
            None
        }
        Lookup::NotFound {
            searched,
            last_error,
        } => {
            problems.push(format!(
                "no CUDA driver: libcuda.so.1 cannot be loaded (last loader error: {last_error}); searched {} \
                 (cudarc's names) on the loader path, LD_LIBRARY_PATH={ld_library_path}; \
                 install the NVIDIA driver, which provides libcuda.so.1 — a machine without a \
                 GPU cannot run this backend",
                searched.join(", ")
            ));
            None
        }
    };
    let nccl_path = match (nccl, nccl_so2) {
        (Lookup::Found { path, missing, .. }, _) if missing.is_empty() => Some(path.clone()),
        (Lookup::Found { path, missing, .. }, _) => {
            problems.push(format!(
                "NCCL {path} lacks {missing:?}: NCCL 2.18 or newer is needed \
                 (pip install -U nvidia-nccl-cu12)"
            ));
            None
        }
        (Lookup::NotFound { searched, .. }, Some(Lookup::Found { path, .. })) => {
            let dir = std::path::Path::new(path)
                .parent()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|| "<its directory>".into());
            problems.push(format!(
                "NCCL is installed as {NCCL_SONAME} ({path}), a name cudarc 0.19 does not try \
                 (it tries {}); create the name it loads: `ln -s {path} {dir}/libnccl.so` and \
                 keep {dir} on LD_LIBRARY_PATH",
                searched.join(", ")
            ));
            None
        }
        (
            Lookup::NotFound {
                searched,
                last_error,
            },
            so2,
        ) => {
            let so2_error = match so2 {
                Some(Lookup::NotFound { last_error, .. }) => format!("; {last_error}"),
                _ => String::new(),
            };
            problems.push(format!(
                "no NCCL: libnccl cannot be loaded (loader: {last_error}{so2_error}); searched {}, \
                 {NCCL_SONAME} on the loader path, LD_LIBRARY_PATH={ld_library_path}; install \
                 it with `pip install nvidia-nccl-cu12` (then `ln -s libnccl.so.2 libnccl.so` in \
                 site-packages/nvidia/nccl/lib and add that directory to LD_LIBRARY_PATH) or \
                 with the system packages libnccl2 and libnccl-dev",
                searched.join(", ")
            ));
            None
        }
    };
    match (driver_path, nccl_path) {
        (Some(driver), Some(nccl)) => Ok(Libraries { driver, nccl }),
        _ => Err(unavailable(problems.join("; "))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(path: &str, missing: &[&str]) -> Lookup {
        Lookup::Found {
            name: path.rsplit('/').next().unwrap_or(path).into(),
            path: path.into(),
            missing: missing.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn not_found(names: &[&str], err: &str) -> Lookup {
        Lookup::NotFound {
            searched: names.iter().map(|s| s.to_string()).collect(),
            last_error: err.into(),
        }
    }

    fn reason(r: Result<Libraries>) -> String {
        match r {
            Err(Error::BackendUnavailable { backend, reason }) => {
                assert_eq!(backend, "nccl");
                reason
            }
            other => panic!("expected BackendUnavailable, got {other:?}"),
        }
    }

    #[test]
    fn candidate_lists_are_cudarcs_and_lack_the_wheel_name() {
        let driver = driver_candidates();
        assert!(driver.contains(&"libcuda.so".to_string()));
        assert!(driver.contains(&"libcuda.so.1".to_string()));
        let nccl = nccl_candidates();
        assert_eq!(nccl[0], "libnccl.so");
        let mut unique = nccl.clone();
        unique.dedup();
        assert_eq!(unique.len(), nccl.len(), "{nccl:?}");
        // The gap this module reports: cudarc 0.19 never tries the wheel's file name.
        assert!(!nccl.contains(&NCCL_SONAME.to_string()), "{nccl:?}");
    }

    #[test]
    fn lookup_finds_a_real_library_its_path_and_missing_symbols() {
        let names = vec!["libdoes-not-exist.so".to_string(), "libc.so.6".to_string()];
        match lookup(&names, &["malloc", "ncclGetUniqueId"]) {
            Lookup::Found {
                name,
                path,
                missing,
            } => {
                assert_eq!(name, "libc.so.6");
                assert!(path.contains("libc"), "{path}");
                assert_eq!(missing, ["ncclGetUniqueId"]);
            }
            other => panic!("libc must load: {other:?}"),
        }
        match lookup(&names[..1], &["malloc"]) {
            Lookup::NotFound {
                searched,
                last_error,
            } => {
                assert_eq!(searched, ["libdoes-not-exist.so"]);
                assert!(last_error.contains("libdoes-not-exist.so"), "{last_error}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn all_present_gives_the_paths() {
        let libs = diagnose(
            &found("/usr/lib/libcuda.so.1", &[]),
            &found("/opt/nccl/libnccl.so", &[]),
            None,
            "/opt/nccl",
        )
        .unwrap();
        assert_eq!(libs.driver, "/usr/lib/libcuda.so.1");
        assert_eq!(libs.nccl, "/opt/nccl/libnccl.so");
    }

    #[test]
    fn a_missing_driver_names_libcuda_and_the_search() {
        let r = reason(diagnose(
            &not_found(
                &["libcuda.so", "libcuda.so.1"],
                "libcuda.so.1: cannot open shared object file",
            ),
            &found("/opt/nccl/libnccl.so", &[]),
            None,
            "<unset>",
        ));
        assert!(
            r.starts_with("no CUDA driver: libcuda.so.1 cannot be loaded"),
            "{r}"
        );
        assert!(r.contains("searched libcuda.so, libcuda.so.1"), "{r}");
        assert!(r.contains("LD_LIBRARY_PATH=<unset>"), "{r}");
        assert!(!r.contains("NCCL"), "{r}");
    }

    #[test]
    fn the_wheel_name_alone_gets_the_symlink_command() {
        let r = reason(diagnose(
            &found("/usr/lib/libcuda.so.1", &[]),
            &not_found(&["libnccl.so", "libnccl.so.1"], "libnccl.so.1: nope"),
            Some(&found("/venv/nvidia/nccl/lib/libnccl.so.2", &[])),
            "/venv/nvidia/nccl/lib",
        ));
        assert!(
            r.contains("ln -s /venv/nvidia/nccl/lib/libnccl.so.2 /venv/nvidia/nccl/lib/libnccl.so"),
            "{r}"
        );
        assert!(r.contains("it tries libnccl.so, libnccl.so.1"), "{r}");
    }

    #[test]
    fn both_missing_are_both_reported() {
        let r = reason(diagnose(
            &not_found(&["libcuda.so.1"], "libcuda.so.1: cannot open"),
            &not_found(&["libnccl.so"], "libnccl.so: cannot open"),
            Some(&not_found(&[NCCL_SONAME], "libnccl.so.2: cannot open")),
            "<unset>",
        ));
        assert!(r.contains("no CUDA driver"), "{r}");
        assert!(r.contains("no NCCL: libnccl cannot be loaded (loader: libnccl.so: cannot open; libnccl.so.2: cannot open)"), "{r}");
        assert!(r.contains("pip install nvidia-nccl-cu12"), "{r}");
    }

    #[test]
    fn old_libraries_name_the_missing_symbols() {
        let r = reason(diagnose(
            &found("/usr/lib/libcuda.so.1", &["cuMemAllocAsync"]),
            &found("/opt/libnccl.so", &["ncclCommSplit"]),
            None,
            "",
        ));
        assert!(r.contains("lacks [\"cuMemAllocAsync\"]"), "{r}");
        assert!(
            r.contains("lacks [\"ncclCommSplit\"]: NCCL 2.18 or newer"),
            "{r}"
        );
    }

    #[test]
    fn probe_on_this_machine_agrees_with_what_is_installed() {
        // Never panics: either both libraries load, or the error names what is missing.
        let driver_present = matches!(lookup(&driver_candidates(), &[]), Lookup::Found { .. });
        match probe() {
            Ok(libs) => assert!(driver_present, "{libs:?}"),
            Err(e) => {
                let text = e.to_string();
                assert!(text.starts_with("backend `nccl` unavailable: "), "{text}");
                if !driver_present {
                    assert!(text.contains("libcuda.so.1"), "{text}");
                }
            }
        }
    }
}
