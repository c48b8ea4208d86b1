//! Which publish a returned message belongs to: pure bookkeeping for one confirm channel.
//!
//! `basic.return` carries no delivery tag. lapin hands each returned message to whichever
//! confirm it completes next (for a `multiple=true` ack, in `HashMap` order), so the
//! confirm that carries a return is often not the publish that was returned. The broker
//! sends a publish's return before its ack, so by the time a publish's confirm completes,
//! its return (if any) has been handed to some confirm that was registered before. The
//! ledger therefore:
//!
//! 1. numbers every publish (`register`) and learns when each confirm completed and what it
//!    carried (`resolve`): a carried return goes into a pool keyed by its content;
//! 2. lets a publish decide only once every publish registered before its own confirm
//!    completed has completed too (its *barrier*; `wait`);
//! 3. then takes a return with its own content from the pool (`claim`). Two messages with
//!    the same exchange, routing key, properties and body are interchangeable.
//!
//! A return still in the pool when no publish that could own it is left is stale (it
//! matched nothing in flight); `claim` drops it and counts it.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

/// A digest of a message's exchange, routing key, properties and body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(u64);

impl Fingerprint {
    /// The digest of one message as published (or as returned: the broker sends back what
    /// was published).
    pub fn of(
        exchange: &str,
        routing_key: &str,
        properties: &BasicProperties,
        body: &[u8],
    ) -> Self {
        let mut h = DefaultHasher::new();
        exchange.hash(&mut h);
        routing_key.hash(&mut h);
        hash_properties(properties, &mut h);
        body.hash(&mut h);
        Fingerprint(h.finish())
    }
}

fn hash_properties(p: &BasicProperties, h: &mut DefaultHasher) {
    let shorts = [
        p.content_type(),
        p.content_encoding(),
        p.correlation_id(),
        p.reply_to(),
        p.expiration(),
        p.message_id(),
        p.kind(),
        p.user_id(),
        p.app_id(),
        p.cluster_id(),
    ];
    for s in shorts {
        s.as_ref().map(|s| s.as_str()).hash(h);
    }
    p.delivery_mode().hash(h);
    p.priority().hash(h);
    p.timestamp().hash(h);
    match p.headers() {
        None => 0u8.hash(h),
        Some(table) => {
            1u8.hash(h);
            hash_table(table, h);
        }
    }
}

/// Hashes a header table without recursion (a hostile message may nest tables deeply).
/// Floats are hashed by their bits, so a NaN matches itself.
fn hash_table(table: &FieldTable, h: &mut DefaultHasher) {
    enum Item<'a> {
        Key(&'a str),
        Value(&'a AMQPValue),
    }
    fn push_table<'a>(table: &'a FieldTable, stack: &mut Vec<Item<'a>>, h: &mut DefaultHasher) {
        table.inner().len().hash(h);
        for (k, v) in table.inner().iter().rev() {
            stack.push(Item::Value(v));
            stack.push(Item::Key(k.as_str()));
        }
    }
    let mut stack: Vec<Item<'_>> = Vec::new();
    push_table(table, &mut stack, h);
    while let Some(item) = stack.pop() {
        let value = match item {
            Item::Key(k) => {
                k.hash(h);
                continue;
            }
            Item::Value(v) => v,
        };
        std::mem::discriminant(value).hash(h);
        match value {
            AMQPValue::Boolean(v) => v.hash(h),
            AMQPValue::ShortShortInt(v) => v.hash(h),
            AMQPValue::ShortShortUInt(v) => v.hash(h),
            AMQPValue::ShortInt(v) => v.hash(h),
            AMQPValue::ShortUInt(v) => v.hash(h),
            AMQPValue::LongInt(v) => v.hash(h),
            AMQPValue::LongUInt(v) => v.hash(h),
            AMQPValue::LongLongInt(v) => v.hash(h),
            AMQPValue::Float(v) => v.to_bits().hash(h),
            AMQPValue::Double(v) => v.to_bits().hash(h),
            AMQPValue::DecimalValue(v) => v.hash(h),
            AMQPValue::ShortString(v) => v.as_str().hash(h),
            AMQPValue::LongString(v) => v.as_bytes().hash(h),
            AMQPValue::Timestamp(v) => v.hash(h),
            AMQPValue::ByteArray(v) => v.as_slice().hash(h),
            AMQPValue::Void => {}
            AMQPValue::FieldArray(items) => {
                items.as_slice().len().hash(h);
                stack.extend(items.as_slice().iter().rev().map(Item::Value));
            }
            AMQPValue::FieldTable(inner) => push_table(inner, &mut stack, h),
        }
    }
}

