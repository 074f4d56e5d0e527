//! PLACEHOLDER (replaced by the rendezvous branch): the trait and an
//! in-process implementation so the communicator compiles meanwhile.
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

pub trait Rendezvous: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }
}

#[derive(Clone, Debug)]
pub struct Id(String);
impl Id {
    pub fn new_unix() -> Result<Id> {
        Err(Error::Rendezvous("not yet".into()))
    }
    pub fn new_tcp(addr: std::net::SocketAddr) -> Id {
        Id(addr.to_string())
    }
}
pub fn connect(_id: &Id, _rank: usize, _world: usize, _t: Duration) -> Result<Box<dyn Rendezvous>> {
    Err(Error::Rendezvous("not yet".into()))
}

struct Shared {
    round: u64,
    slots: Vec<Option<Vec<u8>>>,
    results: Vec<Vec<u8>>,
    arrived: usize,
}
struct InProc {
    rank: usize,
    world: usize,
    timeout: Duration,
    shared: Arc<(Mutex<Shared>, Condvar)>,
}
impl Rendezvous for InProc {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap();
        let round = s.round;
        s.slots[self.rank] = Some(mine.to_vec());
        s.arrived += 1;
        if s.arrived == self.world {
            s.results = s.slots.iter_mut().map(|x| x.take().unwrap()).collect();
            s.arrived = 0;
            s.round += 1;
            cv.notify_all();
            return Ok(s.results.clone());
        }
        let deadline = Instant::now() + self.timeout;
        while s.round == round {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::RendezvousTimeout {
                    what: "in-process".into(),
                    waited_ms: self.timeout.as_millis() as u64,
                });
            }
            s = cv.wait_timeout(s, deadline - now).unwrap().0;
        }
        Ok(s.results.clone())
    }
}
pub fn in_process_group(world: usize, timeout: Duration) -> Vec<Box<dyn Rendezvous>> {
    let shared = Arc::new((
        Mutex::new(Shared { round: 0, slots: vec![None; world], results: vec![], arrived: 0 }),
        Condvar::new(),
    ));
    (0..world)
        .map(|rank| Box::new(InProc { rank, world, timeout, shared: shared.clone() }) as Box<dyn Rendezvous>)
        .collect()
}
