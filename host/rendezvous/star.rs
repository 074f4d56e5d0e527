//! The star protocol over any stream socket (Unix or TCP): rank 0 listens,
//! the others connect and say hello; each all-gather round every other rank
//! sends its contribution to rank 0, which answers with all of them.
//!
//! Guarantees (tested in `tests`):
//! * joining: garbage, foreign jobs, wrong versions, out-of-range or
//!   duplicate ranks, oversized lengths and silent connections are rejected
//!   and closed; the good ranks still join;
//! * every step is bounded by the timeout; an error names the missing or
//!   misbehaving rank;
//! * after a rank dies (EOF) or misbehaves, rank 0 sends ABORT with the
//!   reason to the others, which fail fast; the rendezvous stays broken.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::wire::{self, Frame, Kind, WireError, MAX_CONTRIBUTION};
use super::Rendezvous;
use crate::error::{Error, Result};

/// A connected stream socket.
pub(crate) trait Conn: Read + Write + Send + 'static {
    fn set_timeouts(&self, t: Duration) -> std::io::Result<()>;
    fn set_blocking(&self) -> std::io::Result<()>;
}

impl Conn for UnixStream {
    fn set_timeouts(&self, t: Duration) -> std::io::Result<()> {
        let t = Some(t.max(Duration::from_millis(1)));
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)
    }
    fn set_blocking(&self) -> std::io::Result<()> {
        self.set_nonblocking(false)
    }
}

impl Conn for TcpStream {
    fn set_timeouts(&self, t: Duration) -> std::io::Result<()> {
        let t = Some(t.max(Duration::from_millis(1)));
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)?;
        self.set_nodelay(true)
    }
    fn set_blocking(&self) -> std::io::Result<()> {
        self.set_nonblocking(false)
    }
}

/// A listening socket accepting without blocking.
pub(crate) trait Listen {
    type C: Conn;
    fn try_accept(&self) -> std::io::Result<Option<Self::C>>;
}