/// What the broker said when it returned a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Return {
    /// The reply code (312 NO_ROUTE, 313 NO_CONSUMERS).
    pub code: u16,
    /// The reply text.
    pub text: String,
}

/// A return waiting for its publish to claim it.
#[derive(Debug)]
struct Pooled {
    ret: Return,
    /// Publishes numbered below this had been registered when the return was carried in:
    /// only they can own it.
    registered_before: u64,
}

/// The publishes of one confirm channel and the returns their confirms carried. `W` is
/// how a waiting publish is woken (a oneshot sender in the publisher; anything in tests).
#[derive(Debug)]
pub struct ReturnLedger<W> {
    /// The number the next publish gets (numbers start at 1).
    next_seq: u64,
    /// Every publish numbered up to this one has completed.
    watermark: u64,
    /// Completed publishes above the watermark.
    completed_above: BTreeSet<u64>,
    /// Registered publishes that have not claimed yet (the oldest bounds what is stale).
    unclaimed: BTreeSet<u64>,
    pool: HashMap<Fingerprint, Vec<Pooled>>,
    /// Publishes waiting for the watermark to reach their barrier.
    waiters: BTreeMap<u64, Vec<W>>,
}

impl<W> Default for ReturnLedger<W> {
    fn default() -> Self {
        Self {
            next_seq: 1,
            watermark: 0,
            completed_above: BTreeSet::new(),
            unclaimed: BTreeSet::new(),
            pool: HashMap::new(),
            waiters: BTreeMap::new(),
        }
    }
}

/// What `claim` found.
#[derive(Debug, PartialEq, Eq)]
pub struct Claimed {
    /// The publish's own return, if it was returned.
    pub ret: Option<Return>,
    /// Returns dropped because no publish in flight could own them any more.
    pub stale: usize,
}

impl<W> ReturnLedger<W> {
    /// An empty ledger (a new channel).
    pub fn new() -> Self {
        Self::default()
    }

    /// Numbers a publish about to be sent.
    pub fn register(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.unclaimed.insert(seq);
        seq
    }

    /// Publish `seq` completed (confirmed, nacked, failed or timed out); `carried` is the
    /// return its confirm carried, whoever it belongs to. Gives the publish's barrier and
    /// the waiters the completion releases.
    pub fn resolve(&mut self, seq: u64, carried: Option<(Fingerprint, Return)>) -> (u64, Vec<W>) {
        if let Some((fingerprint, ret)) = carried {
            self.pool.entry(fingerprint).or_default().push(Pooled {
                ret,
                registered_before: self.next_seq,
            });
        }
        if seq > self.watermark {
            self.completed_above.insert(seq);
        }
        let mut released = Vec::new();
        while self.completed_above.remove(&(self.watermark + 1)) {
            self.watermark += 1;
        }
        if !self.waiters.is_empty() {
            let later = self.waiters.split_off(&(self.watermark + 1));
            for (_, ws) in std::mem::replace(&mut self.waiters, later) {
                released.extend(ws);
            }
        }
        (self.next_seq - 1, released)
    }

    /// True when every publish up to `barrier` has completed.
    pub fn passed(&self, barrier: u64) -> bool {
        self.watermark >= barrier
    }

    /// Parks `waiter` until the watermark reaches `barrier`; gives it back when it already has.
    pub fn wait(&mut self, barrier: u64, waiter: W) -> Option<W> {
        if self.passed(barrier) {
            return Some(waiter);
        }
        self.waiters.entry(barrier).or_default().push(waiter);
        None
    }

