//! Fuzz target `bundle`: see ../README.md and `checks::bundle`.
#![no_main]

#[allow(dead_code)]
#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::bundle(data));
