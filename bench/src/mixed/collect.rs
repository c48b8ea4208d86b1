//! The soak's collector: every message that reaches the target queue or the parked queue,
//! by sequence number, with its first arrival and how many copies came.

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use lapin::Connection;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::minutes::Arrived;
use super::traffic::{Kind, Layout};
use crate::load::{consume_no_ack, now_us, read_body};

/// What reached the two queues.
#[derive(Debug, Default)]
pub struct Collected {
    /// First arrival at the target per sequence number (epoch µs, 0: none) and its due time.
    first: Vec<(u64, u64)>,
    /// Copies that reached the target, per sequence number.
    copies: Vec<u32>,
    /// Copies parked, per sequence number.
    parked: Vec<u32>,
    /// Parked copies whose reason was not `unroutable`, or bodies the bench did not make.
    pub strays: u64,
}

/// How the soak's messages ended, against what each kind should.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcomes {
    /// Should have reached the target and did not.
    pub missing: u64,
    /// Reached the target more than once (copies beyond the first).
    pub doubled: u64,
    /// Cancelled, and delivered all the same.
    pub cancel_lost: u64,
    /// Unroutable and not parked, or parked more than once.
    pub unparked: u64,
    /// Of `unparked`, those parked more than once.
    pub parked_again: u64,
    /// Parked although they should not have been.
    pub misparked: u64,
}

impl Collected {
    fn new(total: u64) -> Self {
        Self {
            first: vec![(0, 0); total as usize],
            copies: vec![0; total as usize],
            parked: vec![0; total as usize],
            strays: 0,
        }
    }

    /// Every first arrival at the target.
    pub fn arrived(&self) -> Vec<Arrived> {
        self.first
            .iter()
            .enumerate()
            .filter(|(_, (at, _))| *at > 0)
            .map(|(seq, (at_us, due_us))| Arrived {
                seq: seq as u64,
                at_us: *at_us,
                due_us: *due_us,
            })
            .collect()
    }

    /// How each message ended, against its kind. A message in `late` (its cancel or
    /// reschedule came too close to its due time to count) may have come once more.
    pub fn outcomes(&self, layout: &Layout, late: &[u64]) -> Outcomes {
        let mut o = Outcomes::default();
        for seq in 0..layout.total() {
            let (mut copies, parked) = (self.counted_copies(seq, late), self.parked[seq as usize]);
            if layout.kind(seq) == Kind::Cancelled && late.binary_search(&seq).is_ok() {
                copies = 0;
            }
            match layout.kind(seq) {
                Kind::Cancelled => o.cancel_lost += u64::from(copies),
                Kind::Unroutable => {
                    o.unparked += u64::from(parked != 1);
                    o.parked_again += u64::from(parked > 1);
                    o.doubled += u64::from(copies);
                }
                _ => {
                    o.missing += u64::from(copies == 0);
                    o.doubled += u64::from(copies.saturating_sub(1));
                }
            }
            if layout.kind(seq) != Kind::Unroutable {
                o.misparked += u64::from(parked);
            }
        }
        o
    }

    /// The copies of `seq` that reached the target, as counted: one whose cancel or
    /// reschedule is in `late` may have come once more, which does not count.
    fn counted_copies(&self, seq: u64, late: &[u64]) -> u32 {
        let copies = self.copies[seq as usize];
        if late.binary_search(&seq).is_ok() {
            copies.min(1)
        } else {
            copies
        }
    }

    /// Messages missing and doubled at the target, by kind (what should reach it), counted
    /// as [`Collected::outcomes`] counts them: one in `late` may have come once more.
    pub fn by_kind(&self, layout: &Layout, late: &[u64]) -> Vec<(Kind, (u64, u64))> {
        let kinds = [Kind::Small, Kind::Rescheduled, Kind::Large, Kind::Burst];
        kinds
            .into_iter()
            .map(|kind| {
                let (mut missing, mut doubled) = (0, 0);
                for seq in (0..layout.total()).filter(|s| layout.kind(*s) == kind) {
                    let copies = self.counted_copies(seq, late);
                    missing += u64::from(copies == 0);
                    doubled += u64::from(copies.saturating_sub(1));
                }
                (kind, (missing, doubled))
            })
            .collect()
    }

