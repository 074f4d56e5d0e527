//! The rendezvous of ranks that are threads of one process (in-memory,
//! mutex + condition variable, generation counter per round). A rank whose
//! object is dropped (its initialisation failed) makes the others fail fast
//! instead of waiting for the timeout.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::Rendezvous;
use crate::error::{Error, Result};

struct Shared {
    round: u64,
    slots: Vec<Option<Vec<u8>>>,
    results: Arc<Vec<Vec<u8>>>,
    arrived: usize,
    left: Vec<bool>,
}

struct InProcess {
    rank: usize,
    world: usize,
    timeout: Duration,
    shared: Arc<(Mutex<Shared>, Condvar)>,
}

/// One rendezvous per rank of an in-process group of `world` ranks.
pub fn in_process_group(world: usize, timeout: Duration) -> Vec<Box<dyn Rendezvous>> {
    let shared = Arc::new((
        Mutex::new(Shared {
            round: 0,
            slots: vec![None; world],
            results: Arc::new(Vec::new()),
            arrived: 0,
            left: vec![false; world],
        }),
        Condvar::new(),
    ));
    (0..world)
        .map(|rank| Box::new(InProcess { rank, world, timeout, shared: shared.clone() }) as Box<dyn Rendezvous>)
        .collect()
}

impl Rendezvous for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().map_err(|_| Error::Broken("rendezvous lock poisoned".into()))?;
        let round = s.round;
        s.slots[self.rank] = Some(mine.to_vec());
        s.arrived += 1;
        if s.arrived == self.world {
            let results: Vec<Vec<u8>> = s.slots.iter_mut().map(|x| x.take().unwrap_or_default()).collect();
            s.results = Arc::new(results);
            s.arrived = 0;
            s.round += 1;
            cv.notify_all();
            return Ok((*s.results).clone());
        }
        let deadline = Instant::now() + self.timeout;
        while s.round == round {
            let gone: Vec<usize> = (0..self.world).filter(|&r| s.left[r] && s.slots[r].is_none()).collect();
            if !gone.is_empty() {
                return Err(Error::Rendezvous(format!("ranks {gone:?} left the group (their initialisation failed)")));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.world).filter(|&r| s.slots[r].is_none()).collect();
                return Err(Error::RendezvousTimeout {
                    what: format!("ranks {missing:?} did not arrive"),
                    waited_ms: self.timeout.as_millis() as u64,
                });
            }
            s = cv.wait_timeout(s, deadline - now).map_err(|_| Error::Broken("rendezvous lock poisoned".into()))?.0;
        }
        Ok((*s.results).clone())
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        let (lock, cv) = &*self.shared;
        if let Ok(mut s) = lock.lock() {
            s.left[self.rank] = true;
            cv.notify_all();
        }
    }
}
