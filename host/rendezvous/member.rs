//! Ranks 1..N-1 of the socket rendezvous (see the protocol in the module
//! docs): dial rank 0 (retrying while it is not up yet), HELLO, wait for
//! WELCOME; then per round send GATHER and wait for RESULT, checking that
//! every frame is rank 0's, of this job, round and kind, and that RESULT
//! holds this rank's own bytes.

#![forbid(unsafe_code)]

use std::io;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::wire::{self, Checked, Kind, WireError};
use super::{
    abort_for, error_from_abort, lock, ms, read_frame, send_abort, tcp, unix, unusable, write_frame, Conn, Endpoint,
    Link, Rendezvous, MAX_ROUND_BYTES,
};
use crate::error::{Error, Result};

/// Backoff cap of ranks 1.. while rank 0 is not listening yet.
const MAX_BACKOFF: Duration = Duration::from_millis(100);

/// Rank 1..N-1 of a socket rendezvous: one connection, to rank 0.
pub(super) struct Member {
    link: Link,
    rank: usize,
    inner: Mutex<MemberInner>,
}

struct MemberInner {
    conn: Arc<dyn Conn>,
    round: u32,
    broken: Option<String>,
}

/// Connects to rank 0, retrying while it is not listening yet.
pub(super) fn dial(endpoint: &Endpoint, rank: usize, deadline: Instant, timeout: Duration) -> Result<Arc<dyn Conn>> {
    let mut backoff = Duration::from_millis(1);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = match endpoint {
            Endpoint::Unix(path) => unix::connect(path),
            Endpoint::Tcp(addr) => tcp::connect(*addr, left.max(Duration::from_millis(1))),
        };
        let e = match attempt {
            Ok(conn) => return Ok(conn),
            Err(e) => e,
        };
        let not_up_yet = matches!(
            e.kind(),
            io::ErrorKind::NotFound
                | io::ErrorKind::ConnectionRefused
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::TimedOut
                | io::ErrorKind::WouldBlock
                | io::ErrorKind::Interrupted
        );
        if !not_up_yet {
            return Err(Error::io(format!("rank {rank} connecting to rank 0 at {endpoint}"), e));
        }
        // Rank 0 created the private directory before handing out the id
        // and removes it when it stops listening (the join ended, or it
        // failed): once it is gone, waiting for the socket is pointless.
        if let Endpoint::Unix(path) = endpoint {
            if path.parent().is_some_and(|dir| !dir.exists()) {
                return Err(Error::Rendezvous(format!(
                    "rank {rank}: rank 0's rendezvous directory for {endpoint} is gone: rank 0 failed before \
                     listening, or the join is over"
                )));
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::RendezvousTimeout {
                what: format!("rank 0 was not reachable at {endpoint} within {} ms (last error: {e})", ms(timeout)),
                waited_ms: timeout.as_millis() as u64,
            });
        }
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

impl Member {
    pub(super) fn join(link: Link, endpoint: &Endpoint, rank: usize) -> Result<Member> {
        let started = Instant::now();
        let conn = dial(endpoint, rank, started + link.timeout, link.timeout)?;
        let hello = wire::encode(Kind::Hello, &link.job, rank as u32, 0, &wire::encode_world(link.world))
            .map_err(|e| Error::Rendezvous(e.to_string()))?;
        write_frame(&*conn, Instant::now() + link.timeout, &hello)
            .map_err(|e| Error::io(format!("rank {rank} sending HELLO to rank 0"), e))?;

        let wait = link.timeout + link.limits.grace;
        let reply = read_frame(&*conn, Some(started + wait), wire::MAX_CONTROL_PAYLOAD);
        let from_root = |what: String| Error::Protocol { from: "rank 0".into(), what };
        let frame = match reply {
            Ok(f) => f,
            Err(WireError::TimedOut) => {
                return Err(Error::RendezvousTimeout {
                    what: format!(
                        "rank {rank} got no WELCOME from rank 0 within {} ms (not all ranks joined, and rank 0 sent \
                         no diagnosis: is it running with the same timeout?)",
                        ms(wait)
                    ),
                    waited_ms: wait.as_millis() as u64,
                })
            }
            Err(e) if e.is_disconnect() => {
                return Err(Error::Rendezvous(format!(
                    "rank 0 closed the connection while rank {rank} was joining ({e}: it exited, or refused this rank)"
                )))
            }
            Err(e) => return Err(from_root(format!("during join: {e}"))),
        };
        match frame.check(&link.job, 0, Kind::Welcome, 0).map_err(from_root)? {
            Checked::Aborted(a) => Err(error_from_abort("rank 0", a)),
            Checked::Expected(p) => {
                let world = wire::decode_world(&p).map_err(from_root)?;
                if world != link.world {
                    return Err(from_root(format!("WELCOME for world size {world}, expected {}", link.world)));
                }
                Ok(Member { link, rank, inner: Mutex::new(MemberInner { conn, round: 0, broken: None }) })
            }
        }
    }

    /// One round on rank 1..: send GATHER, wait for RESULT.
    fn exchange(&self, inner: &mut MemberInner, round: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let Link { job, world, timeout, limits } = self.link;
        let rank = self.rank;
        let conn = &*inner.conn;
        let started = Instant::now();
        if mine.len() > MAX_ROUND_BYTES - wire::result_overhead(world) {
            let err = Error::invalid(format!(
                "rank {rank}'s all_gather contribution of {} bytes exceeds the rendezvous limit of {MAX_ROUND_BYTES} \
                 bytes per round",
                mine.len()
            ));
            send_abort(conn, &job, rank as u32, round, &abort_for(&err));
            return Err(err);
        }
        let frame =
            wire::encode(Kind::Gather, &job, rank as u32, round, mine).map_err(|e| Error::Rendezvous(e.to_string()))?;
        if let Err(e) = write_frame(conn, started + timeout, &frame) {
            // Rank 0 may have sent an ABORT before closing: its reason is
            // the better error.
            let soon = Some(Instant::now() + Duration::from_millis(50));
            if let Ok(Checked::Aborted(a)) = read_frame(conn, soon, wire::MAX_PAYLOAD)
                .map_err(|_| ())
                .and_then(|f| f.check(&job, 0, Kind::Result, round).map_err(|_| ()))
            {
                return Err(error_from_abort("rank 0", a));
            }
            return Err(Error::Rendezvous(format!(
                "rank {rank} could not send round {round} to rank 0 ({e}): rank 0 exited or closed the connection"
            )));
        }

        let wait = timeout + limits.grace;
        let from_root =
            |what: String| Error::Protocol { from: "rank 0".into(), what: format!("round {round}: {what}") };
        let frame = match read_frame(conn, Some(started + wait), wire::MAX_PAYLOAD) {
            Ok(f) => f,
            Err(WireError::TimedOut) => {
                return Err(Error::RendezvousTimeout {
                    what: format!("rank {rank} got no result for round {round} from rank 0 within {} ms", ms(wait)),
                    waited_ms: wait.as_millis() as u64,
                })
            }
            Err(e) if e.is_disconnect() => {
                return Err(Error::Rendezvous(format!(
                    "rank 0 closed the connection in round {round} ({e}: its process exited, crashed or dropped its \
                     rendezvous)"
                )))
            }
            Err(e) => return Err(from_root(e.to_string())),
        };
        match frame.check(&job, 0, Kind::Result, round).map_err(from_root)? {
            Checked::Aborted(a) => Err(error_from_abort("rank 0", a)),
            Checked::Expected(p) => {
                let parts = wire::decode_result(&p, world).map_err(from_root)?;
                if parts[rank] != mine {
                    return Err(from_root(format!("RESULT does not hold rank {rank}'s own contribution")));
                }
                Ok(parts)
            }
        }
    }
}

impl Rendezvous for Member {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.link.world
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut inner = lock(&self.inner)?;
        if let Some(why) = &inner.broken {
            return Err(unusable(why));
        }
        inner.round = inner.round.wrapping_add(1);
        let round = inner.round;
        self.exchange(&mut inner, round, mine).inspect_err(|err| inner.broken = Some(err.to_string()))
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let inner = match self.inner.get_mut() {
            Ok(i) => i,
            Err(poisoned) => poisoned.into_inner(),
        };
        inner.conn.disconnect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::testing::*;
    use crate::rendezvous::wire::{Abort, AbortCode};
    use crate::rendezvous::{connect, Id};
    use std::fs;

    #[test]
    fn member_gives_up_when_rank_0_never_listens() {
        for (transport, make) in transports() {
            let id = make();
            let started = Instant::now();
            let err = connect(&id, 1, 2, Duration::from_millis(200)).err().expect("joined without rank 0");
            assert!(started.elapsed() < Duration::from_secs(2), "{transport}: {:?}", started.elapsed());
            assert!(matches!(err, Error::RendezvousTimeout { .. }), "{transport}: {err}");
            assert!(err.to_string().contains("rank 0 was not reachable"), "{transport}: {err}");
            if let Some(dir) = private_dir(&id) {
                fs::remove_dir(dir).unwrap();
            }
        }
    }

    /// When the fake rank 0 answers badly.
    #[derive(PartialEq)]
    enum At {
        Join,
        Round,
    }

    /// What the fake rank 0 sends from the job id (empty: it closes).
    type Reply = Box<dyn Fn(&[u8; 16]) -> Vec<u8>>;

    /// The bad answers of `member_refuses_a_bad_rank_0`: (name, when, what
    /// rank 0 sends, expected text).
    fn bad_rank_0_cases() -> Vec<(&'static str, At, Reply, &'static str)> {
        fn abort(code: AbortCode, reason: &str) -> Vec<u8> {
            wire::encode_abort(&Abort { code, waited_ms: 700, reason: reason.into() })
        }
        fn parts(v: &[&[u8]]) -> Vec<u8> {
            wire::encode_result(&v.iter().map(|p| p.to_vec()).collect::<Vec<_>>())
        }
        vec![
            ("closes", At::Join, Box::new(|_| vec![]), "rank 0 closed the connection while rank 1 was joining"),
            (
                "refuses",
                At::Join,
                Box::new(|j| raw_frame(Kind::Abort, j, 0, 0, &abort(AbortCode::Rejected, "rank 1 has already joined"))),
                "rank 0 refused this rank: rank 1 has already joined",
            ),
            (
                "wrong world",
                At::Join,
                Box::new(|j| raw_frame(Kind::Welcome, j, 0, 0, &wire::encode_world(3))),
                "WELCOME for world size 3",
            ),
            (
                "foreign job",
                At::Join,
                Box::new(|_| raw_frame(Kind::Welcome, &[3; 16], 0, 0, &wire::encode_world(2))),
                "wrong job id",
            ),
            (
                "wrong sender",
                At::Join,
                Box::new(|j| raw_frame(Kind::Welcome, j, 1, 0, &wire::encode_world(2))),
                "claims sender rank 1",
            ),
            ("garbage", At::Join, Box::new(|_| vec![0xAB; 40]), "not a rendezvous frame"),
            ("closes in round", At::Round, Box::new(|_| vec![]), "rank 0 closed the connection in round 1"),
            (
                "not my bytes",
                At::Round,
                Box::new(move |j| raw_frame(Kind::Result, j, 0, 1, &parts(&[b"zero", b"forged"]))),
                "own contribution",
            ),
            (
                "old round",
                At::Round,
                Box::new(move |j| raw_frame(Kind::Result, j, 0, 2, &parts(&[b"zero", b"mine"]))),
                "round 2, expected round 1",
            ),
            (
                "wrong count",
                At::Round,
                Box::new(move |j| raw_frame(Kind::Result, j, 0, 1, &parts(&[b"zero", b"mine", b"extra"]))),
                "holds 3 contributions",
            ),
            (
                "huge length",
                At::Round,
                Box::new(|j| {
                    let mut b = raw_frame(Kind::Result, j, 0, 1, b"");
                    b[36..40].copy_from_slice(&u32::MAX.to_le_bytes());
                    b
                }),
                "exceeds the limit",
            ),
            (
                "relayed timeout",
                At::Round,
                Box::new(|j| raw_frame(Kind::Abort, j, 0, 1, &abort(AbortCode::Timeout, "ranks [5] did not send"))),
                "rank 0 reports: ranks [5] did not send",
            ),
        ]
    }

    /// Rank 1 against a fake rank 0 (the test, on a TCP port it holds)
    /// that answers badly during the join or in round 1: rank 1 must fail
    /// with an error naming rank 0 and saying what was wrong, within bound.
    #[test]
    fn member_refuses_a_bad_rank_0() {
        let cases = bad_rank_0_cases();
        for (name, at, reply, text) in &cases {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let id = Id::new_tcp(listener.local_addr().unwrap());
            let job = id.job_id();
            let started = Instant::now();
            let err = thread::scope(|s| {
                let member = s.spawn(|| connect(&id, 1, 2, Duration::from_secs(3))?.all_gather(b"mine"));
                let (stream, _) = listener.accept().unwrap();
                let conn: Arc<dyn Conn> = Arc::new(stream);
                let hello = read_frame(&*conn, Some(Instant::now() + LONG), 64).unwrap();
                assert_eq!((hello.header.kind, hello.header.sender), (Kind::Hello, 1));
                if *at == At::Round {
                    write_frame(
                        &*conn,
                        Instant::now() + LONG,
                        &raw_frame(Kind::Welcome, &job, 0, 0, &wire::encode_world(2)),
                    )
                    .unwrap();
                    let gather = read_frame(&*conn, Some(Instant::now() + LONG), 64).unwrap();
                    assert_eq!((gather.header.kind, gather.payload.as_slice()), (Kind::Gather, &b"mine"[..]));
                }
                let bytes = reply(&job);
                if bytes.is_empty() {
                    conn.disconnect();
                } else {
                    write_frame(&*conn, Instant::now() + LONG, &bytes).unwrap();
                }
                let err = member.join().unwrap().expect_err(name);
                drop(conn);
                err
            });
            assert!(started.elapsed() < Duration::from_secs(2), "{name}: {:?}", started.elapsed());
            let msg = err.to_string();
            assert!(msg.contains(text) && msg.contains("rank 0"), "{name}: {msg}");
        }
    }
}
