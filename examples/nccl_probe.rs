//! Checks whether this machine can run the NCCL backend: prints the CUDA driver and NCCL
//! libraries cudarc would load, or the error explaining what is missing.
//!
//! `cargo run --example nccl_probe --features nccl`

fn main() {
    match fsdp::collectives::nccl::probe() {
        Ok(libs) => println!("CUDA driver: {}\nNCCL: {}", libs.driver, libs.nccl),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
