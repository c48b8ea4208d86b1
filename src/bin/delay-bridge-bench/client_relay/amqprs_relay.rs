//! The same relay on amqprs, whose reader and writer run as tasks on the caller's runtime:
//! consume, publish each delivery (mandatory, persistent) in confirm mode, and ack it once
//! the broker confirmed. amqprs reports confirms to a channel callback by sequence number;
//! [`Confirms`] hands each to the publish it answers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use amqprs::callbacks::ChannelCallback;
use amqprs::channel::{
    BasicAckArguments, BasicConsumeArguments, BasicPublishArguments, BasicQosArguments, Channel,
    ConfirmSelectArguments,
};
use amqprs::connection::{Connection, OpenConnectionArguments};
use amqprs::{Ack, BasicProperties, Cancel, CloseChannel, Nack, Return};
use anyhow::{Context, Result, bail};
use lapin::uri::AMQPUri;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use delay_bridge::config::BrokerUrl;

use super::job::{ChildArgs, ChildReport, SelfUsage};

/// Publishes waiting for their confirm, by publish sequence number: `true` for an ack,
/// `false` for a nack or a return.
type Waiting = Arc<Mutex<BTreeMap<u64, oneshot::Sender<bool>>>>;

/// The confirm-mode channel's callback: settles the waiting publishes.
struct Confirms(Waiting);

impl Confirms {
    fn settle(&self, sequence: u64, multiple: bool, confirmed: bool) {
        let mut waiting = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let settled = if multiple {
            let later = waiting.split_off(&(sequence + 1));
            std::mem::replace(&mut *waiting, later)
        } else {
            waiting.remove_entry(&sequence).into_iter().collect()
        };
        for (_, publish) in settled {
            let _ = publish.send(confirmed);
        }
    }
}

#[async_trait::async_trait]
impl ChannelCallback for Confirms {
    async fn close(&mut self, _: &Channel, _: CloseChannel) -> Result<(), amqprs::error::Error> {
        Ok(())
    }
    async fn cancel(&mut self, _: &Channel, _: Cancel) -> Result<(), amqprs::error::Error> {
        Ok(())
    }
    async fn flow(&mut self, _: &Channel, active: bool) -> Result<bool, amqprs::error::Error> {
        Ok(active)
    }
    async fn publish_ack(&mut self, _: &Channel, ack: Ack) {
        self.settle(ack.delivery_tag(), ack.mutiple(), true);
    }
    async fn publish_nack(&mut self, _: &Channel, nack: Nack) {
        self.settle(nack.delivery_tag(), nack.multiple(), false);
    }
    async fn publish_return(&mut self, _: &Channel, _: Return, _: BasicProperties, _: Vec<u8>) {
        // The ack that follows a return settles its publish; a relay to an existing queue
        // is never returned, and the count check of the scenario would show one.
        tracing::warn!("a relayed publish was returned");
    }
}

/// Relays `job.count` deliveries; calls `ready` once consuming.
pub async fn relay(url: &BrokerUrl, job: &ChildArgs, ready: impl FnOnce()) -> Result<ChildReport> {
    let uri: AMQPUri = url
        .expose()
        .parse()
        .map_err(|e| anyhow::anyhow!("the broker URL: {e}"))?;
    if uri.scheme != lapin::uri::AMQPScheme::AMQP {
        bail!("the amqprs relay speaks plain amqp:// only");
    }
    let mut arguments = OpenConnectionArguments::new(
        &uri.authority.host,
        uri.authority.port,
        &uri.authority.userinfo.username,
        &uri.authority.userinfo.password,
    );
    arguments.virtual_host(&uri.vhost);
    let connection = Connection::open(&arguments).await?;
    let consuming = connection.open_channel(None).await?;
    consuming
        .basic_qos(BasicQosArguments::new(0, job.prefetch, false))
        .await?;
    let publishing = connection.open_channel(None).await?;
    let waiting = Waiting::default();
    publishing
        .register_callback(Confirms(waiting.clone()))
        .await?;
    publishing
        .confirm_select(ConfirmSelectArguments::default())
        .await?;
    let (_tag, mut deliveries) = consuming
        .basic_consume_rx(BasicConsumeArguments::new(&job.from, ""))
        .await?;
    ready();
    let mut acks = JoinSet::new();
    let mut first = None;
    for sequence in 1..=job.count {
        let delivery = deliveries.recv().await.context("the consumer ended")?;
        if first.is_none() {
            first = Some(SelfUsage::now()?);
        }
        let tag = delivery
            .deliver
            .context("a delivery without its method")?
            .delivery_tag();
        let (confirmed, confirm) = oneshot::channel();
        waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(sequence, confirmed);
        let mut publish = BasicPublishArguments::new("", &job.to);
        publish.mandatory(true);
        publishing
            .basic_publish(
                delivery.basic_properties.unwrap_or_default(),
                delivery.content.unwrap_or_default(),
                publish,
            )
            .await?;
        let consuming = consuming.clone();
        acks.spawn(async move {
            if !confirm.await.unwrap_or(false) {
                bail!("a relayed publish was not confirmed");
            }
            consuming
                .basic_ack(BasicAckArguments::new(tag, false))
                .await?;
            Ok(())
        });
    }
    while let Some(acked) = acks.join_next().await {
        acked??;
    }
    let end = SelfUsage::now()?;
    let _ = connection.close().await;
    Ok(first.context("nothing to relay")?.until(&end, job.count))
}
