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
use delay_bridge::client::{Client, Message, When};
use delay_bridge::sandbox::{Sandbox, TargetBinding, base_config, watch_queue};

#[tokio::main]
async fn main() -> Result<()> {
    // The defaults, with DELAY_BRIDGE_URL as the broker when it is set.
    let base = base_config(None)?;
    // A throw-away prefix, one route, a target exchange with one queue, and the bridge in
    // process, as `delay-bridge run` would run it.
    let sandbox = Sandbox::start(&base, "example", TargetBinding::Fanout).await?;
    let mut arrivals = watch_queue(&sandbox.conn, &sandbox.target_queue).await?;

    let client = Client::connect(sandbox.config.url().expose(), sandbox.prefix()).await?;
    let start = Instant::now();
    let message = |id: &str| {
        Message::new(sandbox.ingress.as_str(), "any-key", id.as_bytes().to_vec())
            .with_message_id(id)
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
        let delivery = tokio::time::timeout(Duration::from_secs(10), arrivals.recv())
            .await
            .context("no arrival within 10 s")?
            .context("consumer ended")?;
        println!(
            "arrived    {:<14} after {:.2}s",
            String::from_utf8_lossy(&delivery.body),
            start.elapsed().as_secs_f64()
        );
    }
    // payment-retry was due at 3 s: give it until 4 s to show it does not come.
    match tokio::time::timeout(
        Duration::from_secs(4).saturating_sub(start.elapsed()),
        arrivals.recv(),
    )
    .await
    {
        Err(_) => println!("payment-retry never arrived (cancelled)"),
        Ok(other) => anyhow::bail!("unexpected arrival: {other:?}"),
    }

    client.close().await?;
    sandbox.finish().await?;
    Ok(())
}
