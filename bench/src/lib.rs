//! What the `delay-bridge-bench` binary shares with its smoke tests: the reports each
//! scenario prints as its last line ([`report`]). The scenarios themselves live in the
//! binary.

pub mod report;
