//! The bridge state's signature: an HMAC-SHA256, keyed by `bridge.state_key`, over what
//! the bridge acts on in a copy travelling through the levels: its bridge headers
//! (`delay-bridge-*`), its `message_id` (the id cancels and schedules name), the publisher
//! headers it reads on the way (`CC`, `BCC`, every `x-repeat-*` rule header) and its body
//! (for a bundle, the body holds its messages and their state). A copy that comes back
//! through the work exchange without a valid signature is parked `bad-state`, so a user
//! who may write to the work exchange or a level cannot forge where, when, as whom, under
//! which id or how often the bridge delivers. Without a key nothing is signed or checked.
//!
//! The signature (`delay-bridge-signature`) is the one versions before 0.2 wrote: the HMAC
//! of the bridge headers and the body. What else the bridge acts on is brought under it by
//! a bridge header of its own, `delay-bridge-acted-on`: the SHA-256 of the `message_id`,
//! `CC`, `BCC` and `x-repeat-*` headers. An older bridge on the same prefix checks the
//! signature as it always did (the new header is one more bridge header to it); this one
//! also checks that the digest matches what the copy carries. Removing the header breaks
//! the signature. A copy without it (signed by an older version) is accepted only while
//! `bridge.accept_unsigned_state` is set: its id and rule could have been changed. The body
//! is read once, by the HMAC.
//!
//! What is signed, in order: for each bridge header but the signature itself, by name (the
//! table is sorted), its name and its value in a canonical form that does not depend on
//! which AMQP integer or string type carried it; then the body. The digest takes the
//! `message_id` and the acted-on headers, by name, in the same canonical form. Each part is
//! length-prefixed, so no two different copies sign the same bytes.

use hmac::{Hmac, Mac};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use sha2::digest::Update;
use sha2::{Digest, Sha256};

use super::value::as_integer;
use super::{ParkReason, Parked, header};

type HmacSha256 = Hmac<Sha256>;

/// The shortest key accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 16;

/// The keys the state is signed and checked with: the current one signs; a copy signed
/// with the previous one (during a key rotation) is still accepted.
#[derive(Clone, PartialEq, Eq)]
pub struct StateKeys {
    current: Vec<u8>,
    previous: Option<Vec<u8>>,
}

impl std::fmt::Debug for StateKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateKeys(<redacted>)")
    }
}

/// How a copy's state passed [`StateKeys::verify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust {
    /// Signed by a bridge of this version with a configured key: everything it acts on is
    /// the bridge's own.
    Signed,
    /// Not signed, or signed by a version before 0.2, and accepted because
    /// `bridge.accept_unsigned_state` is set: carried, but not vouched for (a parked copy
    /// of it is not signed, so never replayed).
    Accepted,
}

impl StateKeys {
    /// Keys from their bytes; `None` when one is shorter than [`MIN_KEY_BYTES`].
    pub fn new(current: &[u8], previous: Option<&[u8]>) -> Option<Self> {
        let long_enough = |key: &[u8]| key.len() >= MIN_KEY_BYTES;
        if !long_enough(current) || previous.is_some_and(|key| !long_enough(key)) {
            return None;
        }
        Some(Self {
            current: current.to_vec(),
            previous: previous.map(<[u8]>::to_vec),
        })
    }

    /// `properties` with the digest of what the bridge acts on and the signature of
    /// `properties` and `body` set (replacing any there).
    pub fn sign(&self, properties: BasicProperties, body: &[u8]) -> BasicProperties {
        let mut headers = properties
            .headers()
            .as_ref()
            .map(|h| h.inner().clone())
            .unwrap_or_default();
        headers.remove(header::STATE_SIGNATURE);
        let mut table = FieldTable::from(headers);
        let digest = acted_on_digest(&table, &properties);
        table.insert(
            ShortString::from(header::STATE_ACTED_ON),
            AMQPValue::LongString(LongString::from(hex::encode(digest))),
        );
        let signature = mac(&self.current, &table, body).finalize().into_bytes();
        table.insert(
            ShortString::from(header::STATE_SIGNATURE),
            AMQPValue::LongString(LongString::from(hex::encode(signature))),
        );
        properties.with_headers(table)
    }

