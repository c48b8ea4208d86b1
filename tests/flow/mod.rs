//! Flow control on one long-running bridge: a few large bodies, or one burst of bundles,
//! narrow a consumer's prefetch window for as long as they need it, never for good. Once
//! they are gone the work and returns consumers are back at `bridge.prefetch` within
//! seconds while small messages flow, and every message arrives once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use delay_bridge::bridge::Stats;
use delay_bridge::clock::now_ms;
use lapin::BasicProperties;
use lapin::types::AMQPValue;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// A message numbered `i`, due at `deliver_at` (epoch ms).
fn numbered(i: usize, deliver_at: u64) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(i.to_string().into())
        .with_headers(headers(vec![(
            "x-deliver-at",
            AMQPValue::LongLongInt(deliver_at as i64),
        )]))
}

/// Both consumers' windows now: (work, returns).
fn windows(stats: &Stats) -> (u64, u64) {
    let counts = stats.snapshot();
    (counts.work_window, counts.returns_window)
}

/// The narrowest windows a bridge's consumers ran with since [`Narrowest::watch`] (sampled
/// every 2 ms: a narrowed window lasts at least as long as a large body is held).
#[derive(Clone)]
struct Narrowest(Arc<std::sync::Mutex<(u64, u64)>>);

impl Narrowest {
    /// Samples `stats`' windows until the test ends.
    fn watch(stats: &Arc<Stats>) -> Self {
        let narrowest = Narrowest(Arc::new(std::sync::Mutex::new((u64::MAX, u64::MAX))));
        let (weak, stats) = (Arc::downgrade(&narrowest.0), stats.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(2));
            // Ends once the test dropped its `Narrowest`.
            while let Some(shared) = weak.upgrade() {
                let (work, returns) = windows(&stats);
                {
                    let mut seen = shared.lock().unwrap();
                    // A window of 0 is a session between consumers.
                    if work > 0 {
                        seen.0 = seen.0.min(work);
                    }
                    if returns > 0 {
                        seen.1 = seen.1.min(returns);
                    }
                }
                drop(shared);
                tick.tick().await;
            }
        });
        narrowest
    }

    /// (work, returns).
    fn get(&self) -> (u64, u64) {
        *self.0.lock().unwrap()
    }
}

/// Publishes small messages numbered from `*next`, `per_tick` every 100 ms, each due
/// `delay(i)` ms after its publish, until both windows are `prefetch` (true) or `within`
/// passed (false). Waits for the windows on the publisher's pace, not on a fixed sleep.
async fn small_flow_until_windows_are(
    w: &World,
    stats: &Arc<Stats>,
    prefetch: u64,
    next: &mut usize,
    per_tick: usize,
    delay: impl Fn(usize) -> u64,
    within: Duration,
) -> bool {
    let deadline = Instant::now() + within;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while Instant::now() < deadline {
        tick.tick().await;
        if windows(stats) == (prefetch, prefetch) {
            return true;
        }
        for _ in 0..per_tick {
            let i = *next;
            *next += 1;
            w.publish("rk.small", b"small", numbered(i, now_ms() + delay(i)))
                .await;
        }
    }
    false
}

/// Publishes messages `0..n` with `body`, all due at `deliver_at`, with their confirms in
/// flight together (as a burst comes), and checks every confirm.
async fn publish_burst(w: &World, n: usize, body: &[u8], deliver_at: u64) {
    let confirms = futures::future::join_all((0..n).map(|i| {
        w.publisher.basic_publish(
            w.ingress.as_str().into(),
            "rk.burst".into(),
            lapin::options::BasicPublishOptions::default(),
            body,
            numbered(i, deliver_at),
        )
    }))
    .await;
    for confirm in futures::future::join_all(confirms.into_iter().map(|c| c.unwrap())).await {
        assert!(confirm.unwrap().is_ack(), "burst publish confirmed");
    }
}

/// Checks that messages `0..n` each arrived exactly once.
fn assert_once_each(received: &[Received], n: usize) {
    let mut seen: HashMap<usize, u32> = HashMap::new();
    for m in received {
        *seen.entry(numeric_id(m)).or_default() += 1;
    }
    let missing: Vec<usize> = (0..n).filter(|i| !seen.contains_key(i)).collect();
    let twice: Vec<usize> = seen
        .iter()
        .filter(|(_, count)| **count > 1)
        .map(|(id, _)| *id)
        .collect();
    assert!(
        missing.is_empty() && twice.is_empty() && seen.len() == n,
        "of {n}: missing {missing:?}, twice {twice:?}"
    );
}

