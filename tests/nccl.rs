//! The `nccl` feature as seen from outside the crate.
//!
//! On a machine without a CUDA driver or without NCCL (CI, this project's machines), creating
//! a group must return [`Error::BackendUnavailable`] naming the missing library — from the
//! environment, from another process group, on every rank, promptly, never a panic. On a
//! machine where the probe passes, the same tests run the collectives on device 0 instead.
#![cfg(all(feature = "nccl", target_os = "linux"))]

mod common;

use common::conformance::{self, Reductions};
use fsdp::collectives::nccl::probe::{driver_candidates, lookup, Lookup};
use fsdp::collectives::nccl::{probe, NcclProcessGroup};
use fsdp::collectives::rendezvous::LaunchEnv;
use fsdp::collectives::{ProcessGroup, ProcessGroupExt, ReduceOp, ThreadGroup};
use fsdp::{DType, Error};
use std::time::{Duration, Instant};

/// Whether this machine can run NCCL at all (driver, library, a device).
fn gpu_available() -> bool {
    probe().is_ok()
}

fn assert_unavailable(err: &Error) {
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
