//! The byte budget for unacknowledged deliveries, as pure bookkeeping: how many body bytes
//! the bridge holds, and how wide the consumer's prefetch window may be so that the broker
//! cannot push more than `bridge.max_unacked_bytes` of bodies at it.
//!
//! `prefetch` counts messages; the broker sends up to that many before the bridge sees one,
//! so bytes can only be bounded by narrowing that window. A consumer's window is fixed when
//! it starts (RabbitMQ applies `basic.qos` to consumers started after it), so changing it
//! means cancelling the consumer and starting another one: the session does that when
//! [`ByteBudget::taken`] says so.
//!
//! - The window is as many of the largest body seen lately as fit in the budget, between 1
//!   and `prefetch`. A session starts with a window of one ([`START_WINDOW`]): before any
//!   body size is known, the broker pushes a new consumer's whole window at once (a backlog
//!   waiting at a restart, say), so a wider first window would let a publisher's large
//!   bodies fill it past the budget. The first delivery sizes the window.
//! - "Lately" is the current period: the deliveries since the window was set, or since the
//!   last window's worth of them. A body that makes the window too wide narrows it at once;
//!   a period of a window's worth of bodies that would fit twice as many widens it, and
//!   otherwise the next period starts afresh. So a large body narrows the window while it
//!   and its like keep coming, and one window's worth of small deliveries after the last
//!   of them widens it back: it never stays narrow for the small bodies behind it.
//! - Over the budget, the consumer pauses, and consumes again with the narrowed window once
//!   half the budget is free.
//!
//! What this cannot bound: the deliveries the broker sent before the bridge saw a larger
//! body than before, at most one window of them. A window widened for small bodies can
//! therefore hold that many large ones past the budget once, before it narrows.

/// The window a session starts with, before any body size is known: one delivery, which
/// sizes the next window.
pub(crate) const START_WINDOW: u16 = 1;

/// What the session should do after taking a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retune {
    /// Cancel the consumer; consume again with this window once [`ByteBudget::may_resume`].
    Pause(u16),
    /// Cancel the consumer and consume again at once with this window.
    Resize(u16),
}

/// Unacked body bytes and the consumer window that keeps them within the budget.
#[derive(Debug)]
pub(crate) struct ByteBudget {
    budget: u64,
    prefetch: u16,
    /// The window of the running consumer, or of the next one while a retune is under way.
    window: u16,
    /// True while a consumer is being replaced.
    retuning: bool,
    /// The largest body taken in the current period (since the window was last set, or
    /// since the last window's worth of deliveries).
    largest: u64,
    /// Deliveries taken in the current period.
    taken_in_period: u64,
    unacked: u64,
}

impl ByteBudget {
    /// A budget of `budget` bytes for a consumer whose widest window is `prefetch`.
    pub(crate) fn new(budget: u64, prefetch: u16) -> Self {
        Self {
            budget: budget.max(1),
            prefetch,
            window: START_WINDOW.min(prefetch),
            retuning: false,
            largest: 0,
            taken_in_period: 0,
            unacked: 0,
        }
    }

    /// The window the next consumer starts with.
    pub(crate) fn window(&self) -> u16 {
        self.window
    }

    /// Body bytes held now.
    pub(crate) fn unacked(&self) -> u64 {
        self.unacked
    }

    /// A delivery of `bytes` was taken: whether the consumer's window must change.
    pub(crate) fn taken(&mut self, bytes: u64) -> Option<Retune> {
        self.unacked = self.unacked.saturating_add(bytes);
        self.largest = self.largest.max(bytes);
        self.taken_in_period += 1;
        if self.retuning {
            return None;
        }
        let fits = self.fitting_window();
        if self.unacked > self.budget {
            return Some(self.retune(Retune::Pause(fits.min(self.window))));
        }
        if fits < self.window {
            return Some(self.retune(Retune::Resize(fits)));
        }
        if self.taken_in_period < u64::from(self.window) {
            return None;
        }
        // A window's worth showed the bodies: widen by a clear margin, or judge the next
        // window's worth on its own (a large body seen before it no longer counts).
        let clearly_wider = fits >= self.window.saturating_mul(2).min(self.prefetch);
        if clearly_wider && fits > self.window {
            return Some(self.retune(Retune::Resize(fits)));
        }
        self.new_period();
        None
    }

