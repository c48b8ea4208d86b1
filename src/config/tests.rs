//! The configuration's tests: parsing, validation, printing, overrides, secrets.

use super::*;

const MINIMAL: &str = "[[route]]\ningress = \"orders.delayed\"\ntarget = \"orders\"\n";

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml(text, "<test>", &[])
}

#[test]
fn the_printed_configuration_reads_back_as_the_same() {
    let text = format!(
        "[broker]\nurl = \"amqp://user@broker:5672/%2f\"\n\
         [topology]\nprefix = \"p\"\nqueue_type = \"quorum\"\n\
         [delays]\nladder = \"1s 5s 1m30s\"\nmargin = \"120ms\"\nmax_delay = \"30d\"\n\
         [bridge]\nprefetch = 100\nworker_threads = 2\nshutdown_timeout = \"3s\"\n\
         confirm_timeout = \"7s 500us\"\ntarget_full_timeout = \"90s\"\n\
         redelivery_limit = 7\nmax_unacked_bytes = 1048576\nhop_window = \"20ms\"\n\
         bundle_hops = true\n\
         [cancel]\ngrace = \"2h\"\n{MINIMAL}\
         [[route]]\ningress = \"b.in\"\ntarget = \"b\"\n"
    );
    let config = parse(&text).unwrap();
    let printed = config.to_string();
    assert_eq!(parse(&printed).unwrap(), config, "{printed}");
    // Durations print in the units the file is written in.
    for line in [
        "max_delay = \"30d\"",
        "grace = \"2h\"",
        "margin = \"120ms\"",
    ] {
        assert!(printed.contains(line), "{line} not in {printed}");
    }
    // The default URL's password is printed as *** and read back as that: all else
    // round-trips.
    let defaults = parse(MINIMAL).unwrap();
    let mut back = parse(&defaults.to_string()).unwrap();
    assert_ne!(back.url(), defaults.url());
    back.urls = defaults.urls.clone();
    assert_eq!(back, defaults);
}

#[test]
fn several_brokers_are_tried_in_order_and_printed_redacted() {
    let config = parse(&format!(
        "[broker]\nurls = [\"amqp://u:pw1@node1:5672/%2f\", \"amqp://u:pw2@node2:5672/%2f\"]\n{MINIMAL}"
    ))
    .unwrap();
    assert_eq!(config.urls.len(), 2);
    let printed = config.to_string();
    assert!(
        printed.contains("u:***@node1") && printed.contains("u:***@node2"),
        "{printed}"
    );
    assert!(
        !printed.contains("pw1") && !printed.contains("pw2"),
        "{printed}"
    );
    let both = parse(&format!(
        "[broker]\nurl = \"amqp://a/%2f\"\nurls = [\"amqp://b/%2f\"]\n{MINIMAL}"
    ));
    assert!(matches!(both, Err(ConfigError::Invalid { key, .. }) if key == "broker"));
    let none = parse(&format!("[broker]\nurls = []\n{MINIMAL}"));
    assert!(matches!(none, Err(ConfigError::Invalid { key, .. }) if key == "broker.urls"));
    let one = parse(MINIMAL).unwrap();
    assert_eq!(one.urls.len(), 1);
}

#[test]
fn the_printed_configuration_never_shows_the_password() {
    let config = parse(&format!(
        "[broker]\nurl = \"amqp://user:s3cret@broker/%2f\"\n{MINIMAL}"
    ))
    .unwrap();
    let printed = config.to_string();
    assert!(!printed.contains("s3cret"), "{printed}");
    assert!(printed.contains("user:***@broker"), "{printed}");
}

#[test]
fn defaults_fill_a_minimal_file() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.url().expose(), DEFAULT_URL);
    assert_eq!(c.names.prefix(), "delay-bridge");
    assert_eq!(c.queue_type, QueueType::Classic);
    // Bundled hops in 100-ms windows, with the window's fine levels below 1 s.
    assert_eq!(c.hop_window, Duration::from_millis(100));
    assert!(c.bundle_hops);
    assert_eq!(
        c.ladder,
        Ladder::default_ladder().with_fine_levels(Duration::from_millis(100))
    );
    assert_eq!(c.ladder.smallest(), Duration::from_millis(100));
    assert_eq!(c.margin, Duration::from_millis(250));
    assert_eq!(c.max_delay, Duration::from_secs(366 * 86_400));
    assert_eq!(c.prefetch, 4000);
    assert_eq!(c.worker_threads, 2);
    assert_eq!(c.cancel_grace, Duration::from_secs(86_400));
    assert_eq!(c.routes, vec![Route::new("orders.delayed", "orders")]);
}

