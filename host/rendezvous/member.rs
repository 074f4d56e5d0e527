//! Ranks 1..N-1 of the socket rendezvous (see the protocol in the module
//! docs): dial rank 0 (retrying while it is not up yet), HELLO, check rank
//! 0's CHALLENGE, PROOF, wait for WELCOME, and start over with a new
//! connection whenever the peer fails authentication or the connection
//! ends before WELCOME, until the timeout; then per round send GATHER and
//! wait for RESULT, checking that every frame opens under the session, is
//! rank 0's, of this job, round and kind, and that RESULT holds this
//! rank's own bytes.

#![forbid(unsafe_code)]

use std::io;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::auth::{self, Opener, Role, Sealer, Transcript};
use super::wire::{self, Checked, Greeting, Kind, WireError};
use super::{
    abort_for, error_from_abort, lock, ms, own_uid, read_frame, sealed, send_abort, tcp, unix, unusable, write_frame,
    Conn, Endpoint, Link, Rendezvous, MAX_ROUND_BYTES,
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
    seal: Sealer,
    open: Opener,
    round: u32,
    broken: Option<String>,
}

/// Connects to rank 0, retrying while it is not listening yet.
/// `refused`: why the last connection was given up, for the timeout error.
pub(super) fn dial(
    endpoint: &Endpoint,
    rank: usize,
    deadline: Instant,
    timeout: Duration,
    refused: Option<&Refused>,
) -> Result<Arc<dyn Conn>> {
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
            return Err(match refused {
                Some(r) => gave_up(rank, endpoint, timeout, r),
                None => Error::RendezvousTimeout {
                    what: format!("rank 0 was not reachable at {endpoint} within {} ms (last error: {e})", ms(timeout)),
                    waited_ms: timeout.as_millis() as u64,
                },
            });
        }
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Why a member's connections to rank 0 were given up so far.
pub(super) struct Refused {
    /// The last attempt's reason (an attempt cut short by the member's own
    /// deadline does not replace it).
    why: String,
    /// Whether any attempt met a rank 0 that proved it holds the secret.
    authenticated: bool,
}

/// The error of a member whose every connection to `endpoint` was refused
/// or failed authentication until its timeout.
fn gave_up(rank: usize, endpoint: &Endpoint, timeout: Duration, r: &Refused) -> Error {
    let what = match r.authenticated {
        false => format!(
            "rank {rank} could not join rank 0 at {endpoint} within {} ms: nothing there passed authentication as \
             rank 0 of this job (the last attempt: {})",
            ms(timeout),
            r.why
        ),
        true => format!(
            "rank {rank} could not join rank 0 at {endpoint} within {} ms; the last attempt: {}",
            ms(timeout),
            r.why
        ),
    };
    Error::RendezvousTimeout { what, waited_ms: timeout.as_millis() as u64 }
}

/// How one connection's join ended, when it did not end joined.
pub(super) enum Attempt {
    /// Nothing this peer said can be trusted, or the connection ended
    /// before WELCOME: dial again. `authenticated`: rank 0 had proved
    /// itself on this connection; `cut_short`: the member's own deadline
    /// ended the attempt (its reason says little).
    Retry { why: String, authenticated: bool, cut_short: bool },
    /// An authenticated rank 0 refused this rank, or the wait for WELCOME
    /// ran out: no new connection would help.
    Fail(Error),
}

