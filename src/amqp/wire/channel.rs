//! One AMQP channel of a [`super::Connection`]: calls that wait for their reply, consumers,
//! acks, and publishes that learn their confirm. What the broker sends on the channel is
//! handled by [`ChannelShared::on_method`] and its siblings, from the connection's reader.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use amq_protocol::protocol::{
    AMQPClass, BasicProperties, basic, channel, confirm, exchange, queue,
};
use lapin::types::{FieldTable, ShortString};
use tokio::sync::{mpsc, oneshot};

use super::confirms::Confirms;
use super::content::{Carrier, Content, Incoming, Malformed, Raw, RawDeliver, Step};
use super::{Inner, WireError};
use crate::amqp::QueueCounts;

/// What the broker said of a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirm {
    /// `basic.ack`: the broker took responsibility for it (an unroutable mandatory publish
    /// is acked too, after its [`Returned`]).
    Ack,
    /// `basic.nack`: the broker lost it.
    Nack,
}

/// A message delivered to a consumer.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Its tag on the channel, for the ack.
    pub delivery_tag: u64,
    /// True when it was delivered before and not acked.
    pub redelivered: bool,
    /// The exchange it was published to.
    pub exchange: ShortString,
    /// The routing key it was published with.
    pub routing_key: ShortString,
    /// Its properties.
    pub properties: BasicProperties,
    /// Its body (named as lapin names it).
    pub data: Vec<u8>,
    /// What of it could not be read (a routing key, a header name or a property that is
    /// not UTF-8), as sent; `exchange`, `routing_key` and `properties` then hold what could
    /// be (names made UTF-8, default properties). Its consumer sets such a delivery aside.
    pub unreadable: Option<Box<Raw>>,
}

/// A mandatory publish the broker could not route, given back.
#[derive(Debug, Clone)]
pub struct Returned {
    /// Why (312 `NO_ROUTE`).
    pub reply_code: u16,
    /// Why, in words.
    pub reply_text: ShortString,
    /// The exchange it was published to.
    pub exchange: ShortString,
    /// The routing key it was published with.
    pub routing_key: ShortString,
    /// Its properties.
    pub properties: BasicProperties,
    /// Its body.
    pub body: Vec<u8>,
}

/// Called with each returned publish, on the connection's reader, before the confirm that
/// follows it is handed over. It must not block nor call the channel.
pub type ReturnHandler = Box<dyn Fn(Returned) + Send + Sync>;

type ConfirmWaiter = oneshot::Sender<Result<Confirm, WireError>>;
type ReplyWaiter = oneshot::Sender<Result<AMQPClass, WireError>>;

/// The channel's state, shared by its handles and the connection's reader.
pub(super) struct ChannelShared {
    id: u16,
    state: Mutex<ChannelState>,
}

struct ChannelState {
    /// Why the channel is gone, once it is.
    closed: Option<WireError>,
    /// Calls waiting for their reply, in the order they were sent.
    replies: VecDeque<ReplyWaiter>,
    /// In confirm mode: the publishes not yet confirmed.
    confirms: Option<Confirms<ConfirmWaiter>>,
    /// Consumers by tag.
    consumers: HashMap<ShortString, mpsc::UnboundedSender<Delivery>>,
    /// A message whose frames are arriving.
    incoming: Option<Incoming>,
    on_return: Option<ReturnHandler>,
    /// Consumer tags given so far (for tags made here).
    consumers_made: u64,
}

