//! The bridge runtime.
