//! Fuzz target `cancel`: see ../README.md and `checks::cancel`.
#![no_main]

#[allow(dead_code)]
#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::cancel(data));
