//! The hop side of bundles (`bridge.bundle_hops`): the messages that hop into the same level
//! in the same `bridge.hop_window` travel as one message (`contract::bundle`). The first
//! message of a (level, window) group leads it: it waits for the window's end, publishes the
//! group as one bundle (more when it passes [`MAX_BUNDLE_BYTES`]) and tells every message
//! how that went; each message's delivery is acked once its bundle is confirmed, as after a
//! hop of its own. A bundle back from a level whose messages all go on into one level hops
//! again whole ([`Bundler::pass_whole`]). The return side is `bundle_returns`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use super::gate::BundleGate;
use super::planner::{self, Decision, Situation};
use super::publish::{Attempt, signed};
use super::settling::Settled;
use super::{Outcome, Sending, Stop, rules};
use crate::bridge::Shared;
use crate::bridge::inlet::{Inlet, Tag};
use crate::bridge::stats::Stats;
use crate::clock::{now_ms, until_epoch_ms};
use crate::contract::Envelope;
use crate::contract::bundle::{self, Summary};

/// A message that takes more than this in a bundle (body and properties) hops alone: a
/// bundle must never be refused for a size its messages would pass alone.
const MAX_MEMBER_BYTES: usize = 64 * 1024;
/// A bundle takes messages until it is this large; the rest of its group goes in the next.
const MAX_BUNDLE_BYTES: usize = 1024 * 1024;

/// How the bundle a message hopped in was settled, when it was.
#[derive(Debug, Clone, Copy)]
enum Joined {
    /// Confirmed into its level.
    Routed,
    /// The level refused the bundle (for its size): the message hops alone.
    Alone,
}

/// What each message of a bundle is told: how it was settled, or why it goes back.
type Answer = Result<Joined, Stop>;

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
struct Filling {
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

/// Carries hops in bundles: the bundles filling up now, and the gate that says whether
/// hops travel in bundles. One per session: its clones share both.
#[derive(Clone)]
pub(super) struct Bundler {
    /// The bundles filling up now.
    filling: Arc<Filling>,
    /// Whether hops travel in bundles now (`bridge::peers` opens and closes it).
    gate: BundleGate,
}

impl Bundler {
    /// No bundle filling, and the gate closed (reported in `stats`).
    pub(super) fn new(stats: Arc<Stats>) -> Self {
        Self {
            filling: Arc::default(),
            gate: BundleGate::new(stats),
        }
    }

    /// Whether hops travel in bundles now.
    pub(super) fn gate(&self) -> &BundleGate {
        &self.gate
    }

    /// Hops a message in the bundle of its level that leaves at `leaves_at` (epoch ms),
    /// published with `sending`; level zero is the returns queue. `None` when it must hop
    /// alone (too large for a bundle, or its bundle was refused).
    pub(super) async fn hop(
        &self,
        sending: Sending<'_>,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        level: Duration,
        leaves_at: u64,
    ) -> Option<Outcome> {
        let member = bundle::encode_hop_member(envelope, body)
            .filter(|member| member.len() <= MAX_MEMBER_BYTES)?;
        let key = (level, leaves_at);
        let due = envelope.occurrence.is_none().then_some(envelope.deliver_at);
        let (answered, leads) = self.filling.join(key, member, due);
        if leads {
            self.lead(sending, tag, key).await;
        }
        match answered.await.unwrap_or(Err(Stop::Release)) {
            Ok(Joined::Routed) => {
                sending.shared.stats.hops.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(
                    ?level,
                    hops = envelope.hops.saturating_add(1),
                    "hop in a bundle"
                );
                Some(Ok(()))
            }
            Ok(Joined::Alone) => None,
            Err(stop) => Some(Err(stop)),
        }
    }

    /// Leads the group `key`: waits for its window's end, then publishes it and answers
    /// every message in it (on a stop first, each is released).
    async fn lead(&self, sending: Sending<'_>, tag: Tag, key: GroupKey) {
        let stopped = tokio::select! {
            _ = tokio::time::sleep(until_epoch_ms(key.1)) => false,
            _ = sending.stop.cancelled() => true,
        };
        let waiting = self.filling.take(key);
        if stopped {
            for message in waiting {
                let _ = message.answer.send(Err(Stop::Release));
            }
            return;
        }
        let (exchange, queue) = level_route(sending.shared, key.0);
        let bundles = split_by_size(waiting, |w| w.member.len(), MAX_BUNDLE_BYTES);
        futures::future::join_all(
            bundles
                .into_iter()
                .map(|messages| publish_bundle(sending, tag, exchange, &queue, messages)),
        )
        .await;
    }

