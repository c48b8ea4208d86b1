//! Turns at publishing to the targets for the messages of bundles, shared fairly.
//!
//! A bundle carries up to thousands of messages due within one window, or at one instant (a
//! burst). Were they all written to their target's channel the moment they are due, a
//! message due a moment later in another bundle would queue behind every one of them (the
//! broker reads a channel in order). So the messages of bundles publish in turns: at most
//! [`WIDTH`] at once, and when more wait, the lanes take turns round-robin. A lane is the
//! messages of one bundle due at one instant: a burst's, or a single message due a moment
//! later (in the burst's bundle or another). A lane of a few messages then waits for at most
//! one turn of each busy lane, however many messages the busiest one holds.
//!
//! [`Turns`] is the bookkeeping, without I/O; [`Lanes`] hands out the turns to tasks.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// How many messages of bundles may be publishing at once: enough to keep the broker busy
/// (it confirms persistent messages in batches, a few milliseconds apart under load), few
/// enough that a message due now waits behind at most this many.
pub(crate) const WIDTH: usize = 128;

/// Who publishes next: at most `width` at once, and the lanes waiting take turns.
#[derive(Debug)]
pub(crate) struct Turns<W> {
    width: usize,
    /// Turns given and not yet done.
    in_flight: usize,
    /// Per lane, its waiters in the order they asked.
    waiting: HashMap<u64, VecDeque<W>>,
    /// The lanes with waiters, the next to be served first.
    rotation: VecDeque<u64>,
}

impl<W> Turns<W> {
    /// At most `width` turns at once (at least one).
    pub(crate) fn new(width: usize) -> Self {
        Self {
            width: width.max(1),
            in_flight: 0,
            waiting: HashMap::new(),
            rotation: VecDeque::new(),
        }
    }

    /// A message of `lane` asks for a turn: `Some(waiter)` back when it has one now, `None`
    /// when it waits (a later [`Turns::done`] hands it over).
    pub(crate) fn ask(&mut self, lane: u64, waiter: W) -> Option<W> {
        if self.in_flight < self.width {
            self.in_flight += 1;
            return Some(waiter);
        }
        let queue = self.waiting.entry(lane).or_default();
        if queue.is_empty() {
            self.rotation.push_back(lane);
        }
        queue.push_back(waiter);
        None
    }

    /// A turn ended: the waiter that has it now, if any (the oldest of the next lane in
    /// the rotation).
    pub(crate) fn done(&mut self) -> Option<W> {
        self.in_flight = self.in_flight.saturating_sub(1);
        let lane = self.rotation.pop_front()?;
        let queue = self.waiting.get_mut(&lane)?;
        let waiter = queue.pop_front()?;
        if queue.is_empty() {
            self.waiting.remove(&lane);
        } else {
            self.rotation.push_back(lane);
        }
        self.in_flight += 1;
        Some(waiter)
    }

