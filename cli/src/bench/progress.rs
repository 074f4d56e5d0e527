//! Progress of a benchmark run on stderr: an indicatif bar when stderr is
//! a terminal, nothing otherwise (logs and pipes get the results only).
#![forbid(unsafe_code)]

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar of `total` steps; [`Progress::step`] names the step starting now.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// Drawn on stderr when it is a terminal, hidden otherwise.
    pub fn new(total: usize) -> Progress {
        let target =
            if std::io::stderr().is_terminal() { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
        Self::with_target(total, target)
    }

    /// Never drawn (tests, and ranks other than the reporting one).
    pub fn hidden(total: usize) -> Progress {
        Self::with_target(total, ProgressDrawTarget::hidden())
    }

    fn with_target(total: usize, target: ProgressDrawTarget) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total as u64), target);
        if let Ok(style) = ProgressStyle::with_template("[{bar:30}] {pos}/{len} {elapsed:>4} {wide_msg}") {
            bar.set_style(style.progress_chars("#>-"));
        }
        Progress { bar }
    }

    /// Announces the step that starts now (and counts it).
    pub fn step(&self, what: &str) {
        self.bar.set_message(what.to_string());
        self.bar.inc(1);
    }

    /// Steps announced so far.
    pub fn position(&self) -> u64 {
        self.bar.position()
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Steps of an in-process run: one per (size, selection) and per size for
/// NCCL, two for the verify pass (ours and NCCL's), three for the
/// efficiency scenario, one for the launch floor.
pub fn total_steps(sizes: usize, selections: usize, nccl: bool, scenarios: &super::Scenarios) -> usize {
    sizes * (selections + nccl as usize)
        + if scenarios.verify_pass { 1 + nccl as usize } else { 0 }
        + if scenarios.efficiency { 3 } else { 0 }
        + scenarios.launch_floor as usize
        // In one process: fused, ours + separate, allreduce; their verify passes.
        + if scenarios.fused.is_some() { 3 + 2 * scenarios.verify_pass as usize } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Scenarios;

    #[test]
    fn steps_are_counted() {
        let p = Progress::hidden(3);
        p.step("1 KB auto");
        p.step("1 KB nccl");
        assert_eq!(p.position(), 2);
        p.finish();
    }

    #[test]
    fn total_counts_every_row_and_scenario() {
        let none = Scenarios::default();
        assert_eq!(total_steps(18, 2, true, &none), 54);
        assert_eq!(total_steps(18, 2, false, &none), 36);
        let all = Scenarios { verify_pass: true, efficiency: true, launch_floor: true, fused: Some((3, 7168)) };
        assert_eq!(total_steps(1, 1, true, &all), 2 + 2 + 3 + 1 + 5);
        assert_eq!(total_steps(1, 1, false, &all), 1 + 1 + 3 + 1 + 5);
    }
}
