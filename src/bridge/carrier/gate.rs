//! Whether hops travel in bundles now (`bridge.bundle_hops`): the carrier's state, opened by
//! `bridge::peers` while every instance on the prefix reads bundles. The gauge
//! `delay_bridge_bundling` only reports it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::bridge::stats::Stats;

/// Open while hops travel in bundles; shared by a session's carrier and its peers watch.
#[derive(Clone)]
pub(in crate::bridge) struct BundleGate {
    open: Arc<AtomicBool>,
    /// Where the gauge that reports it lives.
    stats: Arc<Stats>,
}

impl BundleGate {
    /// A closed gate, reported in `stats`.
    pub(super) fn new(stats: Arc<Stats>) -> Self {
        stats.bundling.store(0, Ordering::Relaxed);
        Self {
            open: Arc::default(),
            stats,
        }
    }

    /// True while hops travel in bundles.
    pub(in crate::bridge) fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    /// Closes the gate without reporting it: for a session's end, whose gauge reading the
    /// session clears itself (a next session's gate may be open by then).
    pub(in crate::bridge) fn close_quietly(&self) {
        self.open.store(false, Ordering::Relaxed);
    }

    /// Opens or closes the gate, and reports it; whether it was open.
    pub(in crate::bridge) fn set(&self, open: bool) -> bool {
        self.stats
            .bundling
            .store(u64::from(open), Ordering::Relaxed);
        self.open.swap(open, Ordering::Relaxed)
    }
}
