//! Broker and management URLs: parsed once, their passwords redacted whenever shown.

use std::fmt;

use super::*;

/// An AMQP URL whose `Display` and `Debug` redact the password, with the TLS files an
/// `amqps://` connection to it uses (`[tls]`).
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    text: String,
    tls: Option<TlsFiles>,
}

/// The files of `[tls]`: the CA that signed the broker's certificate and this client's own
/// certificate and key. Read at every connect, so renewed files apply at the next one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM CA certificates to trust (besides the system's), when set.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and its PEM (PKCS#8) key, for brokers that require one.
    pub client: Option<(PathBuf, PathBuf)>,
    /// The name the broker's certificate must carry, when it is not the URL's host (a
    /// load balancer's address, an IP).
    pub server_name: Option<String>,
}

impl BrokerUrl {
    /// This URL with `tls` for connecting.
    pub fn with_tls(mut self, tls: Option<TlsFiles>) -> Self {
        self.tls = tls;
        self
    }

    /// The TLS files to connect with, when `[tls]` is set.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// Checks the scheme and wraps the URL.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let parsed = url::Url::parse(text)
            .map_err(|e| invalid("broker.url", redact_url(text), format!("not a URL ({e})")))?;
        if !matches!(parsed.scheme(), "amqp" | "amqps") {
            return Err(invalid(
                "broker.url",
                redact_url(text),
                "the scheme must be amqp:// or amqps://",
            ));
        }
        Ok(Self {
            text: text.to_string(),
            tls: None,
        })
    }

    /// The full URL, password included: only for connecting.
    pub fn expose(&self) -> &str {
        &self.text
    }

    /// The user name in the URL (RabbitMQ's default, `guest`, when absent).
    pub fn user(&self) -> String {
        url::Url::parse(&self.text)
            .ok()
            .map(|u| u.username().to_string())
            .filter(|u| !u.is_empty())
            .map(|u| {
                url::form_urlencoded::parse(format!("u={u}").as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or(u)
            })
            .unwrap_or_else(|| "guest".to_string())
    }
}

impl BrokerUrl {
    /// User, password (RabbitMQ's defaults, `guest`, when absent) and virtual host (`/`
    /// when the URL names none), decoded.
    pub fn credentials_and_vhost(&self) -> (String, String, String) {
        let parsed = url::Url::parse(&self.text).ok();
        let decode = |text: &str| {
            url::form_urlencoded::parse(format!("v={}", text.replace('+', "%2B")).as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_else(|| text.to_string())
        };
        let password = parsed
            .as_ref()
            .and_then(|u| u.password().map(decode))
            .unwrap_or_else(|| "guest".to_string());
        let vhost = parsed
            .as_ref()
            .map(|u| u.path().trim_start_matches('/').to_string())
            .filter(|p| !p.is_empty())
            .map(|p| decode(&p))
            .unwrap_or_else(|| "/".to_string());
        (self.user(), password, vhost)
    }
}

/// The base URL of a node's management HTTP API (`http://host:15672`), whose `Display`
/// and `Debug` redact a password.
#[derive(Clone, PartialEq, Eq)]
pub struct ManagementUrl(url::Url);

impl ManagementUrl {
    /// Checks the scheme (`http` or `https`) and wraps the URL.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let parsed = url::Url::parse(text).map_err(|e| {
            invalid(
                "management.url",
                redact_url(text),
                format!("not a URL ({e})"),
            )
        })?;
        if parsed.scheme() != "http" {
            return Err(invalid(
                "management.url",
                redact_url(text),
                "the scheme must be http:// (the management API's own listener, for example http://127.0.0.1:15672)",
            ));
        }
        Ok(Self(parsed))
    }

    /// The URL without its credentials.
    pub fn base(&self) -> url::Url {
        let mut base = self.0.clone();
        let _ = base.set_username("");
        let _ = base.set_password(None);
        base
    }

    /// The user and password the URL carries, if it names a user.
    pub fn credentials(&self) -> Option<(String, String)> {
        let user = self.0.username();
        (!user.is_empty()).then(|| {
            (
                user.to_string(),
                self.0.password().unwrap_or_default().to_string(),
            )
        })
    }
}

impl fmt::Display for ManagementUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(self.0.as_str()))
    }
}

impl fmt::Debug for ManagementUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ManagementUrl({self})")
    }
}

impl fmt::Display for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.text))
    }
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BrokerUrl({})", redact_url(&self.text))
    }
}

/// Replaces the password of a URL with `***` (also in text that does not parse).
pub fn redact_url(text: &str) -> String {
    if let Ok(mut parsed) = url::Url::parse(text) {
        if parsed.password().is_some() && parsed.set_password(Some("***")).is_ok() {
            return parsed.to_string();
        }
        return text.to_string();
    }
    // Unparseable: blank anything between "://user:" and "@".
    match (text.find("://"), text.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &text[s + 3..at];
            match creds.find(':') {
                Some(colon) => format!("{}***{}", &text[..s + 3 + colon + 1], &text[at..]),
                None => text.to_string(),
            }
        }
        _ => text.to_string(),
    }
}
