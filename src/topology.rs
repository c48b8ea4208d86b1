//! The bridge's exchanges, queues and bindings: first as data (pure, from the config), then
//! declared (idempotently, work exchange and bound work queue first) or deleted.

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ExchangeKind};
use thiserror::Error;

use crate::config::{Config, IngressKind, QueueType};

/// RabbitMQ's default delivery limit for quorum queues on 4.x is 20; the work queue sets its
/// own and dead-letters past it into the parked exchange. The bridge parks a delivery with a
/// reason before that (`bridge.redelivery_limit`, at most one below this).
pub const WORK_QUEUE_DELIVERY_LIMIT: i64 = 50;

/// The quorum parked queue's delivery limit: in effect none. Without one, RabbitMQ 4.x
/// applies its default of 20, and a parked message handed back to the queue 20 times (read
/// with requeue, by `delay-bridge status` or any tool) would be dropped: the parked queue
/// dead-letters nowhere. (-1, "no limit" on 4.x, drops every returned message on 3.x.)
pub const PARKED_DELIVERY_LIMIT: i64 = i32::MAX as i64;

/// Classic queues are declared as version 2 (the only version from 4.0; opt-in on 3.10 and
/// 3.11). Measured on 3.10.8 (`delay-bridge bench steady`): with v1 the broker needed ~10%
/// more CPU and, at 2000 msg/s on 2 cores, delivered 1% of expired messages to the bridge
/// after their due time; with v2 none.
const CLASSIC_QUEUE_VERSION: (&str, AMQPValue) = ("x-queue-version", AMQPValue::LongLongInt(2));

/// A queue to declare.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSpec {
    /// Its name.
    pub name: String,
    /// Its `x-` arguments.
    pub arguments: Vec<(&'static str, AMQPValue)>,
}

/// What the bridge declares, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// Exchanges the bridge owns (work, parked, cancel, ingress), in declaration order;
    /// fanout but for those in `headers_exchanges`.
    pub exchanges: Vec<String>,
    /// The ingress exchanges of type `headers` (`route.ingress_type`).
    pub headers_exchanges: Vec<String>,
    /// Queues in declaration order: work, parked, returns, then the levels.
    pub queues: Vec<QueueSpec>,
    /// The cancel stream (a stream queue, retention `max_delay + cancel.grace`), bound
    /// to the cancel exchange once declared.
    pub cancel_stream: QueueSpec,
    /// The exchange cancellers publish to (one of `exchanges`), bound to the cancel stream.
    pub cancel_exchange: String,
    /// (queue, exchange) bindings; fanout, so the routing key is empty.
    pub bindings: Vec<(String, String)>,
    /// (queue, exchange) bindings an older bridge made that this one removes, once
    /// `bindings` are in place: the work queue's to the work exchange, whose messages now go
    /// to the returns queue.
    pub unbindings: Vec<(String, String)>,
}

/// The queues declared before any binding: work, parked and returns.
const BOUND_QUEUES: usize = 3;

/// Why declaring the topology failed.
#[derive(Debug, Error)]
pub enum TopologyError {
    /// A queue or exchange exists with other arguments or type than the configuration asks.
    #[error(
        "{kind} `{name}` already exists with different settings: {broker}. \
         It may hold messages: do not delete it. Change the configuration back, or move to \
         a new topology.prefix as docs/operations.md, 'Changing the topology', says"
    )]
    Mismatch {
        /// "queue" or "exchange".
        kind: &'static str,
        /// Its name.
        name: String,
        /// The broker's own words, which name the argument and both values.
        broker: String,
    },
    /// Any other broker or connection error while declaring.
    #[error("declaring {kind} `{name}` failed: {source}")]
    Declare {
        /// "queue", "exchange" or "binding".
        kind: &'static str,
        /// Its name.
        name: String,
        /// The client error.
        source: lapin::Error,
    },
}

impl TopologyError {
    /// True when retrying cannot help (the broker has conflicting definitions).
    pub fn is_permanent(&self) -> bool {
        matches!(self, TopologyError::Mismatch { .. })
    }
}

/// Queue arguments an existing queue may differ in: it is used as it is, with a warning, so
/// that upgrading the bridge or changing `max_delay` or `cancel.grace` never asks to delete
/// a queue that may hold messages. The first three do not change what happens to the
/// messages (storage format, paging, how long a stream keeps old entries); a queue declared
/// before the bridge set `x-delivery-limit` keeps the broker's default, and the warning
/// says what that risks and how to change it.
pub const TOLERATED_ARGUMENTS: [&str; 4] = [
    "x-queue-version",
    "x-queue-mode",
    "x-max-age",
    "x-delivery-limit",
];

