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
//! waiting for GPU 0). The turns below are per GPU: across GPUs they hold
//! when every rank issues the calls of different communicators in the same
//! order (NCCL's rule too); GPU 0 taking A then B while GPU 1 takes B then A
//! is a cycle no ordering on one GPU can break.
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

/// What a turn does with a rank's event: a CUDA event (`driver::Event`),
/// or in the CPU tests a stand-in that logs.
pub(crate) trait TurnEvent: Send + Sync {
    /// # Safety
    /// `stream` is a live stream of the event's device.
    unsafe fn record(&self, stream: sys::CUstream) -> Result<()>;
    /// # Safety
    /// As `record`.
    unsafe fn wait(&self, stream: sys::CUstream) -> Result<()>;
}

impl TurnEvent for Event {
    unsafe fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { Event::record(self, stream) }
    }
    unsafe fn wait(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { Event::wait(self, stream) }
    }
}

/// A rank's place in its device's turns: registered at construction,
/// removed when dropped.
pub(crate) struct DeviceTurn {
    device: Arc<DeviceTurns>,
    member: u64,
    /// Recorded on the call's stream right after each eager call's
    /// launches; what the next communicator's ranks wait for.
    event: Arc<dyn TurnEvent>,
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
    handoff: Vec<Arc<dyn TurnEvent>>,
}

struct Member {
    group: usize,
    /// Eager calls issued since registration.
    issued: u64,
    /// Whether the next call must wait for `handoff` first (set for every
    /// rank of a communicator when it takes the device).
    waits_for_handoff: bool,
    /// Between taking its turn and the end of its launches (the device's
    /// lock is not held meanwhile).
    launching: bool,
    event: Arc<dyn TurnEvent>,
}

impl TurnState {
    fn calls_issued(&self, group: usize) -> Vec<u64> {
        self.members.values().filter(|m| m.group == group).map(|m| m.issued).collect()
    }

    /// Whether `group` has nothing left to queue here: no rank launching,
    /// every rank at the same call.
    fn settled(&self, group: usize) -> bool {
        !self.members.values().any(|m| m.group == group && m.launching) && settled(&self.calls_issued(group))
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
        let event: Arc<dyn TurnEvent> = Arc::new(Event::new(ctx)?);
        Ok(Self::register_with(ctx.cu_device(), group, event, timeout))
    }

