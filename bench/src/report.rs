//! The reports the scenarios print as their last line, in JSON: one type per scenario,
//! inside the [`Report`] envelope every scenario shares. The bench serialises them and its
//! smoke tests read them back through the same types, so a renamed or missing field is a
//! compile error on both sides, not a `null` found at run time.
//!
//! Units are in the field names: `_ms`, `_s`, `_us`, `_bytes`, `msg_per_s`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What every scenario reports around its own figures (`body`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report<T> {
    /// The scenario's subcommand, for example `steady`.
    pub scenario: String,
    /// How the bridge under test ran (`none` for the broker-only scenarios).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// The broker's own ceiling, measured in the same run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Baseline>,
    /// The scenario's own figures.
    #[serde(flatten)]
    pub body: T,
    /// The bridge process's CPU time and memory over the measured span.
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<BridgeUsage>,
    /// Each target of the performance table with its verdict.
    #[serde(default)]
    pub targets: Vec<TargetRow>,
    /// How busy the whole machine was during the run, for example `62% of 2 cores`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_cpu_busy: Option<String>,
}

impl<T> Report<T> {
    /// A report of `scenario` with its figures and nothing else yet.
    pub fn new(scenario: &str, body: T) -> Self {
        Self {
            scenario: scenario.to_string(),
            bridge: None,
            baseline: None,
            body,
            usage: None,
            targets: Vec::new(),
            machine_cpu_busy: None,
        }
    }

    /// The report with how the bridge ran.
    pub fn bridge(mut self, bridge: impl Into<String>) -> Self {
        self.bridge = Some(bridge.into());
        self
    }

    /// The report with the same run's baseline.
    pub fn baseline(mut self, baseline: Baseline) -> Self {
        self.baseline = Some(baseline);
        self
    }

    /// The report with its targets.
    pub fn targets(mut self, targets: Vec<TargetRow>) -> Self {
        self.targets = targets;
        self
    }

    /// The target whose name starts with `name`, if reported.
    pub fn target(&self, name: &str) -> Option<&TargetRow> {
        self.targets.iter().find(|t| t.target.starts_with(name))
    }
}

impl<T: Serialize> Report<T> {
    /// The report as one JSON line.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("a report serialises")
    }
}

/// One target: what is compared and its limit, the figure, and whether it is met.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetRow {
    /// What is measured and its limit, e.g. "steady p99 lateness <= 5 ms".
    pub target: String,
    /// The measured figure, as shown.
    pub measured: String,
    /// Met or not.
    pub verdict: Verdict,
}

/// Whether a target is met.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Met.
    #[serde(rename = "PASS")]
    Pass,
    /// Not met.
    #[serde(rename = "MISS")]
    Miss,
}

/// A latency or lateness distribution, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Lateness {
    /// Samples.
    pub count: u64,
    /// The smallest.
    pub min_ms: f64,
    /// The median.
    pub p50_ms: f64,
    /// The 90th percentile.
    pub p90_ms: f64,
    /// The 99th percentile.
    pub p99_ms: f64,
    /// The 99.9th percentile.
    pub p999_ms: f64,
    /// The largest.
    pub max_ms: f64,
}

/// CPU time per message of the broker process (beside one plain transit in the same run)
/// and of the bridge process; `None` where it was not measured (the broker does not run on
/// this machine; the scenario runs no bridge).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// The broker's CPU per delayed message, µs.
    pub broker_cpu_us_per_msg: Option<f64>,
    /// The broker's CPU per plain transit at the same rate, µs.
    pub baseline_broker_cpu_us_per_msg: Option<f64>,
    /// The first over the second.
    pub broker_cpu_ratio: Option<f64>,
    /// The bridge's CPU per delayed message, µs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge_cpu_us_per_msg: Option<f64>,
}

