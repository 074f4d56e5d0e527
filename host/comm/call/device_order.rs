//! The launch order between communicators that share a GPU in this
//! process ([`DeviceTurn`]).
//!
//! A collective's kernels wait for their peers' kernels: every block of every
//! rank must be running at once, and a communicator sizes its grids so that
//! its own ranks on a GPU fit there together (`ResidentBlocks`). Two
//! communicators whose calls are in flight on one GPU at the same time do
//! not fit: group A's kernels hold SMs while they wait for A's rank whose
//! kernel cannot start, because group B's kernels hold the rest while they
//! wait for B's. On one GPU shared by both groups' ranks that is a deadlock;
//! across GPUs too (A waits on GPU 0 for GPU 1, where B holds the SMs
//! waiting for GPU 0).
//!
//! So eager calls of different communicators on one device are issued in
//! turns, as NCCL's implicit launch order does: the device belongs to one
//! communicator at a time. A call of communicator G takes the device from
//! communicator H once every rank of H on this device in this process has
//! issued the same number of calls (H's call is complete on the host: none
//! of its ranks' kernels is still to be queued); G's ranks then make their
//! streams wait for H's last launches (one event per rank of H, recorded
//! right after its launches) before their first launch of the turn. Calls
//! of one communicator are not ordered here (its grids fit together; a
//! rank's own calls are ordered by `order.rs`).
//!
//! Turns block on the host only when ranks of several communicators share a
//! GPU *in one process* and one communicator's call has been issued on some
//! of its ranks but not yet all: the host waits (bounded by the launch
//! timeout) for the rest. With one rank per GPU per communicator (an engine:
//! one process per GPU, several groups) a call never waits on the host.
//!
//! Not ordered here (the caller's to order, as with NCCL): captured calls
//! (a graph orders the calls captured on one stream; graphs of different
//! communicators replayed concurrently on one GPU must be ordered by the
//! caller), and communicators of other processes on the same GPU.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};

use crate::driver::Event;
use crate::error::{Error, Result};

/// A rank's place in its device's turns: registered at construction,
/// removed when dropped.
pub(crate) struct DeviceTurn {
    device: Arc<DeviceTurns>,
    member: u64,
    /// Recorded on the call's stream right after each eager call's
    /// launches; what the next communicator's ranks wait for.
    event: Arc<Event>,
    timeout: Duration,
}

/// Every registered rank of one device (this process).
#[derive(Default)]
struct DeviceTurns {
    state: Mutex<TurnState>,
    changed: Condvar,
}

#[derive(Default)]
struct TurnState {
    members: HashMap<u64, Member>,
    /// The communicator whose calls were issued last, if any.
    owner: Option<usize>,
    /// The owner's previous owner's last launches, one event per rank
    /// (alive as long as a waiter may need them).
    handoff: Vec<Arc<Event>>,
}

struct Member {
    group: usize,
    /// Eager calls issued since registration.
    issued: u64,
    /// Whether the next call must wait for `handoff` first (set for every
    /// rank of a communicator when it takes the device).
    waits_for_handoff: bool,
    event: Arc<Event>,
}

impl TurnState {
    fn calls_issued(&self, group: usize) -> Vec<u64> {
        self.members.values().filter(|m| m.group == group).map(|m| m.issued).collect()
    }
}

/// Whether every rank of a communicator here has issued the same number of
/// calls (`issued`, one count per rank): none of its kernels is still to
/// be queued.
fn settled(issued: &[u64]) -> bool {
    issued.windows(2).all(|w| w[0] == w[1])
}

/// `(call, ranks behind, ranks)`: the newest call of a communicator's
/// ranks here, how many have not issued it yet, of how many.
fn progress(issued: &[u64]) -> (u64, usize, usize) {
    let newest = issued.iter().copied().max().unwrap_or(0);
    (newest, issued.iter().filter(|&&c| c < newest).count(), issued.len())
}

