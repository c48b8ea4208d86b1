//! # delay-bridge
//!
//! Exact, arbitrary, cancellable delayed delivery for RabbitMQ without a broker plugin.
//!
//! Publishers send a message with an `x-delay` header (as for the archived
//! `rabbitmq_delayed_message_exchange` plugin) or an absolute `x-deliver-at` to an ingress
//! exchange. The bridge moves it through **tiered TTL queues** — one durable queue per delay
//! level, each with one queue-wide TTL, so nothing blocks — re-publishing it into the largest
//! level that fits until the remainder is below the smallest level, waits that remainder out
//! in process, and publishes the message to its target exchange with its original routing
//! key, body and properties. All state lives in RabbitMQ.
//!
//! # Layout
//!
//! Pure core (no broker I/O; the time is a parameter):
//! - [`clock`]: the only reader of the wall clock.
//! - [`ladder`]: delay levels, presets, duration parsing and printing.
//! - [`plan`]: the next step for a remaining time: hop into a level, hold, or deliver;
//!   [`plan::decide`], the carrier's decision at each step (bundles and hop windows too).
//! - [`pending`]: pending messages by due-time bucket, from queue depths alone.
//! - [`naming`]: the names of the bridge's exchanges and queues, from its prefix.
//! - [`config`]: the TOML file, raw then validated.
//! - [`contract`]: the wire contract: headers and properties in (decode) and out (encode),
//!   park reasons, a content header's frame size, bundles (several hops as one message).
//! - [`cancel`]: the tombstone format of the cancel stream and the set of live tombstones
//!   (and the successor tombstones that keep one copy of a recurring schedule); the trust
//!   table of which entry is taken from which writer.
//! - [`recurring`]: recurring schedules: the `x-repeat-*` headers read, the next
//!   occurrence of an interval or a cron expression in a time zone, and what delivering one
//!   late means (one overdue occurrence, the rest counted as skipped).
//!
//! AMQP edge:
//! - [`amqp`]: connecting, and the broker's version; the project's own AMQP connection
//!   (`wire`), which carries every message (consuming, publishing, confirms, returns, the
//!   cancel stream, the parked queue) while lapin declares and counts; inside the crate,
//!   the one confirmed, mandatory publish, which matches returns to their own publish and
//!   decides what a result means, and the cancel stream's reader on a connection of its
//!   own, which skips an entry the broker cannot send.
//! - [`topology`]: what the bridge declares, as data, then declared or deleted.
//! - [`management`]: the management HTTP API, read for what AMQP does not show (a queue's
//!   expired messages that its dead-letter worker has not forwarded, bytes).
//! - [`parked`]: the parked queue: its messages described, selected, listed, replayed
//!   through the work exchange or purged.
//! - [`status`]: what the topology holds now, queue by queue.
//! - [`permissions`]: each role's least-privilege permissions (`rabbitmqctl
//!   set_permissions` patterns), from the configuration.
//!
//! The service and its client:
//! - [`bridge`]: [`bridge::Bridge`]: reconnects; each session consumes, acks and drains;
//!   each message's carrier hops (alone or bundled with the hops of its window), holds,
//!   delivers (the messages of bundles in turns), parks or drops it; the cancel follower;
//!   whether every instance reads bundles; the watch for queues whose expired messages are
//!   not forwarded.
//! - [`client`]: the typed client: schedule, cancel, reschedule.
//! - `http` (feature `http`, in the `cli` build): the metrics and health listener.
//!
//! For demos and broker-backed tests (feature `sandbox`):
//! - `sandbox`: a throw-away topology and bridge, in process or as a `delay-bridge run`
//!   child process; queue counts and watchers.
//!
//! The `delay-bridge` command (feature `cli`, on by default) lives in `src/bin/`; the
//! `delay-bridge-bench` benchmarks are a package of their own in the workspace (`bench/`).

#![warn(missing_docs)]

pub mod amqp;
pub mod bridge;
pub mod cancel;
pub mod client;
pub mod clock;
pub mod config;
pub mod contract;
pub mod ladder;
pub mod management;
pub mod naming;
pub mod parked;
pub mod pending;
pub mod permissions;
pub mod plan;
pub mod recurring;
pub mod status;
pub mod topology;

#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "sandbox")]
pub mod sandbox;
