//! `fsdp-ckpt` as an MPI job (feature `mpi`): `mpirun -np N fsdp-ckpt reshard …`,
//! `consolidate` and `convert` (`--to dcp`, `--to fsdp`) split the work across N processes
//! and write exactly the bytes a single-process run writes; a failure on one process fails
//! every process with the same error and leaves no output.
//!
//! This target has its own `main` (`harness = false`): it builds a small checkpoint with
//! thread ranks, runs the tool alone for the reference output, then under
//! `mpirun --allow-run-as-root --oversubscribe -np N` (each launch bounded by a timeout, which
//! fails the case). A missing `mpirun` fails every case loudly. Positional arguments filter
//! cases by substring.

#[path = "../../tests/common/mod.rs"]
mod common;
mod tool;

use common::job::{run_job, Outcome};
use common::{files_of, full_adam, nested_model, wrap, wrap_alt};
use fsdp::collectives::ThreadGroup;
use fsdp::Fsdp;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

fn main() {
    let cases: Vec<(&str, fn())> = vec![
        ("reshard_np1_is_the_single_process_run", || {
            reshard_matches_single_process(1)
        }),
        ("reshard_np2_writes_the_single_process_bytes", || {
            reshard_matches_single_process(2)
        }),
        ("reshard_np3_writes_the_single_process_bytes", || {
            reshard_matches_single_process(3)
        }),
        (
            "reshard_failing_on_one_process_fails_all_with_one_error_np2",
            || failure_on_process_1("reshard"),
        ),
        (
            "consolidate_safetensors_np2_writes_the_single_process_bytes",
            || consolidate_matches_single_process(2, Input::Checkpoint, "safetensors"),
        ),
        (
            "consolidate_safetensors_np3_writes_the_single_process_bytes",
            || consolidate_matches_single_process(3, Input::Checkpoint, "safetensors"),
        ),
        ("consolidate_pt_np2_writes_the_single_process_bytes", || {
            consolidate_matches_single_process(2, Input::Checkpoint, "pt")
        }),
        ("consolidate_pt_np3_writes_the_single_process_bytes", || {
            consolidate_matches_single_process(3, Input::Checkpoint, "pt")
        }),
        (
            "consolidate_dcp_pt_np2_writes_the_single_process_bytes",
            || consolidate_matches_single_process(2, Input::Dcp, "pt"),
        ),
        (
            "consolidate_dcp_pt_np3_writes_the_single_process_bytes",
            || consolidate_matches_single_process(3, Input::Dcp, "pt"),
        ),
        (
            "consolidate_dcp_safetensors_np2_writes_the_single_process_bytes",
            || consolidate_matches_single_process(2, Input::Dcp, "safetensors"),
        ),
        (
            "consolidate_dcp_safetensors_np3_writes_the_single_process_bytes",
            || consolidate_matches_single_process(3, Input::Dcp, "safetensors"),
        ),
        (
            "convert_to_dcp_np2_writes_the_single_process_data_file",
            || convert_to_dcp_matches_single_process(2),
        ),
        (
            "convert_to_dcp_np3_writes_the_single_process_data_file",
            || convert_to_dcp_matches_single_process(3),
        ),
        ("convert_to_hf_np2_writes_the_single_process_files", || {
            convert_to_hf_matches_single_process(2)
        }),
        ("convert_to_hf_np3_writes_the_single_process_files", || {
            convert_to_hf_matches_single_process(3)
        }),
        (
            "convert_dcp_to_fsdp_np2_writes_the_single_process_bytes",
            || convert_to_fsdp_matches_single_process(2),
        ),
        (
            "convert_dcp_to_fsdp_np3_writes_the_single_process_bytes",
            || convert_to_fsdp_matches_single_process(3),
        ),
        (
            "deepspeed_consolidate_optim_np2_writes_the_single_process_bytes",
            || deepspeed_matches_single_process(2),
        ),
        (
            "deepspeed_consolidate_and_convert_np3_write_the_single_process_bytes",
            || deepspeed_matches_single_process(3),
        ),
        (
            "convert_to_dcp_failing_on_one_process_fails_all_with_one_error_np2",
            || failure_on_process_1("convert"),
        ),
        (
            "consolidate_failing_on_one_process_fails_all_with_one_error_np2",
            || failure_on_process_1("consolidate"),
        ),
        (
            "consolidate_pt_failing_on_one_process_fails_all_with_one_error_np2",
            || failure_on_process_1("consolidate-pt"),
        ),
    ];
    common::harness::run(&cases);
}

