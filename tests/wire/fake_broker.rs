//! A scripted fake broker: a socket on loopback that the test drives frame by frame, for the
//! connection's edges that a real broker will not show on demand (a peer that goes silent,
//! a tune of the test's choosing). It speaks just enough AMQP 0-9-1 to open a connection.

use amq_protocol::frame::{AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::{AMQPClass, connection, parse_class};
use amq_protocol::types::{FieldTable, LongString};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The frame type of a method.
const FRAME_METHOD: u8 = 1;
/// The frame type of a heartbeat.
const FRAME_HEARTBEAT: u8 = 8;
/// The byte that ends every frame.
const FRAME_END: u8 = 0xCE;

/// A listener on a free loopback port, waiting for one client.
pub struct FakeBroker {
    listener: TcpListener,
}

/// One client's socket, past the handshake or not.
pub struct Peer {
    socket: TcpStream,
}

impl FakeBroker {
    /// Listens on a free port of 127.0.0.1.
    pub async fn listen() -> Self {
        Self {
            listener: TcpListener::bind("127.0.0.1:0").await.expect("a free port"),
        }
    }

    /// The URL a client connects to it with (`query` appended as it is).
    pub fn url(&self, query: &str) -> String {
        let port = self.listener.local_addr().expect("bound").port();
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f{query}")
    }

    /// Accepts one client, takes its login, and refuses it as RabbitMQ does for a wrong
    /// password when the client asked for `authentication_failure_close`.
    pub async fn accept_and_refuse_login(&self) -> Peer {
        let mut peer = self.accept_and_start().await;
        peer.send(AMQPClass::Connection(connection::AMQPMethod::Close(
            connection::Close {
                reply_code: 403,
                reply_text: "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN".into(),
                class_id: 0,
                method_id: 0,
            },
        )))
        .await;
        peer
    }

    /// Accepts one client and opens AMQP with it, offering `tune`.
    pub async fn accept_and_open(&self, tune: connection::Tune) -> Peer {
        let mut peer = self.accept_and_start().await;
        peer.send(AMQPClass::Connection(connection::AMQPMethod::Tune(tune)))
            .await;
        assert!(matches!(
            peer.method().await,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(_))
        ));
        assert!(matches!(
            peer.method().await,
            AMQPClass::Connection(connection::AMQPMethod::Open(_))
        ));
        peer.send(AMQPClass::Connection(connection::AMQPMethod::OpenOk(
            connection::OpenOk {},
        )))
        .await;
        peer
    }

    /// Accepts one client and takes its protocol header and `connection.start-ok`.
    async fn accept_and_start(&self) -> Peer {
        let (socket, _) = self.listener.accept().await.expect("a client");
        let mut peer = Peer { socket };
        let mut greeting = [0u8; 8];
        peer.socket
            .read_exact(&mut greeting)
            .await
            .expect("the protocol header");
        assert_eq!(&greeting, b"AMQP\x00\x00\x09\x01");
        peer.send(AMQPClass::Connection(connection::AMQPMethod::Start(
            connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: FieldTable::default(),
                mechanisms: LongString::from("PLAIN"),
                locales: LongString::from("en_US"),
            },
        )))
        .await;
        assert!(matches!(
            peer.method().await,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(_))
        ));
        peer
    }
}

impl Peer {
    /// Sends `method` on channel 0.
    pub async fn send(&mut self, method: AMQPClass) {
        self.send_on(0, method).await;
    }

    /// Answers every `channel.open` with `channel.open-ok`, until the client closes the
    /// socket.
    pub async fn open_every_channel(mut self) {
        while let Some((channel, method)) = self.next_method_on().await {
            if let AMQPClass::Channel(amq_protocol::protocol::channel::AMQPMethod::Open(_)) = method
            {
                self.send_on(
                    channel,
                    AMQPClass::Channel(amq_protocol::protocol::channel::AMQPMethod::OpenOk(
                        amq_protocol::protocol::channel::OpenOk {},
                    )),
                )
                .await;
            }
        }
    }

    /// Sends a heartbeat frame.
    pub async fn heartbeat(&mut self) {
        self.socket
            .write_all(&[8, 0, 0, 0, 0, 0, 0, FRAME_END])
            .await
            .expect("written");
    }

    /// Sends `method` on `channel`.
    pub async fn send_on(&mut self, channel: u16, method: AMQPClass) {
        self.send_frame(AMQPFrame::Method(channel, method)).await;
    }

    /// The next method frame the client sent (heartbeats skipped).
    pub async fn method(&mut self) -> AMQPClass {
        self.next_method_on().await.expect("a method").1
    }

    /// The next method frame the client sent and its channel (heartbeats skipped).
    pub async fn method_on(&mut self) -> (u16, AMQPClass) {
        self.next_method_on().await.expect("a method")
    }

    /// Takes the client's `channel.open`, answers `channel.open-ok`, and says which
    /// channel it was.
    pub async fn answer_open(&mut self) -> u16 {
        let (channel, method) = self.method_on().await;
        assert!(
            matches!(
                method,
                AMQPClass::Channel(amq_protocol::protocol::channel::AMQPMethod::Open(_))
            ),
            "{method:?} where channel.open was due"
        );
        self.send_on(
            channel,
            AMQPClass::Channel(amq_protocol::protocol::channel::AMQPMethod::OpenOk(
                amq_protocol::protocol::channel::OpenOk {},
            )),
        )
        .await;
        channel
    }

    /// The next frame the client sent, whatever its type: its type, channel and payload
    /// (heartbeats skipped).
    pub async fn frame(&mut self) -> (u8, u16, Vec<u8>) {
        self.next_frame().await.expect("a frame")
    }

    /// Sends `frame` as the codec writes it.
    pub async fn send_frame(&mut self, frame: AMQPFrame) {
        let bytes = gen_frame(&frame)(WriteContext::from(Vec::new()))
            .expect("a frame the codec writes")
            .write;
        self.send_bytes(&bytes).await;
    }

    /// Sends `bytes` as they are (a frame the codec would not write, say).
    pub async fn send_bytes(&mut self, bytes: &[u8]) {
        self.socket.write_all(bytes).await.expect("written");
    }

    /// The next method frame the client sent and its channel (heartbeats and content
    /// skipped); `None` once the client closed the socket.
    async fn next_method_on(&mut self) -> Option<(u16, AMQPClass)> {
        loop {
            let (kind, channel, payload) = self.next_frame().await?;
            if kind == FRAME_METHOD {
                return Some((channel, parse_class(&payload[..]).expect("a method").1));
            }
        }
    }

    /// The next frame the client sent, heartbeats skipped: its type, channel and payload;
    /// `None` once the client closed the socket.
    async fn next_frame(&mut self) -> Option<(u8, u16, Vec<u8>)> {
        loop {
            let mut head = [0u8; 7];
            self.socket.read_exact(&mut head).await.ok()?;
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut payload = vec![0u8; size + 1];
            self.socket
                .read_exact(&mut payload)
                .await
                .expect("its payload");
            assert_eq!(payload.pop(), Some(FRAME_END));
            if head[0] != FRAME_HEARTBEAT {
                return Some((head[0], u16::from_be_bytes([head[1], head[2]]), payload));
            }
        }
    }

    /// Reads what the client still sends until it closes its side of the socket; false if
    /// it did not within `within`.
    pub async fn closed_by_client_within(&mut self, within: std::time::Duration) -> bool {
        let mut sink = [0u8; 4096];
        tokio::time::timeout(within, async {
            loop {
                match self.socket.read(&mut sink).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }
}
