//! The soak's figures per minute, as pure code: the lateness of the small messages due in
//! each minute, and what each minute of the run cost (CPU per message, bridge RSS).

use super::traffic::{Kind, Layout};
use crate::Spread;
use crate::bridge_metrics::LatenessSplit;

/// One message that arrived: its sequence number, when it arrived and when it was due
/// (epoch µs).
#[derive(Debug, Clone, Copy)]
pub struct Arrived {
    /// Its sequence number.
    pub seq: u64,
    /// Its first arrival.
    pub at_us: u64,
    /// Its due time, from its body.
    pub due_us: u64,
}

/// The lateness of the small messages due in one minute of the run.
#[derive(Debug, Clone)]
pub struct DueMinute {
    /// 1 for the first minute after the start.
    pub minute: u64,
    /// Lateness (arrival minus due) of the small messages due in it, µs.
    pub small: Option<Spread>,
    /// Of those, the ones due while a burst drained (from its due instant to its last
    /// arrival): what a burst costs the messages due beside it.
    pub small_while_draining: Option<Spread>,
    /// Large bodies due in it.
    pub large_due: u64,
    /// Burst messages due in it.
    pub burst_due: u64,
}

/// The arrivals grouped by the minute (since `start_us`) in which they were due; `drains`
/// holds each burst's drain as (due instant, last arrival), epoch µs.
pub fn by_due_minute(
    arrived: &[Arrived],
    layout: &Layout,
    start_us: u64,
    drains: &[(u64, u64)],
) -> Vec<DueMinute> {
    let minute_of = |due_us: u64| due_us.saturating_sub(start_us) / 60_000_000 + 1;
    let last = arrived
        .iter()
        .map(|a| minute_of(a.due_us))
        .max()
        .unwrap_or(0);
    let mut small: Vec<Vec<i64>> = vec![Vec::new(); last as usize];
    let mut while_draining: Vec<Vec<i64>> = vec![Vec::new(); last as usize];
    let draining = |due_us: u64| {
        drains
            .iter()
            .any(|&(from, to)| (from..=to).contains(&due_us))
    };
    let mut large = vec![0; last as usize];
    let mut burst = vec![0; last as usize];
    for a in arrived {
        let index = (minute_of(a.due_us) - 1) as usize;
        match layout.kind(a.seq) {
            Kind::Small | Kind::Rescheduled => {
                let late = a.at_us as i64 - a.due_us as i64;
                small[index].push(late);
                if draining(a.due_us) {
                    while_draining[index].push(late);
                }
            }
            Kind::Large => large[index] += 1,
            Kind::Burst => burst[index] += 1,
            Kind::Cancelled | Kind::Unroutable => {}
        }
    }
    (0..last as usize)
        .map(|i| DueMinute {
            minute: i as u64 + 1,
            small: Spread::of(&small[i]),
            small_while_draining: Spread::of(&while_draining[i]),
            large_due: large[i],
            burst_due: burst[i],
        })
        .collect()
}

/// The `n` small messages that arrived latest after their due time, the latest first:
/// where a tail comes from (the ones due at a burst's instant, or during its drain).
pub fn latest_small(arrived: &[Arrived], layout: &Layout, n: usize) -> Vec<Arrived> {
    let mut small: Vec<Arrived> = arrived
        .iter()
        .filter(|a| matches!(layout.kind(a.seq), Kind::Small | Kind::Rescheduled))
        .copied()
        .collect();
    small.sort_unstable_by_key(|a| std::cmp::Reverse(a.at_us as i64 - a.due_us as i64));
    small.truncate(n);
    small
}

/// A reading of the broker's and the bridge's usage, taken once a minute.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    /// Messages published so far.
    pub published: u64,
    /// The broker's CPU time so far (`None`: its process was not found).
    pub broker_cpu_us: Option<u64>,
    /// The bridge's CPU time so far, µs.
    pub bridge_cpu_us: u64,
    /// The bridge's RSS now, bytes.
    pub bridge_rss: u64,
    /// The bridge's own count of its deliveries so far, and how many were late at its
    /// confirm and when it read them (`None`: no bridge, or its metrics did not answer).
    pub bridge_lateness: Option<LatenessSplit>,
}

/// What one minute of the run cost.
#[derive(Debug, Clone, Copy)]
pub struct CostMinute {
    /// 1 for the first minute.
    pub minute: u64,
    /// Messages published in it.
    pub published: u64,
    /// The broker's CPU per message published in it, µs.
    pub broker_us: Option<f64>,
    /// The bridge's CPU per message published in it, µs.
    pub bridge_us: f64,
    /// The bridge's RSS at its end, bytes.
    pub bridge_rss: u64,
    /// The bridge's own count of what it delivered in it, and how many late at its confirm
    /// and when it read them: a late minute the bridge read on time was the bridge's, one it
    /// read late the broker's, one it confirmed on time the collector's.
    pub bridge_lateness: Option<LatenessSplit>,
}