/// The broker's ceiling on this machine, in the same run: a plain durable queue with the
/// same publisher and consumer, flat out and then paced at the scenario's rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// Messages sent flat out.
    pub count: u64,
    /// Body size.
    pub body_bytes: u64,
    /// Flat out, from the first publish to the last arrival.
    pub msg_per_s: f64,
    /// Flat out: arrival minus send time.
    pub latency: Lateness,
    /// The paced pass's rate.
    pub paced_msg_per_s: f64,
    /// Paced: arrival minus send time.
    pub paced_latency: Lateness,
    /// The broker's CPU per message of the paced pass.
    pub paced_broker_cpu_us_per_msg: Option<f64>,
    /// The broker's CPU per message of the flat-out pass.
    pub flat_broker_cpu_us_per_msg: Option<f64>,
    /// The broker's version, when it could be read.
    pub broker_version: Option<String>,
}

/// The bridge process over the measured span.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BridgeUsage {
    /// CPU time.
    pub bridge_cpu_s: f64,
    /// RSS at the span's first reading (the start of the load, or the bridge ready).
    pub bridge_rss_first_bytes: u64,
    /// RSS at the span's end.
    pub bridge_rss_end_bytes: u64,
    /// The largest RSS up to the end.
    pub bridge_peak_rss_bytes: u64,
}

/// The broker-only scenario `baseline`: everything is in [`Report::baseline`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Nothing {}

/// Of what the bridge delivered, how many its own histograms saw late (its `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatenessSplit {
    /// The threshold.
    pub over_ms: u64,
    /// Delivered in all.
    pub delivered: f64,
    /// Confirmed on the target more than `over_ms` after the due time.
    pub confirmed_late: f64,
    /// Already read from the broker more than `over_ms` after the due time.
    pub read_late: f64,
    /// Sent to the target by the bridge more than `over_ms` after the due time (0 in
    /// reports from before it was counted).
    #[serde(default)]
    pub sent_late: f64,
}

/// `steady`: a constant rate of delayed messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Steady {
    /// Messages per second asked.
    pub rate: f64,
    /// Length of the load.
    pub seconds: f64,
    /// Messages sent.
    pub count: u64,
    /// The shortest delay.
    pub min_delay_ms: u64,
    /// The longest delay.
    pub max_delay_ms: u64,
    /// Messages per second achieved.
    pub achieved_rate: f64,
    /// Distinct messages received.
    pub received: u64,
    /// Sent and never received.
    pub missing: u64,
    /// Received more than once.
    pub duplicates: u64,
    /// Received before their due time.
    pub early: u64,
    /// Arrival minus due time.
    pub lateness: Option<Lateness>,
    /// The bridge's own count of late deliveries.
    pub bridge_lateness: Option<LatenessSplit>,
    /// CPU per message.
    pub cost: Cost,
    /// The bridge's CPU per message where it took in and delivered the full rate (absent
    /// for a run too short to have that part, and in reports from before it was read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge_cpu_us_per_msg_full_rate: Option<f64>,
}

/// `burst`: messages all due at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Burst {
    /// Messages sent.
    pub count: u64,
    /// Distinct messages received.
    pub received: u64,
    /// Sent and never received.
    pub missing: u64,
    /// Received more than once.
    pub duplicates: u64,
    /// From the due instant to the last arrival.
    pub drain_s: f64,
    /// Received over the drain time.
    pub drain_msg_per_s: f64,
    /// The drain rate over the baseline's flat-out rate.
    pub drain_ratio: f64,
    /// Arrival minus due time.
    pub lateness: Option<Lateness>,
    /// CPU per message.
    pub cost: Cost,
}

/// `hop`: how fast the bridge moves messages between levels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hop {
    /// Messages hopped.
    pub count: u64,
    /// From ready to the last one in the levels.
    pub seconds: f64,
    /// Hops per second.
    pub hops_per_s: f64,
    /// The hop rate over the baseline's flat-out rate.
    pub ratio: f64,
    /// The bridge's CPU per hop.
    pub bridge_cpu_us_per_hop: f64,
    /// Messages found in the levels at the end.
    pub in_levels: u64,
    /// CPU per message.
    pub cost: Cost,
}

