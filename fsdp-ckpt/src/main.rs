//! The `fsdp-ckpt` executable; the tool itself is the library's [`fsdp_ckpt::main_with_args`].

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(fsdp_ckpt::main_with_args(std::env::args_os()))
}
