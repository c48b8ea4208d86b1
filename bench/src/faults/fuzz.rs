//! `fuzz`: messages with random header tables (every AMQP field type, nested, empty and
//! huge values, odd values of `x-delay`, `x-deliver-at` and `x-published-at`, the bridge's
//! own header names) and random properties, through a real bridge. Every message must end
//! delivered or parked with a reason; the bridge must neither panic nor lose its connection.
//! The bridge's `max_delay` is 10 s here, so a random far due time is parked
//! `delay-too-long` instead of outliving the run.
//!
//! With `--adversary` ([`adversary`]) the bridge signs its state, serves a second route the
//! fuzz never publishes to, and the fuzz publishes as a user with the recipe's `publisher`
//! rights, forging state bound for the second route's target: nothing may reach that
//! route's queue and nothing may be lost, before and after a `parked replay`.

mod adversary;

use std::time::Duration;

use anyhow::Result;
use delay_bridge_bench::report;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, DecimalValue, FieldArray, FieldTable};
use rand::Rng;

use delay_bridge::amqp;
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::contract::signature::StateKeys;
use delay_bridge::contract::{self, header};
use delay_bridge::parked::{Action, Filter};
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use super::traffic::{FaultCollector, Seen, Sent};
use super::{Parked, Tally, peek_parked, read_parked};
use crate::Target;
use crate::load::{Outgoing, body, publish};
use adversary::Arena;

/// `fuzz` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages to send.
    #[arg(long, default_value_t = 2000)]
    count: u64,
    /// Run as an adversary: the bridge signs its state with a random key and serves a
    /// second route (a topic target with a queue bound `#`); the fuzz publishes as a broker
    /// user created for the run with the recipe's `publisher` rights only, to the first
    /// route's ingress, forging state bound for the second route's target. Nothing may
    /// reach the second route's queue and nothing may be lost, before and after a `parked
    /// replay`; the run fails otherwise.
    #[arg(long)]
    adversary: bool,
    /// How to run rabbitmqctl against the broker (`--adversary` creates and deletes its
    /// publisher's user with it), for example `bash scripts/debian-broker.sh trixie ctl`.
    #[arg(long, env = "DELAY_BRIDGE_CTL", default_value = "rabbitmqctl")]
    ctl: String,
}

/// The bridge's longest delay in this scenario.
const MAX_DELAY: Duration = Duration::from_secs(10);

/// How long a control message to the second route may take.
const CONTROL_WITHIN: Duration = Duration::from_secs(10);

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    anyhow::ensure!(args.count > 0, "--count must be > 0");
    let mut config = base.clone();
    config.max_delay = MAX_DELAY;
    if args.adversary {
        config.state_keys = Some(adversary::random_state_key());
    }
    // The adversary's target binds only its routing keys: a stray one is parked
    // `unroutable`, signed by the bridge, for the `parked replay` to replay.
    let binding = match args.adversary {
        true => TargetBinding::Topic(adversary::BOUND.into()),
        false => TargetBinding::Fanout,
    };
    let mut sandbox = Sandbox::declare(&config, "delay-bridge-faults-fuzz", binding).await?;
    // Dropped on any early return: the sandbox deletes what it declared, the arena its user.
    let arena = match args.adversary {
        true => Some(Arena::prepare(&mut sandbox, &args.ctl).await?),
        false => None,
    };
    sandbox.run_in_process().await?;
    let result = measure(&sandbox, args, arena.as_ref()).await;
    let stats = sandbox.stats().map(|s| s.snapshot());
    // A bridge that panicked or stopped makes this fail.
    let stopped = sandbox.finish().await;
    let user_deleted = match arena {
        Some(arena) => arena.user.delete().await,
        None => Ok(()),
    };
    let (tally, outcome) = result?;
    user_deleted?;
    let reconnects = stats.map_or(0, |s| s.reconnects);
    let unexplained = tally.parked.by_reason.get("(none)").copied().unwrap_or(0);
    let mut targets = vec![
        tally.none_missing(),
        Target::new(
            "the bridge kept its connection and stopped cleanly",
            format!(
                "{reconnects} reconnects, stop: {}",
                match &stopped {
                    Ok(()) => "clean".to_string(),
                    Err(e) => e.to_string(),
                }
            ),
            reconnects == 0 && stopped.is_ok(),
        ),
        Target::new(
            "every parked message has a reason",
            format!("{unexplained} without one"),
            unexplained == 0,
        ),
    ];
    let mut lines = vec![format!(
        "{} messages with random headers and properties, max_delay {}s",
        args.count,
        MAX_DELAY.as_secs()
    )];
    let mut after = Vec::new();
    let adversary_targets = outcome.as_ref().map(Outcome::targets).unwrap_or_default();
    let missed: Vec<String> = adversary_targets
        .iter()
        .filter(|t| !t.pass)
        .map(|t| t.name.clone())
        .collect();
    if let Some(o) = &outcome {
        lines.push(o.setting.clone());
        after.extend(o.summary(&tally));
    }
    targets.extend(adversary_targets);
    tally.print_with(
        &lines,
        &after,
        &targets,
        report::FaultDone {
            bridge_reconnects: Some(reconnects),
            ..Default::default()
        },
    );
    anyhow::ensure!(
        missed.is_empty(),
        "fuzz --adversary missed: {}",
        missed.join("; ")
    );
    Ok(())
}

