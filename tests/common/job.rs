//! Running a multi-process job (`mpirun`, `torchrun`) from a test: in a process group of its
//! own, both pipes read, and everything it started killed when its time is up, so a hung rank
//! fails the test instead of hanging it.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What one job gave.
pub struct Outcome {
    /// `None` when the job was killed at its time limit.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    /// Status and both outputs, for a failed assertion's message.
    pub fn describe(&self) -> String {
        format!(
            "status {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// What a pipe reads as when it is still open 10 s after the launcher ended: a process
/// outlived it.
pub const LEFTOVER: &str = "<still open: a process outlived its launcher>";

/// Runs `cmd` (a launcher) to completion or until `limit` passes; then it, its process group
/// and every process below it are killed.
pub fn run_job(mut cmd: Command, limit: Duration) -> Outcome {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so that a timeout reaches the launcher and its ranks.
        .process_group(0);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {:?}: {e}", cmd.get_program()));
    let pid = child.id();
    let out = read_all(Box::new(child.stdout.take().expect("piped stdout")));
    let err = read_all(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait().expect("wait for the job") {
            Some(status) => break Some(status),
            None if Instant::now() >= deadline => {
                // Launchers may put ranks in groups or sessions of their own: collect them first.
                let ranks = descendants(pid);
                signal(&format!("-{pid}"), "TERM");
                std::thread::sleep(Duration::from_secs(2));
                signal(&format!("-{pid}"), "KILL");
                for rank in ranks {
                    signal(&rank.to_string(), "KILL");
                }
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    // Ranks left in the launcher's group would keep the pipes open: end the group.
    if status.is_some() {
        signal(&format!("-{pid}"), "KILL");
    }
    let drain = |pipe: mpsc::Receiver<String>| {
        pipe.recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| LEFTOVER.to_string())
    };
    Outcome {
        status,
        stdout: drain(out),
        stderr: drain(err),
    }
}

/// Reads a pipe to its end on a thread of its own.
fn read_all(mut pipe: Box<dyn Read + Send>) -> mpsc::Receiver<String> {
    let (send, receive) = mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        let _ = send.send(s);
    });
    receive
}

/// Every process below `pid` (from `/proc`).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may contain spaces and parentheses.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        if let Some(ppid) = after.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
            parent_of.push((child, ppid));
        }
    }
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    found.split_off(1)
}

/// `kill -SIGNAL -- TARGET` (a pid, or `-pgid` for a process group).
pub fn signal(target: &str, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg("--")
        .arg(target)
        .stderr(Stdio::null())
        .status();
}
