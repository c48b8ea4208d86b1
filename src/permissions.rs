//! Who may do what on the broker: the least-privilege permissions of each role around a
//! bridge (the bridge's own user, publishers, cancellers, operators), as the regular
//! expressions `rabbitmqctl set_permissions` takes, derived from the configuration. Pure:
//! `delay-bridge permissions` prints them, the manual explains them (docs/operations.md,
//! "Permissions") and the test suite grants exactly these to users of its own.
//!
//! RabbitMQ checks `configure` on declares and deletes, `write` on the exchange of a
//! publish (the default exchange is `amq.default`) and on the queue of a binding, `read` on
//! a queue consumed, fetched or purged and on the exchange of a binding. Passive declares
//! (which `status` and the typed client use to check that a queue or exchange exists) need
//! none.

use crate::config::Config;

/// One role's permissions on the configured virtual host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The role: `bridge`, `publisher`, `canceller` or `operator`.
    pub role: &'static str,
    /// What the role does, in a few words.
    pub purpose: &'static str,
    /// The `configure` pattern (declare, delete).
    pub configure: String,
    /// The `write` pattern (publish into an exchange, bind a queue).
    pub write: String,
    /// The `read` pattern (consume, fetch, purge, bind from an exchange).
    pub read: String,
}

impl Grant {
    /// The `rabbitmqctl set_permissions` command that grants this role to `user` on `vhost`.
    pub fn command(&self, vhost: &str, user: &str) -> String {
        format!(
            "rabbitmqctl set_permissions -p {} {} {} {} {}",
            shell_quote(vhost),
            shell_quote(user),
            shell_quote(&self.configure),
            shell_quote(&self.write),
            shell_quote(&self.read)
        )
    }
}

/// The pattern that matches nothing (RabbitMQ's way to grant no permission of a kind).
pub const NOTHING: &str = "^$";

/// The four roles' permissions for `config`'s prefix and routes.
pub fn grants(config: &Config) -> Vec<Grant> {
    let names = &config.names;
    let own = format!("{}\\..*", escape(names.prefix()));
    let exact = |name: String| escape(&name);
    let ingresses: Vec<String> = config.routes.iter().map(|r| escape(&r.ingress)).collect();
    let targets: Vec<String> = config.routes.iter().map(|r| escape(&r.target)).collect();
    let any_of = |alternatives: Vec<String>| {
        let mut alternatives = alternatives;
        alternatives.sort();
        alternatives.dedup();
        format!("^({})$", alternatives.join("|"))
    };
    let with = |first: &[String], rest: &[String]| {
        first.iter().chain(rest).cloned().collect::<Vec<String>>()
    };
    vec![
        Grant {
            role: "bridge",
            purpose: "the bridge's own user: declares its topology and the ingress \
                      exchanges, consumes its queues, hops through the default exchange, \
                      delivers to the targets, parks",
            configure: any_of(with(std::slice::from_ref(&own), &ingresses)),
            write: any_of(with(
                &[own.clone(), "amq\\.default".to_string()],
                &with(&ingresses, &targets),
            )),
            read: any_of(with(std::slice::from_ref(&own), &ingresses)),
        },
        Grant {
            role: "publisher",
            purpose: "schedules messages: publishes to the ingress exchanges only",
            configure: NOTHING.into(),
            write: any_of(ingresses.clone()),
            read: NOTHING.into(),
        },
        Grant {
            role: "canceller",
            purpose: "cancels messages: publishes tombstones to the cancel exchange only",
            configure: NOTHING.into(),
            write: any_of(vec![exact(names.cancel_exchange())]),
            read: NOTHING.into(),
        },
        Grant {
            role: "operator",
            purpose: "runs `status` and `parked` (list, replay into the work exchange, \
                      purge): reads the bridge's queues, writes the work and parked \
                      exchanges",
            configure: NOTHING.into(),
            write: any_of(vec![
                exact(names.work_exchange()),
                exact(names.parked_exchange()),
            ]),
            read: format!("^{own}$"),
        },
    ]
}

/// `name` as a regular expression that matches exactly it (RabbitMQ's patterns are PCRE).
pub fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for c in name.chars() {
        if "\\^$.|?*+()[]{}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `text` quoted for a POSIX shell (single quotes; a single quote inside closed and
/// escaped).
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RawConfig, RawRoute};

    fn config(prefix: &str, routes: &[(&str, &str)]) -> Config {
        let mut raw = RawConfig::default();
        raw.topology.prefix = Some(prefix.into());
        raw.routes = routes
            .iter()
            .map(|(ingress, target)| RawRoute {
                ingress: Some((*ingress).into()),
                target: Some((*target).into()),
                ..RawRoute::default()
            })
            .collect();
        raw.validate().expect("a valid config")
    }

    fn role<'a>(grants: &'a [Grant], role: &str) -> &'a Grant {
        grants.iter().find(|g| g.role == role).expect("the role")
    }

    #[test]
    fn each_role_gets_only_what_it_needs() {
        let grants = grants(&config("db", &[("orders.in", "orders")]));
        let bridge = role(&grants, "bridge");
        assert_eq!(bridge.configure, r"^(db\..*|orders\.in)$");
        assert_eq!(bridge.write, r"^(amq\.default|db\..*|orders|orders\.in)$");
        assert_eq!(bridge.read, r"^(db\..*|orders\.in)$");
        let publisher = role(&grants, "publisher");
        assert_eq!(
            (
                publisher.configure.as_str(),
                publisher.write.as_str(),
                publisher.read.as_str()
            ),
            (NOTHING, r"^(orders\.in)$", NOTHING)
        );
        assert_eq!(role(&grants, "canceller").write, r"^(db\.cancel)$");
        let operator = role(&grants, "operator");
        assert_eq!(operator.write, r"^(db\.parked|db\.work)$");
        assert_eq!(operator.read, r"^db\..*$");
    }

    #[test]
    fn names_are_escaped_and_routes_sharing_an_exchange_listed_once() {
        let grants = grants(&config("a-b", &[("x+in", "t"), ("y.in", "t")]));
        assert_eq!(
            role(&grants, "bridge").write,
            r"^(a-b\..*|amq\.default|t|x\+in|y\.in)$"
        );
        assert_eq!(role(&grants, "publisher").write, r"^(x\+in|y\.in)$");
        assert_eq!(
            escape("a(b)[c]{d}^$|?*+-/\\"),
            r"a\(b\)\[c\]\{d\}\^\$\|\?\*\+-/\\"
        );
    }

    #[test]
    fn the_command_quotes_for_the_shell() {
        let grant = Grant {
            role: "publisher",
            purpose: "",
            configure: NOTHING.into(),
            write: "^(it's)$".into(),
            read: NOTHING.into(),
        };
        assert_eq!(
            grant.command("/", "app"),
            r"rabbitmqctl set_permissions -p '/' 'app' '^$' '^(it'\''s)$' '^$'"
        );
    }
}
