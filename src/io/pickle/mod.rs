//! Pickle, read and written once for every format that stores one: `torch.save`'s `data.pkl`
//! ([`crate::io::torch_save`]) and DCP's `.metadata` ([`crate::io::dcp`]).
//!
//! [`op`] names the opcodes; [`machine::Machine`] runs a stream, with the allowed globals as
//! a parameter ([`Globals`]) and what a format builds behind [`machine::Format`];
//! [`emit::Emitter`] writes one. Like `torch.load(weights_only=True)` and unlike
//! `pickle.load`, nothing a stream names is ever executed.

pub(crate) mod emit;
pub(crate) mod long;
pub(crate) mod machine;
pub(crate) mod op;
pub(crate) mod value;

pub(crate) use emit::Emitter;
pub(crate) use machine::{truncated, Format, Machine};
pub(crate) use value::{Dict, Node, Value};

/// The names `torch.serialization._get_layout` knows: `str()` of each `torch.layout` of
/// PyTorch 2.13. Any other name is a `KeyError` there. Both `torch.save`'s `data.pkl` and DCP's
/// `.metadata` rebuild layouts through it.
pub(crate) const TORCH_LAYOUTS: &[&str] = &[
    "torch.strided",
    "torch.sparse_coo",
    "torch.sparse_csr",
    "torch.sparse_csc",
    "torch.sparse_bsr",
    "torch.sparse_bsc",
    "torch._mkldnn",
    "torch.jagged",
];

/// The Python globals (classes, functions, constants) a format's streams may name, and what
/// each resolves to: any other one is refused with
/// [`Error::UnsupportedPickleGlobal`](crate::error::Error::UnsupportedPickleGlobal) before
/// anything is built.
pub(crate) struct Globals<G> {
    /// `module.name` → the global, if allowed.
    pub(crate) resolve: fn(module: &str, name: &str) -> Option<G>,
}

impl<G> Globals<G> {
    /// The global `module.name`, if it is allowed.
    pub(crate) fn resolve(&self, module: &str, name: &str) -> Option<G> {
        (self.resolve)(module, name)
    }
}

#[cfg(test)]
mod tests;