/// The process's devices, by CUDA device ordinal.
fn devices() -> &'static Mutex<HashMap<i32, Arc<DeviceTurns>>> {
    static DEVICES: OnceLock<Mutex<HashMap<i32, Arc<DeviceTurns>>>> = OnceLock::new();
    DEVICES.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding it cannot leave the state half-written (every
    // update is a single assignment or insertion): go on.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl DeviceTurn {
    /// Registers a rank of communicator `group` (an identity shared by the
    /// ranks of one communicator in this process) on `ctx`'s device.
    pub(crate) fn register(ctx: &Arc<CudaContext>, group: usize, timeout: Duration) -> Result<DeviceTurn> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let event = Arc::new(Event::new(ctx)?);
        let device = lock(devices()).entry(ctx.cu_device()).or_default().clone();
        let member = NEXT.fetch_add(1, Ordering::Relaxed);
        {
            let mut s = lock(&device.state);
            // A rank of a communicator that already has ranks here starts
            // where they are (construction is collective: they have issued
            // nothing yet, but keep the count consistent regardless).
            let issued = s.members.values().filter(|m| m.group == group).map(|m| m.issued).max().unwrap_or(0);
            s.members.insert(member, Member { group, issued, waits_for_handoff: false, event: event.clone() });
        }
        Ok(DeviceTurn { device, member, event, timeout })
    }

    /// Runs `launch` (an eager call's launches on `stream`) in this
    /// communicator's turn on the device: after every launch of the
    /// previous communicator's call, and records this rank's end.
    ///
    /// # Safety
    /// `stream` is a live, non-capturing stream of the rank's context.
    pub(crate) unsafe fn eager(&self, stream: sys::CUstream, launch: impl FnOnce() -> Result<()>) -> Result<()> {
        let started = Instant::now();
        let mut s = lock(&self.device.state);
        let group = match s.members.get(&self.member) {
            Some(m) => m.group,
            None => return Err(Error::Broken("device turn: this rank is not registered".into())),
        };
        loop {
            match s.owner {
                Some(owner) if owner != group => {
                    if settled(&s.calls_issued(owner)) {
                        // Take the device: every rank of this communicator
                        // waits for the owner's last launches first.
                        let handoff: Vec<Arc<Event>> =
                            s.members.values().filter(|m| m.group == owner).map(|m| m.event.clone()).collect();
                        for m in s.members.values_mut().filter(|m| m.group == group) {
                            m.waits_for_handoff = true;
                        }
                        s.handoff = handoff;
                        s.owner = Some(group);
                        break;
                    }
                    let waited = started.elapsed();
                    if waited >= self.timeout {
                        let (calls, behind, ranks) = progress(&s.calls_issued(owner));
                        return Err(Error::invalid(format!(
                            "a call waited {:.1} s for another communicator's call on this GPU to be issued on all \
                             of its ranks here ({behind} of its {ranks} ranks in this process have not issued call \
                             {calls} yet). Communicators sharing a GPU take turns (their kernels would hold the SMs \
                             each other's need): issue a call on every rank of one communicator before calling \
                             another one on the same GPU, e.g. one thread per rank",
                            waited.as_secs_f64()
                        )));
                    }
                    let (next, _) = self
                        .device
                        .changed
                        .wait_timeout(s, self.timeout - waited)
                        .unwrap_or_else(|e| e.into_inner());
                    s = next;
                }
                _ => {
                    s.owner = Some(group);
                    break;
                }
            }
        }
        let wait_first = s.members.get_mut(&self.member).map(|m| std::mem::take(&mut m.waits_for_handoff));
        let mut result = Ok(());
        if wait_first == Some(true) {
            for e in &s.handoff {
                // SAFETY: `stream` is live (contract); the event is alive
                // (held by the state) and of this device's context family.
                if let Err(err) = unsafe { e.wait(stream) } {
                    result = Err(err);
                    break;
                }
            }
        }
        // The launches run under the device's lock: a second communicator
        // cannot slip its launches in between the wait above and ours.
        let result = result.and_then(|()| launch());
        // SAFETY: as above.
        let recorded = unsafe { self.event.record(stream) };
        if let Some(m) = s.members.get_mut(&self.member) {
            m.issued += 1;
        }
        drop(s);
        self.device.changed.notify_all();
        result.and(recorded)
    }
}

impl Drop for DeviceTurn {
    fn drop(&mut self) {
        lock(&self.device.state).members.remove(&self.member);
        // A rank gone may settle its communicator for a waiter.
        self.device.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_communicator_is_settled_when_all_its_ranks_here_issued_equally() {
        assert!(settled(&[]), "no ranks: nothing to wait for");
        assert!(settled(&[3, 3, 3]));
        assert!(!settled(&[4, 3, 4]), "one rank is still to issue call 4");
        assert_eq!(progress(&[4, 3, 4]), (4, 1, 3));
        assert_eq!(progress(&[]), (0, 0, 0));
    }
}