impl ChannelShared {
    pub(super) fn new(id: u16) -> Self {
        Self {
            id,
            state: Mutex::new(ChannelState {
                closed: None,
                replies: VecDeque::new(),
                confirms: None,
                consumers: HashMap::new(),
                incoming: None,
                on_return: None,
                consumers_made: 0,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ChannelState> {
        // A panic under this lock (in a return handler) fails the connection; what
        // fails it still reaches the state.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Ends the channel with `error`: every call, publish and consumer waiting on it gets
    /// it (consumers see their stream end).
    pub(super) fn fail(&self, error: &WireError) {
        let mut state = self.state();
        state.closed.get_or_insert_with(|| error.clone());
        for waiter in state.replies.drain(..) {
            let _ = waiter.send(Err(error.clone()));
        }
        if let Some(confirms) = &mut state.confirms {
            for waiter in confirms.take_all() {
                let _ = waiter.send(Err(error.clone()));
            }
        }
        state.consumers.clear();
        state.incoming = None;
    }

    /// A method the broker sent on this channel. `Err` fails the connection.
    pub(super) fn on_method(&self, inner: &Inner, method: AMQPClass) -> Result<(), WireError> {
        let mut state = self.state();
        if state.incoming.is_some() {
            return Err(WireError::Unexpected(format!(
                "{method:?} on channel {} where a message's frames were due",
                self.id
            )));
        }
        match method {
            AMQPClass::Basic(basic::AMQPMethod::Deliver(deliver)) => {
                state.incoming = Some(Incoming::new(Carrier::Deliver(deliver)));
            }
            AMQPClass::Basic(basic::AMQPMethod::Return(returned)) => {
                state.incoming = Some(Incoming::new(Carrier::Return(returned)));
            }
            AMQPClass::Basic(basic::AMQPMethod::Ack(ack)) => {
                settle(&mut state, ack.delivery_tag, ack.multiple, Confirm::Ack)
            }
            AMQPClass::Basic(basic::AMQPMethod::Nack(nack)) => {
                settle(&mut state, nack.delivery_tag, nack.multiple, Confirm::Nack)
            }
            AMQPClass::Basic(basic::AMQPMethod::Cancel(cancel)) => {
                state.consumers.remove(&cancel.consumer_tag);
                if !cancel.nowait {
                    inner.outbox.send(|frames| {
                        frames.method(
                            self.id,
                            AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                                consumer_tag: cancel.consumer_tag.clone(),
                            })),
                        )
                    })?;
                }
            }
            AMQPClass::Channel(channel::AMQPMethod::Flow(flow)) => {
                inner.outbox.send(|frames| {
                    frames.method(
                        self.id,
                        AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                            active: flow.active,
                        })),
                    )
                })?;
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(close)) => {
                drop(state);
                let error = WireError::Closed {
                    what: "channel",
                    code: close.reply_code,
                    text: close.reply_text.to_string(),
                };
                self.fail(&error);
                // Answered before the number can be given to a new channel.
                inner.outbox.send(|frames| {
                    frames.method(
                        self.id,
                        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                    )
                })?;
                inner.forget_channel(self.id);
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => {
                let waiter = state.replies.pop_front();
                drop(state);
                inner.forget_channel(self.id);
                self.fail(&WireError::ChannelClosed);
                if let Some(waiter) = waiter {
                    let _ = waiter.send(Ok(method));
                }
            }
            reply => match state.replies.pop_front() {
                Some(waiter) => {
                    let _ = waiter.send(Ok(reply));
                }
                None => {
                    return Err(WireError::Unexpected(format!(
                        "{reply:?} on channel {} with no call waiting",
                        self.id
                    )));
                }
            },
        }
        Ok(())
    }

    /// True when a publish on this channel waits for its confirm or a call for its reply.
    pub(super) fn awaits_broker(&self) -> bool {
        let state = self.state();
        !state.replies.is_empty() || state.confirms.as_ref().is_some_and(|c| c.len() > 0)
    }

    /// A `basic.deliver` the codec cannot read, read by hand: its content follows.
    pub(super) fn on_raw_deliver(&self, deliver: RawDeliver) -> Result<(), WireError> {
        let mut state = self.state();
        if state.incoming.is_some() {
            return Err(WireError::Unexpected(format!(
                "a delivery on channel {} where a message's frames were due",
                self.id
            )));
        }
        state.incoming = Some(Incoming::new(Carrier::RawDeliver(deliver)));
        Ok(())
    }

