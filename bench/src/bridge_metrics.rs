//! What the bridge under test counts of its own lateness, read from its Prometheus listener
//! at the end of a run: how many deliveries it confirmed late, how many it sent late (its
//! own part), and how many it had already read late (the broker handed them over late).

use std::time::Duration;

use delay_bridge::bridge::instruments::{LATENESS, PUBLISH_LATENESS, READ_LATENESS};

/// The lateness threshold the split is taken at, as the histograms' bucket bound (`le`).
const OVER_LE: &str = "0.01";
/// The same threshold, for the report.
const OVER: Duration = Duration::from_millis(10);

/// Of the deliveries the bridge confirmed, how many were late by more than [`OVER`] at its
/// confirm, how many when it sent them, and how many already were when it read them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatenessSplit {
    /// Deliveries confirmed.
    pub delivered: f64,
    /// Confirmed more than [`OVER`] after their due time.
    pub confirmed_late: f64,
    /// Read more than [`OVER`] after their due time.
    pub read_late: f64,
    /// Sent to their target more than [`OVER`] after their due time (0 from a bridge too
    /// old to count it).
    pub sent_late: f64,
}

impl LatenessSplit {
    /// Reads the split from the Prometheus text `metrics`; `None` when a histogram or its
    /// bucket is missing.
    pub fn read(metrics: &str) -> Option<Self> {
        let delivered = bucket(metrics, LATENESS, "+Inf")?;
        Some(Self {
            delivered,
            confirmed_late: delivered - bucket(metrics, LATENESS, OVER_LE)?,
            read_late: bucket(metrics, READ_LATENESS, "+Inf")?
                - bucket(metrics, READ_LATENESS, OVER_LE)?,
            sent_late: bucket(metrics, PUBLISH_LATENESS, "+Inf")
                .zip(bucket(metrics, PUBLISH_LATENESS, OVER_LE))
                .map_or(0.0, |(all, within)| all - within),
        })
    }

    /// What was counted after `earlier` (a reading of the same bridge) up to this one.
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            delivered: self.delivered - earlier.delivered,
            confirmed_late: self.confirmed_late - earlier.confirmed_late,
            read_late: self.read_late - earlier.read_late,
            sent_late: self.sent_late - earlier.sent_late,
        }
    }

    /// The shares of the deliveries confirmed late and read late, percent (both 0 when
    /// nothing was delivered).
    pub fn shares(&self) -> (f64, f64) {
        (self.share(self.confirmed_late), self.share(self.read_late))
    }

    /// `count` as a share of the deliveries, percent (0 when nothing was delivered).
    fn share(&self, count: f64) -> f64 {
        100.0 * count / self.delivered.max(1.0)
    }

    /// One report line.
    pub fn line(&self) -> String {
        let (confirmed_late, read_late) = self.shares();
        let sent_late = self.share(self.sent_late);
        let over = OVER.as_millis();
        format!(
            "the bridge's own count (its /metrics): of {:.0} delivered, {confirmed_late:.2}% confirmed more than {over} ms late, {sent_late:.2}% sent more than {over} ms late (the bridge's own part), {read_late:.2}% already read more than {over} ms late (the broker handed them over late)",
            self.delivered,
        )
    }

    /// For the report.
    pub fn report(&self) -> delay_bridge_bench::report::LatenessSplit {
        delay_bridge_bench::report::LatenessSplit {
            over_ms: OVER.as_millis() as u64,
            delivered: self.delivered,
            confirmed_late: self.confirmed_late,
            read_late: self.read_late,
            sent_late: self.sent_late,
        }
    }
}

/// The value of `metric`'s bucket `le` in the Prometheus text `metrics`.
fn bucket(metrics: &str, metric: &str, le: &str) -> Option<f64> {
    value(metrics, &format!("{metric}_bucket{{le=\"{le}\"}}"))
}

/// The value of the series `series` (a name, with its labels if it has any) in the
/// Prometheus text `metrics`.
pub fn value(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE delay_bridge_delivery_lateness_seconds histogram
delay_bridge_delivery_lateness_seconds_bucket{le=\"0.005\"} 90
delay_bridge_delivery_lateness_seconds_bucket{le=\"0.01\"} 95
delay_bridge_delivery_lateness_seconds_bucket{le=\"+Inf\"} 100
delay_bridge_read_lateness_seconds_bucket{le=\"0.01\"} 98
delay_bridge_read_lateness_seconds_bucket{le=\"+Inf\"} 100
delay_bridge_publish_lateness_seconds_bucket{le=\"0.01\"} 97
delay_bridge_publish_lateness_seconds_bucket{le=\"+Inf\"} 100
";

    #[test]
    fn the_split_counts_what_is_above_the_bound() {
        let split = LatenessSplit::read(TEXT).unwrap();
        assert_eq!(
            split,
            LatenessSplit {
                delivered: 100.0,
                confirmed_late: 5.0,
                read_late: 2.0,
                sent_late: 3.0,
            }
        );
        assert!(split.line().contains(
            "of 100 delivered, 5.00% confirmed more than 10 ms late, 3.00% sent more than 10 ms late (the bridge's own part), 2.00% already read"
        ));
    }

    #[test]
    fn a_bridge_that_does_not_count_what_it_sent_late_gives_none_sent_late() {
        let older: String = TEXT
            .lines()
            .filter(|line| !line.contains("publish_lateness"))
            .map(|line| format!("{line}\n"))
            .collect();
        let split = LatenessSplit::read(&older).unwrap();
        assert_eq!(split.sent_late, 0.0);
        assert_eq!(split.confirmed_late, 5.0);
    }

    #[test]
    fn a_later_reading_less_an_earlier_one_is_what_came_between() {
        let earlier = LatenessSplit::read(TEXT).unwrap();
        let later = LatenessSplit {
            delivered: 300.0,
            confirmed_late: 45.0,
            read_late: 2.0,
            sent_late: 4.0,
        };
        let between = later.since(&earlier);
        assert_eq!(
            between,
            LatenessSplit {
                delivered: 200.0,
                confirmed_late: 40.0,
                read_late: 0.0,
                sent_late: 1.0,
            }
        );
        assert_eq!(between.shares(), (20.0, 0.0));
        assert_eq!(
            between.since(&between).shares(),
            (0.0, 0.0),
            "none delivered"
        );
    }

    #[test]
    fn a_series_is_read_by_its_whole_name() {
        let text = format!("{TEXT}delay_bridge_hops_total 7\n");
        assert_eq!(value(&text, "delay_bridge_hops_total"), Some(7.0));
        assert_eq!(value(&text, "delay_bridge_hops"), None);
        assert_eq!(
            value(
                &text,
                "delay_bridge_read_lateness_seconds_bucket{le=\"0.01\"}"
            ),
            Some(98.0)
        );
    }

    #[test]
    fn a_missing_histogram_gives_no_split() {
        let without_read = TEXT
            .lines()
            .filter(|line| !line.starts_with("delay_bridge_read"))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(LatenessSplit::read(&without_read), None);
    }
}
