//! The `delay-bridge` command line: run the bridge, run a demo, plan a delay, check a config.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use output::{out, outln};
use tokio_util::sync::CancellationToken;

use delay_bridge::bridge::Bridge;
use delay_bridge::config::{Config, LogFormat, defaults};
use delay_bridge::http::{self, Endpoints, MetricsRegistry};
use delay_bridge::ladder::parse_duration;

mod declare_cmd;
mod demo;
mod error_report;
mod health;
mod output;
mod parked_cmd;
mod permissions_cmd;
mod plan_cmd;
mod schedule_cmd;
mod status_cmd;

/// Exact, arbitrary delayed delivery for RabbitMQ, without a broker plugin.
///
/// Publish a message with an `x-delay` header (milliseconds) or `x-deliver-at` (epoch ms or
/// RFC 3339) to a route's ingress exchange; delay-bridge delivers it to the route's target
/// exchange when it is due, with its routing key, body and properties unchanged.
#[derive(Debug, Parser)]
#[command(name = "delay-bridge", version, propagate_version = true)]
struct Cli {
    /// The configuration file (TOML). See config/delay-bridge.toml for every key.
    #[arg(
        short,
        long,
        global = true,
        env = "DELAY_BRIDGE_CONFIG",
        default_value = "config/delay-bridge.toml"
    )]
    config: PathBuf,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the bridge until SIGINT or SIGTERM.
    Run,
    /// Declare the topology as `run` does, without consuming, and exit.
    ///
    /// The exchanges, queues and bindings: each route's ingress exchange exists and is bound
    /// to `<prefix>.work`, which holds what is published to it until a bridge runs.
    /// Idempotent; moving off the delayed-message plugin needs it
    /// (docs/moving-off-the-plugin.md).
    Declare,
    /// Run a bridge in process against the broker, publish a few delayed messages with plain
    /// AMQP and `x-delay`, print each arrival, clean up and exit.
    Demo,
    /// Print the hops and the final hold of one delay, for example `plan 5h` or `plan 1500ms`.
    Plan {
        /// The delay: 1500ms, 90s, 5h, 40d, ...
        #[arg(value_parser = parse_duration)]
        delay: Duration,
        /// The ladder to plan with (a preset or a list such as "1s 1m 1h"); default: the
        /// configured one.
        #[arg(long)]
        ladder: Option<String>,
        /// The margin to plan with; default: the configured one.
        #[arg(long, value_parser = parse_duration)]
        margin: Option<Duration>,
    },
    /// Compare ladders: mean and worst-case hops over delays spread evenly up to --max.
    Ladders {
        /// The longest delay to measure over.
        #[arg(long, default_value = "30d", value_parser = parse_duration)]
        max: Duration,
        /// The margin to plan with; default: the default margin (250ms).
        #[arg(long, value_parser = parse_duration)]
        margin: Option<Duration>,
        /// Extra ladders to compare beside the presets (each a list like "1s 1m 1h").
        #[arg(long = "ladder")]
        extra: Vec<String>,
    },
    /// Validate the configuration (with environment overrides) and print the effective one.
    CheckConfig,
    /// What the bridge's topology holds now: each queue's messages (bytes too with
    /// `[management]`), the work queue's consumers, the parked messages by reason and the
    /// cancel stream's entries; a table, or JSON.
    Status(status_cmd::StatusArgs),
    /// The parked messages: list, replay (back through the bridge) or purge those a filter
    /// selects.
    #[command(subcommand)]
    Parked(parked_cmd::ParkedCommand),
    /// Print the least-privilege permissions of the bridge's user, publishers, cancellers
    /// and operators for this configuration, as `rabbitmqctl set_permissions` commands.
    Permissions,
    /// Ask a running bridge's listener (`metrics.listen`) whether it is alive (`/healthz`),
    /// or with `--ready` whether it is ready (`/readyz`); exits 0 if so, 1 if not. For
    /// container health checks: the image needs no HTTP client.
    Health {
        /// Ask `/readyz` instead of `/healthz`.
        #[arg(long)]
        ready: bool,
    },
    /// Schedule one message through the bridge (waits for the broker's confirm).
    Schedule {
        /// The message id (the handle to cancel or reschedule it); default: a new UUID.
        #[arg(long)]
        message_id: Option<String>,
        #[command(flatten)]
        args: schedule_cmd::ScheduleArgs,
    },
    /// Cancel a scheduled message: every pending copy of this id published before now is
    /// dropped. A delivered or unknown id is a harmless no-op.
    Cancel {
        /// The message id to cancel.
        message_id: String,
        /// When the message was due (RFC 3339 or epoch ms, as `schedule` printed it): the
        /// bridges then forget the cancel once that time plus `cancel.grace` has passed,
        /// instead of keeping it `max_delay` longer.
        #[arg(long)]
        due: Option<String>,
    },
    /// Move a scheduled message to a new time: cancel its id, then schedule it again.
    Reschedule {
        /// The message id to move.
        message_id: String,
        #[command(flatten)]
        args: schedule_cmd::ScheduleArgs,
    },
}

