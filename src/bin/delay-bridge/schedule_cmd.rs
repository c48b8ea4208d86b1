//! The `schedule`, `cancel` and `reschedule` commands: thin wrappers over the typed client.

use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Args;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::output::outln;
use delay_bridge::client::{Cancelled, Client, Message, Repeat, Scheduled, When};
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::ladder::{format_duration, parse_duration};

/// What to schedule, and when.
#[derive(Debug, Args)]
pub struct ScheduleArgs {
    /// Routing key the message is delivered with.
    #[arg(long, short = 'k', default_value = "")]
    routing_key: String,
    /// The message body (text).
    #[arg(long, short, default_value = "")]
    body: String,
    /// Deliver after this delay: 90s, 30m, 2h30m, ...
    #[arg(long, conflicts_with = "at", required_unless_present_any = ["at", "every", "cron"], value_parser = parse_duration)]
    delay: Option<Duration>,
    /// Deliver at this instant, RFC 3339 (2026-12-24T08:00:00Z).
    #[arg(long)]
    at: Option<String>,
    /// Repeat every interval (5m, 1h30m), the first occurrence one interval from now; needs
    /// --message-id, the schedule's id (cancel it by that id).
    #[arg(long, value_parser = parse_duration, conflicts_with_all = ["delay", "at", "cron"])]
    every: Option<Duration>,
    /// Repeat whenever this cron expression matches ("0 8 * * 1-5"), read in --tz; needs
    /// --message-id.
    #[arg(long, conflicts_with_all = ["delay", "at"])]
    cron: Option<String>,
    /// The IANA time zone of --cron (Europe/Berlin); UTC when not given.
    #[arg(long)]
    tz: Option<String>,
    /// A recurring schedule's last possible occurrence, RFC 3339 or epoch ms.
    #[arg(long)]
    until: Option<String>,
    /// A recurring schedule's number of occurrences.
    #[arg(long)]
    count: Option<u64>,
    /// The ingress exchange to publish to; default: the first route's.
    #[arg(long, short)]
    exchange: Option<String>,
    /// A header to deliver with the message, NAME=VALUE (a string); repeatable.
    #[arg(long = "header", value_name = "NAME=VALUE")]
    headers: Vec<String>,
    /// The `content_type` property.
    #[arg(long)]
    content_type: Option<String>,
}

/// An instant given as RFC 3339 or as epoch milliseconds.
fn parse_instant(text: &str) -> Result<std::time::SystemTime> {
    let ms = match text.parse::<u64>() {
        Ok(ms) => ms,
        Err(_) => {
            let t = chrono::DateTime::parse_from_rfc3339(text).with_context(|| {
                format!("{text:?} is neither an RFC 3339 time nor epoch milliseconds")
            })?;
            u64::try_from(t.timestamp_millis())
                .with_context(|| format!("{text:?} is before 1970"))?
        }
    };
    Ok(UNIX_EPOCH + Duration::from_millis(ms))
}

impl ScheduleArgs {
    /// The time zone of `--cron`.
    fn zone(&self) -> &str {
        self.tz.as_deref().unwrap_or("UTC")
    }

    fn when(&self) -> Result<When> {
        if let Some(at) = &self.at {
            let t = chrono::DateTime::parse_from_rfc3339(at)
                .with_context(|| format!("--at {at:?} is not an RFC 3339 time"))?;
            let ms = u64::try_from(t.timestamp_millis())
                .with_context(|| format!("--at {at:?} is before 1970"))?;
            return Ok(When::At(UNIX_EPOCH + Duration::from_millis(ms)));
        }
        Ok(When::After(self.delay.unwrap_or_default()))
    }

    fn message(&self, config: &Config, id: Option<&str>) -> Result<Message> {
        let exchange = match &self.exchange {
            Some(e) => e.clone(),
            None => config.routes[0].ingress.clone(),
        };
        let mut table = FieldTable::default();
        for h in &self.headers {
            let Some((name, value)) = h.split_once('=') else {
                bail!("--header {h:?} is not NAME=VALUE");
            };
            let name = ShortString::try_new(name.to_string())
                .map_err(|_| anyhow::anyhow!("--header name longer than 255 bytes"))?;
            table.insert(name, AMQPValue::LongString(LongString::from(value)));
        }
        let mut props = BasicProperties::default().with_headers(table);
        if let Some(ct) = &self.content_type {
            props = props.with_content_type(ShortString::from(ct.as_str()));
        }
        let mut message = Message::new(exchange, self.routing_key.clone(), self.body.clone())
            .with_properties(props);
        if let Some(id) = id {
            message = message.with_message_id(id);
        }
        Ok(message)
    }
}