/// A fresh directory under cargo's temporary directory for this target (kept small).
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cli_mpi")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The nested model's Adam state saved as a checkpoint of `ws` thread ranks at `dir`.
fn saved_checkpoint(dir: &Path, ws: usize) {
    let model = nested_model();
    let full = full_adam(&model);
    for r in ThreadGroup::run(ws, |pg| {
        let fsdp = Fsdp::new(&model, &wrap(false), Arc::new(pg))?;
        let params = fsdp.optim_params();
        let local = fsdp.shard_full_optim_state_dict(&full, &params)?;
        fsdp.save_optim_checkpoint(&local, &params, dir, &Default::default())
    }) {
        r.unwrap();
    }
}

/// `fsdp-ckpt --quiet ARGS` under `mpirun -np N`, every output line tagged with its rank.
fn mpirun(np: usize, args: &[&dyn AsRef<OsStr>]) -> Outcome {
    let probe = Command::new("mpirun").arg("--version").output();
    assert!(
        probe.as_ref().is_ok_and(|o| o.status.success()),
        "mpirun not found or not working ({probe:?}): these tests need Open MPI \
         (Debian: apt-get install openmpi-bin libopenmpi-dev)"
    );
    let limit = Duration::from_secs(120);
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--tag-output",
        "-np",
    ])
    .arg(np.to_string())
    .arg("--timeout")
    .arg((limit.as_secs() + 30).to_string())
    .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
    .arg(tool::BIN)
    .arg("--quiet");
    for a in args {
        cmd.arg(a.as_ref());
    }
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    run_job(cmd, limit)
}

/// The entries of `dir` (to see that no temporary was left behind).
fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A checkpoint of 8 ranks resharded for 3 ranks under the other wrapping: N processes
/// write the same directory, byte for byte, as the tool alone.
fn reshard_matches_single_process(np: usize) {
    let root = scratch(&format!("reshard-np{np}"));
    let ckpt = root.join("ckpt8");
    saved_checkpoint(&ckpt, 8);
    let policy = root.join("alt.json");
    std::fs::write(&policy, serde_json::to_string(&wrap_alt()).unwrap()).unwrap();
    let alone = root.join("alone");
    let job = root.join("job");
    let args = |out: &Path| -> Vec<std::ffi::OsString> {
        vec![
            "reshard".into(),
            ckpt.clone().into(),
            out.into(),
            "--world-size".into(),
            "3".into(),
            "--policy".into(),
            policy.clone().into(),
        ]
    };
    let a = args(&alone);
    let a: Vec<&dyn AsRef<OsStr>> = a.iter().map(|s| s as &dyn AsRef<OsStr>).collect();
    tool::ok(&tool::run(&a));
    let j = args(&job);
    let j: Vec<&dyn AsRef<OsStr>> = j.iter().map(|s| s as &dyn AsRef<OsStr>).collect();
    let outcome = mpirun(np, &j);
    assert!(
        outcome.status.is_some_and(|s| s.success()),
        "reshard at {np} processes failed: {}",
        outcome.describe()
    );
    let (want, got) = (files_of(&alone), files_of(&job));
    let names = |v: &[(String, Vec<u8>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&got), names(&want), "the same files");
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        assert!(w == g, "{name} differs between 1 and {np} processes");
    }
    // Only process 0 reports, once.
    let reports = outcome.stderr.matches("resharded ").count();
    assert_eq!(reports, 1, "{}", outcome.describe());
    assert_eq!(names_in(&root), ["alone", "alt.json", "ckpt8", "job"]);
    std::fs::remove_dir_all(&root).unwrap();
}