    /// Whether the signature of a copy with `properties` and `body` is valid under the
    /// current or the previous key, and its digest matches what it carries; else the
    /// reason to park it. A copy signed by an older version (no digest) or not signed at
    /// all is [`Trust::Accepted`] only when `accept_unsigned` (while a key is being
    /// introduced, or during an upgrade from a version before 0.2).
    pub fn verify(
        &self,
        properties: &BasicProperties,
        body: &[u8],
        accept_unsigned: bool,
    ) -> Result<Trust, Parked> {
        let empty = FieldTable::default();
        let table = properties.headers().as_ref().unwrap_or(&empty);
        let bad = |why: &str| Err(Parked::new(ParkReason::BadState, why.to_string()));
        let Some(given) = table.inner().get(header::STATE_SIGNATURE) else {
            if accept_unsigned {
                return Ok(Trust::Accepted);
            }
            return bad("the bridge state is not signed (bridge.state_key is set)");
        };
        let given = match given {
            AMQPValue::LongString(text) => hex::decode(text.as_bytes()).ok(),
            AMQPValue::ShortString(text) => hex::decode(text.as_str()).ok(),
            _ => None,
        };
        let valid = given.is_some_and(|given| {
            std::iter::once(&self.current)
                .chain(self.previous.as_ref())
                .any(|key| mac(key, table, body).verify_slice(&given).is_ok())
        });
        if !valid {
            return bad(
                "the bridge state's signature does not match (forged or changed, or signed \
                 with another bridge.state_key)",
            );
        }
        let Some(carried) = table.inner().get(header::STATE_ACTED_ON) else {
            if accept_unsigned {
                return Ok(Trust::Accepted);
            }
            return bad(
                "the bridge state carries only the signature of a version before 0.2, which \
                 leaves its message id and rule unsigned (accepted only while \
                 bridge.accept_unsigned_state is set)",
            );
        };
        let matches = match carried {
            AMQPValue::LongString(text) => hex::decode(text.as_bytes()).ok(),
            AMQPValue::ShortString(text) => hex::decode(text.as_str()).ok(),
            _ => None,
        }
        .is_some_and(|carried| carried[..] == acted_on_digest(table, properties)[..]);
        if matches {
            Ok(Trust::Signed)
        } else {
            bad(
                "its message id, CC, BCC or x-repeat-* rule changed after the bridge signed \
                 it",
            )
        }
    }
}

/// Whether a publisher header is one the bridge acts on in flight, and so under the
/// signature: `CC`, `BCC` (extra routing keys at the target) and the recurring rule
/// (`x-repeat-*`).
fn acted_on(name: &str) -> bool {
    name == header::CC || name == header::BCC || name.starts_with(REPEAT_PREFIX)
}

/// The prefix of the recurring rule's headers.
const REPEAT_PREFIX: &str = "x-repeat-";

/// The SHA-256 of what the bridge acts on besides its own headers: the `message_id` of
/// `properties` and the acted-on headers of `table`.
fn acted_on_digest(table: &FieldTable, properties: &BasicProperties) -> [u8; 32] {
    let mut digest = Sha256::new();
    match properties.message_id() {
        Some(id) => {
            Update::update(&mut digest, b"s");
            part(&mut digest, id.as_str().as_bytes());
        }
        None => Update::update(&mut digest, b"-"),
    }
    for (name, value) in table.inner() {
        if acted_on(name.as_str()) {
            part(&mut digest, name.as_str().as_bytes());
            canonical(&mut digest, value);
        }
    }
    digest.finalize().into()
}

/// The HMAC of the bridge headers of `table` (but the signature) and `body`, not yet
/// finalized.
fn mac(key: &[u8], table: &FieldTable, body: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    for (name, value) in table.inner() {
        let name = name.as_str();
        if !name.starts_with(header::BRIDGE_PREFIX) || name == header::STATE_SIGNATURE {
            continue;
        }
        part(&mut mac, name.as_bytes());
        canonical(&mut mac, value);
    }
    part(&mut mac, body);
    mac
}

/// `bytes`, preceded by their length.
fn part(hash: &mut impl Update, bytes: &[u8]) {
    hash.update(&(bytes.len() as u64).to_be_bytes());
    hash.update(bytes);
}

