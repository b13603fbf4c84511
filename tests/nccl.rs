//! The `nccl` feature as seen from outside the crate.
//!
//! On a machine without a CUDA driver or without NCCL (CI, this project's machines), creating
//! a group must return [`Error::BackendUnavailable`] naming the missing library — from the
//! environment, from another process group, on every rank, promptly, never a panic. On a
//! machine where the probe passes, the same tests run the collectives on device 0 instead,
//! time the device collectives of 1 GiB and compare FSDP2's collectives with the thread
//! backend's. With `FSDP_REQUIRE_GPU=1` (the GPU kit's runner, `scripts/gpu-check.sh`, sets
//! it) a machine that cannot run NCCL fails every test instead of taking the CPU branch.
#![cfg(all(feature = "nccl", target_os = "linux"))]

mod common;

use common::conformance::{self, Reductions};
use common::fsdp2;
use cudarc::driver::{CudaSlice, CudaStream};
use fsdp::collectives::nccl::probe::{driver_candidates, lookup, Lookup};
use fsdp::collectives::nccl::{probe, NcclProcessGroup};
use fsdp::collectives::rendezvous::LaunchEnv;
use fsdp::collectives::{ProcessGroup, ProcessGroupExt, ReduceOp, ThreadGroup};
use fsdp::{DType, Error, HostTensor};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether this machine can run NCCL at all (driver, library, a device).
fn gpu_available() -> bool {
    probe().is_ok()
}

/// Whether `FSDP_REQUIRE_GPU=1`: NCCL being unavailable is then a failure.
fn gpu_required() -> bool {
    std::env::var_os("FSDP_REQUIRE_GPU").is_some_and(|v| v == "1")
}

fn assert_unavailable(err: &Error) {
    assert!(
        !gpu_required(),
        "FSDP_REQUIRE_GPU=1 but NCCL cannot run here: {err}"
    );
    match err {
        Error::BackendUnavailable { backend, reason } => {
            assert_eq!(backend, "nccl");
            // The probe names what is missing: the driver first.
            let driver_missing =
                matches!(lookup(&driver_candidates(), &[]), Lookup::NotFound { .. });
            if driver_missing {
                assert!(reason.contains("libcuda.so.1"), "{reason}");
            } else {
                assert!(
                    reason.contains("libnccl") || reason.contains("device"),
                    "{reason}"
                );
            }
        }
        other => panic!("expected Error::BackendUnavailable, got {other:?}"),
    }
}

#[test]
fn probe_names_the_missing_libraries_or_finds_both() {
    match probe() {
        Ok(libs) => {
            assert!(libs.driver.contains("libcuda"), "{libs:?}");
            assert!(libs.nccl.contains("libnccl"), "{libs:?}");
            report_versions(&libs);
        }
        Err(e) => {
            assert_unavailable(&e);
            let text = e.to_string();
            assert!(text.starts_with("backend `nccl` unavailable: "), "{text}");
            // When NCCL is absent too, the message says how to install it.
            if text.contains("no NCCL") {
                assert!(text.contains("pip install nvidia-nccl-cu12"), "{text}");
            }
        }
    }
}