/// Three bodies of 256 KiB with a byte budget of 1 MiB per queue narrow both windows to
/// the four such bodies that fit. Then small messages only: both windows are back at
/// `bridge.prefetch` within seconds. (Before, the window kept fitting the largest body it
/// had seen while it was being narrowed, for good: a prefetch of 4 for every small message
/// after three large ones.)
#[tokio::test]
async fn after_large_bodies_both_windows_widen_back_to_prefetch() {
    const BODY: usize = 256 << 10;
    const PREFETCH: u64 = 4000;
    let mut w = World::start(Setup {
        max_unacked_bytes: Some(2 << 20),
        ..Setup::new("flow-large")
    })
    .await;
    let stats = w.stats();
    let mut next = 0;
    // The bridge starts narrow; a flow of small messages widens it.
    assert!(
        small_flow_until_windows_are(&w, &stats, PREFETCH, &mut next, 40, |_| 300, 20 * SEC).await,
        "small messages widen both windows to prefetch: {:?}",
        windows(&stats)
    );
    // Three large bodies back to back, due together: they pass through both queues.
    let due = now_ms() + 700;
    for _ in 0..3 {
        w.publish("rk.large", &vec![b'L'; BODY], numbered(next, due))
            .await;
        next += 1;
    }
    let narrowest = Narrowest::watch(&stats);
    {
        let narrowest = narrowest.clone();
        wait_until(
            "both windows narrowed for the large bodies",
            10 * SEC,
            move || {
                let (work, returns) = narrowest.get();
                work <= 4 && returns <= 4
            },
        )
        .await;
    }
    // Small messages only, from now on.
    let back = small_flow_until_windows_are(
        &w,
        &stats,
        PREFETCH,
        &mut next,
        40,
        |i| 200 + (i % 5) as u64 * 100,
        15 * SEC,
    )
    .await;
    let (work, returns) = windows(&stats);
    let received = w.recv_n(next, 30 * SEC).await;
    assert_once_each(&received, next);
    assert!(
        back,
        "both windows back at prefetch {PREFETCH} after the large bodies: work {work}, returns {returns} (narrowest {:?})",
        narrowest.get()
    );
    assert!(
        stats.snapshot().max_unacked_bytes_seen <= 2 << 20,
        "within the byte budget: {:?}",
        stats.snapshot()
    );
    w.cleanup().await;
}

/// A bridge that bundles its hops takes a burst of 3 000 messages of 2 KiB due at one
/// instant: the burst comes back from the level as full bundles (1 MiB), which narrow the
/// returns window to the few such bundles that fit. Then a steady flow of small bundles:
/// both windows are back at `bridge.prefetch` within seconds, held messages go back to
/// none, and every message arrives once. (Before, the returns window stayed narrow for
/// good, and held bundles filled it.)
#[tokio::test]
async fn after_a_burst_of_bundles_both_windows_widen_back_to_prefetch() {
    const BURST: usize = 3_000;
    const PREFETCH: u64 = 100;
    let mut w = World::start(Setup {
        ladder: "1s 2s",
        margin: Duration::from_millis(100),
        hop_window: Some(Duration::from_millis(200)),
        bundle_hops: Some(true),
        prefetch: PREFETCH as u32,
        // 12 MiB for each queue: the whole burst fits (so the bridge narrows the window
        // without pausing), but only a few of its bundles (up to 1 MiB of bodies each).
        max_unacked_bytes: Some(24 << 20),
        ..Setup::new("flow-burst")
    })
    .await;
    let stats = w.stats();
    let narrowest = Narrowest::watch(&stats);
    let due = now_ms() + 3_500;
    // Published with confirms in flight together, as a burst comes: most windows then
    // bundle more than 1 MiB of bodies, and their bundles are full ones.
    publish_burst(&w, BURST, &[b'b'; 2048], due).await;
    let mut burst = w.recv_n(BURST, 30 * SEC).await;
    let narrowed = narrowest.get().1;
    println!(
        "burst: returns window narrowed to {narrowed}; {:?}",
        stats.snapshot()
    );
    assert!(
        narrowed <= PREFETCH / 2,
        "the burst's bundles narrowed the returns window: {narrowed}"
    );
    let mut next = BURST;
    let back = small_flow_until_windows_are(
        &w,
        &stats,
        PREFETCH,
        &mut next,
        2,
        |i| 1_300 + (i % 7) as u64 * 100,
        15 * SEC,
    )
    .await;
    let (work, returns) = windows(&stats);
    burst.extend(w.recv_n(next - BURST, 30 * SEC).await);
    assert_once_each(&burst, next);
    assert!(
        back,
        "both windows back at prefetch {PREFETCH} after the burst: work {work}, returns {returns}"
    );
    let held = stats.clone();
    wait_until("nothing held once everything arrived", 5 * SEC, move || {
        held.snapshot().held == 0
    })
    .await;
    w.cleanup().await;
}

