//! The settling policy against every disposition: unit and property tests.

use super::*;
use crate::amqp::publisher::PublishError;
use proptest::prelude::*;

const TIMEOUT: Duration = Duration::from_secs(30);

fn refusal(reason: ParkReason, culprit: Culprit) -> Disposition {
    Disposition::Refused(Refusal {
        reason,
        code: 406,
        detail: "closed".into(),
        culprit,
    })
}

fn lost() -> Disposition {
    Disposition::Lost(PublishError::ConfirmTimeout(Duration::from_secs(1)))
}

fn to_target() -> Settling<'static> {
    Settling::new(Destination::Target("orders"), "rk.1", 100, TIMEOUT)
}

fn to_level() -> Settling<'static> {
    Settling::new(Destination::Own("level 1s"), "", 100, TIMEOUT)
}

/// What the state settles as (or the error it gives up with), after `dispositions` at
/// `now`; `None` while it retries.
fn run(
    settling: &mut Settling<'_>,
    dispositions: Vec<Disposition>,
) -> Option<Result<Settled, BridgeError>> {
    let now = Instant::now();
    for disposition in dispositions {
        match settling.next(disposition, now) {
            Next::Settle(settled) => return Some(Ok(settled)),
            Next::Fail(error) => return Some(Err(error)),
            Next::Retry => {}
        }
    }
    None
}

fn parked_reason(settled: Option<Result<Settled, BridgeError>>) -> Option<ParkReason> {
    match settled {
        Some(Ok(Settled::Park(parked))) => Some(parked.reason),
        _ => None,
    }
}

#[test]
fn routed_settles_at_once() {
    assert!(matches!(
        run(&mut to_target(), vec![Disposition::Routed]),
        Some(Ok(Settled::Routed))
    ));
}

#[test]
fn returned_parks_for_a_target_and_renews_the_session_for_the_bridges_own() {
    let returned = || Disposition::Returned {
        code: 312,
        text: "NO_ROUTE".into(),
    };
    match run(&mut to_target(), vec![returned()]) {
        Some(Ok(Settled::Park(parked))) => {
            assert_eq!(parked.reason, ParkReason::Unroutable);
            assert!(parked.detail.contains("`orders`") && parked.detail.contains("`rk.1`"));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        run(&mut to_level(), vec![returned()]),
        Some(Err(BridgeError::OwnQueueMissing(_)))
    ));
}

#[test]
fn a_target_nacking_past_its_timeout_parks_target_full_and_the_bridges_own_never() {
    let t0 = Instant::now();
    let mut target = to_target();
    assert!(matches!(target.next(Disposition::Nacked, t0), Next::Retry));
    let just_before = t0 + TIMEOUT - Duration::from_millis(1);
    assert!(matches!(
        target.next(Disposition::Nacked, just_before),
        Next::Retry
    ));
    assert!(matches!(
        target.next(Disposition::Nacked, t0 + TIMEOUT),
        Next::Settle(Settled::Park(Parked {
            reason: ParkReason::TargetFull,
            ..
        }))
    ));
    let mut level = to_level();
    for hours in 0..100 {
        let at = t0 + Duration::from_secs(3600 * hours);
        assert!(matches!(level.next(Disposition::Nacked, at), Next::Retry));
    }
}

#[test]
fn a_missing_target_parks_after_three_refusals_on_its_own_channel() {
    let mut target = to_target();
    let missing = || refusal(ParkReason::TargetMissing, Culprit::Destination);
    assert!(run(&mut target, vec![missing(), missing()]).is_none());
    assert!(!target.alone(), "every publish to it is refused alike");
    assert_eq!(
        parked_reason(run(&mut target, vec![missing()])),
        Some(ParkReason::TargetMissing)
    );
}

#[test]
fn a_size_refusal_is_this_messages_only_when_the_size_is_its_bodys() {
    let mut own_size = to_target();
    let too_large = |size| refusal(ParkReason::TooLarge, Culprit::SizeOf(size));
    assert!(run(&mut own_size, vec![too_large(100)]).is_none());
    assert!(own_size.alone(), "then alone, to be sure");
    assert_eq!(
        parked_reason(run(&mut own_size, vec![too_large(100), too_large(100)])),
        Some(ParkReason::TooLarge)
    );
    // Another size blames another message three times; then this one goes alone, where
    // any refusal is its own.
    let mut other_size = to_target();
    assert!(run(&mut other_size, vec![too_large(7), too_large(7)]).is_none());
    assert!(!other_size.alone());
    assert!(run(&mut other_size, vec![too_large(7)]).is_none());
    assert!(other_size.alone());
    assert_eq!(
        parked_reason(run(
            &mut other_size,
            vec![too_large(7), too_large(7), too_large(7)]
        )),
        Some(ParkReason::TooLarge)
    );
}