    /// Publish `seq`, whose content is `fingerprint`, takes its return if the pool holds
    /// one it can own. Call once per publish, after its barrier passed.
    pub fn claim(&mut self, seq: u64, fingerprint: Fingerprint) -> Claimed {
        self.unclaimed.remove(&seq);
        let mut ret = None;
        if let Some(entries) = self.pool.get_mut(&fingerprint)
            && let Some(i) = entries.iter().position(|p| seq < p.registered_before)
        {
            ret = Some(entries.remove(i).ret);
            if entries.is_empty() {
                self.pool.remove(&fingerprint);
            }
        }
        let mut stale = 0;
        if !self.pool.is_empty() {
            // Publishes numbered from `oldest` on may still claim; a return carried in
            // before `oldest` was registered belongs to none of them.
            let oldest = self.unclaimed.first().copied().unwrap_or(self.next_seq);
            self.pool.retain(|_, entries| {
                let before = entries.len();
                entries.retain(|p| p.registered_before > oldest);
                stale += before - entries.len();
                !entries.is_empty()
            });
        }
        Claimed { ret, stale }
    }

    /// Publish `seq` will not claim (it failed, or its caller went away).
    pub fn forget(&mut self, seq: u64) {
        self.unclaimed.remove(&seq);
    }

    /// Returns waiting in the pool now.
    #[cfg(test)]
    pub fn pooled(&self) -> usize {
        self.pool.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString};
    use proptest::prelude::*;

    fn fp(n: u64) -> Fingerprint {
        Fingerprint(n)
    }

    fn no_return() -> Return {
        Return {
            code: 312,
            text: "NO_ROUTE".into(),
        }
    }

    #[test]
    fn a_return_carried_by_another_confirm_reaches_its_own_publish() {
        let mut ledger = ReturnLedger::<u64>::new();
        let (a, b) = (ledger.register(), ledger.register());
        // b was returned; the broker acks a and b together; lapin gives b's return to a.
        let (barrier_a, _) = ledger.resolve(a, Some((fp(2), no_return())));
        let (barrier_b, released) = ledger.resolve(b, None);
        assert!(released.is_empty());
        assert!(ledger.passed(barrier_a) && ledger.passed(barrier_b));
        assert_eq!(ledger.claim(a, fp(1)).ret, None);
        assert_eq!(ledger.claim(b, fp(2)).ret, Some(no_return()));
        assert_eq!(ledger.pooled(), 0);
    }

    #[test]
    fn a_publish_waits_for_every_confirm_registered_before_its_own_completed() {
        let mut ledger = ReturnLedger::<&str>::new();
        let (a, b) = (ledger.register(), ledger.register());
        // b's confirm completes first (its waiter is woken only once a has completed too).
        let (barrier_b, _) = ledger.resolve(b, None);
        assert_eq!(barrier_b, b);
        assert!(!ledger.passed(barrier_b));
        assert_eq!(ledger.wait(barrier_b, "b"), None);
        let (_, released) = ledger.resolve(a, Some((fp(2), no_return())));
        assert_eq!(released, vec!["b"]);
        assert_eq!(ledger.claim(b, fp(2)).ret, Some(no_return()));
    }

    #[test]
    fn a_return_carried_in_before_a_publish_existed_is_not_its_own() {
        let mut ledger = ReturnLedger::<()>::new();
        let (a, b) = (ledger.register(), ledger.register());
        // a's confirm carries a return of content 7 (b's, by content).
        ledger.resolve(a, Some((fp(7), no_return())));
        assert_eq!(ledger.claim(a, fp(1)).ret, None);
        // c, with the same content, was registered after that return came in.
        let c = ledger.register();
        ledger.resolve(b, None);
        ledger.resolve(c, None);
        assert_eq!(ledger.claim(c, fp(7)).ret, None);
        assert_eq!(ledger.claim(b, fp(7)).ret, Some(no_return()));
    }

    #[test]
    fn a_return_no_publish_in_flight_can_own_is_dropped_as_stale() {
        let mut ledger = ReturnLedger::<()>::new();
        let a = ledger.register();
        ledger.resolve(a, Some((fp(7), no_return())));
        let claimed = ledger.claim(a, fp(1));
        assert_eq!((claimed.ret, claimed.stale), (None, 1));
        assert_eq!(ledger.pooled(), 0);
    }