/// What the AMQP client must never log, whatever `RUST_LOG` says: the returned messages it
/// dumps at warn (bodies and header values) and its frame traces (a connection's first frames
/// carry the credentials).
const SILENCED: [&str; 2] = ["lapin::returned_messages=off", "lapin::frames=debug"];

/// `RUST_LOG`, or `default` when it is unset, with [`SILENCED`] on top.
fn log_filter(default: &str) -> tracing_subscriber::EnvFilter {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    SILENCED.iter().fold(filter, |filter, directive| {
        filter.add_directive(directive.parse().expect("a valid directive"))
    })
}

/// The stack of every thread this process starts (in bytes), the AMQP client's I/O thread
/// included: its parser recurses once per level of a header table, so a hostile publisher's
/// table nested ~1 150 levels deep (8 KiB) overflowed the default 2 MiB and aborted the
/// bridge, again at every redelivery. The deepest table a 128 KiB frame can carry (~18 700
/// levels) needs about 32 MiB in a release build and over 128 MiB in a debug one. This is
/// address space reserved per thread, not memory used.
const THREAD_STACK_BYTES: &str = "268435456";

/// Starts this program again with `RUST_MIN_STACK` set, unless it is set already: the
/// standard library reads it when the first thread starts, and setting it from inside the
/// process would need `unsafe`. `exec` keeps the process id, so signals and supervisors
/// see no difference. Returns only if that is impossible.
fn ensure_thread_stack() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os("RUST_MIN_STACK").is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut args = std::env::args_os();
    let error = std::process::Command::new(exe)
        .arg0(args.next().unwrap_or_default())
        .args(args)
        .env("RUST_MIN_STACK", THREAD_STACK_BYTES)
        .exec();
    eprintln!(
        "delay-bridge: could not restart with RUST_MIN_STACK={THREAD_STACK_BYTES} ({error}); \
         set it yourself: a header table nested deeper than ~1 000 levels would crash the bridge"
    );
}

fn main() -> ExitCode {
    ensure_thread_stack();
    match dispatch(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        // Its reader has what it wanted (`| head`): nothing went wrong.
        Err(error) if output::is_closed_pipe(&error) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {}", error_report::error_report(&error));
            ExitCode::FAILURE
        }
    }
}

