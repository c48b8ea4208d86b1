//! Bundles of hops (`bridge.bundle_hops`): the messages that hop into the same level in the
//! same `bridge.hop_window` travel as one message (`contract::bundle`), and a bundle that
//! comes back is carried as its messages.
//!
//! Hop side: the first message of a (level, window) group leads it. It waits for the
//! window's end, publishes the group as one bundle (more when it passes
//! [`MAX_BUNDLE_BYTES`]) and tells every message how that went; each message's delivery is
//! acked once its bundle is confirmed, as after a hop of its own.
//!
//! Return side: a bundle's delivery is acked once every message in it is settled (hopped
//! again, delivered, parked or dropped). When the session stops first, the messages not yet
//! settled travel on as a bundle of their own through the work exchange before the delivery
//! is acked, so a graceful stop delivers nothing twice. After a failure that renews the
//! session the whole bundle goes back to the broker, and its settled messages come again
//! (at least once, as any delivery unacked at a fault).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::ShortString;
use tokio::sync::oneshot;

use super::planner::{self, Decision, Situation};
use super::{Attempt, Carrier, Decoded, Destination, Outcome, Settled, Undecodable};
use crate::amqp::wire::Delivery;
use crate::bridge::BridgeError;
use crate::bridge::inlet::{Inlet, Tag};
use crate::bridge::turns::Lane;
use crate::clock::{now_ms, until_epoch_ms};
use crate::contract::bundle::{self, Member, Summary};
use crate::contract::{Envelope, Parked, consumed_properties, hop_properties};

/// A message that takes more than this in a bundle (body and properties) hops alone: a
/// bundle must never be refused for a size its messages would pass alone.
const MAX_MEMBER_BYTES: usize = 64 * 1024;
/// A bundle takes messages until it is this large; the rest of its group goes in the next.
const MAX_BUNDLE_BYTES: usize = 1024 * 1024;
/// What the bridge is taken to hold per message of a bundle it carries, besides the bundle's
/// body, for the byte budget: a decoded message's task state measured 928 bytes (see
/// docs/performance.md, "Bridge memory is per unacked delivery"), plus its envelope.
pub(super) const HELD_MESSAGE_BYTES: u64 = 1024;

/// How the bundle a message hopped in was settled.
#[derive(Debug, Clone)]
enum Answer {
    /// Confirmed into its level.
    Routed,
    /// The level refused the bundle (for its size): the message hops alone.
    Alone,
    /// The session is stopping: the message goes back.
    Release,
    /// The publish failed in a way that renews the session (the error, as text).
    Failed(String),
}

/// A message waiting for its bundle to leave.
struct Waiting {
    /// Its bytes in the bundle's body.
    member: Vec<u8>,
    /// When it is due, epoch ms; `None` for a recurring occurrence (see `Summary::of`).
    due: Option<u64>,
    answer: oneshot::Sender<Answer>,
}

/// A group of hops: the level they go to and when their bundle leaves (epoch ms).
type GroupKey = (Duration, u64);

/// The bundles filling up now.
#[derive(Default)]
pub(in crate::bridge) struct Filling {
    groups: Mutex<HashMap<GroupKey, Vec<Waiting>>>,
}

impl Filling {
    /// Adds a message to its group: how its bundle is settled, and whether it is the
    /// group's first (its leader).
    fn join(
        &self,
        key: GroupKey,
        member: Vec<u8>,
        due: Option<u64>,
    ) -> (oneshot::Receiver<Answer>, bool) {
        let (answer, answered) = oneshot::channel();
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        let group = groups.entry(key).or_default();
        group.push(Waiting {
            member,
            due,
            answer,
        });
        (answered, group.len() == 1)
    }

    /// Takes a group out: a message that joins after this starts the next.
    fn take(&self, key: GroupKey) -> Vec<Waiting> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key)
            .unwrap_or_default()
    }
}

/// A bundle that came back, ready to be carried.
pub(in crate::bridge) enum PreparedBundle {
    /// Its messages, read one by one.
    Read(Bundle),
    /// Back from a level with a header that says when its first and last messages are due:
    /// kept as it came, to be passed on whole if they go on into one level when it is
    /// carried (else read then).
    Sealed(Box<Sealed>),
    /// It could not be read: parked whole.
    Unreadable(Box<Undecodable>),
}

/// A message of a bundle as it was read: decoded, or why it is parked.
type Read = Result<Decoded, Box<Undecodable>>;

