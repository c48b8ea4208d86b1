//! The command output shown in README.md and docs/*.md is what the commands print today.
//!
//! A block is a sample when the line before its opening fence is an HTML comment naming
//! it, `<!-- sample: NAME -->`. NAME is one of:
//!
//! - `plan ARGS`, `ladders ARGS`, `permissions`, `check-config`: `$ delay-bridge ARGS`, then
//!   what `delay-bridge ARGS` prints with the shipped `config/delay-bridge.toml` (no broker);
//! - `demo`: `$ delay-bridge demo`, then what it prints against the test broker;
//! - `readme.toml`: the configuration of that scenario, as shown;
//! - `readme metrics`, `readme status`: the `readme.toml` scenario of docs/operations.md, run
//!   against the test broker under a unique six-character prefix that the shown output
//!   names `readme` (a bridge, three messages scheduled and one unroutable, then its
//!   `/metrics` and `status`);
//! - `readme parked`: in the same scenario, two more messages to a key no queue is bound
//!   to, then `parked list`, `parked replay --dry-run`, a queue bound for the key, and
//!   `parked replay`.
//!
//! Before two blocks are compared, both are masked, so that what changes from run to run
//! does not count: times of day (`19:53:25.938`) become `<time>`, RFC 3339 date-times
//! `<date-time>`, UUIDs `<uuid>`, a signed lateness with the blanks before it (`     +2 ms`) ` <late>`, a loopback port
//! (`127.0.0.1:40123`) `127.0.0.1:<port>`, the demo's prefix (`delay-bridge-demo-1a2b3c4d`)
//! `delay-bridge-demo-<id>`, a parked message's age before its detail (`   5s  target
//! exchange`) `<age>`; trailing blanks and a final empty line are dropped. Nothing
//! else is masked: a count, a level, a duration or a column that changes fails the test.
//! A block whose last line is `...` shows the start of the output: it is compared with as
//! many lines (the demo's counters and metrics depend on where its messages fell in their
//! hop windows, so the README shows it up to its arrivals).
//!
//! `DELAY_BRIDGE_SAMPLES=update` (what `scripts/samples.sh --update` sets) writes what the
//! commands print now into the blocks instead of failing; `git diff` then shows what
//! changed. The broker is `DELAY_BRIDGE_TEST_URL` (default the local one), as for the
//! integration tests.

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use regex_automata::meta::Regex;

const BIN: &str = env!("CARGO_BIN_EXE_delay-bridge");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const MARKER: &str = "<!-- sample: ";

/// One sample block in a document.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Block {
    /// The document, relative to the repository.
    file: String,
    /// The sample's name, from its marker.
    name: String,
    /// The 1-based line of its marker.
    line: usize,
    /// The lines of the block, between its fences (indices into the document's lines).
    body: std::ops::Range<usize>,
}

/// The sample blocks of `text` (the document `file`).
fn blocks(file: &str, text: &str) -> Result<Vec<Block>, String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        if let Some(rest) = line.strip_prefix(MARKER) {
            let name = rest
                .strip_suffix("-->")
                .ok_or_else(|| format!("{file}:{}: a sample marker ends with -->", i + 1))?
                .trim()
                .to_string();
            let open = i + 1;
            if !lines.get(open).is_some_and(|l| l.starts_with("```")) {
                return Err(format!(
                    "{file}:{}: the sample `{name}` is not followed by a fenced block",
                    i + 1
                ));
            }
            let close = (open + 1..lines.len())
                .find(|&j| lines[j].trim_end() == "```")
                .ok_or_else(|| format!("{file}:{}: the sample `{name}` never ends", i + 1))?;
            found.push(Block {
                file: file.to_string(),
                name,
                line: i + 1,
                body: open + 1..close,
            });
            i = close;
        }
        i += 1;
    }
    Ok(found)
}

/// One rule of the mask: what matches `pattern` reads as `with`.
struct Mask {
    pattern: Regex,
    with: &'static str,
}

