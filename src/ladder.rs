//! Delay levels: a validated, sorted set of durations, the presets, and duration text.
//!
//! Each level becomes one durable queue whose queue-wide `x-message-ttl` is the level, so
//! every level must be a whole number of milliseconds and no longer than the broker's largest
//! TTL ([`MAX_LEVEL`], 2^32 − 1 ms ≈ 49.7 days).

use std::fmt;
use std::time::Duration;

use thiserror::Error;

/// The longest TTL RabbitMQ accepts for `x-message-ttl` (2^32 − 1 ms, about 49.7 days).
pub const MAX_LEVEL: Duration = Duration::from_millis(u32::MAX as u64);

/// Why a ladder (or one of its items) was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LadderError {
    /// The ladder has no levels at all.
    #[error("a ladder needs at least one level; got none")]
    Empty,
    /// An item is not a duration humantime understands.
    #[error(
        "level #{index} `{item}` is not a duration ({reason}); write levels like `500ms 1s 1m30s 2h 1d`"
    )]
    BadDuration {
        /// 1-based position of the item.
        index: usize,
        /// The text as written.
        item: String,
        /// What the duration parser said.
        reason: String,
    },
    /// A level of zero length.
    #[error("level #{index} `{item}` is zero; every level must be longer than 0 ms")]
    Zero {
        /// 1-based position of the item.
        index: usize,
        /// The level as written or formatted.
        item: String,
    },
    /// A level that is not a whole number of milliseconds (TTLs are in ms).
    #[error("level #{index} `{item}` is not a whole number of milliseconds (queue TTLs are in ms)")]
    SubMillisecond {
        /// 1-based position of the item.
        index: usize,
        /// The level as written or formatted.
        item: String,
    },
    /// A level above the broker's largest TTL.
    #[error(
        "level #{index} `{item}` is longer than RabbitMQ's largest TTL (4294967295 ms, about 49.7 days)"
    )]
    TooLong {
        /// 1-based position of the item.
        index: usize,
        /// The level as written or formatted.
        item: String,
    },
    /// The same level twice.
    #[error("level #{index} `{item}` appears twice; every level must be distinct")]
    Duplicate {
        /// 1-based position of the second occurrence.
        index: usize,
        /// The level as written or formatted.
        item: String,
    },
    /// A level shorter than the one before it.
    #[error(
        "level #{index} `{item}` is shorter than the level before it (`{previous}`); list levels in ascending order"
    )]
    Unsorted {
        /// 1-based position of the item.
        index: usize,
        /// The level as written or formatted.
        item: String,
        /// The level before it.
        previous: String,
    },
    /// A preset name that does not exist.
    #[error("unknown ladder preset `{0}`; presets are: default, rocketmq, binary")]
    UnknownPreset(String),
}

/// A sorted, duplicate-free, non-empty set of delay levels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ladder {
    levels: Vec<Duration>,
}

/// The names [`Ladder::preset`] accepts.
pub const PRESETS: [&str; 3] = ["default", "rocketmq", "binary"];

impl Ladder {
    /// Validates levels given in ascending order.
    pub fn new(levels: Vec<Duration>) -> Result<Self, LadderError> {
        if levels.is_empty() {
            return Err(LadderError::Empty);
        }
        for (i, level) in levels.iter().enumerate() {
            let index = i + 1;
            let item = format_duration(*level);
            if level.is_zero() {
                return Err(LadderError::Zero { index, item });
            }
            if level.subsec_nanos() % 1_000_000 != 0 {
                return Err(LadderError::SubMillisecond { index, item });
            }
            if *level > MAX_LEVEL {
                return Err(LadderError::TooLong { index, item });
            }
            if i > 0 {
                let previous = levels[i - 1];
                if *level == previous {
                    return Err(LadderError::Duplicate { index, item });
                }
                if *level < previous {
                    return Err(LadderError::Unsorted {
                        index,
                        item,
                        previous: format_duration(previous),
                    });
                }
            }
        }
        Ok(Self { levels })
    }

