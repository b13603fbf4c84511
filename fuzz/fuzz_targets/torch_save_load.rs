//! Feeds arbitrary bytes to the `torch.save` reader: it must return a value or a typed error,
//! never panic, and never allocate without bound.
#![no_main]

use fsdp::io::torch_save::{load_from_bytes, optim_from_pyobj};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(obj) = load_from_bytes(data) {
        // Whatever parses must also convert (or fail) without panicking.
        let _ = optim_from_pyobj(obj);
    }
});