impl Listen for UnixListener {
    type C = UnixStream;
    fn try_accept(&self) -> std::io::Result<Option<UnixStream>> {
        match self.accept() {
            Ok((s, _)) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Listen for TcpListener {
    type C = TcpStream;
    fn try_accept(&self) -> std::io::Result<Option<TcpStream>> {
        match self.accept() {
            Ok((s, _)) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Longest a joining connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

struct State<C> {
    /// Root: the connection of every other rank. Others: `[root]`.
    conns: Vec<Option<C>>,
    round: u32,
    broken: Option<String>,
}

pub(crate) struct Star<C: Conn> {
    rank: usize,
    world: usize,
    job: [u8; 16],
    timeout: Duration,
    state: Mutex<State<C>>,
    /// Rank 0 of a Unix rendezvous removes its socket file and directory.
    cleanup: Option<(PathBuf, PathBuf)>,
}

fn frame(kind: Kind, job: [u8; 16], sender: usize, round: u32, payload: Vec<u8>) -> Frame {
    Frame { kind, job, sender: sender as u32, round, payload }
}

impl<C: Conn> Star<C> {
    /// Rank 0: accept every other rank's hello, then welcome them.
    pub(crate) fn root<L: Listen<C = C>>(
        listener: L,
        world: usize,
        job: [u8; 16],
        timeout: Duration,
        cleanup: Option<(PathBuf, PathBuf)>,
    ) -> Result<Star<C>> {
        let deadline = Instant::now() + timeout;
        let mut conns: Vec<Option<C>> = (0..world).map(|_| None).collect();
        let mut joined = 1;
        while joined < world {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (1..world).filter(|r| conns[*r].is_none()).collect();
                return Err(Error::RendezvousTimeout {
                    what: format!("ranks {missing:?} did not join rank 0"),
                    waited_ms: timeout.as_millis() as u64,
                });
            }
            match listener.try_accept() {
                Ok(Some(mut conn)) => {
                    let wait = HELLO_TIMEOUT.min(deadline - now);
                    match Self::read_hello(&mut conn, world, &job, wait, &conns) {
                        Ok(sender) => {
                            conns[sender] = Some(conn);
                            joined += 1;
                        }
                        Err(why) => {
                            // Best effort: tell the peer why, then drop it.
                            let _ = wire::write_frame(&mut conn, &frame(Kind::Reject, job, 0, 0, why.into_bytes()));
                        }
                    }
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(2)),
                Err(e) => return Err(Error::io("accepting rendezvous connections", e)),
            }
        }
        for (r, conn) in conns.iter_mut().enumerate() {
            if let Some(c) = conn {
                let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
                c.set_timeouts(remaining).map_err(|e| Error::io("configuring a rendezvous socket", e))?;
                wire::write_frame(c, &frame(Kind::Welcome, job, 0, 0, Vec::new()))
                    .map_err(|e| Error::Rendezvous(format!("welcoming rank {r}: {e}")))?;
            }
        }
        Ok(Star { rank: 0, world, job, timeout, state: Mutex::new(State { conns, round: 0, broken: None }), cleanup })
    }

    fn read_hello(
        conn: &mut C,
        world: usize,
        job: &[u8; 16],
        wait: Duration,
        conns: &[Option<C>],
    ) -> std::result::Result<usize, String> {
        conn.set_blocking().map_err(|e| e.to_string())?;
        conn.set_timeouts(wait).map_err(|e| e.to_string())?;
        let f = wire::read_frame(conn, job).map_err(|e| format!("bad hello: {e}"))?;
        if f.kind != Kind::Hello || f.round != 0 {
            return Err(format!("expected a hello, got {:?}", f.kind));
        }
        let sender = f.sender as usize;
        if sender == 0 || sender >= world {
            return Err(format!("rank {sender} is out of range 1..{world}"));
        }
        if f.payload != (world as u32).to_le_bytes() {
            return Err(format!("rank {sender} disagrees on the world size"));
        }
        if conns[sender].is_some() {
            return Err(format!("rank {sender} already joined (duplicate)"));
        }
        Ok(sender)
    }

    /// Ranks 1..: connect (retrying while rank 0 is not up yet), hello, and
    /// wait for the welcome.
    pub(crate) fn member(
        connect: impl Fn() -> std::io::Result<C>,
        rank: usize,
        world: usize,
        job: [u8; 16],
        timeout: Duration,
    ) -> Result<Star<C>> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(5);
        let mut conn = loop {
            match connect() {
                Ok(c) => break c,
                Err(e) => {
                    let retry = matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound
                            | std::io::ErrorKind::ConnectionRefused
                            | std::io::ErrorKind::AddrNotAvailable
                    );
                    if !retry {
                        return Err(Error::io(format!("rank {rank}: connecting to rank 0"), e));
                    }
                    if Instant::now() + backoff >= deadline {
                        return Err(Error::RendezvousTimeout {
                            what: format!("rank {rank} could not reach rank 0 (is rank 0 running with the same id?)"),
                            waited_ms: timeout.as_millis() as u64,
                        });
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(100));
                }
            }
        };
        let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        conn.set_timeouts(remaining).map_err(|e| Error::io("configuring a rendezvous socket", e))?;
        wire::write_frame(&mut conn, &frame(Kind::Hello, job, rank, 0, (world as u32).to_le_bytes().to_vec()))
            .map_err(|e| Error::Rendezvous(format!("rank {rank}: sending hello: {e}")))?;
        let reply = wire::read_frame(&mut conn, &job).map_err(|e| match e {
            WireError::TimedOut => Error::RendezvousTimeout {
                what: format!("rank {rank}: rank 0 did not welcome it (other ranks missing?)"),
                waited_ms: timeout.as_millis() as u64,
            },
            other => Error::Protocol { from: "rank 0".into(), what: other.to_string() },
        })?;
        match reply.kind {
            Kind::Welcome => {}
            Kind::Reject => {
                return Err(Error::Rendezvous(format!(
                    "rank 0 rejected rank {rank}: {}",
                    String::from_utf8_lossy(&reply.payload)
                )))
            }
            other => {
                return Err(Error::Protocol { from: "rank 0".into(), what: format!("expected welcome, got {other:?}") })
            }
        }
        let mut conns: Vec<Option<C>> = vec![None];
        conns[0] = Some(conn);
        Ok(Star {
            rank,
            world,
            job,
            timeout,
            state: Mutex::new(State { conns, round: 0, broken: None }),
            cleanup: None,
        })
    }

    fn abort_others(state: &mut State<C>, job: [u8; 16], reason: &str) {
        for c in state.conns.iter_mut().flatten() {
            let _ = c.set_timeouts(Duration::from_millis(200));
            let _ = wire::write_frame(c, &frame(Kind::Abort, job, 0, state.round, reason.as_bytes().to_vec()));
        }
        state.broken = Some(reason.to_string());
    }

    fn gather_root(&self, state: &mut State<C>, round: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let deadline = Instant::now() + self.timeout;
        let mut parts: Vec<Vec<u8>> = Vec::with_capacity(self.world);
        parts.push(mine.to_vec());
        for r in 1..self.world {
            let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            let conn = state.conns[r].as_mut().expect("root holds every rank's connection");
            let got =
                conn.set_timeouts(remaining).map_err(WireError::Io).and_then(|_| wire::read_frame(conn, &self.job));
            let err = match got {
                Ok(f)
                    if f.kind == Kind::Gather
                        && f.sender as usize == r
                        && f.round == round
                        && f.payload.len() <= MAX_CONTRIBUTION =>
                {
                    parts.push(f.payload);
                    continue;
                }
                Ok(f) => Error::Protocol {
                    from: format!("rank {r}"),
                    what: format!(
                        "unexpected {:?} frame (sender {}, round {} of expected {round}, {} bytes)",
                        f.kind,
                        f.sender,
                        f.round,
                        f.payload.len()
                    ),
                },
                Err(WireError::Closed) => {
                    Error::Rendezvous(format!("rank {r} closed its connection (exited or crashed)"))
                }
                Err(WireError::TimedOut) => Error::RendezvousTimeout {
                    what: format!("rank {r} did not arrive at all-gather round {round}"),
                    waited_ms: self.timeout.as_millis() as u64,
                },
                Err(other) => Error::Protocol { from: format!("rank {r}"), what: other.to_string() },
            };
            Self::abort_others(state, self.job, &err.to_string());
            return Err(err);
        }
        let result = frame(Kind::Result, self.job, 0, round, wire::encode_contributions(&parts));
        for r in 1..self.world {
            let conn = state.conns[r].as_mut().expect("root holds every rank's connection");
            if let Err(e) = wire::write_frame(conn, &result) {
                let err =
                    Error::Rendezvous(format!("sending the result to rank {r} failed ({e}): it exited or crashed"));
                Self::abort_others(state, self.job, &err.to_string());
                return Err(err);
            }
        }
        Ok(parts)
    }

    fn gather_member(&self, state: &mut State<C>, round: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let rank = self.rank;
        let conn = state.conns[0].as_mut().expect("a member holds the root connection");
        conn.set_timeouts(self.timeout).map_err(|e| Error::io("configuring a rendezvous socket", e))?;
        wire::write_frame(conn, &frame(Kind::Gather, self.job, rank, round, mine.to_vec())).map_err(|e| {
            Error::Rendezvous(format!("rank {rank}: sending to rank 0 failed ({e}): rank 0 exited or crashed"))
        })?;
        let reply = wire::read_frame(conn, &self.job).map_err(|e| match e {
            WireError::Closed => {
                Error::Rendezvous(format!("rank {rank}: rank 0 closed the connection (exited or crashed)"))
            }
            WireError::TimedOut => Error::RendezvousTimeout {
                what: format!("rank {rank}: all-gather round {round} did not complete (a rank did not arrive)"),
                waited_ms: self.timeout.as_millis() as u64,
            },
            other => Error::Protocol { from: "rank 0".into(), what: other.to_string() },
        })?;
        match reply.kind {
            Kind::Result if reply.round == round && reply.sender == 0 => {
                wire::decode_contributions(&reply.payload, self.world)
                    .map_err(|e| Error::Protocol { from: "rank 0".into(), what: e.to_string() })
            }
            Kind::Abort => Err(Error::Rendezvous(format!(
                "rank {rank}: rank 0 aborted the rendezvous: {}",
                String::from_utf8_lossy(&reply.payload)
            ))),
            other => Err(Error::Protocol {
                from: "rank 0".into(),
                what: format!("expected the result of round {round}, got {other:?} (round {})", reply.round),
            }),
        }
    }
}

impl<C: Conn> Rendezvous for Star<C> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        if mine.len() > MAX_CONTRIBUTION {
            return Err(Error::invalid(format!(
                "rendezvous contribution of {} bytes exceeds {MAX_CONTRIBUTION}",
                mine.len()
            )));
        }
        let mut state = self.state.lock().map_err(|_| Error::Broken("rendezvous lock poisoned".into()))?;
        if let Some(why) = &state.broken {
            return Err(Error::Rendezvous(format!("rendezvous unusable after an earlier error: {why}")));
        }
        state.round = state.round.wrapping_add(1);
        let round = state.round;
        let result = if self.rank == 0 {
            self.gather_root(&mut state, round, mine)
        } else {
            self.gather_member(&mut state, round, mine)
        };
        if let Err(e) = &result {
            if state.broken.is_none() {
                state.broken = Some(e.to_string());
            }
        }
        result
    }
}

impl<C: Conn> Drop for Star<C> {
    fn drop(&mut self) {
        if let Some((socket, dir)) = &self.cleanup {
            let _ = std::fs::remove_file(socket);
            let _ = std::fs::remove_dir(dir);
        }
    }
}
