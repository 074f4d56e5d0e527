//! Rendezvous for ranks that are threads of one process: a shared slot per
//! rank under a mutex, a condition variable, and a generation counter that
//! tells a waiting rank its round has completed. Same contract and errors as
//! the socket rendezvous: bounded waits, errors naming the missing ranks, and
//! a failure on one rank fails the others' current and later calls.

#![forbid(unsafe_code)]

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Rendezvous;
use crate::error::{Error, Result};

/// One [`Rendezvous`] per rank (index = rank) for `world_size` threads of
/// this process. Each all_gather waits at most `timeout` for the others.
/// Dropping a rank's object makes the others' next (or current) call fail at
/// once, naming it.
pub fn in_process_group(world_size: usize, timeout: Duration) -> Vec<Box<dyn Rendezvous>> {
    members(world_size, timeout).into_iter().map(|m| Box::new(m) as Box<dyn Rendezvous>).collect()
}

fn members(world_size: usize, timeout: Duration) -> Vec<Member> {
    let group = Arc::new(Group {
        world: world_size,
        timeout,
        state: Mutex::new(State {
            generation: 0,
            slots: vec![None; world_size],
            arrived: 0,
            result: Arc::new(Vec::new()),
            left: vec![false; world_size],
            broken: None,
        }),
        cv: Condvar::new(),
    });
    (0..world_size).map(|rank| Member { rank, group: group.clone() }).collect()
}

struct Group {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    /// Completed rounds; a waiter's round is done when this moves on.
    generation: u64,
    /// Contributions to the round in progress.
    slots: Vec<Option<Vec<u8>>>,
    arrived: usize,
    /// The last completed round. It stays valid until every waiter of that
    /// round has read it: the next round needs all ranks, waiters included.
    result: Arc<Vec<Vec<u8>>>,
    /// Ranks whose object was dropped.
    left: Vec<bool>,
    /// Set by the first failure; every later call fails with it.
    broken: Option<String>,
}

struct Member {
    rank: usize,
    group: Arc<Group>,
}

fn lock(group: &Group) -> Result<MutexGuard<'_, State>> {
    group.state.lock().map_err(|_| Error::Rendezvous("in-process group poisoned: a rank thread panicked".into()))
}

/// Breaks the group: records why, withdraws the round's contributions and
/// wakes every waiter so it fails too.
fn fail(group: &Group, s: &mut State, err: Error) -> Error {
    s.broken = Some(match &err {
        Error::RendezvousTimeout { what, .. } => what.clone(),
        other => other.to_string(),
    });
    s.slots.iter_mut().for_each(|slot| *slot = None);
    s.arrived = 0;
    group.cv.notify_all();
    err
}

impl Member {
    /// A rank that left, among those that have not contributed to the round.
    fn missing_left(&self, s: &State) -> Option<usize> {
        (0..self.group.world).find(|&r| r != self.rank && s.left[r] && s.slots[r].is_none())
    }
}

