//! Teardown: when the memory peers touch may be freed.
//!
//! Peers write into a rank's region (flags, ring credits, pushed payload)
//! and read from it (staged inputs) until *their* kernels end, which can be
//! after this rank's last kernel: a ring receiver releases its last credit
//! after the sender has finished, and a peer that keeps calling after this
//! rank left (or failed) still signals it until its wait times out. And
//! CUDA leaves freeing memory that another process still maps through an
//! IPC handle undefined. So a rank's region outlives its communicator:
//!
//! * The ranks of one communicator that live in this process (an in-process
//!   group, or the local ranks of a mixed placement) share one
//!   [`LocalGroup`]. A communicator that goes (drop or `close`) first waits
//!   for its context, then hands the group its region and its mappings of
//!   the peers' memory ([`Departed`]). Nothing is freed until the last
//!   communicator of the group in this process goes. No barrier here: one
//!   thread may drop its ranks one after the other.
//! * When some rank runs in another process, that last communicator then
//!   meets the other processes, every departed rank of this process taking
//!   part (their rendezvous are kept for it): barrier 1 (every rank's device
//!   work is done), close this process's mappings of the others' memory,
//!   barrier 2 (nobody maps anybody's memory any more), free. Each barrier
//!   is bounded; a dead or stuck peer costs the bound, never a hang, and
//!   the memory is freed anyway. Waiting on the rendezvous runs on helper
//!   threads so that the bound holds whatever the rendezvous's own timeout
//!   is; a thread that outlives the bound ends with the rendezvous's
//!   timeout.

#![forbid(unsafe_code)]

use std::any::Any;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::rendezvous::Rendezvous;

/// How long a communicator's drop waits in each teardown barrier.
pub(crate) const DROP_BARRIER_BOUND: Duration = Duration::from_secs(10);

/// What every rank contributes to a teardown barrier: a peer still in
/// another collective receives it instead of the data it expects (and
/// fails), and is told apart from a peer that is tearing down too.
const TEARDOWN_MARKER: &[u8] = b"tp-allreduce teardown barrier";

/// What one rank leaves behind.
pub(crate) struct Departed {
    /// Memory peers write into or read from (the region): freed last.
    pub memory: Box<dyn Any + Send>,
    /// This rank's mappings of peers' memory: closed between the barriers.
    pub mappings: Box<dyn Any + Send>,
    /// Kept for the barriers when some rank runs in another process
    /// ([`LocalGroup::meets_other_processes`]); otherwise dropped at once,
    /// so that the ranks still running learn that this one left.
    pub rendezvous: Option<Arc<dyn Rendezvous>>,
}

/// The ranks of one communicator in this process.
pub(crate) struct LocalGroup {
    job: String,
    /// Unique in the process for its lifetime (never reused).
    id: usize,
    /// Some rank runs in another process: the last one out meets them.
    cross_process: bool,
    departed: Mutex<Vec<Departed>>,
}

fn registry() -> &'static Mutex<Vec<Weak<LocalGroup>>> {
    static GROUPS: OnceLock<Mutex<Vec<Weak<LocalGroup>>>> = OnceLock::new();
    GROUPS.get_or_init(|| Mutex::new(Vec::new()))
}

/// The local group of the communicator whose rank 0 chose `job` (joined by
/// every rank of this process during init).
pub(crate) fn join(job: &str, cross_process: bool) -> Arc<LocalGroup> {
    let mut groups = registry().lock().unwrap_or_else(PoisonError::into_inner);
    groups.retain(|g| g.strong_count() > 0);
    if let Some(group) = groups.iter().filter_map(Weak::upgrade).find(|g| g.job == job) {
        return group;
    }
    static NEXT_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let group = Arc::new(LocalGroup { job: job.to_string(), id, cross_process, departed: Mutex::new(Vec::new()) });
    groups.push(Arc::downgrade(&group));
    group
}

impl LocalGroup {
    /// An identity of the communicator in this process that no other
    /// communicator of the process ever has (unlike an address).
    pub fn id(&self) -> usize {
        self.id
    }