    /// A content header frame's payload the broker sent on this channel.
    pub(super) fn on_header(&self, payload: &[u8]) -> Result<(), WireError> {
        let mut state = self.state();
        let incoming = state.incoming.take().ok_or_else(|| {
            WireError::Unexpected(format!(
                "a content header on channel {} out of place",
                self.id
            ))
        })?;
        let step = incoming
            .header_frame(payload)
            .map_err(|malformed| match malformed {
                Malformed::OutOfPlace(text) => WireError::Unexpected(text),
                Malformed::Unreadable(text) => WireError::Unreadable(text),
            })?;
        arrive(&mut state, step);
        Ok(())
    }

    /// A body frame the broker sent on this channel.
    pub(super) fn on_body(&self, part: &[u8]) -> Result<(), WireError> {
        let mut state = self.state();
        let incoming = state.incoming.take().ok_or_else(|| {
            WireError::Unexpected(format!("a body frame on channel {} out of place", self.id))
        })?;
        let step = incoming.body(part).map_err(WireError::Unexpected)?;
        arrive(&mut state, step);
        Ok(())
    }
}

fn settle(state: &mut ChannelState, tag: u64, multiple: bool, confirm: Confirm) {
    if let Some(confirms) = &mut state.confirms {
        for waiter in confirms.settle(tag, multiple) {
            let _ = waiter.send(Ok(confirm));
        }
    }
}

fn arrive(state: &mut ChannelState, step: Step) {
    let content = match step {
        Step::Waiting(incoming) => {
            state.incoming = Some(incoming);
            return;
        }
        Step::Done(content) => content,
    };
    let Content {
        carrier,
        properties,
        raw,
        body,
    } = content;
    let unreadable = raw.map(Box::new);
    match carrier {
        Carrier::Deliver(deliver) => {
            // A consumer that is gone leaves the delivery unacked: the broker gives it
            // back when the channel closes.
            if let Some(consumer) = state.consumers.get(&deliver.consumer_tag) {
                let _ = consumer.send(Delivery {
                    delivery_tag: deliver.delivery_tag,
                    redelivered: deliver.redelivered,
                    exchange: deliver.exchange,
                    routing_key: deliver.routing_key,
                    properties,
                    data: body,
                    unreadable,
                });
            }
        }
        Carrier::RawDeliver(deliver) => {
            let tag = lossy_short_string(&deliver.consumer_tag);
            if let Some(consumer) = state.consumers.get(&tag) {
                let _ = consumer.send(Delivery {
                    delivery_tag: deliver.delivery_tag,
                    redelivered: deliver.redelivered,
                    exchange: lossy_short_string(&deliver.exchange),
                    routing_key: lossy_short_string(&deliver.routing_key),
                    properties,
                    data: body,
                    unreadable,
                });
            }
        }
        Carrier::Return(returned) => {
            if let Some(handler) = &state.on_return {
                handler(Returned {
                    reply_code: returned.reply_code,
                    reply_text: returned.reply_text,
                    exchange: returned.exchange,
                    routing_key: returned.routing_key,
                    properties,
                    body,
                });
            }
        }
    }
}

/// `bytes` as a short string: made UTF-8 (each invalid sequence replaced) and cut to the
/// 255 bytes a short string holds, at a character boundary.
fn lossy_short_string(bytes: &[u8]) -> ShortString {
    let text = String::from_utf8_lossy(bytes);
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::from(&text[..end])
}

/// A handle on an open channel. Clones share the channel.
#[derive(Clone)]
pub struct Channel {
    pub(super) shared: Arc<ChannelShared>,
    pub(super) inner: Arc<Inner>,
}

impl Channel {
    /// The channel's number.
    pub fn id(&self) -> u16 {
        self.shared.id
    }

    /// True until the channel or its connection is gone.
    pub fn is_open(&self) -> bool {
        self.shared.state().closed.is_none()
    }

    /// Why the channel is gone, once it is.
    pub fn error(&self) -> Option<WireError> {
        self.shared.state().closed.clone()
    }

    /// Sends `method` and waits for the broker's reply to it (a method that is neither a
    /// delivery, a return, a confirm nor a close). A channel error (a passive declare of
    /// an exchange that does not exist, say) comes back as [`WireError::Closed`], and the
    /// channel is then gone. Crate-private: a `nowait` method has no reply, and the replies
    /// of every later call would then be matched to the wrong callers.
    pub(crate) async fn call(&self, method: AMQPClass) -> Result<AMQPClass, WireError> {
        self.request(method, false).await
    }