/// Runs the command `cli` names.
fn dispatch(cli: Cli) -> Result<()> {
    // The commands that work with a broker read the whole configuration first, so that
    // `log.format` applies to their first line; `plan` and `ladders` read it leniently.
    let config = match cli.command {
        Command::Plan { .. } | Command::Ladders { .. } => None,
        _ => Some(load(&cli)?),
    };
    // The demo prints its own story; the bridge's logs would interleave with it. A command
    // that ends reports its own errors: the AMQP client's log lines would say them again.
    let default_filter = match cli.command {
        Command::Run => "info",
        Command::Demo => "warn",
        _ => "info,lapin=off",
    };
    init_logging(
        config.as_ref().map_or(LogFormat::Text, |c| c.log_format),
        default_filter,
    );
    match (&cli.command, config) {
        (Command::Run, Some(config)) => {
            bridge_runtime(config.worker_threads)?.block_on(run(config))
        }
        (Command::Demo, Some(config)) => runtime()?.block_on(demo::run_demo(&config)),
        (Command::Declare, Some(config)) => runtime()?.block_on(declare_cmd::declare(&config)),
        (
            Command::Plan {
                delay,
                ladder,
                margin,
            },
            _,
        ) => {
            let settings = plan_cmd::PlanSettings::read(&cli.config, ladder.as_deref(), *margin)?;
            let name = ladder.as_deref().unwrap_or("configured");
            out!("{}", plan_cmd::render_plan(*delay, name, &settings))?;
            Ok(())
        }
        (Command::Ladders { max, margin, extra }, _) => {
            plan_cmd::print_ladders(*max, margin.unwrap_or(defaults::MARGIN), extra)
        }
        (Command::Schedule { message_id, args }, Some(config)) => {
            runtime()?.block_on(schedule_cmd::schedule(&config, args, message_id.as_deref()))
        }
        (Command::Cancel { message_id, due }, Some(config)) => {
            runtime()?.block_on(schedule_cmd::cancel(&config, message_id, due.as_deref()))
        }
        (Command::Reschedule { message_id, args }, Some(config)) => {
            runtime()?.block_on(schedule_cmd::reschedule(&config, message_id, args))
        }
        (Command::Parked(command), Some(config)) => {
            runtime()?.block_on(parked_cmd::run(&config, command))
        }
        (Command::Status(args), Some(config)) => {
            runtime()?.block_on(status_cmd::status(&config, args))
        }
        (Command::Permissions, Some(config)) => {
            out!("{}", permissions_cmd::render(&config))?;
            Ok(())
        }
        (Command::Health { ready }, Some(config)) => {
            runtime()?.block_on(health::check(&config, *ready))
        }
        (Command::CheckConfig, Some(config)) => {
            outln!("# {}: valid", cli.config.display())?;
            out!("{config}")?;
            Ok(())
        }
        (_, None) => bail!("the configuration was not loaded for this command"),
    }
}

/// Log lines to stderr: plain text (coloured only on a terminal) or one JSON object per
/// line, filtered by `RUST_LOG` or `default_filter`.
fn init_logging(format: LogFormat, default_filter: &str) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(log_filter(default_filter))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_ansi(false)
            .init(),
    }
}

/// The runtime of `delay-bridge run`: `bridge.worker_threads` workers.
fn bridge_runtime(worker_threads: usize) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn load(cli: &Cli) -> Result<Config> {
    Config::load(&cli.config)
        .with_context(|| format!("invalid configuration {}", cli.config.display()))
}

async fn run(config: Config) -> Result<()> {
    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown requested");
        on_signal.cancel();
    });
    let bridge = match config.metrics {
        Some(metrics) => {
            let registry = Arc::new(MetricsRegistry::new());
            let bridge = Bridge::with_metrics(config, registry.recorder());
            let listener = tokio::net::TcpListener::bind(metrics.listen)
                .await
                .with_context(|| format!("cannot listen on metrics.listen = {}", metrics.listen))?;
            tracing::info!(
                "metrics on http://{0}/metrics, health on /healthz and /readyz",
                listener.local_addr().unwrap_or(metrics.listen)
            );
            let endpoints = Endpoints {
                registry,
                stats: bridge.stats(),
                ready: bridge.ready(),
            };
            let stop_serving = shutdown.clone();
            tokio::spawn(async move {
                if let Err(e) = http::serve(listener, endpoints, stop_serving).await {
                    tracing::error!("the metrics listener failed: {e}");
                }
            });
            bridge
        }
        None => Bridge::new(config),
    };
    // On a worker thread, not on the main thread that blocks on this future: the session
    // loop and the message tasks then share the runtime's workers.
    tokio::spawn(bridge.run(shutdown))
        .await
        .context("the bridge task panicked")??;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
