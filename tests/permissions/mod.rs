//! Who may do what: users holding exactly the permissions `delay-bridge permissions`
//! prints (`delay_bridge::permissions`) run a bridge, schedule, cancel, read `status` and
//! list, replay and purge parked messages, and each is refused (403) where its role must
//! not write or read: a publisher into a level, the work or returns queue, the parked
//! queue, the cancel stream or the bridge's exchanges; an operator consuming the work or
//! returns queue or a level (messages in flight); the bridge's user and the operator on the
//! names of a bridge whose prefix extends theirs (`<prefix>.eu`).

use std::time::Duration;

use delay_bridge::client::{Client, ClientError, Message, When};
use delay_bridge::config::BrokerUrl;
use delay_bridge::permissions::{Grant, grants};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// A user of the test's own holding `grant`, and its URL.
fn user_for(grant: &Grant, tag: &str) -> (TestUser, String) {
    let name = format!("perm-{}-{tag}", grant.role);
    let password = format!("pw-{tag}");
    let user = TestUser::create(
        &name,
        &password,
        [&grant.configure, &grant.write, &grant.read],
    );
    let url = user.url(&password);
    (user, url)
}

/// Publishes one message to `exchange` with `routing_key` as the user of `url`: `None`
/// when the broker confirmed it, else the error that ended the publish.
async fn publish_as(url: &str, exchange: &str, routing_key: &str) -> Option<String> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("the user connects");
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let outcome = match channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions::default(),
            b"forged",
            BasicProperties::default(),
        )
        .await
    {
        Ok(confirm) => confirm.await.map(|_| ()),
        Err(error) => Err(error),
    };
    let _ = connection.close(200, "done".into()).await;
    outcome.err().map(|error| error.to_string())
}

/// Consumes `queue` as the user of `url`: `None` when the broker took the consumer (the
/// connection closes at once, handing back whatever it was sent), else the error.
async fn consume_as(url: &str, queue: &str) -> Option<String> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("the user connects");
    let channel = connection.create_channel().await.unwrap();
    let outcome = channel
        .basic_consume(
            queue.into(),
            "permissions-probe".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await;
    let _ = connection.close(200, "done".into()).await;
    outcome.err().map(|error| error.to_string())
}

/// Declares the queue `queue` as the user of `url`: `None` when the broker declared it,
/// else the error. The queue is deleted again as guest either way.
async fn declare_as(url: &str, queue: &str) -> Option<String> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("the user connects");
    let channel = connection.create_channel().await.unwrap();
    let outcome = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await;
    let _ = connection.close(200, "done".into()).await;
    let guest = connect().await;
    let channel = guest.create_channel().await.unwrap();
    let _ = channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    let _ = guest.close(200, "done".into()).await;
    outcome.err().map(|error| error.to_string())
}

