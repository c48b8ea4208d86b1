//! Rates, durations and limits on the command line: each must be a finite number above 0,
//! checked when the command line is read, so that none reaches a division or a `Duration`.

/// Parses `text` as a number that is finite and above 0 (a clap `value_parser`).
pub fn above_zero(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value.is_finite() && value > 0.0 => Ok(value),
        Ok(_) => Err("must be a finite number above 0".into()),
        Err(e) => Err(format!("{e}: must be a finite number above 0")),
    }
}

#[cfg(test)]
mod tests {
    use super::above_zero;

    #[test]
    fn only_finite_numbers_above_zero_pass() {
        assert_eq!(above_zero("2000"), Ok(2000.0));
        assert_eq!(above_zero("0.1"), Ok(0.1));
        for refused in ["0", "-0", "-1", "NaN", "inf", "-inf", "", "fast"] {
            assert!(above_zero(refused).is_err(), "{refused:?} is refused");
        }
    }
}
