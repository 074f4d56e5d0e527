//! The host-side watchdog of a communicator with ranks in other processes
//! of this host (issue 13 item 13). Device-side waits on a peer that has
//! not shown the current call are bounded generously
//! (`Config::launch_timeout`, 60 s: the peer may still be compiling or
//! loading a model); a peer *process* that dies must not cost that bound.
//! So a thread checks every [`PERIOD`] that each peer process still exists
//! (its pid and start time, read from `/proc` at init, in the same pid
//! namespace); when one is gone it records `PeerExited` naming the rank in
//! this rank's error record and raises the rank's abort words, which every
//! waiting kernel polls: they stop within microseconds, and the next call
//! (or `check`/`synchronize`) returns the error.
//!
//! Peers in another pid namespace (a different container) are not
//! watched; their death is noticed by the launch bound.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use serde::{Deserialize, Serialize};
use tp_allreduce_kernels::ids::DeviceErrorCode;
use tp_allreduce_kernels::layout::ErrorRecord;

use crate::driver::{self, PinnedHostMemory};
use crate::error::Result;

/// How often the peers' processes are checked.
pub(crate) const PERIOD: Duration = Duration::from_millis(100);

/// Who a process is, as `/proc` tells: its pid, its pid namespace and its
/// start time (so a reused pid is not mistaken for the peer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ProcessIdentity {
    pub pid: u32,
    pub pid_namespace: u64,
    pub start_time: u64,
}

impl ProcessIdentity {
    /// This process, or `None` where `/proc` does not tell.
    pub(crate) fn of_self() -> Option<ProcessIdentity> {
        use std::os::unix::fs::MetadataExt;
        let pid = std::process::id();
        let pid_namespace = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
        Some(ProcessIdentity { pid, pid_namespace, start_time: start_time(pid)? })
    }

    /// Whether the process still runs (same pid, same start time).
    pub(crate) fn alive(&self) -> bool {
        start_time(self.pid) == Some(self.start_time)
    }
}

/// Field 22 of `/proc/<pid>/stat` (start time in clock ticks after boot).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

/// The start time of a `/proc/<pid>/stat` line: the command name (field 2)
/// may hold spaces and parentheses, so fields are counted after its last ')'.
pub(crate) fn parse_start_time(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Field 3 is the first after the name; field 22 is the 20th of those.
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// The peers to watch: ranks in another process of this pid namespace.
pub(crate) fn peers_to_watch(
    identities: &[Option<ProcessIdentity>],
    same_process: &[bool],
    mine: Option<ProcessIdentity>,
) -> Vec<(usize, ProcessIdentity)> {
    let Some(mine) = mine else { return Vec::new() };
    identities
        .iter()
        .enumerate()
        .filter(|(r, _)| !same_process.get(*r).copied().unwrap_or(true))
        .filter_map(|(r, id)| id.filter(|id| id.pid_namespace == mine.pid_namespace).map(|id| (r, id)))
        .collect()
}

/// What the watchdog raises when a peer is gone.
pub(crate) struct AbortTargets {
    pub rank: usize,
    pub record: Arc<PinnedHostMemory>,
    /// Device addresses of this rank's `Control::error_claim`, `Control::abort`
    /// and peer-visible `SignalBlock::abort`.
    pub error_claim: u64,
    pub control_abort: u64,
    pub signal_abort: u64,
}

/// The running watchdog; stops (and joins its thread) when dropped.
pub(crate) struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching `peers` (nothing to watch: `None`).
    pub(crate) fn start(
        ctx: &Arc<CudaContext>,
        peers: Vec<(usize, ProcessIdentity)>,
        targets: AbortTargets,
    ) -> Result<Option<Watchdog>> {
        if peers.is_empty() {
            return Ok(None);
        }
        // Created here, outside any capture: a non-blocking stream of the
        // rank's context for the abort writes.
        let stream = ctx.new_stream().map_err(|e| crate::error::driver("cuStreamCreate", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("tp-allreduce-watchdog-{}", targets.rank))
            .spawn(move || {
                let started = Instant::now();
                while !flag.load(Ordering::Acquire) {
                    if let Some(&(dead, _)) = peers.iter().find(|(_, id)| !id.alive()) {
                        // Best effort: a failure here leaves the launch bound.
                        let _ = raise(&stream, &targets, dead, started.elapsed());
                        return;
                    }
                    std::thread::sleep(PERIOD);
                }
            })
            .map_err(|e| crate::error::Error::invalid(format!("starting the watchdog thread: {e}")))?;
        Ok(Some(Watchdog { stop, thread: Some(thread) }))
    }
}

/// Records `PeerExited` for `dead` and raises this rank's abort words.
fn raise(stream: &Arc<cudarc::driver::CudaStream>, t: &AbortTargets, dead: usize, after: Duration) -> Result<()> {
    let code = DeviceErrorCode::PeerExited as u32;
    t.record.publish_error_record(&ErrorRecord {
        code,
        rank: t.rank as u32,
        peer: dead as u32,
        waited_ns: after.as_nanos().min(u64::MAX as u128) as u64,
        ..ErrorRecord::default()
    })?;
    // Claim the record first so no kernel overwrites it, then the aborts
    // every wait polls (own control word, peer-visible word).
    driver::write_u32_now(stream, t.error_claim, 1)?;
    driver::write_u32_now(stream, t.control_abort, code)?;
    driver::write_u32_now(stream, t.signal_abort, code)
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_is_field_22_even_with_odd_command_names() {
        let fields: Vec<String> = (3..=22).map(|f| f.to_string()).collect();
        for name in ["(bash)", "(a b) c)", "((x))"] {
            let line = format!("1234 {name} {}", fields.join(" "));
            assert_eq!(parse_start_time(&line), Some(22), "{line}");
        }
        assert_eq!(parse_start_time("1234 (short) 3 4"), None);
        assert_eq!(parse_start_time("garbage"), None);
    }

    #[test]
    fn this_process_is_alive_and_a_changed_start_time_is_not() {
        let me = ProcessIdentity::of_self().expect("/proc is readable on Linux");
        assert!(me.alive());
        assert!(!ProcessIdentity { start_time: me.start_time + 1, ..me }.alive());
        // A pid that does not exist (pid_max is at most 2^22).
        assert!(!ProcessIdentity { pid: 1 << 23, ..me }.alive());
    }

    #[test]
    fn only_other_processes_of_this_pid_namespace_are_watched() {
        let me = ProcessIdentity { pid: 10, pid_namespace: 1, start_time: 5 };
        let other = ProcessIdentity { pid: 11, ..me };
        let foreign = ProcessIdentity { pid: 12, pid_namespace: 2, start_time: 5 };
        let ids = [Some(me), Some(other), Some(foreign), None, Some(me)];
        let same = [true, false, false, false, true];
        assert_eq!(peers_to_watch(&ids, &same, Some(me)), vec![(1, other)]);
        assert!(peers_to_watch(&ids, &same, None).is_empty());
    }
}
