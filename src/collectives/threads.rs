//! In-process thread backend.

/// Placeholder.
pub struct ThreadGroup;
/// Placeholder.
pub struct ThreadProcessGroup;