/// What an adversary run measured beside the tally (which is what it saw before the
/// `parked replay`).
struct Outcome {
    /// The run's setting, one line.
    setting: String,
    /// Arrivals at the second route's queue before the replay.
    outside_before: u64,
    /// Messages neither delivered to the first route's target, nor parked, nor dropped by
    /// a cancel, before the replay.
    lost_before: u64,
    /// Parked messages the replay sent back through the work exchange.
    replayed: u64,
    /// Parked messages the replay left parked (not replayable).
    stayed: u64,
    /// After the replay: what reached the first route's target, and what was parked.
    seen_after: Seen,
    parked_after: Parked,
    /// Arrivals at the second route's queue, from the start to the end.
    outside_after: u64,
    /// As `lost_before`, after the replay.
    lost_after: u64,
    /// Copies the bridge dropped because their message was cancelled.
    cancelled: u64,
    /// The control message published to the second route's ingress arrived.
    control_arrived: bool,
}

impl Outcome {
    fn summary(&self, tally: &Tally) -> Vec<String> {
        vec![
            format!(
                "adversary: delivered {}, parked {}, delivered outside their route {}, lost {} ({} dropped by a cancel)",
                tally.seen.delivered(),
                tally.parked.total(),
                self.outside_before,
                self.lost_before,
                self.cancelled
            ),
            format!(
                "after parked replay ({} replayed, {} not replayable): delivered {}, parked {}, delivered outside their route {}, lost {}",
                self.replayed,
                self.stayed,
                self.seen_after.delivered(),
                self.parked_after.total(),
                self.outside_after,
                self.lost_after
            ),
            format!(
                "parked by reason after the replay: {:?}",
                self.parked_after.by_reason
            ),
        ]
    }

    fn targets(&self) -> Vec<Target> {
        vec![
            Target::new(
                "0 delivered outside their route",
                format!(
                    "{} before parked replay, {} after",
                    self.outside_before, self.outside_after
                ),
                self.outside_before == 0 && self.outside_after == 0,
            ),
            Target::new(
                "0 lost",
                format!(
                    "{} before parked replay, {} after ({} dropped by a cancel)",
                    self.lost_before, self.lost_after, self.cancelled
                ),
                self.lost_before == 0 && self.lost_after == 0,
            ),
            Target::new(
                "the second route delivers (a control message)",
                match self.control_arrived {
                    true => "arrived".to_string(),
                    false => format!("not within {}s", CONTROL_WITHIN.as_secs()),
                },
                self.control_arrived,
            ),
        ]
    }
}

/// Sequence numbers neither delivered nor parked, less the copies a cancel dropped.
fn lost(seen: &Seen, parked: &Parked, cancelled: u64) -> u64 {
    let neither = seen
        .copies
        .iter()
        .zip(&parked.copies)
        .filter(|(delivered, parked)| **delivered == 0 && **parked == 0)
        .count() as u64;
    neither.saturating_sub(cancelled)
}