#[test]
fn from_a_thread_group_fails_every_rank_with_the_typed_error() {
    if gpu_available() {
        return run_on_device_0();
    }
    let start = Instant::now();
    let results = ThreadGroup::run(3, |pg| NcclProcessGroup::from_process_group(&pg, 0));
    for (rank, r) in results.into_iter().enumerate() {
        let err = r.expect_err("no CUDA here");
        assert_unavailable(&err);
        // Each rank reports its own probe failure (the others' are in the same state).
        assert!(
            err.to_string().contains("backend `nccl` unavailable"),
            "rank {rank}: {err}"
        );
    }
    // Every rank learns the others' failure in the exchange: no rank waits for a timeout.
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn from_launch_variables_fails_promptly_on_every_rank() {
    if gpu_available() {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let results = std::thread::scope(|s| {
        let joins: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let env = LaunchEnv {
                        rank,
                        world_size: 2,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        local_rank: Some(rank),
                        agent_store: None,
                    };
                    NcclProcessGroup::from_launch_env(&env, Duration::from_secs(60))
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("no panic"))
            .collect::<Vec<_>>()
    });
    for r in results {
        assert_unavailable(&r.expect_err("no CUDA here"));
    }
    // Each rank fails its local probe before the rendezvous, so nobody waits 60 s.
    assert!(start.elapsed() < Duration::from_secs(30));
}

/// The only test that touches the process environment (tests run on parallel threads).
#[test]
fn from_env_reads_the_variables_then_reports_the_backend() {
    let vars = [
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_RANK",
    ];
    for v in vars {
        std::env::remove_var(v);
    }
    match NcclProcessGroup::from_env() {
        Err(Error::Environment { variable, reason }) => {
            assert_eq!(variable, "RANK");
            assert!(reason.contains("not set"), "{reason}");
        }
        other => panic!("expected a missing RANK, got {other:?}"),
    }
    std::env::set_var("RANK", "0");
    std::env::set_var("WORLD_SIZE", "1");
    std::env::set_var("MASTER_ADDR", "127.0.0.1");
    std::env::set_var("MASTER_PORT", "0");
    let r = NcclProcessGroup::from_env();
    for v in vars {
        std::env::remove_var(v);
    }
    match r {
        Ok(pg) => {
            assert!(gpu_available());
            assert_eq!((pg.rank(), pg.world_size()), (0, 1));
        }
        Err(e) => assert_unavailable(&e),
    }
}

#[test]
fn nccl_groups_pass_the_conformance_suite_where_a_gpu_exists() {
    if let Err(e) = probe() {
        // Without a GPU the group cannot exist; what can be checked is that it says why.
        assert_unavailable(&e);
        eprintln!("skipped: the NCCL conformance suite needs a CUDA device ({e})");
        return;
    }
    // One rank per visible device (NCCL refuses two ranks on one device).
    let devices = cudarc::driver::CudaContext::device_count().expect("count CUDA devices");
    let devices = usize::try_from(devices).expect("a device count");
    assert!(devices > 0, "the probe passed, so a device is visible");
    ThreadGroup::run(devices, |pg| {
        let nccl = NcclProcessGroup::from_process_group(&pg, pg.rank()).unwrap();
        conformance::run(&nccl, Reductions::BackendOrder, "nccl");
    });
}

/// On a machine with a GPU: world size 1 over a thread group, every host collective and the
/// device ones. (Not reached on machines without CUDA.)
fn run_on_device_0() {
    let results = ThreadGroup::run(1, |pg| -> fsdp::Result<()> {
        let nccl = NcclProcessGroup::from_process_group(&pg, 0)?;
        let mut recv = [0u8; 3];
        nccl.all_gather_into(&[1, 2, 3], &mut recv)?;
        assert_eq!(recv, [1, 2, 3]);
        assert_eq!(nccl.broadcast_bytes(Some(b"abc"), 0)?, b"abc");
        assert_eq!(nccl.all_gather_object(&7u32)?, [7]);
        let mut buf = 2.5f32.to_le_bytes();
        nccl.all_reduce(&mut buf, DType::F32, ReduceOp::Sum)?;
        assert_eq!(f32::from_le_bytes(buf), 2.5);
        let err = nccl.broadcast(&mut [0u8; 4], 1).unwrap_err();
        assert!(matches!(err, Error::InvalidCollective { .. }), "{err:?}");
        nccl.barrier()?;
        let sub = nccl.new_subgroup(&[0])?.expect("rank 0 is a member");
        assert_eq!(sub.world_size(), 1);
        let stream = nccl.stream().clone();
        let send = stream.clone_htod(&[1.0f32, 2.0]).expect("upload");
        let mut out = stream.alloc_zeros::<f32>(2).expect("alloc");
        nccl.all_gather_device(&send, &mut out)?;
        nccl.reduce_scatter_device(&send, &mut out, ReduceOp::Avg)?;
        nccl.synchronize()?;
        assert_eq!(stream.clone_dtoh(&out).expect("download"), [1.0, 2.0]);
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

/// Prints what the GPU run used (the runner keeps it): libraries, versions, device 0.
fn report_versions(libs: &fsdp::collectives::nccl::probe::Libraries) {
    let mut cuda = 0i32;
    // SAFETY: the probe loaded the driver, which exports cuDriverGetVersion since CUDA 2.2 (it
    // needs no cuInit); `cuda` is a valid out-pointer.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut cuda) };
    assert_eq!(status, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    let version = ThreadGroup::run(1, |pg| -> fsdp::Result<_> {
        let nccl = NcclProcessGroup::from_process_group(&pg, 0)?;
        let ctx = nccl.context();
        let device = format!(
            "{}, {} GiB, compute capability {:?}",
            ctx.name().expect("device name"),
            ctx.total_mem().expect("device memory") >> 30,
            ctx.compute_capability().expect("compute capability")
        );
        Ok((nccl.nccl_version()?, device))
    })
    .pop()
    .expect("one rank")
    .unwrap();
    let (nccl, device) = version;
    println!(
        "probe: CUDA driver {} (CUDA {}.{}); NCCL {} (version {}.{}.{}); device 0: {device}",
        libs.driver,
        cuda / 1000,
        cuda % 1000 / 10,
        libs.nccl,
        nccl / 10000,
        nccl % 10000 / 100,
        nccl % 100
    );
    // ncclCommSplit (sub-groups) needs 2.18; the probe checked the symbol, this the version.
    assert!(nccl >= 21800, "NCCL {nccl} is older than 2.18");
}

/// FSDP2's collectives (tests/it/fsdp2_comm.rs's suite) through NCCL at world size 1 produce
/// what the thread backend produces, bit for bit.
#[test]
fn fsdp2_collectives_through_nccl_equal_the_thread_groups() {
    let want: Vec<HostTensor> = ThreadGroup::run(1, |pg| fsdp2::outputs(&pg, "threads"))
        .pop()
        .expect("one rank");
    assert!(!want.is_empty());
    if !gpu_available() {
        return assert_unavailable(&probe().unwrap_err());
    }
    let got = ThreadGroup::run(1, |pg| {
        let nccl = NcclProcessGroup::from_process_group(&pg, 0).unwrap();
        fsdp2::outputs(&nccl, "nccl")
    })
    .pop()
    .expect("one rank");
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.bit_eq(w),
            "output {i} of the FSDP2 suite: NCCL differs from threads"
        );
    }
    println!(
        "fsdp2: {} outputs of the FSDP2 suite through NCCL equal the thread group's bit for bit",
        got.len()
    );
}

/// The bytes each timed collective moves: `FSDP_GPU_CHECK_BYTES`, else 1 GiB.
fn timed_bytes() -> usize {
    std::env::var("FSDP_GPU_CHECK_BYTES")
        .ok()
        .map(|v| v.parse().expect("FSDP_GPU_CHECK_BYTES is a byte count"))
        .unwrap_or(1 << 30)
}

/// `all_gather_device`, `reduce_scatter_device` and `broadcast_device` of 1 GiB of f32 at world
/// size 1, each against a device-to-device copy of the same bytes, timed with CUDA events
/// (the fastest and the median of 10 after a warm-up); every result checked bit for bit.
#[test]
fn timed_device_collectives_of_1_gib() {
    if !gpu_available() {
        return assert_unavailable(&probe().unwrap_err());
    }
    let n = timed_bytes() / 4;
    ThreadGroup::run(1, |pg| {
        let nccl = NcclProcessGroup::from_process_group(&pg, 0).unwrap();
        let stream = nccl.stream().clone();
        // Finite, integer-valued floats: any reduction at one rank must leave them as they are.
        let host: Vec<f32> = (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 9) as f32 - 4_194_304.0)
            .collect();
        let send = stream.clone_htod(&host).expect("upload");
        let mut recv = stream.alloc_zeros::<f32>(n).expect("alloc");
        let mut copy = stream.alloc_zeros::<f32>(n).expect("alloc");
        let copy_ms = time(&stream, || {
            stream.memcpy_dtod(&send, &mut copy).expect("copy");
            Ok(())
        });
        check(&stream, &copy, &host, "device copy");
        let report = |op: &str, ms: (f32, f32)| {
            println!(
                "timed: {op:<22} {:.2} GiB: fastest {:.3} ms, median {:.3} ms, {:.0} GB/s; \
                 device copy fastest {:.3} ms: {:.2}x its time",
                (n * 4) as f64 / f64::from(1u32 << 30),
                ms.0,
                ms.1,
                (n * 4) as f64 / f64::from(ms.0) / 1e6,
                copy_ms.0,
                ms.0 / copy_ms.0
            )
        };
        report("device copy", copy_ms);
        let ms = time(&stream, || nccl.all_gather_device(&send, &mut recv));
        check(&stream, &recv, &host, "all_gather_device");
        report("all_gather_device", ms);
        stream.memset_zeros(&mut recv).expect("memset");
        let ms = time(&stream, || {
            nccl.reduce_scatter_device(&send, &mut recv, ReduceOp::Sum)
        });
        check(&stream, &recv, &host, "reduce_scatter_device");
        report("reduce_scatter_device", ms);
        let ms = time(&stream, || nccl.broadcast_device(&mut copy, 0));
        check(&stream, &copy, &host, "broadcast_device");
        report("broadcast_device", ms);
    });
}

/// The fastest and the median time of `op` over 10 runs after one, by CUDA events.
fn time(stream: &Arc<CudaStream>, mut op: impl FnMut() -> fsdp::Result<()>) -> (f32, f32) {
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    op().unwrap();
    let mut ms: Vec<f32> = (0..10)
        .map(|_| {
            let start = stream.record_event(timing).expect("event");
            op().unwrap();
            let end = stream.record_event(timing).expect("event");
            start.elapsed_ms(&end).expect("elapsed")
        })
        .collect();
    ms.sort_by(f32::total_cmp);
    (ms[0], ms[ms.len() / 2])
}

/// Downloads `dev` and requires it equal to `host` bit for bit.
fn check(stream: &Arc<CudaStream>, dev: &CudaSlice<f32>, host: &[f32], what: &str) {
    let got = stream.clone_dtoh(dev).expect("download");
    assert_eq!(got.len(), host.len(), "{what}: length");
    if let Some(i) = (0..host.len()).find(|&i| got[i].to_bits() != host[i].to_bits()) {
        panic!("{what}: element {i} is {} instead of {}", got[i], host[i]);
    }
}