    /// A copy of `seq` was parked: true when it is the first (a second copy must not make
    /// up for a message still on its way, or the wait would end early).
    fn park(&mut self, seq: u64) -> bool {
        let Some(parked) = self.parked.get_mut(seq as usize) else {
            return false;
        };
        *parked += 1;
        *parked == 1
    }

    /// The sequence numbers that should have reached the target and did not, in order.
    pub fn missing(&self, layout: &Layout, late: &[u64]) -> Vec<u64> {
        (0..layout.total())
            .filter(|seq| layout.kind(*seq).is_delivered())
            .filter(|seq| self.counted_copies(*seq, late) == 0)
            .collect()
    }

    /// A copy of `seq` reached the target: true when it is the first.
    fn target(&mut self, seq: u64, due_us: u64, at: u64) -> bool {
        let Some(copies) = self.copies.get_mut(seq as usize) else {
            return false;
        };
        *copies += 1;
        if *copies == 1 {
            self.first[seq as usize] = (at, due_us);
        }
        *copies == 1
    }
}

/// Sorted sequence numbers as runs `(first, last, count)`: a number at most `gap` after the
/// previous one continues its run. Shows whether what went missing went together.
pub fn runs(seqs: &[u64], gap: u64) -> Vec<(u64, u64, usize)> {
    let mut runs: Vec<(u64, u64, usize)> = Vec::new();
    for &seq in seqs {
        match runs.last_mut() {
            Some((_, last, count)) if seq.saturating_sub(*last) <= gap => {
                *last = seq;
                *count += 1;
            }
            _ => runs.push((seq, seq, 1)),
        }
    }
    runs
}

/// Consumes the target and parked queues (auto-ack) in a task of its own.
pub struct Collector {
    task: JoinHandle<Result<Collected>>,
    stop: CancellationToken,
    /// Turns true once every message that should arrive somewhere did.
    done: tokio::sync::watch::Receiver<bool>,
}