/// What a 406 "inequivalent arg" says: the argument, and the existing queue's value
/// (`None`: it has none). Reads the broker's text, for example `inequivalent arg
/// 'x-queue-version' for queue 'q' in vhost '/': received '2' but current is '1'`.
pub fn inequivalent_argument(text: &str) -> Option<(String, Option<String>)> {
    let rest = text.split_once("inequivalent arg '")?.1;
    let (argument, rest) = rest.split_once('\'')?;
    let current = rest.rsplit_once("current is ")?.1.trim_end_matches('"');
    if current.starts_with("none") {
        return Some((argument.to_string(), None));
    }
    let quoted = current.strip_prefix("the value ").unwrap_or(current);
    let value = quoted.strip_prefix('\'')?.split_once('\'')?.0;
    Some((argument.to_string(), Some(value.to_string())))
}

/// The arguments to declare again so that they match an existing queue in `argument`
/// (whose value there is `current`), keeping the configured value's type.
fn matching(
    arguments: &[(&'static str, AMQPValue)],
    argument: &str,
    current: Option<&str>,
) -> Option<Vec<(&'static str, AMQPValue)>> {
    let name = *TOLERATED_ARGUMENTS.iter().find(|a| **a == argument)?;
    let mut adjusted: Vec<_> = arguments
        .iter()
        .filter(|(k, _)| *k != name)
        .cloned()
        .collect();
    if let Some(current) = current {
        let configured = arguments.iter().find(|(k, _)| *k == name).map(|(_, v)| v);
        let value = match configured {
            Some(AMQPValue::LongLongInt(_)) | Some(AMQPValue::LongInt(_)) => {
                AMQPValue::LongLongInt(current.parse().ok()?)
            }
            _ => text(current),
        };
        adjusted.push((name, value));
    }
    Some(adjusted)
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

impl Topology {
    /// The declarations a config needs.
    pub fn from_config(config: &Config) -> Self {
        let names = &config.names;
        let quorum = config.queue_type == QueueType::Quorum;
        let mut exchanges = vec![
            names.work_exchange(),
            names.parked_exchange(),
            names.cancel_exchange(),
        ];
        exchanges.extend(config.routes.iter().map(|r| r.ingress.clone()));
        let headers_exchanges = config
            .routes
            .iter()
            .filter(|r| r.ingress_kind == IngressKind::Headers)
            .map(|r| r.ingress.clone())
            .collect();

        let replicated = |args: &mut Vec<(&'static str, AMQPValue)>| {
            args.push(("x-queue-type", text("quorum")));
        };
        let mut work_args = Vec::new();
        let mut parked_args = Vec::new();
        if quorum {
            replicated(&mut work_args);
            work_args.push((
                "x-delivery-limit",
                AMQPValue::LongLongInt(WORK_QUEUE_DELIVERY_LIMIT),
            ));
            work_args.push(("x-dead-letter-exchange", text(&names.parked_exchange())));
            work_args.push(("x-dead-letter-strategy", text("at-least-once")));
            work_args.push(("x-overflow", text("reject-publish")));
            replicated(&mut parked_args);
            parked_args.push((
                "x-delivery-limit",
                AMQPValue::LongLongInt(PARKED_DELIVERY_LIMIT),
            ));
        } else {
            work_args.push(CLASSIC_QUEUE_VERSION);
        }
        let mut queues = vec![
            QueueSpec {
                name: names.work_queue(),
                arguments: work_args.clone(),
            },
            QueueSpec {
                name: names.parked_queue(),
                arguments: parked_args,
            },
            QueueSpec {
                name: names.returns_queue(),
                arguments: work_args,
            },
        ];
        for level in config.ladder.levels() {
            let mut args = vec![
                (
                    "x-message-ttl",
                    AMQPValue::LongLongInt(level.as_millis() as i64),
                ),
                ("x-dead-letter-exchange", text(&names.work_exchange())),
            ];
            if quorum {
                replicated(&mut args);
                args.push(("x-dead-letter-strategy", text("at-least-once")));
                args.push(("x-overflow", text("reject-publish")));
            } else {
                // Pending messages belong on disk (ignored from 3.12, where classic queues
                // page out on their own).
                args.push(("x-queue-mode", text("lazy")));
                args.push(CLASSIC_QUEUE_VERSION);
            }
            queues.push(QueueSpec {
                name: names.level_queue(*level),
                arguments: args,
            });
        }
        // The returns queue is bound before the work queue is unbound from the work
        // exchange (an older bridge bound it there): never a moment with no queue bound.
        let mut bindings = vec![
            (names.returns_queue(), names.work_exchange()),
            (names.parked_queue(), names.parked_exchange()),
        ];
        bindings.extend(
            config
                .routes
                .iter()
                .map(|r| (names.work_queue(), r.ingress.clone())),
        );
        let keep = config.tombstone_keep();
        let cancel_stream = QueueSpec {
            name: names.cancel_stream(),
            arguments: vec![
                ("x-queue-type", text("stream")),
                (
                    "x-max-age",
                    text(&format!(
                        "{}s",
                        keep.as_secs() + u64::from(keep.subsec_nanos() > 0)
                    )),
                ),
            ],
        };
        Self {
            exchanges,
            headers_exchanges,
            queues,
            cancel_stream,
            cancel_exchange: names.cancel_exchange(),
            bindings,
            unbindings: vec![(names.work_queue(), names.work_exchange())],
        }
    }

    /// Declares everything, in order: the work exchange and the returns queue bound to it
    /// exist before any level queue, so no expiry is ever dropped.
    ///
    /// Moving an older bridge's topology to the returns queue binds it first, then unbinds
    /// the work queue: a message dead-lettered between the two (well under a millisecond,
    /// once) is routed to both, and delivered twice.
    pub async fn declare(&self, connection: &Connection) -> Result<(), TopologyError> {
        let mut channel = open(connection, "channel", "declare").await?;
        let (work_exchange, rest) = self.exchanges.split_first().expect("work exchange");
        declare_exchange(&channel, work_exchange, ExchangeKind::Fanout).await?;
        for queue in &self.queues[..BOUND_QUEUES] {
            declare_queue(connection, &mut channel, queue).await?;
        }
        for exchange in rest {
            let kind = if self.headers_exchanges.contains(exchange) {
                ExchangeKind::Headers
            } else {
                ExchangeKind::Fanout
            };
            declare_exchange(&channel, exchange, kind).await?;
        }
        for (queue, exchange) in &self.bindings {
            bind(&channel, queue, exchange).await?;
        }
        for (queue, exchange) in &self.unbindings {
            unbind(&channel, queue, exchange).await?;
        }
        declare_queue(connection, &mut channel, &self.cancel_stream).await?;
        bind(&channel, &self.cancel_stream.name, &self.cancel_exchange).await?;
        for queue in &self.queues[BOUND_QUEUES..] {
            declare_queue(connection, &mut channel, queue).await?;
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(())
    }

    /// Deletes every queue and exchange of this topology (for tests and the demo).
    /// Messages in them are lost: never run this against a bridge in service.
    pub async fn delete(&self, connection: &Connection) -> Result<(), lapin::Error> {
        let channel = connection.create_channel().await?;
        for queue in self.queues.iter().rev().chain([&self.cancel_stream]) {
            channel
                .queue_delete(queue.name.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        for exchange in &self.exchanges {
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
        }
        let _ = channel.close(200, "deleted".into()).await;
        Ok(())
    }
}

async fn open(
    connection: &Connection,
    kind: &'static str,
    name: &str,
) -> Result<Channel, TopologyError> {
    connection
        .create_channel()
        .await
        .map_err(|source| TopologyError::Declare {
            kind,
            name: name.to_string(),
            source,
        })
}

/// A 406 PRECONDITION_FAILED from the broker becomes a `Mismatch`.
fn classify(kind: &'static str, name: &str, source: lapin::Error) -> TopologyError {
    if let lapin::ErrorKind::ProtocolError(amqp) = source.kind()
        && amqp.get_id() == 406
    {
        return TopologyError::Mismatch {
            kind,
            name: name.to_string(),
            broker: amqp.get_message().to_string(),
        };
    }
    TopologyError::Declare {
        kind,
        name: name.to_string(),
        source,
    }
}

async fn declare_exchange(
    channel: &Channel,
    name: &str,
    kind: ExchangeKind,
) -> Result<(), TopologyError> {
    channel
        .exchange_declare(
            ShortString::from(name),
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| classify("exchange", name, e))
}

/// Declares a queue. An existing queue that differs only in [`TOLERATED_ARGUMENTS`] is used
/// as it is, with one warning per argument (a mismatch closes the channel: a new one is
/// opened in its place).
async fn declare_queue(
    connection: &Connection,
    channel: &mut Channel,
    queue: &QueueSpec,
) -> Result<(), TopologyError> {
    let mut arguments = queue.arguments.clone();
    let mut kept = Vec::new();
    loop {
        let mut args = FieldTable::default();
        for (k, v) in &arguments {
            args.insert(ShortString::from(*k), v.clone());
        }
        let declared = channel
            .queue_declare(
                ShortString::from(queue.name.as_str()),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await;
        let error = match declared {
            Ok(_) => break,
            Err(e) => classify("queue", &queue.name, e),
        };
        let TopologyError::Mismatch { broker, .. } = &error else {
            return Err(error);
        };
        let Some((argument, current)) = inequivalent_argument(broker) else {
            return Err(error);
        };
        if kept.contains(&argument) {
            return Err(error);
        }
        let Some(adjusted) = matching(&arguments, &argument, current.as_deref()) else {
            return Err(error);
        };
        *channel = open(connection, "channel", "declare").await?;
        arguments = adjusted;
        kept.push(argument.clone());
        if argument == "x-delivery-limit" {
            tracing::warn!(
                queue = %queue.name,
                existing = current.as_deref().unwrap_or("none"),
                "queue exists with another delivery limit than the bridge sets; used as it is. \
                 Without one, RabbitMQ 4.x applies 20: a message handed back to it 20 times \
                 (read with requeue) is dropped or dead-lettered. Set the limit with a policy \
                 (delivery-limit) or move to a new topology.prefix"
            );
        } else {
            tracing::warn!(
                queue = %queue.name,
                argument = %argument,
                existing = current.as_deref().unwrap_or("none"),
                "queue exists with another value of an argument that does not change what happens to its messages; used as it is"
            );
        }
    }
    Ok(())
}

async fn bind(channel: &Channel, queue: &str, exchange: &str) -> Result<(), TopologyError> {
    channel
        .queue_bind(
            ShortString::from(queue),
            ShortString::from(exchange),
            ShortString::from(""),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| classify("binding", &format!("{queue} <- {exchange}"), e))
}

/// Removes a binding; one that does not exist is no error (RabbitMQ answers `unbind-ok`).
async fn unbind(channel: &Channel, queue: &str, exchange: &str) -> Result<(), TopologyError> {
    channel
        .queue_unbind(
            ShortString::from(queue),
            ShortString::from(exchange),
            ShortString::from(""),
            FieldTable::default(),
        )
        .await
        .map_err(|e| classify("binding", &format!("{queue} <- {exchange}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(queue_type: &str) -> Config {
        Config::from_toml(
            &format!(
                "[topology]\nprefix = \"p\"\nqueue_type = \"{queue_type}\"\n[delays]\nladder = \"1s 1m\"\n[bridge]\nhop_window = \"0s\"\n[[route]]\ningress = \"in\"\ntarget = \"out\"\n"
            ),
            "<test>",
            &[],
        )
        .unwrap()
    }

    fn arg<'a>(q: &'a QueueSpec, k: &str) -> Option<&'a AMQPValue> {
        q.arguments
            .iter()
            .find(|(name, _)| *name == k)
            .map(|(_, v)| v)
    }

    #[test]
    fn classic_levels_dead_letter_to_work_and_never_expire() {
        let t = Topology::from_config(&config("classic"));
        assert_eq!(t.exchanges, vec!["p.work", "p.parked", "p.cancel", "in"]);
        assert_eq!(t.cancel_exchange, "p.cancel");
        let names: Vec<&str> = t.queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "p.work",
                "p.parked",
                "p.returns",
                "p.level.1s",
                "p.level.1m"
            ]
        );
        let level = &t.queues[4];
        assert_eq!(
            arg(level, "x-message-ttl"),
            Some(&AMQPValue::LongLongInt(60_000))
        );
        assert_eq!(arg(level, "x-dead-letter-exchange"), Some(&text("p.work")));
        for q in &t.queues {
            assert_eq!(arg(q, "x-expires"), None, "{} must never expire", q.name);
        }
        assert_eq!(
            arg(&t.queues[0], "x-message-ttl"),
            None,
            "no TTL on the work queue, ever"
        );
        for q in [&t.queues[0], &t.queues[2], &t.queues[3], &t.queues[4]] {
            assert_eq!(
                arg(q, "x-queue-version"),
                Some(&AMQPValue::LongLongInt(2)),
                "{}: classic queue v2 (measured: the v1 work queue fell behind at 2000 msg/s)",
                q.name
            );
        }
        assert!(t.bindings.contains(&("p.work".into(), "in".into())));
        assert!(t.bindings.contains(&("p.returns".into(), "p.work".into())));
        assert!(!t.bindings.contains(&("p.work".into(), "p.work".into())));
        assert_eq!(t.unbindings, vec![("p.work".into(), "p.work".into())]);
        let returns_bound = t
            .bindings
            .iter()
            .position(|b| *b == ("p.returns".into(), "p.work".into()));
        assert_eq!(returns_bound, Some(0), "bound before anything else");
        assert_eq!(t.cancel_stream.name, "p.cancel");
        assert_eq!(arg(&t.cancel_stream, "x-queue-type"), Some(&text("stream")));
        // retention: max delay (366d) + grace (1d), in seconds
        assert_eq!(
            arg(&t.cancel_stream, "x-max-age"),
            Some(&text(&format!("{}s", 367 * 86_400)))
        );
    }

    #[test]
    fn quorum_mode_is_at_least_once_and_parks_past_the_delivery_limit() {
        let t = Topology::from_config(&config("quorum"));
        for q in &t.queues {
            assert_eq!(arg(q, "x-queue-type"), Some(&text("quorum")), "{}", q.name);
        }
        for work in [&t.queues[0], &t.queues[2]] {
            assert_eq!(arg(work, "x-dead-letter-exchange"), Some(&text("p.parked")));
            assert!(arg(work, "x-delivery-limit").is_some());
        }
        // The parked queue dead-letters nowhere: 4.x's default limit would drop messages.
        let parked = &t.queues[1];
        assert_eq!(
            arg(parked, "x-delivery-limit"),
            Some(&AMQPValue::LongLongInt(PARKED_DELIVERY_LIMIT))
        );
        for q in [&t.queues[0], &t.queues[2], &t.queues[3], &t.queues[4]] {
            assert_eq!(
                arg(q, "x-dead-letter-strategy"),
                Some(&text("at-least-once"))
            );
            assert_eq!(arg(q, "x-overflow"), Some(&text("reject-publish")));
        }
    }

    #[test]
    fn the_brokers_inequivalent_arg_text_is_read() {
        let cases = [
            (
                "PRECONDITION_FAILED - inequivalent arg 'x-queue-version' for queue 'q' in vhost '/': received the value '2' of type 'signedint' but current is none",
                ("x-queue-version", None),
            ),
            (
                "PRECONDITION_FAILED - inequivalent arg 'x-queue-version' for queue 'q' in vhost '/': received '2' but current is '1'",
                ("x-queue-version", Some("1")),
            ),
            (
                "PRECONDITION_FAILED - inequivalent arg 'x-queue-mode' for queue 'q' in vhost '/': received none but current is the value 'lazy' of type 'longstr'",
                ("x-queue-mode", Some("lazy")),
            ),
            (
                "PRECONDITION_FAILED - inequivalent arg 'x-max-age' for queue 's' in vhost '/': received '20s' but current is '10s'",
                ("x-max-age", Some("10s")),
            ),
        ];
        for (text, (argument, current)) in cases {
            assert_eq!(
                inequivalent_argument(text),
                Some((argument.to_string(), current.map(str::to_string))),
                "{text}"
            );
        }
        assert_eq!(inequivalent_argument("NOT_FOUND - no queue 'q'"), None);
    }

    #[test]
    fn only_tolerated_arguments_are_matched_to_the_existing_queue() {
        let args = vec![
            ("x-message-ttl", AMQPValue::LongLongInt(1_000)),
            ("x-queue-mode", text("lazy")),
            CLASSIC_QUEUE_VERSION,
        ];
        let version_1 = matching(&args, "x-queue-version", Some("1")).unwrap();
        assert!(version_1.contains(&("x-queue-version", AMQPValue::LongLongInt(1))));
        assert!(version_1.contains(&("x-message-ttl", AMQPValue::LongLongInt(1_000))));
        let no_mode = matching(&args, "x-queue-mode", None).unwrap();
        assert!(!no_mode.iter().any(|(k, _)| *k == "x-queue-mode"));
        assert_eq!(matching(&args, "x-message-ttl", Some("2000")), None);
        assert_eq!(matching(&args, "x-queue-type", Some("quorum")), None);
    }
}