/// Waits until every message is delivered or parked, or `within` passes (at least `at_least`).
async fn settle(
    sandbox: &Sandbox,
    collector: &FaultCollector,
    count: u64,
    at_least: Duration,
    within: Duration,
) -> Result<()> {
    let parked_queue = sandbox.config.names.parked_queue();
    let started = tokio::time::Instant::now();
    loop {
        let parked = sandbox.counts(&parked_queue).await?.messages;
        let now = tokio::time::Instant::now();
        if (collector.delivered() + parked >= count && now >= started + at_least)
            || now > started + within
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn measure(
    sandbox: &Sandbox,
    args: &Args,
    arena: Option<&Arena>,
) -> Result<(Tally, Option<Outcome>)> {
    let urls = sandbox.config.urls.clone();
    let collector = FaultCollector::start(urls.clone(), sandbox.target_queue.clone(), args.count);
    let outside =
        arena.map(|a| FaultCollector::start(urls.clone(), a.other_queue.clone(), args.count));
    let own_user = sandbox.config.url().user();
    let (publisher_conn, hostile) = match arena {
        Some(a) => (
            Some(amqp::connect(&a.publisher_url, "delay-bridge faults fuzz adversary").await?),
            Hostile {
                user_id: a.user.name(),
                forger: Some(Forger {
                    target: &a.other_target,
                    key: adversary::random_state_key(),
                }),
            },
        ),
        None => (
            None,
            Hostile {
                user_id: &own_user,
                forger: None,
            },
        ),
    };
    let channel =
        crate::load::confirm_channel(publisher_conn.as_ref().unwrap_or(&sandbox.conn)).await?;
    let ingress = sandbox.ingress.clone();
    let mut rng = rand::rng();
    let mut forged = Forgeries::default();
    let mut strays = [0u64; 2];
    let published = publish(&channel, args.count, None, |seq| {
        let body = body(seq, 0, 16);
        let properties = hostile.within_a_frame(&mut rng, &body, &mut forged);
        let routing_key = match (arena, rng.random_range(0..10)) {
            (Some(_), 0) => {
                strays[0] += 1;
                adversary::STRAY_REPLAYED
            }
            (Some(_), 1) => {
                strays[1] += 1;
                adversary::STRAY_PARKED
            }
            _ => "fuzz",
        };
        Outgoing {
            exchange: ingress.as_str().into(),
            routing_key: routing_key.into(),
            body,
            properties,
        }
    })
    .await?;
    let _ = channel.close(200, "published".into()).await;
    if let Some(conn) = &publisher_conn {
        let _ = conn.close(200, "published".into()).await;
    }
    let parked_queue = sandbox.config.names.parked_queue();
    // Everything is delivered or parked within the longest delay plus a margin: wait for
    // the delivered ones, then read what was parked.
    let margin = MAX_DELAY + Duration::from_secs(30);
    settle(sandbox, &collector, args.count, Duration::ZERO, margin).await?;
    let sent = Sent {
        confirmed: args.count,
        rate: args.count as f64 * 1e6
            / published
                .confirmed_us
                .saturating_sub(published.started_us)
                .max(1) as f64,
        ..Sent::default()
    };
    let (Some(arena), Some(outside)) = (arena, outside) else {
        let seen = collector
            .finish(
                args.count,
                tokio::time::Instant::now(),
                Duration::from_secs(2),
            )
            .await?;
        let parked = read_parked(&urls, &parked_queue, args.count).await?;
        let tally = Tally {
            scenario: "fuzz",
            count: args.count,
            sent,
            seen,
            parked,
        };
        return Ok((tally, None));
    };

    // The adversary: what was parked stays parked (read unacknowledged), and what arrived
    // is read after it, so that a message is counted at least once.
    let parked = peek_parked(&urls, &parked_queue, args.count).await?;
    let seen = collector.seen_now();
    let outside_before = outside.seen_now().arrivals();
    let cancelled = || {
        sandbox
            .stats()
            .map_or(0, |stats| stats.snapshot().cancelled)
    };
    let lost_before = lost(&seen, &parked, cancelled());
    // `delay-bridge parked replay`, as the operator runs it: the bridge's own key re-signs
    // what it signed when it parked it, and nothing else is replayable.
    arena.bind_stray_replayed(sandbox).await?;
    let replay = delay_bridge::parked::act_at(
        &sandbox.config,
        Action::Replay,
        &Filter::default(),
        args.count as usize,
        false,
    )
    .await?;
    let replayed = replay.done() as u64;
    let stayed = replay.selected.len() as u64 - replayed;
    settle(
        sandbox,
        &collector,
        args.count,
        Duration::from_secs(1),
        margin,
    )
    .await?;
    let seen_after = collector
        .finish(
            args.count,
            tokio::time::Instant::now(),
            Duration::from_secs(2),
        )
        .await?;
    let outside_after = outside
        .finish(args.count, tokio::time::Instant::now(), Duration::ZERO)
        .await?
        .arrivals();
    let parked_after = read_parked(&urls, &parked_queue, args.count).await?;
    let cancelled = cancelled();
    let control_arrived = arena.control_arrives(sandbox, CONTROL_WITHIN).await?;
    let setting = format!(
        "adversary: a random 32-byte state key; publisher `{}` with the recipe's publisher rights (write {}) to {} only; a second route {} -> {} (topic, its queue bound `#`); {} messages forge {} = {} ({} of them signed with another key); routing keys: {} `{}` (bound to the first target after the first pass), {} `{}` (never bound), the rest `fuzz`",
        arena.user.name(),
        arena.publisher_write,
        sandbox.ingress,
        arena.other_ingress,
        arena.other_target,
        forged.target,
        header::STATE_TARGET,
        arena.other_target,
        forged.signed,
        strays[0],
        adversary::STRAY_REPLAYED,
        strays[1],
        adversary::STRAY_PARKED
    );
    let outcome = Outcome {
        setting,
        outside_before,
        lost_before,
        replayed,
        stayed,
        lost_after: lost(&seen_after, &parked_after, cancelled),
        seen_after,
        parked_after,
        outside_after,
        cancelled,
        control_arrived,
    };
    let tally = Tally {
        scenario: "fuzz",
        count: args.count,
        sent,
        seen,
        parked,
    };
    Ok((tally, Some(outcome)))
}

/// Who publishes the fuzz, and what it forges.
struct Hostile<'a> {
    /// The `user_id` a message may carry: the publisher's own (the broker refuses another
    /// at publish, before the bridge sees it).
    user_id: &'a str,
    /// The adversary's forgeries, when it is one.
    forger: Option<Forger<'a>>,
}

/// An adversary's forged bridge state.
struct Forger<'a> {
    /// The target it names: the second route's.
    target: &'a str,
    /// The key it signs some of it with: its own, not the bridge's.
    key: StateKeys,
}

