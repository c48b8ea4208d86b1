//! The fault suite, reduced: each scenario of `scripts/faults.sh` that needs one broker
//! runs through `delay-bridge-bench` with small counts and short runs. What must hold at any
//! size is asserted (nothing missing, the fault happened, the bridge kept its connection);
//! lateness is reported, not asserted, at these sizes. The cluster scenarios (node loss,
//! broker crash) need brokers of their own and run in `scripts/faults.sh` only.

use delay_bridge_bench::report::{Fault, Report, Verdict};

use crate::bench::bench;

/// `scenario` with a small load (`count` messages at 500/s, delays of 1-3 s) and `extra`.
async fn reduced(scenario: &str, count: &str, extra: &[&str]) -> Report<Fault> {
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

fn assert_nothing_missing(report: &Report<Fault>) {
    assert_eq!(report.body.missing, 0, "{report:?}");
    assert_eq!(report.targets[0].verdict, Verdict::Pass, "{report:?}");
}

#[tokio::test]
async fn fault_connection_cuts_reduced() {
    let report = reduced(
        "connection-cuts",
        "1500",
        &["--every", "1s", "--cut-for", "3s"],
    )
    .await;
    assert_nothing_missing(&report);
    assert!(report.body.fault.cuts.expect("cuts") >= 1, "{report:?}");
}

#[tokio::test]
async fn fault_bridge_chaos_reduced() {
    let report = reduced(
        "bridge-chaos",
        "2000",
        &["--min-pause", "1s", "--max-pause", "2s"],
    )
    .await;
    assert_nothing_missing(&report);
    assert!(report.body.fault.kills.expect("kills") >= 1, "{report:?}");
    assert_eq!(report.targets[1].verdict, Verdict::Pass, "{report:?}");
}

#[tokio::test]
async fn fault_fuzz_reduced() {
    let report: Report<Fault> = bench(&["fuzz", "--count", "500"]).await;
    assert_nothing_missing(&report);
    let fuzz = &report.body;
    assert_eq!(fuzz.fault.bridge_reconnects, Some(0), "{report:?}");
    assert_eq!(fuzz.count, 500);
    assert!(fuzz.delivered + fuzz.parked >= 500, "{report:?}");
    assert!(
        fuzz.delivered > 0 && fuzz.parked > 0,
        "some of each: {report:?}"
    );
    for t in &report.targets {
        assert_eq!(t.verdict, Verdict::Pass, "{report:?}");
    }
}

/// The fuzz as an adversary (a signing bridge, a second route, a publisher with the
/// recipe's rights only, forged state bound for the second route): nothing reaches the
/// second route and nothing is lost, before and after a `parked replay`.
#[tokio::test]
async fn fault_fuzz_adversary_reduced() {
    let report: Report<Fault> = bench(&["fuzz", "--adversary", "--count", "300"]).await;
    assert_nothing_missing(&report);
    assert_eq!(report.body.fault.bridge_reconnects, Some(0), "{report:?}");
    for name in [
        "0 delivered outside their route",
        "0 lost",
        "the second route delivers",
    ] {
        let target = report
            .target(name)
            .unwrap_or_else(|| panic!("no target `{name}`: {report:?}"));
        assert_eq!(target.verdict, Verdict::Pass, "{report:?}");
    }
    for t in &report.targets {
        assert_eq!(t.verdict, Verdict::Pass, "{report:?}");
    }
}
