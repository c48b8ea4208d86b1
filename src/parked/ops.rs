//! Reading the parked queue, and listing, replaying or purging what a filter selects.

use std::time::Duration;

use lapin::types::{FieldTable, ShortString};
use serde::Serialize;

use super::{Filter, MOST_AT_ONCE, ParkedError, ParkedMessage, replay_properties};
use crate::amqp;
use crate::amqp::disposition::Disposition;
use crate::amqp::publisher::Publisher;
use crate::amqp::wire::{self, Channel, Consumer, Delivery, WireError};
use crate::clock::now_ms;
use crate::config::Config;
use crate::contract::signature::StateKeys;
use crate::naming::Names;

/// How long a read waits for the next message the queue counted before it gives up on it
/// (another consumer may have taken it).
const NEXT_WITHIN: Duration = Duration::from_secs(5);

/// What to do with the selected messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Describe them; they stay parked.
    List,
    /// Publish each back through the work exchange and, once the broker confirmed that
    /// copy, remove it from the parked queue.
    Replay,
    /// Remove them.
    Purge,
}

/// What became of one selected message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Outcome {
    /// The message.
    #[serde(flatten)]
    pub message: ParkedMessage,
    /// True when it was replayed or purged (never on a dry run or a list).
    pub done: bool,
    /// Why it was not, when it was to be.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// What an operation did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The operation.
    pub action: Action,
    /// True when nothing was changed on purpose.
    pub dry_run: bool,
    /// Messages in the parked queue when the operation began.
    pub held: u64,
    /// Messages read to select from.
    pub scanned: u64,
    /// The selected messages, in queue order, with what became of each.
    pub selected: Vec<Outcome>,
}

impl Report {
    /// How many selected messages were replayed or purged.
    pub fn done(&self) -> usize {
        self.selected.iter().filter(|o| o.done).count()
    }
}

/// Reads the parked queue of `names` on `connection` (at most [`MOST_AT_ONCE`] messages),
/// selects those `filter` matches, at most `limit` of them, and lists, replays or purges
/// them; on a dry run it only says what it would do. Whatever it does not remove goes back
/// to the queue, in its order, when its channel closes. A replayed message is removed only
/// after the broker confirmed its copy in the work queue: a replay stopped at any point
/// leaves each message parked, replayed, or (confirmed but not yet removed) both. A message
/// the AMQP codec cannot read in full is described as `unreadable` as it is, never changed
/// by a list ([`ParkedMessage::describe_unreadable`]).
pub async fn act(
    connection: &wire::Connection,
    replay: Replay<'_>,
    names: &Names,
    action: Action,
    filter: &Filter,
    limit: usize,
    dry_run: bool,
) -> Result<Report, ParkedError> {
    let queue = names.parked_queue();
    let replay_into = match (action, dry_run) {
        (Action::Replay, false) => Some(ReplayInto {
            publisher: Publisher::open(connection, replay.confirm_timeout)
                .await
                .map_err(|e| ParkedError::Replay(e.into()))?,
            work_exchange: ShortString::from(names.work_exchange()),
        }),
        _ => None,
    };
    act_on(
        connection,
        &queue,
        replay_into,
        replay.state_keys,
        action,
        filter,
        limit,
        dry_run,
    )
    .await
}

/// How a replay publishes its copies (on the operation's connection).
#[derive(Clone, Copy)]
pub struct Replay<'a> {
    /// How long a copy waits for the broker's confirm.
    pub confirm_timeout: Duration,
    /// The key each copy's bridge state is signed with (`bridge.state_key`), if any: the
    /// bridges park an unsigned copy when they have one. With a key, only a parked copy the
    /// bridge itself signed when it parked it is replayable (and signed anew): a copy whose
    /// state a publisher forged, that failed its signature, or that an older version
    /// parked, is listed as not replayable and stays parked.
    pub state_keys: Option<&'a StateKeys>,
}