/// How many messages sent forged state.
#[derive(Debug, Default)]
struct Forgeries {
    /// With a `delay-bridge-target` naming the forger's target.
    target: u64,
    /// Of those, signed with the forger's key.
    signed: u64,
}

/// The largest content header the fuzz sends: under the broker's 128 KiB frame (a larger
/// one costs the publisher its connection before the bridge sees it), with room left for
/// the bridge's own headers, which may push it over (that is then the bridge's to park).
const MAX_HEADER_FRAME: usize = 120 * 1024;

impl Hostile<'_> {
    /// Random properties whose content header fits [`MAX_HEADER_FRAME`], for a message
    /// with `body`; counts the forged ones in `forged`.
    fn within_a_frame(
        &self,
        rng: &mut impl Rng,
        body: &[u8],
        forged: &mut Forgeries,
    ) -> BasicProperties {
        loop {
            let (properties, signed) = self.random_properties(rng, body);
            if contract::content_header_frame_len(&properties) > MAX_HEADER_FRAME {
                continue;
            }
            if let Some(forger) = &self.forger {
                let names_target = properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get(header::STATE_TARGET).cloned())
                    == Some(AMQPValue::LongString(forger.target.into()));
                if names_target {
                    forged.target += 1;
                    forged.signed += u64::from(signed);
                }
            }
            return properties;
        }
    }

    /// Random properties, each present or not; values the broker accepts at publish (an
    /// `expiration` that is not a number or a foreign `user_id` would be refused before the
    /// bridge saw them). An adversary's forge bridge state bound for its target in some
    /// (and sign some of those with its own key: true when it did).
    fn random_properties(&self, rng: &mut impl Rng, body: &[u8]) -> (BasicProperties, bool) {
        let forged_target = self.forger.as_ref().map(|f| f.target);
        let mut headers = random_table(rng, 0, forged_target);
        if let Some(target) = forged_target
            && rng.random_bool(0.3)
        {
            forge_state(rng, &mut headers, target);
        }
        let mut p = BasicProperties::default().with_headers(headers);
        if rng.random_bool(0.3) {
            p = p.with_content_type(random_text(rng, 40).as_str().into());
        }
        if rng.random_bool(0.3) {
            p = p.with_priority(rng.random());
        }
        if rng.random_bool(0.3) {
            p = p.with_correlation_id(random_text(rng, 60).as_str().into());
        }
        if rng.random_bool(0.3) {
            p = p.with_expiration(rng.random_range(60_000u32..86_400_000).to_string().into());
        }
        if rng.random_bool(0.3) {
            p = p.with_message_id(random_text(rng, 60).as_str().into());
        }
        if rng.random_bool(0.3) {
            p = p.with_timestamp(rng.random());
        }
        if rng.random_bool(0.3) {
            p = p.with_delivery_mode(rng.random_range(1..=2));
        }
        if rng.random_bool(0.2) {
            p = p.with_user_id(self.user_id.into());
        }
        if rng.random_bool(0.2) {
            p = p.with_reply_to(random_text(rng, 40).as_str().into());
        }
        match &self.forger {
            Some(forger) if rng.random_bool(0.5) => (forger.key.sign(p, body), true),
            _ => (p, false),
        }
    }
}