#[test]
fn a_hop_window_of_zero_turns_bundles_off_unless_they_are_asked_for() {
    let c = parse(&format!("{MINIMAL}\n[bridge]\nhop_window = \"0s\"\n")).unwrap();
    assert!(!c.bundle_hops);
    assert_eq!(
        c.ladder,
        Ladder::default_ladder(),
        "no fine levels without bundles"
    );
    let c = parse(&format!("{MINIMAL}\n[bridge]\nbundle_hops = false\n")).unwrap();
    assert!(!c.bundle_hops);
    assert_eq!(c.ladder, Ladder::default_ladder());
    assert_eq!(
        c.to_raw().validate().unwrap().ladder,
        c.ladder,
        "round trip"
    );
    let bundled = parse(MINIMAL).unwrap();
    assert_eq!(
        bundled.to_raw().validate().unwrap().ladder,
        bundled.ladder,
        "round trip with fine levels"
    );
}

#[test]
fn the_shipped_file_parses_and_documents_every_key() {
    let text = include_str!("../../config/delay-bridge.toml");
    let c = parse(text).unwrap();
    assert!(!c.routes.is_empty());
    // Every key the raw structs know appears in the documented file (uncommented).
    for key in [
        "[broker]",
        "url =",
        "[topology]",
        "prefix =",
        "queue_type =",
        "[delays]",
        "ladder =",
        "margin =",
        "max_delay =",
        "[bridge]",
        "prefetch =",
        "worker_threads =",
        "shutdown_timeout =",
        "[cancel]",
        "grace =",
        "[[route]]",
        "ingress =",
        "target =",
    ] {
        assert!(
            text.lines().any(|l| l.trim_start().starts_with(key)),
            "config/delay-bridge.toml does not document `{key}`"
        );
    }
}

