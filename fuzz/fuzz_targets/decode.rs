//! Fuzz target `decode`: see ../README.md and `checks::decode`.
#![no_main]

#[allow(dead_code)]
#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::decode(data));