/// A bridge bundling in 100-ms windows, levels 1 s and 2 s.
fn bundling(name: &str) -> Setup<'_> {
    Setup {
        ladder: "1s 2s",
        margin: Duration::from_millis(100),
        hop_window: Some(Duration::from_millis(100)),
        bundle_hops: Some(true),
        ..Setup::new(name)
    }
}

/// A bridge bundling in 100-ms windows (levels 1 s and 2 s), whose target copies each message
/// to 15 queues besides its own, so that the broker, not the bridge, sets the pace (as a
/// busy broker does in production).
async fn busy_bundling_world(name: &str) -> World {
    const FANOUT: usize = 15;
    let mut w = World::start(Setup {
        prefetch: 1000,
        // The tests on this world judge an order under a burst: alone.
        alone: true,
        ..bundling(name)
    })
    .await;
    let target = w.sandbox.target.clone();
    for copy in 0..FANOUT {
        let queue = format!("{}.copy-{copy}", w.sandbox.prefix());
        w.declare_bound_queue(&queue, &target, "rk.#").await;
    }
    w
}

/// A bundling bridge takes a burst of 8 000 messages due at one instant; from that
/// instant on, one message every 10 ms, each due a moment after it is published, until the
/// whole burst arrived. They pass the burst: the messages of bundles publish to their
/// targets in turns (`bridge::turns`), so one due later waits behind at most a turn's worth
/// of the burst, not behind all of it. The target queue keeps the order the bridge
/// published in, so the test reads, from the order of arrival, the longest run of the
/// burst's messages that no later message broke. (Before, each bundle of the burst was
/// written to the target's channel whole at its due instant: runs of 1 247 and 1 267 in two
/// runs, behind which the later messages queued; with turns, at most 249.)
#[tokio::test]
async fn messages_due_after_a_burst_pass_it() {
    const BURST: usize = 8_000;
    const MOST_LATER: usize = 500;
    let mut w = busy_bundling_world("flow-pass").await;
    let due = now_ms() + 3_000;
    publish_burst(&w, BURST, &[b'b'; 16], due).await;
    // The later messages, each due 5 ms after it is published (below every level: the
    // bridge reads it and waits it out), until the burst arrived.
    let burst_arrived = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let later = {
        let (channel, ingress, done) = (
            w.publisher.clone(),
            w.ingress.clone(),
            burst_arrived.clone(),
        );
        let start = tokio::time::Instant::now() + Duration::from_millis(due - now_ms());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(start, Duration::from_millis(10));
            // Confirms are awaited at the end: waiting for each would space them out as
            // the broker slows down under the burst.
            let mut confirms = Vec::new();
            while confirms.len() < MOST_LATER && !done.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                let id = BURST + confirms.len();
                let confirm = channel
                    .basic_publish(
                        ingress.as_str().into(),
                        "rk.later".into(),
                        lapin::options::BasicPublishOptions::default(),
                        b"later",
                        numbered(id, now_ms() + 5),
                    )
                    .await
                    .unwrap();
                confirms.push(confirm);
            }
            let sent = confirms.len();
            for confirm in futures::future::join_all(confirms).await {
                assert!(confirm.unwrap().is_ack(), "later publish confirmed");
            }
            sent
        })
    };
    let mut ids = Vec::new();
    while ids.iter().filter(|id| **id < BURST).count() < BURST {
        let m = w.recv_within(30 * SEC).await;
        ids.push(numeric_id(&m));
    }
    burst_arrived.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = later.await.unwrap();
    for m in w.recv_n(BURST + sent - ids.len(), 10 * SEC).await {
        ids.push(numeric_id(&m));
    }
    let mut seen = ids.clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(
        (seen.len(), ids.len()),
        (BURST + sent, BURST + sent),
        "each arrived once"
    );
    // Runs of burst messages between two later ones, from the first later one on.
    let first_later = ids.iter().position(|id| *id >= BURST).unwrap();
    // Runs closed by a later message: the burst messages after the last later one had
    // none left to let by (the later messages stop after MOST_LATER).
    let last_later = ids.iter().rposition(|id| *id >= BURST).unwrap();
    let runs: Vec<usize> = ids[first_later..last_later]
        .split(|id| *id >= BURST)
        .map(<[usize]>::len)
        .filter(|run| *run > 0)
        .collect();
    let longest = runs.iter().copied().max().unwrap_or(0);
    println!(
        "{sent} later messages; burst messages before the first {first_later}, then in runs of {runs:?}, then {}",
        ids.len() - 1 - last_later
    );
    assert!(
        longest <= BURST / 12,
        "later messages pass the burst: the longest run of burst messages none passed is {longest} ({runs:?})"
    );
    w.cleanup().await;
}

