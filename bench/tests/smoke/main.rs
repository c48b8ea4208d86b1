//! The benchmarks' smoke tests against the test broker: every scenario of
//! `delay-bridge-bench` with tiny counts (`bench`), and the single-broker fault scenarios
//! reduced (`fault_suite`). They share the daemon's test support (`tests/support`).

mod bench;
mod fault_suite;
#[path = "../../../tests/support/mod.rs"]
mod support;