/// The messages of a bundle that came back.
pub(in crate::bridge) struct Bundle {
    /// Its delivery.
    tag: Tag,
    /// The routing key it came back with (its level's name).
    routing_key: ShortString,
    /// Each message decoded, or why it is parked.
    messages: Vec<Read>,
}

/// A bundle kept as it came (see [`PreparedBundle::Sealed`]): read only should its messages
/// go apart.
/// What a bundle's delivery says of every message in it.
#[derive(Clone, Copy)]
pub(in crate::bridge) struct Provenance {
    /// The broker flagged the delivery redelivered (see `Decoded::redelivered`).
    redelivered: bool,
    /// The bridge vouches for the bundle's state (see `Undecodable::vouched`).
    vouched: bool,
}

pub(in crate::bridge) struct Sealed {
    /// Its delivery.
    tag: Tag,
    /// The exchange it came back through (the work exchange).
    exchange: ShortString,
    /// The routing key it came back with (its level's name).
    routing_key: ShortString,
    /// Its properties as consumed.
    properties: BasicProperties,
    /// Its body as consumed.
    body: Vec<u8>,
    /// Where it comes from.
    provenance: Provenance,
    /// How many messages it carries.
    count: usize,
    /// What its header says of them.
    summary: Summary,
}

/// `items` in order, cut into runs whose `size`s add up to at most `max` (an item larger
/// than `max` makes a run of its own).
fn split_by_size<T>(items: Vec<T>, size: impl Fn(&T) -> usize, max: usize) -> Vec<Vec<T>> {
    let mut runs: Vec<Vec<T>> = Vec::new();
    let mut filled = 0;
    for item in items {
        let len = size(&item);
        match runs.last_mut() {
            Some(run) if filled + len <= max => run.push(item),
            _ => {
                runs.push(vec![item]);
                filled = 0;
            }
        }
        filled += len;
    }
    runs
}

impl Carrier {
    /// Hops a message in the bundle of its level that leaves at `leaves_at` (epoch ms); level
    /// zero is the returns queue. `None` when it must hop alone (too large for a bundle, or
    /// its bundle was refused).
    pub(super) async fn hop_bundled(
        &self,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        level: Duration,
        leaves_at: u64,
    ) -> Option<Outcome> {
        let member = bundle::encode_member(&hop_properties(envelope), body)
            .filter(|member| member.len() <= MAX_MEMBER_BYTES)?;
        let key = (level, leaves_at);
        let due = envelope.occurrence.is_none().then_some(envelope.deliver_at);
        let (answered, leads) = self.bundles.join(key, member, due);
        if leads {
            self.lead(tag, key).await;
        }
        match answered.await.unwrap_or(Answer::Release) {
            Answer::Routed => {
                self.shared.stats.hops.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(
                    ?level,
                    hops = envelope.hops.saturating_add(1),
                    "hop in a bundle"
                );
                Some(Outcome::Done)
            }
            Answer::Alone => None,
            Answer::Release => Some(Outcome::Release),
            Answer::Failed(error) => Some(Outcome::Failed(BridgeError::Bundle(error))),
        }
    }

    /// Leads the group `key`: waits for its window's end, then publishes it and answers
    /// every message in it (on a stop first, each is released).
    async fn lead(&self, tag: Tag, key: GroupKey) {
        let stopped = tokio::select! {
            _ = tokio::time::sleep(until_epoch_ms(key.1)) => false,
            _ = self.stop.cancelled() => true,
        };
        let waiting = self.bundles.take(key);
        if stopped {
            for message in waiting {
                let _ = message.answer.send(Answer::Release);
            }
            return;
        }
        let (exchange, queue) = self.level_route(key.0);
        let bundles = split_by_size(waiting, |w| w.member.len(), MAX_BUNDLE_BYTES);
        futures::future::join_all(
            bundles
                .into_iter()
                .map(|messages| self.publish_bundle(tag, exchange, &queue, messages)),
        )
        .await;
    }

    /// The exchange and the queue a bundle into `level` goes through: a level queue through
    /// the default exchange, and level zero, the returns queue, through the work exchange.
    fn level_route(&self, level: Duration) -> (&str, String) {
        let names = &self.shared.config.names;
        if level.is_zero() {
            (self.shared.work_exchange.as_str(), names.returns_queue())
        } else {
            ("", names.level_queue(level))
        }
    }

