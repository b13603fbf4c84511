//! The harness of the test binaries that launch themselves as jobs (`harness = false`: the
//! mpirun and torchrun tests): runs the cases this process's arguments select and prints
//! libtest's lines (`test NAME ... ok`, `test result: ...`), so that CI's summary counts them.

use std::time::Instant;

/// One test case: it fails by panicking.
pub type Case = fn();

/// Runs `cases` as libtest would with this process's arguments: words select the cases
/// whose names contain one of them, `--list` lists the names. Exits with 101 when a case
/// failed.
pub fn run(cases: &[(&str, Case)]) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    if args.iter().any(|a| a == "--list") {
        for (name, _) in cases {
            println!("{name}: test");
        }
        return;
    }
    let selected: Vec<_> = cases
        .iter()
        .filter(|(name, _)| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str())))
        .collect();
    println!("\nrunning {} tests", selected.len());
    let mut failed = Vec::new();
    for (name, case) in selected.iter() {
        let start = Instant::now();
        let outcome = std::panic::catch_unwind(case);
        let secs = start.elapsed().as_secs_f64();
        match outcome {
            Ok(()) => println!("test {name} ... ok ({secs:.1}s)"),
            Err(_) => {
                println!("test {name} ... FAILED ({secs:.1}s)");
                failed.push(*name);
            }
        }
    }
    let passed = selected.len() - failed.len();
    if failed.is_empty() {
        println!("\ntest result: ok. {passed} passed; 0 failed\n");
    } else {
        println!("\nfailures:");
        for name in &failed {
            println!("    {name}");
        }
        println!(
            "\ntest result: FAILED. {passed} passed; {} failed\n",
            failed.len()
        );
        std::process::exit(101);
    }
}
