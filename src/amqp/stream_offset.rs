//! The `x-stream-offset` the broker stamps on every delivery from a stream, read from
//! properties the codec read, or by hand from property bytes it could not read (a header
//! name that is not UTF-8 fails the whole table).

use lapin::BasicProperties;
use lapin::types::AMQPValue;

/// The offset in properties the codec read.
pub(crate) fn stream_offset(properties: &BasicProperties) -> Option<u64> {
    match properties
        .headers()
        .as_ref()?
        .inner()
        .get("x-stream-offset")?
    {
        AMQPValue::LongLongInt(v) if *v >= 0 => Some(*v as u64),
        AMQPValue::LongInt(v) if *v >= 0 => Some(*v as u64),
        _ => None,
    }
}

/// The `x-stream-offset` header in raw content-header properties (flags, then the
/// properties), read without lapin's parser, which refuses the whole table when one of its
/// names is not UTF-8.
pub(crate) fn raw_stream_offset(properties: &[u8]) -> Option<u64> {
    let flags = u16::from_be_bytes(properties.get(..2)?.try_into().ok()?);
    let mut at = 2;
    // content-type and content-encoding come before the headers.
    for bit in [15, 14] {
        if flags & (1 << bit) != 0 {
            at += 1 + usize::from(*properties.get(at)?);
        }
    }
    if flags & (1 << 13) == 0 {
        return None;
    }
    let len = u32::from_be_bytes(properties.get(at..at + 4)?.try_into().ok()?) as usize;
    let table = properties.get(at + 4..(at + 4).checked_add(len)?)?;
    let mut i = 0;
    while i < table.len() {
        let name_len = usize::from(*table.get(i)?);
        let name = table.get(i + 1..i + 1 + name_len)?;
        let tag = *table.get(i + 1 + name_len)?;
        i += 2 + name_len;
        let value = table.get(i..)?;
        if name == b"x-stream-offset" {
            return match tag {
                b'l' => u64::try_from(i64::from_be_bytes(value.get(..8)?.try_into().ok()?)).ok(),
                b'I' => u64::try_from(i32::from_be_bytes(value.get(..4)?.try_into().ok()?)).ok(),
                _ => None,
            };
        }
        i += value_len(tag, value)?;
    }
    None
}

/// The encoded length of a field value of type `tag` at the start of `value`.
fn value_len(tag: u8, value: &[u8]) -> Option<usize> {
    Some(match tag {
        b'V' => 0,
        b't' | b'b' | b'B' => 1,
        b's' | b'u' => 2,
        b'I' | b'i' | b'f' => 4,
        b'D' => 5,
        b'l' | b'L' | b'd' | b'T' => 8,
        b'S' | b'A' | b'F' | b'x' => {
            4 + u32::from_be_bytes(value.get(..4)?.try_into().ok()?) as usize
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::basic;

    #[test]
    fn the_stream_offset_is_read_past_a_name_lapin_refuses() {
        let mut table = Vec::new();
        for (name, tag, value) in [
            (&[0xffu8, 0xfe][..], b'S', &[0, 0, 0, 2, 0xc3, 0x28][..]),
            (b"n", b'F', &[0, 0, 0, 0][..]),
            (b"x-stream-offset", b'l', &42i64.to_be_bytes()[..]),
        ] {
            table.push(name.len() as u8);
            table.extend_from_slice(name);
            table.push(tag);
            table.extend_from_slice(value);
        }
        // content-type "t", then the headers.
        let mut properties = ((1u16 << 15) | (1u16 << 13)).to_be_bytes().to_vec();
        properties.extend([1, b't']);
        properties.extend((table.len() as u32).to_be_bytes());
        properties.extend(&table);
        assert!(
            basic::parse_properties(&properties[..]).is_err(),
            "lapin refuses it"
        );
        assert_eq!(raw_stream_offset(&properties), Some(42));
        assert_eq!(raw_stream_offset(&properties[..properties.len() - 1]), None);
        assert_eq!(raw_stream_offset(&0u16.to_be_bytes()), None, "no headers");
    }
}
