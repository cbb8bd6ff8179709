//! Durations on the command line. Every duration flag takes a humantime duration (`500ms`,
//! `30s`, `2m`, `1h 30m`), so units are written, not implied by a flag's name; a bare number
//! still means what it meant before the flag took units (milliseconds for the flags that
//! were `*-ms`, seconds for `--recovery-interval`), so existing scripts and units keep
//! working.

use std::time::Duration;

/// A duration flag's value that is not a duration: the text and what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a duration ({reason}): write it with a unit (500ms, 30s, 2m) or as a bare number of {bare_unit}")]
pub struct InvalidDuration {
    text: String,
    reason: String,
    bare_unit: &'static str,
}

/// A duration whose bare number is milliseconds (the flags once spelled `*-ms`).
pub fn millis_or_humantime(text: &str) -> Result<Duration, InvalidDuration> {
    parse(text, Duration::from_millis, "milliseconds")
}

/// A duration whose bare number is seconds (`--recovery-interval`).
pub fn seconds_or_humantime(text: &str) -> Result<Duration, InvalidDuration> {
    parse(text, Duration::from_secs, "seconds")
}

/// Whole milliseconds as the retry policy counts them, at least 1 (a zero wait would
/// retry in a busy loop) and at most `i64::MAX`.
pub fn whole_millis_at_least_one(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

fn parse(
    text: &str,
    bare: fn(u64) -> Duration,
    bare_unit: &'static str,
) -> Result<Duration, InvalidDuration> {
    let text = text.trim();
    if let Ok(number) = text.parse::<u64>() {
        return Ok(bare(number));
    }
    humantime::parse_duration(text).map_err(|e| InvalidDuration {
        text: text.to_string(),
        reason: e.to_string(),
        bare_unit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_with_units_is_read_whatever_the_flag() {
        // Given / when / then: humantime spellings mean the same on every flag.
        for parse in [millis_or_humantime, seconds_or_humantime] {
            assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
            assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
            assert_eq!(parse("1m 30s"), Ok(Duration::from_secs(90)));
        }
    }

    #[test]
    fn a_bare_number_keeps_the_unit_the_flag_had() {
        // Given: the old spellings `--min-position-wait-ms 2000`, `--recovery-interval 60`.
        // When / then: they mean 2 s and 60 s, as before.
        assert_eq!(millis_or_humantime("2000"), Ok(Duration::from_secs(2)));
        assert_eq!(seconds_or_humantime("60"), Ok(Duration::from_secs(60)));
        assert_eq!(seconds_or_humantime("0"), Ok(Duration::ZERO));
    }

    #[test]
    fn anything_else_is_refused_saying_how_to_write_it() {
        // Given: a unit humantime does not know, a negative number, nothing.
        for text in ["5x", "-5", ""] {
            // When / then: refused, with the accepted spellings.
            let error = millis_or_humantime(text).unwrap_err().to_string();
            assert!(error.contains("500ms, 30s, 2m"), "{error}");
        }
    }

    #[test]
    fn the_retry_policy_gets_at_least_one_millisecond() {
        assert_eq!(whole_millis_at_least_one(Duration::ZERO), 1);
        assert_eq!(whole_millis_at_least_one(Duration::from_millis(1500)), 1500);
        assert_eq!(whole_millis_at_least_one(Duration::MAX), i64::MAX);
    }
}