/// What `consolidate` reads.
#[derive(Clone, Copy)]
enum Input {
    /// The crate's checkpoint of 8 ranks (`saved_checkpoint`).
    Checkpoint,
    /// PyTorch 2.13's DCP directory of FSDP2 at 4 ranks (`tests/golden/dcp/fsdp2_adam_ws4`).
    Dcp,
}

/// `input` consolidated to `full.EXT` by the tool alone and by N processes, split across
/// them (in two directories: a torch.save archive is named after its file): the same file,
/// byte for byte.
fn consolidate_matches_single_process(np: usize, input: Input, ext: &str) {
    let from = match input {
        Input::Checkpoint => "ckpt",
        Input::Dcp => "dcp",
    };
    let root = scratch(&format!("consolidate-{from}-{ext}-np{np}"));
    let ckpt = root.join("in");
    match input {
        Input::Checkpoint => saved_checkpoint(&ckpt, 8),
        Input::Dcp => {
            let golden = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/golden/dcp/fsdp2_adam_ws4/ckpt");
            std::fs::create_dir(&ckpt).unwrap();
            for e in std::fs::read_dir(golden).unwrap() {
                let e = e.unwrap();
                std::fs::copy(e.path(), ckpt.join(e.file_name())).unwrap();
            }
        }
    }
    let alone = root.join("alone").join(format!("full.{ext}"));
    let job = root.join("job").join(format!("full.{ext}"));
    std::fs::create_dir(root.join("alone")).unwrap();
    std::fs::create_dir(root.join("job")).unwrap();
    tool::ok(&tool::run(&[&"consolidate", &ckpt, &alone]));
    let outcome = mpirun(np, &[&"consolidate", &ckpt, &job]);
    assert!(
        outcome.status.is_some_and(|s| s.success()),
        "consolidate at {np} processes failed: {}",
        outcome.describe()
    );
    assert!(
        std::fs::read(&alone).unwrap() == std::fs::read(&job).unwrap(),
        "{ext} differs between 1 and {np} processes"
    );
    assert_eq!(outcome.stderr.matches("consolidated ").count(), 1);
    assert!(
        outcome.stderr.contains(&format!("on {np} processes")),
        "not split across the processes: {}",
        outcome.describe()
    );
    let full = format!("full.{ext}");
    assert_eq!(names_in(&root), ["alone", "in", "job"]);
    assert_eq!(names_in(&root.join("job")), [full.as_str()]);
    std::fs::remove_dir_all(&root).unwrap();
}

