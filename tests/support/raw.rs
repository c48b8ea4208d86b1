//! A bare AMQP 0-9-1 publisher over a TCP socket, for messages no client library will
//! encode (a header table nested thousands of levels deep overflows their recursive
//! encoders). One confirmed publish per connection.

use std::time::Duration;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use lapin::tcp::AsyncTcpStream;

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_END: u8 = 0xCE;

fn short_string(out: &mut Vec<u8>, s: &str) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

fn long_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// A header table, encoded: `x-delay` (long-long) and `deep`, a table nested `depth`
/// levels (each level one entry `n` holding the next table).
pub fn deep_headers(delay_ms: i64, depth: usize) -> Vec<u8> {
    let mut inner: Vec<u8> = 0u32.to_be_bytes().to_vec();
    for _ in 0..depth {
        let mut entry = vec![1u8, b'n', b'F'];
        entry.extend_from_slice(&inner);
        let mut table = (entry.len() as u32).to_be_bytes().to_vec();
        table.extend(entry);
        inner = table;
    }
    let mut entries = Vec::new();
    short_string(&mut entries, "x-delay");
    entries.push(b'l');
    entries.extend_from_slice(&delay_ms.to_be_bytes());
    short_string(&mut entries, "deep");
    entries.push(b'F');
    entries.extend_from_slice(&inner);
    let mut table = (entries.len() as u32).to_be_bytes().to_vec();
    table.extend(entries);
    table
}

/// A header table, encoded: `x-delay` (long-long) and `pad`, a long string of `pad` bytes.
pub fn padded_headers(delay_ms: i64, pad: usize) -> Vec<u8> {
    let mut entries = Vec::new();
    short_string(&mut entries, "x-delay");
    entries.push(b'l');
    entries.extend_from_slice(&delay_ms.to_be_bytes());
    short_string(&mut entries, "pad");
    entries.push(b'S');
    long_string(&mut entries, &vec![b'p'; pad]);
    let mut table = (entries.len() as u32).to_be_bytes().to_vec();
    table.extend(entries);
    table
}

/// Publishes, through the default exchange straight into `queue` (a parked queue, a cancel
/// stream) on the broker at `url`, a message whose header name is not UTF-8: one the AMQP
/// client cannot read.
pub async fn publish_unreadable_into(url: &str, queue: &str, body: &[u8]) {
    let mut properties = (1u16 << 13).to_be_bytes().to_vec();
    properties.extend(headers_named(300, &[0xff, 0xfe]));
    publish_raw_properties(url, "", queue.as_bytes(), &properties, body).await;
}

/// A header table, encoded: `x-delay` (long-long) and one entry whose name is `name`, bytes
/// that need not be UTF-8, holding a long-long 1.
pub fn headers_named(delay_ms: i64, name: &[u8]) -> Vec<u8> {
    let mut entries = Vec::new();
    short_string(&mut entries, "x-delay");
    entries.push(b'l');
    entries.extend_from_slice(&delay_ms.to_be_bytes());
    entries.push(name.len() as u8);
    entries.extend_from_slice(name);
    entries.push(b'l');
    entries.extend_from_slice(&1i64.to_be_bytes());
    let mut table = (entries.len() as u32).to_be_bytes().to_vec();
    table.extend(entries);
    table
}

struct Conn<S> {
    stream: S,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    async fn send(&mut self, kind: u8, channel: u16, payload: &[u8]) {
        let mut frame = vec![kind];
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(FRAME_END);
        self.stream.write_all(&frame).await.unwrap();
    }

    async fn method(&mut self, channel: u16, class: u16, method: u16, args: &[u8]) {
        let mut payload = class.to_be_bytes().to_vec();
        payload.extend_from_slice(&method.to_be_bytes());
        payload.extend_from_slice(args);
        self.send(FRAME_METHOD, channel, &payload).await;
    }

    /// The next method frame's (class, method, arguments), skipping heartbeats.
    async fn expect(&mut self, class: u16, method: u16) -> Vec<u8> {
        loop {
            let mut head = [0u8; 7];
            self.stream.read_exact(&mut head).await.unwrap();
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut payload = vec![0u8; size + 1];
            self.stream.read_exact(&mut payload).await.unwrap();
            if head[0] != FRAME_METHOD {
                continue;
            }
            let got = (
                u16::from_be_bytes([payload[0], payload[1]]),
                u16::from_be_bytes([payload[2], payload[3]]),
            );
            assert_eq!(got, (class, method), "unexpected method frame: {payload:?}");
            return payload[4..size].to_vec();
        }
    }
}

/// Publishes one message with `headers` (an encoded table) to `exchange` on the broker of
/// `url` (`amqp://user:password@host:port/vhost`) and waits for its confirm.
pub async fn publish_raw(
    url: &str,
    exchange: &str,
    routing_key: &str,
    headers: &[u8],
    body: &[u8],
) {
    let mut properties = (1u16 << 13).to_be_bytes().to_vec(); // headers only
    properties.extend_from_slice(headers);
    publish_raw_properties(url, exchange, routing_key.as_bytes(), &properties, body).await;
}

