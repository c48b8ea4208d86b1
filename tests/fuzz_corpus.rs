//! The fuzz corpus replayed on stable, without libFuzzer and without a broker: every file
//! of `fuzz/corpus/<target>/` goes through that target's check (`fuzz/checks.rs`, the same
//! code the fuzz targets run), and so do the seeds the corpus started from. A check panics
//! on a wrong answer; a file that fails is named. See `fuzz/README.md`.

#[allow(dead_code)]
#[path = "../fuzz/checks.rs"]
mod checks;

use std::path::{Path, PathBuf};

/// The stack each replay runs on: the AMQP parser recurses once per level of a header
/// table, and a corpus file may nest as deep as the fuzzer's largest input (the bridge runs
/// its threads on 256 MiB for the same reason).
const STACK_BYTES: usize = 256 << 20;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// Runs `check` over `input` on a big stack; the panic's message if it fails.
fn replay(check: checks::Check, input: Vec<u8>) -> Result<(), String> {
    std::thread::Builder::new()
        .stack_size(STACK_BYTES)
        .spawn(move || check(&input))
        .expect("a replay thread starts")
        .join()
        .map_err(|panic| {
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".into())
        })
}

#[test]
fn every_corpus_file_passes_its_targets_check() {
    let mut failures = Vec::new();
    for (target, check) in checks::TARGETS {
        let dir = corpus_dir(target);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|path| path.is_file())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{} holds no corpus", dir.display());
        for file in files {
            let input = std::fs::read(&file).expect("a corpus file reads");
            if let Err(why) = replay(check, input) {
                failures.push(format!("{}: {why}", file.display()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "failing corpus files:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_seeds_pass_their_targets_check() {
    let seeds = checks::seeds();
    for (target, _) in checks::TARGETS {
        assert!(
            seeds.iter().any(|(t, _)| *t == target),
            "no seed for {target}"
        );
    }
    for (target, input) in seeds {
        let (_, check) = checks::TARGETS
            .into_iter()
            .find(|(name, _)| *name == target)
            .expect("a seed of a known target");
        if let Err(why) = replay(check, input.clone()) {
            panic!("a {target} seed fails ({why}): {input:?}");
        }
    }
}

/// Writes the seeds into the corpus directories (`seed-<target>-<n>`), to start fuzzing
/// from; `cargo fuzz cmin` then keeps those that add coverage. Run by hand:
/// `cargo test --test fuzz_corpus -- --ignored write_seeds`.
#[test]
#[ignore = "writes files: run by hand to seed the corpus"]
fn write_seeds() {
    for (n, (target, input)) in checks::seeds().into_iter().enumerate() {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).expect("the corpus directory");
        std::fs::write(dir.join(format!("seed-{target}-{n}")), input).expect("a seed written");
    }
}