    /// [`register`](Self::register) on device `device` with `event`.
    fn register_with(device: i32, group: usize, event: Arc<dyn TurnEvent>, timeout: Duration) -> DeviceTurn {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let device = lock(devices()).entry(device).or_default().clone();
        let member = NEXT.fetch_add(1, Ordering::Relaxed);
        {
            let mut s = lock(&device.state);
            // A rank of a communicator that already has ranks here starts
            // where they are (construction is collective: they have issued
            // nothing yet, but keep the count consistent regardless).
            let issued = s.members.values().filter(|m| m.group == group).map(|m| m.issued).max().unwrap_or(0);
            s.members.insert(member, Member { group, issued, waits_for_handoff: false, launching: false, event: event.clone() });
        }
        DeviceTurn { device, member, event, timeout }
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
                    if s.settled(owner) {
                        // Take the device: every rank of this communicator
                        // waits for the owner's last launches first.
                        let handoff: Vec<Arc<dyn TurnEvent>> =
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
                        // Counted as issued (nothing launched): this
                        // communicator's ranks stay in step with each other.
                        if let Some(m) = s.members.get_mut(&self.member) {
                            m.issued += 1;
                        }
                        drop(s);
                        self.device.changed.notify_all();
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
        // This rank's turn. While it launches, its communicator is not
        // settled, so no other communicator takes the device; the lock is
        // released meanwhile (a launch may block on the host: a full launch
        // queue, NCCL connecting to its peers on a first call).
        let handoff = match s.members.get_mut(&self.member) {
            Some(m) => {
                m.launching = true;
                std::mem::take(&mut m.waits_for_handoff)
            }
            None => false,
        };
        let handoff: Vec<Arc<dyn TurnEvent>> = if handoff { s.handoff.clone() } else { Vec::new() };
        drop(s);
        let mut result = Ok(());
        for e in &handoff {
            // SAFETY: `stream` is live (contract); the event is alive (held
            // here) and of this device.
            if let Err(err) = unsafe { e.wait(stream) } {
                result = Err(err);
                break;
            }
        }
        let waited = result.is_ok();
        let result = result.and_then(|()| launch());
        // SAFETY: as above.
        let recorded = unsafe { self.event.record(stream) };
        let mut s = lock(&self.device.state);
        if let Some(m) = s.members.get_mut(&self.member) {
            m.launching = false;
            // Counted whatever happened: the ranks stay in step.
            m.issued += 1;
            // A failed wait is owed again by the next call.
            m.waits_for_handoff |= !handoff.is_empty() && !waited;
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

    /// A stand-in event: logs "<name> recorded" / "<stream> waits for
    /// <name>" (a stream is a number here) into a shared log.
    struct LoggedEvent {
        name: &'static str,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl TurnEvent for LoggedEvent {
        unsafe fn record(&self, stream: sys::CUstream) -> Result<()> {
            lock(&self.log).push(format!("{} recorded on {}", self.name, stream as usize));
            Ok(())
        }
        unsafe fn wait(&self, stream: sys::CUstream) -> Result<()> {
            lock(&self.log).push(format!("{} waits for {}", stream as usize, self.name));
            Ok(())
        }
    }

    /// A device key no other test uses (the registry is process-wide).
    fn fresh_device() -> i32 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        -(NEXT.fetch_add(1, Ordering::Relaxed) as i32) - 1000
    }

    fn rank(device: i32, group: usize, name: &'static str, log: &Arc<Mutex<Vec<String>>>, timeout_ms: u64) -> DeviceTurn {
        let event: Arc<dyn TurnEvent> = Arc::new(LoggedEvent { name, log: log.clone() });
        DeviceTurn::register_with(device, group, event, Duration::from_millis(timeout_ms))
    }

    /// One call of `turn` on stream `stream`, logging "launch <what>".
    fn call(turn: &DeviceTurn, stream: usize, what: &str, log: &Arc<Mutex<Vec<String>>>) -> Result<()> {
        // SAFETY: the logged events take any number as a stream.
        unsafe {
            turn.eager(stream as sys::CUstream, || {
                lock(log).push(format!("launch {what}"));
                Ok(())
            })
        }
    }

    fn taken(log: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
        std::mem::take(&mut *lock(log))
    }

    #[test]
    fn the_next_communicator_waits_for_every_rank_of_the_previous_one() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let d = fresh_device();
        let (a0, a1) = (rank(d, 1, "a0", &log, 1000), rank(d, 1, "a1", &log, 1000));
        let b0 = rank(d, 2, "b0", &log, 1000);
        call(&a0, 10, "A0", &log).unwrap();
        call(&a1, 11, "A1", &log).unwrap();
        assert_eq!(taken(&log), ["launch A0", "a0 recorded on 10", "launch A1", "a1 recorded on 11"], "one communicator: no waits");
        call(&b0, 20, "B0", &log).unwrap();
        let mut got = taken(&log);
        got[..2].sort();
        assert_eq!(got, ["20 waits for a0", "20 waits for a1", "launch B0", "b0 recorded on 20"]);
        // A's next call waits for B's launches, on each of A's ranks once.
        call(&a0, 10, "A0'", &log).unwrap();
        call(&a1, 11, "A1'", &log).unwrap();
        call(&a0, 10, "A0''", &log).unwrap();
        assert_eq!(
            taken(&log),
            [
                "10 waits for b0",
                "launch A0'",
                "a0 recorded on 10",
                "11 waits for b0",
                "launch A1'",
                "a1 recorded on 11",
                "launch A0''",
                "a0 recorded on 10"
            ]
        );
    }

    #[test]
    fn a_call_waits_on_the_host_until_the_previous_call_is_issued_on_every_rank() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let d = fresh_device();
        let (a0, a1) = (rank(d, 1, "a0", &log, 5000), rank(d, 1, "a1", &log, 5000));
        let b0 = rank(d, 2, "b0", &log, 5000);
        call(&a0, 10, "A0", &log).unwrap();
        std::thread::scope(|scope| {
            let b = scope.spawn(|| call(&b0, 20, "B0", &log));
            std::thread::sleep(Duration::from_millis(200));
            assert!(!lock(&log).iter().any(|l| l == "launch B0"), "B launched before A's call was issued on a1");
            call(&a1, 11, "A1", &log).unwrap();
            b.join().unwrap().unwrap();
        });
        let got = taken(&log);
        let at = |what: &str| got.iter().position(|l| l == what).unwrap_or_else(|| panic!("{what} missing: {got:?}"));
        assert!(at("a1 recorded on 11") < at("20 waits for a1") && at("20 waits for a1") < at("launch B0"), "{got:?}");
    }

