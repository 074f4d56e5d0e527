//! The tool's logger: the library's `log` records (measured `auto` saying
//! that it measures and what it chose, slower-path warnings) on stderr, one
//! line each. No logging crate: a filter of `target=level` rules and a
//! `log::Log` of a few lines.
//!
//! Default: INFO and above from `tp_allreduce` and `tp_allreduce_cli`,
//! WARN and above from anything else. `TP_ALLREDUCE_LOG` (else `RUST_LOG`)
//! replaces it, in `RUST_LOG`'s simple form: `debug`, `off`,
//! `tp_allreduce::comm=debug,warn` (the last bare level is the default; a
//! target rule covers that module path and everything under it; the
//! longest matching rule wins).
#![forbid(unsafe_code)]

use log::{Level, LevelFilter, Log, Metadata, Record};

/// The variable that sets the filter (`RUST_LOG` when it is unset).
pub const LOG_VAR: &str = "TP_ALLREDUCE_LOG";

/// Which records are written: a level per module-path prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    default: LevelFilter,
    rules: Vec<(String, LevelFilter)>,
}

impl Filter {
    /// INFO from the library and the tool, WARN from the rest.
    pub fn tool_default() -> Filter {
        Filter {
            default: LevelFilter::Warn,
            rules: vec![("tp_allreduce".into(), LevelFilter::Info), ("tp_allreduce_cli".into(), LevelFilter::Info)],
        }
    }

    /// Parses `level` / `target=level` items separated by `,`.
    pub fn parse(spec: &str) -> Result<Filter, String> {
        let level = |s: &str| {
            s.trim()
                .parse::<LevelFilter>()
                .map_err(|_| format!("{LOG_VAR}: `{}` is not a level (off, error, warn, info, debug, trace)", s.trim()))
        };
        let mut filter = Filter { default: LevelFilter::Warn, rules: Vec::new() };
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.split_once('=') {
                Some((target, l)) if !target.trim().is_empty() => {
                    filter.rules.push((target.trim().to_string(), level(l)?))
                }
                Some(_) => return Err(format!("{LOG_VAR}: `{item}` names no target")),
                None => filter.default = level(item)?,
            }
        }
        Ok(filter)
    }

    /// The filter the environment asks for: `TP_ALLREDUCE_LOG`, else
    /// `RUST_LOG`, else [`Filter::tool_default`].
    pub fn from_env() -> Result<Filter, String> {
        match std::env::var(LOG_VAR).or_else(|_| std::env::var("RUST_LOG")) {
            Ok(spec) if !spec.trim().is_empty() => Filter::parse(&spec),
            _ => Ok(Filter::tool_default()),
        }
    }

    /// The level for `target`: the longest rule naming it or a module above it.
    fn level_for(&self, target: &str) -> LevelFilter {
        let covers =
            |prefix: &str| target == prefix || target.strip_prefix(prefix).is_some_and(|rest| rest.starts_with("::"));
        self.rules
            .iter()
            .filter(|(prefix, _)| covers(prefix))
            .max_by_key(|(prefix, _)| prefix.len())
            .map_or(self.default, |(_, l)| *l)
    }

    pub fn enabled(&self, target: &str, level: Level) -> bool {
        level <= self.level_for(target)
    }

    /// The most verbose level any target gets (for `log::set_max_level`).
    pub fn max_level(&self) -> LevelFilter {
        self.rules.iter().map(|(_, l)| *l).chain([self.default]).max().unwrap_or(LevelFilter::Off)
    }
}

/// One record as the tool writes it: `tp-allreduce: INFO comm::measure: ...`
/// (the library's own prefix `tp_allreduce::` left out).
pub fn format_line(level: Level, target: &str, message: &std::fmt::Arguments<'_>) -> String {
    let target = target.strip_prefix("tp_allreduce::").unwrap_or(target);
    format!("tp-allreduce: {level} {target}: {message}\n")
}

struct StderrLogger(Filter);

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.0.enabled(metadata.target(), metadata.level())
    }

    fn log(&self, record: &Record<'_>) {
        if self.enabled(record.metadata()) {
            use std::io::Write as _;
            // One write per line, so lines of rank threads do not interleave;
            // a closed stderr is not worth failing over.
            let line = format_line(record.level(), record.target(), record.args());
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
        }
    }

    fn flush(&self) {}
}

/// Installs the stderr logger with the environment's filter. An unreadable
/// filter is an error for the user; a logger installed before is kept.
pub fn install() -> Result<(), String> {
    let filter = Filter::from_env()?;
    let max = filter.max_level();
    if log::set_boxed_logger(Box::new(StderrLogger(filter))).is_ok() {
        log::set_max_level(max);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_shows_the_librarys_info_lines_and_only_warnings_of_others() {
        let f = Filter::tool_default();
        assert!(f.enabled("tp_allreduce::comm::measure", Level::Info));
        assert!(f.enabled("tp_allreduce_cli::bench", Level::Info));
        assert!(!f.enabled("tp_allreduce::comm::measure", Level::Debug));
        assert!(!f.enabled("cudarc::driver", Level::Info));
        assert!(f.enabled("cudarc::driver", Level::Warn));
        assert!(!f.enabled("tp_allreduce_extra", Level::Info), "a rule covers module paths, not name prefixes");
        assert_eq!(f.max_level(), LevelFilter::Info);
    }

    #[test]
    fn a_spec_sets_levels_per_target_and_the_longest_rule_wins() {
        let f = Filter::parse("tp_allreduce=warn, tp_allreduce::comm=debug, error").unwrap();
        assert!(f.enabled("tp_allreduce::comm::measure", Level::Debug));
        assert!(!f.enabled("tp_allreduce::select", Level::Info));
        assert!(f.enabled("tp_allreduce::select", Level::Warn));
        assert!(!f.enabled("other", Level::Warn));
        assert_eq!(f.max_level(), LevelFilter::Debug);
        let off = Filter::parse("off").unwrap();
        assert!(!off.enabled("tp_allreduce::comm::measure", Level::Error));
        assert_eq!(off.max_level(), LevelFilter::Off);
        for bad in ["loud", "tp_allreduce=loud", "=info"] {
            let e = Filter::parse(bad).unwrap_err();
            assert!(e.contains(LOG_VAR), "{bad}: {e}");
        }
    }

    #[test]
    fn a_line_names_the_level_and_the_module() {
        let line = format_line(Level::Info, "tp_allreduce::comm::measure", &format_args!("measuring {} s", 15));
        assert_eq!(line, "tp-allreduce: INFO comm::measure: measuring 15 s\n");
        let line = format_line(Level::Warn, "other::x", &format_args!("w"));
        assert_eq!(line, "tp-allreduce: WARN other::x: w\n");
    }
}
