//! The wire contract (v1): headers and properties in, and out.
//!
//! [`decode`] turns a consumed delivery into an [`Envelope`] (when it is due, where it goes,
//! what the publisher sent) or a [`Parked`] reason. [`hop_properties`],
//! [`delivery_properties`] and [`parked_properties`] build what is published next. Pure:
//! no I/O, the clock is a parameter.
//!
//! One job per file: `value` reads AMQP values (the plugin's `x-delay` rules, times),
//! `decode` reads a consumed delivery, `encode` builds what is published next, `reason` holds
//! the stable park reasons, `size` measures a content header's frame, `bundle` packs the
//! hops of one window into one message.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::config::Route;

pub mod bundle;
mod decode;
mod encode;
mod hop_bytes;
mod reason;
pub mod signature;
mod size;
pub(crate) mod value;

pub use decode::{beyond_max_delay, decode, redelivered_too_often};
pub use encode::{
    consumed_properties, delivery_properties, hop_properties, parked_properties,
    parked_properties_without_headers, unreadable_parked, without_bridge_headers,
};
pub use reason::{ParkReason, Parked};
pub use size::{content_header_frame_len, fits_frame};
pub use value::{
    parse_delay, parse_delay_in, parse_deliver_at, parse_deliver_at_in, parse_published_at,
};

/// Header names of the contract.
pub mod header {
    /// The delay in milliseconds, as the delayed-message plugin reads it.
    pub const DELAY: &str = "x-delay";
    /// An absolute due time: epoch milliseconds or an RFC 3339 string. Wins over every
    /// other due-time header.
    pub const DELIVER_AT: &str = "x-deliver-at";
    /// An absolute due time in epoch milliseconds, as the AMQP 1.0 annotation that
    /// Tanzu RabbitMQ's delayed queues read, sent as a header. Wins over the delays.
    pub const OPT_DELIVERY_TIME: &str = "x-opt-delivery-time";
    /// A delay in milliseconds, as the AMQP 1.0 annotation that Tanzu RabbitMQ's delayed
    /// queues read, sent as a header. Read only without `x-delay`.
    pub const OPT_DELIVERY_DELAY: &str = "x-opt-delivery-delay";
    /// The due-time headers, by precedence: the first one present decides (an absolute
    /// time before a delay, the bridge's and the plugin's names before the annotations).
    pub const DUE_TIME: [&str; 4] = [DELIVER_AT, OPT_DELIVERY_TIME, DELAY, OPT_DELIVERY_DELAY];
    /// When the publisher published the message, epoch ms (the typed client sets it). A
    /// cancel drops the copies that entered before it: this header, when present, is when
    /// the copy entered; otherwise the moment the bridge first read it.
    pub const PUBLISHED_AT: &str = "x-published-at";
    /// Prefix of every header the bridge itself writes.
    pub const BRIDGE_PREFIX: &str = "delay-bridge-";
    /// Bridge state: the due time, epoch ms.
    pub const STATE_DELIVER_AT: &str = "delay-bridge-deliver-at";
    /// Bridge state: the target exchange.
    pub const STATE_TARGET: &str = "delay-bridge-target";
    /// Bridge state: the publisher's routing key.
    pub const STATE_ROUTING_KEY: &str = "delay-bridge-routing-key";
    /// Bridge state: the publisher's `expiration` property (it would cut a level's TTL short).
    pub const STATE_EXPIRATION: &str = "delay-bridge-expiration";
    /// Bridge state: the publisher's `user_id` property (the broker refuses another user's).
    pub const STATE_USER_ID: &str = "delay-bridge-user-id";
    /// Bridge state: the publisher's `delivery_mode` when it was not 2 (0 = absent).
    pub const STATE_DELIVERY_MODE: &str = "delay-bridge-delivery-mode";
    /// Bridge state: the publisher's `CC` header (extra routing keys; on a hop through the
    /// default exchange they would name queues).
    pub const STATE_CC: &str = "delay-bridge-cc";
    /// Bridge state: the publisher's `BCC` header.
    pub const STATE_BCC: &str = "delay-bridge-bcc";
    /// The sender-selected distribution header: more routing keys for the same exchange.
    pub const CC: &str = "CC";
    /// As `CC`, removed by the broker before delivery.
    pub const BCC: &str = "BCC";
    /// Bridge state: how many hops the message has made.
    pub const STATE_HOPS: &str = "delay-bridge-hops";
    /// Bridge state: when the bridge first saw the message, epoch ms.
    pub const STATE_FIRST_SEEN: &str = "delay-bridge-first-seen";
    /// Bridge state: when the copy entered, for cancellation (`x-published-at`, else first
    /// seen), epoch ms.
    pub const STATE_ENTERED_AT: &str = "delay-bridge-entered-at";
    /// Bridge state of a recurring schedule's copy: the number of its occurrence (from 1).
    pub const STATE_OCCURRENCE: &str = "delay-bridge-occurrence";
    /// Bridge state of a recurring schedule's copy: its birth (see
    /// [`crate::cancel::birth`]), which orders two copies of one occurrence.
    pub const STATE_BORN: &str = "delay-bridge-born";
    /// On parked messages: the stable reason code.
    pub const REASON: &str = "delay-bridge-reason";
    /// On parked messages: a human explanation.
    pub const DETAIL: &str = "delay-bridge-detail";
    /// On parked messages: when the bridge parked it, epoch ms.
    pub const PARKED_AT: &str = "delay-bridge-parked-at";
    /// On messages parked `unreadable`: the original content header's property bytes
    /// (flags, then the properties), as the broker delivered them (RabbitMQ 4 may encode
    /// again, in another order, a header table it could read).
    pub const RAW_PROPERTIES: &str = "delay-bridge-raw-properties";
    /// On messages parked `unreadable` whose routing key is not UTF-8: its bytes.
    pub const RAW_ROUTING_KEY: &str = "delay-bridge-raw-routing-key";
    /// On delivered messages whose publisher set a `user_id` other than the bridge's user.
    pub const ORIGINAL_USER_ID: &str = "original-user-id";
    /// On a bundle: how many messages it carries (see [`bundle`](super::bundle)). Read only
    /// on a delivery that came back through the work exchange.
    pub const BUNDLE: &str = "delay-bridge-bundle";
    /// On a bundle passed on whole from one level to the next: the hops its messages made
    /// in it that their own state (`delay-bridge-hops`) does not count yet (see
    /// [`bundle`](super::bundle)). Read only on a bundle.
    pub const BUNDLE_HOPS: &str = "delay-bridge-bundle-hops";
    /// On a bundle none of whose messages is a recurring occurrence: the earliest due time
    /// of its messages, epoch ms (see [`bundle`](super::bundle)). Read only on a bundle.
    pub const BUNDLE_FIRST_DUE: &str = "delay-bridge-bundle-first-due";
    /// With [`BUNDLE_FIRST_DUE`]: the latest due time of its messages, epoch ms.
    pub const BUNDLE_LAST_DUE: &str = "delay-bridge-bundle-last-due";
    /// On a copy travelling through the levels, when `bridge.state_key` is set: the
    /// HMAC-SHA256 (hex) of its bridge headers and body (see
    /// [`signature`](super::signature)).
    pub const STATE_SIGNATURE: &str = "delay-bridge-signature";
    /// On a copy travelling through the levels, when `bridge.state_key` is set: the
    /// SHA-256 (hex) of its `message_id` and the publisher headers the bridge acts on
    /// (`CC`, `BCC`, `x-repeat-*`), which the signature covers as a bridge header (see
    /// [`signature`](super::signature)).
    pub const STATE_ACTED_ON: &str = "delay-bridge-acted-on";
    /// Failed deliveries so far, set by quorum queues on redelivery.
    pub const DELIVERY_COUNT: &str = "x-delivery-count";
    /// Prefixes of the headers dead-lettering adds; stripped on every re-publish.
    pub const DEATH_PREFIXES: [&str; 3] = ["x-death", "x-first-death-", "x-last-death-"];