    /// Sends `method` and waits for its reply; with `last`, the channel takes nothing more
    /// to send from the moment it is sent (a close).
    async fn request(&self, method: AMQPClass, last: bool) -> Result<AMQPClass, WireError> {
        let reply = self.send_request(method, last)?;
        reply.await.map_err(|_| self.gone())?
    }

    /// Sends `method` and queues a waiter for its reply: replies come in the order of
    /// their requests.
    fn send_request(
        &self,
        method: AMQPClass,
        last: bool,
    ) -> Result<oneshot::Receiver<Result<AMQPClass, WireError>>, WireError> {
        let (waiter, reply) = oneshot::channel();
        let mut state = self.shared.state();
        if let Some(error) = &state.closed {
            return Err(error.clone());
        }
        self.inner
            .outbox
            .send(|frames| frames.method(self.shared.id, method))?;
        if last {
            state.closed = Some(WireError::ChannelClosed);
        }
        state.replies.push_back(waiter);
        Ok(reply)
    }

    /// Sends `method` and waits for nothing: its reply is still taken in its turn, so that
    /// every later call gets its own. It undoes what a call asked of the broker when the
    /// call's caller has gone (its future dropped before the reply); on a channel that is
    /// gone there is nothing to undo.
    pub(super) fn send_detached(&self, method: AMQPClass, last: bool) {
        let _ = self.send_request(method, last);
    }

