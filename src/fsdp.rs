//! The `Fsdp` façade.
