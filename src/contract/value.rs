//! Reading AMQP header values: `x-delay` exactly as the delayed-message plugin reads it,
//! `x-deliver-at` and `x-published-at` as epoch milliseconds or RFC 3339, integers of any
//! width, text.

use lapin::types::AMQPValue;

/// Epoch milliseconds before this (September 2001) in `x-deliver-at` are taken for seconds.
const EARLIEST_DELIVER_AT_MS: i64 = 1_000_000_000_000;

/// Reads `x-delay` as the delayed-message plugin does: any integer type, a string of
/// (optionally signed) digits, a float or decimal truncated toward zero. Huge values
/// saturate (and are then refused as too long). Anything else is an error with a reason.
pub fn parse_delay(value: &AMQPValue) -> Result<i128, String> {
    parse_delay_in(super::header::DELAY, value)
}

/// As [`parse_delay`], for the header `name` (`x-opt-delivery-delay` reads the same way).
pub fn parse_delay_in(name: &str, value: &AMQPValue) -> Result<i128, String> {
    if let Some(v) = as_integer(value) {
        return Ok(i128::from(v));
    }
    match value {
        AMQPValue::Float(f) => float_delay(name, f64::from(*f)),
        AMQPValue::Double(f) => float_delay(name, *f),
        AMQPValue::DecimalValue(d) => {
            Ok(i128::from(d.value) / 10i128.pow(u32::from(d.scale.min(30))))
        }
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
            let text = as_text(value).unwrap_or_default();
            parse_signed_digits(&text)
                .ok_or_else(|| format!("{name} {text:?} is not a whole number of milliseconds"))
        }
        other => Err(format!(
            "{name} must be an integer or a string of digits, got {}",
            type_name(other)
        )),
    }
}

fn float_delay(name: &str, f: f64) -> Result<i128, String> {
    if f.is_finite() {
        Ok(f.trunc().clamp(i128::MIN as f64, i128::MAX as f64) as i128)
    } else {
        Err(format!("{name} {f} is not a finite number"))
    }
}

/// `[+-]?[0-9]+`, saturating far beyond any useful delay.
fn parse_signed_digits(text: &str) -> Option<i128> {
    let (negative, digits) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let magnitude = if digits.len() > 30 {
        i128::MAX
    } else {
        digits.parse::<i128>().ok()?
    };
    Some(if negative { -magnitude } else { magnitude })
}

/// Reads `x-deliver-at`: epoch milliseconds (an integer, or a string of digits) or an
/// RFC 3339 timestamp. Epoch values before 2001 are refused as probably seconds.
pub fn parse_deliver_at(value: &AMQPValue) -> Result<i64, String> {
    parse_deliver_at_in(super::header::DELIVER_AT, value)
}

/// As [`parse_deliver_at`], for the header `name`. `x-opt-delivery-time` reads the same
/// way, and also as an AMQP 0-9-1 timestamp (whole seconds, which RabbitMQ turns into
/// milliseconds when it carries the value to AMQP 1.0).
pub fn parse_deliver_at_in(name: &str, value: &AMQPValue) -> Result<i64, String> {
    let epoch_ms = |v: i64| {
        if v < EARLIEST_DELIVER_AT_MS {
            Err(format!(
                "{name} {v} is before 2001 as epoch milliseconds (seconds instead of milliseconds?)"
            ))
        } else {
            Ok(v)
        }
    };
    if let Some(v) = as_integer(value) {
        return epoch_ms(v);
    }
    match value {
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
            let text = as_text(value).unwrap_or_default();
            if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
                return text
                    .parse::<i64>()
                    .map_err(|_| format!("{name} {text:?} is out of range"))
                    .and_then(epoch_ms);
            }
            chrono::DateTime::parse_from_rfc3339(text.trim())
                .map(|t| t.timestamp_millis())
                .map_err(|e| {
                    format!(
                        "{name} {text:?} is neither epoch milliseconds nor an RFC 3339 time ({e})"
                    )
                })
        }
        AMQPValue::Timestamp(seconds) if name == super::header::OPT_DELIVERY_TIME => {
            i64::try_from(*seconds)
                .ok()
                .and_then(|s| s.checked_mul(1000))
                .ok_or_else(|| format!("{name} timestamp {seconds} s is out of range"))
                .and_then(epoch_ms)
        }
        other => Err(format!(
            "{name} must be epoch milliseconds or an RFC 3339 string, got {}",
            type_name(other)
        )),
    }
}

/// Reads `x-published-at`: epoch milliseconds as any integer type or a string of digits,
/// from 2001 on (an earlier value is probably seconds).
pub fn parse_published_at(value: &AMQPValue) -> Result<u64, String> {
    let v = match as_integer(value) {
        Some(v) => v,
        None => as_text(value)
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|t| t.parse::<i64>().ok())
            .ok_or_else(|| {
                format!(
                    "x-published-at must be epoch milliseconds (an integer), got {}",
                    match value {
                        AMQPValue::LongString(_) | AMQPValue::ShortString(_) =>
                            format!("{:?}", as_text(value).unwrap_or_default()),
                        other => type_name(other).to_string(),
                    }
                )
            })?,
    };
    if v < EARLIEST_DELIVER_AT_MS {
        return Err(format!(
            "x-published-at {v} is before 2001 as epoch milliseconds (seconds instead of milliseconds?)"
        ));
    }
    Ok(v as u64)
}

/// Any AMQP integer type, widened. `LongLongUInt` above `i64::MAX` saturates.
pub(crate) fn as_integer(value: &AMQPValue) -> Option<i64> {
    Some(match value {
        AMQPValue::ShortShortInt(v) => i64::from(*v),
        AMQPValue::ShortShortUInt(v) => i64::from(*v),
        AMQPValue::ShortInt(v) => i64::from(*v),
        AMQPValue::ShortUInt(v) => i64::from(*v),
        AMQPValue::LongInt(v) => i64::from(*v),
        AMQPValue::LongUInt(v) => i64::from(*v),
        AMQPValue::LongLongInt(v) => *v,
        _ => return None,
    })
}

pub(crate) fn as_text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

fn type_name(value: &AMQPValue) -> &'static str {
    match value {
        AMQPValue::Boolean(_) => "a boolean",
        AMQPValue::FieldTable(_) => "a table",
        AMQPValue::FieldArray(_) => "an array",
        AMQPValue::ByteArray(_) => "a byte array",
        AMQPValue::Timestamp(_) => "a timestamp",
        AMQPValue::Void => "void",
        _ => "a value of another type",
    }
}
