# delay-bridge as a container: `docker build -t delay-bridge .`
# Runs `delay-bridge run` with config/delay-bridge.toml baked in; point it at a broker with
# DELAY_BRIDGE_URL, or mount your own file over /etc/delay-bridge/delay-bridge.toml.

# Build stage: the current stable Rust (the crate needs 1.88 or newer, edition 2024); the
# image's gcc builds aws-lc for rustls.
FROM rust:1-bookworm AS build
WORKDIR /src
# The workspace's manifest names bench/ as a member: cargo reads it even to build only
# the daemon.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY bench ./bench
COPY config ./config
RUN cargo build --release --locked -p delay-bridge --bin delay-bridge

# Run stage: the binary, CA certificates for amqps://, and an unprivileged user.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home delay-bridge
COPY --from=build /src/target/release/delay-bridge /usr/local/bin/delay-bridge
COPY config/delay-bridge.toml /etc/delay-bridge/delay-bridge.toml
# RUST_MIN_STACK: room for the AMQP client to parse the deepest header table a frame can
# carry (the binary sets the same value itself when it is unset; address space, not memory).
# DELAY_BRIDGE_METRICS_LISTEN turns on the metrics and health listener: Prometheus on
# :9090/metrics, /healthz and /readyz.
ENV DELAY_BRIDGE_CONFIG=/etc/delay-bridge/delay-bridge.toml \
    DELAY_BRIDGE_METRICS_LISTEN=0.0.0.0:9090 \
    RUST_LOG=info \
    RUST_MIN_STACK=268435456
EXPOSE 9090
USER delay-bridge
# Alive while /healthz answers (`delay-bridge health` GETs it: the image needs no curl). A
# bridge that is reconnecting is alive but not ready: orchestrators route on /readyz
# (`delay-bridge health --ready`, as docker-compose.yml does).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["delay-bridge", "health"]
# SIGTERM (docker stop) drains: stops consuming, hands held messages back, waits up to
# bridge.shutdown_timeout (10s) for in-flight confirms; give `docker stop` longer than that
# (`--time 15`, or compose's stop_grace_period). Anything unacked is redelivered anyway.
STOPSIGNAL SIGTERM
ENTRYPOINT ["delay-bridge"]
CMD ["run"]
