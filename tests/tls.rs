//! `amqps://` with `[tls]`: a broker node the test starts with an AMQPS listener that
//! requires a client certificate, and certificates the test makes with `openssl`. The node
//! comes from `DELAY_BRIDGE_TEST_TLS_BROKER start-tls DIR` (default `scripts/cluster.sh`:
//! the installed 3.x package, port 5695; `scripts/test.sh` also runs it with
//! `scripts/debian-broker.sh trixie`, 4.0, port 5696, and `sid`, 4.3, port 5697) and listens on `DELAY_BRIDGE_TEST_TLS_PORT`. A message goes through the bridge over TLS;
//! a broker certificate from another CA, and a missing client certificate, fail to connect
//! with an error that says so.
//!
//! Its own test binary: it starts a broker node of its own, whatever broker the suite
//! targets.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use delay_bridge::amqp;
use delay_bridge::config::{BrokerUrl, Config, RawBroker, RawConfig, RawRoute, RawTls};
use delay_bridge::sandbox::{Sandbox, TargetBinding, watch_queue};
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::tcp::{AsyncTcpStream, OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable};

#[path = "support/raw.rs"]
#[allow(dead_code)]
mod raw;

/// Publishes `body` to `exchange` with `key` and an `x-delay` of 300 ms, and waits for the
/// broker's confirm.
async fn publish_delayed(publisher: &lapin::Channel, exchange: &str, key: &str, body: &[u8]) {
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(300));
    publisher
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default().with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// The TLS node's URL with `host`: `localhost` is the name its certificate carries.
fn url_at(host: &str) -> String {
    format!("amqps://guest:guest@{host}:{}/%2f", port())
}

/// The TLS node's port.
fn port() -> u16 {
    std::env::var("DELAY_BRIDGE_TEST_TLS_PORT")
        .map(|port| port.parse().expect("DELAY_BRIDGE_TEST_TLS_PORT is a port"))
        .unwrap_or(5695)
}

fn url() -> String {
    url_at("localhost")
}

fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

/// A CA (`<name>-ca.pem`, `<name>-ca.key`) in `dir`.
fn make_ca(dir: &Path, name: &str) {
    let (pem, key) = (format!("{name}-ca.pem"), format!("{name}-ca.key"));
    openssl(
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            &key,
            "-out",
            &pem,
            "-subj",
            &format!("/CN={name} test CA"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        dir,
    );
}

/// A certificate `<name>.pem` with key `<name>.key` (PKCS#8), signed by the CA `<ca>`.
fn make_cert(dir: &Path, ca: &str, name: &str, extensions: &str) {
    let ext = format!("{name}.ext");
    std::fs::write(dir.join(&ext), extensions).unwrap();
    openssl(
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ],
        dir,
    );
    openssl(
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}-ca.pem"),
            "-CAkey",
            &format!("{ca}-ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &format!("{name}.pem"),
            "-extfile",
            &ext,
        ],
        dir,
    );
}

/// Certificates for the broker (`ca.pem`, `server.pem`, `server.key`, as
/// `cluster.sh start-tls` reads them), the bridge's client certificate, and a second CA
/// whose server certificate the bridge must refuse.
fn certificates() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("delay-bridge-tls-{:08x}", rand::random::<u32>()));
    std::fs::create_dir_all(&dir).unwrap();
    make_ca(&dir, "test");
    make_ca(&dir, "rogue");
    make_cert(
        &dir,
        "test",
        "server",
        // A name only, no address: an `amqps://127.0.0.1` URL needs `server_name`.
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    );
    make_cert(
        &dir,
        "test",
        "client",
        "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
    );
    std::fs::copy(dir.join("test-ca.pem"), dir.join("ca.pem")).unwrap();
    dir
}