#[test]
fn the_state_key_comes_from_its_file_or_the_environment_and_is_never_printed() {
    let dir = std::env::temp_dir();
    let file = dir.join(format!("state-key-{:08x}", rand::random::<u32>()));
    std::fs::write(&file, "0123456789abcdef0123456789abcdef\n").unwrap();
    let text = format!(
        "[bridge]\nstate_key_file = \"{}\"\naccept_unsigned_state = true\n{MINIMAL}",
        file.display()
    );
    let c = parse(&text).unwrap();
    let from_file = c.state_keys.clone().expect("a key");
    assert!(c.accept_unsigned_state);
    let printed = c.to_string();
    assert!(!printed.contains("0123456789abcdef"), "{printed}");
    let reread = parse(&printed).unwrap();
    assert_eq!(
        (reread.state_keys, reread.accept_unsigned_state),
        (c.state_keys.clone(), true),
        "{printed}"
    );
    // The variable wins over the file; the trailing newline of the file is not key.
    let from_env = Config::from_toml(
        &text,
        "<test>",
        &[(ENV_STATE_KEY, "0123456789abcdef0123456789abcdef".into())],
    )
    .unwrap();
    assert_eq!(from_env.state_keys, Some(from_file));
    let short = Config::from_toml(MINIMAL, "<test>", &[(ENV_STATE_KEY, "short".into())]);
    assert!(
        matches!(&short, Err(ConfigError::Invalid { key, value, .. })
            if key == "bridge.state_key_file" && value == "<redacted>"),
        "{short:?}"
    );
    let missing = parse("[bridge]\nstate_key_file = \"/nonexistent/key\"\n");
    assert!(
        matches!(missing, Err(ConfigError::Invalid { .. })),
        "{missing:?}"
    );
    let only_previous = Config::from_toml(
        MINIMAL,
        "<test>",
        &[(
            ENV_STATE_KEY_PREVIOUS,
            "0123456789abcdef0123456789abcdef".into(),
        )],
    );
    assert!(only_previous.is_err());
    assert_eq!(parse(MINIMAL).unwrap().state_keys, None, "off by default");
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn environment_overrides_win() {
    let c = Config::from_toml(
        MINIMAL,
        "<test>",
        &[
            (ENV_URL, "amqp://u:secret@h:5673/v".to_string()),
            (ENV_PREFIX, "other".to_string()),
        ],
    )
    .unwrap();
    assert_eq!(c.url().expose(), "amqp://u:secret@h:5673/v");
    assert_eq!(c.names.prefix(), "other");
    assert_eq!(c.url().user(), "u");
    let listening = Config::from_toml(
        MINIMAL,
        "<test>",
        &[(ENV_METRICS_LISTEN, "0.0.0.0:9090".to_string())],
    )
    .unwrap();
    assert_eq!(
        listening.metrics.map(|m| m.listen),
        Some("0.0.0.0:9090".parse().unwrap())
    );
    let bad = Config::from_toml(MINIMAL, "<test>", &[(ENV_METRICS_LISTEN, "9090".into())]);
    assert!(matches!(bad, Err(ConfigError::Invalid { key, .. }) if key == ENV_METRICS_LISTEN));
}

#[test]
fn the_url_variable_may_name_several_brokers() {
    let c = Config::from_toml(
        MINIMAL,
        "<test>",
        &[(
            ENV_URL,
            " amqp://u:p@n1:5672/%2f  amqp://u:p@n2:5672/%2f\n".to_string(),
        )],
    )
    .unwrap();
    let urls: Vec<&str> = c.urls.iter().map(BrokerUrl::expose).collect();
    assert_eq!(urls, ["amqp://u:p@n1:5672/%2f", "amqp://u:p@n2:5672/%2f"]);
    let empty = Config::from_toml(MINIMAL, "<test>", &[(ENV_URL, " ".to_string())]);
    assert!(matches!(empty, Err(ConfigError::Invalid { key, .. }) if key == "broker.urls"));
}

#[test]
fn unknown_keys_are_refused_by_name() {
    let err = parse(&format!("{MINIMAL}[bridge]\nprefetsh = 10\n")).unwrap_err();
    assert!(err.to_string().contains("prefetsh"), "{err}");
    let err = parse(&format!("colour = 1\n{MINIMAL}")).unwrap_err();
    assert!(err.to_string().contains("colour"), "{err}");
}

#[test]
fn bad_values_name_key_and_value() {
    let cases = [
        ("[delays]\nmax_delay = \"1ms\"\n", "delays.max_delay", "1ms"),
        (
            "[topology]\nqueue_type = \"lazy\"\n",
            "topology.queue_type",
            "lazy",
        ),
        (
            "[topology]\nprefix = \"has space\"\n",
            "topology.prefix",
            "has space",
        ),
        ("[bridge]\nprefetch = 0\n", "bridge.prefetch", "0"),
        ("[bridge]\nprefetch = 70000\n", "bridge.prefetch", "70000"),
        (
            "[bridge]\nworker_threads = 0\n",
            "bridge.worker_threads",
            "0",
        ),
        (
            "[bridge]\nworker_threads = 65\n",
            "bridge.worker_threads",
            "65",
        ),
        ("[broker]\nurl = \"http://x\"\n", "broker.url", "http://x"),
        ("[delays]\nladder = \"1s 1s\"\n", "delays.ladder", "1s"),
        (
            "[bridge]\nredelivery_limit = 50\n",
            "bridge.redelivery_limit",
            "50",
        ),
        (
            "[bridge]\nmax_unacked_bytes = 0\n",
            "bridge.max_unacked_bytes",
            "0",
        ),
        ("[bridge]\nhop_window = \"2s\"\n", "bridge.hop_window", "2s"),
        (
            "[bridge]\nbundle_hops = true\nhop_window = \"0s\"\n",
            "bridge.bundle_hops",
            "true",
        ),
    ];
    for (extra, key, value) in cases {
        let err = parse(&format!("{extra}{MINIMAL}")).unwrap_err().to_string();
        assert!(
            err.contains(key) && err.contains(value),
            "{extra:?} gave {err}"
        );
    }
    // A duration that does not parse is refused by the reader, which shows the line.
    for (extra, line) in [
        ("[delays]\nmargin = \"soon\"\n", "margin = \"soon\""),
        ("[cancel]\ngrace = \"a while\"\n", "grace = \"a while\""),
        ("[bridge]\nconfirm_timeout = 30\n", "confirm_timeout = 30"),
    ] {
        let err = parse(&format!("{extra}{MINIMAL}")).unwrap_err().to_string();
        assert!(
            err.contains("line 2") && err.contains(line) && err.contains("duration"),
            "{extra:?} gave {err}"
        );
    }
    let err = parse("[[route]]\ningress = \"a\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("route[0].target"), "{err}");
    let err = parse("").unwrap_err().to_string();
    assert!(err.contains("[[route]]"), "{err}");
}

#[test]
fn a_route_takes_a_fanout_or_a_headers_ingress_and_nothing_else() {
    assert_eq!(
        parse(MINIMAL).unwrap().routes[0].ingress_kind,
        IngressKind::Fanout
    );
    let headers = parse(&format!("{MINIMAL}ingress_type = \"headers\"\n")).unwrap();
    assert_eq!(headers.routes[0].ingress_kind, IngressKind::Headers);
    assert_eq!(
        headers.to_raw().validate().unwrap().routes,
        headers.routes,
        "written back as read"
    );
    let err = parse(&format!("{MINIMAL}ingress_type = \"topic\"\n"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("route[0].ingress_type") && err.contains("`fanout` or `headers`"),
        "{err}"
    );
}

#[test]
fn passwords_are_redacted_when_printed() {
    let c = Config::from_toml(
        MINIMAL,
        "<test>",
        &[(
            ENV_URL,
            "amqps://admin:hunter2@rabbit:5671/prod".to_string(),
        )],
    )
    .unwrap();
    for shown in [c.to_string(), format!("{c:?}"), c.url().to_string()] {
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("admin:***@rabbit"), "{shown}");
    }
    let err = parse(&format!("[broker]\nurl = \"ftp://a:hunter2@b\"\n{MINIMAL}"))
        .unwrap_err()
        .to_string();
    assert!(!err.contains("hunter2"), "{err}");
    assert_eq!(redact_url("amqp://a:b c@host"), "amqp://a:***@host");
}

#[test]
fn the_metrics_listener_is_off_unless_an_address_is_set() {
    assert_eq!(parse(MINIMAL).unwrap().metrics, None);
    let config = parse(&format!("[metrics]\nlisten = \"0.0.0.0:9090\"\n{MINIMAL}")).unwrap();
    let metrics = config.metrics.expect("metrics set");
    assert_eq!(metrics.listen, "0.0.0.0:9090".parse().unwrap());
    assert_eq!(metrics.interval, defaults::METRICS_INTERVAL);
    let printed = config.to_string();
    assert!(printed.contains("listen = \"0.0.0.0:9090\""), "{printed}");
    assert!(printed.contains("interval = \"5s\""), "{printed}");
    let refused = |extra: &str| {
        parse(&format!("{extra}\n{MINIMAL}"))
            .unwrap_err()
            .to_string()
    };
    assert!(refused("[metrics]\ninterval = \"5s\"").contains("needs the listener's address"));
    assert!(refused("[metrics]\nlisten = \"localhost\"").contains("listen"));
    assert!(
        refused("[metrics]\nlisten = \"127.0.0.1:9090\"\ninterval = \"1ms\"")
            .contains("at least 100ms")
    );
}

#[test]
fn the_management_section_is_off_unless_a_url_is_set_and_keeps_its_password() {
    assert_eq!(parse(MINIMAL).unwrap().management, None);
    let config = parse(&format!(
        "[management]\nurl = \"http://watcher:s3cret@127.0.0.1:15672\"\nstuck_after = \"30s\"\n{MINIMAL}"
    ))
    .unwrap();
    let management = config.management.clone().expect("management set");
    assert_eq!(management.interval, defaults::MANAGEMENT_INTERVAL);
    assert_eq!(management.stuck_after, Duration::from_secs(30));
    assert_eq!(
        management.urls[0].credentials(),
        Some(("watcher".to_string(), "s3cret".to_string()))
    );
    let printed = config.to_string();
    assert!(!printed.contains("s3cret"), "{printed}");
    assert!(printed.contains("stuck_after = \"30s\""), "{printed}");

    let refused = |text: &str| {
        parse(&format!("{text}\n{MINIMAL}"))
            .unwrap_err()
            .to_string()
    };
    assert!(refused("[management]\nstuck_after = \"5s\"").contains("need the management API"));
    assert!(refused("[management]\nurl = \"amqp://h:15672\"").contains("http://"));
    assert!(
        refused("[management]\nurl = \"http://h\"\ninterval = \"10ms\"").contains("at least 100ms")
    );
}

#[test]
fn an_amqp_url_gives_the_management_api_its_credentials_and_virtual_host() {
    let url = BrokerUrl::parse("amqp://bob:p%40ss@h:5672/orders%2Fprod").unwrap();
    assert_eq!(
        url.credentials_and_vhost(),
        ("bob".into(), "p@ss".into(), "orders/prod".into())
    );
    let url = BrokerUrl::parse("amqp://h").unwrap();
    assert_eq!(
        url.credentials_and_vhost(),
        ("guest".into(), "guest".into(), "/".into())
    );
    let url = BrokerUrl::parse("amqp://guest:guest@127.0.0.1:5672/%2f").unwrap();
    assert_eq!(url.credentials_and_vhost().2, "/");
}