    #[test]
    fn fingerprints_tell_properties_and_bodies_apart_and_nan_matches_itself() {
        let mut nested = FieldTable::default();
        nested.insert("x".into(), AMQPValue::Double(f64::NAN));
        let mut headers = FieldTable::default();
        headers.insert("t".into(), AMQPValue::FieldTable(nested));
        headers.insert(
            "a".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                LongString::from("v"),
            )])),
        );
        let props = BasicProperties::default().with_headers(headers);
        let one = Fingerprint::of("x", "k", &props, b"body");
        assert_eq!(one, Fingerprint::of("x", "k", &props.clone(), b"body"));
        assert_ne!(one, Fingerprint::of("x", "k", &props, b"other"));
        assert_ne!(one, Fingerprint::of("x", "k2", &props, b"body"));
        assert_ne!(one, Fingerprint::of("y", "k", &props, b"body"));
        assert_ne!(
            one,
            Fingerprint::of("x", "k", &BasicProperties::default(), b"body")
        );
    }

    #[test]
    fn a_deeply_nested_table_hashes_on_a_small_stack() {
        // 20 000 levels is more than fits in a 128 KiB frame. Building and dropping such a
        // table recurses in lapin's own types, so that happens on a big stack; the hash runs
        // on a 64 KiB one.
        let big = std::thread::Builder::new().stack_size(1 << 30);
        big.spawn(|| {
            let mut table = FieldTable::default();
            for _ in 0..20_000 {
                let mut outer = FieldTable::default();
                outer.insert("n".into(), AMQPValue::FieldTable(table));
                table = outer;
            }
            let props = BasicProperties::default().with_headers(table);
            std::thread::scope(|s| {
                let small = std::thread::Builder::new().stack_size(64 << 10);
                small
                    .spawn_scoped(s, || Fingerprint::of("", "", &props, b""))
                    .expect("thread")
                    .join()
                    .expect("hashing a deep table does not overflow the stack")
            });
        })
        .expect("thread")
        .join()
        .expect("test thread");
    }

    /// lapin's behaviour, modelled: the broker sends each return before the ack that
    /// covers its publish, acks in tag order (`multiple` up to a tag, or single), and lapin
    /// hands the waiting returns FIFO to the confirms of an ack frame in an arbitrary order.
    fn simulate(returned: &[bool], contents: &[u64], frames: &[(usize, u64)]) -> Vec<bool> {
        let n = returned.len();
        let mut ledger = ReturnLedger::<usize>::new();
        let seqs: Vec<u64> = (0..n).map(|_| ledger.register()).collect();
        let mut waiting_returns = std::collections::VecDeque::new();
        let mut pending: Vec<usize> = (0..n).collect();
        let mut decided = vec![None; n];
        let mut next_return = 0;
        let mut frame = frames.iter().cycle();
        while !pending.is_empty() {
            let (take, shuffle) = *frame.next().unwrap();
            let take = take.clamp(1, pending.len());
            let mut batch: Vec<usize> = pending.drain(..take).collect();
            // returns of this frame's publishes arrive before the ack
            let last = *batch.iter().max().unwrap();
            while next_return <= last {
                if returned[next_return] {
                    waiting_returns.push_back(next_return);
                }
                next_return += 1;
            }
            // lapin completes the frame's confirms in hash order
            let len = batch.len();
            for i in 0..len {
                batch.swap(i, (shuffle as usize).wrapping_mul(i + 7) % len);
            }
            // an owner decides as soon as it is released, before the rest of the frame
            for i in batch {
                let carried = waiting_returns
                    .pop_front()
                    .map(|owner| (fp(contents[owner]), no_return()));
                let (barrier, mut woken) = ledger.resolve(seqs[i], carried);
                woken.extend(ledger.wait(barrier, i));
                for w in woken {
                    decided[w] = Some(ledger.claim(seqs[w], fp(contents[w])).ret.is_some());
                }
            }
        }
        assert_eq!(ledger.pooled(), 0, "every return was claimed");
        decided.into_iter().map(|d| d.expect("decided")).collect()
    }

    proptest! {
        #[test]
        fn every_publish_learns_whether_it_was_returned(
            messages in proptest::collection::vec((any::<bool>(), 0u64..4), 1..300),
            frames in proptest::collection::vec((1usize..40, any::<u64>()), 1..20),
        ) {
            let returned: Vec<bool> = messages.iter().map(|m| m.0).collect();
            // content = (returned, group): identical content is interchangeable, so two
            // messages with the same content are routed alike here.
            let contents: Vec<u64> = messages.iter().map(|m| m.1 * 2 + m.0 as u64).collect();
            prop_assert_eq!(simulate(&returned, &contents, &frames), returned);
        }
    }
}
