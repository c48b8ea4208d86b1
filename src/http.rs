//! The metrics and health listener (`[metrics] listen`): Prometheus text on `/metrics`,
//! liveness on `/healthz`, readiness on `/readyz`.
//!
//! Each bridge gets its own [`MetricsRegistry`] (not the process-wide recorder), so a test
//! or a library user running two bridges in one process scrapes each apart.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics::{Key, KeyName, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::bridge::Stats;
use crate::bridge::instruments::{
    HOPS_BUCKETS, HOPS_PER_MESSAGE, LATENESS, LATENESS_BUCKETS, PUBLISH_LATENESS, READ_LATENESS,
};

/// 1 while the bridge is ready, else 0.
pub const READY: &str = "delay_bridge_ready";

/// How often the registry folds recorded histogram samples into its buckets when nobody
/// scrapes (bounds the memory samples take between scrapes).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// A Prometheus registry for one bridge: give [`MetricsRegistry::recorder`] to
/// [`crate::bridge::Bridge::with_metrics`], and the registry to [`serve`].
pub struct MetricsRegistry {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

impl MetricsRegistry {
    /// An empty registry, with the bridge's histogram buckets.
    pub fn new() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(LATENESS.into()), &LATENESS_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(READ_LATENESS.into()), &LATENESS_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(PUBLISH_LATENESS.into()), &LATENESS_BUCKETS)
            })
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full(HOPS_PER_MESSAGE.into()), &HOPS_BUCKETS)
            })
            .expect("the bucket lists are constant and not empty")
            .build_recorder();
        let handle = recorder.handle();
        Self { recorder, handle }
    }

    /// The recorder a bridge registers its metrics with.
    pub fn recorder(&self) -> &dyn Recorder {
        &self.recorder
    }

    /// Every metric as Prometheus text, the `stats` counters and readiness read now.
    pub fn render(&self, stats: &Stats, ready: bool) -> String {
        stats.snapshot().export(&self.recorder);
        self.recorder.describe_gauge(
            KeyName::from_const_str(READY),
            None,
            "1 while the bridge is connected, its topology declared, the cancel stream read and the work queue consumed.".into(),
        );
        self.recorder
            .register_gauge(
                &Key::from_static_name(READY),
                &Metadata::new(module_path!(), Level::INFO, None),
            )
            .set(if ready { 1.0 } else { 0.0 });
        self.handle.render()
    }
}

impl Default for MetricsRegistry {
    fn default() -> Self {
        Self::new()
    }
}

/// What the listener serves: one bridge's registry, counters and readiness.
#[derive(Clone)]
pub struct Endpoints {
    /// The registry the bridge records with.
    pub registry: Arc<MetricsRegistry>,
    /// The bridge's counters ([`crate::bridge::Bridge::stats`]).
    pub stats: Arc<Stats>,
    /// The bridge's readiness ([`crate::bridge::Bridge::ready`]).
    pub ready: watch::Receiver<bool>,
}

/// The routes: `/metrics`, `/healthz`, `/readyz`.
pub fn router(endpoints: Endpoints) -> Router {
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "alive\n" }))
        .route("/readyz", get(readiness))
        .with_state(endpoints)
}

/// Serves [`router`] on `listener` until `shutdown` fires.
pub async fn serve(
    listener: TcpListener,
    endpoints: Endpoints,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let handle = endpoints.registry.handle.clone();
    let upkeep_stop = shutdown.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tokio::select! {
                _ = every.tick() => handle.run_upkeep(),
                _ = upkeep_stop.cancelled() => break,
            }
        }
    });
    axum::serve(listener, router(endpoints))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

async fn metrics_text(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    let ready = *endpoints.ready.borrow();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        endpoints.registry.render(&endpoints.stats, ready),
    )
}

async fn readiness(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    if *endpoints.ready.borrow() {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: connecting, declaring the topology or reading the cancel stream\n",
        )
    }
}