    /// Whether the last rank to leave meets ranks of other processes.
    pub fn meets_other_processes(&self) -> bool {
        self.cross_process
    }

    /// Hands over what a rank leaves behind (its device work already
    /// waited for). The last rank of this process to leave frees everything
    /// held, after the barriers with other processes (each bounded by
    /// `bound`); their failure is returned, the memory is freed regardless.
    pub fn leave(self: Arc<Self>, departed: Departed, bound: Duration) -> Result<()> {
        self.departed.lock().unwrap_or_else(PoisonError::into_inner).push(departed);
        match Arc::into_inner(self) {
            Some(last) => last.finish(bound),
            None => Ok(()),
        }
    }

    fn finish(self, bound: Duration) -> Result<()> {
        let departed = self.departed.into_inner().unwrap_or_else(PoisonError::into_inner);
        if !self.cross_process || departed.is_empty() {
            return Ok(());
        }
        let rendezvous: Vec<Arc<dyn Rendezvous>> = departed.iter().filter_map(|d| d.rendezvous.clone()).collect();
        let work_done = barrier_all(&rendezvous, bound, "barrier 1 (device work done)");
        let mut memory = Vec::with_capacity(departed.len());
        for d in departed {
            drop(d.mappings);
            memory.push(d.memory);
        }
        // After a failed barrier the rendezvous is unusable (or still busy
        // on a helper thread): free without the second one.
        let unmapped =
            if work_done.is_ok() { barrier_all(&rendezvous, bound, "barrier 2 (mappings closed)") } else { Ok(()) };
        drop(memory);
        work_done.and(unmapped)
    }
}