    /// Turns given and not yet done.
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

/// The turns of one carrier's bundles.
#[derive(Debug)]
pub(crate) struct Lanes {
    turns: Mutex<Turns<oneshot::Sender<Turn>>>,
    next_lane: AtomicU64,
}

impl Lanes {
    /// Lanes sharing [`WIDTH`] turns.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            turns: Mutex::new(Turns::new(WIDTH)),
            next_lane: AtomicU64::new(0),
        })
    }

    /// A lane for the messages of one bundle due at one instant, none of them in it yet
    /// (each [`Lane::join`]s).
    pub(crate) fn open(self: &Arc<Self>) -> Lane {
        Lane {
            id: self.next_lane.fetch_add(1, Ordering::Relaxed),
            lanes: self.clone(),
            members: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn turns(&self) -> std::sync::MutexGuard<'_, Turns<oneshot::Sender<Turn>>> {
        self.turns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A turn ended: hands it to the next waiter still waiting.
    fn pass_on(self: &Arc<Self>) {
        let mut turns = self.turns();
        while let Some(waiter) = turns.done() {
            match waiter.send(Turn::new(self.clone())) {
                Ok(()) => return,
                // It stopped waiting: the turn goes on to the next (without this drop
                // passing it on again under the lock).
                Err(turn) => turn.forget(),
            }
        }
    }
}

/// The lane of one bundle's messages.
#[derive(Debug, Clone)]
pub(crate) struct Lane {
    id: u64,
    lanes: Arc<Lanes>,
    /// How many messages joined it.
    members: Arc<AtomicUsize>,
}

impl Lane {
    /// One more message of the lane: its handle.
    pub(crate) fn join(&self) -> Lane {
        self.members.fetch_add(1, Ordering::Relaxed);
        self.clone()
    }

    /// A burst's lane: more messages than may publish at once. They publish on a channel of
    /// their own, so that a message due meanwhile in another lane, once it has its turn,
    /// does not wait behind them in the broker's channel as well.
    pub(crate) fn is_bulk(&self) -> bool {
        self.members.load(Ordering::Relaxed) > WIDTH
    }

    /// Waits for this lane's turn; the turn ends when the [`Turn`] is dropped.
    pub(crate) async fn turn(&self) -> Turn {
        let (waiter, granted) = oneshot::channel();
        let now = self.lanes.turns().ask(self.id, waiter);
        if let Some(waiter) = now {
            drop(waiter);
            return Turn::new(self.lanes.clone());
        }
        match granted.await {
            Ok(turn) => turn,
            // The lanes are gone with their carrier; nothing waits for this turn.
            Err(_) => Turn { lanes: None },
        }
    }
}

/// A turn at publishing: the next waiter gets it when this is dropped.
#[derive(Debug)]
pub(crate) struct Turn {
    lanes: Option<Arc<Lanes>>,
}

impl Turn {
    fn new(lanes: Arc<Lanes>) -> Self {
        Self { lanes: Some(lanes) }
    }

    /// Ends without passing the turn on (its giver does).
    fn forget(mut self) {
        self.lanes = None;
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(lanes) = self.lanes.take() {
            lanes.pass_on();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_lane_is_a_bursts_once_more_join_it_than_may_publish_at_once() {
        let lanes = Lanes::new();
        let lane = lanes.open();
        let members: Vec<Lane> = (0..WIDTH).map(|_| lane.join()).collect();
        assert!(!members[0].is_bulk(), "as many as may publish at once");
        let last = lane.join();
        assert!(
            last.is_bulk() && members[0].is_bulk(),
            "one more: each member sees it"
        );
        assert!(!lanes.open().join().is_bulk(), "a lane of one");
    }

    #[test]
    fn a_small_lane_waits_one_turn_of_a_busy_one() {
        let mut turns = Turns::new(2);
        assert_eq!(turns.ask(1, "burst-0"), Some("burst-0"));
        assert_eq!(turns.ask(1, "burst-1"), Some("burst-1"));
        for i in 2..100 {
            assert_eq!(turns.ask(1, format!("burst-{i}").leak() as &str), None);
        }
        assert_eq!(turns.ask(2, "small"), None);
        assert_eq!(turns.done(), Some("burst-2"));
        assert_eq!(turns.done(), Some("small"), "after one turn of the burst");
        assert_eq!(turns.done(), Some("burst-3"));
    }

    #[test]
    fn nobody_waits_while_turns_are_free() {
        let mut turns = Turns::new(3);
        assert_eq!(turns.ask(1, 'a'), Some('a'));
        assert_eq!(turns.done(), None);
        assert_eq!(turns.in_flight(), 0);
        assert_eq!(turns.ask(2, 'b'), Some('b'));
    }

    proptest! {
        /// Whatever the asks and dones: never more than `width` at once, every waiter gets
        /// its turn, in its lane's order, and one that was the first of its lane to wait
        /// waits for at most one turn of each other lane.
        #[test]
        fn turns_are_bounded_ordered_and_fair(
            width in 1usize..8,
            steps in prop::collection::vec((0u64..5, any::<bool>()), 1..300),
        ) {
            let mut turns = Turns::new(width);
            let mut next = 0u64;
            // (lane, seq) of the turns held now.
            let mut held: Vec<(u64, u64)> = Vec::new();
            let mut waiting: Vec<(u64, u64)> = Vec::new();
            let mut granted_order: Vec<(u64, u64)> = Vec::new();
            // Per waiter that was the first of its lane to wait: turns given to others while
            // it waited, per other lane.
            let mut passed: HashMap<u64, HashMap<u64, u32>> = HashMap::new();
            let grant = |who: (u64, u64), waiting: &mut Vec<(u64, u64)>, passed: &mut HashMap<u64, HashMap<u64, u32>>| {
                waiting.retain(|w| *w != who);
                for (seq, others) in passed.iter_mut() {
                    if waiting.iter().any(|w| w.1 == *seq && w.0 != who.0) {
                        *others.entry(who.0).or_default() += 1;
                    }
                }
                passed.remove(&who.1);
                who
            };
            for (lane, ask) in steps.into_iter().chain((0..400).map(|_| (0, false))) {
                if ask {
                    let who = (lane, next);
                    next += 1;
                    match turns.ask(lane, who) {
                        Some(w) => held.push(grant(w, &mut waiting, &mut passed)),
                        None => {
                            if !waiting.iter().any(|w| w.0 == lane) {
                                passed.insert(who.1, HashMap::new());
                            }
                            waiting.push(who);
                        }
                    }
                } else if !held.is_empty() {
                    held.remove(0);
                    if let Some(w) = turns.done() {
                        granted_order.push(w);
                        held.push(grant(w, &mut waiting, &mut passed));
                    }
                }
                prop_assert!(held.len() <= width);
                prop_assert_eq!(turns.in_flight(), held.len());
                prop_assert!(waiting.is_empty() || held.len() == width);
                for others in passed.values() {
                    for count in others.values() {
                        prop_assert!(*count <= 1, "waited {} turns of one lane", count);
                    }
                }
            }
            prop_assert!(waiting.is_empty(), "left waiting: {:?}", waiting);
            for lane in 0..5 {
                let seqs: Vec<u64> = granted_order.iter().filter(|w| w.0 == lane).map(|w| w.1).collect();
                prop_assert!(seqs.windows(2).all(|p| p[0] < p[1]));
            }
        }
    }
}