/// A year, in ms.
const YEAR_MS: i64 = 366 * 86_400_000;

/// Bridge state as a copy in flight carries it, bound for `target`: due soon, entered now
/// or far ahead (where no cancel reaches), as another user, sometimes claiming to be a
/// bundle; with a valid `x-delay` or without.
fn forge_state(rng: &mut impl Rng, headers: &mut FieldTable, target: &str) {
    let now = now_ms() as i64;
    let mut set = |name: &str, value: AMQPValue| {
        headers.insert(name.into(), value);
    };
    set(header::STATE_TARGET, AMQPValue::LongString(target.into()));
    set(
        header::STATE_DELIVER_AT,
        AMQPValue::LongLongInt(now + rng.random_range(0..3_000)),
    );
    let routing_key = match rng.random_range(0..3) {
        0 => "refund.approved".to_string(),
        1 => String::new(),
        _ => random_text(rng, 30),
    };
    set(
        header::STATE_ROUTING_KEY,
        AMQPValue::LongString(routing_key.as_str().into()),
    );
    set(header::STATE_HOPS, AMQPValue::LongLongInt(0));
    set(header::STATE_FIRST_SEEN, AMQPValue::LongLongInt(now));
    let entered = if rng.random_bool(0.5) {
        now
    } else {
        now + 10 * YEAR_MS
    };
    set(header::STATE_ENTERED_AT, AMQPValue::LongLongInt(entered));
    if rng.random_bool(0.3) {
        set(header::STATE_USER_ID, AMQPValue::LongString("admin".into()));
    }
    if rng.random_bool(0.5) {
        set(
            header::DELAY,
            AMQPValue::LongLongInt(rng.random_range(0..3_000)),
        );
    }
    if rng.random_bool(0.2) {
        set(header::BUNDLE, AMQPValue::LongLongInt(1));
    }
}

/// A random table; with `forged_target`, a `delay-bridge-target` in it names that target
/// more often than not.
fn random_table(rng: &mut impl Rng, depth: u32, forged_target: Option<&str>) -> FieldTable {
    let mut table = FieldTable::default();
    for _ in 0..rng.random_range(0..8) {
        // The contract's own names, an empty one, or any other.
        let key = if rng.random_bool(0.5) {
            header::ALL[rng.random_range(0..header::ALL.len())].to_string()
        } else if rng.random_bool(0.05) {
            String::new()
        } else {
            random_text(rng, 20)
        };
        let value = if let Some(target) = forged_target
            && key == header::STATE_TARGET
            && rng.random_bool(0.7)
        {
            AMQPValue::LongString(target.into())
        } else if key == header::CC || key == header::BCC {
            // The broker itself refuses a `CC` or `BCC` that is not an array of strings.
            AMQPValue::FieldArray(FieldArray::from(
                (0..rng.random_range(0..4))
                    .map(|_| AMQPValue::LongString(random_text(rng, 30).as_str().into()))
                    .collect::<Vec<_>>(),
            ))
        } else {
            random_value(rng, depth)
        };
        table.insert(key.as_str().into(), value);
    }
    table
}

