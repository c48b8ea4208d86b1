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
//! The crate is layered: pure logic ([`ladder`], [`plan`], [`contract`], [`naming`],
//! [`config`]) with no I/O, and the runtime ([`topology`], [`amqp`], [`bridge`]) at the edge.

#![warn(missing_docs)]

pub mod amqp;
pub mod bridge;
pub mod cancel;
pub mod client;
pub mod config;
pub mod contract;
pub mod ladder;
pub mod naming;
pub mod plan;
pub mod topology;
