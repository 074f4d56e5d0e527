//! Helpers shared by the rendezvous tests: ids for both transports, a
//! thread per rank, and raw connections that play a rank by hand.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rand::Rng;

use super::member::dial;
use super::wire::{self, Kind};
use super::{read_frame, Conn, Endpoint, Id};

/// Bound for calls expected to succeed; a failing test may wait this long.
pub(super) const LONG: Duration = Duration::from_secs(10);

pub(super) fn unix_id() -> Id {
    Id::new_unix().unwrap()
}

/// A loopback id on a port that was free a moment ago, that no other test
/// of this process was given, picked at random below Linux's default
/// ephemeral range (32768..60999): a port the kernel picked for a listener
/// on port 0 could meanwhile become the local port of one of the thousands
/// of client connections the tests open, and rank 0's bind would fail;
/// random, so that test processes running at once rarely pick the same.
pub(super) fn tcp_id() -> Id {
    const PORTS: std::ops::Range<u16> = 20_000..32_000;
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..PORTS.len() {
        let port = rand::thread_rng().gen_range(PORTS);
        if given.contains(&port) {
            continue;
        }
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            given.insert(port);
            return Id::new_tcp(l.local_addr().unwrap());
        }
    }
    panic!("no free loopback port in {PORTS:?}");
}

pub(super) type MakeId = fn() -> Id;

pub(super) fn transports() -> [(&'static str, MakeId); 2] {
    [("unix", unix_id), ("tcp", tcp_id)]
}

pub(super) fn private_dir(id: &Id) -> Option<PathBuf> {
    match &id.endpoint {
        Endpoint::Unix(p) => p.parent().map(Path::to_path_buf),
        Endpoint::Tcp(_) => None,
    }
}

/// Runs `f(rank)` on a thread per rank; results in rank order.
pub(super) fn on_ranks<T: Send>(ranks: std::ops::Range<usize>, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> = ranks.map(|r| s.spawn(move || f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Connects a raw socket to rank 0 (retrying until it listens).
pub(super) fn raw_dial(id: &Id) -> Arc<dyn Conn> {
    dial(&id.endpoint, 99, Instant::now() + LONG, LONG).unwrap()
}

pub(super) fn raw_frame(kind: Kind, job: &[u8; 16], sender: u32, round: u32, payload: &[u8]) -> Vec<u8> {
    wire::encode(kind, job, sender, round, payload).unwrap()
}

pub(super) fn raw_hello(job: &[u8; 16], rank: u32, world: usize) -> Vec<u8> {
    raw_frame(Kind::Hello, job, rank, 0, &wire::encode_world(world))
}

/// Reads what rank 0 sends a refused connection until it closes it;
/// returns the ABORT (its job id and reason) if there was one. Panics
/// if the connection is not closed within `bound`.
pub(super) fn read_until_closed(conn: &dyn Conn, bound: Duration) -> Option<([u8; 16], String)> {
    let deadline = Instant::now() + bound;
    let mut abort = None;
    loop {
        match read_frame(conn, Some(deadline), wire::MAX_PAYLOAD) {
            Ok(f) if f.header.kind == Kind::Abort => {
                abort = Some((f.header.job, wire::decode_abort(&f.payload).unwrap().reason));
            }
            Ok(f) => panic!("a refused connection got {:?}", f.header),
            Err(e) if e.is_disconnect() => return abort,
            Err(e) => panic!("a refused connection was not closed within {bound:?}: {e}"),
        }
    }
}