/// The cost of each minute between consecutive readings (the first is the start).
pub fn cost_per_minute(readings: &[Reading]) -> Vec<CostMinute> {
    readings
        .windows(2)
        .enumerate()
        .map(|(i, pair)| {
            let (a, b) = (pair[0], pair[1]);
            let published = b.published.saturating_sub(a.published);
            let per = |us: u64| us as f64 / published.max(1) as f64;
            CostMinute {
                minute: i as u64 + 1,
                published,
                broker_us: a
                    .broker_cpu_us
                    .zip(b.broker_cpu_us)
                    .map(|(a, b)| per(b.saturating_sub(a))),
                bridge_us: per(b.bridge_cpu_us.saturating_sub(a.bridge_cpu_us)),
                bridge_rss: b.bridge_rss,
                bridge_lateness: b
                    .bridge_lateness
                    .zip(a.bridge_lateness)
                    .map(|(b, a)| b.since(&a)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_fall_in_the_minute_they_were_due_and_kinds_apart() {
        let layout = Layout {
            steady: 2000,
            large: 1,
            bursts: 1,
            burst_size: 10,
            plain: false,
        };
        let start = 1_000_000_000;
        let at = |seq, due_s: u64, late_us| Arrived {
            seq,
            at_us: start + due_s * 1_000_000 + late_us,
            due_us: start + due_s * 1_000_000,
        };
        let arrived = vec![
            at(100, 10, 2_000),
            at(101, 59, 4_000),
            at(102, 61, 8_000),
            at(2000, 61, 900_000),
            at(2001, 125, 300_000),
            at(0, 30, 0),
        ];
        let drain = (start + 61_000_000, start + 61_500_000);
        let minutes = by_due_minute(&arrived, &layout, start, &[drain]);
        assert_eq!(minutes.len(), 3);
        assert_eq!(minutes[0].small.unwrap().count, 2);
        assert_eq!(
            minutes[0].small.unwrap().max,
            4_000,
            "the cancelled one is apart"
        );
        assert_eq!(
            minutes[1].small.unwrap().max,
            8_000,
            "the large body is apart"
        );
        assert_eq!((minutes[1].large_due, minutes[2].burst_due), (1, 1));
        let during = minutes[1].small_while_draining.unwrap();
        assert_eq!(
            (during.count, during.max),
            (1, 8_000),
            "the small one due in the drain, not the burst's own"
        );
        assert!(minutes[0].small_while_draining.is_none());
        assert!(minutes[2].small.is_none());
    }

    #[test]
    fn the_latest_small_messages_come_latest_first_and_without_the_others() {
        let layout = Layout {
            steady: 2000,
            large: 1,
            bursts: 1,
            burst_size: 10,
            plain: false,
        };
        let at = |seq, late_us: u64| Arrived {
            seq,
            at_us: 5_000_000 + late_us,
            due_us: 5_000_000,
        };
        let arrived = vec![
            at(100, 10),
            at(101, 30),
            at(2000, 900),
            at(2001, 800),
            at(102, 20),
        ];
        let latest: Vec<u64> = latest_small(&arrived, &layout, 2)
            .iter()
            .map(|a| a.seq)
            .collect();
        assert_eq!(latest, vec![101, 102]);
    }

    #[test]
    fn each_minute_costs_what_was_spent_in_it_per_message_published_in_it() {
        let reading = |published, broker, bridge, rss| Reading {
            published,
            broker_cpu_us: Some(broker),
            bridge_cpu_us: bridge,
            bridge_rss: rss,
            bridge_lateness: Some(LatenessSplit {
                delivered: published as f64,
                confirmed_late: (published / 10) as f64,
                read_late: 0.0,
                sent_late: 0.0,
            }),
        };
        let mut unanswered = reading(300, 61_000, 14_000, 30);
        unanswered.bridge_lateness = None;
        let minutes = cost_per_minute(&[
            reading(0, 1_000, 0, 10),
            reading(100, 51_000, 10_000, 20),
            reading(300, 61_000, 14_000, 30),
            unanswered,
        ]);
        assert_eq!(minutes.len(), 3);
        assert_eq!(minutes[0].broker_us, Some(500.0));
        assert_eq!(minutes[1].broker_us, Some(50.0));
        assert_eq!(minutes[1].bridge_us, 20.0);
        assert_eq!(minutes[1].bridge_rss, 30);
        let late = minutes[1].bridge_lateness.expect("both minutes answered");
        assert_eq!((late.delivered, late.confirmed_late), (200.0, 20.0));
        assert!(
            minutes[2].bridge_lateness.is_none(),
            "a reading the bridge did not answer gives no split"
        );
    }
}