/// The 8-rank checkpoint, and its consolidated `.pt` and `.safetensors` files, converted to a
/// DCP directory by the tool alone and by N processes: the same data file byte for byte
/// (`.metadata` differs only in its random save id) and the same state once loaded.
fn convert_to_dcp_matches_single_process(np: usize) {
    let root = scratch(&format!("convert-dcp-np{np}"));
    let ckpt = root.join("ckpt8");
    saved_checkpoint(&ckpt, 8);
    let job = convert_alone_and_as_job(np, &ckpt, &root, "");
    assert_eq!(names_in(&root), ["alone", "ckpt8", "job"]);
    assert_eq!(names_in(&job), [".metadata", "__0_0.distcp"]);
    // From the consolidated torch.save and safetensors files: the same again.
    for ext in ["pt", "safetensors"] {
        let full = root.join(format!("full.{ext}"));
        tool::ok(&tool::run(&[&"consolidate", &ckpt, &full]));
        convert_alone_and_as_job(np, &full, &root, &format!("-{ext}"));
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// The FSDP2 DCP checkpoint of a tiny Llama (tests/golden/hf) exported to a Hugging Face
/// model by the tool alone and by N processes, each writing its share of the files: the same
/// files, byte for byte; and that model directory imported back to DCP the same way.
fn convert_to_hf_matches_single_process(np: usize) {
    let root = scratch(&format!("convert-hf-np{np}"));
    let src = tool::golden("hf").join("llama_untied/dcp");
    let (alone, job) = (root.join("alone"), root.join("job"));
    let args = |out: &Path| -> Vec<std::ffi::OsString> {
        vec![
            "convert".into(),
            src.clone().into(),
            out.into(),
            "--to".into(),
            "hf".into(),
            "--max-shard-size".into(),
            "60KB".into(),
        ]
    };
    tool::ok(&tool::run(&as_refs(&args(&alone))));
    let outcome = mpirun(np, &as_refs(&args(&job)));
    assert!(
        outcome.status.is_some_and(|s| s.success()),
        "convert --to hf at {np} processes failed: {}",
        outcome.describe()
    );
    assert_eq!(names_in(&job).len(), 4, "3 files and the index");
    assert_eq!(common::files_of(&alone), common::files_of(&job));
    assert_eq!(outcome.stderr.matches("exported ").count(), 1);
    assert!(outcome.stderr.contains(&format!("a job of {np} processes")));
    convert_alone_and_as_job(np, &job, &root, "-import");
    std::fs::remove_dir_all(&root).unwrap();
}

/// `convert INPUT ROOT/alone{suffix} --to dcp` by the tool alone and `ROOT/job{suffix}` under
/// `mpirun -np N`: the same data file and the same state loaded, one report naming the job.
/// Returns the job's directory.
fn convert_alone_and_as_job(np: usize, input: &Path, root: &Path, suffix: &str) -> PathBuf {
    let what = input.display();
    let (alone, job) = (
        root.join(format!("alone{suffix}")),
        root.join(format!("job{suffix}")),
    );
    tool::ok(&tool::run(&[&"convert", &input, &alone, &"--to", &"dcp"]));
    let outcome = mpirun(np, &[&"convert", &input, &job, &"--to", &"dcp"]);
    assert!(
        outcome.status.is_some_and(|s| s.success()),
        "convert of {what} at {np} processes failed: {}",
        outcome.describe()
    );
    let data = |dir: &Path| std::fs::read(dir.join("__0_0.distcp")).unwrap();
    assert!(data(&alone) == data(&job), "{what}: the data file differs");
    let load = |dir: &Path| {
        fsdp::io::dcp::DcpCheckpoint::open(dir)
            .unwrap()
            .load()
            .unwrap()
    };
    assert!(
        load(&alone).bit_eq(&load(&job)),
        "{what}: the loaded state differs"
    );
    assert_eq!(outcome.stderr.matches("converted ").count(), 1);
    assert!(outcome.stderr.contains(&format!("a job of {np} processes")));
    job
}

/// A DeepSpeed ZeRO-2 bf16 checkpoint (tests/golden/deepspeed) consolidated with `--optim` to
/// both formats, and converted `--to dcp`, by the tool alone and by N processes: the same
/// bytes (the same data file and loaded state for DCP), one report naming the job.
fn deepspeed_matches_single_process(np: usize) {
    let root = scratch(&format!("deepspeed-np{np}"));
    let src = tool::golden("deepspeed").join("zero2_bf16/ckpt");
    for ext in ["pt", "safetensors"] {
        let (alone, job) = (
            root.join(format!("alone-{ext}")),
            root.join(format!("job-{ext}")),
        );
        std::fs::create_dir_all(&alone).unwrap();
        std::fs::create_dir_all(&job).unwrap();
        let file = format!("full.{ext}");
        tool::ok(&tool::run(&[
            &"consolidate",
            &src,
            &alone.join(&file),
            &"--optim",
        ]));
        let outcome = mpirun(np, &[&"consolidate", &src, &job.join(&file), &"--optim"]);
        assert!(
            outcome.status.is_some_and(|s| s.success()),
            "consolidate --optim at {np} processes failed: {}",
            outcome.describe()
        );
        assert!(
            std::fs::read(alone.join(&file)).unwrap() == std::fs::read(job.join(&file)).unwrap(),
            "{ext} differs between 1 and {np} processes"
        );
        assert_eq!(outcome.stderr.matches("consolidated ").count(), 1);
        assert!(
            outcome.stderr.contains(&format!("on {np} processes")),
            "not split across the processes: {}",
            outcome.describe()
        );
    }
    convert_alone_and_as_job(np, &src, &root, "-dcp");
    std::fs::remove_dir_all(&root).unwrap();
}

/// PyTorch's FSDP2 DCP fixture (tests/golden/dcp) converted to the crate's checkpoint for 5
/// ranks by the tool alone and by N processes: the same files, byte for byte.
fn convert_to_fsdp_matches_single_process(np: usize) {
    use fsdp::commands::rank_dicts::DescFile;
    use fsdp::WrapPolicy;
    let root = scratch(&format!("convert-fsdp-np{np}"));
    let input =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/dcp/fsdp2_adam_ws4/ckpt");
    // gen.py's Net, wrapped as FSDP1 wraps it: net1, net2, the root.
    let model = common::dcp_fixture_net();
    let desc = root.join("desc.json");
    let policy = WrapPolicy::units(&["net1", "net2", ""]);
    std::fs::write(&desc, DescFile::new(model, policy).to_json()).unwrap();
    let (alone, job) = (root.join("alone"), root.join("job"));
    let args = |out: &Path| -> Vec<std::ffi::OsString> {
        vec![
            "convert".into(),
            input.clone().into(),
            out.into(),
            "--to".into(),
            "fsdp".into(),
            "--model".into(),
            desc.clone().into(),
            "--world-size".into(),
            "5".into(),
        ]
    };
    let (alone_args, job_args) = (args(&alone), args(&job));
    tool::ok(&tool::run(&as_refs(&alone_args)));
    let outcome = mpirun(np, &as_refs(&job_args));
    assert!(
        outcome.status.is_some_and(|s| s.success()),
        "convert --to fsdp at {np} processes failed: {}",
        outcome.describe()
    );
    assert!(files_of(&alone) == files_of(&job), "the checkpoints differ");
    assert_eq!(outcome.stderr.matches("converted ").count(), 1);
    assert!(outcome.stderr.contains(&format!("a job of {np} processes")));
    assert_eq!(names_in(&root), ["alone", "desc.json", "job"]);
    std::fs::remove_dir_all(&root).unwrap();
}

/// A corrupt block that only process 1 reads (the end of input rank 7's file: output rank 1
/// of 2 holds it, and the consolidated file's last tensors): every process fails with the
/// error the tool alone gives, and neither the output nor a temporary is left.
fn failure_on_process_1(command: &str) {
    let root = scratch(&format!("{command}-fail"));
    let ckpt = root.join("ckpt8");
    saved_checkpoint(&ckpt, 8);
    let file = ckpt.join("rank7.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let (out, args): (PathBuf, Vec<std::ffi::OsString>) = if command == "reshard" {
        let out = root.join("out");
        let args = vec![
            "reshard".into(),
            ckpt.clone().into(),
            out.clone().into(),
            "--world-size".into(),
            "2".into(),
        ];
        (out, args)
    } else if command == "convert" {
        let out = root.join("out");
        let args = vec![
            "convert".into(),
            ckpt.clone().into(),
            out.clone().into(),
            "--to".into(),
            "dcp".into(),
        ];
        (out, args)
    } else {
        let ext = if command == "consolidate-pt" {
            "pt"
        } else {
            "safetensors"
        };
        let out = root.join(format!("out.{ext}"));
        (
            out.clone(),
            vec!["consolidate".into(), ckpt.clone().into(), out.into()],
        )
    };
    let args = as_refs(&args);
    let alone = tool::fails(
        &tool::run(&args),
        &["rank7.safetensors", "fails its checksum"],
    );
    let outcome = mpirun(2, &args);
    assert!(
        outcome.status.is_some_and(|s| !s.success()),
        "{}",
        outcome.describe()
    );
    for rank in 0..2 {
        let line = format!("[1,{rank}]<stderr>:{}", alone.trim_end());
        assert!(
            outcome.stderr.lines().any(|l| l == line),
            "process {rank} does not report the single-process error `{}`: {}",
            alone.trim_end(),
            outcome.describe()
        );
    }
    assert!(!out.exists(), "no output on failure");
    assert_eq!(names_in(&root), ["ckpt8"], "no temporary left behind");
    std::fs::remove_dir_all(&root).unwrap();
}

/// `args` as the argument list [`mpirun`] and `tool::run` take.
fn as_refs(args: &[std::ffi::OsString]) -> Vec<&dyn AsRef<OsStr>> {
    args.iter().map(|s| s as &dyn AsRef<OsStr>).collect()
}