/// Messages due a moment after a burst's instant, published among the burst's messages so
/// that they travel in the burst's own bundles, pass the burst too: a bundle's messages
/// take turns by due instant (a lane per instant), so one due later waits for a turn of the
/// burst's lane, not behind every burst message its bundle holds. Every bundle of the burst
/// holds later messages, all due within 40 ms of the burst's instant: with one lane per
/// bundle, the last of them arrived behind nearly the whole burst (its bundle's lane
/// finished last); with a lane per instant, behind what the broker takes in 40 ms.
#[tokio::test]
async fn messages_due_after_a_burst_in_its_bundles_pass_it() {
    const BURST: usize = 8_000;
    const EVERY: usize = 100;
    const LATER: usize = BURST / EVERY;
    let mut w = busy_bundling_world("flow-pass-bundled").await;
    let due = now_ms() + 3_000;
    // After every EVERY-th burst message one later message, due 20-40 ms after the
    // burst's instant.
    let messages: Vec<(usize, u64)> = (0..BURST)
        .flat_map(|i| {
            let later = (i % EVERY == EVERY - 1).then(|| {
                let j = i / EVERY;
                (BURST + j, due + 20 + (j * 20 / LATER) as u64)
            });
            std::iter::once((i, due)).chain(later)
        })
        .collect();
    let confirms = futures::future::join_all(messages.iter().map(|(id, deliver_at)| {
        w.publisher.basic_publish(
            w.ingress.as_str().into(),
            "rk.burst".into(),
            lapin::options::BasicPublishOptions::default(),
            b"burst",
            numbered(*id, *deliver_at),
        )
    }))
    .await;
    for confirm in futures::future::join_all(confirms.into_iter().map(|c| c.unwrap())).await {
        assert!(confirm.unwrap().is_ack(), "publish confirmed");
    }
    assert!(
        now_ms() + 1_000 < due,
        "published well before the due instant"
    );
    let received = w.recv_n(BURST + LATER, 60 * SEC).await;
    assert_once_each(&received, BURST + LATER);
    let ids: Vec<usize> = received.iter().map(numeric_id).collect();
    let first_later = ids.iter().position(|id| *id >= BURST).unwrap();
    let last_later = ids.iter().rposition(|id| *id >= BURST).unwrap();
    let before_last = last_later + 1 - LATER;
    println!(
        "burst messages before the first later one {first_later}, before the last {before_last}"
    );
    assert!(
        before_last <= BURST / 3,
        "later messages in the burst's bundles pass it: {before_last} of {BURST} burst messages arrived before the last of them"
    );
    w.cleanup().await;
}

/// A burst publishes to its target on a channel of its own. Its messages publish in turns
/// (at most a turn's width at once); were they on the target's one channel, a message due
/// meanwhile would, once it has its turn, still wait behind those in the broker's channel.
/// Here 2 000 messages are due at one instant and one more 50 ms later, all to one target:
/// the broker counts the bridge's publishes per channel, and the channel that carried the
/// most (the burst's, or most of it: a bundle may end with a few of its messages, which
/// publish as others do) carried at most the burst. Before, one channel carried all 2 001.
/// (The bridge's own channel carries its hops, a few bundles.)
#[tokio::test]
async fn a_burst_publishes_to_its_target_on_a_channel_of_its_own() {
    const BURST: u64 = 2_000;
    let mut w = World::start(bundling("flow-bulk")).await;
    let due = now_ms() + 3_000;
    publish_burst(&w, BURST as usize, b"burst", due).await;
    w.publish("rk.later", b"later", numbered(BURST as usize, due + 50))
        .await;
    let received = w.recv_n(BURST as usize + 1, 30 * SEC).await;
    assert_once_each(&received, BURST as usize + 1);
    let publisher = format!("delay-bridge {} publisher", w.config.names.prefix());
    // The broker samples each channel's statistics every 5 s: the counts are final once two
    // readings more than that apart agree and hold every delivery.
    let deadline = Instant::now() + 60 * SEC;
    let mut last = Vec::new();
    let counts = loop {
        let counts = published_per_channel(&publisher).await;
        let complete = counts.iter().sum::<u64>() > BURST;
        if (complete && counts == last) || Instant::now() > deadline {
            break counts;
        }
        last = counts;
        tokio::time::sleep(Duration::from_secs(6)).await;
    };
    assert!(
        counts.iter().sum::<u64>() > BURST,
        "the broker counted every delivery: {counts:?}"
    );
    assert!(
        counts[0] >= BURST / 2 && counts[0] <= BURST,
        "the burst on a channel of its own, without the later message: {counts:?}"
    );
    w.cleanup().await;
}
