//! The metrics a bridge records as it works, beside its [`super::Stats`] counters: parked
//! messages by reason, lateness and hops at delivery, and the queue depths it reads. Each
//! bridge registers its own handles with the recorder it is given, so two bridges in one
//! process never share a figure; without one, every handle does nothing.

use std::collections::HashMap;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Level, Metadata, Recorder, Unit};

use crate::config::Config;
use crate::contract::ParkReason;
use crate::ladder::format_duration;
use crate::pending::{DUE_BUCKETS, Pending};

/// Messages parked, by reason.
pub const PARKED: &str = "delay_bridge_parked_total";
/// Lateness at delivery: the broker's confirm of the publish to the target minus the due
/// time, in seconds.
pub const LATENESS: &str = "delay_bridge_delivery_lateness_seconds";
/// How late a delivered message already was when the bridge read it for its delivery, in
/// seconds (0 when it was read before its due time): the broker's part of the lateness.
pub const READ_LATENESS: &str = "delay_bridge_read_lateness_seconds";
/// How late the bridge sent a delivered message's publish to its target, in seconds (0
/// when sent at its due instant; never earlier): the bridge's own part of the lateness.
pub const PUBLISH_LATENESS: &str = "delay_bridge_publish_lateness_seconds";
/// Hops a message took, observed at its delivery.
pub const HOPS_PER_MESSAGE: &str = "delay_bridge_hops_per_message";
/// Messages ready in one level queue.
pub const LEVEL_MESSAGES: &str = "delay_bridge_level_messages";
/// Messages ready in the work queue.
pub const WORK_QUEUE_MESSAGES: &str = "delay_bridge_work_queue_messages";
/// Messages in the parked queue.
pub const PARKED_MESSAGES: &str = "delay_bridge_parked_messages";
/// Pending messages surely due within `le` seconds (cumulative, `+Inf`: all of them).
pub const PENDING_DUE: &str = "delay_bridge_pending_due_messages";

/// Occurrences of recurring schedules delivered.
pub const OCCURRENCES: &str = "delay_bridge_occurrences_delivered_total";
/// Occurrences of recurring schedules skipped: due while the bridge could not deliver, and
/// stood for by one late occurrence.
pub const OCCURRENCES_SKIPPED: &str = "delay_bridge_occurrences_skipped_total";

/// The buckets of [`LATENESS`], [`READ_LATENESS`] and [`PUBLISH_LATENESS`], in seconds.
pub const LATENESS_BUCKETS: [f64; 16] = [
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
/// The buckets of [`HOPS_PER_MESSAGE`].
pub const HOPS_BUCKETS: [f64; 12] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 50.0,
];

/// The handles one bridge records with.
pub(crate) struct Instruments {
    /// False when no recorder was given: nothing reads the queue depths then.
    pub(crate) enabled: bool,
    parked: HashMap<ParkReason, Counter>,
    pub(crate) lateness: Histogram,
    pub(crate) read_lateness: Histogram,
    pub(crate) publish_lateness: Histogram,
    pub(crate) hops_per_message: Histogram,
    occurrences: Counter,
    occurrences_skipped: Counter,
    /// Each level and its gauge, ascending.
    levels: Vec<(Duration, Gauge)>,
    work_queue: Gauge,
    parked_queue: Gauge,
    /// One gauge per bucket of [`DUE_BUCKETS`], then `+Inf`.
    pending_due: Vec<Gauge>,
}

impl Instruments {
    /// Handles that record nothing.
    pub(crate) fn disabled(config: &Config) -> Self {
        Self {
            enabled: false,
            ..Self::register(&metrics::NoopRecorder, config)
        }
    }

