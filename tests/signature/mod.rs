//! `bridge.state_key`: the bridge signs the state of every copy it sends through the levels
//! and parks (`bad-state`) a copy that comes back through the work exchange without a valid
//! signature, so a user who may write to the work exchange or a level cannot forge where,
//! when and as whom the bridge delivers. Without a key, or while unsigned copies are
//! accepted, such a copy is delivered: what the signature protects.

use std::time::Duration;

use delay_bridge::clock::now_ms;
use delay_bridge::contract::signature::StateKeys;
use delay_bridge::contract::{bundle, header};

use crate::bundles::{bundling, in_flight};
use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// The test key (a real one is 32 random bytes: `openssl rand -hex 32`).
const KEY: &[u8] = b"3f9c1a7e5b2d4c6e8a0b1c2d3e4f5a6b";

/// A bundling world (parked messages watched when `watch_parked`) whose bridge signs with
/// `key` (none: no signing), accepting unsigned copies when `accept_unsigned`; the key is
/// also in a file the config names, so that a `delay-bridge` child process of this world
/// has it.
async fn world_with_key(
    test: &str,
    watch_parked: bool,
    key: Option<&[u8]>,
    accept_unsigned: bool,
) -> World {
    let mut w = World::start(Setup {
        start_bridge: false,
        watch_parked,
        ..bundling(test)
    })
    .await;
    if let Some(key) = key {
        let file = std::env::temp_dir().join(format!("{}.key", w.prefix()));
        std::fs::write(&file, key).expect("key file written");
        w.config.state_key_files = (Some(file), None);
        w.config.state_keys = Some(StateKeys::new(key, None).expect("a long enough key"));
    }
    w.config.accept_unsigned_state = accept_unsigned;
    w.start_bridge().await;
    w
}

fn reason(parked: &Received) -> String {
    match parked.header(header::REASON) {
        Some(lapin::types::AMQPValue::LongString(text)) => text.to_string(),
        other => panic!("no reason: {other:?}"),
    }
}

/// Four forged copies, each due now and bound for the world's target: unsigned into the work
/// exchange, signed with another key, as a bundle, and into a level through the default
/// exchange (it dead-letters into the work exchange a second later). Their routing keys are
/// `rk.forged.<n>`.
async fn forge(w: &World) {
    let work = w.config.names.work_exchange();
    let now = now_ms();
    publish_to(
        &w.publisher,
        &work,
        "forged",
        b"forged",
        in_flight(1, now, &w.target),
    )
    .await;
    let other = StateKeys::new(b"another key, at least 16 bytes", None).unwrap();
    let signed_elsewhere = other.sign(in_flight(2, now, &w.target), b"forged");
    publish_to(&w.publisher, &work, "forged", b"forged", signed_elsewhere).await;
    let member = bundle::encode_member(&in_flight(3, now, &w.target), b"forged").unwrap();
    publish_to(
        &w.publisher,
        &work,
        "forged",
        &bundle::bundle_body([member.as_slice()]),
        bundle::bundle_properties(1),
    )
    .await;
    let level = w.config.names.level_queue(Duration::from_secs(1));
    let due = now + 1_000;
    publish_to(
        &w.publisher,
        "",
        &level,
        b"forged",
        in_flight(4, due, &w.target),
    )
    .await;
}

#[tokio::test]
async fn with_a_key_forged_state_is_parked_and_the_bridges_own_copies_are_delivered() {
    let mut w = world_with_key("signed", true, Some(KEY), false).await;
    // Through the ingress: hops in signed bundles, comes back, is delivered.
    w.publish("rk.genuine", b"genuine", with_delay(2_500)).await;
    forge(&w).await;
    for _ in 0..4 {
        let parked = w.parked_within(10 * SEC).await;
        assert_eq!(reason(&parked), "bad-state", "{parked:?}");
    }
    let got = w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"genuine");
    assert_eq!(got.routing_key, "rk.genuine");
    assert!(
        got.properties.headers().as_ref().is_none_or(|h| h
            .inner()
            .keys()
            .all(|k| !k.as_str().starts_with("delay-bridge-"))),
        "no bridge header is delivered: {got:?}"
    );
    w.assert_quiet(SEC).await;
    w.cleanup().await;
}

#[tokio::test]
async fn without_a_key_or_while_unsigned_copies_are_accepted_forged_state_is_delivered() {
    for (test, key, accept_unsigned) in [("unsigned", None, false), ("accepting", Some(KEY), true)]
    {
        let mut w = world_with_key(test, true, key, accept_unsigned).await;
        let work = w.config.names.work_exchange();
        publish_to(
            &w.publisher,
            &work,
            "forged",
            b"forged",
            in_flight(1, now_ms(), &w.target),
        )
        .await;
        let got = w.recv_within(10 * SEC).await;
        assert_eq!(got.routing_key, "rk.forged.1", "{test}");
        // A genuine message still travels (signed when there is a key).
        w.publish("rk.genuine", b"genuine", with_delay(1_500)).await;
        assert_eq!(w.recv_within(10 * SEC).await.body, b"genuine", "{test}");
        w.assert_quiet(SEC).await;
        w.cleanup().await;
    }
}

/// `parked replay` signs the copies it sends back through the work exchange with the
/// configured key: a message the bridge parked at delivery (it signed the parked copy) comes
/// back and is delivered, not parked again `bad-state`. A copy written into the parked queue
/// by hand, whose state no bridge signed, is not replayable.
#[tokio::test]
async fn a_replay_signs_what_it_sends_back() {
    let mut w = world_with_key("replay", false, Some(KEY), false).await;
    let parked_queue = w.config.names.parked_queue();
    let mut by_hand = in_flight(7, now_ms(), &w.target)
        .headers()
        .clone()
        .expect("state headers");
    by_hand.insert(header::REASON.into(), text("unroutable"));
    publish_to(
        &w.publisher,
        "",
        &parked_queue,
        b"by hand",
        lapin::BasicProperties::default()
            .with_message_id("7".into())
            .with_delivery_mode(2)
            .with_headers(by_hand),
    )
    .await;
    // Unroutable at the target (which binds `rk.#`): the bridge parks it.
    w.publish("nobody.8", b"parked", with_delay(200)).await;
    let deadline = std::time::Instant::now() + 10 * SEC;
    while w.queue_depth(&parked_queue).await < 2 {
        assert!(std::time::Instant::now() < deadline, "not parked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.declare_bound_queue(
        &format!("{}.nobody", w.prefix()),
        &w.target.clone(),
        "nobody.#",
    )
    .await;
    let config = w.config_file(4000);
    let (ok, out) = run_command(&config, &["parked", "replay", "--json"]).await;
    assert!(!ok, "the copy written by hand stays parked: {out}");
    assert!(out.contains("did not sign its state"), "{out}");
    assert_eq!(
        w.queue_depth(&parked_queue).await,
        1,
        "the bridge's own went"
    );
    let nobody = format!("{}.nobody", w.prefix());
    let deadline = std::time::Instant::now() + 10 * SEC;
    while w.queue_depth(&nobody).await < 1 {
        assert!(std::time::Instant::now() < deadline, "not delivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(w.queue_depth(&parked_queue).await, 1, "not parked again");
    w.assert_quiet(SEC).await;
    w.cleanup().await;
}
