//! Parked messages the AMQP client cannot read, set aside so that the queue can be read.
//!
//! lapin fails its whole connection on a message whose header name, property or routing
//! key is not UTF-8 (see [`crate::amqp::unreadable`]). The bridge never parks such a
//! message as it is, but one published straight into the parked queue failed every
//! `parked` command and `status`. Setting it aside parks it again as a message lapin can
//! read (reason `unreadable`, its property bytes kept in a header) and removes the
//! original once the broker confirmed that copy.

use std::time::Duration;

use super::{Action, Filter, MOST_AT_ONCE, ParkedError, ParkedMessage, ReplayOn, Report, act};
use crate::amqp::{self, SweepError};
use crate::config::Config;

/// How many times [`act_at`] starts the operation (each time after a set-aside).
const ATTEMPTS: usize = 3;

/// The most sweeps one set-aside runs: each one takes out every unreadable message among
/// the first [`MOST_AT_ONCE`], so it ends long before unless more keep coming.
const SWEEPS_MOST: usize = 100;

/// A sweep ends when no message has come for this long.
const SWEEP_IDLE: Duration = Duration::from_secs(1);

/// Parks again, as messages the AMQP client can read, the messages of `config`'s parked
/// queue it cannot read, among the first [`MOST_AT_ONCE`] (as many as one read takes).
/// Gives how many. Every other message stays where it was in the queue.
pub async fn set_aside_unreadable(config: &Config) -> Result<u64, SweepError> {
    let queue = config.names.parked_queue();
    let mut set_aside = 0;
    for _ in 0..SWEEPS_MOST {
        let swept = amqp::unreadable::sweep(
            config.url(),
            &config.names,
            &queue,
            MOST_AT_ONCE,
            SWEEP_IDLE,
        )
        .await?;
        if swept.parked == 0 {
            break;
        }
        set_aside += swept.parked;
    }
    Ok(set_aside)
}

/// [`act`] on `config`'s parked queue over a connection of its own. When the AMQP client
/// fails on a message it cannot read (which [`act`] meets before it does anything), sets
/// such messages aside ([`set_aside_unreadable`]) and starts again on a new connection, up
/// to three times.
pub async fn act_at(
    config: &Config,
    action: Action,
    filter: &Filter,
    limit: usize,
    dry_run: bool,
) -> Result<Report, ParkedError> {
    let mut set_aside = 0;
    let mut attempt = 1;
    loop {
        let connection = amqp::connect(config.url(), "delay-bridge parked").await?;
        let replay_on = match (action, dry_run) {
            (Action::Replay, false) => {
                Some(amqp::connect_wire(config.url(), "delay-bridge parked replay").await?)
            }
            _ => None,
        };
        let result = act(
            &connection,
            replay_on.as_ref().map(|connection| ReplayOn {
                connection,
                confirm_timeout: config.confirm_timeout,
                state_keys: config.state_keys.as_ref(),
            }),
            &config.names,
            action,
            filter,
            limit,
            dry_run,
        )
        .await;
        let _ = connection.close(200, "done".into()).await;
        if let Some(replay_on) = replay_on {
            replay_on.close().await;
        }
        match result {
            Ok(report) => {
                return Ok(Report {
                    set_aside,
                    ..report
                });
            }
            Err(ParkedError::Unreadable { .. }) if attempt < ATTEMPTS => {
                let now = set_aside_unreadable(config).await?;
                tracing::warn!(
                    set_aside = now,
                    "parked again as `unreadable` the parked messages the AMQP client cannot read"
                );
                set_aside += now;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The first `limit` messages of `config`'s parked queue (at most [`MOST_AT_ONCE`]), and how
/// many it held in all when the read began, read over a connection of its own and past
/// messages the AMQP client cannot read ([`act_at`]). Nothing is removed.
pub async fn peek(config: &Config, limit: u16) -> Result<(Vec<ParkedMessage>, u64), ParkedError> {
    let report = act_at(
        config,
        Action::List,
        &Filter::default(),
        usize::from(limit),
        false,
    )
    .await?;
    let messages = report.selected.into_iter().map(|o| o.message).collect();
    Ok((messages, report.held))
}