    /// Publishes `messages` as one bundle through `exchange` into `queue` (a level queue
    /// through the default exchange, or the returns queue through the work exchange) and
    /// answers each of them.
    async fn publish_bundle(&self, tag: Tag, exchange: &str, queue: &str, messages: Vec<Waiting>) {
        let body = bundle::bundle_body(messages.iter().map(|w| w.member.as_slice()));
        let attempt = Attempt {
            tag,
            destination: Destination::Own(queue),
            exchange: ShortString::from(exchange),
            routing_key: ShortString::from(queue),
            body: &body,
            properties: self.signed(
                bundle::summarised_properties(
                    messages.len(),
                    &Summary::of(messages.iter().map(|w| w.due)),
                ),
                &body,
            ),
            lane: None,
        };
        let answer = match self.publish_until_settled(attempt).await {
            Settled::Routed => {
                self.shared.stats.bundles.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(queue, messages = messages.len(), "bundle");
                Answer::Routed
            }
            Settled::Park(refused) => {
                tracing::warn!(
                    queue,
                    messages = messages.len(),
                    reason = refused.reason.as_str(),
                    "a level refused a bundle: its messages hop alone"
                );
                Answer::Alone
            }
            Settled::Release => Answer::Release,
            Settled::Failed(error) => Answer::Failed(error.to_string()),
        };
        for message in messages {
            let _ = message.answer.send(answer.clone());
        }
    }

    /// Prepares a bundle that came back through the work exchange: kept sealed when it came
    /// back from a level, hops travel in bundles and its header says when its first and
    /// last messages are due (whether they go on together is decided once, when it is
    /// carried), else read into its messages, each decoded as a delivery of its own would
    /// be (a bundle redelivered too often parks every message in it `redelivery-limit`).
    pub(super) fn prepare_bundle(
        &self,
        tag: Tag,
        delivery: Delivery,
        redeliveries: Option<u32>,
    ) -> PreparedBundle {
        let Delivery {
            exchange,
            routing_key,
            properties,
            data,
            ..
        } = delivery;
        let unreadable = |body, routing_key, consumed, parked, vouched| {
            PreparedBundle::Unreadable(Box::new(Undecodable {
                tag,
                body,
                routing_key,
                consumed,
                parked,
                vouched,
            }))
        };
        let provenance = match self.check_signature(&exchange, &properties, &data) {
            Ok(vouched) => Provenance {
                redelivered: redeliveries.is_some(),
                vouched,
            },
            Err(parked) => return unreadable(data, routing_key, properties, parked, false),
        };
        let too_often = self.redelivered_too_often(&properties, redeliveries);
        let summary = bundle::summary(&properties);
        let count = bundle::count(&properties).and_then(|count| usize::try_from(count).ok());
        if let Some(count) = count
            && too_often.is_none()
            && summary.due.is_some()
            && !self.back_from_returns(&routing_key)
            && self.shared.stats.bundling.load(Ordering::Relaxed) == 1
        {
            return PreparedBundle::Sealed(Box::new(Sealed {
                tag,
                exchange,
                routing_key,
                properties,
                body: data,
                provenance,
                count,
                summary,
            }));
        }
        let read = self.read_bundle(
            tag,
            &exchange,
            &routing_key,
            &properties,
            &data,
            too_often,
            provenance,
        );
        match read {
            Ok(bundle) => PreparedBundle::Read(bundle),
            Err(parked) => unreadable(data, routing_key, properties, parked, provenance.vouched),
        }
    }

    /// True for a delivery back from the returns queue (level zero): its messages wait out
    /// their last moments here; back from a level, they move there first.
    fn back_from_returns(&self, routing_key: &ShortString) -> bool {
        routing_key.as_str() == self.shared.config.names.returns_queue()
    }

