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
//! none on RabbitMQ before 4.3; from 4.3 they need some permission on the resource (read
//! or write will do), so the operator holds write on the queues it only counts.
//!
//! The bridge's own names are granted by [`own_names`], for prefix `db`:
//! `db\.(cancel|level\.([0-9]+(ms|[dhms]))+|parked|returns|work)`, which takes the level
//! queues of any ladder and no name of a bridge whose prefix extends `db` (`db.eu.work`,
//! `db.level.work`). The operator reads only the parked queue and the cancel stream
//! (`^(db\.cancel|db\.parked)$`): never the work or returns queue or a level, where it could
//! take messages in flight from the bridge.

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

/// A level's duration as [`crate::ladder::format_duration`] prints it (`100ms`, `1m30s`,
/// `48d`): one or more numbers, each with its unit. It holds no `.` and starts with a
/// digit, so it is never `work`, `returns`, `parked`, `cancel` nor `level.<...>`.
pub const LEVEL_DURATION: &str = "([0-9]+(ms|[dhms]))+";

/// Every name the bridge with `prefix` declares, binds, consumes or publishes to, as one
/// expression without anchors: `<prefix>.work`, `.returns`, `.parked` and `.cancel` (each
/// both an exchange and a queue or stream) and the level queues `<prefix>.level.<duration>`
/// of any ladder. It matches no name of a bridge whose prefix extends this one
/// (`db.eu.work`, `db.level.work`, `db.work.x.cancel` for prefix `db`): such a name is
/// `<prefix>.<rest>.<suffix>`, so this would have to read `<rest>.<suffix>` as
/// `level.<duration>`, with `<suffix>` a duration; but a suffix is `work`, `returns`,
/// `parked`, `cancel` or `level.<duration>`. Nor does the expression of a prefix that
/// extends this one match this one's names (none begins `<prefix>.<rest>.`).
pub fn own_names(prefix: &str) -> String {
    format!(
        "{}\\.(cancel|level\\.{LEVEL_DURATION}|parked|returns|work)",
        escape(prefix)
    )
}