    /// A delivery of `bytes` was settled (acked or given back).
    pub(crate) fn settled(&mut self, bytes: u64) {
        self.unacked = self.unacked.saturating_sub(bytes);
    }

    /// True when a paused consumer may be replaced: half the budget is free.
    pub(crate) fn may_resume(&self) -> bool {
        self.unacked <= self.budget / 2
    }

    /// The new consumer started with [`ByteBudget::window`].
    pub(crate) fn resumed(&mut self) {
        self.retuning = false;
    }

    /// As many of the largest body seen as fit in the budget, between 1 and `prefetch`.
    fn fitting_window(&self) -> u16 {
        let fit = self.budget / self.largest.max(1);
        u16::try_from(fit)
            .unwrap_or(u16::MAX)
            .clamp(1, self.prefetch)
    }

    fn retune(&mut self, retune: Retune) -> Retune {
        let (Retune::Pause(window) | Retune::Resize(window)) = retune;
        self.window = window;
        self.retuning = true;
        self.new_period();
        retune
    }

    /// Forgets the bodies seen so far: the next ones alone size the window.
    fn new_period(&mut self) {
        self.largest = 0;
        self.taken_in_period = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KIB: u64 = 1024;

    #[test]
    fn no_amount_taken_overflows_the_count() {
        let mut b = ByteBudget::new(1024 * KIB, 4000);
        b.taken(u64::MAX);
        b.taken(u64::MAX);
        assert_eq!(b.unacked(), u64::MAX);
    }

    /// Before any body is seen, the broker may push a new consumer's whole window at once:
    /// it is one, and the first delivery sizes the next, large or small.
    #[test]
    fn the_first_window_is_one_and_the_first_delivery_sizes_the_next() {
        let mut large = ByteBudget::new(512 * KIB, 4000);
        assert_eq!(large.window(), 1);
        assert_eq!(large.taken(256 * KIB), Some(Retune::Resize(2)));
        let mut small = ByteBudget::new(512 * KIB, 4000);
        assert_eq!(small.taken(100), Some(Retune::Resize(4000)));
        let mut too_large = ByteBudget::new(512 * KIB, 4000);
        assert_eq!(too_large.taken(1024 * KIB), Some(Retune::Pause(1)));
    }

    #[test]
    fn small_bodies_widen_the_window_to_prefetch() {
        let mut b = ByteBudget::new(256 << 20, 4000);
        assert_eq!(b.window(), START_WINDOW);
        let mut retunes = Vec::new();
        for _ in 0..(4 * u64::from(START_WINDOW)) {
            if let Some(r) = b.taken(100) {
                retunes.push(r);
            }
            b.settled(100);
        }
        assert_eq!(retunes, vec![Retune::Resize(4000)]);
        b.resumed();
        assert_eq!(b.window(), 4000);
    }

    #[test]
    fn a_body_too_large_for_the_window_narrows_it_and_over_the_budget_pauses() {
        let mut b = ByteBudget::new(1024 * KIB, 4000);
        assert_eq!(b.taken(256 * KIB), Some(Retune::Resize(4)));
        assert!(b.may_resume());
        b.resumed();
        assert_eq!(b.window(), 4);
        // four fit; a fifth taken before the new window took effect is over the budget
        for _ in 0..3 {
            assert_eq!(b.taken(256 * KIB), None);
        }
        assert_eq!(b.taken(256 * KIB), Some(Retune::Pause(4)));
        assert!(!b.may_resume());
        for _ in 0..3 {
            b.settled(256 * KIB);
        }
        assert!(b.may_resume(), "two bodies of 256 KiB are half the budget");
    }

    /// The large bodies that come while the window is being narrowed (the broker had sent
    /// them already) count in the narrowed window's first period, not for good: a window's
    /// worth of small bodies after them widens it back to `prefetch`.
    #[test]
    fn a_window_narrowed_for_large_bodies_widens_back_once_small_ones_follow() {
        let mut b = ByteBudget::new(1024 * KIB, 4000);
        for _ in 0..(2 * u64::from(START_WINDOW)) {
            if b.taken(100).is_some() {
                b.resumed();
            }
            b.settled(100);
        }
        assert_eq!(b.window(), 4000);
        assert_eq!(b.taken(256 * KIB), Some(Retune::Resize(4)));
        assert_eq!(
            b.taken(256 * KIB),
            None,
            "taken while the consumer is replaced"
        );
        assert_eq!(b.taken(256 * KIB), None);
        b.resumed();
        for _ in 0..3 {
            b.settled(256 * KIB);
        }
        let mut small = 0;
        let widened = loop {
            small += 1;
            assert!(
                small <= 8,
                "still {} after {small} small bodies",
                b.window()
            );
            let retune = b.taken(100);
            b.settled(100);
            if let Some(retune) = retune {
                break retune;
            }
        };
        // The narrowed window's first period still held two large bodies; the next one
        // held small ones only.
        assert_eq!(widened, Retune::Resize(4000));
    }

    #[test]
    fn a_body_larger_than_the_budget_gets_a_window_of_one() {
        let mut b = ByteBudget::new(1024 * KIB, 4000);
        assert_eq!(b.taken(5000 * KIB), Some(Retune::Pause(1)));
    }

    proptest! {
        /// Whatever came before: small bodies (that fit `prefetch` of them) bring a
        /// consumer's window back to `prefetch` within two of its windows' worth of
        /// deliveries plus `prefetch`.
        #[test]
        fn small_bodies_after_anything_widen_back_to_prefetch(
            budget in (64u64 << 10)..(64 << 20),
            prefetch in 1u16..5000,
            before in prop::collection::vec(0u64..(4 << 20), 0..100),
            small_share in 1u64..=100,
        ) {
            let mut b = ByteBudget::new(budget, prefetch);
            for size in &before {
                if b.taken(*size).is_some() {
                    b.resumed();
                }
                b.settled(*size);
            }
            let small = (budget / u64::from(prefetch) * small_share / 100).max(1).min(budget / u64::from(prefetch));
            // The period under way may still count a large body (then it ends, at most one
            // window on), the next may widen part of the way from the bodies before, and
            // one of small bodies only widens to prefetch.
            let limit = 2 * u64::from(b.window()) + u64::from(prefetch) + 1;
            let mut taken = 0;
            while b.window() < prefetch && small * u64::from(prefetch) <= budget {
                taken += 1;
                prop_assert!(taken <= limit, "window {} after {} small bodies", b.window(), taken);
                if b.taken(small).is_some() {
                    b.resumed();
                }
                b.settled(small);
            }
        }

        /// Whatever the sizes: a new window holds that many of the body just taken within
        /// the budget, and a wider one that many of the largest of the last window's worth
        /// of bodies (or it is 1).
        #[test]
        fn a_new_window_fits_the_bodies_it_was_sized_from(
            budget in 1u64..(64 << 20),
            prefetch in 1u16..5000,
            sizes in prop::collection::vec(0u64..(4 << 20), 1..300),
        ) {
            let mut b = ByteBudget::new(budget, prefetch);
            for (i, size) in sizes.iter().enumerate() {
                let before = b.window();
                if let Some(retune) = b.taken(*size) {
                    let (Retune::Pause(window) | Retune::Resize(window)) = retune;
                    prop_assert!(window >= 1 && window <= prefetch);
                    let sized_from = if window > before {
                        let last = usize::from(before).min(i + 1);
                        sizes[i + 1 - last..=i].iter().copied().max().unwrap_or(0)
                    } else {
                        *size
                    };
                    prop_assert!(
                        window == 1 || u64::from(window) * sized_from <= budget,
                        "window {} of {} bytes over {}", window, sized_from, budget
                    );
                    b.resumed();
                }
                b.settled(*size);
            }
        }
    }
}