/// Where a replay publishes: the publisher and the work exchange.
struct ReplayInto {
    publisher: Publisher,
    work_exchange: ShortString,
}

/// [`act`] on the parked queue `queue`; a replay publishes as `replay_into` says (none on a
/// list, a purge or a dry run); with `state_keys`, only copies they verify are replayable.
#[allow(clippy::too_many_arguments)]
async fn act_on(
    connection: &wire::Connection,
    queue: &str,
    replay_into: Option<ReplayInto>,
    state_keys: Option<&StateKeys>,
    action: Action,
    filter: &Filter,
    limit: usize,
    dry_run: bool,
) -> Result<Report, ParkedError> {
    let fail = |source| ParkedError::Read {
        queue: queue.to_string(),
        source,
    };
    let channel = connection.open_channel().await.map_err(fail)?;
    let mut report = Report {
        action,
        dry_run,
        held: 0,
        scanned: 0,
        selected: Vec::new(),
    };
    let result = async {
        report.held = channel
            .queue_counts(queue)
            .await
            .map_err(|source| match source.reply_code() {
                Some(404) => ParkedError::Missing {
                    queue: queue.to_string(),
                },
                _ => fail(source),
            })?
            .messages;
        let scan = report.held.min(u64::from(MOST_AT_ONCE)) as usize;
        if scan == 0 || limit == 0 {
            return Ok(());
        }
        // Without a filter every message read is selected: `limit` of them are enough.
        let window = if filter.is_empty() {
            scan.min(limit)
        } else {
            scan
        };
        let mut deliveries = consume(&channel, queue, window).await.map_err(fail)?;
        // Everything this operation takes is read before anything is done with it.
        let mut chosen = Vec::new();
        while (report.scanned as usize) < scan && chosen.len() < limit {
            let delivery = match tokio::time::timeout(NEXT_WITHIN, deliveries.next()).await {
                Ok(Ok(Some(delivery))) => delivery,
                Ok(Err(source)) => return Err(fail(source)),
                Ok(Ok(None)) | Err(_) => break,
            };
            report.scanned += 1;
            let mut message = match &delivery.unreadable {
                None => ParkedMessage::describe(
                    delivery.routing_key.as_str(),
                    &delivery.properties,
                    delivery.data.len(),
                ),
                Some(raw) => ParkedMessage::describe_unreadable(
                    delivery.routing_key.as_str(),
                    raw.what,
                    delivery.data.len(),
                ),
            };
            // With a key, a parked copy is replayable only when the bridge signed it.
            let unvouched = match state_keys {
                Some(keys) if message.replayable => keys
                    .verify(&delivery.properties, &delivery.data, false)
                    .err()
                    .map(|refused| refused.detail),
                _ => None,
            };
            if unvouched.is_some() {
                message.replayable = false;
            }
            if filter.matches(&message, now_ms()) {
                chosen.push((delivery, message, unvouched));
            }
        }
        // No more deliveries: each removal below would make room for one.
        channel.cancel(deliveries.tag()).await.map_err(fail)?;
        for (delivery, message, unvouched) in chosen {
            let mut outcome = Outcome {
                message,
                done: false,
                note: None,
            };
            match (action, &replay_into) {
                (Action::List, _) => {}
                (Action::Purge, _) if dry_run => {}
                (Action::Purge, _) => {
                    remove(&channel, &delivery).map_err(fail)?;
                    outcome.done = true;
                }
                (Action::Replay, _) if !outcome.message.replayable => {
                    outcome.note = Some(match unvouched {
                        Some(why) => format!(
                            "not replayable: the bridge did not sign its state when it parked it ({why}); a copy a publisher forged, that failed its signature, or that a version before 0.2 parked is never signed again: read it, and publish what it should be to an ingress"
                        ),
                        None => "not replayable: parked before a bridge read it (no due time and target); fix it and publish it again".into(),
                    });
                }
                (Action::Replay, None) => {}
                (Action::Replay, Some(into)) => {
                    let mut properties = replay_properties(&delivery.properties);
                    if let Some(keys) = state_keys {
                        properties = keys.sign(properties, &delivery.data);
                    }
                    let disposition = into
                        .publisher
                        .publish(
                            into.work_exchange.as_str(),
                            delivery.routing_key.as_str(),
                            &delivery.data,
                            &properties,
                        )
                        .await;
                    match disposition {
                        Disposition::Routed => {
                            remove(&channel, &delivery).map_err(fail)?;
                            outcome.done = true;
                        }
                        Disposition::Returned { code, text } => {
                            outcome.note = Some(format!(
                                "the work exchange routed it nowhere ({code} {text}): is a bridge's topology declared?"
                            ));
                        }
                        Disposition::Nacked => {
                            outcome.note = Some("the work queue refused it (nack)".into());
                        }
                        // The refusal closed the replay's channel: nothing more goes out.
                        Disposition::Refused(refusal) => {
                            return Err(ParkedError::ReplayRefused {
                                detail: refusal.detail,
                            });
                        }
                        Disposition::Lost(e) => return Err(e.into()),
                    }
                }
            }
            report.selected.push(outcome);
        }
        Ok::<(), ParkedError>(())
    }
    .await;
    // Closing the channel hands every message not removed back to the queue.
    let _ = channel.close().await;
    if let Some(into) = replay_into {
        into.publisher.close().await;
    }
    result?;
    Ok(report)
}

