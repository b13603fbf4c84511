//! The rendezvous under PyTorch 2.13's real `torchrun`, launched as README says:
//! `torchrun --nproc-per-node 2 --no-python <program>`.
//!
//! torchrun's elastic agent already serves a `TCPStore` at `MASTER_ADDR:MASTER_PORT` and tells
//! the workers so (`TORCHELASTIC_USE_AGENT_STORE=True`); a rank that bound that port failed
//! with "Address already in use". This target has its own `main` (`harness = false`) and
//! plays two roles:
//!
//! * **Harness** (run by `cargo test`): launches `.venv/bin/torchrun` (or the `torchrun` next
//!   to `FSDP_PYTHON`) on this same executable with `FSDP_TORCHRUN_WORKER=<scenario>`, bounds
//!   every launch by a timeout (a hang fails the case; torchrun and every worker are killed),
//!   and checks the exit status and what each rank printed. Positional arguments filter
//!   cases by substring; `--list` lists them.
//! * **Worker** (`FSDP_TORCHRUN_WORKER` set): one rank. It reads the launcher variables with
//!   `LaunchEnv::from_env`, hands a blob from rank 0 to every rank with
//!   `TcpRendezvous::from_env` twice (two rendezvous of one process must not mix), checks
//!   them, and prints one line.
//!
//! Since the worker is the test executable itself, `cargo test` always builds it.

mod common;

use common::job::{run_job, Outcome, LEFTOVER};
use fsdp::collectives::rendezvous::{LaunchEnv, TcpRendezvous};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Environment variable that turns this executable into a worker running that scenario.
const WORKER_ENV: &str = "FSDP_TORCHRUN_WORKER";
/// How long one torchrun launch may take (starting Python and torch takes seconds on a
/// loaded machine); `FSDP_TORCHRUN_TIMEOUT` (seconds) overrides it.
const DEFAULT_LIMIT: Duration = Duration::from_secs(240);

fn main() {
    if let Ok(scenario) = std::env::var(WORKER_ENV) {
        std::process::exit(worker(&scenario));
    }
    let cases: [(&str, fn()); 3] = [
        ("two_ranks_rendezvous_through_the_agent_store", two_ranks),
        ("a_restarted_worker_group_reads_no_stale_bytes", restart),
        ("harness_times_out_a_hanging_job", harness_times_out),
    ];
    common::harness::run(&cases);
}

// ----- worker -----

/// One rank of `scenario`; the process exit code.
fn worker(scenario: &str) -> i32 {
    match run_worker(scenario) {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(e) => {
            eprintln!("fsdp-torchrun-worker {scenario}: error: {e}");
            1
        }
    }
}

fn run_worker(scenario: &str) -> Result<String, String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let agent = env
        .agent_store
        .clone()
        .ok_or("torchrun did not set TORCHELASTIC_USE_AGENT_STORE=True")?;
    let mut got = Vec::new();
    for round in 0..2 {
        let rdzv = TcpRendezvous::from_env(&env)
            .map_err(|e| e.to_string())?
            .with_timeout(Duration::from_secs(60));
        if !rdzv.uses_agent_store() {
            return Err("the rendezvous does not use the agent store".into());
        }
        // Only rank 0 knows its pid: a rank that prints it got it through the rendezvous.
        let blob = format!(
            "round {round} of attempt {} from pid {}",
            agent.restart_count,
            std::process::id()
        );
        let blob = rdzv
            .exchange((env.rank == 0).then_some(blob.as_bytes()))
            .map_err(|e| e.to_string())?;
        let blob = String::from_utf8(blob).map_err(|e| e.to_string())?;
        let expected = format!("round {round} of attempt {} from pid ", agent.restart_count);
        if !blob.starts_with(&expected) {
            return Err(format!("expected `{expected}…`, got `{blob}`"));
        }
        got.push(blob);
    }
    if scenario == "restart" && agent.restart_count == 0 && env.rank == 1 {
        return Err("failing attempt 0 on purpose, so that torchrun restarts the group".into());
    }
    if scenario == "hang" {
        std::thread::sleep(Duration::from_secs(3600));
    }
    Ok(format!(
        "fsdp-torchrun-worker {scenario}: rank {} of {} got `{}` then `{}`",
        env.rank, env.world_size, got[0], got[1]
    ))
}

