//! A recurring schedule with the typed client, against a bridge run in process: three
//! occurrences on time, then a cancel, and none after it.
//!
//! ```sh
//! bash scripts/broker.sh   # a local RabbitMQ on 127.0.0.1:5672
//! cargo run --example recurring
//! ```
//!
//! Set `DELAY_BRIDGE_URL` to use another broker. Everything it declares is named from a
//! random prefix and deleted at the end.

use std::time::Duration;

use anyhow::{Context, Result};
use delay_bridge::client::{Client, Message, Repeat};
use delay_bridge::clock::now_ms;
use delay_bridge::recurring::header;
use delay_bridge::sandbox::{Sandbox, TargetBinding, base_config, watch_queue};
use lapin::types::AMQPValue;

#[tokio::main]
async fn main() -> Result<()> {
    // The defaults, with DELAY_BRIDGE_URL as the broker when it is set.
    let base = base_config(None)?;
    let sandbox = Sandbox::start(&base, "recurring", TargetBinding::Fanout).await?;
    let mut arrivals = watch_queue(&sandbox.conn, &sandbox.target_queue).await?;
    let client = Client::connect(sandbox.config.url().expose(), sandbox.prefix()).await?;

    let heartbeat = Message::new(sandbox.ingress.as_str(), "heartbeat", b"ping".to_vec())
        .with_message_id("heartbeat");
    let scheduled = client
        .schedule_every(heartbeat, Duration::from_secs(1), Repeat::default())
        .await?;
    println!(
        "scheduled  heartbeat every 1s, first in {} ms",
        scheduled.deliver_at.saturating_sub(now_ms())
    );
    let number = |name: &str, d: &delay_bridge::sandbox::Received| match d.header(name) {
        Some(AMQPValue::LongLongInt(v)) => *v as u64,
        _ => 0,
    };
    for _ in 0..3 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), arrivals.recv())
            .await
            .context("no occurrence within 10 s")?
            .context("consumer ended")?;
        let due = number(header::OCCURRENCE_DUE, &delivery);
        println!(
            "arrived    heartbeat occurrence {} ({} ms after its due time)",
            number(header::OCCURRENCE, &delivery),
            delivery.at_ms as i64 - due as i64
        );
    }
    client.cancel("heartbeat").await?;
    let cancelled_at = now_ms();
    println!("cancelled  heartbeat");
    // What was already on its way may still arrive within a moment; then nothing.
    let quiet = Duration::from_secs(4);
    let until = tokio::time::Instant::now() + quiet;
    loop {
        match tokio::time::timeout_at(until, arrivals.recv()).await {
            Err(_) => break,
            Ok(Some(late)) if late.at_ms < cancelled_at + 500 => println!(
                "arrived    heartbeat occurrence {} (on its way at the cancel)",
                number(header::OCCURRENCE, &late)
            ),
            Ok(other) => anyhow::bail!("an occurrence after the cancel: {other:?}"),
        }
    }
    println!("none in the {}s after the cancel", quiet.as_secs());

    client.close().await?;
    sandbox.finish().await?;
    Ok(())
}