/// A barrier on every rendezvous at once (the ranks of this process, one
/// helper thread each), waiting at most `bound` in all. Every rank must
/// contribute the teardown marker.
fn barrier_all(rendezvous: &[Arc<dyn Rendezvous>], bound: Duration, what: &str) -> Result<()> {
    let deadline = Instant::now() + bound;
    let (sender, receiver) = mpsc::channel();
    for rdv in rendezvous {
        let (rdv, sender) = (rdv.clone(), sender.clone());
        std::thread::Builder::new()
            .name("tp-allreduce-teardown".into())
            .spawn(move || {
                let outcome = rdv.all_gather(TEARDOWN_MARKER).and_then(|all| {
                    match all.iter().position(|contribution| contribution != TEARDOWN_MARKER) {
                        Some(peer) => {
                            Err(Error::Rendezvous(format!("rank {peer} was in another collective, not tearing down")))
                        }
                        None => Ok(()),
                    }
                });
                let _ = sender.send((rdv.rank(), outcome));
            })
            .map_err(|e| Error::Rendezvous(format!("teardown {what}: cannot start a thread: {e}")))?;
    }
    drop(sender);
    let mut first_error = None;
    for _ in rendezvous {
        match receiver.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((_, Ok(()))) => {}
            Ok((rank, Err(e))) => {
                first_error.get_or_insert(Error::Rendezvous(format!("teardown {what}, rank {rank}: {e}")));
            }
            Err(_) => {
                return Err(Error::RendezvousTimeout {
                    what: format!("teardown {what}: the ranks in other processes did not all arrive"),
                    waited_ms: bound.as_millis() as u64,
                })
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::in_process_group;

    /// Records when a value is dropped.
    struct Logged {
        name: String,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Drop for Logged {
        fn drop(&mut self) {
            self.log.lock().unwrap().push(format!("freed {}", self.name));
        }
    }

    fn departed(rank: usize, log: &Arc<Mutex<Vec<String>>>, rdv: Option<Arc<dyn Rendezvous>>) -> Departed {
        let logged = |what: &str| Logged { name: format!("{what} {rank}"), log: log.clone() };
        Departed { memory: Box::new(logged("region")), mappings: Box::new(logged("mappings")), rendezvous: rdv }
    }

    fn rendezvous(world: usize) -> Vec<Arc<dyn Rendezvous>> {
        in_process_group(world, Duration::from_secs(30)).into_iter().map(Arc::from).collect()
    }

    #[test]
    fn in_process_ranks_keep_every_region_until_the_last_one_leaves() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let members: Vec<_> = (0..3).map(|_| join("test-in-process", false)).collect();
        assert!(Arc::ptr_eq(&members[0], &members[2]), "ranks of one job share a group");
        // One thread drops the ranks one after the other (no barrier: it
        // would wait for ranks this thread has not dropped yet).
        for (rank, member) in members.into_iter().enumerate() {
            assert!(log.lock().unwrap().is_empty(), "freed before rank {rank} left: {:?}", log.lock().unwrap());
            assert!(!member.meets_other_processes());
            member.leave(departed(rank, &log, None), Duration::from_secs(5)).unwrap();
        }
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 6, "{log:?}");
        assert!(log.contains(&"freed region 0".to_string()), "{log:?}");
    }

    #[test]
    fn different_jobs_do_not_share_a_group() {
        let a = join("test-job-a", false);
        let b = join("test-job-b", false);
        assert!(!Arc::ptr_eq(&a, &b));
    }

    #[test]
    fn across_processes_nothing_is_freed_before_every_rank_closed_its_mappings() {
        // Two "processes" of one rank each (separate groups, one rendezvous).
        let log = Arc::new(Mutex::new(Vec::new()));
        let rdv = rendezvous(2);
        let outcomes: Vec<Result<()>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (log, rdv) = (log.clone(), Some(rdv[rank].clone()));
                    scope.spawn(move || {
                        let group = join(&format!("test-cross-{rank}"), true);
                        group.leave(departed(rank, &log, rdv), Duration::from_secs(20))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        let log = log.lock().unwrap();
        let at = |what: &str| log.iter().position(|l| l == what).unwrap_or_else(|| panic!("{what}: {log:?}"));
        for region in ["freed region 0", "freed region 1"] {
            for mappings in ["freed mappings 0", "freed mappings 1"] {
                assert!(at(mappings) < at(region), "{region} before {mappings}: {log:?}");
            }
        }
    }

    #[test]
    fn a_peer_that_never_leaves_costs_the_bound_and_the_memory_is_freed() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let rdv = rendezvous(2);
        let group = join("test-dead-peer", true);
        // Rank 1 never arrives (its rendezvous stays alive, as a stuck peer's would).
        let err = group.leave(departed(0, &log, Some(rdv[0].clone())), Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, Error::RendezvousTimeout { .. }), "{err}");
        assert!(err.to_string().contains("barrier 1"), "{err}");
        let log = log.lock().unwrap();
        assert!(
            log.contains(&"freed region 0".to_string()) && log.contains(&"freed mappings 0".to_string()),
            "{log:?}"
        );
        drop(rdv);
    }

    #[test]
    fn a_peer_still_in_another_collective_is_not_taken_for_a_departed_one() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let rdv = rendezvous(2);
        let busy = rdv[1].clone();
        let peer = std::thread::spawn(move || busy.all_gather(b"registration outcome"));
        let group = join("test-busy-peer", true);
        let err = group.leave(departed(0, &log, Some(rdv[0].clone())), Duration::from_secs(30)).unwrap_err();
        assert!(err.to_string().contains("rank 1 was in another collective"), "{err}");
        assert!(log.lock().unwrap().contains(&"freed region 0".to_string()));
        // The busy peer got the marker, not an outcome it could mistake for one.
        let got = peer.join().unwrap().unwrap();
        assert_eq!(got[0], TEARDOWN_MARKER);
    }

    #[test]
    fn a_peer_that_is_gone_fails_the_barrier_at_once_and_the_memory_is_freed() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut rdv = rendezvous(2);
        drop(rdv.pop()); // rank 1's rendezvous is dropped: it died.
        let group = join("test-gone-peer", true);
        let err = group.leave(departed(0, &log, Some(rdv[0].clone())), Duration::from_secs(30)).unwrap_err();
        assert!(matches!(err, Error::Rendezvous(_)), "{err}");
        assert!(log.lock().unwrap().contains(&"freed region 0".to_string()));
    }
}