/// A client for the configured bridges: it refuses a message due beyond their
/// `delays.max_delay` before publishing (before cancelling, for a reschedule).
async fn client(config: &Config) -> Result<Client> {
    Ok(Client::connect_to(&config.urls, config.names.prefix())
        .await?
        .with_max_delay(config.max_delay))
}

fn describe(s: &Scheduled) -> String {
    let due = chrono::DateTime::from_timestamp_millis(s.deliver_at as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default();
    let left = Duration::from_millis(s.deliver_at.saturating_sub(now_ms()));
    format!(
        "message id {}: due {due} (in {})",
        s.message_id,
        format_duration(left)
    )
}

fn describe_cancel(c: &Cancelled) -> String {
    format!(
        "cancelled message id {} (tombstone confirmed at {} ms): every copy still pending is dropped at its next hop or before delivery; \
         if it was already delivered, or no such id was scheduled, this is a harmless no-op",
        c.message_id, c.cancelled_at
    )
}

/// `delay-bridge schedule`
pub async fn schedule(config: &Config, args: &ScheduleArgs, id: Option<&str>) -> Result<()> {
    let client = client(config).await?;
    let message = args.message(config, id)?;
    let recurring = args.every.is_some() || args.cron.is_some();
    if args.cron.is_none() && args.tz.is_some() {
        bail!("--tz is the time zone of --cron: give --cron too");
    }
    if !recurring && (args.until.is_some() || args.count.is_some()) {
        bail!("--until and --count end a recurring schedule: give --every or --cron too");
    }
    if recurring && id.is_none() {
        bail!("a recurring schedule needs --message-id: it is the schedule's id, to cancel it by");
    }
    let repeat = Repeat {
        until: args.until.as_deref().map(parse_instant).transpose()?,
        count: args.count,
    };
    let scheduled = match (args.every, &args.cron) {
        (Some(every), _) => client.schedule_every(message, every, repeat).await?,
        (None, Some(cron)) => {
            client
                .schedule_cron(message, cron, args.zone(), repeat)
                .await?
        }
        (None, None) => client.schedule(message, args.when()?).await?,
    };
    let what = match (args.every, &args.cron) {
        (Some(every), _) => format!(" every {}", format_duration(every)),
        (None, Some(cron)) => format!(" on {cron:?} in {}", args.zone()),
        (None, None) => String::new(),
    };
    outln!(
        "scheduled{what} {}{}",
        describe(&scheduled),
        if recurring { " (first occurrence)" } else { "" }
    )?;
    client.close().await?;
    Ok(())
}

/// `delay-bridge cancel`; `due` (RFC 3339 or epoch ms) lets bridges forget the tombstone
/// once the message's due time plus the grace has passed.
pub async fn cancel(config: &Config, id: &str, due: Option<&str>) -> Result<()> {
    let client = client(config).await?;
    let cancelled = match due {
        None => client.cancel(id).await?,
        Some(due) => client.cancel_due(id, parse_instant(due)?).await?,
    };
    outln!("{}", describe_cancel(&cancelled))?;
    client.close().await?;
    Ok(())
}

/// `delay-bridge reschedule`
pub async fn reschedule(config: &Config, id: &str, args: &ScheduleArgs) -> Result<()> {
    if args.every.is_some() || args.cron.is_some() {
        bail!(
            "a recurring schedule is replaced by scheduling it again under its id: use `schedule --message-id {id}`"
        );
    }
    let client = client(config).await?;
    let scheduled = client
        .reschedule(args.message(config, Some(id))?, args.when()?)
        .await?;
    outln!(
        "rescheduled {} (the earlier copy is cancelled)",
        describe(&scheduled)
    )?;
    client.close().await?;
    Ok(())
}
