//! The relay on lapin, the bridge's client: consume, publish each delivery (mandatory,
//! persistent) on a confirm-mode channel, and ack it once the broker confirmed.

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use lapin::Confirmation;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::task::JoinSet;

use delay_bridge::amqp;
use delay_bridge::config::BrokerUrl;

use super::job::{ChildArgs, ChildReport, SelfUsage};

/// Relays `job.count` deliveries; calls `ready` once consuming.
pub async fn relay(url: &BrokerUrl, job: &ChildArgs, ready: impl FnOnce()) -> Result<ChildReport> {
    let connection = amqp::connect(url, "delay-bridge bench relay (lapin)").await?;
    let consuming = connection.create_channel().await?;
    consuming
        .basic_qos(job.prefetch, BasicQosOptions::default())
        .await?;
    let publishing = amqp::confirm_channel(&connection).await?;
    let mut deliveries = consuming
        .basic_consume(
            job.from.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    ready();
    let mut acks = JoinSet::new();
    let mut first = None;
    for _ in 0..job.count {
        let delivery = deliveries.next().await.context("the consumer ended")??;
        if first.is_none() {
            first = Some(SelfUsage::now()?);
        }
        let confirm = publishing
            .basic_publish(
                "".into(),
                job.to.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                delivery.properties.clone(),
            )
            .await?;
        acks.spawn(async move {
            match confirm.await? {
                Confirmation::Ack(None) => {}
                other => bail!("a relayed publish was not confirmed: {other:?}"),
            }
            delivery.acker.ack(BasicAckOptions::default()).await?;
            Ok(())
        });
    }
    while let Some(acked) = acks.join_next().await {
        acked??;
    }
    let end = SelfUsage::now()?;
    let _ = connection.close(200, "relayed".into()).await;
    Ok(first.context("nothing to relay")?.until(&end, job.count))
}
