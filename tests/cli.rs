//! CLI tests (placeholder).