/// Removes a read message from the parked queue (acknowledges it).
fn remove(channel: &Channel, delivery: &Delivery) -> Result<(), WireError> {
    channel.ack([(delivery.delivery_tag, false)])
}

/// Consumes `queue` on `channel` with a prefetch of `wanted` (nothing is delivered for 0).
async fn consume(channel: &Channel, queue: &str, wanted: usize) -> Result<Consumer, WireError> {
    channel
        .qos(u16::try_from(wanted.max(1)).unwrap_or(MOST_AT_ONCE))
        .await?;
    channel
        .consume(
            queue,
            &format!("delay-bridge-parked-{}", std::process::id()),
            FieldTable::default(),
        )
        .await
}

/// [`act`] on `config`'s parked queue over a connection of its own, closed afterwards.
pub async fn act_at(
    config: &Config,
    action: Action,
    filter: &Filter,
    limit: usize,
    dry_run: bool,
) -> Result<Report, ParkedError> {
    let connection = amqp::connect_wire(config.url(), "delay-bridge parked").await?;
    let replay = Replay {
        confirm_timeout: config.confirm_timeout,
        state_keys: config.state_keys.as_ref(),
    };
    let result = act(
        &connection,
        replay,
        &config.names,
        action,
        filter,
        limit,
        dry_run,
    )
    .await;
    connection.close().await;
    result
}

/// The first `limit` messages of `config`'s parked queue (at most [`MOST_AT_ONCE`]), and how
/// many it held in all when the read began, read over a connection of its own. Nothing is
/// removed.
pub async fn peek(config: &Config, limit: u16) -> Result<(Vec<ParkedMessage>, u64), ParkedError> {
    let connection = amqp::connect_wire(config.url(), "delay-bridge parked").await?;
    let result = peek_on(&connection, config, limit).await;
    connection.close().await;
    result
}

/// [`peek`] on `connection`.
pub async fn peek_on(
    connection: &wire::Connection,
    config: &Config,
    limit: u16,
) -> Result<(Vec<ParkedMessage>, u64), ParkedError> {
    let replay = Replay {
        confirm_timeout: config.confirm_timeout,
        state_keys: config.state_keys.as_ref(),
    };
    let report = act(
        connection,
        replay,
        &config.names,
        Action::List,
        &Filter::default(),
        usize::from(limit),
        false,
    )
    .await?;
    let messages = report.selected.into_iter().map(|o| o.message).collect();
    Ok((messages, report.held))
}