    #[test]
    fn a_turn_that_never_comes_is_an_error_that_says_why_and_a_dropped_rank_settles_its_group() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let d = fresh_device();
        let (a0, a1) = (rank(d, 1, "a0", &log, 300), rank(d, 1, "a1", &log, 300));
        let b0 = rank(d, 2, "b0", &log, 300);
        call(&a0, 10, "A0", &log).unwrap();
        let started = Instant::now();
        let e = call(&b0, 20, "B0", &log).expect_err("a1 never issues its call");
        assert!(started.elapsed() >= Duration::from_millis(300), "the wait is the launch timeout");
        let msg = e.to_string();
        assert!(msg.contains("1 of its 2 ranks") && msg.contains("take turns"), "{msg}");
        assert!(!lock(&log).iter().any(|l| l == "launch B0"));
        // a1 goes away: A is settled, B's next call runs.
        drop(a1);
        call(&b0, 20, "B0", &log).unwrap();
        assert!(lock(&log).iter().any(|l| l == "launch B0"));
    }

    /// A launch may block on the host (NCCL connecting to its peers on a
    /// first call, a full launch queue): the device's lock is not held
    /// meanwhile, so another rank of the same communicator launches (here
    /// a0's launch waits for a1's), and another communicator still waits
    /// for its turn until a0's launch is over.
    #[test]
    fn a_launch_that_blocks_on_the_host_holds_the_turn_but_not_the_lock() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let d = fresh_device();
        let (a0, a1) = (rank(d, 1, "a0", &log, 5000), rank(d, 1, "a1", &log, 5000));
        let b0 = rank(d, 2, "b0", &log, 5000);
        call(&b0, 20, "B0", &log).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let (a0, log) = (&a0, &log);
            let blocked = scope.spawn(move || {
                // SAFETY: the logged events take any number as a stream.
                unsafe {
                    a0.eager(10 as sys::CUstream, || {
                        rx.recv_timeout(Duration::from_secs(3))
                            .map_err(|_| Error::invalid("a1 could not launch while a0's launch blocked"))?;
                        lock(log).push("launch A0".into());
                        Ok(())
                    })
                }
            });
            std::thread::sleep(Duration::from_millis(100));
            let b = scope.spawn(|| call(&b0, 20, "B0'", log));
            std::thread::sleep(Duration::from_millis(100));
            call(&a1, 11, "A1", log).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            assert!(!lock(log).iter().any(|l| l == "launch B0'"), "B took the device while a0 was launching");
            tx.send(()).unwrap();
            blocked.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
        });
        let got = taken(&log);
        let at = |what: &str| got.iter().position(|l| l == what).unwrap_or_else(|| panic!("{what} missing: {got:?}"));
        assert!(at("launch A1") < at("launch A0") && at("launch A0") < at("launch B0'"), "{got:?}");
    }
}