/// `capacity`: the highest steady rate that meets the lateness limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// The p99 lateness a rate must meet.
    pub p99_limit_ms: f64,
    /// Length of each run.
    pub seconds: f64,
    /// The shortest delay.
    pub min_delay_ms: u64,
    /// The longest delay.
    pub max_delay_ms: u64,
    /// The highest rate that passed (0 when none did).
    pub capacity_msg_per_s: f64,
    /// CPU per message at that rate.
    pub cost_at_capacity: Option<Cost>,
    /// Every rate tried, in order.
    pub runs: Vec<CapacityRun>,
}

/// One rate of a `capacity` search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CapacityRun {
    /// Messages per second asked.
    pub rate: f64,
    /// Whether the rate met the limit.
    pub pass: bool,
    /// Messages per second achieved.
    pub achieved_rate: f64,
    /// Arrival minus due time.
    pub lateness: Option<Lateness>,
    /// Sent and never received.
    pub missing: u64,
    /// Received more than once.
    pub duplicates: u64,
    /// CPU per message.
    pub cost: Cost,
}

/// `pending`: what waiting messages cost the broker and the bridge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pending {
    /// The levels' queue type.
    pub queue_type: String,
    /// Body size.
    pub body_bytes: u64,
    /// One reading per checkpoint.
    pub readings: Vec<PendingReading>,
    /// The broker's memory per waiting message, between the first and last reading.
    pub broker_bytes_per_pending_message: f64,
    /// The queues' memory per waiting message.
    pub queue_bytes_per_pending_message: f64,
    /// The broker's data directory per waiting message, between the first and last
    /// reading (absent in reports from before it was read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes_per_pending_message: Option<f64>,
    /// A sample due at one instant on top of the last reading's pending messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample: Option<PendingSample>,
}

/// `pending`'s sample: messages due at one instant while the levels hold the rest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingSample {
    /// Messages in the sample.
    pub count: u64,
    /// Messages pending in the levels beside it.
    pub pending: u64,
    /// From their due instant to the last arrival.
    pub drain_s: f64,
    /// Sample messages that never arrived.
    pub missing: u64,
    /// Copies beyond the first.
    pub duplicates: u64,
    /// Arrival minus due time.
    pub lateness: Option<Lateness>,
}

/// One checkpoint of `pending`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingReading {
    /// Messages waiting in the levels.
    pub pending: u64,
    /// The broker's total memory.
    pub broker_total_bytes: u64,
    /// Messages in the level queues as the broker counts them (a bundle of hops is one;
    /// absent in reports from before it was read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level_messages: Option<u64>,
    /// The queues' memory.
    pub queue_memory_bytes: u64,
    /// The bridge's RSS.
    pub bridge_rss_bytes: u64,
    /// The bridge's largest RSS so far.
    pub bridge_peak_rss_bytes: u64,
    /// The bridge's CPU time so far.
    pub bridge_cpu_s: f64,
    /// Since the start.
    pub seconds: f64,
    /// Bytes under the broker's data directory (absent in reports from before it was
    /// read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker_disk_bytes: Option<u64>,
    /// CPU per message of the intake up to this checkpoint (none at the first).
    pub intake_cost: Option<Cost>,
}

/// `intake`: the broker's cost of a consumer that acks late.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Intake {
    /// Messages per second asked.
    pub rate: f64,
    /// Length of the load.
    pub seconds: f64,
    /// How long each message stays unacked.
    pub ack_every_ms: u64,
    /// Messages sent.
    pub count: u64,
    /// Distinct messages received.
    pub received: u64,
    /// Received more than once.
    pub duplicates: u64,
    /// The broker's CPU per message.
    pub intake_broker_cpu_us_per_msg: f64,
    /// That over one plain transit.
    pub intake_ratio: f64,
    /// The intake and the final transit, over one plain transit.
    pub intake_plus_transit_ratio: f64,
}

/// `cancel-horizon`: how close to the due time a cancel still wins.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelHorizon {
    /// The bridge's margin.
    pub margin_ms: u64,
    /// One row per lead time.
    pub rows: Vec<HorizonRow>,
    /// The largest confirmed lead of a cancel that lost.
    pub largest_lost_confirmed_lead_ms: Option<i64>,
    /// The smallest confirmed lead of a cancel that won.
    pub smallest_won_confirmed_lead_ms: Option<i64>,
    /// Messages the bridge dropped (cancelled).
    pub dropped: u64,
    /// Messages the bridge delivered.
    pub delivered: u64,
    /// CPU per message (the broker's).
    #[serde(flatten)]
    pub cost: Cost,
}

