//! The command line's own edges, without a broker.

use std::process::Stdio;

use crate::support::bridge_exe;

/// A reader that closes the pipe before the command writes (`delay-bridge ... | head -n 1`
/// once `head` has its line) ends the command quietly, as it ends `cat`: no panic, and no
/// failure for a pipeline under `set -o pipefail`.
#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    for args in [
        &["ladders"][..],
        &["plan", "5h"],
        &["permissions"],
        &["check-config"],
    ] {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let output = std::process::Command::new(bridge_exe())
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env_remove("DELAY_BRIDGE_CONFIG")
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .expect("the command runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && !stderr.contains("panicked"),
            "`delay-bridge {}` into a closed pipe: {}, stderr: {stderr}",
            args.join(" "),
            output.status
        );
    }
}
