//! Multi-process tests of `MpiProcessGroup` (feature `mpi`): real processes under `mpirun`.
//!
//! This target has its own `main` (`harness = false`) and plays two roles:
//!
//! * **Harness** (run by `cargo test --features mpi --test mpi`): launches this same executable
//!   under `mpirun --allow-run-as-root --oversubscribe -np N` with `FSDP_MPI_WORKER=<scenario>`
//!   for each case, bounds every launch by a timeout (a hang fails the case, the job's process
//!   group is killed), and checks the exit status and that every rank printed its `ok` line.
//!   A missing `mpirun` fails every case loudly. Positional arguments filter cases by
//!   substring, as libtest does; `--list` lists them. `FSDP_MPI_TIMEOUT` (seconds, default
//!   600) overrides the per-launch timeout.
//! * **Worker** (`FSDP_MPI_WORKER` set): one rank of the scenario; see `mpi/worker.rs`.
//!
//! Since the worker is the test executable itself, `cargo test` always builds it and it is
//! never stale.

mod common;
#[path = "mpi/worker.rs"]
mod worker;

use common::harness::Case;
use common::job::{run_job, Outcome};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Environment variable that turns this executable into a worker running that scenario.
pub const WORKER_ENV: &str = "FSDP_MPI_WORKER";
/// Directory shared by the ranks of the checkpoint scenarios.
pub const DIR_ENV: &str = "FSDP_MPI_DIR";

fn main() {
    if let Ok(scenario) = std::env::var(WORKER_ENV) {
        std::process::exit(worker::main(&scenario));
    }
    common::harness::run(&cases());
}

fn cases() -> Vec<(&'static str, Case)> {
    vec![
        (
            "harness_fails_when_a_rank_fails",
            harness_fails_when_a_rank_fails,
        ),
        (
            "harness_times_out_a_hanging_job",
            harness_times_out_a_hanging_job,
        ),
        ("singleton_without_mpirun_is_a_world_of_one", singleton),
        ("fully_shard_collectives_np2", || run_ok("fsdp2", 2)),
        ("fully_shard_collectives_np3", || run_ok("fsdp2", 3)),
        ("fully_shard_collectives_np4", || run_ok("fsdp2", 4)),
        ("collectives_np2", || run_ok("collectives", 2)),
        ("collectives_np3", || run_ok("collectives", 3)),
        ("collectives_np4", || run_ok("collectives", 4)),
        ("mismatched_collectives_fail_every_rank_np2", || {
            run_ok("errors", 2)
        }),
        ("mismatched_collectives_fail_every_rank_np3", || {
            run_ok("errors", 3)
        }),
        ("mismatched_collectives_fail_every_rank_np4", || {
            run_ok("errors", 4)
        }),
        ("scenario_matrix_np2", || run_ok("matrix", 2)),
        ("scenario_matrix_np3", || run_ok("matrix", 3)),
        ("scenario_matrix_np4", || run_ok("matrix", 4)),
        (
            "checkpoint_saved_at_4_processes_loads_at_3",
            checkpoint_4_to_3,
        ),
    ]
}

fn timeout() -> Duration {
    std::env::var("FSDP_MPI_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(600))
}

/// `mpirun` on this executable as a worker of `scenario`; `np = None` runs it directly.
fn launch(np: Option<usize>, scenario: &str, env: &[(&str, &str)], limit: Duration) -> Outcome {
    let exe = std::env::current_exe().expect("path of the test executable");
    let mut cmd = match np {
        Some(np) => {
            let probe = Command::new("mpirun").arg("--version").output();
            assert!(
                probe.as_ref().is_ok_and(|o| o.status.success()),
                "mpirun not found or not working ({probe:?}): the mpi tests need Open MPI \
                 (Debian: apt-get install openmpi-bin libopenmpi-dev)"
            );
            let mut cmd = Command::new("mpirun");
            cmd.args(["--allow-run-as-root", "--oversubscribe", "-np"])
                .arg(np.to_string())
                // mpirun's own limit ends the job even if this harness is killed first.
                .arg("--timeout")
                .arg((limit.as_secs() + 30).to_string())
                // Containers usually forbid the cross-memory-attach single copy.
                .args(["--mca", "btl_vader_single_copy_mechanism", "none"]);
            for (k, _) in env.iter().chain(&[(WORKER_ENV, scenario)]) {
                cmd.args(["-x", k]);
            }
            cmd.arg(&exe);
            cmd
        }
        None => Command::new(&exe),
    };
    cmd.env(WORKER_ENV, scenario)
        .envs(env.iter().copied())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    run_job(cmd, limit)
}

/// The line each rank prints when its scenario passed.
pub fn ok_line(scenario: &str, rank: usize, ws: usize) -> String {
    format!("fsdp-mpi-worker {scenario}: rank {rank} of {ws} ok")
}

fn assert_ok(outcome: &Outcome, scenario: &str, ws: usize) {
    assert!(
        outcome.status.is_some_and(|s| s.success()),
        "{scenario} at {ws} processes failed: {}",
        outcome.describe()
    );
    // Open MPI complains about ranks that exit without MPI_Finalize.
    assert!(
        !outcome.stderr.to_lowercase().contains("finalize"),
        "{scenario} at {ws} processes: MPI finalization was not clean: {}",
        outcome.describe()
    );
    for rank in 0..ws {
        assert!(
            outcome.stdout.contains(&ok_line(scenario, rank, ws)),
            "rank {rank} of {scenario} at {ws} processes did not report ok: {}",
            outcome.describe()
        );
    }
}

fn run_ok(scenario: &str, np: usize) {
    assert_ok(&launch(Some(np), scenario, &[], timeout()), scenario, np);
}

fn harness_fails_when_a_rank_fails() {
    let outcome = launch(Some(2), "selftest_fail", &[], timeout());
    assert!(
        outcome.status.is_some_and(|s| !s.success()),
        "a job whose rank 1 exits with an error must fail: {}",
        outcome.describe()
    );
    assert!(!outcome.stdout.contains(&ok_line("selftest_fail", 1, 2)));
}

fn harness_times_out_a_hanging_job() {
    let start = Instant::now();
    let outcome = launch(Some(2), "selftest_hang", &[], Duration::from_secs(20));
    assert!(
        outcome.status.is_none(),
        "a hanging job must be killed at the timeout: {}",
        outcome.describe()
    );
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "the kill took too long"
    );
}

fn singleton() {
    let outcome = launch(None, "singleton", &[], timeout());
    assert_ok(&outcome, "singleton", 1);
    assert!(
        outcome.stdout.contains(&ok_line("after_finalize", 0, 1)),
        "world() after the last handle was dropped must be a typed error: {}",
        outcome.describe()
    );
}

fn checkpoint_4_to_3() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("ckpt");
    let path = path.to_str().expect("UTF-8 temporary path");
    let env = [(DIR_ENV, path)];
    assert_ok(
        &launch(Some(4), "ckpt_save", &env, timeout()),
        "ckpt_save",
        4,
    );
    assert!(
        Path::new(path).is_dir(),
        "the save at 4 processes left no checkpoint at {path}"
    );
    assert_ok(
        &launch(Some(3), "ckpt_load", &env, timeout()),
        "ckpt_load",
        3,
    );
}