/// A header value as a type tag and its content: every integer type as one, every string
/// type as one, arrays item by item; any other type by its debug form.
fn canonical(hash: &mut impl Update, value: &AMQPValue) {
    if let Some(integer) = as_integer(value) {
        hash.update(b"i");
        hash.update(&integer.to_be_bytes());
        return;
    }
    match value {
        AMQPValue::LongString(text) => {
            hash.update(b"s");
            part(hash, text.as_bytes());
        }
        AMQPValue::ShortString(text) => {
            hash.update(b"s");
            part(hash, text.as_str().as_bytes());
        }
        AMQPValue::FieldArray(items) => {
            hash.update(b"a");
            hash.update(&(items.as_slice().len() as u64).to_be_bytes());
            for item in items.as_slice() {
                canonical(hash, item);
            }
        }
        other => {
            hash.update(b"x");
            part(hash, format!("{other:?}").as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldArray;
    use proptest::prelude::*;

    fn keys() -> StateKeys {
        StateKeys::new(b"0123456789abcdef0123456789abcdef", None).unwrap()
    }

    fn state(target: &str, due: i64) -> BasicProperties {
        let mut headers = std::collections::BTreeMap::new();
        headers.insert(
            ShortString::from(header::STATE_TARGET),
            AMQPValue::LongString(target.into()),
        );
        headers.insert(
            ShortString::from(header::STATE_DELIVER_AT),
            AMQPValue::LongLongInt(due),
        );
        headers.insert(
            ShortString::from("x-death"),
            AMQPValue::FieldArray(FieldArray::default()),
        );
        headers.insert(
            ShortString::from("publisher-header"),
            AMQPValue::LongString("kept".into()),
        );
        BasicProperties::default().with_headers(FieldTable::from(headers))
    }

    fn with_header(properties: &BasicProperties, name: &str, value: AMQPValue) -> BasicProperties {
        let mut headers = properties.headers().as_ref().unwrap().inner().clone();
        headers.insert(ShortString::from(name), value);
        properties.clone().with_headers(FieldTable::from(headers))
    }

    #[test]
    fn a_signed_copy_verifies_and_any_change_of_state_or_body_does_not() {
        let keys = keys();
        let signed = keys.sign(state("orders", 1_000), b"body");
        assert_eq!(keys.verify(&signed, b"body", false), Ok(Trust::Signed));
        // Forged: another target, another due time, another body, a state header added.
        let other_target = with_header(
            &signed,
            header::STATE_TARGET,
            AMQPValue::LongString("payments".into()),
        );
        let earlier = with_header(&signed, header::STATE_DELIVER_AT, AMQPValue::LongLongInt(1));
        let as_someone = with_header(
            &signed,
            header::STATE_USER_ID,
            AMQPValue::LongString("admin".into()),
        );
        for forged in [&other_target, &earlier, &as_someone] {
            let parked = keys.verify(forged, b"body", false).unwrap_err();
            assert_eq!(parked.reason, ParkReason::BadState);
        }
        assert!(keys.verify(&signed, b"other body", false).is_err());
        // Another key's signature.
        let other = StateKeys::new(b"another key of 16+ bytes", None).unwrap();
        assert!(other.verify(&signed, b"body", false).is_err());
    }

    #[test]
    fn what_the_broker_adds_or_retypes_does_not_break_it() {
        let keys = keys();
        let signed = keys.sign(state("orders", 1_000), b"body");
        // Dead-lettering adds x-death; a quorum queue adds x-delivery-count; a publisher
        // header is not the bridge's state.
        let mut travelled = with_header(
            &signed,
            "x-first-death-queue",
            AMQPValue::LongString("q".into()),
        );
        travelled = with_header(
            &travelled,
            header::DELIVERY_COUNT,
            AMQPValue::LongLongInt(2),
        );
        travelled = with_header(
            &travelled,
            "publisher-header",
            AMQPValue::LongString("other".into()),
        );
        // The same integer and string in other AMQP types.
        travelled = with_header(
            &travelled,
            header::STATE_DELIVER_AT,
            AMQPValue::LongUInt(1_000),
        );
        travelled = with_header(
            &travelled,
            header::STATE_TARGET,
            AMQPValue::ShortString("orders".into()),
        );
        assert_eq!(keys.verify(&travelled, b"body", false), Ok(Trust::Signed));
    }

    #[test]
    fn unsigned_copies_are_parked_unless_accepted_and_the_previous_key_still_verifies() {
        let keys = keys();
        let unsigned = state("orders", 1_000);
        assert!(keys.verify(&unsigned, b"", false).is_err());
        assert_eq!(keys.verify(&unsigned, b"", true), Ok(Trust::Accepted));
        let old = StateKeys::new(b"the previous key, 16+ bytes", None).unwrap();
        let rotated = StateKeys::new(
            b"0123456789abcdef0123456789abcdef",
            Some(b"the previous key, 16+ bytes"),
        )
        .unwrap();
        let signed_before = old.sign(unsigned.clone(), b"");
        assert_eq!(
            rotated.verify(&signed_before, b"", false),
            Ok(Trust::Signed)
        );
        assert!(keys.verify(&signed_before, b"", false).is_err());
        // A garbled signature is a bad one, never a panic.
        let garbled = with_header(
            &signed_before,
            header::STATE_SIGNATURE,
            AMQPValue::LongString("zz".into()),
        );
        assert!(rotated.verify(&garbled, b"", false).is_err());
        assert!(StateKeys::new(b"too short", None).is_none());
        assert_eq!(format!("{keys:?}"), "StateKeys(<redacted>)");
    }

    /// A copy signed as a version before 0.2 signed it: no digest.
    fn signed_as_before(
        keys: &StateKeys,
        properties: BasicProperties,
        body: &[u8],
    ) -> BasicProperties {
        let table = properties.headers().clone().unwrap_or_default();
        let signature = hex::encode(mac(&keys.current, &table, body).finalize().into_bytes());
        with_header(
            &properties,
            header::STATE_SIGNATURE,
            AMQPValue::LongString(signature.into()),
        )
    }

    #[test]
    fn the_message_id_cc_bcc_and_the_rule_are_signed_too() {
        let keys = keys();
        let copy = with_header(
            &state("orders", 1_000).with_message_id("order-1".into()),
            "x-repeat-every",
            AMQPValue::LongString("1h".into()),
        );
        let signed = keys.sign(copy, b"body");
        assert_eq!(keys.verify(&signed, b"body", false), Ok(Trust::Signed));
        let changed = [
            signed.clone().with_message_id("someone-else".into()),
            with_header(
                &signed,
                "CC",
                AMQPValue::LongString("refund.approved".into()),
            ),
            with_header(&signed, "BCC", AMQPValue::LongString("audit".into())),
            with_header(
                &signed,
                "x-repeat-every",
                AMQPValue::LongString("1s".into()),
            ),
            with_header(&signed, "x-repeat-count", AMQPValue::LongLongInt(1_000_000)),
        ];
        for forged in &changed {
            let parked = keys.verify(forged, b"body", false).unwrap_err();
            assert_eq!(parked.reason, ParkReason::BadState, "{forged:?}");
        }
        // What the bridge does not act on may change on the way, as before.
        let other = with_header(&signed, "publisher-header", AMQPValue::LongLongInt(7));
        assert_eq!(keys.verify(&other, b"body", false), Ok(Trust::Signed));
    }

    #[test]
    fn an_older_version_verifies_what_this_one_signs_and_its_own_copies_need_the_upgrade_switch() {
        let keys = keys();
        let signed = keys.sign(state("orders", 1_000).with_message_id("m".into()), b"body");
        // An older version checks the signature over every bridge header but itself: the
        // digest included.
        let table = signed.headers().clone().unwrap();
        let signature = match table.inner().get(header::STATE_SIGNATURE) {
            Some(AMQPValue::LongString(text)) => hex::decode(text.as_bytes()).unwrap(),
            other => panic!("no signature: {other:?}"),
        };
        assert!(table.inner().contains_key(header::STATE_ACTED_ON));
        assert!(
            mac(&keys.current, &table, b"body")
                .verify_slice(&signature)
                .is_ok()
        );
        // What an older version signed: only while unsigned state is accepted, and then
        // still checked.
        let before = signed_as_before(&keys, state("orders", 1_000), b"body");
        let refused = keys.verify(&before, b"body", false).unwrap_err();
        assert!(refused.detail.contains("before 0.2"), "{}", refused.detail);
        assert_eq!(keys.verify(&before, b"body", true), Ok(Trust::Accepted));
        let forged_before = with_header(
            &before,
            header::STATE_TARGET,
            AMQPValue::LongString("x".into()),
        );
        assert!(keys.verify(&forged_before, b"body", true).is_err());
        // Stripping the digest from a copy this version signed does not downgrade it: the
        // signature covered it.
        let mut stripped = signed.headers().clone().unwrap().inner().clone();
        stripped.remove(header::STATE_ACTED_ON);
        let stripped = signed.clone().with_headers(FieldTable::from(stripped));
        assert!(keys.verify(&stripped, b"body", false).is_err());
        assert!(keys.verify(&stripped, b"body", true).is_err());
    }

    proptest! {
        /// Any body and due time signs and verifies; flipping any byte of the body does
        /// not.
        #[test]
        fn any_change_of_the_body_is_caught(
            body in prop::collection::vec(any::<u8>(), 1..512),
            due in any::<i64>(),
            flip in any::<prop::sample::Index>(),
        ) {
            let keys = keys();
            let signed = keys.sign(state("orders", due), &body);
            prop_assert!(keys.verify(&signed, &body, false).is_ok());
            let mut changed = body.clone();
            let at = flip.index(changed.len());
            changed[at] ^= 0x01;
            prop_assert!(keys.verify(&signed, &changed, false).is_err());
        }
    }
}