    /// Lets the broker deliver at most `prefetch_count` messages unacked on this channel.
    pub async fn qos(&self, prefetch_count: u16) -> Result<(), WireError> {
        let reply = self
            .call(AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count,
                global: false,
            })))
            .await?;
        expect(reply, |m| {
            matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_)))
        })
    }

    /// Puts the channel in publisher-confirm mode.
    pub async fn confirm_select(&self) -> Result<(), WireError> {
        self.shared
            .state()
            .confirms
            .get_or_insert_with(Confirms::new);
        let reply = self
            .call(AMQPClass::Confirm(confirm::AMQPMethod::Select(
                confirm::Select { nowait: false },
            )))
            .await?;
        expect(reply, |m| {
            matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)))
        })
    }

    /// `Ok` when `exchange` exists (a passive declare). A missing one is a 404 channel
    /// error ([`WireError::Closed`]), and the channel is then gone.
    pub async fn check_exchange(&self, name: &str) -> Result<(), WireError> {
        let reply = self
            .call(AMQPClass::Exchange(exchange::AMQPMethod::Declare(
                exchange::Declare {
                    exchange: name.into(),
                    kind: "direct".into(),
                    passive: true,
                    durable: false,
                    auto_delete: false,
                    internal: false,
                    nowait: false,
                    arguments: FieldTable::default(),
                },
            )))
            .await?;
        expect(reply, |m| {
            matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_)))
        })
    }

    /// The ready messages and consumers of an existing queue (a passive declare). A
    /// missing one is a 404 channel error ([`WireError::Closed`]), and the channel is then
    /// gone.
    pub async fn queue_counts(&self, name: &str) -> Result<QueueCounts, WireError> {
        let reply = self
            .call(AMQPClass::Queue(queue::AMQPMethod::Declare(
                queue::Declare {
                    queue: name.into(),
                    passive: true,
                    durable: false,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments: FieldTable::default(),
                },
            )))
            .await?;
        match reply {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => Ok(QueueCounts {
                messages: u64::from(ok.message_count),
                consumers: u64::from(ok.consumer_count),
            }),
            other => Err(WireError::Unexpected(format!(
                "{other:?} where queue.declare-ok was due"
            ))),
        }
    }

    /// Gives returned mandatory publishes to `handler` from now on.
    pub fn on_return(&self, handler: ReturnHandler) {
        self.shared.state().on_return = Some(handler);
    }

    /// Consumes `queue` with `arguments`, as `consumer_tag` (one made here when empty).
    pub async fn consume(
        &self,
        queue: &str,
        consumer_tag: &str,
        arguments: FieldTable,
    ) -> Result<Consumer, WireError> {
        let (deliveries, receiver) = mpsc::unbounded_channel();
        let tag = {
            let mut state = self.shared.state();
            let tag = if consumer_tag.is_empty() {
                state.consumers_made += 1;
                ShortString::from(format!("wire-{}-{}", self.shared.id, state.consumers_made))
            } else {
                ShortString::from(consumer_tag)
            };
            // Registered before the broker can deliver to it.
            state.consumers.insert(tag.clone(), deliveries);
            tag
        };
        // A caller that goes before the broker's consume-ok (its future dropped) leaves a
        // consumer the broker feeds and nobody reads: cancel it.
        let undo = scopeguard::guard(tag.clone(), |tag| {
            self.shared.state().consumers.remove(&tag);
            self.send_detached(cancel_method(tag), false);
        });
        let reply = self
            .call(AMQPClass::Basic(basic::AMQPMethod::Consume(
                basic::Consume {
                    queue: queue.into(),
                    consumer_tag: tag.clone(),
                    no_local: false,
                    no_ack: false,
                    exclusive: false,
                    nowait: false,
                    arguments,
                },
            )))
            .await;
        let tag = scopeguard::ScopeGuard::into_inner(undo);
        let checked = reply.and_then(|reply| {
            expect(reply, |m| {
                matches!(m, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)))
            })
        });
        if let Err(error) = checked {
            self.shared.state().consumers.remove(&tag);
            return Err(error);
        }
        Ok(Consumer {
            tag,
            deliveries: receiver,
            channel: self.clone(),
        })
    }

    /// Stops the consumer `tag`: nothing more is delivered to it once this returns. A
    /// caller that goes before the broker's answer (its future dropped) ends the consumer
    /// all the same: what is still delivered to it stays unacked until the channel closes.
    pub async fn cancel(&self, tag: &ShortString) -> Result<(), WireError> {
        let _forget = scopeguard::guard((), |()| {
            self.shared.state().consumers.remove(tag);
        });
        let reply = self.call(cancel_method(tag.clone())).await?;
        expect(reply, |m| {
            matches!(m, AMQPClass::Basic(basic::AMQPMethod::CancelOk(_)))
        })
    }

    /// Acks deliveries, each `(tag, multiple)` (`multiple` acks every one up to `tag`), in
    /// one write.
    pub fn ack(&self, acks: impl IntoIterator<Item = (u64, bool)>) -> Result<(), WireError> {
        self.settle(
            acks.into_iter()
                .map(|(tag, multiple)| Settle::Ack { tag, multiple }),
        )
    }

    /// Gives deliveries back, each `(tag, multiple)`, to the queue when `requeue` (else to
    /// its dead-letter exchange, or dropped).
    pub fn nack(
        &self,
        nacks: impl IntoIterator<Item = (u64, bool)>,
        requeue: bool,
    ) -> Result<(), WireError> {
        self.settle(nacks.into_iter().map(|(tag, multiple)| Settle::Nack {
            tag,
            multiple,
            requeue,
        }))
    }

    /// Acks and nacks, in the order given, in one write.
    pub fn settle(&self, settles: impl IntoIterator<Item = Settle>) -> Result<(), WireError> {
        let state = self.shared.state();
        if let Some(error) = &state.closed {
            return Err(error.clone());
        }
        let id = self.shared.id;
        self.inner.outbox.send(|frames| {
            for settle in settles {
                frames.settle(id, settle);
            }
            Ok(())
        })
    }

    /// Publishes `body` with `properties` to `exchange` with `routing_key`, on a channel in
    /// confirm mode ([`Channel::confirm_select`]). The frames are queued now; the returned
    /// future gives the broker's confirm. A `mandatory` publish the broker cannot route
    /// goes to the [`Channel::on_return`] handler before its confirm.
    pub fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
        properties: &BasicProperties,
        body: &[u8],
    ) -> Result<PendingConfirm, WireError> {
        let (waiter, confirm) = oneshot::channel();
        let mut state = self.shared.state();
        if let Some(error) = &state.closed {
            return Err(error.clone());
        }
        let id = self.shared.id;
        let Some(confirms) = &mut state.confirms else {
            return Err(WireError::Unexpected(
                "a publish on a channel not in confirm mode".into(),
            ));
        };
        self.inner.outbox.send(|frames| {
            frames.publish(id, exchange, routing_key, mandatory)?;
            frames.content(id, properties, body)
        })?;
        confirms.register(waiter);
        Ok(PendingConfirm {
            confirm,
            channel: self.clone(),
        })
    }

    /// How long the broker has sent nothing at all on this channel's connection.
    pub fn broker_silent_for(&self) -> std::time::Duration {
        self.inner.silent_for()
    }

    /// How many publishes wait for their confirm.
    pub fn unconfirmed(&self) -> usize {
        self.shared
            .state()
            .confirms
            .as_ref()
            .map_or(0, Confirms::len)
    }

    /// Closes the channel (the broker gives back what it delivered and was not acked).
    /// From the moment it begins, the channel takes nothing more to send: a frame the broker
    /// read after its `close-ok` would be on a closed channel, and it closes the whole
    /// connection for that. Confirms and deliveries already on their way still arrive.
    pub async fn close(&self) -> Result<(), WireError> {
        let reply = self.request(close_method(), true).await?;
        expect(reply, |m| {
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)))
        })
    }

    /// Why a waiter was dropped unanswered: the channel's error, else the connection's.
    fn gone(&self) -> WireError {
        self.error()
            .or_else(|| self.inner.error())
            .unwrap_or(WireError::ChannelClosed)
    }
}

