//! `fuzz`: messages with random header tables (every AMQP field type, nested, empty and
//! huge values, odd values of `x-delay`, `x-deliver-at` and `x-published-at`, the bridge's
//! own header names) and random properties, through a real bridge. Every message must end
//! delivered or parked with a reason; the bridge must neither panic nor lose its connection.
//! The bridge's `max_delay` is 10 s here, so a random far due time is parked
//! `delay-too-long` instead of outliving the run.

use std::time::Duration;

use anyhow::Result;
use delay_bridge_bench::report;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, DecimalValue, FieldArray, FieldTable};
use rand::Rng;

use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::contract::{self, header};
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use super::traffic::{FaultCollector, Sent};
use super::{Tally, read_parked};
use crate::Target;
use crate::load::{Outgoing, body, publish};

/// `fuzz` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages to send.
    #[arg(long, default_value_t = 2000)]
    count: u64,
}

/// The bridge's longest delay in this scenario.
const MAX_DELAY: Duration = Duration::from_secs(10);

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    anyhow::ensure!(args.count > 0, "--count must be > 0");
    let mut config = base.clone();
    config.max_delay = MAX_DELAY;
    let mut sandbox =
        Sandbox::declare(&config, "delay-bridge-faults-fuzz", TargetBinding::Fanout).await?;
    sandbox.run_in_process().await?;
    let result = measure(&sandbox, args).await;
    let stats = sandbox.stats().map(|s| s.snapshot());
    // A bridge that panicked or stopped makes this fail.
    let stopped = sandbox.finish().await;
    let tally = result?;
    let reconnects = stats.map_or(0, |s| s.reconnects);
    let unexplained = tally.parked.by_reason.get("(none)").copied().unwrap_or(0);
    let targets = [
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
    tally.print(
        &[format!(
            "{} messages with random headers and properties, max_delay {}s",
            args.count,
            MAX_DELAY.as_secs()
        )],
        &targets,
        report::FaultDone {
            bridge_reconnects: Some(reconnects),
            ..Default::default()
        },
    );
    Ok(())
}

async fn measure(sandbox: &Sandbox, args: &Args) -> Result<Tally> {
    let urls = sandbox.config.urls.clone();
    let collector = FaultCollector::start(urls.clone(), sandbox.target_queue.clone(), args.count);
    let channel = crate::load::confirm_channel(&sandbox.conn).await?;
    let ingress = sandbox.ingress.clone();
    let mut rng = rand::rng();
    let published = publish(&channel, args.count, None, |seq| Outgoing {
        exchange: ingress.as_str().into(),
        routing_key: "fuzz".into(),
        body: body(seq, 0, 16),
        properties: within_a_frame(&mut rng),
    })
    .await?;
    let _ = channel.close(200, "published".into()).await;
    let parked_queue = sandbox.config.names.parked_queue();
    // Everything is delivered or parked within the longest delay plus a margin: wait for
    // the delivered ones, then read what was parked.
    let deadline = tokio::time::Instant::now() + MAX_DELAY + Duration::from_secs(30);
    let delivered_by = async {
        loop {
            let parked = sandbox.counts(&parked_queue).await?.messages;
            if collector.delivered() + parked >= args.count
                || tokio::time::Instant::now() > deadline
            {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    delivered_by.await?;
    let seen = collector
        .finish(
            args.count,
            tokio::time::Instant::now(),
            Duration::from_secs(2),
        )
        .await?;
    let parked = read_parked(&urls, &parked_queue, args.count).await?;
    Ok(Tally {
        scenario: "fuzz",
        count: args.count,
        sent: Sent {
            confirmed: args.count,
            rate: args.count as f64 * 1e6
                / published
                    .confirmed_us
                    .saturating_sub(published.started_us)
                    .max(1) as f64,
            ..Sent::default()
        },
        seen,
        parked,
    })
}

/// The largest content header the fuzz sends: under the broker's 128 KiB frame (a larger
/// one costs the publisher its connection before the bridge sees it), with room left for
/// the bridge's own headers, which may push it over (that is then the bridge's to park).
const MAX_HEADER_FRAME: usize = 120 * 1024;

/// Random properties whose content header fits [`MAX_HEADER_FRAME`].
fn within_a_frame(rng: &mut impl Rng) -> BasicProperties {
    loop {
        let properties = random_properties(rng);
        if contract::content_header_frame_len(&properties) <= MAX_HEADER_FRAME {
            return properties;
        }
    }
}

/// Random properties, each present or not; values the broker accepts at publish (an
/// `expiration` that is not a number or a foreign `user_id` would be refused before the
/// bridge saw them).
fn random_properties(rng: &mut impl Rng) -> BasicProperties {
    let mut p = BasicProperties::default().with_headers(random_table(rng, 0));
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
        p = p.with_user_id("guest".into());
    }
    if rng.random_bool(0.2) {
        p = p.with_reply_to(random_text(rng, 40).as_str().into());
    }
    p
}

fn random_table(rng: &mut impl Rng, depth: u32) -> FieldTable {
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
        let value = if key == header::CC || key == header::BCC {
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
        _ => AMQPValue::FieldTable(random_table(rng, depth + 1)),
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
