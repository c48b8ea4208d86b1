//! `delay-bridge declare` declares the topology as `run` does and consumes nothing: the step
//! of docs/moving-off-the-plugin.md that needs `<prefix>.work` bound to the new ingress
//! before a bridge may run. An ingress name held by an exchange of another type (the
//! plugin's `x-delayed-message`; here `direct`, which every broker has) stops it with the
//! broker's words; once that exchange is deleted, it declares the `headers` ingress.

use std::time::Duration;

use delay_bridge::config::IngressKind;
use delay_bridge::topology::Topology;
use lapin::ExchangeKind;
use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// `delay-bridge declare` on `config`: whether it succeeded, its stdout and its stderr.
async fn declare(config: &delay_bridge::sandbox::process::ConfigFile) -> (bool, String, String) {
    let output = config
        .command(&bridge_exe())
        .arg("declare")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .output()
        .await
        .expect("delay-bridge runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    eprint!("delay-bridge declare: {stdout}{stderr}");
    (output.status.success(), stdout, stderr)
}

/// A world whose bridge topology is gone again, as on a broker no bridge ran on (the sandbox
/// declares it; its cleanup deletes whatever `declare` makes, even when the test fails).
async fn world_without_topology(test: &str) -> World {
    let w = World::start(Setup {
        start_bridge: false,
        watch_parked: false,
        ..Setup::new(test)
    })
    .await;
    Topology::from_config(&w.config)
        .delete(&w.conn)
        .await
        .expect("the sandbox's bridge topology deleted");
    assert!(
        w.counts(&w.config.names.work_queue()).await.is_err(),
        "no work queue yet"
    );
    w
}

#[tokio::test]
async fn declare_makes_the_topology_and_consumes_nothing() {
    let w = world_without_topology("declare").await;
    let config = w.config_file_with(|_| {});
    let work = w.config.names.work_queue();

    let (ok, stdout, _) = declare(&config).await;
    assert!(ok, "declare failed");
    assert!(
        stdout.contains(&format!(
            "ingress `{}` (fanout) -> {work} (bound)",
            w.ingress
        )),
        "{stdout}"
    );
    let topology = Topology::from_config(&w.config);
    for queue in topology.queues.iter().chain([&topology.cancel_stream]) {
        let counts = w.counts(&queue.name).await.expect("declared");
        assert_eq!(counts.consumers, 0, "{}: nothing consumes", queue.name);
    }

    // The ingress is bound to the work queue: a message published now waits there.
    w.publish("rk.declare.waits", b"waits", with_delay(60_000))
        .await;
    assert_eq!(w.queue_depth(&work).await, 1);

    // Again, as `run` will at its start: nothing changes, the waiting message is kept.
    let (ok, _, _) = declare(&config).await;
    assert!(ok, "a second declare failed");
    let counts = w.counts(&work).await.expect("the work queue");
    assert_eq!((counts.messages, counts.consumers), (1, 0));
    w.cleanup().await;
}

#[tokio::test]
async fn declare_names_the_exchange_in_the_way_and_declares_the_headers_ingress_once_it_is_gone() {
    let mut w = world_without_topology("declare-headers").await;
    let ingress = w.ingress.clone();
    let work = w.config.names.work_queue();
    let config = w.config_file_with(|config| {
        config.routes[0].ingress_kind = IngressKind::Headers;
    });
    // The ingress's name is held by an exchange of another type, as by the plugin's.
    let channel = w.confirm_channel().await;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            ingress.as_str().into(),
            ExchangeKind::Direct,
            durable,
            FieldTable::default(),
        )
        .await
        .expect("the old exchange");

    let (ok, _, stderr) = declare(&config).await;
    assert!(
        !ok,
        "declare must fail while the old exchange holds the name"
    );
    assert!(stderr.contains(&ingress), "{stderr}");
    assert!(stderr.contains("inequivalent arg 'type'"), "{stderr}");

    // The move: the old exchange deleted, declare makes the headers ingress bound to the
    // work queue, and the target bound to it for what carries the drain header only.
    channel
        .exchange_delete(ingress.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("the old exchange deleted");
    let (ok, stdout, _) = declare(&config).await;
    assert!(ok, "declare failed after the delete");
    assert!(
        stdout.contains(&format!("ingress `{ingress}` (headers) -> {work} (bound)")),
        "{stdout}"
    );
    channel
        .exchange_declare(
            ingress.as_str().into(),
            ExchangeKind::Headers,
            durable,
            FieldTable::default(),
        )
        .await
        .expect("the ingress is a durable headers exchange");
    channel
        .exchange_bind(
            w.target.as_str().into(),
            ingress.as_str().into(),
            "rk.declare.drain".into(),
            ExchangeBindOptions::default(),
            headers(vec![
                ("x-match", text("all")),
                ("delay-bridge-plugin-drain", text("yes")),
            ]),
        )
        .await
        .expect("the drain binding");
    w.publish(
        "rk.declare.drain",
        b"through the bridge",
        with_delay(60_000),
    )
    .await;
    assert_eq!(w.queue_depth(&work).await, 1);
    w.assert_quiet(SEC).await;
    w.cleanup().await;
}