/// Runs the script that starts and stops the TLS node: `DELAY_BRIDGE_TEST_TLS_BROKER` (a
/// script under the project and its leading arguments, for example
/// `scripts/debian-broker.sh sid`).
fn tls_broker(args: &[&str]) -> std::process::Output {
    let line = std::env::var("DELAY_BRIDGE_TEST_TLS_BROKER")
        .unwrap_or_else(|_| "scripts/cluster.sh".into());
    let mut parts = line.split_whitespace();
    let script = parts.next().expect("a script");
    Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(script))
        .args(parts)
        .args(args)
        .output()
        .expect("the TLS broker script runs")
}

/// The broker node with the AMQPS listener; stopped when dropped.
struct TlsBroker;

impl TlsBroker {
    fn start(certificates: &Path) -> TlsBroker {
        let out = tls_broker(&["start-tls", certificates.to_str().unwrap()]);
        assert!(out.status.success(), "the TLS broker starts: {out:?}");
        TlsBroker
    }
}

impl Drop for TlsBroker {
    fn drop(&mut self) {
        let _ = tls_broker(&["stop-tls"]);
    }
}

fn config(tls: RawTls) -> Config {
    config_at("localhost", tls)
}

fn config_at(host: &str, tls: RawTls) -> Config {
    raw(&url_at(host), tls).validate().expect("a valid config")
}

/// A configuration of one route with this broker URL and `[tls]`, as the file holds it.
fn raw(url: &str, tls: RawTls) -> RawConfig {
    RawConfig {
        broker: RawBroker {
            url: Some(url.into()),
            urls: None,
        },
        routes: vec![RawRoute {
            ingress: Some("tls.in".into()),
            target: Some("tls.out".into()),
            ingress_type: None,
        }],
        tls,
        ..RawConfig::default()
    }
}

