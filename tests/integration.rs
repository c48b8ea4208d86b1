//! End-to-end tests against the real broker. Each test has its own prefixed topology and
//! deletes it; waits are on events with deadlines.

mod adversary;
mod bundles;
mod cancel;
mod cli;
mod connections;
mod declare;
mod delivery;
mod faults;
mod flow;
mod history;
mod hostile;
mod interop;
mod logs;
mod metrics;
mod no_loss;
mod parked;
mod permissions;
mod recurring;
mod refusals;
mod signature;
mod status;
mod stuck_levels;
mod support;
mod upgrade;
mod versions;
mod wire;