    /// Every header name the contract reads or writes, and those dead-lettering adds: the
    /// names a hostile or careless publisher may reuse (the fuzz tests send them).
    pub const ALL: [&str; 35] = [
        DELAY,
        DELIVER_AT,
        OPT_DELIVERY_TIME,
        OPT_DELIVERY_DELAY,
        PUBLISHED_AT,
        STATE_DELIVER_AT,
        STATE_TARGET,
        STATE_ROUTING_KEY,
        STATE_EXPIRATION,
        STATE_USER_ID,
        STATE_DELIVERY_MODE,
        STATE_CC,
        STATE_BCC,
        CC,
        BCC,
        STATE_HOPS,
        STATE_FIRST_SEEN,
        STATE_ENTERED_AT,
        STATE_OCCURRENCE,
        STATE_BORN,
        REASON,
        DETAIL,
        PARKED_AT,
        RAW_PROPERTIES,
        RAW_ROUTING_KEY,
        ORIGINAL_USER_ID,
        BUNDLE,
        BUNDLE_HOPS,
        BUNDLE_FIRST_DUE,
        BUNDLE_LAST_DUE,
        STATE_SIGNATURE,
        STATE_ACTED_ON,
        DELIVERY_COUNT,
        "x-death",
        "x-first-death-reason",
    ];
}

/// `delivery_mode` value of a persistent message.
pub const PERSISTENT: u8 = 2;

/// The AMQP basic properties as plain data, so they can be edited and rebuilt
/// (lapin's `BasicProperties` cannot remove a field).
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Properties {
    pub content_type: Option<ShortString>,
    pub content_encoding: Option<ShortString>,
    pub headers: Option<FieldTable>,
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<ShortString>,
    pub reply_to: Option<ShortString>,
    pub expiration: Option<ShortString>,
    pub message_id: Option<ShortString>,
    pub timestamp: Option<u64>,
    pub kind: Option<ShortString>,
    pub user_id: Option<ShortString>,
    pub app_id: Option<ShortString>,
    pub cluster_id: Option<ShortString>,
}