#[tokio::test]
async fn amqps_with_a_ca_and_a_client_certificate_carries_messages_and_refuses_the_wrong_ones() {
    let dir = certificates();
    let _broker = TlsBroker::start(&dir);
    let good = RawTls {
        ca_file: Some(dir.join("test-ca.pem")),
        cert_file: Some(dir.join("client.pem")),
        key_file: Some(dir.join("client.key")),
        server_name: None,
    };

    // A message through the bridge, every connection over TLS.
    let mut base = config(good.clone());
    base.ladder = delay_bridge::ladder::Ladder::parse("100ms 200ms").unwrap();
    base.margin = Duration::from_millis(30);
    let sandbox = Sandbox::start(&base, "test-tls", TargetBinding::Fanout)
        .await
        .expect("the sandbox and its bridge connect over TLS");
    let mut arrivals = watch_queue(&sandbox.conn, &sandbox.target_queue)
        .await
        .unwrap();
    let publisher = sandbox.conn.create_channel().await.unwrap();
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    publish_delayed(&publisher, &sandbox.ingress, "rk.tls", b"over tls").await;
    let got = tokio::time::timeout(Duration::from_secs(10), arrivals.recv())
        .await
        .expect("delivered within 10 s")
        .unwrap();
    assert_eq!(got.body, b"over tls");

    // A delivery the AMQP client cannot read (a header name that is not UTF-8), published
    // over TLS by hand: the bridge's sweep reaches the broker over TLS as well and parks it
    // `unreadable`; the next message is delivered.
    let mut parked = watch_queue(&sandbox.conn, &sandbox.config.names.parked_queue())
        .await
        .unwrap();
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let identity = OwnedTLSConfig {
        identity: Some(OwnedIdentity::PKCS8 {
            pem: read("client.pem"),
            key: read("client.key"),
        }),
        cert_chain: Some(String::from_utf8(read("test-ca.pem")).unwrap()),
    };
    let runtime = lapin::runtime::default_runtime().unwrap();
    let stream = AsyncTcpStream::connect(&runtime, runtime.to_socket_addrs(("localhost", port())))
        .await
        .unwrap()
        .into_tls("localhost", identity.as_ref())
        .await
        .expect("a TLS stream with the client certificate");
    let mut properties = (1u16 << 13).to_be_bytes().to_vec();
    properties.extend(raw::headers_named(300, &[0xff, 0xfe]));
    raw::publish_raw_on(
        stream,
        &url(),
        &sandbox.ingress,
        b"rk.bad",
        &properties,
        b"unreadable over tls",
    )
    .await;
    publish_delayed(&publisher, &sandbox.ingress, "rk.after", b"after").await;
    let unreadable = tokio::time::timeout(Duration::from_secs(20), parked.recv())
        .await
        .expect("parked within 20 s")
        .unwrap();
    assert_eq!(unreadable.body, b"unreadable over tls");
    assert_eq!(
        unreadable.header("delay-bridge-reason"),
        Some(&AMQPValue::LongString("unreadable".into()))
    );
    let after = tokio::time::timeout(Duration::from_secs(20), arrivals.recv())
        .await
        .expect("the next message delivered within 20 s")
        .unwrap();
    assert_eq!(after.body, b"after");
    sandbox.finish().await.unwrap();

    // The broker's certificate from another CA: refused, and the error says why.
    let rogue = config(RawTls {
        ca_file: Some(dir.join("rogue-ca.pem")),
        ..good.clone()
    });
    let error = amqp::connect(rogue.url(), "tls test")
        .await
        .unwrap_err()
        .to_string();
    println!("a broker certificate from another CA: {error}");
    assert!(error.contains("certificate"), "{error}");
    assert!(!error.contains("guest:guest"), "no password in {error}");

    // No client certificate where the broker requires one: refused.
    let anonymous = config(RawTls {
        ca_file: Some(dir.join("test-ca.pem")),
        cert_file: None,
        key_file: None,
        server_name: None,
    });
    let error = amqp::connect(anonymous.url(), "tls test")
        .await
        .expect_err("the broker requires a client certificate")
        .to_string();
    println!("no client certificate: {error}");
    // The broker's alert (CertificateRequired), or a reset before it, with the hint.
    assert!(error.contains("client certificate"), "{error}");

    // By address: the certificate names no address, so the name to check is set apart.
    let by_address = config_at("127.0.0.1", good.clone());
    let error = amqp::connect(by_address.url(), "tls test")
        .await
        .expect_err("127.0.0.1 is not a name on the certificate")
        .to_string();
    println!("by address, no server_name: {error}");
    assert!(error.contains("certificate"), "{error}");
    let named = config_at(
        "127.0.0.1",
        RawTls {
            server_name: Some("localhost".into()),
            ..good.clone()
        },
    );
    let connection = amqp::connect(named.url(), "tls test")
        .await
        .expect("server_name = localhost matches the certificate");
    let _ = connection.close(200, "done".into()).await;

    // A missing file names itself.
    let missing = config(RawTls {
        ca_file: Some(dir.join("nowhere.pem")),
        ..good
    });
    let error = amqp::connect(missing.url(), "tls test")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tls.ca_file") && error.contains("nowhere.pem"),
        "{error}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tls_needs_amqps_urls_and_a_whole_client_identity() {
    let ca = RawTls {
        ca_file: Some("ca.pem".into()),
        ..RawTls::default()
    };
    let plain = raw("amqp://h", ca.clone())
        .validate()
        .unwrap_err()
        .to_string();
    assert!(plain.contains("amqps://"), "{plain}");
    let half = raw(
        &url(),
        RawTls {
            cert_file: Some("c.pem".into()),
            ..RawTls::default()
        },
    )
    .validate()
    .unwrap_err()
    .to_string();
    assert!(half.contains("key_file"), "{half}");
    let bad_name = raw(
        &url(),
        RawTls {
            server_name: Some("rabbit:5671".into()),
            ..ca.clone()
        },
    )
    .validate()
    .unwrap_err()
    .to_string();
    assert!(bad_name.contains("tls.server_name"), "{bad_name}");
    let config = raw(&url(), ca).validate().unwrap();
    assert!(config.url().tls().is_some());
    assert!(config.to_string().contains("ca_file = \"ca.pem\""));
    let _: &BrokerUrl = config.url();
}
