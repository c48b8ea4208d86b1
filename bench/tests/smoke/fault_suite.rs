//! The fault suite, reduced: each scenario of `scripts/faults.sh` that needs one broker
//! runs through `delay-bridge-bench` with small counts and short runs. What must hold at any
//! size is asserted (nothing missing, the fault happened, the bridge kept its connection);
//! lateness is reported, not asserted, at these sizes. The cluster scenarios (node loss,
//! broker crash) need brokers of their own and run in `scripts/faults.sh` only.

use serde_json::Value;

use crate::bench::bench;

/// `scenario` with a small load (`count` messages at 500/s, delays of 1-3 s) and `extra`.
async fn reduced(scenario: &str, count: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        scenario,
        "--count",
        count,
        "--rate",
        "500",
        "--min-delay",
        "1s",
        "--max-delay",
        "3s",
    ];
    args.extend(extra);
    bench(&args).await
}

fn assert_nothing_missing(json: &Value) {
    assert_eq!(json["missing"], 0, "{json}");
    assert_eq!(json["targets"][0]["verdict"], "PASS", "{json}");
}

#[tokio::test]
async fn fault_connection_cuts_reduced() {
    let json = reduced(
        "connection-cuts",
        "1500",
        &["--every", "1s", "--cut-for", "3s"],
    )
    .await;
    assert_nothing_missing(&json);
    assert!(json["cuts"].as_u64().unwrap() >= 1, "{json}");
}

#[tokio::test]
async fn fault_bridge_chaos_reduced() {
    let json = reduced(
        "bridge-chaos",
        "2000",
        &["--min-pause", "1s", "--max-pause", "2s"],
    )
    .await;
    assert_nothing_missing(&json);
    assert!(json["kills"].as_u64().unwrap() >= 1, "{json}");
    assert_eq!(json["targets"][1]["verdict"], "PASS", "{json}");
}

#[tokio::test]
async fn fault_fuzz_reduced() {
    let json = bench(&["fuzz", "--count", "500"]).await;
    assert_nothing_missing(&json);
    assert_eq!(json["bridge_reconnects"], 0, "{json}");
    assert_eq!(json["count"], 500);
    let delivered = json["delivered"].as_u64().unwrap();
    let parked = json["parked"].as_u64().unwrap();
    assert!(delivered + parked >= 500, "{json}");
    assert!(delivered > 0 && parked > 0, "some of each: {json}");
    for t in json["targets"].as_array().unwrap() {
        assert_eq!(t["verdict"], "PASS", "{json}");
    }
}