impl Member {
    pub(super) fn join(link: Link, endpoint: &Endpoint, rank: usize) -> Result<Member> {
        let started = Instant::now();
        let deadline = started + link.timeout;
        let mut backoff = Duration::from_millis(1);
        let mut refused: Option<Refused> = None;
        loop {
            let conn = dial(endpoint, rank, deadline, link.timeout, refused.as_ref())?;
            let (why, authenticated, cut_short) = match attempt(&link, endpoint, rank, &conn, started) {
                Ok((seal, open)) => {
                    let inner = MemberInner { conn, seal, open, round: 0, broken: None };
                    return Ok(Member { link, rank, inner: Mutex::new(inner) });
                }
                Err(Attempt::Fail(e)) => {
                    conn.disconnect();
                    return Err(e);
                }
                Err(Attempt::Retry { why, authenticated, cut_short }) => (why, authenticated, cut_short),
            };
            conn.disconnect();
            let ever = authenticated || refused.as_ref().is_some_and(|r| r.authenticated);
            let r = match refused.take() {
                Some(earlier) if cut_short => Refused { authenticated: ever, ..earlier },
                _ => Refused { why, authenticated: ever },
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(gave_up(rank, endpoint, link.timeout, &r));
            }
            refused = Some(r);
            thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One round on rank 1..: send GATHER, wait for RESULT.
    fn exchange(&self, inner: &mut MemberInner, round: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let Link { job, world, timeout, limits, .. } = self.link;
        let rank = self.rank;
        let MemberInner { conn, seal, open, .. } = inner;
        let conn = &**conn;
        let started = Instant::now();
        if mine.len() > MAX_ROUND_BYTES - wire::result_overhead(world) {
            let err = Error::invalid(format!(
                "rank {rank}'s all_gather contribution of {} bytes exceeds the rendezvous limit of {MAX_ROUND_BYTES} \
                 bytes per round",
                mine.len()
            ));
            send_abort(conn, seal, &job, rank as u32, round, &abort_for(&err));
            return Err(err);
        }
        let frame = sealed(seal, Kind::Gather, &job, rank as u32, round, mine)?;
        if let Err(e) = write_frame(conn, started + timeout, &frame) {
            // Rank 0 may have sent an ABORT before closing: its reason is
            // the better error.
            let soon = Some(Instant::now() + Duration::from_millis(50));
            if let Ok(Checked::Aborted(a)) = read_frame(conn, soon, wire::MAX_PAYLOAD)
                .map_err(|_| ())
                .and_then(|f| f.open(open).map_err(|_| ()).map(|()| f))
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
        frame.open(open).map_err(|e| from_root(e.to_string()))?;
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

/// One connection's join, as rank `rank`: the peer's uid (Unix), HELLO,
/// rank 0's CHALLENGE (it must prove it holds the secret before this rank
/// says anything more), PROOF, then WELCOME or an authenticated refusal.
/// The session's sealer and opener once welcomed.
pub(super) fn attempt(
    link: &Link,
    endpoint: &Endpoint,
    rank: usize,
    conn: &Arc<dyn Conn>,
    started: Instant,
) -> std::result::Result<(Sealer, Opener), Attempt> {
    let conn = &**conn;
    let deadline = started + link.timeout;
    let retry =
        |authenticated: bool, why: String| Attempt::Retry { why, authenticated, cut_short: Instant::now() >= deadline };
    // Before rank 0 has proved itself, whatever the peer does is a failure
    // of authentication: say so.
    let unproven =
        |what: String| retry(false, format!("the process at {endpoint} did not authenticate as rank 0: {what}"));
    let fatal = Attempt::Fail;
    match conn.peer_uid() {
        Ok(Some(uid)) if uid != own_uid() => {
            return Err(unproven(format!(
                "it runs as uid {uid}, and this rank as uid {}; a Unix-socket rendezvous joins processes of one user \
                 only",
                own_uid()
            )))
        }
        Ok(_) => {}
        Err(e) => return Err(unproven(format!("its uid could not be read ({e})"))),
    }
    let member_nonce = auth::random::<{ auth::NONCE_LEN }>().map_err(fatal)?;
    let (job, world) = (link.job, link.world as u32);
    let tag = auth::hello_tag(&link.secret, &job, rank as u32, world, &member_nonce);
    let greeting = Greeting { world, nonce: member_nonce, tag };
    let hello = wire::encode(Kind::Hello, &job, rank as u32, 0, &wire::encode_greeting(&greeting))
        .map_err(|e| fatal(Error::Rendezvous(e.to_string())))?;
    write_frame(conn, deadline, &hello).map_err(|e| unproven(format!("sending it HELLO failed ({e})")))?;

    // Rank 0 answers as soon as it has accepted the connection; the wait
    // also covers time in its accept queue.
    let wait = (2 * link.limits.handshake_timeout).min(deadline.saturating_duration_since(Instant::now()));
    let frame = match read_frame(conn, Some(Instant::now() + wait), wire::MAX_CONTROL_PAYLOAD) {
        Ok(f) => f,
        Err(WireError::TimedOut) => return Err(unproven(format!("it sent no CHALLENGE within {} ms", ms(wait)))),
        Err(e) if e.is_disconnect() => {
            return Err(unproven(format!(
                "it closed the connection first ({e}; rank 0 drops connections it has no room for, and refuses \
                 some)"
            )))
        }
        Err(e) => return Err(unproven(format!("it sent no CHALLENGE but {e}"))),
    };
    let h = frame.header;
    if h.kind == Kind::Abort && !h.sealed {
        // Anyone on the port can say this; it is only shown if no later
        // attempt succeeds.
        let said = wire::decode_abort(&frame.payload).map(|a| a.reason).unwrap_or_else(|e| e);
        return Err(unproven(format!("it refused this rank without authenticating itself, saying: {said}")));
    }
    if h.kind != Kind::Challenge || h.sealed || h.job != job || h.sender != 0 || h.round != 0 {
        return Err(unproven(format!(
            "it answered HELLO with {}{} (job {}, sender {}, round {}), not rank 0's CHALLENGE",
            if h.sealed { "a sealed " } else { "" },
            h.kind.name(),
            if h.job == job { "this one" } else { "another" },
            h.sender,
            h.round
        )));
    }
    let challenge = wire::decode_greeting(&frame.payload, Kind::Challenge)
        .map_err(|why| unproven(format!("its CHALLENGE is malformed: {why}")))?;
    let t = Transcript {
        job,
        rank: rank as u32,
        member_world: world,
        member_nonce,
        root_world: challenge.world,
        root_nonce: challenge.nonce,
    };
    if !t.challenge_tag_ok(&link.secret, &challenge.tag) {
        return Err(unproven(
            "its CHALLENGE failed authentication: it was not made with this id's secret (another process holds \
             the address, or rank 0 was given another id)"
                .into(),
        ));
    }
    // Rank 0 is authentic from here on.
    if challenge.world != world {
        return Err(fatal(Error::Rendezvous(format!(
            "rank 0 was started with world size {}, rank {rank} with {world}",
            challenge.world
        ))));
    }
    let proof = wire::encode(Kind::Proof, &job, rank as u32, 0, &t.proof_tag(&link.secret))
        .map_err(|e| fatal(Error::Rendezvous(e.to_string())))?;
    write_frame(conn, deadline, &proof).map_err(|e| retry(true, format!("sending PROOF to rank 0 failed: {e}")))?;
    let (seal, mut open) = t.session(&link.secret, Role::Member);

    let wait = link.timeout + link.limits.grace;
    let frame = match read_frame(conn, Some(started + wait), wire::MAX_CONTROL_PAYLOAD) {
        Ok(f) => f,
        Err(WireError::TimedOut) => {
            return Err(fatal(Error::RendezvousTimeout {
                what: format!(
                    "rank {rank} got no WELCOME from rank 0 within {} ms (not all ranks joined, and rank 0 sent \
                     no diagnosis: is it running with the same timeout?)",
                    ms(wait)
                ),
                waited_ms: wait.as_millis() as u64,
            }))
        }
        Err(e) if e.is_disconnect() => {
            return Err(retry(
                true,
                format!(
                    "rank 0 closed the connection while rank {rank} was joining ({e}: it exited, or refused this rank)"
                ),
            ))
        }
        Err(e) => return Err(retry(true, format!("rank 0 sent no WELCOME but {e}"))),
    };
    if let Err(e) = frame.open(&mut open) {
        return Err(retry(true, format!("waiting for WELCOME, rank 0's connection carried a {e}")));
    }
    let from_root = |what: String| fatal(Error::Protocol { from: "rank 0".into(), what });
    match frame.check(&job, 0, Kind::Welcome, 0).map_err(from_root)? {
        Checked::Aborted(a) => Err(fatal(error_from_abort("rank 0", a))),
        Checked::Expected(p) => match wire::decode_world(&p).map_err(from_root)? {
            w if w == link.world => Ok((seal, open)),
            w => Err(from_root(format!("WELCOME for world size {w}, expected {}", link.world))),
        },
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
    use crate::rendezvous::wire::{Abort, AbortCode, Frame};
    use crate::rendezvous::{connect, Id};
    use std::fs;
    use std::os::fd::AsRawFd;

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

    /// A process at rank 0's socket path that accepts nothing, its backlog
    /// full: a member's dial must not block past the member's timeout
    /// (a blocking connect(2) to a Unix socket waits for room in the
    /// backlog, without a bound of its own).
    #[test]
    fn a_full_backlog_does_not_hold_the_dial_past_the_timeout() {
        use nix::sys::socket::{self as sock, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        let id = unix_id();
        let Endpoint::Unix(path) = id.endpoint.clone() else { unreachable!() };
        let stream = || sock::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK, None).unwrap();
        let addr = UnixAddr::new(&path).unwrap();
        let listener = stream();
        sock::bind(listener.as_raw_fd(), &addr).unwrap();
        sock::listen(&listener, Backlog::new(0).unwrap()).unwrap();
        let mut queued = Vec::new();
        loop {
            let s = stream();
            match sock::connect(s.as_raw_fd(), &addr) {
                Ok(()) => queued.push(s),
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => panic!("filling the backlog: {e}"),
            }
            assert!(queued.len() < 64, "the backlog never filled");
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let member_id = id.clone();
        thread::spawn(move || {
            let started = Instant::now();
            let result = connect(&member_id, 1, 2, Duration::from_millis(300)).err();
            let _ = tx.send((result, started.elapsed()));
        });
        let (err, took) = rx.recv_timeout(Duration::from_secs(5)).expect("the dial blocked past its timeout");
        let err = err.expect("joined a listener that accepts nothing");
        assert!(matches!(err, Error::RendezvousTimeout { .. }), "{err}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        drop((listener, queued));
        id.remove_files();
    }

    /// A rank 0 played by the test on a TCP port it holds: `play` handles
    /// each connection the member makes, until the member's `connect` and
    /// one round return; their error, and how long the member took.
    fn against_fake(timeout: Duration, play: &(dyn Fn(&Id, Arc<dyn Conn>) + Sync)) -> (Error, Duration) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let id = Id::new_tcp(listener.local_addr().unwrap());
        let started = Instant::now();
        let err = thread::scope(|s| {
            let member = s.spawn(|| connect(&id, 1, 2, timeout)?.all_gather(b"mine"));
            while !member.is_finished() {
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).unwrap();
                        play(&id, Arc::new(stream));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(1)),
                    Err(e) => panic!("{e}"),
                }
            }
            member.join().unwrap().expect_err("the member accepted a bad rank 0")
        });
        (err, started.elapsed())
    }

    fn abort(code: AbortCode, reason: &str) -> Vec<u8> {
        wire::encode_abort(&Abort { code, waited_ms: 700, reason: reason.into() })
    }

    /// What a fake rank 0 without the secret sends, from the member's HELLO
    /// (empty: it closes; `None`: it stays silent).
    type Unauthenticated = Box<dyn Fn(&Frame) -> Option<Vec<u8>> + Sync>;

    /// A fake rank 0 that does not hold the secret answers every HELLO
    /// badly: the member never trusts it, dials again until its timeout,
    /// and then fails naming rank 0 and what the last attempt met.
    #[test]
    fn member_retries_past_a_rank_0_that_cannot_authenticate() {
        let challenge = |f: &Frame, job: [u8; 16], tag: [u8; 32]| {
            let hello = wire::decode_greeting(&f.payload, Kind::Hello).unwrap();
            let g = wire::Greeting { world: 2, nonce: [4; 32], tag: if tag == [0; 32] { hello.tag } else { tag } };
            raw_frame(Kind::Challenge, &job, 0, 0, &wire::encode_greeting(&g))
        };
        let cases: Vec<(&str, Unauthenticated, &str)> = vec![
            ("closes", Box::new(|_| Some(vec![])), "it closed the connection first"),
            ("silent", Box::new(|_| None), "sent no CHALLENGE within"),
            (
                "plain refusal",
                Box::new(|f| Some(raw_frame(Kind::Abort, &f.header.job, 0, 0, &abort(AbortCode::Rejected, "go away")))),
                "refused this rank without authenticating itself, saying: go away",
            ),
            ("garbage", Box::new(|_| Some(vec![0xAB; 40])), "it sent no CHALLENGE but not a rendezvous frame"),
            (
                "challenge without the secret",
                Box::new(move |f| Some(challenge(f, f.header.job, [1; 32]))),
                "its CHALLENGE failed authentication",
            ),
            (
                "challenge carrying the member's own HELLO tag",
                Box::new(move |f| Some(challenge(f, f.header.job, [0; 32]))),
                "its CHALLENGE failed authentication: it was not made with this id's secret",
            ),
            (
                "its HELLO reflected",
                Box::new(|f| Some(f.raw_header.iter().chain(&f.payload).copied().collect())),
                "answered HELLO with HELLO",
            ),
            (
                "WELCOME without a CHALLENGE",
                Box::new(|f| Some(raw_frame(Kind::Welcome, &f.header.job, 0, 0, &wire::encode_world(2)))),
                "answered HELLO with WELCOME",
            ),
            (
                "challenge of another job",
                Box::new(move |f| Some(challenge(f, [3; 16], [1; 32]))),
                "(job another, sender 0, round 0)",
            ),
        ];
        let timeout = Duration::from_millis(400);
        for (name, reply, text) in &cases {
            let (err, took) = against_fake(timeout, &|_, conn: Arc<dyn Conn>| {
                let Ok(hello) = read_frame(&*conn, Some(Instant::now() + LONG), 128) else { return };
                match reply(&hello) {
                    Some(b) if b.is_empty() => conn.disconnect(),
                    Some(b) => drop(write_frame(&*conn, Instant::now() + LONG, &b)),
                    // Past the member's timeout.
                    None => thread::sleep(Duration::from_millis(600)),
                }
            });
            assert!(took < timeout + Duration::from_secs(2), "{name}: {took:?}");
            let msg = err.to_string();
            assert!(matches!(err, Error::RendezvousTimeout { .. }), "{name}: {msg}");
            assert!(msg.contains("rank 1 could not join rank 0") && msg.contains(text), "{name}: {msg}");
            assert!(msg.contains("nothing there passed authentication as rank 0 of this job"), "{name}: {msg}");
        }
    }

    /// When the authenticated fake rank 0 answers badly.
    #[derive(PartialEq)]
    enum At {
        /// Instead of WELCOME: fails the member at once.
        Join,
        /// Instead of WELCOME, something the member does not trust: it
        /// dials again until its timeout.
        JoinRetried,
        /// Instead of round 1's RESULT.
        Round,
    }

    /// What the fake rank 0 sends, sealed with its session unless the case
    /// says otherwise (empty: it closes).
    type Reply = Box<dyn Fn(&mut Session) -> Vec<u8> + Sync>;

    /// The bad answers of `member_refuses_a_bad_authenticated_rank_0`:
    /// (name, when, what rank 0 sends, expected text).
    fn bad_rank_0_cases() -> Vec<(&'static str, At, Reply, &'static str)> {
        fn parts(v: &[&[u8]]) -> Vec<u8> {
            wire::encode_result(&v.iter().map(|p| p.to_vec()).collect::<Vec<_>>())
        }
        vec![
            (
                "refuses",
                At::Join,
                Box::new(|s| s.frame(Kind::Abort, 0, &abort(AbortCode::Rejected, "rank 1 has already joined"))),
                "rank 0 refused this rank: rank 1 has already joined",
            ),
            (
                "wrong world",
                At::Join,
                Box::new(|s| s.frame(Kind::Welcome, 0, &wire::encode_world(3))),
                "WELCOME for world size 3",
            ),
            (
                "foreign job",
                At::Join,
                Box::new(|s| {
                    s.job = [3; 16];
                    s.frame(Kind::Welcome, 0, &wire::encode_world(2))
                }),
                "wrong job id",
            ),
            (
                "wrong sender",
                At::Join,
                Box::new(|s| {
                    s.me = 1;
                    s.frame(Kind::Welcome, 0, &wire::encode_world(2))
                }),
                "claims sender rank 1",
            ),
            ("closes", At::JoinRetried, Box::new(|_| vec![]), "rank 0 closed the connection while rank 1 was joining"),
            (
                "plain WELCOME",
                At::JoinRetried,
                Box::new(|s| raw_frame(Kind::Welcome, &s.job, 0, 0, &wire::encode_world(2))),
                "WELCOME frame without a tag",
            ),
            (
                "plain ABORT",
                At::JoinRetried,
                Box::new(|s| raw_frame(Kind::Abort, &s.job, 0, 0, &abort(AbortCode::Rejected, "forged"))),
                "ABORT frame without a tag",
            ),
            (
                "altered WELCOME",
                At::JoinRetried,
                Box::new(|s| {
                    let mut f = s.frame(Kind::Welcome, 0, &wire::encode_world(2));
                    f[wire::HEADER_LEN] ^= 1;
                    f
                }),
                "WELCOME frame failed authentication",
            ),
            ("garbage", At::JoinRetried, Box::new(|_| vec![0xAB; 40]), "not a rendezvous frame"),
            ("closes in round", At::Round, Box::new(|_| vec![]), "rank 0 closed the connection in round 1"),
            (
                "not my bytes",
                At::Round,
                Box::new(|s| s.frame(Kind::Result, 1, &parts(&[b"zero", b"forged"]))),
                "own contribution",
            ),
            (
                "old round",
                At::Round,
                Box::new(|s| s.frame(Kind::Result, 2, &parts(&[b"zero", b"mine"]))),
                "round 2, expected round 1",
            ),
            (
                "wrong count",
                At::Round,
                Box::new(|s| s.frame(Kind::Result, 1, &parts(&[b"zero", b"mine", b"extra"]))),
                "holds 3 contributions",
            ),
            (
                "huge length",
                At::Round,
                Box::new(|s| {
                    let mut b = s.frame(Kind::Result, 1, b"");
                    b[36..40].copy_from_slice(&u32::MAX.to_le_bytes());
                    b
                }),
                "exceeds the limit",
            ),
            (
                "relayed timeout",
                At::Round,
                Box::new(|s| s.frame(Kind::Abort, 1, &abort(AbortCode::Timeout, "ranks [5] did not send"))),
                "rank 0 reports: ranks [5] did not send",
            ),
            (
                "plain RESULT",
                At::Round,
                Box::new(|s| raw_frame(Kind::Result, &s.job, 0, 1, &parts(&[b"zero", b"mine"]))),
                "RESULT frame without a tag",
            ),
            (
                "a RESULT sealed out of order",
                At::Round,
                Box::new(|s| {
                    let _skipped = s.frame(Kind::Result, 1, b"");
                    s.frame(Kind::Result, 1, &parts(&[b"zero", b"mine"]))
                }),
                "RESULT frame failed authentication",
            ),
        ]
    }

    /// Rank 1 against a fake rank 0 that holds the secret (it completes the
    /// handshake) but answers badly during the join or in round 1: rank 1
    /// fails with an error naming rank 0 and saying what was wrong, at once
    /// (or, for what it cannot trust, at its timeout).
    #[test]
    fn member_refuses_a_bad_authenticated_rank_0() {
        for (name, at, reply, text) in &bad_rank_0_cases() {
            let timeout = if *at == At::JoinRetried { Duration::from_millis(500) } else { Duration::from_secs(3) };
            let (err, took) = against_fake(timeout, &|id, conn| {
                let Ok((mut session, hello)) = root_handshake(conn, id, 2) else { return };
                assert_eq!(hello.header.sender, 1);
                if *at == At::Round {
                    session.send(Kind::Welcome, 0, &wire::encode_world(2));
                    let gather = session.recv().unwrap();
                    assert_eq!((gather.header.kind, gather.payload.as_slice()), (Kind::Gather, &b"mine"[..]));
                }
                let bytes = reply(&mut session);
                if bytes.is_empty() {
                    session.conn.disconnect();
                } else {
                    let _ = write_frame(&*session.conn, Instant::now() + LONG, &bytes);
                    // Held open until the member is done with it.
                    let _ = read_frame(&*session.conn, Some(Instant::now() + LONG), 64);
                }
            });
            let msg = err.to_string();
            assert!(msg.contains(text) && msg.contains("rank 0"), "{name}: {msg}");
            let bound = if *at == At::JoinRetried { timeout + Duration::from_secs(2) } else { Duration::from_secs(2) };
            assert!(took < bound, "{name}: {took:?}");
        }
    }

    /// An authenticated rank 0 started with another world size: the member
    /// sees it in the CHALLENGE and fails at once, saying so.
    #[test]
    fn member_fails_at_once_on_an_authenticated_world_size_mismatch() {
        let (err, took) = against_fake(Duration::from_secs(3), &|id, conn| {
            let _ = root_handshake(conn, id, 3);
        });
        assert!(took < Duration::from_secs(2), "{took:?}");
        assert!(err.to_string().contains("rank 0 was started with world size 3, rank 1 with 2"), "{err}");
    }
}