    /// Registers every metric of a bridge with `config` in `recorder`, with its help text.
    pub(crate) fn register(recorder: &dyn Recorder, config: &Config) -> Self {
        let describe = |name: &'static str, unit: Option<Unit>, help: &'static str| {
            recorder.describe_counter(KeyName::from_const_str(name), unit, help.into());
        };
        describe(PARKED, None, "Messages parked (confirmed), by reason.");
        describe(
            OCCURRENCES,
            None,
            "Occurrences of recurring schedules delivered (confirmed by the target).",
        );
        describe(
            OCCURRENCES_SKIPPED,
            None,
            "Occurrences of recurring schedules skipped: due while none could be delivered, and stood for by one late occurrence.",
        );
        recorder.describe_histogram(
            KeyName::from_const_str(LATENESS),
            Some(Unit::Seconds),
            "Lateness at delivery: the broker's confirm of the publish to the target minus the due time.".into(),
        );
        recorder.describe_histogram(
            KeyName::from_const_str(READ_LATENESS),
            Some(Unit::Seconds),
            "How late a delivered message already was when the bridge read it for its delivery (0 when read before its due time): the broker's part of the delivery lateness, from a level that dead-lettered late or a backlog in the work queue.".into(),
        );
        recorder.describe_histogram(
            KeyName::from_const_str(PUBLISH_LATENESS),
            Some(Unit::Seconds),
            "How late the bridge sent a delivered message's publish to its target (0 when sent at its due instant): the bridge's own part of the delivery lateness; the rest of it after this is the broker's routing and confirm.".into(),
        );
        recorder.describe_histogram(
            KeyName::from_const_str(HOPS_PER_MESSAGE),
            None,
            "Hops a message took through the level queues, observed at its delivery.".into(),
        );
        let describe_gauge = |name: &'static str, help: &'static str| {
            recorder.describe_gauge(KeyName::from_const_str(name), None, help.into());
        };
        describe_gauge(
            LEVEL_MESSAGES,
            "Messages ready in one level queue, read every metrics.interval.",
        );
        describe_gauge(
            WORK_QUEUE_MESSAGES,
            "Messages ready in the work queue, read every metrics.interval.",
        );
        describe_gauge(
            PARKED_MESSAGES,
            "Messages in the parked queue, read every metrics.interval.",
        );
        describe_gauge(
            PENDING_DUE,
            "Pending messages surely due within le seconds (a level's bound is the next level up plus the margin; the largest level and the work queue only count in +Inf).",
        );
        let metadata = Metadata::new(module_path!(), Level::INFO, None);
        let labelled = |name: &'static str, key: &'static str, value: String| {
            Key::from_parts(name, vec![Label::new(key, value)])
        };
        let plain = Key::from_static_name;
        Self {
            enabled: true,
            parked: ParkReason::ALL
                .iter()
                .map(|reason| {
                    let key = labelled(PARKED, "reason", reason.as_str().to_string());
                    (*reason, recorder.register_counter(&key, &metadata))
                })
                .collect(),
            lateness: recorder.register_histogram(&plain(LATENESS), &metadata),
            read_lateness: recorder.register_histogram(&plain(READ_LATENESS), &metadata),
            publish_lateness: recorder.register_histogram(&plain(PUBLISH_LATENESS), &metadata),
            hops_per_message: recorder.register_histogram(&plain(HOPS_PER_MESSAGE), &metadata),
            occurrences: recorder.register_counter(&plain(OCCURRENCES), &metadata),
            occurrences_skipped: recorder.register_counter(&plain(OCCURRENCES_SKIPPED), &metadata),
            levels: config
                .ladder
                .levels()
                .iter()
                .map(|level| {
                    let key = labelled(LEVEL_MESSAGES, "level", format_duration(*level));
                    (*level, recorder.register_gauge(&key, &metadata))
                })
                .collect(),
            work_queue: recorder.register_gauge(&plain(WORK_QUEUE_MESSAGES), &metadata),
            parked_queue: recorder.register_gauge(&plain(PARKED_MESSAGES), &metadata),
            pending_due: DUE_BUCKETS
                .iter()
                .map(|upper| upper.as_secs().to_string())
                .chain(["+Inf".to_string()])
                .map(|le| recorder.register_gauge(&labelled(PENDING_DUE, "le", le), &metadata))
                .collect(),
        }
    }

    /// Counts one parked message.
    pub(crate) fn parked(&self, reason: ParkReason) {
        if let Some(counter) = self.parked.get(&reason) {
            counter.increment(1);
        }
    }

    /// Counts one delivered occurrence of a recurring schedule, which stood for `skipped`.
    pub(crate) fn occurrence(&self, skipped: u64) {
        self.occurrences.increment(1);
        self.occurrences_skipped.increment(skipped);
    }

    /// Sets the depth gauges from one reading.
    pub(crate) fn depths(&self, pending: &Pending, parked: u64, config: &Config) {
        for ((level, gauge), (read_level, count)) in self.levels.iter().zip(&pending.levels) {
            debug_assert_eq!(level, read_level);
            gauge.set(*count as f64);
        }
        self.work_queue.set(pending.work_queue as f64);
        self.parked_queue.set(parked as f64);
        let buckets = pending.due_buckets(&config.ladder, config.margin);
        for (gauge, count) in self.pending_due.iter().zip(buckets) {
            gauge.set(count as f64);
        }
    }
}