    /// Passes a bundle back from a level (delivery `tag`, header `summary`, `count`
    /// messages in `body`) on whole with `sending` into the one level all its messages go
    /// to, when they still do: its body as it came, its hop counted on the bundle. `None`
    /// when it must be read and carried message by message instead (they go apart now, or
    /// the level refused it).
    pub(super) async fn pass_whole(
        &self,
        sending: Sending<'_>,
        tag: Tag,
        summary: &Summary,
        count: usize,
        body: &[u8],
    ) -> Option<Outcome> {
        let shared = sending.shared;
        let (level, leaves_at) = self.next_level_whole(shared, tag, summary, body)?;
        tokio::select! {
            _ = tokio::time::sleep(until_epoch_ms(leaves_at)) => {}
            _ = sending.stop.cancelled() => return Some(Err(Stop::Release)),
        }
        let (exchange, queue) = level_route(shared, level);
        let onward = Summary {
            uncounted_hops: summary.uncounted_hops.saturating_add(1),
            ..*summary
        };
        let properties = bundle::summarised_properties(count, &onward);
        let attempt = Attempt::own(
            tag,
            &queue,
            exchange,
            &queue,
            body,
            signed(&shared.config, properties, body),
        );
        match sending.publishing.until_settled(attempt).await {
            Ok(Settled::Routed) => {
                let stats = &shared.stats;
                stats.bundles.fetch_add(1, Ordering::Relaxed);
                stats.passed_whole.fetch_add(1, Ordering::Relaxed);
                stats.hops.fetch_add(count as u64, Ordering::Relaxed);
                tracing::trace!(queue, messages = count, "bundle passed on whole");
                Some(Ok(()))
            }
            Ok(Settled::Park(refused)) => {
                tracing::warn!(
                    queue,
                    messages = count,
                    reason = refused.reason.as_str(),
                    "a level refused a bundle passed on whole: its messages go on one by one"
                );
                None
            }
            Err(stop) => Some(Err(stop)),
        }
    }

    /// The one level and window every message of a bundle back from a level (delivery
    /// `tag`, header `summary`, `body`) goes on to now, if they do: the first and the last
    /// due go on into the same one (so every message between does), no cancel in `shared`
    /// names one of them, and hops travel in bundles.
    fn next_level_whole(
        &self,
        shared: &Shared,
        tag: Tag,
        summary: &Summary,
        body: &[u8],
    ) -> Option<(Duration, u64)> {
        if !self.gate.is_open() {
            return None;
        }
        let (first, last) = summary.due?;
        let rules = rules(&shared.config);
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
        let tombstones = shared.tombstones.lock().expect("tombstone lock");
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
}

/// The exchange and the queue a bundle into `level` goes through, by the names in
/// `shared`: a level queue through the default exchange, and level zero, the returns
/// queue, through the work exchange.
fn level_route(shared: &Shared, level: Duration) -> (&str, String) {
    let names = &shared.config.names;
    if level.is_zero() {
        (shared.work_exchange.as_str(), names.returns_queue())
    } else {
        ("", names.level_queue(level))
    }
}

/// Publishes `messages` as one bundle through `exchange` into `queue` (a level queue
/// through the default exchange, or the returns queue through the work exchange) with
/// `sending`, and answers each of them.
async fn publish_bundle(
    sending: Sending<'_>,
    tag: Tag,
    exchange: &str,
    queue: &str,
    messages: Vec<Waiting>,
) {
    let body = bundle::bundle_body(messages.iter().map(|w| w.member.as_slice()));
    let properties =
        bundle::summarised_properties(messages.len(), &Summary::of(messages.iter().map(|w| w.due)));
    let attempt = Attempt::own(
        tag,
        queue,
        exchange,
        queue,
        &body,
        signed(&sending.shared.config, properties, &body),
    );
    let answer = match sending.publishing.until_settled(attempt).await {
        Ok(Settled::Routed) => {
            sending.shared.stats.bundles.fetch_add(1, Ordering::Relaxed);
            tracing::trace!(queue, messages = messages.len(), "bundle");
            Ok(Joined::Routed)
        }
        Ok(Settled::Park(refused)) => {
            tracing::warn!(
                queue,
                messages = messages.len(),
                reason = refused.reason.as_str(),
                "a level refused a bundle: its messages hop alone"
            );
            Ok(Joined::Alone)
        }
        Err(stop) => Err(stop),
    };
    for message in messages {
        let _ = message.answer.send(match &answer {
            Ok(joined) => Ok(*joined),
            Err(stop) => Err(stop.shared()),
        });
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
