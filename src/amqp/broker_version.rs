//! What the broker's version means for the bridge: the known broker faults it warns of at
//! connect, as pure code.

use crate::config::QueueType;

/// The first RabbitMQ 4.3 release whose quorum queues dead-letter without getting stuck.
const QUORUM_DEAD_LETTER_FIXED: (u64, u64, u64) = (4, 3, 3);

/// A warning for an operator when `version` (the broker's announced version, such as
/// `4.3.1`) is known to misbehave with `queue_type`, else `None`.
///
/// RabbitMQ 4.3.0 to 4.3.2 can leave a quorum queue's dead-lettered messages stuck
/// (rabbitmq-server #16652, fixed in 4.3.3); in quorum mode every hop of the bridge is a
/// dead-lettering from a quorum level queue.
pub fn warning(version: &str, queue_type: QueueType) -> Option<String> {
    let release = parse(version)?;
    let affected = queue_type == QueueType::Quorum
        && release >= (4, 3, 0)
        && release < QUORUM_DEAD_LETTER_FIXED;
    affected.then(|| {
        format!(
            "RabbitMQ {version} can leave quorum queues' dead-lettered messages stuck (rabbitmq-server #16652, fixed in 4.3.3): in quorum mode every hop is a dead-lettering, so messages may stop in a level. Upgrade the broker to 4.3.3 or later, or run queue_type = \"classic\""
        )
    })
}

/// `major.minor.patch` from a version such as `4.3.1` or `4.3.0-rc.1` (a missing patch
/// reads as 0); `None` when it does not start that way.
fn parse(version: &str) -> Option<(u64, u64, u64)> {
    let numbers = version.split(['-', '+']).next()?;
    let mut parts = numbers.split('.').map(str::parse::<u64>);
    let major = parts.next()?.ok()?;
    let minor = parts.next()?.ok()?;
    let patch = parts.next().unwrap_or(Ok(0)).ok()?;
    Some((major, minor, patch))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_mode_on_4_3_0_to_4_3_2_is_warned_of_by_version_and_fix() {
        for version in ["4.3.0", "4.3.1", "4.3.2", "4.3.0-rc.2"] {
            let text = warning(version, QueueType::Quorum).expect(version);
            println!("{text}");
            assert!(
                text.starts_with(&format!("RabbitMQ {version} can leave quorum queues' dead-lettered messages stuck (rabbitmq-server #16652, fixed in 4.3.3)")),
                "{text}"
            );
            assert!(text.contains("Upgrade the broker to 4.3.3 or later"));
        }
    }

    #[test]
    fn other_versions_and_classic_mode_are_not_warned_of() {
        for version in ["3.10.8", "4.0.5", "4.2.9", "4.3.3", "4.3.6", "4.4.0", "5.0"] {
            assert_eq!(warning(version, QueueType::Quorum), None, "{version}");
        }
        assert_eq!(warning("4.3.1", QueueType::Classic), None);
        assert_eq!(warning("not a version", QueueType::Quorum), None);
    }
}
