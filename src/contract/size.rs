//! How many bytes a message's properties take on the wire. A content header must fit in one
//! frame: one that does not makes the broker close the whole connection.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

/// Frame overhead around a payload: type (1), channel (2), size (4) and the end octet (1).
const FRAME_OVERHEAD: usize = 8;
/// A content header's fixed part: class (2), weight (2), body size (8), property flags (2).
const CONTENT_HEADER_FIXED: usize = 14;

/// The size of the frame that carries a message with these properties' content header.
pub fn content_header_frame_len(properties: &BasicProperties) -> usize {
    FRAME_OVERHEAD + CONTENT_HEADER_FIXED + properties_len(properties)
}

/// True when a message with these properties fits a connection whose `frame_max` is this.
pub fn fits_frame(properties: &BasicProperties, frame_max: u32) -> bool {
    frame_max == 0 || content_header_frame_len(properties) <= frame_max as usize
}

fn properties_len(p: &BasicProperties) -> usize {
    let short =
        |s: &Option<lapin::types::ShortString>| s.as_ref().map_or(0, |s| 1 + s.as_str().len());
    short(p.content_type())
        + short(p.content_encoding())
        + short(p.correlation_id())
        + short(p.reply_to())
        + short(p.expiration())
        + short(p.message_id())
        + short(p.kind())
        + short(p.user_id())
        + short(p.app_id())
        + short(p.cluster_id())
        + p.delivery_mode().map_or(0, |_| 1)
        + p.priority().map_or(0, |_| 1)
        + p.timestamp().map_or(0, |_| 8)
        + p.headers().as_ref().map_or(0, table_len)
}

/// A field table's encoded size, without recursion (a hostile table may be nested deeply).
/// Scalars are counted where they stand; only nested tables and arrays wait on a stack,
/// so a flat table (every header the bridge writes) is measured without allocating.
fn table_len(table: &FieldTable) -> usize {
    let mut nested: Vec<Nested<'_>> = Vec::new();
    let mut len = entries_len(table, &mut nested);
    while let Some(next) = nested.pop() {
        len += match next {
            Nested::Table(table) => entries_len(table, &mut nested),
            Nested::Array(items) => items
                .iter()
                .map(|value| value_len(value, &mut nested))
                .sum(),
        };
    }
    len
}

/// A table or array inside a table, measured after the entries around it.
enum Nested<'a> {
    Table(&'a FieldTable),
    Array(&'a [AMQPValue]),
}

/// A table's length prefix and its entries, a nested table's or array's contents left on
/// `nested`.
fn entries_len<'a>(table: &'a FieldTable, nested: &mut Vec<Nested<'a>>) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(key, value)| 1 + key.as_str().len() + value_len(value, nested))
        .sum::<usize>()
}

/// A value's type tag and encoding, a nested table's or array's contents left on `nested`.
fn value_len<'a>(value: &'a AMQPValue, nested: &mut Vec<Nested<'a>>) -> usize {
    1 + match value {
        AMQPValue::Void => 0,
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::FieldArray(items) => {
            nested.push(Nested::Array(items.as_slice()));
            4
        }
        AMQPValue::FieldTable(inner) => {
            nested.push(Nested::Table(inner));
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{DecimalValue, FieldArray, LongString};

    #[test]
    fn sizes_match_the_wire_encoding() {
        assert_eq!(content_header_frame_len(&BasicProperties::default()), 22);
        let mut nested = FieldTable::default();
        nested.insert("i".into(), AMQPValue::LongInt(1)); // 1+1 + 1+4
        let mut headers = FieldTable::default();
        headers.insert("s".into(), AMQPValue::LongString(LongString::from("abc"))); // 2 + 1+4+3
        headers.insert("t".into(), AMQPValue::FieldTable(nested)); // 2 + 1 + 4+7
        headers.insert(
            "a".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::Boolean(true),
                AMQPValue::DecimalValue(DecimalValue { scale: 1, value: 5 }),
            ])),
        ); // 2 + 1 + 4 + (1+1) + (1+5)
        let props = BasicProperties::default()
            .with_message_id("m-1".into()) // 1+3
            .with_delivery_mode(2) // 1
            .with_timestamp(1) // 8
            .with_headers(headers); // 4 + 10 + 14 + 15
        assert_eq!(
            content_header_frame_len(&props),
            22 + 4 + 1 + 8 + 4 + 10 + 14 + 15
        );
    }

    #[test]
    fn a_frame_of_131_072_bytes_holds_a_header_payload_of_131_064() {
        let pad = |n: usize| {
            let mut headers = FieldTable::default();
            headers.insert(
                "p".into(),
                AMQPValue::LongString(LongString::from(vec![b'x'; n])),
            );
            BasicProperties::default().with_headers(headers)
        };
        // payload = 14 + table (4 + 1+1 + 1 + 4 + n) = 25 + n
        assert!(fits_frame(&pad(131_064 - 25), 131_072));
        assert!(!fits_frame(&pad(131_064 - 24), 131_072));
        assert!(fits_frame(&pad(1 << 20), 0), "0 means no limit");
    }
}
