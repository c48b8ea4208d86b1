//! RabbitMQ's management HTTP API, read for what AMQP does not tell: how many of a quorum
//! queue's messages expired but wait for its dead-letter worker (`messages_dlx`) beside
//! its ready ones. A passive `queue.declare` gives the ready count only.
//!
//! One request per poll lists the bridge's own queues (`name` filtered by the prefix on the
//! broker's side), so the cost does not grow with the broker's other queues.

use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use crate::config::{BrokerUrl, ManagementUrl};

/// Why the management API gave no answer.
#[derive(Debug, Error)]
pub enum ManagementError {
    /// No node answered, or one answered with an error status.
    #[error("management API at {url}: {source}")]
    Request {
        /// The node asked (password redacted).
        url: String,
        /// What went wrong.
        source: reqwest::Error,
    },
}

/// One queue as the management API counts it. The broker publishes these figures every few
/// seconds (`collect_statistics_interval`, 5 s by default), not live.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct QueueFigures {
    /// The queue's name.
    pub name: String,
    /// Every message the queue holds.
    #[serde(default)]
    pub messages: u64,
    /// Messages ready for a consumer.
    #[serde(default)]
    pub messages_ready: u64,
    /// Messages delivered and not yet acknowledged.
    #[serde(default)]
    pub messages_unacknowledged: u64,
    /// Quorum queues: messages that expired and wait for the dead-letter worker to forward
    /// them (at-least-once dead-lettering).
    #[serde(default)]
    pub messages_dlx: u64,
    /// Bytes of the bodies the queue holds.
    #[serde(default)]
    pub message_bytes: u64,
    /// Consumers of the queue.
    #[serde(default)]
    pub consumers: u64,
}

/// A page of queues as the API returns it when asked to filter.
#[derive(Deserialize)]
struct Page {
    items: Vec<QueueFigures>,
}

/// A reader of the management API of one or more nodes (any node answers for the whole
/// cluster; the next is tried when one does not answer).
#[derive(Clone)]
pub struct Management {
    urls: Vec<ManagementUrl>,
    user: String,
    password: String,
    vhost: String,
    client: reqwest::Client,
}

impl Management {
    /// A reader of `urls`, logging in with the credentials in each URL or else those of
    /// `broker`, for `broker`'s virtual host. Each request gives up after `timeout`.
    pub fn new(urls: &[ManagementUrl], broker: &BrokerUrl, timeout: Duration) -> Self {
        let (user, password, vhost) = broker.credentials_and_vhost();
        Self {
            urls: urls.to_vec(),
            user,
            password,
            vhost,
            client: reqwest::Client::builder()
                .timeout(timeout)
                .build()
                .expect("an HTTP client without TLS options builds"),
        }
    }

    /// The figures of every queue whose name starts with `prefix` and a dot.
    pub async fn queues(&self, prefix: &str) -> Result<Vec<QueueFigures>, ManagementError> {
        let mut last = None;
        for url in &self.urls {
            match self.queues_from(url, prefix).await {
                Ok(queues) => return Ok(queues),
                Err(source) => {
                    last = Some(ManagementError::Request {
                        url: url.to_string(),
                        source,
                    })
                }
            }
        }
        Err(last.expect("a configuration names at least one management URL"))
    }

    async fn queues_from(
        &self,
        url: &ManagementUrl,
        prefix: &str,
    ) -> Result<Vec<QueueFigures>, reqwest::Error> {
        let (user, password) = url
            .credentials()
            .unwrap_or((self.user.clone(), self.password.clone()));
        let mut endpoint = url.base();
        endpoint
            .path_segments_mut()
            .expect("an http URL has a path")
            .pop_if_empty()
            .extend(["api", "queues", &self.vhost]);
        let name_filter = format!("^{}\\.", regex_escape(prefix));
        let page: Page = self
            .client
            .get(endpoint)
            .basic_auth(user, Some(password))
            .query(&[
                ("page", "1"),
                ("page_size", "500"),
                ("name", name_filter.as_str()),
                ("use_regex", "true"),
                (
                    "columns",
                    "name,messages,messages_ready,messages_unacknowledged,messages_dlx,message_bytes,consumers",
                ),
            ])
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(page.items)
    }
}

/// `text` with every character a regular expression gives a meaning escaped.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if r"\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_matches_itself_only() {
        assert_eq!(regex_escape("delay-bridge"), "delay-bridge");
        assert_eq!(regex_escape("a.b:c"), r"a\.b:c");
    }

    #[test]
    fn figures_missing_from_the_answer_read_as_zero() {
        // A queue the broker has not published statistics for yet has its name only.
        let page: Page = serde_json::from_str(
            r#"{"items":[{"name":"p.level.1s"},{"name":"p.level.2s","messages":5,"messages_dlx":5}]}"#,
        )
        .expect("a page");
        assert_eq!(page.items[0].messages, 0);
        assert_eq!(page.items[1].messages_dlx, 5);
        assert_eq!(page.items[1].messages_ready, 0);
    }
}