/// `parked <args> --json` as the user of `config`, parsed; the number of messages it
/// selected and of those it replayed or purged.
async fn parked_as(
    config: &delay_bridge::sandbox::process::ConfigFile,
    args: &[&str],
) -> (usize, usize) {
    let mut command = vec!["parked"];
    command.extend_from_slice(args);
    command.push("--json");
    let (ok, out) = run_command(config, &command).await;
    assert!(ok, "parked {args:?} as the operator: {out}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let selected = report["selected"].as_array().expect("selected");
    let done = selected.iter().filter(|o| o["done"] == true).count();
    (selected.len(), done)
}

/// Waits until `queue` holds `n` messages.
async fn wait_for_depth(w: &World, queue: &str, n: u64, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let depth = w.queue_depth(queue).await;
        if depth == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "`{queue}` holds {depth}, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn assert_refused(outcome: Option<String>, what: &str) {
    let error = outcome.unwrap_or_else(|| panic!("{what}: taken, not refused"));
    assert!(
        error.contains("ACCESS_REFUSED"),
        "{what}: refused for another reason: {error}"
    );
}

#[tokio::test]
async fn each_role_does_its_job_with_the_recipes_rights_and_is_refused_the_rest() {
    // The test reads the parked queue itself, as the operator.
    let mut w = World::start(Setup {
        start_bridge: false,
        watch_parked: false,
        ..Setup::new("permissions")
    })
    .await;
    let tag = format!("{:08x}", rand::random::<u32>());
    let recipe = grants(&w.config);
    let role = |name: &str| recipe.iter().find(|g| g.role == name).expect("a role");
    let (_bridge_user, bridge_url) = user_for(role("bridge"), &tag);
    let (_publisher, publisher_url) = user_for(role("publisher"), &tag);
    let (_canceller, canceller_url) = user_for(role("canceller"), &tag);
    let (_operator, operator_url) = user_for(role("operator"), &tag);
    let config = w.config.clone();
    let as_user = |url: &str| {
        let mut config = config.clone();
        config.urls = vec![BrokerUrl::parse(url).expect("a URL")];
        delay_bridge::sandbox::process::ConfigFile::write(&config).expect("config written")
    };

    // The bridge's user declares the topology again, consumes, hops and delivers.
    let bridge_config = as_user(&bridge_url);
    let bridge = spawn_process(&bridge_config);
    wait_for_consumers(&w, 1, 20 * SEC).await;

    // A publisher schedules through the ingress; the message is delivered.
    let ingress = w.config.routes[0].ingress.clone();
    let publisher = Client::connect(&publisher_url, w.prefix())
        .await
        .expect("a publisher connects");
    let delivered = Message::new(&ingress, "rk.delivered", b"delivered".to_vec())
        .with_message_id(format!("delivered-{tag}"));
    publisher
        .schedule(delivered, When::After(Duration::from_millis(1_500)))
        .await
        .expect("a publisher schedules");
    // ... and one more, which the canceller cancels before it is due.
    let cancelled_id = format!("cancelled-{tag}");
    let cancelled = Message::new(&ingress, "rk.cancelled", b"cancelled".to_vec())
        .with_message_id(&cancelled_id);
    publisher
        .schedule(cancelled, When::After(Duration::from_secs(3)))
        .await
        .expect("a publisher schedules");
    // A publisher may not cancel: the cancel exchange is not its to write.
    match publisher.cancel(&cancelled_id).await {
        Err(ClientError::Denied { code, .. }) => assert_eq!(code, 403),
        other => panic!("a publisher's cancel: {other:?}"),
    }
    let canceller = Client::connect(&canceller_url, w.prefix())
        .await
        .expect("a canceller connects");
    canceller
        .cancel(&cancelled_id)
        .await
        .expect("a canceller cancels");
    // ... and one no queue of the target takes: the bridge parks it (unroutable).
    let parked_id = format!("parked-{tag}");
    let unroutable =
        Message::new(&ingress, "nobody.listens", b"parked".to_vec()).with_message_id(&parked_id);
    publisher
        .schedule(unroutable, When::After(Duration::from_millis(500)))
        .await
        .expect("a publisher schedules");
    let got = w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"delivered");
    w.assert_quiet(4 * SEC).await;
    let parked_queue = w.config.names.parked_queue();
    wait_for_depth(&w, &parked_queue, 1, 10 * SEC).await;

    // The publisher is refused everywhere but the ingress.
    let names = &w.config.names;
    let mut into_queues = vec![
        names.work_queue(),
        names.returns_queue(),
        names.parked_queue(),
        names.cancel_stream(),
    ];
    into_queues.extend(
        w.config
            .ladder
            .levels()
            .iter()
            .map(|l| names.level_queue(*l)),
    );
    for queue in &into_queues {
        assert_refused(
            publish_as(&publisher_url, "", queue).await,
            &format!("a publisher into `{queue}` through the default exchange"),
        );
    }
    for exchange in [
        names.work_exchange(),
        names.parked_exchange(),
        names.cancel_exchange(),
        w.target.clone(),
    ] {
        assert_refused(
            publish_as(&publisher_url, &exchange, "rk.forged").await,
            &format!("a publisher into exchange `{exchange}`"),
        );
    }
    // The canceller writes tombstones only.
    assert_refused(
        publish_as(&canceller_url, &ingress, "rk.forged").await,
        "a canceller into the ingress",
    );
    assert_refused(
        publish_as(&canceller_url, "", &names.work_queue()).await,
        "a canceller into the work queue",
    );

    // An operator reads the topology (the cancel stream too) and the parked messages,
    // replays them into the work exchange and purges them.
    let operator_config = as_user(&operator_url);
    let (ok, out) = run_command(&operator_config, &["status", "--json"]).await;
    assert!(ok, "status as the operator: {out}");
    let status: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(status["parked"]["by_reason"]["unroutable"], 1, "{status:#}");
    assert!(
        status["cancel_entries"]["tombstones"].as_u64() >= Some(1),
        "{status:#}"
    );
    assert_eq!(parked_as(&operator_config, &["list"]).await, (1, 0));
    assert_eq!(parked_as(&operator_config, &["replay"]).await, (1, 1));
    // The bridge carries the replayed copy to the target again, which parks it again.
    wait_for_depth(&w, &parked_queue, 1, 10 * SEC).await;
    assert_eq!(
        parked_as(&operator_config, &["purge", "--message-id", &parked_id]).await,
        (1, 1)
    );
    wait_for_depth(&w, &parked_queue, 0, 10 * SEC).await;
    assert_refused(
        publish_as(&operator_url, &ingress, "rk.forged").await,
        "an operator into the ingress",
    );
    // An operator may not take messages in flight: not from the work or returns queue, not
    // from a level.
    let first_level = names.level_queue(w.config.ladder.levels()[0]);
    for queue in [names.work_queue(), names.returns_queue(), first_level] {
        assert_refused(
            consume_as(&operator_url, &queue).await,
            &format!("an operator consuming `{queue}`"),
        );
    }

    // Neither the bridge's user nor an operator has rights on the names of a bridge whose
    // prefix extends theirs (refused, not "not found": the rights are checked first).
    let nested = delay_bridge::naming::Names::new(format!("{}.eu", w.prefix()));
    for queue in [nested.work_queue(), nested.parked_queue()] {
        assert_refused(
            consume_as(&operator_url, &queue).await,
            &format!("an operator consuming `{queue}`"),
        );
        assert_refused(
            consume_as(&bridge_url, &queue).await,
            &format!("the bridge's user consuming `{queue}`"),
        );
        assert_refused(
            declare_as(&bridge_url, &queue).await,
            &format!("the bridge's user declaring `{queue}`"),
        );
    }
    assert_refused(
        publish_as(&bridge_url, &nested.work_exchange(), "rk.forged").await,
        &format!("the bridge's user into `{}`", nested.work_exchange()),
    );

    let status = bridge.terminate(15 * SEC).await.expect("the bridge stops");
    assert!(status.success(), "the bridge as its user exited {status}");
    w.assert_quiet(Duration::from_millis(500)).await;
    w.cleanup().await;
}