/// The mask, in the order the rules apply (the module's doc says why each).
fn masks() -> Vec<Mask> {
    [
        (
            r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})",
            "<date-time>",
        ),
        (r"\b\d{2}:\d{2}:\d{2}(\.\d+)?\b", "<time>"),
        (
            r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",
            "<uuid>",
        ),
        // With the blanks that right-align it: `+12 ms` is one column wider than `+2 ms`.
        (r" +[+-]\d+ ms\b", " <late>"),
        (r"127\.0\.0\.1:\d+", "127.0.0.1:<port>"),
        (r"delay-bridge-demo-[0-9a-f]{8}", "delay-bridge-demo-<id>"),
        (
            r" +\d+(ms|[smhd])  target exchange",
            " <age>  target exchange",
        ),
    ]
    .into_iter()
    .map(|(pattern, with)| Mask {
        pattern: Regex::new(pattern).expect("a valid pattern"),
        with,
    })
    .collect()
}

/// `text` with every rule of `masks` applied, trailing blanks and final empty lines
/// dropped.
fn masked(text: &str, masks: &[Mask]) -> String {
    let mut text = text.to_string();
    for mask in masks {
        let mut out = String::with_capacity(text.len());
        let mut last = 0;
        for found in mask.pattern.find_iter(&text) {
            out.push_str(&text[last..found.start()]);
            out.push_str(mask.with);
            last = found.end();
        }
        out.push_str(&text[last..]);
        text = out;
    }
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    let end = lines
        .iter()
        .rposition(|l| !l.is_empty())
        .map_or(0, |i| i + 1);
    lines[..end].join("\n")
}

