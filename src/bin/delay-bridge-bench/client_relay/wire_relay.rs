//! The relay on the library's own connection (`delay_bridge::amqp::wire`), shaped as the
//! lapin relay is: consume on one channel, publish each delivery (mandatory, persistent) on
//! a confirm-mode channel, and ack it from a task of its own once the broker confirmed.
//! What the bridge's data path would cost on that connection.

use anyhow::{Context, Result, bail};
use lapin::types::FieldTable;
use tokio::task::JoinSet;

use delay_bridge::amqp::wire::{Confirm, Connection};
use delay_bridge::config::BrokerUrl;

use super::job::{ChildArgs, ChildReport, SelfUsage};

/// Relays `job.count` deliveries; calls `ready` once consuming.
pub async fn relay(url: &BrokerUrl, job: &ChildArgs, ready: impl FnOnce()) -> Result<ChildReport> {
    let connection = Connection::open(
        url,
        "delay-bridge bench relay (wire)",
        std::time::Duration::from_secs(60),
    )
    .await?;
    let consuming = connection.open_channel().await?;
    consuming.qos(job.prefetch).await?;
    let publishing = connection.open_channel().await?;
    publishing.confirm_select().await?;
    let mut deliveries = consuming
        .consume(&job.from, "", FieldTable::default())
        .await?;
    ready();
    let mut acks = JoinSet::new();
    let mut first = None;
    for _ in 0..job.count {
        let delivery = deliveries.next().await?.context("the consumer ended")?;
        if first.is_none() {
            first = Some(SelfUsage::now()?);
        }
        let confirm =
            publishing.publish("", &job.to, true, &delivery.properties, &delivery.data)?;
        let consuming = consuming.clone();
        acks.spawn(async move {
            match confirm.await? {
                Confirm::Ack => {}
                other => bail!("a relayed publish was not confirmed: {other:?}"),
            }
            consuming.ack([(delivery.delivery_tag, false)])?;
            Ok(())
        });
    }
    while let Some(acked) = acks.join_next().await {
        acked??;
    }
    let end = SelfUsage::now()?;
    connection.close().await;
    Ok(first.context("nothing to relay")?.until(&end, job.count))
}