fn random_value(rng: &mut impl Rng, depth: u32) -> AMQPValue {
    let kinds = if depth < 3 { 20 } else { 18 };
    match rng.random_range(0..kinds) {
        0 => AMQPValue::Boolean(rng.random()),
        1 => AMQPValue::ShortShortInt(rng.random()),
        2 => AMQPValue::ShortShortUInt(rng.random()),
        3 => AMQPValue::ShortInt(rng.random()),
        4 => AMQPValue::ShortUInt(rng.random()),
        5 => AMQPValue::LongInt(rng.random()),
        6 => AMQPValue::LongUInt(rng.random()),
        7 => AMQPValue::LongLongInt(rng.random()),
        // A delay or due time that lands within the run.
        8 => AMQPValue::LongLongInt(rng.random_range(-2_000..4_000)),
        9 => AMQPValue::LongLongInt((now_ms() + rng.random_range(0..4_000)) as i64),
        // Finite only: RabbitMQ cannot read a NaN or an infinity and closes the publisher's
        // connection.
        10 => AMQPValue::Float(
            Some(f32::from_bits(rng.random()))
                .filter(|f| f.is_finite())
                .unwrap_or(0.5),
        ),
        11 => AMQPValue::Double(
            Some(f64::from_bits(rng.random()))
                .filter(|f| f.is_finite())
                .unwrap_or(0.5),
        ),
        12 => AMQPValue::DecimalValue(DecimalValue {
            scale: rng.random(),
            value: rng.random(),
        }),
        // Not `ShortString`: the client writes it as `s`, which RabbitMQ reads as a 16-bit
        // integer; the broker closes the publisher's connection before the bridge sees it.
        13 => AMQPValue::LongString(random_text(rng, 60).as_str().into()),
        14 => AMQPValue::LongString(number_text(rng).as_str().into()),
        // Huge: one value of up to 48 KiB (a header frame holds 128 KiB).
        15 => AMQPValue::LongString("x".repeat(rng.random_range(0..48 * 1024)).as_str().into()),
        16 => AMQPValue::Timestamp(rng.random()),
        17 => AMQPValue::ByteArray(
            (0..rng.random_range(0..64))
                .map(|_| rng.random())
                .collect::<Vec<u8>>()
                .into(),
        ),
        18 => AMQPValue::FieldArray(FieldArray::from(
            (0..rng.random_range(0..5))
                .map(|_| random_value(rng, depth + 1))
                .collect::<Vec<_>>(),
        )),
        _ => AMQPValue::FieldTable(random_table(rng, depth + 1, None)),
    }
}

/// Text a publisher might send for a number or a time, or anything.
fn number_text(rng: &mut impl Rng) -> String {
    match rng.random_range(0..6) {
        0 => rng.random::<i64>().to_string(),
        1 => rng.random_range(-2_000..4_000).to_string(),
        2 => format!(" {} ", rng.random_range(0..4_000)),
        3 => (now_ms() + rng.random_range(0..4_000)).to_string(),
        4 => chrono::Utc::now().to_rfc3339(),
        _ => random_text(rng, 30),
    }
}

/// Up to `max` random characters (any Unicode scalar, at most 255 bytes in all).
fn random_text(rng: &mut impl Rng, max: usize) -> String {
    let mut text = String::new();
    for _ in 0..rng.random_range(0..=max) {
        let c: char = if rng.random_bool(0.8) {
            rng.random_range(' '..='~')
        } else {
            rng.random()
        };
        if text.len() + c.len_utf8() > 255 {
            break;
        }
        text.push(c);
    }
    text
}