/// One lead time of `cancel-horizon`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HorizonRow {
    /// How long before the due time the cancel was sent.
    pub lead_ms: u64,
    /// Cancels sent.
    pub sent: u64,
    /// Cancels that won.
    pub honoured: u64,
    /// Cancels that lost.
    pub lost: u64,
    /// The median lead at the cancel's confirm.
    pub confirmed_lead_p50_ms: i64,
    /// The smallest lead at the cancel's confirm.
    pub confirmed_lead_min_ms: i64,
}

/// `tombstones`: what a long cancel stream costs at start and in memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tombstones {
    /// Cancels appended.
    pub count: u64,
    /// Time to append them.
    pub publish_s: f64,
    /// Bridge ready on an empty stream.
    pub ready_empty_s: f64,
    /// Bridge ready on the full stream.
    pub ready_full_s: f64,
    /// The difference.
    pub catch_up_s: f64,
    /// RSS on the empty stream.
    pub rss_empty_bytes: u64,
    /// RSS on the full stream.
    pub rss_full_bytes: u64,
    /// The difference per cancel.
    pub rss_bytes_per_tombstone: f64,
    /// The broker's CPU per appended cancel.
    pub append_broker_cpu_us_per_tombstone: Option<f64>,
    /// That over one plain transit.
    pub append_broker_cpu_ratio: Option<f64>,
    /// CPU per cancel read at start.
    pub read_cost: Cost,
}

/// One bridge start of `history`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryStart {
    /// Until it consumed, seconds.
    pub ready_s: f64,
    /// Its RSS then.
    pub rss_bytes: u64,
    /// Cancel-stream entries it read before it was ready (none: its metrics do not say).
    pub entries_read: Option<u64>,
    /// Live cancels it held then.
    pub live: Option<u64>,
}

/// `history`: a year-like cancel stream, and what a start reads of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct History {
    /// Entries appended.
    pub entries: u64,
    /// Live cancels asked for.
    pub live: u64,
    /// Time to append them.
    pub publish_s: f64,
    /// A start on the empty stream.
    pub empty: HistoryStart,
    /// The first start on the full stream (no checkpoint yet).
    pub first: HistoryStart,
    /// The starts after it (from the newest checkpoint).
    pub restarts: Vec<HistoryStart>,
    /// The `--before` executable's start, when asked.
    pub before: Option<HistoryStart>,
    /// `status` runs while the stream was written (absent in reports from before they
    /// were timed).
    #[serde(default)]
    pub status: Vec<HistoryStatus>,
}

/// `cancel-mix`: a shop's cancels appended while a bridge runs, then a restart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelMix {
    /// Cancels appended.
    pub count: u64,
    /// Time to append them.
    pub publish_s: f64,
    /// Checkpoints the running bridge wrote.
    pub checkpoints: u64,
    /// From the first append until the running bridge had written a checkpoint and held
    /// every cancel (none: not within the wait).
    pub first_checkpoint_s: Option<f64>,
    /// The running bridge's RSS growth per live cancel.
    pub rss_bytes_per_tombstone: f64,
    /// A start on the empty stream.
    pub empty: HistoryStart,
    /// The restart after the appends.
    pub restart: HistoryStart,
    /// The restarted bridge's peak RSS up to ready.
    pub restart_peak_rss_bytes: u64,
    /// One `status --json`, start to exit.
    pub status_s: f64,
    /// The cancels of the checkpoint `status` began at (none: it began at none).
    pub status_checkpoint_cancels: Option<u64>,
}

/// One `status` run of `history`, timed while cancels were appended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryStatus {
    /// From start to exit.
    pub seconds: f64,
    /// It read up to the end the stream had when it began.
    pub complete: bool,
    /// It began at a checkpoint.
    pub from_checkpoint: bool,
    /// Entries it read after the checkpoint (or from the start without one).
    pub entries_after: u64,
}

