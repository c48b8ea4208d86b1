//! What a scenario's delayed messages cost in CPU: the broker process's time per delayed
//! message beside one plain transit at the same rate (the baseline's paced pass), and the
//! bridge process's time per message.

use std::time::Duration;

use super::Target;
use super::baseline::Baseline;
use super::broker_process::BrokerProcess;

/// The broker's CPU per delayed message may be at most this many plain transits: the
/// ratio of the delayed-message plugin, which does one broker transit per message.
pub const BROKER_RATIO_TARGET: f64 = 3.0;

/// The bridge's CPU per message at 2 000 msg/s, µs.
pub const BRIDGE_US_TARGET: f64 = 100.0;

/// CPU time spent on a scenario's messages.
#[derive(Debug, Clone, Copy)]
pub struct Cost {
    /// Messages the time is divided by.
    pub messages: u64,
    /// The broker process's CPU time over the run (`None`: not found on this machine).
    pub broker_cpu: Option<Duration>,
    /// The baseline's broker CPU per plain transit, µs.
    pub baseline_broker_us: Option<f64>,
    /// The bridge process's CPU time over the run.
    pub bridge_cpu: Duration,
}

/// Reads the broker process's CPU time, if the baseline found it.
pub fn broker_cpu_now(baseline: &Baseline) -> anyhow::Result<Option<Duration>> {
    baseline.broker.as_ref().map(BrokerProcess::cpu).transpose()
}

/// The CPU time between two readings of [`broker_cpu_now`] (`None` unless both were read).
pub fn broker_cpu_between(start: Option<Duration>, end: Option<Duration>) -> Option<Duration> {
    start.zip(end).map(|(a, b)| b.saturating_sub(a))
}

impl Cost {
    /// The broker's CPU per message, µs.
    pub fn broker_us(&self) -> Option<f64> {
        self.broker_cpu
            .map(|cpu| cpu.as_secs_f64() * 1e6 / self.messages.max(1) as f64)
    }

    /// The broker's CPU per message as a multiple of one plain transit.
    pub fn broker_ratio(&self) -> Option<f64> {
        Some(self.broker_us()? / self.baseline_broker_us?.max(1e-9))
    }

    /// The bridge's CPU per message, µs.
    pub fn bridge_us(&self) -> f64 {
        self.bridge_cpu.as_secs_f64() * 1e6 / self.messages.max(1) as f64
    }

    /// The broker's CPU per message beside one plain transit, for the human report.
    pub fn broker_line(&self) -> String {
        match (self.broker_us(), self.baseline_broker_us) {
            (Some(us), Some(base)) => format!(
                "{us:.0} us per message, {:.2}x one plain transit at the same rate ({base:.0} us)",
                us / base.max(1e-9)
            ),
            (Some(us), None) => format!("{us:.0} us per message"),
            _ => "not measured".into(),
        }
    }

    /// One line for the human report.
    pub fn line(&self) -> String {
        format!(
            "CPU: broker {}; bridge {:.0} us per message",
            self.broker_line(),
            self.bridge_us()
        )
    }

    /// The broker's target: at most [`BROKER_RATIO_TARGET`] plain transits.
    pub fn broker_target(&self) -> Target {
        let ratio = self.broker_ratio();
        Target::new(
            format!("broker CPU per message <= {BROKER_RATIO_TARGET}x plain"),
            ratio.map_or_else(|| "not measured".into(), |r| format!("{r:.2}x")),
            ratio.is_some_and(|r| r <= BROKER_RATIO_TARGET),
        )
    }

    /// The bridge's target: at most [`BRIDGE_US_TARGET`] µs per message.
    pub fn bridge_target(&self) -> Target {
        Target::new(
            format!("bridge CPU per message <= {BRIDGE_US_TARGET} us"),
            format!("{:.0} us", self.bridge_us()),
            self.bridge_us() <= BRIDGE_US_TARGET,
        )
    }

    /// For the report: µs rounded, the ratio to two decimals.
    pub fn report(&self) -> delay_bridge_bench::report::Cost {
        delay_bridge_bench::report::Cost {
            broker_cpu_us_per_msg: self.broker_us().map(|us| us.round()),
            baseline_broker_cpu_us_per_msg: self.baseline_broker_us.map(|us| us.round()),
            broker_cpu_ratio: self.broker_ratio().map(|r| (r * 100.0).round() / 100.0),
            bridge_cpu_us_per_msg: Some(self.bridge_us().round()),
        }
    }

    /// For the report of a run no bridge served (the delayed-message plugin): the broker's
    /// figures only.
    pub fn broker_report(&self) -> delay_bridge_bench::report::Cost {
        delay_bridge_bench::report::Cost {
            bridge_cpu_us_per_msg: None,
            ..self.report()
        }
    }
}
