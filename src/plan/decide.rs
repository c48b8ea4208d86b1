//! The carrier's decision, as pure code: what one message does next, from the clock, its due
//! time, the ladder, the margin and the hop window, and whether its hops travel in bundles.
//! The bridge's carrier does what this says, then asks again; `delay-bridge plan` walks a
//! delay through the same decisions on an ideal clock.
//!
//! Without bundles a hop waits for the end of its hop window (so the hops of a window reach
//! each level together) and then goes alone; the last moments are held here. With bundles a
//! hop joins the bundle of its level that leaves at the window's end, planned for that
//! instant; a message that must then wait out its last moments travels first to the returns
//! queue in the bundle of its window (unless it came from there), and waits there.

use std::time::Duration;

use crate::ladder::Ladder;
use crate::plan::{Step, hop_window_end, next_step};

/// Where a message is, for [`decide`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Situation {
    /// The clock, epoch ms.
    pub now_ms: u64,
    /// The message's due time, epoch ms.
    pub deliver_at: u64,
    /// Its hops travel in bundles (`bridge.bundle_hops`, and every instance reads them).
    pub bundled: bool,
    /// It already waited for its hop window's end (or there is no window).
    pub in_window: bool,
    /// It came from the returns queue (alone or in a bundle): its last moments are waited
    /// out here, never sent back there.
    pub waits_here: bool,
    /// It was consumed from the work queue (a hold there counts as in flight, not held).
    pub from_work: bool,
}

/// The settings [`decide`] reads.
#[derive(Debug, Clone, Copy)]
pub struct Rules<'a> {
    /// The delay levels.
    pub ladder: &'a Ladder,
    /// How much before its due time the last hop lands.
    pub margin: Duration,
    /// The hop window (zero: none).
    pub hop_window: Duration,
}

/// What a message does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Hop into this level now, alone.
    Hop(Duration),
    /// Join the bundle into `level` that leaves at `leaves_at` (epoch ms); a zero level is
    /// the returns queue, through the work exchange. Should the bundle be refused, decide
    /// again without bundles.
    Bundle {
        /// The level queue (zero: the returns queue).
        level: Duration,
        /// When the bundle leaves: the end of the current hop window.
        leaves_at: u64,
    },
    /// Wait until this instant (epoch ms, the end of the hop window), then decide again
    /// with `in_window`.
    AwaitWindow(u64),
    /// Wait here until the due time, then decide again; counted as held (not in flight)
    /// when `counted`.
    Hold {
        /// Reported to the session as held.
        counted: bool,
    },
    /// Publish to the target now.
    Deliver,
}

/// What a message in `situation` does next under `rules`.
pub fn decide(situation: &Situation, rules: &Rules<'_>) -> Decision {
    let Situation {
        now_ms,
        deliver_at,
        bundled,
        in_window,
        ..
    } = *situation;
    let step = |at: u64| next_step(deliver_at, at, rules.ladder, rules.margin);
    match step(now_ms) {
        // A bundled hop is planned for its window's end, when its bundle leaves; one too
        // close to its due time by then waits it out instead.
        Step::Hop(_) if bundled => {
            let leaves_at = hop_window_end(now_ms, rules.hop_window);
            match step(leaves_at) {
                Step::Hop(level) => Decision::Bundle { level, leaves_at },
                Step::Hold(_) | Step::Deliver => wait_out(situation, rules, leaves_at),
            }
        }
        Step::Hop(_) if !in_window => {
            Decision::AwaitWindow(hop_window_end(now_ms, rules.hop_window))
        }
        Step::Hop(level) => Decision::Hop(level),
        Step::Hold(_) if bundled => {
            wait_out(situation, rules, hop_window_end(now_ms, rules.hop_window))
        }
        Step::Hold(_) => Decision::Hold { counted: true },
        Step::Deliver => Decision::Deliver,
    }
}