/// The encoded properties of a message with `message_id` (any bytes) and a header table
/// holding `x-delay`.
pub fn message_id_properties(delay_ms: i64, message_id: &[u8]) -> Vec<u8> {
    let mut properties = ((1u16 << 13) | (1u16 << 7)).to_be_bytes().to_vec();
    let mut entries = Vec::new();
    short_string(&mut entries, "x-delay");
    entries.push(b'l');
    entries.extend_from_slice(&delay_ms.to_be_bytes());
    properties.extend_from_slice(&(entries.len() as u32).to_be_bytes());
    properties.extend(entries);
    properties.push(message_id.len() as u8);
    properties.extend_from_slice(message_id);
    properties
}

/// Publishes one message with `properties` (the property flags, then the encoded
/// properties) and a routing key of any bytes, and waits for its confirm.
/// Publishes `body` to `exchange` with routing key `rk.bad` and one header, named
/// `name` (bytes that need not be UTF-8), beside an `x-delay` of `delay_ms`: a message the
/// AMQP client cannot read.
pub async fn publish_with_header_named(
    url: &str,
    exchange: &str,
    delay_ms: i64,
    name: &[u8],
    body: &[u8],
) {
    // The property flags: headers only.
    let mut properties = (1u16 << 13).to_be_bytes().to_vec();
    properties.extend(headers_named(delay_ms, name));
    publish_raw_properties(url, exchange, b"rk.bad", &properties, body).await;
}

pub async fn publish_raw_properties(
    url: &str,
    exchange: &str,
    routing_key: &[u8],
    properties: &[u8],
    body: &[u8],
) {
    let parsed = url::Url::parse(url).unwrap();
    let host = parsed.host_str().unwrap().to_string();
    let port = parsed.port().unwrap_or(5672);
    let runtime = lapin::runtime::default_runtime().unwrap();
    let addresses = runtime.to_socket_addrs((host, port));
    let stream = tokio::time::timeout(
        Duration::from_secs(10),
        AsyncTcpStream::connect(&runtime, addresses),
    )
    .await
    .unwrap()
    .unwrap();
    publish_raw_on(stream, url, exchange, routing_key, properties, body).await;
}

/// [`publish_raw_properties`] over `stream`, already connected to the broker of `url` (a
/// TLS stream, say).
pub async fn publish_raw_on(
    stream: impl AsyncRead + AsyncWrite + Unpin,
    url: &str,
    exchange: &str,
    routing_key: &[u8],
    properties: &[u8],
    body: &[u8],
) {
    let url = url::Url::parse(url).unwrap();
    let path = url.path().trim_start_matches('/');
    let vhost = if path.is_empty() || path.eq_ignore_ascii_case("%2f") {
        "/".to_string()
    } else {
        path.to_string()
    };
    let response = format!("\0{}\0{}", url.username(), url.password().unwrap_or(""));
    let mut c = Conn { stream };
    c.stream.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
    c.expect(10, 10).await; // connection.start
    let mut start_ok = 0u32.to_be_bytes().to_vec(); // client properties: none
    short_string(&mut start_ok, "PLAIN");
    long_string(&mut start_ok, response.as_bytes());
    short_string(&mut start_ok, "en_US");
    c.method(0, 10, 11, &start_ok).await;
    let tune = c.expect(10, 30).await;
    let mut tune_ok = tune[..6].to_vec(); // channel_max, frame_max as offered
    tune_ok.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
    c.method(0, 10, 31, &tune_ok).await;
    let mut open = Vec::new();
    short_string(&mut open, &vhost);
    short_string(&mut open, "");
    open.push(0);
    c.method(0, 10, 40, &open).await;
    c.expect(10, 41).await;
    c.method(1, 20, 10, &[0]).await; // channel.open
    c.expect(20, 11).await;
    c.method(1, 85, 10, &[0]).await; // confirm.select
    c.expect(85, 11).await;
    let mut publish = 0u16.to_be_bytes().to_vec();
    short_string(&mut publish, exchange);
    publish.push(routing_key.len() as u8);
    publish.extend_from_slice(routing_key);
    publish.push(0);
    c.method(1, 60, 40, &publish).await;
    let mut header = 60u16.to_be_bytes().to_vec();
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&(body.len() as u64).to_be_bytes());
    header.extend_from_slice(properties);
    c.send(FRAME_HEADER, 1, &header).await;
    c.send(FRAME_BODY, 1, body).await;
    c.expect(60, 80).await; // basic.ack
    let mut close = 200u16.to_be_bytes().to_vec();
    short_string(&mut close, "done");
    close.extend_from_slice(&[0, 0, 0, 0]);
    c.method(0, 10, 50, &close).await;
    c.expect(10, 51).await;
}