impl Rendezvous for Member {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let g = &*self.group;
        let mut s = lock(g)?;
        if let Some(why) = &s.broken {
            return Err(Error::Rendezvous(format!("unusable after an earlier error: {why}")));
        }
        if s.slots[self.rank].is_some() {
            return Err(Error::invalid(format!(
                "rank {} called all_gather from two threads at once (collectives must be called in order)",
                self.rank
            )));
        }
        let generation = s.generation;
        s.slots[self.rank] = Some(mine.to_vec());
        s.arrived += 1;
        if s.arrived == g.world {
            let all: Vec<Vec<u8>> = s.slots.iter_mut().map(|slot| slot.take().unwrap_or_default()).collect();
            s.result = Arc::new(all);
            s.arrived = 0;
            s.generation += 1;
            g.cv.notify_all();
            return Ok(s.result.to_vec());
        }
        let deadline = Instant::now() + g.timeout;
        loop {
            if s.generation != generation {
                return Ok(s.result.to_vec());
            }
            if let Some(why) = &s.broken {
                return Err(Error::Rendezvous(format!("another rank failed: {why}")));
            }
            if let Some(r) = self.missing_left(&s) {
                let err = Error::Rendezvous(format!("rank {r} left the group (its rendezvous was dropped)"));
                return Err(fail(g, &mut s, err));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..g.world).filter(|&r| s.slots[r].is_none()).collect();
                let err = Error::RendezvousTimeout {
                    what: format!(
                        "ranks {missing:?} did not call all_gather within {} ms (in-process group)",
                        g.timeout.as_millis()
                    ),
                    waited_ms: g.timeout.as_millis() as u64,
                };
                return Err(fail(g, &mut s, err));
            }
            s =
                g.cv.wait_timeout(s, deadline - now)
                    .map_err(|_| Error::Rendezvous("in-process group poisoned: a rank thread panicked".into()))?
                    .0;
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let mut s = match self.group.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        s.left[self.rank] = true;
        self.group.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn run_all<T: Send>(rdvs: &[Box<dyn Rendezvous>], f: impl Fn(&dyn Rendezvous) -> T + Sync) -> Vec<T> {
        thread::scope(|s| {
            let handles: Vec<_> = rdvs.iter().map(|r| s.spawn(|| f(&**r))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn in_process_rounds_in_rank_order() {
        for world in [1, 2, 4, 8] {
            let rdvs = in_process_group(world, Duration::from_secs(10));
            let results = run_all(&rdvs, |r| {
                (0..20u8)
                    .map(|round| {
                        let mine = vec![r.rank() as u8 ^ round; r.rank() * round as usize];
                        r.all_gather(&mine).unwrap()
                    })
                    .collect::<Vec<_>>()
            });
            for per_rank in &results {
                for (round, got) in per_rank.iter().enumerate() {
                    let want: Vec<Vec<u8>> =
                        (0..world).map(|rank| vec![rank as u8 ^ round as u8; rank * round]).collect();
                    assert_eq!(got, &want, "world {world} round {round}");
                }
            }
            run_all(&rdvs, |r| r.barrier().unwrap());
        }
    }

    #[test]
    fn in_process_missing_rank_times_out_naming_it() {
        let rdvs = in_process_group(3, Duration::from_millis(150));
        let started = Instant::now();
        let errs = run_all(&rdvs[..2], |r| r.all_gather(b"x").unwrap_err());
        assert!(started.elapsed() < Duration::from_secs(2));
        for e in &errs {
            assert!(e.to_string().contains("[2]"), "{e}");
        }
        assert!(errs.iter().any(|e| matches!(e, Error::RendezvousTimeout { waited_ms: 150, .. })));
        // The late rank finds the group broken rather than waiting again.
        let late = rdvs[2].all_gather(b"late").unwrap_err();
        assert!(late.to_string().contains("did not call all_gather"), "{late}");
    }

    /// Rank 2 is dropped while ranks 0 and 1 wait in a round: both fail
    /// at once naming it, and so does any later call.
    #[test]
    fn in_process_dropped_rank_fails_the_others_fast() {
        let mut ranks = members(3, Duration::from_secs(30));
        let group = ranks[0].group.clone();
        let two = ranks.pop().unwrap();
        let started = Instant::now();
        let errs = thread::scope(|s| {
            let handles: Vec<_> = ranks.iter().map(|r| s.spawn(|| r.all_gather(b"y").unwrap_err())).collect();
            while group.state.lock().unwrap().arrived < 2 {
                assert!(started.elapsed() < Duration::from_secs(5), "ranks 0 and 1 never arrived");
                thread::yield_now();
            }
            drop(two);
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        assert!(started.elapsed() < Duration::from_secs(5));
        for e in errs {
            assert!(e.to_string().contains("rank 2 left"), "{e}");
        }
        let later = ranks[0].all_gather(b"z").unwrap_err();
        assert!(later.to_string().contains("rank 2 left"), "{later}");
    }

    #[test]
    fn in_process_rank_dropped_between_rounds_fails_the_next_call() {
        let mut rdvs = in_process_group(2, Duration::from_secs(30));
        run_all(&rdvs, |r| r.barrier().unwrap());
        drop(rdvs.pop());
        let started = Instant::now();
        let err = rdvs[0].all_gather(b"x").unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(err.to_string().contains("rank 1 left"), "{err}");
    }
}