    /// Parses a preset name or a list of levels separated by spaces or commas
    /// (`"1s 5s 1m30s 2h"`). Errors name the offending item as written.
    pub fn parse(text: &str) -> Result<Self, LadderError> {
        let trimmed = text.trim();
        if PRESETS.contains(&trimmed) {
            return Self::preset(trimmed);
        }
        let items: Vec<&str> = trimmed
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|s| !s.is_empty())
            .collect();
        let mut levels = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let level = parse_duration(item).map_err(|reason| LadderError::BadDuration {
                index: i + 1,
                item: item.to_string(),
                reason,
            })?;
            levels.push(level);
        }
        // Validate, then report errors with the item exactly as the user wrote it.
        Self::new(levels).map_err(|e| e.with_written_item(&items))
    }

    /// A named preset: `default`, `rocketmq` or `binary`.
    pub fn preset(name: &str) -> Result<Self, LadderError> {
        match name {
            "default" => Ok(Self::default_ladder()),
            "rocketmq" => Ok(Self::rocketmq()),
            "binary" => Ok(Self::binary()),
            other => Err(LadderError::UnknownPreset(other.to_string())),
        }
    }

    /// RocketMQ's 18 fixed levels: 1s 5s 10s 30s 1m 2m … 10m 20m 30m 1h 2h.
    pub fn rocketmq() -> Self {
        let secs = [
            1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200,
        ];
        Self {
            levels: secs.iter().map(|s| Duration::from_secs(*s)).collect(),
        }
    }

    /// Powers of two seconds, 1 s to 2^22 s (48.5 days, the largest power of two under the
    /// broker's TTL limit): the NServiceBus-style tiers.
    pub fn binary() -> Self {
        Self {
            levels: (0..=22).map(|p| Duration::from_secs(1 << p)).collect(),
        }
    }

    /// The default "clock" ladder: every whole second below a minute, every minute below an
    /// hour, every hour below a day, and every day up to 48 days (189 levels).
    ///
    /// Chosen by measurement (`delay-bridge ladders`, and the table in docs/architecture.md): a delay
    /// costs at most one hop per clock unit, so the mean is under 4 hops over [1 s, 30 d],
    /// where `binary` needs about 11 and `rocketmq` hundreds.
    pub fn default_ladder() -> Self {
        let mut levels = Vec::with_capacity(189);
        levels.extend((1..60).map(Duration::from_secs));
        levels.extend((1..60).map(|m| Duration::from_secs(m * 60)));
        levels.extend((1..24).map(|h| Duration::from_secs(h * 3600)));
        levels.extend((1..=48).map(|d| Duration::from_secs(d * 86_400)));
        Self { levels }
    }

    /// This ladder with the fine levels of a hop window added below its smallest level:
    /// `window`, twice `window`, four times... while shorter than the smallest level.
    ///
    /// With bundled hops, a bundle that comes back from a level is held until its last
    /// message is delivered, and a crash before then delivers the ones already delivered
    /// again. After the last hop of a ladder whose smallest gap is 1 s, a bundle's messages
    /// are due up to 1 s apart; fine levels take them on in steps that halve the rest, so
    /// that the last bundle's messages are due within about one window of each other.
    /// Adding them again changes nothing.
    pub fn with_fine_levels(&self, window: Duration) -> Self {
        let mut fine = Vec::new();
        let mut level = window;
        while !window.is_zero() && level < self.smallest() {
            fine.push(level);
            level *= 2;
        }
        fine.extend_from_slice(&self.levels);
        Self { levels: fine }
    }

    /// The levels, ascending.
    pub fn levels(&self) -> &[Duration] {
        &self.levels
    }

    /// The shortest level.
    pub fn smallest(&self) -> Duration {
        self.levels[0]
    }

    /// The longest level.
    pub fn largest(&self) -> Duration {
        self.levels[self.levels.len() - 1]
    }

    /// The largest level that is `<= budget`, if any.
    pub fn largest_at_most(&self, budget: Duration) -> Option<Duration> {
        let idx = self.levels.partition_point(|l| *l <= budget);
        idx.checked_sub(1).map(|i| self.levels[i])
    }

    /// The most hops any delay up to `max_delay` can take under this ladder and `margin`
    /// (computed exactly, not sampled).
    pub fn worst_case_hops(&self, max_delay: Duration, margin: Duration) -> u64 {
        let Some(budget) = max_delay.checked_sub(margin) else {
            return 0;
        };
        let budget_ms = budget.as_millis() as u64;
        let levels_ms: Vec<u64> = self.levels.iter().map(|l| l.as_millis() as u64).collect();
        let top = *levels_ms.last().expect("ladder is never empty");
        // Greedy takes the top level while it fits: k top hops, then the remainder x < top
        // is planned with the lower levels only. The worst case is either k top hops with
        // a remainder up to budget mod top, or k−1 top hops with any remainder below top.
        let k = budget_ms / top;
        let mut memo = std::collections::HashMap::new();
        let mut worst = k + max_residual_hops(&levels_ms, budget_ms % top, &mut memo);
        if k > 0 {
            worst = worst.max(k - 1 + max_residual_hops(&levels_ms, top - 1, &mut memo));
        }
        worst
    }
}