/// `plugin`: the archived delayed-message plugin under the same load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plugin {
    /// Messages per second asked.
    pub rate: f64,
    /// Length of the load.
    pub seconds: f64,
    /// The shortest delay.
    pub min_delay_ms: u64,
    /// The longest delay.
    pub max_delay_ms: u64,
    /// Distinct messages received.
    pub received: u64,
    /// Sent and never received.
    pub missing: u64,
    /// Received more than once.
    pub duplicates: u64,
    /// Arrival minus due time.
    pub lateness: Option<Lateness>,
    /// The broker's CPU per message.
    pub cost: Cost,
    /// The burst, when one was asked.
    pub burst: Option<PluginBurst>,
}

/// The burst of `plugin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginBurst {
    /// Messages sent.
    pub count: u64,
    /// Distinct messages received.
    pub received: u64,
    /// From the due instant to the last arrival.
    pub drain_s: f64,
    /// Received over the drain time.
    pub drain_msg_per_s: f64,
    /// The drain rate over the baseline's flat-out rate.
    pub drain_ratio: f64,
}

/// `plugin-move`: moving a live delayed exchange from the plugin to the bridge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginMove {
    /// Messages published to the plugin before the move.
    pub published_before: u64,
    /// Messages published after it.
    pub published_after: u64,
    /// Messages still waiting in the plugin at the move.
    pub waiting_at_move: u64,
    /// The exchange's delete, declare and bindings.
    pub move_ms: u64,
    /// How long the plugin was suspended around the move.
    pub suspended_ms: u64,
    /// Distinct messages delivered.
    pub delivered: u64,
    /// Delivered more than once.
    pub doubled: u64,
    /// Never delivered.
    pub lost: u64,
    /// Arrival minus due time.
    pub lateness: Option<Lateness>,
}

/// `mixed`: the soak, with figures per minute.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mixed {
    /// Small messages per second.
    pub rate: f64,
    /// Length of the load.
    pub minutes: f64,
    /// Body size of the large messages.
    pub large_size: u64,
    /// Messages of each burst.
    pub burst_size: u64,
    /// Never delivered and not cancelled.
    pub missing: u64,
    /// Delivered more than once.
    pub doubled: u64,
    /// Cancelled in time and delivered anyway.
    pub cancel_lost: u64,
    /// Unroutable and not parked.
    pub unparked: u64,
    /// Parked with the wrong reason, or parked and routable.
    pub misparked: u64,
    /// Arrivals that were no message of this run.
    pub strays: u64,
    /// Cancels sent too close to the due time to count.
    pub late_cancels: u64,
    /// By minute of due time ("01", "02", ...): lateness of the small messages, and the
    /// large and burst messages due in it. Keyed, not listed, so that `spread` shows each
    /// minute over the runs.
    pub minutes_due: BTreeMap<String, MinuteDue>,
    /// By minute of the run: what was published and what it cost.
    pub minutes_cost: BTreeMap<String, MinuteCost>,
    /// The first minute's p99 of small messages.
    pub first_minute_p99_ms: f64,
    /// The worst minute's.
    pub worst_minute_p99_ms: f64,
    /// Each burst's drain time.
    pub burst_drain_s: Vec<f64>,
    /// The broker's CPU per message over the run.
    pub broker_us: Option<f64>,
    /// The bridge's.
    pub bridge_us: f64,
    /// The bridge's largest RSS.
    pub bridge_peak_rss_bytes: u64,
}

/// One minute of due time of `mixed`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MinuteDue {
    /// Lateness of the small messages due in it.
    pub small: Option<Lateness>,
    /// Of those, the ones due while a burst drained (reports before it have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub small_while_draining: Option<Lateness>,
    /// Large messages due in it.
    pub large_due: u64,
    /// Burst messages due in it.
    pub burst_due: u64,
}

/// One minute of `mixed`'s run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MinuteCost {
    /// Messages published in it.
    pub published: u64,
    /// The broker's CPU per message published in it.
    pub broker_us: Option<f64>,
    /// The bridge's.
    pub bridge_us: f64,
    /// The bridge's RSS at its end.
    pub bridge_rss_bytes: u64,
    /// The bridge's own count of what it delivered in it, and how many late (absent in
    /// reports from before it was read per minute, and without a bridge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge_lateness: Option<LatenessSplit>,
}