    /// Reads a bundle's messages from its `properties` and `body`, each decoded (or parked
    /// as `too_often` says), with the hops its header says their state does not count, and
    /// `redelivered` when the broker flagged the bundle's delivery so; why the whole bundle
    /// is parked when it cannot be read.
    #[allow(clippy::too_many_arguments)]
    fn read_bundle(
        &self,
        tag: Tag,
        exchange: &ShortString,
        routing_key: &ShortString,
        properties: &BasicProperties,
        body: &[u8],
        too_often: Option<Parked>,
        provenance: Provenance,
    ) -> Result<Bundle, Parked> {
        let read_at = now_ms();
        let members = bundle::decode_bundle(properties, body)?;
        let uncounted_hops = bundle::summary(properties).uncounted_hops;
        let waits_here = self.back_from_returns(routing_key);
        // A lane per due instant: a burst's messages (due at one instant) take turns as one
        // lane, and each message due after them in the same bundle as a lane of its own,
        // so it waits for a turn of the burst, not behind all of it.
        let mut lanes: HashMap<u64, Lane> = HashMap::new();
        let messages = members
            .into_iter()
            .map(|Member { properties, body }| {
                let decoded = match &too_often {
                    Some(parked) => Err(parked.clone()),
                    None => self.decode(exchange, routing_key, &properties),
                };
                match decoded {
                    Ok(mut envelope) => {
                        envelope.hops = envelope.hops.saturating_add(uncounted_hops);
                        let lane = lanes
                            .entry(envelope.deliver_at)
                            .or_insert_with(|| self.lanes.open())
                            .join();
                        Ok(Decoded {
                            tag,
                            body: body.to_vec(),
                            envelope,
                            read_at,
                            waits_here,
                            lane: Some(lane),
                            taken_in: false,
                            redelivered: provenance.redelivered,
                        })
                    }
                    Err(parked) => Err(Box::new(Undecodable {
                        tag,
                        body: body.to_vec(),
                        routing_key: routing_key.clone(),
                        consumed: properties,
                        parked,
                        vouched: provenance.vouched,
                    })),
                }
            })
            .collect();
        Ok(Bundle {
            tag,
            routing_key: routing_key.clone(),
            messages,
        })
    }

    /// The one level and window every message of a bundle back from a level (delivery
    /// `tag`, header `summary`, `body`) goes on to now, if they do: the first and the last
    /// due go on into the same one (so every message between does), no cancel names one of
    /// them, and hops travel in bundles.
    fn sealed_next_level(
        &self,
        tag: Tag,
        summary: &Summary,
        body: &[u8],
    ) -> Option<(Duration, u64)> {
        if self.shared.stats.bundling.load(Ordering::Relaxed) != 1 {
            return None;
        }
        let (first, last) = summary.due?;
        let rules = self.rules();
        let now_ms = now_ms();
        let decide = |deliver_at| {
            let situation = Situation {
                now_ms,
                deliver_at,
                bundled: true,
                in_window: rules.hop_window.is_zero(),
                waits_here: false,
                from_work: tag.inlet == Inlet::Work,
            };
            planner::decide(&situation, &rules)
        };
        let next = decide(first);
        let Decision::Bundle { level, leaves_at } = next else {
            return None;
        };
        if decide(last) != next {
            return None;
        }
        let tombstones = self.shared.tombstones.lock().expect("tombstone lock");
        if !tombstones.is_empty() {
            for id in bundle::member_message_ids(body)?.into_iter().flatten() {
                match std::str::from_utf8(id) {
                    Ok(id) if !tombstones.names(id) => {}
                    _ => return None,
                }
            }
        }
        Some((level, leaves_at))
    }

    /// Passes a sealed bundle on whole into the one level all its messages go to, when they
    /// still do: its body as it came, its hop counted on the bundle. `None` when it must be
    /// read and carried message by message instead (they go apart now, or the level
    /// refused it).
    async fn pass_sealed(&self, sealed: &Sealed) -> Option<Outcome> {
        let (level, leaves_at) =
            self.sealed_next_level(sealed.tag, &sealed.summary, &sealed.body)?;
        tokio::select! {
            _ = tokio::time::sleep(until_epoch_ms(leaves_at)) => {}
            _ = self.stop.cancelled() => return Some(Outcome::Release),
        }
        let (exchange, queue) = self.level_route(level);
        let summary = Summary {
            uncounted_hops: sealed.summary.uncounted_hops.saturating_add(1),
            ..sealed.summary
        };
        let properties = bundle::summarised_properties(sealed.count, &summary);
        let attempt = Attempt {
            tag: sealed.tag,
            destination: Destination::Own(&queue),
            exchange: ShortString::from(exchange),
            routing_key: ShortString::from(queue.as_str()),
            body: &sealed.body,
            properties: self.signed(properties, &sealed.body),
            lane: None,
        };
        match self.publish_until_settled(attempt).await {
            Settled::Routed => {
                let stats = &self.shared.stats;
                stats.bundles.fetch_add(1, Ordering::Relaxed);
                stats.passed_whole.fetch_add(1, Ordering::Relaxed);
                stats.hops.fetch_add(sealed.count as u64, Ordering::Relaxed);
                tracing::trace!(queue, messages = sealed.count, "bundle passed on whole");
                Some(Outcome::Done)
            }
            Settled::Park(refused) => {
                tracing::warn!(
                    queue,
                    messages = sealed.count,
                    reason = refused.reason.as_str(),
                    "a level refused a bundle passed on whole: its messages go on one by one"
                );
                None
            }
            Settled::Release => Some(Outcome::Release),
            Settled::Failed(error) => Some(Outcome::Failed(error)),
        }
    }

