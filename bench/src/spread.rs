//! `delay-bridge-bench spread REPORT...`: the spread of several runs of one scenario. Each
//! report is a scenario's saved output, whose last line is its JSON object; every number in
//! it (nested objects flattened to dotted names; lists left out) is shown as min / median /
//! max over the runs, and every target as the runs that met it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use serde_json::Value;

/// `bench spread` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Saved outputs of the same scenario, one per run.
    #[arg(required = true)]
    reports: Vec<PathBuf>,
}

/// Every number of a JSON object under its dotted path.
fn numbers(value: &Value, path: &str, out: &mut BTreeMap<String, Vec<f64>>) {
    match value {
        Value::Number(n) => {
            if let Some(n) = n.as_f64() {
                out.entry(path.to_string()).or_default().push(n);
            }
        }
        Value::Object(fields) => {
            for (key, value) in fields {
                let path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                numbers(value, &path, out);
            }
        }
        _ => {}
    }
}

/// Min, median and max of some values (the median of an even count is the lower middle).
fn spread(values: &mut [f64]) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (
        values[0],
        values[(values.len() - 1) / 2],
        values[values.len() - 1],
    )
}

/// Shows a number with as few decimals as it needs, up to three.
fn show(n: f64) -> String {
    let text = format!("{n:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Reads the reports and prints the spread.
pub fn run(args: &Args) -> Result<()> {
    let mut figures = BTreeMap::new();
    let mut targets: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut scenario = String::new();
    for path in &args.reports {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let last = text
            .lines()
            .rev()
            .find(|line| line.starts_with('{'))
            .with_context(|| format!("{} has no JSON report line", path.display()))?;
        let report: Value = serde_json::from_str(last)
            .with_context(|| format!("{}: the report line is not JSON", path.display()))?;
        if let Some(name) = report.get("scenario").and_then(Value::as_str) {
            scenario = name.to_string();
        }
        numbers(&report, "", &mut figures);
        for target in report
            .get("targets")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let field = |key: &str| {
                target
                    .get(key)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            targets
                .entry(field("target"))
                .or_default()
                .push((field("verdict"), field("measured")));
        }
    }
    let runs = args.reports.len();
    println!("{scenario}: {runs} runs, min / median / max");
    for (name, values) in &mut figures {
        let (min, median, max) = spread(values);
        let partial = if values.len() < runs {
            format!(" ({} of {runs} runs)", values.len())
        } else {
            String::new()
        };
        println!(
            "  {name:<48} {} / {} / {}{partial}",
            show(min),
            show(median),
            show(max)
        );
    }
    if !targets.is_empty() {
        println!("targets:");
    }
    for (name, verdicts) in &targets {
        let passed = verdicts.iter().filter(|(v, _)| v == "PASS").count();
        let verdict = if passed == runs { "PASS" } else { "MISS" };
        let measured: Vec<&str> = verdicts.iter().map(|(_, m)| m.as_str()).collect();
        println!(
            "  {verdict}  {name:<48} in {passed} of {runs} runs: {}",
            measured.join(" | ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_numbers_are_flattened_and_lists_left_out() {
        let report = serde_json::json!({
            "a": 1, "b": {"c": 2.5, "d": "text"}, "runs": [{"x": 1}],
        });
        let mut out = BTreeMap::new();
        numbers(&report, "", &mut out);
        assert_eq!(
            out.into_iter().collect::<Vec<_>>(),
            vec![("a".to_string(), vec![1.0]), ("b.c".to_string(), vec![2.5])]
        );
    }

    #[test]
    fn the_spread_of_three_runs_is_their_min_median_and_max() {
        assert_eq!(spread(&mut [3.0, 1.0, 2.0]), (1.0, 2.0, 3.0));
        assert_eq!(spread(&mut [4.0, 1.0]), (1.0, 1.0, 4.0));
    }
}
