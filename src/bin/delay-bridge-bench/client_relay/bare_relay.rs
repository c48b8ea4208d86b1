//! The same relay on the library's bare connection (`delay_bridge::amqp::bare`: frames in
//! and out with amq-protocol, lapin's own codec, on the caller's runtime): what a client of
//! our own would cost. One task reads each frame and answers it at once: a delivery is
//! published (mandatory, persistent) as it arrives, and a confirm acks, in one write, the
//! deliveries whose publishes it settles. No thread, task or channel per message. Unlike
//! the other relays it consumes and publishes on one AMQP channel (the bare connection opens
//! one).

use std::collections::BTreeMap;

use amq_protocol::frame::parsing::parse_content_header;
use amq_protocol::protocol::{AMQPClass, basic};
use anyhow::{Context, Result, bail};
use lapin::types::FieldTable;

use delay_bridge::amqp::bare::{self, FRAME_BODY, FRAME_HEADER};
use delay_bridge::config::BrokerUrl;

use super::job::{ChildArgs, ChildReport, SelfUsage};

/// Relays `job.count` deliveries; calls `ready` once consuming.
pub async fn relay(url: &BrokerUrl, job: &ChildArgs, ready: impl FnOnce()) -> Result<ChildReport> {
    let mut connection = bare::connect(url, "delay-bridge bench relay (bare)").await?;
    connection.confirm_select().await?;
    connection
        .consume(&job.from, job.prefetch, FieldTable::default())
        .await?;
    ready();
    // Publishes not yet confirmed: publish sequence number -> the delivery it relays.
    let mut unconfirmed = BTreeMap::new();
    let mut published = 0u64;
    let mut relayed = 0u64;
    let mut first = None;
    while relayed < job.count {
        let frame = connection.read().await?;
        match frame.method() {
            Some(AMQPClass::Basic(basic::AMQPMethod::Deliver(deliver))) => {
                if first.is_none() {
                    first = Some(SelfUsage::now()?);
                }
                let header = connection.read().await?;
                if header.kind != FRAME_HEADER {
                    bail!(
                        "a frame of type {} where a content header was due",
                        header.kind
                    );
                }
                let (_, header) = parse_content_header(&header.payload[..])
                    .map_err(|e| anyhow::anyhow!("a content header: {e:?}"))?;
                let mut body = Vec::with_capacity(header.body_size as usize);
                while (body.len() as u64) < header.body_size {
                    let part = connection.read().await?;
                    if part.kind != FRAME_BODY {
                        bail!("a frame of type {} where a body was due", part.kind);
                    }
                    body.extend(part.payload);
                }
                connection
                    .publish(
                        basic::Publish {
                            exchange: "".into(),
                            routing_key: job.to.as_str().into(),
                            mandatory: true,
                            immediate: false,
                        },
                        header.properties,
                        &body,
                    )
                    .await?;
                published += 1;
                unconfirmed.insert(published, deliver.delivery_tag);
            }
            Some(AMQPClass::Basic(basic::AMQPMethod::Ack(ack))) => {
                let settled = if ack.multiple {
                    let later = unconfirmed.split_off(&(ack.delivery_tag + 1));
                    std::mem::replace(&mut unconfirmed, later)
                } else {
                    unconfirmed
                        .remove_entry(&ack.delivery_tag)
                        .into_iter()
                        .collect()
                };
                relayed += settled.len() as u64;
                connection
                    .ack(settled.into_values().map(|tag| (tag, false)))
                    .await?;
            }
            other => bail!("the relay did not expect {other:?}"),
        }
    }
    let end = SelfUsage::now()?;
    connection.close().await;
    Ok(first.context("nothing to relay")?.until(&end, job.count))
}