    /// Carries a bundle that came back: passes it on whole, or carries every message of it
    /// at once (done when all are), or parks it whole.
    pub(super) async fn carry_bundle(&self, prepared: &PreparedBundle) -> Outcome {
        match prepared {
            PreparedBundle::Read(bundle) => self.carry_messages(bundle).await,
            PreparedBundle::Sealed(sealed) => {
                if let Some(outcome) = self.pass_sealed(sealed).await {
                    return outcome;
                }
                let read = self.read_bundle(
                    sealed.tag,
                    &sealed.exchange,
                    &sealed.routing_key,
                    &sealed.properties,
                    &sealed.body,
                    None,
                    sealed.provenance,
                );
                match read {
                    Ok(bundle) => self.carry_messages(&bundle).await,
                    Err(parked) => {
                        Box::pin(self.park(
                            sealed.tag,
                            &sealed.body,
                            &sealed.routing_key,
                            &sealed.properties,
                            &parked,
                            sealed.provenance.vouched,
                        ))
                        .await
                    }
                }
            }
            PreparedBundle::Unreadable(unreadable) => {
                Box::pin(self.park(
                    unreadable.tag,
                    &unreadable.body,
                    &unreadable.routing_key,
                    &unreadable.consumed,
                    &unreadable.parked,
                    unreadable.vouched,
                ))
                .await
            }
        }
    }

    /// Carries every message of a bundle at once; done when all are.
    async fn carry_messages(&self, bundle: &Bundle) -> Outcome {
        let outcomes = futures::future::join_all(
            bundle
                .messages
                .iter()
                .map(|message| self.carry_prepared(message)),
        )
        .await;
        let mut released = Vec::new();
        for (message, outcome) in bundle.messages.iter().zip(outcomes) {
            match outcome {
                Outcome::Done => {}
                Outcome::Release => released.push(message),
                Outcome::Failed(error) => return Outcome::Failed(error),
            }
        }
        if released.is_empty() {
            return Outcome::Done;
        }
        self.pass_on(bundle, &released).await
    }

    /// Sends the messages of `bundle` a stop released on through the work exchange, as a
    /// bundle of their own: once that is confirmed, the bundle's delivery is done and none
    /// of its settled messages comes again.
    async fn pass_on(&self, bundle: &Bundle, released: &[&Read]) -> Outcome {
        let members: Option<Vec<Vec<u8>>> = released
            .iter()
            .map(|message| match message {
                Ok(decoded) => {
                    bundle::encode_member(&consumed_properties(&decoded.envelope), &decoded.body)
                }
                Err(undecodable) => bundle::encode_member(&undecodable.consumed, &undecodable.body),
            })
            .collect();
        // They were read from a bundle, so they fit one; should one not, all go back.
        let Some(members) = members else {
            return Outcome::Release;
        };
        let body = bundle::bundle_body(members.iter().map(Vec::as_slice));
        let attempt = Attempt {
            tag: bundle.tag,
            destination: Destination::Own("the work queue"),
            exchange: ShortString::from(self.shared.work_exchange.as_str()),
            routing_key: bundle.routing_key.clone(),
            body: &body,
            properties: self.signed(bundle::bundle_properties(members.len()), &body),
            lane: None,
        };
        match self.publish_until_settled(attempt).await {
            Settled::Routed => {
                tracing::debug!(
                    messages = members.len(),
                    "stopping: passed the unsettled messages of a bundle on"
                );
                Outcome::Done
            }
            Settled::Park(_) | Settled::Release => Outcome::Release,
            Settled::Failed(error) => Outcome::Failed(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_keep_the_order_and_stay_within_the_size() {
        let runs = split_by_size(vec![4, 4, 3, 9, 12, 1, 1], |n| *n, 10);
        assert_eq!(
            runs,
            vec![vec![4, 4], vec![3], vec![9], vec![12], vec![1, 1]]
        );
        assert_eq!(
            split_by_size(Vec::<usize>::new(), |n| *n, 10),
            Vec::<Vec<usize>>::new()
        );
        assert_eq!(split_by_size(vec![5, 5], |n| *n, 10), vec![vec![5, 5]]);
    }
}