// ----- harness -----

fn torchrun() -> PathBuf {
    let beside = |python: &Path| python.with_file_name("torchrun");
    if let Some(p) = std::env::var_os("FSDP_PYTHON") {
        return beside(Path::new(&p));
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/torchrun");
    assert!(
        venv.exists(),
        "no torchrun found: set FSDP_PYTHON to a python that has torch 2.13, or run \
         scripts/setup-venv.sh to create .venv in the crate root; this test launches the \
         rendezvous under PyTorch's own torchrun and is never skipped"
    );
    venv
}

fn limit() -> Duration {
    std::env::var("FSDP_TORCHRUN_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_LIMIT)
}

/// `torchrun --nproc-per-node 2 [extra] --no-python <this executable>` as a worker of
/// `scenario`, killed with every worker when `limit` passes.
fn launch(scenario: &str, extra: &[&str], limit: Duration) -> Outcome {
    let exe = std::env::current_exe().expect("path of the test executable");
    let mut cmd = Command::new(torchrun());
    cmd.args(["--nproc-per-node", "2"])
        .args(extra)
        .arg("--no-python")
        .arg(exe)
        .env(WORKER_ENV, scenario);
    // torchrun starts each worker in a session of its own; run_job finds them in /proc.
    run_job(cmd, limit)
}

/// The blobs rank `rank` printed in torchrun's attempt `attempt`, asserting there is exactly
/// one such line.
fn rank_line(outcome: &Outcome, scenario: &str, rank: usize, attempt: u64) -> String {
    let prefix = format!(
        "fsdp-torchrun-worker {scenario}: rank {rank} of 2 got `round 0 of attempt {attempt} "
    );
    let lines: Vec<&str> = outcome
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .collect();
    assert_eq!(lines.len(), 1, "rank {rank}: {}", outcome.describe());
    lines[0].to_string()
}

fn two_ranks() {
    let outcome = launch("exchange", &[], limit());
    assert!(
        outcome.status.is_some_and(|s| s.success()),
        "torchrun failed: {}",
        outcome.describe()
    );
    assert!(
        !outcome.stderr.contains("Address already in use"),
        "{}",
        outcome.describe()
    );
    let (zero, one) = (
        rank_line(&outcome, "exchange", 0, 0),
        rank_line(&outcome, "exchange", 1, 0),
    );
    // Rank 1 holds rank 0's pid from both rendezvous, in order.
    assert_eq!(zero, one, "{}", outcome.describe());
    assert!(
        zero.starts_with("from pid ") && zero.contains("` then `round 1 of attempt 0 from pid "),
        "{zero}"
    );
}

fn restart() {
    let outcome = launch("restart", &["--max-restarts", "1"], limit());
    assert!(
        outcome.status.is_some_and(|s| s.success()),
        "torchrun failed: {}",
        outcome.describe()
    );
    // Attempt 0 failed on rank 1 on purpose, after its rendezvous.
    assert!(
        outcome.stderr.contains("failing attempt 0 on purpose"),
        "{}",
        outcome.describe()
    );
    // Attempt 1 handed out attempt 1's bytes, not attempt 0's left in the agent's store.
    let (zero, one) = (
        rank_line(&outcome, "restart", 0, 1),
        rank_line(&outcome, "restart", 1, 1),
    );
    assert_eq!(zero, one, "{}", outcome.describe());
    assert!(
        zero.starts_with("from pid ") && zero.contains("` then `round 1 of attempt 1 from pid "),
        "{zero}"
    );
    // Rank 0 of attempt 0 had finished its rendezvous before rank 1 failed.
    rank_line(&outcome, "restart", 0, 0);
}

/// The harness itself: a job that hangs is killed at the limit, workers included.
fn harness_times_out() {
    let start = Instant::now();
    let outcome = launch("hang", &[], Duration::from_secs(30));
    assert!(outcome.status.is_none(), "{}", outcome.describe());
    // The outputs reached their end: no worker survived holding them.
    assert_ne!(outcome.stdout, LEFTOVER);
    assert_ne!(outcome.stderr, LEFTOVER);
    assert!(start.elapsed() < Duration::from_secs(60));
}