impl From<&BasicProperties> for Properties {
    fn from(p: &BasicProperties) -> Self {
        Self {
            headers: p.headers().clone(),
            ..Self::without_headers(p)
        }
    }
}

impl Properties {
    /// A copy of these properties but their headers (see [`Properties::without_headers`]).
    pub fn clone_without_headers(&self) -> Self {
        Self {
            content_type: self.content_type.clone(),
            content_encoding: self.content_encoding.clone(),
            headers: None,
            delivery_mode: self.delivery_mode,
            priority: self.priority,
            correlation_id: self.correlation_id.clone(),
            reply_to: self.reply_to.clone(),
            expiration: self.expiration.clone(),
            message_id: self.message_id.clone(),
            timestamp: self.timestamp,
            kind: self.kind.clone(),
            user_id: self.user_id.clone(),
            app_id: self.app_id.clone(),
            cluster_id: self.cluster_id.clone(),
        }
    }

    /// `p`'s properties but its headers (a header table is the costly part to copy: the
    /// bridge copies only the headers it keeps).
    pub fn without_headers(p: &BasicProperties) -> Self {
        Self {
            content_type: p.content_type().clone(),
            content_encoding: p.content_encoding().clone(),
            headers: None,
            delivery_mode: *p.delivery_mode(),
            priority: *p.priority(),
            correlation_id: p.correlation_id().clone(),
            reply_to: p.reply_to().clone(),
            expiration: p.expiration().clone(),
            message_id: p.message_id().clone(),
            timestamp: *p.timestamp(),
            kind: p.kind().clone(),
            user_id: p.user_id().clone(),
            app_id: p.app_id().clone(),
            cluster_id: p.cluster_id().clone(),
        }
    }
}

impl From<Properties> for BasicProperties {
    fn from(p: Properties) -> Self {
        let mut out = BasicProperties::default();
        macro_rules! set {
            ($($field:ident => $with:ident),* $(,)?) => {
                $(if let Some(v) = p.$field { out = out.$with(v); })*
            };
        }
        set!(
            content_type => with_content_type,
            content_encoding => with_content_encoding,
            headers => with_headers,
            delivery_mode => with_delivery_mode,
            priority => with_priority,
            correlation_id => with_correlation_id,
            reply_to => with_reply_to,
            expiration => with_expiration,
            message_id => with_message_id,
            timestamp => with_timestamp,
            kind => with_type,
            user_id => with_user_id,
            app_id => with_app_id,
            cluster_id => with_cluster_id,
        );
        out
    }
}

/// A consumed delivery, as the contract sees it.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    /// The exchange it was published to (an ingress exchange, or the work exchange for a
    /// message coming back from a level).
    pub exchange: &'a str,
    /// Its routing key.
    pub routing_key: &'a ShortString,
    /// Its properties, headers included.
    pub properties: &'a BasicProperties,
}

/// What `decode` needs to know of the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Intake<'a> {
    /// The bridge's work exchange: messages from it carry bridge state.
    pub work_exchange: &'a str,
    /// The routes: ingress exchange → target exchange (the allow-list of targets).
    pub routes: &'a [Route],
    /// The longest delay accepted.
    pub max_delay: Duration,
    /// The smallest level: a recurring schedule whose occurrences come closer together is
    /// refused.
    pub smallest_level: Duration,
}

/// What the publisher's properties had that the bridge must not carry through levels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stash {
    /// The publisher's `expiration`, restored on delivery.
    pub expiration: Option<ShortString>,
    /// The publisher's `user_id`.
    pub user_id: Option<ShortString>,
    /// The publisher's `delivery_mode`; hops are always persistent.
    pub delivery_mode: Option<u8>,
    /// The publisher's `CC` header, restored on delivery: a hop goes through the default
    /// exchange, where `CC` would copy the message into any queue it names.
    pub cc: Option<AMQPValue>,
    /// The publisher's `BCC` header, restored on delivery, for the same reason.
    pub bcc: Option<AMQPValue>,
}

/// A message the bridge is moving: when it is due, where it goes, what the publisher sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// Due time, epoch ms.
    pub deliver_at: u64,
    /// The target exchange.
    pub target: String,
    /// The publisher's routing key.
    pub routing_key: ShortString,
    /// Hops made so far.
    pub hops: u32,
    /// When the bridge first saw the message, epoch ms.
    pub first_seen: u64,
    /// When this copy entered, for cancellation: a cancel at or after this time drops it.
    pub entered_at: u64,
    /// The publisher's properties without `expiration`, `user_id` and `delivery_mode`
    /// (see `stash`), and with no `x-death*` or `delay-bridge-*` headers.
    pub properties: Properties,
    /// The properties set aside while the message travels.
    pub stash: Stash,
    /// For a copy of a recurring schedule: the number of its occurrence (from 1).
    pub occurrence: Option<u64>,
    /// For a copy of a recurring schedule: its birth, which orders two copies of one
    /// occurrence (see [`crate::cancel::Successors`]); 0 for other messages.
    pub born: u64,
}

#[cfg(test)]
mod tests;
