//! The two queues a session consumes, each on a channel of its own: the work queue (new
//! messages and those back from a level) and the hold queue (bundles of messages in their
//! last second, `bridge.bundle_hops`). A delivery tag is its channel's, so every delivery
//! carries its lane, and is acked on that lane's channel.

/// Which queue, and so which channel, a delivery came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// The work queue.
    Work,
    /// The hold queue: what is in it only waits out its last moments.
    Hold,
}

/// A delivery: the lane it came on and its tag on that lane's channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LaneTag {
    /// The lane (channel) the tag belongs to.
    pub lane: Lane,
    /// The delivery tag on that channel.
    pub tag: u64,
}