/// What to tell the broker of a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// `basic.ack`: done with it (and, with `multiple`, every one up to it).
    Ack {
        /// The delivery tag.
        tag: u64,
        /// Every unsettled delivery up to `tag` too.
        multiple: bool,
    },
    /// `basic.nack`: give it back.
    Nack {
        /// The delivery tag.
        tag: u64,
        /// Every unsettled delivery up to `tag` too.
        multiple: bool,
        /// Back into the queue (else dead-lettered, or dropped).
        requeue: bool,
    },
}

/// `channel.close` as this client closes a channel: 200, done.
pub(super) fn close_method() -> AMQPClass {
    AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
        reply_code: 200,
        reply_text: "done".into(),
        class_id: 0,
        method_id: 0,
    }))
}

/// `basic.cancel` of the consumer `tag`, with its reply.
fn cancel_method(consumer_tag: ShortString) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
        consumer_tag,
        nowait: false,
    }))
}

fn expect(reply: AMQPClass, is_reply: impl Fn(&AMQPClass) -> bool) -> Result<(), WireError> {
    if is_reply(&reply) {
        Ok(())
    } else {
        Err(WireError::Unexpected(format!("{reply:?} as a reply")))
    }
}

/// The broker's confirm of one publish, to come.
pub struct PendingConfirm {
    confirm: oneshot::Receiver<Result<Confirm, WireError>>,
    channel: Channel,
}

impl Future for PendingConfirm {
    type Output = Result<Confirm, WireError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.confirm).poll(cx) {
            Poll::Ready(Ok(answer)) => Poll::Ready(answer),
            Poll::Ready(Err(_)) => Poll::Ready(Err(self.channel.gone())),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The deliveries to one consumer.
pub struct Consumer {
    tag: ShortString,
    deliveries: mpsc::UnboundedReceiver<Delivery>,
    channel: Channel,
}

impl Consumer {
    /// The consumer's tag.
    pub fn tag(&self) -> &ShortString {
        &self.tag
    }

    /// The next delivery; `None` once the consumer was cancelled (here or by the broker:
    /// its queue was deleted, say), `Err` once its channel or connection is gone.
    pub async fn next(&mut self) -> Result<Option<Delivery>, WireError> {
        match self.deliveries.recv().await {
            Some(delivery) => Ok(Some(delivery)),
            None => self.ended(),
        }
    }

    fn ended(&self) -> Result<Option<Delivery>, WireError> {
        match self.channel.error().or_else(|| self.channel.inner.error()) {
            Some(error) => Err(error),
            None => Ok(None),
        }
    }
}
