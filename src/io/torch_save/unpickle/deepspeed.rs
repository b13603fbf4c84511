//! The three DeepSpeed globals a ZeRO checkpoint's pickles name, allowed only when the file
//! belongs to a recognised DeepSpeed checkpoint ([`Allow::DeepSpeed`]): each is inert data,
//! mapped to a plain value, so reading them needs no DeepSpeed and runs nothing.
//!
//! | global | how DeepSpeed pickles it | read as |
//! | --- | --- | --- |
//! | `deepspeed.runtime.fp16.loss_scaler.LossScaler` | `NEWOBJ()` then `BUILD {'cur_scale': 1.0, 'dynamic': False}` | the dict of its attributes |
//! | `deepspeed.runtime.zero.config.ZeroStageEnum` | `ZeroStageEnum(n)` (`REDUCE`), an int enum | the int `n` (0 to 4, its members) |
//! | `deepspeed.utils.tensor_fragment.fragment_address` | `NEWOBJ()` then `BUILD {'numel': n, 'start': s}` | the dict `{'numel': n, 'start': s}` |
//!
//! Every other DeepSpeed global (`DynamicLossScaler`, a config object, …) stays refused by
//! name, as any global outside the allow-list is.

use super::subclass::Class;
use super::{resolve, Global, Vm, V};
use crate::error::Result;
use crate::io::pickle::Globals;

/// Which allow-list a stream is read with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Allow {
    /// `torch.load(weights_only=True)`'s (plus FSDP1's `ShardedTensor`).
    #[default]
    TorchLoad,
    /// That one plus the three DeepSpeed globals of a ZeRO checkpoint: only for files of a
    /// recognised DeepSpeed checkpoint.
    DeepSpeed,
}

impl Allow {
    /// The allow-list.
    pub(super) fn globals(self) -> &'static Globals<Global> {
        match self {
            Allow::TorchLoad => &super::ALLOWED,
            Allow::DeepSpeed => &WITH_DEEPSPEED,
        }
    }
}

/// `torch.load`'s allow-list and the three DeepSpeed globals.
static WITH_DEEPSPEED: Globals<Global> = Globals {
    resolve: resolve_with_deepspeed,
};

fn resolve_with_deepspeed(module: &str, name: &str) -> Option<Global> {
    resolve(module, name).or_else(|| {
        Some(Global::Class(match (module, name) {
            ("deepspeed.runtime.fp16.loss_scaler", "LossScaler") => Class::LossScaler,
            ("deepspeed.runtime.zero.config", "ZeroStageEnum") => Class::ZeroStageEnum,
            ("deepspeed.utils.tensor_fragment", "fragment_address") => Class::FragmentAddress,
            _ => return None,
        }))
    })
}

/// The members of `ZeroStageEnum` (`disabled` 0 … `max_stage` 4): calling the enum with any
/// other value is Python's `ValueError`.
const ZERO_STAGES: std::ops::RangeInclusive<i64> = 0..=4;

/// Whether `class` is one of the DeepSpeed records read as the dict of their attributes.
pub(super) fn is_attribute_record(class: Class) -> bool {
    matches!(class, Class::LossScaler | Class::FragmentAddress)
}

impl Vm<'_, '_> {
    /// `ZeroStageEnum(n)`: the int `n`.
    pub(super) fn zero_stage(&self, a: &[V]) -> Result<V> {
        match a {
            [V::Int(n)] if ZERO_STAGES.contains(n) => Ok(V::Int(*n)),
            [V::Int(n)] => Err(self.err(format!(
                "ZeroStageEnum({n}): not a member (0 to 4: disabled, optimizer_states, gradients, weights, max_stage)"
            ))),
            _ => Err(self.err("ZeroStageEnum needs one int argument")),
        }
    }
}
