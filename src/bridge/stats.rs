//! The bridge's counters: [`Stats`] (live, shared with its tasks) and [`Counts`] (a
//! reading of them), declared from one list with the Prometheus metric each is exported as.

use std::sync::atomic::{AtomicU64, Ordering};

/// Declares [`Stats`] (the live counters, shared with the bridge's tasks) and [`Counts`] (a
/// reading of them) from one list, so the two cannot drift apart. Each entry names the
/// Prometheus metric it is exported as (a counter or a gauge; `seconds_of_ms`: a gauge in
/// seconds of a value kept in ms; `none`: exported otherwise),
/// and its doc comment is that metric's help text.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident: $kind:ident $metric:literal,)*) => {
        /// Counters of what the bridge did, updated as it works; read them with
        /// [`Stats::snapshot`].
        #[derive(Debug, Default)]
        pub struct Stats {
            $($(#[doc = $doc])* pub(crate) $name: AtomicU64,)*
        }

        /// What the bridge had done when [`Stats::snapshot`] was called.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct Counts {
            $($(#[doc = $doc])* pub $name: u64,)*
        }

        impl Stats {
            /// Every counter now (each read on its own, not as one atomic reading).
            pub fn snapshot(&self) -> Counts {
                Counts {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }

        impl Counts {
            /// Sets each exported metric of `recorder` to this reading.
            pub fn export(&self, recorder: &dyn metrics::Recorder) {
                $(export!($kind, recorder, $metric, concat!($($doc),*), self.$name);)*
            }
        }
    };
}

/// One entry of [`counters!`] into a metrics recorder.
macro_rules! export {
    (counter, $recorder:expr, $metric:literal, $help:expr, $value:expr) => {
        $recorder.describe_counter(
            metrics::KeyName::from_const_str($metric),
            None,
            metrics::SharedString::from($help.trim().to_string()),
        );
        metrics::Recorder::register_counter(
            $recorder,
            &metrics::Key::from_static_name($metric),
            &metrics::Metadata::new(module_path!(), metrics::Level::INFO, None),
        )
        .absolute($value);
    };
    (gauge, $recorder:expr, $metric:literal, $help:expr, $value:expr) => {
        $recorder.describe_gauge(
            metrics::KeyName::from_const_str($metric),
            None,
            metrics::SharedString::from($help.trim().to_string()),
        );
        metrics::Recorder::register_gauge(
            $recorder,
            &metrics::Key::from_static_name($metric),
            &metrics::Metadata::new(module_path!(), metrics::Level::INFO, None),
        )
        .set($value as f64);
    };
    (seconds_of_ms, $recorder:expr, $metric:literal, $help:expr, $value:expr) => {
        $recorder.describe_gauge(
            metrics::KeyName::from_const_str($metric),
            Some(metrics::Unit::Seconds),
            metrics::SharedString::from($help.trim().to_string()),
        );
        metrics::Recorder::register_gauge(
            $recorder,
            &metrics::Key::from_static_name($metric),
            &metrics::Metadata::new(module_path!(), metrics::Level::INFO, None),
        )
        .set($value as f64 / 1_000.0);
    };
    (none, $recorder:expr, $metric:literal, $help:expr, $value:expr) => {};
}

counters! {
    /// Deliveries consumed from the work queue.
    consumed: counter "delay_bridge_consumed_total",
    /// Hops published into level queues (confirmed), alone or in a bundle.
    hops: counter "delay_bridge_hops_total",
    /// Bundles published into level queues (confirmed): each carries the hops of one
    /// `bridge.hop_window` into one level (`bridge.bundle_hops`).
    bundles: counter "delay_bridge_bundles_total",
    /// Bundles that came back from a level and were passed on whole into the next (every
    /// message in them went there): counted in `bundles` too.
    passed_whole: counter "delay_bridge_bundles_passed_whole_total",
    /// Messages published to their target (confirmed).
    delivered: counter "delay_bridge_delivered_total",
    /// Messages parked (confirmed); exported by reason as `delay_bridge_parked_total`.
    parked: none "",
    /// Messages waiting on a hold timer now.
    held: gauge "delay_bridge_held_messages",
    /// Deliveries consumed and not yet acked or given back now.
    in_flight: gauge "delay_bridge_in_flight_messages",
    /// Deliveries given back to the broker unprocessed (shutdown or a failed session).
    released: counter "delay_bridge_released_total",
    /// Publishes the broker refused (nack) and that were retried.
    nacks: counter "delay_bridge_nacks_total",
    /// Publishes tried again for any reason: refused (nack), unanswered (a lost channel or
    /// no confirm in time), or refused by the broker (403, 404, 406) fewer times than it
    /// takes to park.
    retries: counter "delay_bridge_publish_retries_total",
    /// Sessions that ended with an error and were reconnected.
    reconnects: counter "delay_bridge_reconnects_total",
    /// Copies dropped because their message was cancelled.
    cancelled: counter "delay_bridge_cancelled_total",
    /// Live tombstones in memory now.
    tombstones: gauge "delay_bridge_tombstones",
    /// Cancel-stream entries read before the bridge was last ready: the stretch read to find
    /// the newest checkpoint, the checkpoint, and the entries after it (all of them when the
    /// stream has no checkpoint).
    catch_up_entries: gauge "delay_bridge_cancel_catch_up_entries",
    /// Checkpoints of the cancel state this bridge wrote to the cancel stream.
    checkpoints: counter "delay_bridge_checkpoints_total",
    /// Cancel-stream entries skipped because the broker could not send them to an AMQP
    /// 0-9-1 reader (each closed the reader's connection; warned of with its offset).
    stream_skipped: counter "delay_bridge_cancel_stream_skipped_total",
    /// How far this bridge's clock is behind the times other bridges write into the cancel
    /// stream (0: not behind), measured on what it read in the last 20 to 40 minutes. It
    /// judges cancels dated ahead by its clock corrected by up to a minute; further behind,
    /// it writes no clamp.
    clock_behind_ms: seconds_of_ms "delay_bridge_clock_behind_stream_seconds",
    /// Times the consumer was paused because unacked bodies went over
    /// `bridge.max_unacked_bytes` (its prefetch window narrowed).
    pauses: counter "delay_bridge_consumer_pauses_total",
    /// The most bytes of unacked deliveries held at once so far: their bodies, and 1 KiB
    /// for each message of a bundle.
    max_unacked_bytes_seen: gauge "delay_bridge_max_unacked_bytes",
    /// The prefetch window of the work queue's consumer now: `bridge.prefetch`, or fewer
    /// while large bodies narrow it to fit its share of `bridge.max_unacked_bytes`.
    work_window: gauge "delay_bridge_work_window",
    /// The prefetch window of the returns queue's consumer now (as `work_window`).
    returns_window: gauge "delay_bridge_returns_window",
    /// 1 while hops travel in bundles (`bridge.bundle_hops`, and every instance on the
    /// prefix reads bundles), else 0: the carriers read it to decide.
    bundling: gauge "delay_bridge_bundling",
    /// The bridge's queues holding expired messages their dead-letter worker has not
    /// forwarded for `management.stuck_after` now (read from the management API).
    stuck_queues: gauge "delay_bridge_stuck_queues",
    /// Expired messages not yet forwarded by the dead-letter workers of the bridge's
    /// queues, at the last reading of the management API.
    expired_unforwarded: gauge "delay_bridge_expired_unforwarded_messages",
}
