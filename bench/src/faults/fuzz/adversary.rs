//! `fuzz --adversary`: the fuzz as a publisher who is not an administrator. The bridge signs
//! its state (a random 32-byte `bridge.state_key`) and serves a second route whose target,
//! a topic exchange, has a queue that takes every routing key; the fuzz publishes as a
//! broker user created for the run with exactly the recipe's `publisher` rights
//! (`delay-bridge permissions`), to the first route's ingress only, with a forged
//! `delay-bridge-target` naming the second route's target among its headers. Nothing may
//! reach the second route's queue and nothing may be lost, before and after a `parked
//! replay` of what was parked.

use std::time::Duration;

use anyhow::{Context, Result};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};

use delay_bridge::config::{BrokerUrl, Route};
use delay_bridge::contract::header;
use delay_bridge::contract::signature::StateKeys;
use delay_bridge::permissions::{Grant, grants};
use delay_bridge::sandbox::Sandbox;

use crate::broker_memory::Ctl;

/// The pattern the first route's target queue is bound with.
pub const BOUND: &str = "fuzz.#";
/// A routing key the first target does not bind at first (the bridge parks such a message
/// `unroutable`), and binds before the `parked replay`: replayed, it is delivered.
pub const STRAY_REPLAYED: &str = "stray.replayed";
/// A routing key the first target never binds: replayed, such a message is parked again.
pub const STRAY_PARKED: &str = "stray.parked";

/// A random 32-byte state key.
pub fn random_state_key() -> StateKeys {
    StateKeys::new(&rand::random::<[u8; 32]>(), None).expect("32 bytes are long enough")
}

/// The second route and the publisher of an adversary run.
pub struct Arena {
    /// The second route's ingress (never published to).
    pub other_ingress: String,
    /// The second route's target: a topic exchange.
    pub other_target: String,
    /// Its queue, bound with `#`.
    pub other_queue: String,
    /// The publisher's broker user.
    pub user: BrokerUser,
    /// The broker URL with the publisher's credentials.
    pub publisher_url: BrokerUrl,
    /// The publisher's `write` permission.
    pub publisher_write: String,
}

impl Arena {
    /// Before the bridge starts: adds the second route to `sandbox` (deleted with it), its
    /// target and queue, and creates the publisher's user with `ctl` (deleted by
    /// [`BrokerUser::delete`], or when dropped).
    pub async fn prepare(sandbox: &mut Sandbox, ctl: &str) -> Result<Arena> {
        let prefix = sandbox.prefix().to_string();
        let other_ingress = format!("{prefix}.pay.in");
        let other_target = format!("{prefix}.payments");
        let other_queue = format!("{prefix}.payments.all");
        sandbox
            .add_route(Route::new(other_ingress.clone(), other_target.clone()))
            .await?;
        sandbox
            .declare_extra_exchange(&other_target, ExchangeKind::Topic)
            .await?;
        sandbox.adopt_queue(&other_queue);
        let channel = sandbox.channel().await?;
        channel
            .queue_declare(
                other_queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("declaring {other_queue}"))?;
        channel
            .queue_bind(
                other_queue.as_str().into(),
                other_target.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("binding {other_queue}"))?;
        let _ = channel.close(200, "declared".into()).await;

        let grant = grants(&sandbox.config)
            .into_iter()
            .find(|g| g.role == "publisher")
            .context("the recipe has a publisher")?;
        let base = sandbox.config.url().clone();
        let (_, _, vhost) = base.credentials_and_vhost();
        let name = format!("fuzz-adversary-{:08x}", rand::random::<u32>());
        let password = format!("{:032x}", rand::random::<u128>());
        let user = BrokerUser::create(ctl, &name, &password, &vhost, &grant).await?;
        let mut url = reqwest::Url::parse(base.expose()).context("the broker URL")?;
        let credentials_set =
            url.set_username(&name).is_ok() && url.set_password(Some(&password)).is_ok();
        anyhow::ensure!(credentials_set, "the broker URL takes no credentials");
        let publisher_url = BrokerUrl::parse(url.as_str())?.with_tls(base.tls().cloned());
        Ok(Arena {
            other_ingress,
            other_target,
            other_queue,
            user,
            publisher_url,
            publisher_write: grant.write,
        })
    }

    /// Binds the first route's target queue with [`STRAY_REPLAYED`].
    pub async fn bind_stray_replayed(&self, sandbox: &Sandbox) -> Result<()> {
        let channel = sandbox.channel().await?;
        channel
            .queue_bind(
                sandbox.target_queue.as_str().into(),
                sandbox.target.as_str().into(),
                STRAY_REPLAYED.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("binding {} with {STRAY_REPLAYED}", sandbox.target_queue))?;
        let _ = channel.close(200, "bound".into()).await;
        Ok(())
    }

    /// Publishes one genuine message (as the sandbox's own user) to the second route's
    /// ingress and says whether it reaches the second route's queue within `within`: the
    /// route works, so nothing reaching it meant something.
    pub async fn control_arrives(&self, sandbox: &Sandbox, within: Duration) -> Result<bool> {
        let channel = crate::load::confirm_channel(&sandbox.conn).await?;
        let mut headers = FieldTable::default();
        headers.insert(header::DELAY.into(), AMQPValue::LongLongInt(0));
        channel
            .basic_publish(
                self.other_ingress.as_str().into(),
                "control".into(),
                BasicPublishOptions::default(),
                b"control",
                BasicProperties::default().with_headers(headers),
            )
            .await?
            .await?;
        let deadline = tokio::time::Instant::now() + within;
        let arrived = loop {
            let got = channel
                .basic_get(
                    self.other_queue.as_str().into(),
                    BasicGetOptions { no_ack: true },
                )
                .await?;
            if got.is_some_and(|m| m.delivery.data == b"control") {
                break true;
            }
            if tokio::time::Instant::now() > deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let _ = channel.close(200, "control".into()).await;
        Ok(arrived)
    }
}

/// A broker user created for the run, deleted by [`BrokerUser::delete`] or, on any other
/// way out (an error, a panic), when dropped.
pub struct BrokerUser {
    name: String,
    ctl: String,
    deleted: bool,
}

impl BrokerUser {
    /// `rabbitmqctl add_user` and `set_permissions` with `grant`'s three patterns on
    /// `vhost`.
    async fn create(
        ctl: &str,
        name: &str,
        password: &str,
        vhost: &str,
        grant: &Grant,
    ) -> Result<BrokerUser> {
        let run = Ctl::parse(ctl)?;
        run.call(&["add_user", name, password]).await?;
        let user = BrokerUser {
            name: name.to_string(),
            ctl: ctl.to_string(),
            deleted: false,
        };
        run.call(&[
            "set_permissions",
            "-p",
            vhost,
            name,
            &grant.configure,
            &grant.write,
            &grant.read,
        ])
        .await?;
        Ok(user)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `rabbitmqctl delete_user`.
    pub async fn delete(mut self) -> Result<()> {
        self.deleted = true;
        Ctl::parse(&self.ctl)?
            .call(&["delete_user", &self.name])
            .await
            .map(|_| ())
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        let mut words = self.ctl.split_whitespace();
        if let Some(program) = words.next() {
            let _ = std::process::Command::new(program)
                .args(words)
                .args(["delete_user", &self.name])
                .output();
        }
    }
}