impl Collector {
    /// Starts consuming the `targets` (the small messages' queue and the bursts'), each on
    /// its connection of `conns`, and `parked` on the first, for the sequence numbers of
    /// `layout`.
    pub async fn start(
        conns: [&Connection; 2],
        targets: [&str; 2],
        parked: &str,
        layout: Layout,
    ) -> Result<Self> {
        let total = layout.total();
        // Each delivered once, or parked once.
        let expected = (0..total)
            .filter(|seq| {
                let kind = layout.kind(*seq);
                kind.is_delivered() || kind == Kind::Unroutable
            })
            .count() as u64;
        let (done_tx, done) = tokio::sync::watch::channel(false);
        let [conn, burst_conn] = conns;
        let (target_channel, small) =
            consume_no_ack(conn, targets[0], "delay-bridge-bench-mixed").await?;
        let (burst_channel, bursts) =
            consume_no_ack(burst_conn, targets[1], "delay-bridge-bench-mixed-bursts").await?;
        let mut targets = futures::stream::select(small, bursts);
        let (parked_channel, mut parks) =
            consume_no_ack(conn, parked, "delay-bridge-bench-mixed-parked").await?;
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut collected = Collected::new(total);
            // Distinct messages at the target, plus parked copies.
            let mut arrived = 0u64;
            loop {
                if arrived == expected {
                    done_tx.send_replace(true);
                }
                tokio::select! {
                    next = targets.next() => {
                        let at = now_us();
                        let delivery = next.context("the target consumer ended")?.context("consuming")?;
                        match read_body(&delivery.data) {
                            Some((seq, due_us)) if seq < total => {
                                if collected.target(seq, due_us, at) {
                                    arrived += 1;
                                }
                            }
                            _ => collected.strays += 1,
                        }
                    }
                    next = parks.next() => {
                        let delivery = next.context("the parked consumer ended")?.context("consuming")?;
                        let reason = delivery
                            .properties
                            .headers()
                            .as_ref()
                            .and_then(|h| h.inner().get(delay_bridge::contract::header::REASON).cloned());
                        let unroutable = matches!(
                            reason,
                            Some(lapin::types::AMQPValue::LongString(ref s)) if s.as_bytes() == b"unroutable"
                        );
                        match read_body(&delivery.data) {
                            Some((seq, _)) if unroutable && seq < total => {
                                if collected.park(seq) {
                                    arrived += 1;
                                }
                            }
                            _ => collected.strays += 1,
                        }
                    }
                    _ = stopped.cancelled() => break,
                }
            }
            let _ = target_channel.close(200, "collected".into()).await;
            let _ = burst_channel.close(200, "collected".into()).await;
            let _ = parked_channel.close(200, "collected".into()).await;
            Ok(collected)
        });
        Ok(Self { task, stop, done })
    }

    /// Waits until every message that should arrive somewhere did, or `deadline`; then
    /// watches `linger` more (late copies), stops and returns what arrived.
    pub async fn finish(
        mut self,
        deadline: tokio::time::Instant,
        linger: std::time::Duration,
    ) -> Result<Collected> {
        let _ = tokio::time::timeout_at(deadline, self.done.wait_for(|d| *d)).await;
        tokio::time::sleep(linger).await;
        self.stop.cancel();
        match self.task.await {
            Ok(result) => result,
            Err(e) => bail!("the collector task failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small soak's layout, and every message that should reach the target there once.
    fn each_delivered_once() -> (Layout, Collected) {
        let layout = Layout {
            steady: 1000,
            large: 1,
            bursts: 1,
            burst_size: 2,
            plain: false,
        };
        let mut c = Collected::new(layout.total());
        for seq in 0..layout.total() {
            if layout.kind(seq).is_delivered() {
                c.target(seq, 1, 2);
            }
        }
        (layout, c)
    }

    #[test]
    fn outcomes_count_each_kind_against_what_it_should_become() {
        let (layout, mut c) = each_delivered_once();
        c.parked[15..20].iter_mut().for_each(|p| *p = 1);
        assert_eq!(c.outcomes(&layout, &[]), Outcomes::default());
        c.target(20, 1, 3);
        c.target(0, 1, 3);
        c.copies[1001] = 0;
        c.parked[15] = 0;
        c.parked[21] = 1;
        assert_eq!(c.outcomes(&layout, &[0]).cancel_lost, 0, "a late cancel");
        assert_eq!(
            c.outcomes(&layout, &[]),
            Outcomes {
                missing: 1,
                doubled: 1,
                cancel_lost: 1,
                unparked: 1,
                parked_again: 0,
                misparked: 1,
            }
        );
    }

    #[test]
    fn a_second_parked_copy_is_not_a_first_arrival_and_missing_lists_what_did_not_come() {
        let (layout, mut c) = each_delivered_once();
        let unroutable: Vec<u64> = (0..layout.total())
            .filter(|s| layout.kind(*s) == Kind::Unroutable)
            .collect();
        for seq in &unroutable {
            assert!(c.park(*seq), "the first copy");
        }
        assert_eq!(c.outcomes(&layout, &[]).unparked, 0, "each parked once");
        assert!(!c.park(unroutable[0]), "the second copy");
        assert!(!c.park(layout.total()), "not a sequence number of the run");
        let twice = c.outcomes(&layout, &[]);
        assert_eq!((twice.unparked, twice.parked_again), (1, 1), "parked twice");
        assert!(c.missing(&layout, &[]).is_empty());
        c.copies[20] = 0;
        c.copies[1001] = 0;
        assert_eq!(c.missing(&layout, &[]), vec![20, 1001]);
    }

    #[test]
    fn runs_join_numbers_within_the_gap() {
        assert_eq!(runs(&[], 10), vec![]);
        assert_eq!(
            runs(&[3, 5, 15, 40, 41, 100], 10),
            vec![(3, 15, 3), (40, 41, 2), (100, 100, 1)]
        );
    }

    #[test]
    fn by_kind_counts_a_late_reschedule_delivered_twice_as_outcomes_do() {
        let (layout, mut c) = each_delivered_once();
        let rescheduled: Vec<u64> = (0..layout.total())
            .filter(|s| layout.kind(*s) == Kind::Rescheduled)
            .take(2)
            .collect();
        for seq in &rescheduled {
            c.target(*seq, 1, 3);
        }
        let doubled = |c: &Collected, late: &[u64]| {
            c.by_kind(&layout, late)
                .into_iter()
                .find(|(kind, _)| *kind == Kind::Rescheduled)
                .map(|(_, (_, doubled))| doubled)
        };
        assert_eq!(doubled(&c, &[]), Some(2));
        assert_eq!(
            doubled(&c, &rescheduled[..1]),
            Some(1),
            "the late one not counted"
        );
        assert_eq!(
            c.outcomes(&layout, &rescheduled[..1]).doubled,
            1,
            "as the outcomes count it"
        );
    }
}
