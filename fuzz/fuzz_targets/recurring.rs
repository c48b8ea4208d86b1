//! Fuzz target `recurring`: see ../README.md and `checks::recurring`.
#![no_main]

#[allow(dead_code)]
#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::recurring(data));