/// The four roles' permissions for `config`'s prefix and routes.
pub fn grants(config: &Config) -> Vec<Grant> {
    let names = &config.names;
    let own = own_names(names.prefix());
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
                      purge): reads the parked queue and the cancel stream only (never the \
                      work or returns queue or a level: messages in flight), writes the work \
                      and parked exchanges, and holds write on the other queues so that \
                      RabbitMQ 4.3 answers `status`'s passive declares",
            configure: NOTHING.into(),
            write: any_of(vec![format!(
                "{}\\.(level\\.{LEVEL_DURATION}|parked|returns|work)",
                escape(names.prefix())
            )]),
            read: any_of(vec![
                exact(names.parked_queue()),
                exact(names.cancel_stream()),
            ]),
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
    use crate::ladder::Ladder;
    use crate::naming::Names;

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
        let own = r"db\.(cancel|level\.([0-9]+(ms|[dhms]))+|parked|returns|work)";
        assert_eq!(bridge.configure, format!(r"^({own}|orders\.in)$"));
        assert_eq!(
            bridge.write,
            format!(r"^(amq\.default|{own}|orders|orders\.in)$")
        );
        assert_eq!(bridge.read, format!(r"^({own}|orders\.in)$"));
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
        assert_eq!(
            operator.write,
            r"^(db\.(level\.([0-9]+(ms|[dhms]))+|parked|returns|work))$"
        );
        assert_eq!(operator.read, r"^(db\.cancel|db\.parked)$");
    }

    #[test]
    fn names_are_escaped_and_routes_sharing_an_exchange_listed_once() {
        let grants = grants(&config("a-b", &[("x+in", "t"), ("y.in", "t")]));
        assert_eq!(
            role(&grants, "bridge").write,
            r"^(a-b\.(cancel|level\.([0-9]+(ms|[dhms]))+|parked|returns|work)|amq\.default|t|x\+in|y\.in)$"
        );
        assert_eq!(role(&grants, "publisher").write, r"^(x\+in|y\.in)$");
        assert_eq!(
            escape("a(b)[c]{d}^$|?*+-/\\"),
            r"a\(b\)\[c\]\{d\}\^\$\|\?\*\+-/\\"
        );
    }

    /// `pattern` compiled: it allows a name when RabbitMQ would grant it, which searches
    /// the pattern anywhere in the name (the recipe's patterns anchor themselves).
    fn compiled(pattern: &str) -> regex_automata::meta::Regex {
        regex_automata::meta::Regex::new(pattern)
            .unwrap_or_else(|e| panic!("`{pattern}` is no regular expression: {e}"))
    }

    /// Every name the bridge of `config` declares, binds, consumes or publishes to under its
    /// prefix (naming.rs), with the level queues of its own ladder and of every preset (the
    /// recipe must not change with the ladder).
    fn bridge_names(config: &Config) -> Vec<String> {
        let names = &config.names;
        let mut all = vec![
            names.work_exchange(),
            names.work_queue(),
            names.returns_queue(),
            names.parked_exchange(),
            names.parked_queue(),
            names.cancel_stream(),
            names.cancel_exchange(),
        ];
        let odd = Ladder::parse("1ms 999ms 1s1ms 1m30s 1h0m1s 1d1h1m1s1ms 49d").expect("levels");
        for ladder in [
            config.ladder.clone(),
            Ladder::default_ladder(),
            Ladder::binary(),
            Ladder::rocketmq(),
            odd,
        ] {
            all.extend(ladder.levels().iter().map(|l| names.level_queue(*l)));
        }
        all.sort();
        all.dedup();
        all
    }

    /// Each of a role's patterns, and which of the bridge's own names (`everything` under
    /// `names`' prefix) it must allow: it must refuse the others.
    fn expected(
        grant: &Grant,
        names: &Names,
        everything: &[String],
    ) -> Vec<(&'static str, String, Vec<String>)> {
        let everything = everything.to_vec();
        let (configure, write, read) = match grant.role {
            "bridge" => (everything.clone(), everything.clone(), everything),
            "publisher" => (vec![], vec![], vec![]),
            "canceller" => (vec![], vec![names.cancel_exchange()], vec![]),
            "operator" => (
                vec![],
                // Everything but the cancel exchange: a passive declare needs some right
                // on RabbitMQ 4.3, and write on a queue lets no one take its messages.
                everything
                    .iter()
                    .filter(|name| **name != names.cancel_exchange())
                    .cloned()
                    .collect(),
                vec![names.parked_queue(), names.cancel_stream()],
            ),
            other => panic!("a role the test does not know: {other}"),
        };
        vec![
            ("configure", grant.configure.clone(), configure),
            ("write", grant.write.clone(), write),
            ("read", grant.read.clone(), read),
        ]
    }

    #[test]
    fn the_default_ladder_has_the_fine_levels_the_names_are_checked_with() {
        let config = config("db", &[("orders.in", "orders")]);
        let names = bridge_names(&config);
        for fine in [
            "db.level.100ms",
            "db.level.200ms",
            "db.level.400ms",
            "db.level.800ms",
        ] {
            assert!(names.iter().any(|n| n == fine), "{fine} missing: {names:?}");
        }
        assert!(names.iter().any(|n| n == "db.level.48d"));
        // What the topology declares and binds under the prefix is among the names checked.
        let topology = crate::topology::Topology::from_config(&config);
        let declared = topology
            .exchanges
            .iter()
            .chain(topology.queues.iter().map(|q| &q.name))
            .chain([&topology.cancel_stream.name, &topology.cancel_exchange])
            .chain(topology.bindings.iter().flat_map(|(q, e)| [q, e]))
            .filter(|name| name.as_str() != "orders.in");
        for name in declared {
            assert!(names.contains(name), "{name} is declared but not checked");
        }
    }

    #[test]
    fn the_operator_reads_only_the_parked_queue_and_the_cancel_stream() {
        let config = config("db", &[("orders.in", "orders")]);
        let operator = role(&grants(&config), "operator").clone();
        let names = &config.names;
        for name in bridge_names(&config) {
            let may = name == names.parked_queue() || name == names.cancel_stream();
            assert_eq!(
                compiled(&operator.read).is_match(&name),
                may,
                "operator read `{}` on `{name}`",
                operator.read
            );
        }
    }

    #[test]
    fn each_pattern_allows_its_own_bridge_s_names_and_none_of_a_prefix_extending_it() {
        let pairs = [
            ("db", "db.eu"),
            ("db", "db.level"),
            ("db", "db.level.1s"),
            ("db", "db.level.100ms"),
            ("db", "db.work"),
            ("db", "db.work.x"),
            ("db", "db.returns"),
            ("db", "db.parked"),
            ("db", "db.cancel"),
            ("db", "db.1s"),
            ("db", "db-eu"),
            ("db", "db:eu"),
            ("db.eu", "db.eu.level"),
            ("delay-bridge", "delay-bridge.level"),
        ];
        for (outer, inner) in pairs {
            let outer = config(outer, &[("orders.in", "orders")]);
            let inner = config(inner, &[("eu.in", "eu")]);
            for (one, other) in [(&outer, &inner), (&inner, &outer)] {
                let ours = bridge_names(one);
                let theirs = bridge_names(other);
                for grant in grants(one) {
                    for (kind, pattern, allowed) in expected(&grant, &one.names, &ours) {
                        let regex = compiled(&pattern);
                        for name in &ours {
                            assert_eq!(
                                regex.is_match(name),
                                allowed.contains(name),
                                "{} {kind} `{pattern}` on its own `{name}`",
                                grant.role
                            );
                        }
                        for name in &theirs {
                            assert!(
                                !regex.is_match(name),
                                "{} {kind} `{pattern}` of prefix `{}` allows `{name}` of prefix `{}`",
                                grant.role,
                                one.names.prefix(),
                                other.names.prefix()
                            );
                        }
                    }
                }
            }
        }
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