/// The most greedy hops any residual in `[0, limit]` ms takes, where each hop subtracts the
/// largest level `<= residual`. Memoised on `limit`; recursion only ever descends to lower
/// levels, so its depth is bounded by the number of levels, not the number of hops.
fn max_residual_hops(
    levels: &[u64],
    limit: u64,
    memo: &mut std::collections::HashMap<u64, u64>,
) -> u64 {
    if let Some(v) = memo.get(&limit) {
        return *v;
    }
    let mut best = 0;
    // A residual x in [levels[i], next_i) takes levels[i] q = x / levels[i] times in a row
    // (what is left stays below next_i), then plans x mod levels[i] with the lower levels.
    // Over [levels[i], upper] the most is either the largest q with a remainder up to
    // upper mod levels[i], or one fewer with any remainder below levels[i].
    for (i, level) in levels.iter().enumerate() {
        if *level > limit {
            break;
        }
        let upper = match levels.get(i + 1) {
            Some(next) => limit.min(next - 1),
            None => limit,
        };
        let q = upper / level;
        let mut here = q + max_residual_hops(levels, upper % level, memo);
        if q > 1 {
            here = here.max(q - 1 + max_residual_hops(levels, level - 1, memo));
        }
        best = best.max(here);
    }
    memo.insert(limit, best);
    best
}

impl LadderError {
    /// Replaces the formatted item with the text the user wrote at that position.
    fn with_written_item(self, written: &[&str]) -> Self {
        let pick = |index: usize, fallback: String| {
            written
                .get(index - 1)
                .map(|s| s.to_string())
                .unwrap_or(fallback)
        };
        match self {
            LadderError::Zero { index, item } => LadderError::Zero {
                index,
                item: pick(index, item),
            },
            LadderError::SubMillisecond { index, item } => LadderError::SubMillisecond {
                index,
                item: pick(index, item),
            },
            LadderError::TooLong { index, item } => LadderError::TooLong {
                index,
                item: pick(index, item),
            },
            LadderError::Duplicate { index, item } => LadderError::Duplicate {
                index,
                item: pick(index, item),
            },
            LadderError::Unsorted {
                index,
                item,
                previous,
            } => LadderError::Unsorted {
                index,
                item: pick(index, item),
                previous: pick(index - 1, previous),
            },
            other => other,
        }
    }
}

impl fmt::Display for Ladder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.levels.iter().map(|l| format_duration(*l)).collect();
        f.write_str(&parts.join(" "))
    }
}

/// Parses one duration such as `1500ms`, `90s`, `1m30s`, `2h` or `40d` (humantime syntax).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| e.to_string())
}