#[test]
fn an_unknown_culprit_sends_the_message_alone() {
    let mut target = to_target();
    let some = || refusal(ParkReason::TargetRefused, Culprit::SomeMessage);
    assert!(run(&mut target, vec![some()]).is_none());
    assert!(target.alone());
}

#[test]
fn the_bridges_own_queue_parks_too_large_and_renews_the_session_for_anything_else() {
    let too_large = || refusal(ParkReason::TooLarge, Culprit::SizeOf(100));
    assert_eq!(
        parked_reason(run(&mut to_level(), (0..3).map(|_| too_large()).collect())),
        Some(ParkReason::TooLarge)
    );
    // On the session's shared channel a missing exchange could be any publish's: the
    // first refusal sends it alone, and three there make it a configuration fault.
    let missing = || refusal(ParkReason::TargetMissing, Culprit::Destination);
    let mut level = to_level();
    assert!(run(&mut level, vec![missing()]).is_none());
    assert!(level.alone());
    assert!(matches!(
        run(&mut level, (0..3).map(|_| missing()).collect()),
        Some(Err(BridgeError::OwnQueueMissing(_)))
    ));
}

#[test]
fn lost_attempts_renew_the_session_after_three() {
    let mut level = to_level();
    assert!(run(&mut level, (0..LOST_ATTEMPTS).map(|_| lost()).collect()).is_none());
    assert!(matches!(run(&mut level, vec![lost()]), Some(Err(_))));
}

/// Any answer but a nack, as the broker may give it.
fn answer() -> impl Strategy<Value = u8> {
    0u8..8
}

fn disposition(kind: u8) -> Disposition {
    match kind {
        0 => Disposition::Routed,
        1 => Disposition::Returned {
            code: 312,
            text: "NO_ROUTE".into(),
        },
        2 => refusal(ParkReason::TargetMissing, Culprit::Destination),
        3 => refusal(ParkReason::TargetRefused, Culprit::Destination),
        4 => refusal(ParkReason::TooLarge, Culprit::SizeOf(100)),
        5 => refusal(ParkReason::TooLarge, Culprit::SizeOf(7)),
        6 => refusal(ParkReason::TargetRefused, Culprit::SomeMessage),
        _ => lost(),
    }
}

proptest! {
    /// Without nacks (which a target's timeout bounds), every publish settles within
    /// a bounded number of attempts: three lost, two refusals of its own, two blaming
    /// others and three sending it alone (one before each refusal of its own: a
    /// missing target's refusal sends it back to the shared channel) at most go by
    /// unsettled.
    #[test]
    fn every_publish_settles_within_eleven_attempts(
        kinds in proptest::collection::vec(answer(), 11),
        to_target_exchange in any::<bool>(),
    ) {
        let mut settling = if to_target_exchange { to_target() } else { to_level() };
        let settled = run(&mut settling, kinds.into_iter().map(disposition).collect());
        prop_assert!(settled.is_some());
    }

    /// The bridge's own queues never park anything but a message too large for them;
    /// a target parks only with a refusal's reason, `unroutable` or `target-full`.
    #[test]
    fn what_is_parked_has_a_reason_its_destination_can_give(
        kinds in proptest::collection::vec(answer(), 1..12),
        to_target_exchange in any::<bool>(),
    ) {
        let mut settling = if to_target_exchange { to_target() } else { to_level() };
        if let Some(reason) = parked_reason(run(&mut settling, kinds.into_iter().map(disposition).collect())) {
            if to_target_exchange {
                prop_assert!(matches!(
                    reason,
                    ParkReason::TargetMissing | ParkReason::TargetRefused | ParkReason::TooLarge | ParkReason::Unroutable
                ));
            } else {
                prop_assert_eq!(reason, ParkReason::TooLarge);
            }
        }
    }

    /// A routed answer settles as routed whatever came before it.
    #[test]
    fn routed_is_routed_after_any_unsettled_answers(
        kinds in proptest::collection::vec(answer(), 0..8),
    ) {
        let mut settling = to_target();
        let now = Instant::now();
        for kind in kinds {
            if !matches!(settling.next(disposition(kind), now), Next::Retry) {
                return Ok(());
            }
        }
        prop_assert!(matches!(settling.next(Disposition::Routed, now), Next::Settle(Settled::Routed)));
    }
}