/// A fault scenario (`connection-cuts`, `bridge-chaos`, `fuzz`, `node-loss`,
/// `broker-crash`): a load through a fault, counted at the end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fault {
    /// Messages sent.
    pub count: u64,
    /// Messages the broker confirmed to the publisher.
    pub confirmed: u64,
    /// Messages per second achieved.
    pub publish_rate: f64,
    /// Messages the publisher sent again after a failed confirm.
    pub publisher_resent: u64,
    /// The publisher's reconnects.
    pub publisher_reconnects: u64,
    /// Distinct messages delivered.
    pub delivered: u64,
    /// Confirmed and neither delivered nor parked.
    pub missing: u64,
    /// Delivered more than once.
    pub duplicates: u64,
    /// Parked.
    pub parked: u64,
    /// Parked, by reason.
    pub parked_by_reason: BTreeMap<String, u64>,
    /// The collector's reconnects.
    pub collector_reconnects: u64,
    /// Arrivals that were no message of this run.
    pub foreign: u64,
    /// Arrival minus due time.
    pub lateness: Option<Lateness>,
    /// Deliveries more than 1 s late.
    pub later_than_1s: u64,
    /// What the fault itself did.
    #[serde(flatten)]
    pub fault: FaultDone,
}

/// What a fault scenario's fault did; each scenario fills its own.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultDone {
    /// `connection-cuts`: connections cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuts: Option<u64>,
    /// `bridge-chaos`: bridge processes killed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kills: Option<u64>,
    /// `fuzz`: the bridge's reconnects (hostile input must cause none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge_reconnects: Option<u64>,
    /// `node-loss`, `broker-crash`: the levels' queue type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_type: Option<String>,
    /// `node-loss`, `broker-crash`: from the kill to consuming again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failover_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report reads back as it was written, envelope and flattened parts included.
    #[test]
    fn a_report_reads_back_as_written() {
        let lateness = Lateness {
            count: 3,
            min_ms: 0.1,
            p50_ms: 0.2,
            p90_ms: 0.3,
            p99_ms: 0.4,
            p999_ms: 0.5,
            max_ms: 0.6,
        };
        let body = Fault {
            count: 10,
            confirmed: 10,
            publish_rate: 5.0,
            publisher_resent: 0,
            publisher_reconnects: 0,
            delivered: 9,
            missing: 0,
            duplicates: 1,
            parked: 1,
            parked_by_reason: BTreeMap::from([("unroutable".to_string(), 1)]),
            collector_reconnects: 0,
            foreign: 0,
            lateness: Some(lateness),
            later_than_1s: 0,
            fault: FaultDone {
                cuts: Some(2),
                ..FaultDone::default()
            },
        };
        let mut report = Report::new("connection-cuts", body).targets(vec![TargetRow {
            target: "nothing missing".into(),
            measured: "0".into(),
            verdict: Verdict::Pass,
        }]);
        report.usage = Some(BridgeUsage {
            bridge_cpu_s: 1.5,
            bridge_rss_first_bytes: 1,
            bridge_rss_end_bytes: 2,
            bridge_peak_rss_bytes: 3,
        });
        let line = report.to_line();
        assert!(line.contains(r#""cuts":2"#), "{line}");
        assert!(!line.contains("kills"), "{line}");
        let back: Report<Fault> = serde_json::from_str(&line).unwrap();
        assert_eq!(back.body, report.body);
        assert_eq!(back.usage, report.usage);
        assert_eq!(back.targets, report.targets);
        assert_eq!(back.bridge, None);
    }

    /// A report without a bridge process reads back without usage.
    #[test]
    fn a_report_without_usage_reads_back_without_it() {
        let line = Report::new("baseline", Nothing {}).bridge("none").to_line();
        let back: Report<Nothing> = serde_json::from_str(&line).unwrap();
        assert_eq!(back.usage, None);
        assert_eq!(back.bridge.as_deref(), Some("none"));
    }
}
