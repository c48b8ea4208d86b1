//! Schedule, reschedule and cancel with the typed client, against a bridge run in process.
//!
//! ```sh
//! bash scripts/broker.sh   # a local RabbitMQ on 127.0.0.1:5672
//! cargo run --example schedule_and_cancel
//! ```
//!
//! Set `DELAY_BRIDGE_URL` to use another broker. Everything it declares is named from a
//! random prefix and deleted at the end.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use delay_bridge::bridge::Bridge;
use delay_bridge::client::{Client, Message, When};
use delay_bridge::config::Config;
use delay_bridge::topology::Topology;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<()> {
    let url = std::env::var("DELAY_BRIDGE_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let prefix = format!("example-{:06x}", rand::random::<u32>() & 0xff_ffff);
    let ingress = format!("{prefix}.in");
    let config = Config::from_toml(
        &format!(
            "[broker]\nurl = \"{url}\"\n[topology]\nprefix = \"{prefix}\"\n\
             [[route]]\ningress = \"{ingress}\"\ntarget = \"amq.direct\"\n"
        ),
        "<example>",
        &[],
    )?;

    // Where due messages land: a temporary queue bound to amq.direct.
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .context("is RabbitMQ running? try: bash scripts/broker.sh")?;
    let channel = conn.create_channel().await?;
    let queue = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            queue.name().clone(),
            "amq.direct".into(),
            prefix.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut arrivals = channel
        .basic_consume(
            queue.name().clone(),
            "example".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;

    // The bridge, in process, as `delay-bridge run` would run it.
    let bridge = Bridge::new(config.clone());
    let mut ready = bridge.ready();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(bridge.run(shutdown.clone()));
    ready.wait_for(|r| *r).await?;

    let client = Client::connect(&url, &prefix).await?;
    let start = Instant::now();
    let message = |id: &str| {
        Message::new(ingress.as_str(), prefix.as_str(), id.as_bytes().to_vec()).with_message_id(id)
    };
    for (id, secs) in [("reminder", 2), ("payment-retry", 3), ("publish-post", 4)] {
        let s = client
            .schedule(message(id), When::After(Duration::from_secs(secs)))
            .await?;
        println!("scheduled  {:<14} in {secs}s", s.message_id);
    }
    client
        .reschedule(message("publish-post"), When::After(Duration::from_secs(1)))
        .await?;
    println!("rescheduled publish-post   to 1s");
    client.cancel("payment-retry").await?;
    println!("cancelled  payment-retry");

    for _ in 0..2 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), arrivals.next())
            .await
            .context("no arrival within 10 s")?
            .context("consumer ended")??;
        println!(
            "arrived    {:<14} after {:.2}s",
            String::from_utf8_lossy(&delivery.data),
            start.elapsed().as_secs_f64()
        );
    }
    // payment-retry was due at 3 s: give it until 4 s to show it does not come.
    match tokio::time::timeout(
        Duration::from_secs(4).saturating_sub(start.elapsed()),
        arrivals.next(),
    )
    .await
    {
        Err(_) => println!("payment-retry never arrived (cancelled)"),
        Ok(other) => anyhow::bail!("unexpected arrival: {other:?}"),
    }

    client.close().await?;
    shutdown.cancel();
    running.await??;
    Topology::from_config(&config).delete(&conn).await?;
    conn.close(200, "example done".into()).await?;
    Ok(())
}
