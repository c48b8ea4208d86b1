//! How the command prints an error: the error, then each cause that says something new.

/// `error` and its causes, one per line (a cause's own further lines indented under it).
/// A cause whose words the line before already
/// carries is left out: the library's errors name their source in their own message, so
/// the plain chain says the same thing two or three times.
pub fn error_report(error: &anyhow::Error) -> String {
    let mut report = error.to_string();
    let mut last = report.clone();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !last.contains(&text) {
            report.push_str("\n  caused by: ");
            report.push_str(&text.replace('\n', "\n    "));
        }
        last = text;
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn not_found() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "no such file")
    }

    #[test]
    fn a_cause_the_line_before_already_names_is_left_out() {
        let error = anyhow::Error::new(not_found())
            .context("cannot read config file x.toml: no such file")
            .context("invalid configuration x.toml");
        assert_eq!(
            error_report(&error),
            "invalid configuration x.toml\n  caused by: cannot read config file x.toml: no such file"
        );
    }

    #[test]
    fn a_cause_with_words_of_its_own_is_kept() {
        let error = anyhow::Error::new(not_found()).context("reading the status");
        assert_eq!(
            error_report(&error),
            "reading the status\n  caused by: no such file"
        );
    }

    #[test]
    fn the_further_lines_of_a_cause_are_indented_under_it() {
        let error = anyhow::anyhow!("line 3\nunknown field").context("invalid configuration");
        assert_eq!(
            error_report(&error),
            "invalid configuration\n  caused by: line 3\n    unknown field"
        );
    }

    #[test]
    fn an_error_without_a_cause_is_one_line() {
        assert_eq!(
            error_report(&anyhow::anyhow!("--max must be at least 1s")),
            "--max must be at least 1s"
        );
    }
}