/// Formats a duration compactly, without spaces: `1d2h`, `1m30s`, `1s500ms`, `0ms`.
/// Used in queue names and in plan output; sub-millisecond parts are dropped.
pub fn format_duration(d: Duration) -> String {
    let mut ms = d.as_millis();
    if ms == 0 {
        return "0ms".to_string();
    }
    let mut out = String::new();
    for (unit, size) in [
        ("d", 86_400_000u128),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= size {
            out.push_str(&format!("{}{unit}", ms / size));
            ms %= size;
        }
    }
    if ms > 0 {
        out.push_str(&format!("{ms}ms"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Step, plan};

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn parses_levels_and_presets() {
        let ladder = Ladder::parse("1s 5s, 1m30s 2h").unwrap();
        assert_eq!(ladder.levels(), &[s(1), s(5), s(90), s(7200)]);
        assert_eq!(Ladder::parse("rocketmq").unwrap(), Ladder::rocketmq());
        assert_eq!(Ladder::parse(" binary ").unwrap(), Ladder::binary());
        assert_eq!(Ladder::parse("default").unwrap(), Ladder::default_ladder());
    }

    #[test]
    fn fine_levels_halve_down_to_the_window_below_the_smallest_level() {
        let ms = Duration::from_millis;
        let ladder = Ladder::parse("1s 5s").unwrap();
        let fine = ladder.with_fine_levels(ms(100));
        assert_eq!(
            fine.levels(),
            &[ms(100), ms(200), ms(400), ms(800), ms(1000), ms(5000)]
        );
        assert_eq!(
            fine.with_fine_levels(ms(100)),
            fine,
            "adding them again changes nothing"
        );
        assert_eq!(ladder.with_fine_levels(ms(1000)), ladder);
        assert_eq!(ladder.with_fine_levels(Duration::ZERO), ladder);
        assert_eq!(
            Ladder::parse("100ms 200ms")
                .unwrap()
                .with_fine_levels(ms(100)),
            Ladder::parse("100ms 200ms").unwrap()
        );
        // Still a valid ladder: ascending, whole milliseconds.
        assert_eq!(Ladder::new(fine.levels().to_vec()).unwrap(), fine);
    }

    #[test]
    fn rejects_bad_ladders_naming_the_item() {
        let cases: &[(&str, LadderError)] = &[
            ("", LadderError::Empty),
            (" , ", LadderError::Empty),
            (
                "1s 0s 5s",
                LadderError::Zero {
                    index: 2,
                    item: "0s".into(),
                },
            ),
            (
                "1s 5s 5000ms",
                LadderError::Duplicate {
                    index: 3,
                    item: "5000ms".into(),
                },
            ),
            (
                "1s 1m 30s",
                LadderError::Unsorted {
                    index: 3,
                    item: "30s".into(),
                    previous: "1m".into(),
                },
            ),
            (
                "1s 60d",
                LadderError::TooLong {
                    index: 2,
                    item: "60d".into(),
                },
            ),
            (
                "1s 1500us",
                LadderError::SubMillisecond {
                    index: 2,
                    item: "1500us".into(),
                },
            ),
            (
                "2500us 1s",
                LadderError::SubMillisecond {
                    index: 1,
                    item: "2500us".into(),
                },
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(
                Ladder::parse(text).unwrap_err(),
                *expected,
                "input {text:?}"
            );
        }
        match Ladder::parse("1s five 2h").unwrap_err() {
            LadderError::BadDuration { index, item, .. } => {
                assert_eq!((index, item.as_str()), (2, "five"))
            }
            other => panic!("unexpected {other:?}"),
        }
        let message = Ladder::parse("1s 1m 30s").unwrap_err().to_string();
        assert!(
            message.contains("`30s`") && message.contains("`1m`"),
            "{message}"
        );
    }

    #[test]
    fn presets_are_valid_ladders() {
        for name in PRESETS {
            let ladder = Ladder::preset(name).unwrap();
            Ladder::new(ladder.levels().to_vec()).unwrap();
        }
        assert_eq!(Ladder::rocketmq().levels().len(), 18);
        assert_eq!(Ladder::default_ladder().levels().len(), 189);
        assert_eq!(Ladder::binary().largest(), s(1 << 22));
        assert!(Ladder::preset("fast").is_err());
    }

    #[test]
    fn largest_at_most_picks_the_fitting_level() {
        let ladder = Ladder::parse("1s 5s 10s").unwrap();
        assert_eq!(ladder.largest_at_most(Duration::from_millis(999)), None);
        assert_eq!(ladder.largest_at_most(s(1)), Some(s(1)));
        assert_eq!(ladder.largest_at_most(s(9)), Some(s(5)));
        assert_eq!(ladder.largest_at_most(s(100)), Some(s(10)));
    }

    #[test]
    fn formats_compactly() {
        assert_eq!(format_duration(s(90)), "1m30s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1s500ms");
        assert_eq!(format_duration(s(86_400 + 7200)), "1d2h");
        assert_eq!(format_duration(Duration::ZERO), "0ms");
    }

    /// Brute force over every millisecond residual of a small ladder agrees with the
    /// closed-form worst case.
    #[test]
    fn worst_case_matches_brute_force() {
        for text in [
            "3ms 7ms 10ms",
            "2ms 3ms",
            "5ms",
            "1ms 4ms 9ms 25ms",
            "1ms 2ms 60ms",
            "2ms 7ms 30ms 31ms",
        ] {
            let ladder = Ladder::parse(text).unwrap();
            for margin_ms in [0u64, 1, 2] {
                let margin = Duration::from_millis(margin_ms);
                for max_ms in [0u64, 1, 13, 40, 97] {
                    let max = Duration::from_millis(max_ms);
                    let brute = (0..=max_ms)
                        .map(|d| {
                            plan(Duration::from_millis(d), &ladder, margin)
                                .iter()
                                .filter(|s| matches!(s, Step::Hop(_)))
                                .count() as u64
                        })
                        .max()
                        .unwrap();
                    assert_eq!(
                        ladder.worst_case_hops(max, margin),
                        brute,
                        "{text} margin {margin_ms} max {max_ms}"
                    );
                }
            }
        }
    }

    #[test]
    fn worst_case_of_a_ladder_with_a_wide_gap_needs_no_deep_stack() {
        // Between 1 ms and 4 999 s the greedy plan repeats the 1 ms level millions of times;
        // counting those hops must not recurse once per hop.
        let ladder = Ladder::parse("1ms 4999s").unwrap();
        let worst = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || ladder.worst_case_hops(Duration::from_secs(5_000), Duration::ZERO))
            .unwrap()
            .join()
            .expect("no stack overflow");
        // one hop short of a full top level, all in 1 ms hops
        assert_eq!(worst, 4_998_999);
    }
}
