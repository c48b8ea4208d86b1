//! The wall clock: the only place that reads it. Everything else takes the time as a
//! parameter (pure code) or asks here (I/O code).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Wall-clock now, epoch milliseconds.
pub fn now_ms() -> u64 {
    now_since_epoch().as_millis() as u64
}

/// Wall-clock now as the time since the epoch, with the clock's full precision.
pub fn now_since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// How long from now until the epoch-ms instant `at` (zero if it has passed), measured
/// with the clock's full precision.
pub fn until_epoch_ms(at: u64) -> Duration {
    (UNIX_EPOCH + Duration::from_millis(at))
        .duration_since(SystemTime::now())
        .unwrap_or_default()
}