/// With bundles: a message that must wait out its last moments, its window's bundles
/// leaving at `leaves_at`. Unless it waits here already (it came alone or in a bundle from
/// the returns queue), one due at least a margin after that travels to the returns queue in
/// its window's bundle (through the work exchange) and waits there; the delivery it came in
/// is acked once that is confirmed. So:
/// - the work queue's channel holds nothing for long, and its acks go in order (one
///   `multiple` ack for many; a held delivery makes every ack behind it a single one, for
///   which the broker walks its unacked list);
/// - a bundle back from a level is settled within its window: were it held until its last
///   message is delivered, a crash would deliver again the ones delivered already, and hop
///   again the ones that hopped on.
///
/// Any other holds here; a short hold on the work queue's channel counts as in flight (the
/// acks behind it wait for it, then go as one).
fn wait_out(situation: &Situation, rules: &Rules<'_>, leaves_at: u64) -> Decision {
    let margin = rules.margin.as_millis() as u64;
    if !situation.waits_here && situation.deliver_at >= leaves_at.saturating_add(margin) {
        Decision::Bundle {
            level: Duration::ZERO,
            leaves_at,
        }
    } else {
        Decision::Hold {
            counted: !situation.from_work,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn situation(now_ms: u64, deliver_at: u64) -> Situation {
        Situation {
            now_ms,
            deliver_at,
            bundled: false,
            in_window: false,
            waits_here: false,
            from_work: true,
        }
    }

    #[test]
    fn alone_a_hop_waits_for_its_window_then_goes() {
        let ladder = Ladder::parse("1s 10s").unwrap();
        let rules = Rules {
            ladder: &ladder,
            margin: ms(100),
            hop_window: ms(100),
        };
        let first = situation(1_050, 20_000);
        assert_eq!(decide(&first, &rules), Decision::AwaitWindow(1_100));
        let in_window = Situation {
            now_ms: 1_100,
            in_window: true,
            ..first
        };
        assert_eq!(decide(&in_window, &rules), Decision::Hop(ms(10_000)));
        let last = Situation {
            now_ms: 19_950,
            ..in_window
        };
        assert_eq!(decide(&last, &rules), Decision::Hold { counted: true });
        let due = Situation {
            now_ms: 20_000,
            ..in_window
        };
        assert_eq!(decide(&due, &rules), Decision::Deliver);
    }

    #[test]
    fn bundled_a_hop_joins_the_bundle_of_its_window_and_the_last_moments_go_to_the_returns_queue() {
        let ladder = Ladder::parse("1s 10s").unwrap();
        let rules = Rules {
            ladder: &ladder,
            margin: ms(100),
            hop_window: ms(100),
        };
        let bundled = Situation {
            bundled: true,
            ..situation(1_050, 20_000)
        };
        assert_eq!(
            decide(&bundled, &rules),
            Decision::Bundle {
                level: ms(10_000),
                leaves_at: 1_100
            }
        );
        // 800 ms left: below the smallest level, sent to the returns queue to wait there.
        let near = Situation {
            now_ms: 19_200,
            ..bundled
        };
        assert_eq!(
            decide(&near, &rules),
            Decision::Bundle {
                level: Duration::ZERO,
                leaves_at: 19_200
            }
        );
        // From the returns queue it waits here, counted as held.
        let returned = Situation {
            waits_here: true,
            from_work: false,
            ..near
        };
        assert_eq!(decide(&returned, &rules), Decision::Hold { counted: true });
        // Within a margin of its window's end it waits here too (on the work queue: in
        // flight).
        let last = Situation {
            now_ms: 19_950,
            ..bundled
        };
        assert_eq!(decide(&last, &rules), Decision::Hold { counted: false });
    }

    fn ladder_strategy() -> impl Strategy<Value = Ladder> {
        prop::collection::btree_set(1u64..100_000, 1..8).prop_map(|set| {
            Ladder::new(set.into_iter().map(Duration::from_millis).collect()).unwrap()
        })
    }

    proptest! {
        /// Whatever the situation: nothing is delivered early; a bundle leaves at the end of
        /// the current window, within one window of now; a bundled hop lands at least a
        /// margin before the due time; a message goes to the returns queue only when it did
        /// not come from there and is due a margin after its bundle leaves; without bundles
        /// a hop goes alone only once it waited for its window.
        #[test]
        fn every_decision_keeps_the_rules(
            ladder in ladder_strategy(),
            margin_ms in 0u64..1_000,
            window_ms in 0u64..1_000,
            now_ms in 1_000_000u64..2_000_000,
            ahead_ms in 0u64..500_000,
            bundled in any::<bool>(),
            in_window in any::<bool>(),
            waits_here in any::<bool>(),
            from_work in any::<bool>(),
        ) {
            let rules = Rules { ladder: &ladder, margin: ms(margin_ms), hop_window: ms(window_ms) };
            let situation = Situation {
                now_ms,
                deliver_at: now_ms + ahead_ms,
                bundled,
                in_window,
                waits_here,
                from_work,
            };
            let deliver_at = situation.deliver_at;
            match decide(&situation, &rules) {
                Decision::Deliver => prop_assert!(now_ms >= deliver_at),
                Decision::Bundle { level, leaves_at } => {
                    prop_assert!(bundled);
                    prop_assert!(leaves_at >= now_ms && leaves_at < now_ms + window_ms.max(1));
                    if level.is_zero() {
                        prop_assert!(!waits_here);
                        prop_assert!(deliver_at >= leaves_at + margin_ms);
                    } else {
                        prop_assert!(ladder.levels().contains(&level));
                        let lands = leaves_at + level.as_millis() as u64;
                        prop_assert!(lands + margin_ms <= deliver_at);
                    }
                }
                Decision::Hop(level) => {
                    prop_assert!(!bundled && in_window);
                    prop_assert!(now_ms + level.as_millis() as u64 + margin_ms <= deliver_at);
                }
                Decision::AwaitWindow(until) => {
                    prop_assert!(!bundled && !in_window);
                    prop_assert!(until >= now_ms && until < now_ms + window_ms.max(1));
                }
                Decision::Hold { counted } => {
                    prop_assert!(now_ms < deliver_at);
                    if !counted {
                        prop_assert!(bundled && from_work);
                    }
                }
            }
        }

        /// A bundle passed on whole relies on this: when the first and the last message
        /// due join the same bundle, every message due between them does.
        #[test]
        fn what_the_first_and_the_last_due_join_every_message_between_joins(
            ladder in ladder_strategy(),
            margin_ms in 0u64..1_000,
            window_ms in 0u64..1_000,
            now_ms in 1_000_000u64..2_000_000,
            ahead_ms in 0u64..500_000,
            spread in (0u64..50_000, 0u64..=100),
            from_work in any::<bool>(),
        ) {
            let rules = Rules { ladder: &ladder, margin: ms(margin_ms), hop_window: ms(window_ms) };
            let decide_at = |deliver_at| {
                let situation = Situation {
                    now_ms,
                    deliver_at,
                    bundled: true,
                    in_window: window_ms == 0,
                    waits_here: false,
                    from_work,
                };
                decide(&situation, &rules)
            };
            let (width, percent) = spread;
            let first = now_ms + ahead_ms;
            let last = first + width;
            let between = first + width * percent / 100;
            let joins = decide_at(first);
            if matches!(joins, Decision::Bundle { .. }) && decide_at(last) == joins {
                prop_assert_eq!(decide_at(between), joins);
            }
        }
    }
}
