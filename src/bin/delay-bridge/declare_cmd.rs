//! `delay-bridge declare`: declares the configured topology, as `run` does at every connect,
//! and exits without consuming. For steps that need the bridge's queues and bindings before
//! a bridge may run (docs/moving-off-the-plugin.md).

use anyhow::{Result, anyhow};

use crate::output::out;
use delay_bridge::config::{Config, IngressKind};
use delay_bridge::topology::{Topology, TopologyError};

/// Declares `config`'s topology on the first of its brokers that answers and prints what it
/// holds.
pub async fn declare(config: &Config) -> Result<()> {
    let connection = connect(config).await?;
    let topology = Topology::from_config(config);
    let declared = topology.declare(&connection).await;
    let _ = connection.close(200, "declared".into()).await;
    declared.map_err(explain)?;
    out!("{}", render(config, &topology))?;
    Ok(())
}

/// A connection to the first of the configured brokers that answers.
async fn connect(config: &Config) -> Result<lapin::Connection> {
    let mut failures = Vec::new();
    for url in &config.urls {
        match delay_bridge::amqp::connect(url, "delay-bridge declare").await {
            Ok(connection) => return Ok(connection),
            Err(e) => failures.push(e.to_string()),
        }
    }
    Err(anyhow!("no broker answered: {}", failures.join("; ")))
}

/// The error, with what to do when the exchange in the way is the plugin's own.
fn explain(error: TopologyError) -> anyhow::Error {
    let plugin = matches!(
        &error,
        TopologyError::Mismatch { kind: "exchange", broker, .. }
            if broker.contains("x-delayed-message")
    );
    let error = anyhow::Error::new(error);
    if plugin {
        error.context(
            "an ingress exchange is still the delayed-message plugin's (type \
             x-delayed-message): delete it while the plugin is suspended and declare again, \
             as docs/moving-off-the-plugin.md says",
        )
    } else {
        error.context("declaring the topology")
    }
}

/// What was declared: the prefix, the counts, and each route's ingress with its binding.
fn render(config: &Config, topology: &Topology) -> String {
    let levels = topology.queues.len() - 3;
    let mut out = format!(
        "declared prefix `{}` ({} queues): exchanges {}; queues {}, {}, {} and {} levels; \
         the cancel stream {}\n",
        config.names.prefix(),
        config.queue_type,
        topology.exchanges.join(", "),
        config.names.work_queue(),
        config.names.returns_queue(),
        config.names.parked_queue(),
        levels,
        topology.cancel_stream.name,
    );
    for route in &config.routes {
        let kind = match route.ingress_kind {
            IngressKind::Fanout => "fanout",
            IngressKind::Headers => "headers",
        };
        out.push_str(&format!(
            "route: ingress `{}` ({kind}) -> {} (bound); due messages go to `{}`\n",
            route.ingress,
            config.names.work_queue(),
            route.target,
        ));
    }
    out.push_str("nothing consumes until `delay-bridge run` starts\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugins_exchange_in_the_way_says_what_to_do() {
        let error = explain(TopologyError::Mismatch {
            kind: "exchange",
            name: "orders.delayed".into(),
            broker: "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'orders.delayed' \
                     in vhost '/': received 'headers' but current is 'x-delayed-message'"
                .into(),
        });
        let text = format!("{error:#}");
        assert!(text.contains("moving-off-the-plugin.md"), "{text}");
        assert!(text.contains("orders.delayed"), "{text}");
    }

    #[test]
    fn the_summary_names_the_bound_ingress() {
        let config = Config::from_toml(
            "[topology]\nprefix = \"p\"\n[delays]\nladder = \"1s 1m\"\n[bridge]\nhop_window = \"0s\"\n\
             [[route]]\ningress = \"orders.delayed\"\ntarget = \"orders\"\ningress_type = \"headers\"\n",
            "<test>",
            &[],
        )
        .expect("valid");
        let text = render(&config, &Topology::from_config(&config));
        assert!(text.contains("declared prefix `p`"), "{text}");
        assert!(text.contains("2 levels"), "{text}");
        assert!(
            text.contains("ingress `orders.delayed` (headers) -> p.work (bound)"),
            "{text}"
        );
    }
}
