//! Which publish a returned message belongs to: pure bookkeeping for one confirm channel.
//!
//! `basic.return` carries no delivery tag. The broker sends a publish's return before the
//! confirm that covers it, and the project's connection ([`super::wire`]) hands each return
//! over before it reads the next frame; so by the time a publish's confirm completes, its
//! return (if any) is in the pool. A publish then takes a return with its own content from
//! the pool ([`ReturnPool::claim`]). Two messages with the same exchange, routing key,
//! properties and body are interchangeable.
//!
//! Each return remembers how many publishes had been numbered when it came: a publish
//! numbered later cannot own it. A return still in the pool when no publish that could own
//! it is left (its own publish was abandoned) is stale; `claim` drops it and counts it.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
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
    /// Publishes numbered below this had been numbered when the return came: only they
    /// can own it.
    numbered_before: u64,
}

/// The returns of one confirm channel not yet claimed, and the publishes that may claim
/// them.
#[derive(Debug)]
pub struct ReturnPool {
    /// The number the next publish gets (numbers start at 1).
    next_seq: u64,
    /// Numbered publishes that have not claimed yet (the oldest bounds what is stale).
    unclaimed: BTreeSet<u64>,
    pool: HashMap<Fingerprint, Vec<Pooled>>,
}

impl Default for ReturnPool {
    fn default() -> Self {
        Self {
            next_seq: 1,
            unclaimed: BTreeSet::new(),
            pool: HashMap::new(),
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

impl ReturnPool {
    /// An empty pool (a new channel).
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

    /// The broker returned a message whose content is `fingerprint`.
    pub fn returned(&mut self, fingerprint: Fingerprint, ret: Return) {
        self.pool.entry(fingerprint).or_default().push(Pooled {
            ret,
            numbered_before: self.next_seq,
        });
    }

    /// Publish `seq`, whose confirm came, takes its return if the pool holds one it can
    /// own. Its content's `fingerprint` is computed only when some return waits in the pool
    /// (returns are rare; hashing every body is not free). Call once per publish.
    pub fn claim(&mut self, seq: u64, fingerprint: impl FnOnce() -> Fingerprint) -> Claimed {
        self.unclaimed.remove(&seq);
        if self.pool.is_empty() {
            return Claimed {
                ret: None,
                stale: 0,
            };
        }
        let fingerprint = fingerprint();
        let mut ret = None;
        if let Some(entries) = self.pool.get_mut(&fingerprint)
            && let Some(i) = entries.iter().position(|p| seq < p.numbered_before)
        {
            ret = Some(entries.remove(i).ret);
            if entries.is_empty() {
                self.pool.remove(&fingerprint);
            }
        }
        let mut stale = 0;
        if !self.pool.is_empty() {
            // Publishes numbered from `oldest` on may still claim; a return that came
            // before `oldest` was numbered belongs to none of them.
            let oldest = self.unclaimed.first().copied().unwrap_or(self.next_seq);
            self.pool.retain(|_, entries| {
                let before = entries.len();
                entries.retain(|p| p.numbered_before > oldest);
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
    fn a_publish_takes_the_return_with_its_own_content() {
        let mut pool = ReturnPool::new();
        let (a, b) = (pool.register(), pool.register());
        // b was returned; its return came before either confirm.
        pool.returned(fp(2), no_return());
        assert_eq!(pool.claim(a, || fp(1)).ret, None);
        assert_eq!(pool.claim(b, || fp(2)).ret, Some(no_return()));
        assert_eq!(pool.pooled(), 0);
    }

    #[test]
    fn a_return_that_came_before_a_publish_was_numbered_is_not_its_own() {
        let mut pool = ReturnPool::new();
        let b = pool.register();
        pool.returned(fp(7), no_return());
        // c, with the same content, was numbered after that return came.
        let c = pool.register();
        assert_eq!(pool.claim(c, || fp(7)).ret, None);
        assert_eq!(pool.claim(b, || fp(7)).ret, Some(no_return()));
    }

    #[test]
    fn a_return_no_publish_in_flight_can_own_is_dropped_as_stale() {
        let mut pool = ReturnPool::new();
        let (a, b) = (pool.register(), pool.register());
        pool.returned(fp(7), no_return());
        // b, whose return it was, went away without claiming.
        pool.forget(b);
        let claimed = pool.claim(a, || fp(1));
        assert_eq!((claimed.ret, claimed.stale), (None, 1));
        assert_eq!(pool.pooled(), 0);
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

    /// The broker's behaviour: returns come in publish order, each before the confirm of
    /// its own publish; confirms complete in any order after that. Each publish claims
    /// when its confirm completes. Gives how many returns each content's publishes took.
    fn simulate(returned: &[bool], contents: &[u64], order: &[usize]) -> HashMap<u64, usize> {
        let n = returned.len();
        let mut pool = ReturnPool::new();
        let seqs: Vec<u64> = (0..n).map(|_| pool.register()).collect();
        // A confirm is ready once its own return (if any) came; returns come in order.
        let mut next_return = 0;
        let mut unconfirmed: Vec<usize> = (0..n).collect();
        let mut took = HashMap::new();
        let mut pick = order.iter().cycle();
        while !unconfirmed.is_empty() {
            let i = unconfirmed.remove(pick.next().unwrap() % unconfirmed.len());
            while next_return <= i {
                if returned[next_return] {
                    pool.returned(fp(contents[next_return]), no_return());
                }
                next_return += 1;
            }
            let claimed = pool.claim(seqs[i], || fp(contents[i]));
            assert_eq!(claimed.stale, 0, "no publish went away");
            *took.entry(contents[i]).or_default() += usize::from(claimed.ret.is_some());
        }
        assert_eq!(pool.pooled(), 0, "every return was claimed");
        took
    }

    proptest! {
        #[test]
        fn every_return_is_taken_by_a_publish_of_its_content(
            messages in proptest::collection::vec((any::<bool>(), 0u64..4), 1..300),
            order in proptest::collection::vec(0usize..1000, 1..50),
        ) {
            let returned: Vec<bool> = messages.iter().map(|m| m.0).collect();
            let contents: Vec<u64> = messages.iter().map(|m| m.1).collect();
            let mut expected: HashMap<u64, usize> = HashMap::new();
            for (r, c) in returned.iter().zip(&contents) {
                *expected.entry(*c).or_default() += usize::from(*r);
            }
            let took = simulate(&returned, &contents, &order);
            for (content, count) in expected {
                prop_assert_eq!(took.get(&content).copied().unwrap_or(0), count);
            }
        }
    }
}