/// The documents that may hold samples: the README and every page of docs/.
fn documents() -> Vec<String> {
    let mut files = vec!["README.md".to_string(), "CONTRIBUTING.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(Path::new(ROOT).join("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// `delay-bridge ARGS` in the repository, with no variable of this environment that would
/// change what it reads; its stdout, or why it failed.
fn delay_bridge(args: &[&str], url: Option<&str>) -> Result<String, String> {
    let mut command = Command::new(BIN);
    command.current_dir(ROOT).args(args);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("DELAY_BRIDGE_") {
            command.env_remove(&key);
        }
    }
    if let Some(url) = url {
        command.env("DELAY_BRIDGE_URL", url);
    }
    let out = command
        .env_remove("RUST_LOG")
        .output()
        .map_err(|e| format!("cannot run {BIN}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`delay-bridge {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8(out.stdout).map_err(|e| format!("not UTF-8: {e}"))
}

/// The broker the samples run against.
fn broker_url() -> String {
    std::env::var("DELAY_BRIDGE_TEST_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string())
}

/// What the block named `name` shows when the commands run now (`readme` runs the
/// scenario once for the samples that need it).
fn produce(
    name: &str,
    readme: &mut Option<BTreeMap<&'static str, String>>,
) -> Result<String, String> {
    let words: Vec<&str> = name.split_whitespace().collect();
    match words.as_slice() {
        ["plan" | "ladders" | "permissions" | "check-config", ..] => {
            let mut args = vec!["-c", "config/delay-bridge.toml"];
            args.extend(&words);
            Ok(format!(
                "$ delay-bridge {name}\n{}",
                delay_bridge(&args, None)?
            ))
        }
        ["demo"] => {
            let url = broker_url();
            let args = ["-c", "config/delay-bridge.toml", "demo"];
            Ok(format!(
                "$ delay-bridge demo\n{}",
                delay_bridge(&args, Some(&url))?
            ))
        }
        ["readme.toml"] => Ok(readme_toml("readme", 9090)),
        ["readme", what] => {
            if readme.is_none() {
                *readme = Some(readme_scenario()?);
            }
            readme
                .as_ref()
                .and_then(|shown| shown.get(what).cloned())
                .ok_or_else(|| format!("the readme scenario shows no `{what}`"))
        }
        _ => Err(format!("no sample is named `{name}`")),
    }
}

/// The `readme.toml` of docs/operations.md, for `prefix`, with the metrics on `port`. Hops
/// go alone (no hop window, so no bundles): a level then holds one message per hop, and
/// every figure is the same from run to run, whenever the messages were read.
fn readme_toml(prefix: &str, port: u16) -> String {
    format!(
        "[topology]\nprefix = \"{prefix}\"\n[delays]\nladder = \"1s 10s 1m 10m 1h\"\n\
         [bridge]\nhop_window = \"0s\"\n\
         [metrics]\nlisten = \"127.0.0.1:{port}\"\n[[route]]\ningress = \"{prefix}.delayed\"\n\
         target = \"amq.direct\"\n"
    )
}

/// The messages the scenario schedules, as docs/operations.md shows them.
const SCHEDULED: [&str; 4] = [
    "schedule -k orders.close -b \"order 1\" --delay 30m",
    "schedule -k orders.close -b \"order 2\" --delay 30m",
    "schedule -k reminders -b \"rate the ride\" --delay 2h",
    "schedule -k nobody.listens -b x --delay 1s    # parked: unroutable",
];

/// A bridge process that is stopped (SIGTERM) when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// GET `path` from the listener on `port`: the status code and the body.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// `/metrics` as the shown pipeline filters it: no comments, no histogram buckets, no
/// zeros, no empty lines, sorted (the exporter's order changes from one reading to the
/// next).
fn shown_metrics(body: &str) -> String {
    let mut lines: Vec<&str> = body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains("_bucket{") && !l.ends_with(" 0"))
        .filter(|l| !l.is_empty())
        .collect();
    lines.sort_unstable();
    lines.iter().map(|l| format!("{l}\n")).collect()
}

/// Runs the `readme.toml` scenario under a unique prefix: a bridge, the four messages, then
/// what `/metrics`, `/readyz` and `status` show once the bridge has read its queue depths
/// twice with nothing changing; deletes everything it declared.
fn readme_scenario() -> Result<BTreeMap<&'static str, String>, String> {
    // Six characters, as `readme`, so that the columns line up when it is named so.
    let prefix = format!("s{:05x}", std::process::id() & 0xf_ffff);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let dir = std::env::temp_dir().join(format!("samples-{prefix}"));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let config = dir.join("readme.toml");
    std::fs::write(&config, readme_toml(&prefix, port)).map_err(|e| e.to_string())?;
    let url = broker_url();
    let shown = run_readme(&config, &url, port);
    let cleaned = delete_topology(&config, &url);
    let _ = std::fs::remove_dir_all(&dir);
    let shown = shown?;
    cleaned?;
    Ok(shown
        .into_iter()
        .map(|(what, text)| (what, text.replace(&prefix, "readme")))
        .collect())
}

fn run_readme(
    config: &Path,
    url: &str,
    port: u16,
) -> Result<BTreeMap<&'static str, String>, String> {
    let config_arg = config
        .to_str()
        .ok_or("a temporary path that is not UTF-8")?;
    let mut command = Command::new(BIN);
    command
        .args(["-c", config_arg, "run"])
        .env("DELAY_BRIDGE_URL", url)
        .env_remove("RUST_LOG")
        .env_remove("DELAY_BRIDGE_PREFIX")
        .env_remove("DELAY_BRIDGE_METRICS_LISTEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let bridge = Running(
        command
            .spawn()
            .map_err(|e| format!("cannot run the bridge: {e}"))?,
    );
    wait_for("the bridge to be ready", Duration::from_secs(30), || {
        get(port, "/readyz").is_some_and(|(code, _)| code == 200)
    })?;
    for line in SCHEDULED {
        let words = shell_words(line.split('#').next().unwrap_or_default());
        let mut args = vec!["-c", config_arg];
        args.extend(words.iter().map(String::as_str));
        delay_bridge(&args, Some(url))?;
    }
    // The queue depths are read every `metrics.interval` (5 s): wait until two readings a
    // depth interval apart agree and show the unroutable message parked.
    let mut last = String::new();
    let mut metrics = String::new();
    wait_for(
        "the bridge's figures to settle",
        Duration::from_secs(40),
        || {
            let now =
                get(port, "/metrics").map_or_else(String::new, |(_, body)| shown_metrics(&body));
            let settled = now == last && now.contains("delay_bridge_parked_messages 1");
            last = now.clone();
            metrics = now;
            if !settled {
                std::thread::sleep(Duration::from_secs(5));
            }
            settled
        },
    )?;
    let ready = get(port, "/readyz").map_or_else(String::new, |(_, body)| body);
    let status = delay_bridge(&["-c", config_arg, "status"], Some(url))?;
    let parked = run_parked(config_arg, url);
    drop(bridge);
    let parked = parked?;
    let mut shown = String::from("$ delay-bridge -c readme.toml run 2>bridge.log &\n");
    for line in SCHEDULED {
        shown.push_str(&format!("$ delay-bridge -c readme.toml {line}\n"));
    }
    shown.push_str(
        "$ curl -s 127.0.0.1:9090/metrics | grep -v '^#' | grep -v '_bucket{' | grep -v ' 0$' | grep . | sort\n",
    );
    shown.push_str(&metrics);
    shown.push_str("$ curl -s 127.0.0.1:9090/readyz\n");
    shown.push_str(&ready);
    if !ready.ends_with('\n') {
        shown.push('\n');
    }
    Ok(BTreeMap::from([
        ("parked", parked),
        ("metrics", shown),
        (
            "status",
            format!("$ delay-bridge -c readme.toml status\n{status}"),
        ),
    ]))
}

/// The messages the parked part of the scenario schedules.
const PARKED: [&str; 2] = [
    "schedule --message-id invoice-7 -k nobody.listens -b \"invoice 7\" --delay 1s",
    "schedule --message-id invoice-8 -k nobody.listens -b \"invoice 8\" --delay 1s",
];

/// The parked part of the scenario, on its running bridge (`config`): two more messages
/// parked `unroutable`, listed, replayed without a queue (a dry run), then replayed once a
/// queue is bound for their key; what docs/operations.md shows. The queue is deleted after.
fn run_parked(config: &str, url: &str) -> Result<String, String> {
    let prefix = delay_bridge::config::Config::load(Path::new(config))
        .map_err(|e| format!("the config: {e}"))?
        .names
        .prefix()
        .to_string();
    let invoices = format!("{prefix}.invoices");
    for line in PARKED {
        let mut args = vec!["-c", config];
        let words = shell_words(line);
        args.extend(words.iter().map(String::as_str));
        delay_bridge(&args, Some(url))?;
    }
    let parked = |args: &[&str]| {
        let mut all = vec!["-c", config, "parked"];
        all.extend(args);
        delay_bridge(&all, Some(url))
    };
    wait_for("the invoices to be parked", Duration::from_secs(30), || {
        parked(&["list"]).is_ok_and(|list| list.contains("invoice-7") && list.contains("invoice-8"))
    })?;
    let mut shown = String::new();
    for args in [&["list"][..], &["replay", "--dry-run"]] {
        shown.push_str(&format!(
            "$ delay-bridge -c readme.toml parked {}\n",
            args.join(" ")
        ));
        shown.push_str(&parked(args)?);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let replayed = (|| {
        amqp(&runtime, url, |channel| {
            let invoices = invoices.clone();
            Box::pin(async move {
                declare(&channel, &invoices, false).await?;
                channel
                    .queue_bind(
                        invoices.as_str().into(),
                        "amq.direct".into(),
                        "nobody.listens".into(),
                        lapin::options::QueueBindOptions::default(),
                        lapin::types::FieldTable::default(),
                    )
                    .await
            })
        })?;
        shown.push_str("$ delay-bridge -c readme.toml parked replay\n");
        shown.push_str(&parked(&["replay"])?);
        wait_for(
            "the replayed invoices to arrive",
            Duration::from_secs(30),
            || {
                amqp(&runtime, url, |channel| {
                    let invoices = invoices.clone();
                    Box::pin(async move {
                        declare(&channel, &invoices, true)
                            .await
                            .map(|count| count == 3)
                    })
                })
                .unwrap_or(false)
            },
        )
    })();
    let deleted = amqp(&runtime, url, |channel| {
        let invoices = invoices.clone();
        Box::pin(async move {
            channel
                .queue_delete(
                    invoices.as_str().into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await
                .map(|_| ())
        })
    });
    replayed?;
    deleted?;
    Ok(shown.replace(&invoices, "readme.invoices"))
}

/// Declares `queue` (only checks that it exists when `passive`): its message count.
async fn declare(channel: &lapin::Channel, queue: &str, passive: bool) -> lapin::Result<u32> {
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .map(|declared| declared.message_count())
}

/// Runs `act` on a channel of a connection of its own to `url`, on `runtime`.
fn amqp<T>(
    runtime: &tokio::runtime::Runtime,
    url: &str,
    act: impl FnOnce(
        lapin::Channel,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = lapin::Result<T>>>>,
) -> Result<T, String> {
    runtime.block_on(async {
        let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .map_err(|e| e.to_string())?;
        let channel = conn.create_channel().await.map_err(|e| e.to_string())?;
        let done = act(channel).await.map_err(|e| e.to_string());
        let _ = conn.close(200, "done".into()).await;
        done
    })
}

/// Deletes every queue and exchange the configuration's bridge declares.
fn delete_topology(config: &Path, url: &str) -> Result<(), String> {
    let mut raw = delay_bridge::config::Config::load(config)
        .map_err(|e| format!("the config: {e}"))?
        .to_raw();
    raw.broker.url = Some(url.to_string());
    raw.broker.urls = None;
    let loaded = raw.validate().map_err(|e| format!("the config: {e}"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let conn = delay_bridge::amqp::connect(loaded.url(), "samples cleanup")
            .await
            .map_err(|e| e.to_string())?;
        let deleted = delay_bridge::topology::Topology::from_config(&loaded)
            .delete(&conn)
            .await
            .map_err(|e| format!("deleting the scenario's topology: {e}"));
        let _ = conn.close(200, "done".into()).await;
        deleted
    })
}

/// The words of `line`, with double quotes grouping.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut any = false;
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    words.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(word);
    }
    words
}

/// Polls `done` until it holds, for at most `within`.
fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if done() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(format!("waited {within:?} for {what}"))
}

/// Every sample block compared with what its commands print now; with
/// `DELAY_BRIDGE_SAMPLES=update`, rewritten instead.
#[test]
fn every_sample_in_the_docs_is_what_its_command_prints_today() {
    let update = std::env::var("DELAY_BRIDGE_SAMPLES").is_ok_and(|v| v == "update");
    let masks = masks();
    let mut readme = None;
    let mut produced: BTreeMap<String, Result<String, String>> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    for file in documents() {
        let path: PathBuf = Path::new(ROOT).join(&file);
        let text = std::fs::read_to_string(&path).expect("a readable document");
        let found = blocks(&file, &text).unwrap_or_else(|e| panic!("{e}"));
        if found.is_empty() {
            continue;
        }
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        // From the last block up, so that a rewritten block moves none before it.
        for block in found.iter().rev() {
            let now = produced
                .entry(block.name.clone())
                .or_insert_with(|| produce(&block.name, &mut readme))
                .clone();
            let now = match now {
                Ok(now) => now,
                Err(e) => {
                    failures.push(format!(
                        "{}:{} `{}`: {e}",
                        block.file, block.line, block.name
                    ));
                    continue;
                }
            };
            checked += 1;
            let shown = lines[block.body.clone()].join("\n");
            // A block whose last line is `...` shows the start of the output: as many lines.
            let start = lines[block.body.clone()]
                .last()
                .is_some_and(|l| l.trim() == "...")
                .then(|| block.body.len() - 1);
            let now = match start {
                Some(n) => {
                    let mut head: Vec<&str> = now.lines().take(n).collect();
                    head.push("...");
                    head.join("\n")
                }
                None => now,
            };
            let (shown_masked, now_masked) = (masked(&shown, &masks), masked(&now, &masks));
            if shown_masked == now_masked {
                continue;
            }
            if update {
                let new: Vec<String> = now.trim_end().lines().map(str::to_string).collect();
                lines.splice(block.body.clone(), new);
            } else {
                failures.push(format!(
                    "{}:{} `{}` shows what the command no longer prints (masked; - shown, + now):\n{}",
                    block.file,
                    block.line,
                    block.name,
                    line_diff(&shown_masked, &now_masked)
                ));
            }
        }
        if update {
            let mut new = lines.join("\n");
            new.push('\n');
            if new != text {
                std::fs::write(&path, new).expect("a writable document");
                eprintln!("updated the samples of {file}");
            }
        }
    }
    assert!(checked > 0 || !failures.is_empty(), "no sample block found");
    assert!(
        failures.is_empty(),
        "{} of the samples differ (scripts/samples.sh --update rewrites them):\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// The lines of `a` and `b` side by side: equal ones once, differing ones as `-` and `+`.
fn line_diff(a: &str, b: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let mut out = String::new();
    for i in 0..a.len().max(b.len()) {
        match (a.get(i), b.get(i)) {
            (Some(x), Some(y)) if x == y => out.push_str(&format!("  {x}\n")),
            (x, y) => {
                if let Some(x) = x {
                    out.push_str(&format!("- {x}\n"));
                }
                if let Some(y) = y {
                    out.push_str(&format!("+ {y}\n"));
                }
            }
        }
    }
    out
}

#[test]
fn the_mask_hides_times_ids_lateness_and_ports_and_nothing_else() {
    let masks = masks();
    assert_eq!(
        masked(
            "   1000 ms  19:53:25.938  19:53:25.940     +2 ms             0  \n\n",
            &masks
        ),
        "   1000 ms  <time>  <time> <late>             0"
    );
    assert_eq!(
        masked(
            "   1000 ms  19:53:25.938  19:53:25.952    +14 ms             0",
            &masks
        ),
        "   1000 ms  <time>  <time> <late>             0",
        "a lateness of two digits is masked as one of one"
    );
    assert_eq!(
        masked(
            "due 2026-12-24T08:00:00Z id 3f1e2d4c-0a1b-4c2d-8e3f-0123456789ab on 127.0.0.1:40123",
            &masks
        ),
        "due <date-time> id <uuid> on 127.0.0.1:<port>"
    );
    assert_eq!(
        masked("deleted delay-bridge-demo-0a1b2c3d", &masks),
        "deleted delay-bridge-demo-<id>"
    );
    assert_eq!(
        masked(
            "invoice-7     0ms  target exchange `t`\ninvoice-8    11s  target exchange `t`",
            &masks
        ),
        "invoice-7 <age>  target exchange `t`\ninvoice-8 <age>  target exchange `t`"
    );
    let kept = "plan for 5h: hop into level 4h due in 1h, 3 of 5 levels, 250ms, 1s500ms";
    assert_eq!(masked(kept, &masks), kept);
}

#[test]
fn a_sample_is_the_fenced_block_right_after_its_marker() {
    let text = "intro\n<!-- sample: plan 5h -->\n```\n$ delay-bridge plan 5h\nout\n```\nafter\n";
    let found = blocks("x.md", text).unwrap();
    assert_eq!(
        found,
        vec![Block {
            file: "x.md".into(),
            name: "plan 5h".into(),
            line: 2,
            body: 3..5,
        }]
    );
    assert!(blocks("x.md", "<!-- sample: plan 5h -->\ntext\n").is_err());
    assert!(blocks("x.md", "<!-- sample: plan 5h -->\n```\nnever closed\n").is_err());
    assert_eq!(
        shell_words("schedule -k a -b \"order 1\" --delay 30m"),
        ["schedule", "-k", "a", "-b", "order 1", "--delay", "30m"]
    );
}
