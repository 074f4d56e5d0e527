//! Rank 0 of the socket rendezvous (see the protocol in the module docs):
//! the join (accepting connections, reading each one's HELLO on its own
//! thread, admitting one per rank, WELCOME), then one reader thread per
//! rank feeding a channel from which each round collects every GATHER and
//! answers RESULT, or ABORTs everyone with the reason.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::wire::{self, Abort, AbortCode, Checked, Frame, Kind, WireError};
use super::{
    abort_for, lock, ms, read_frame, send_abort, unusable, write_frame, Conn, Link, Listen, Rendezvous, MAX_ROUND_BYTES,
};
use crate::error::{Error, Result};

/// How often rank 0 polls its non-blocking listener during the join (std
/// has no accept with a timeout; this runs only until everyone has joined).
const ACCEPT_POLL: Duration = Duration::from_millis(2);
/// Connections rank 0 accepts per poll of its listener.
const ACCEPTS_PER_POLL: usize = 16;

/// Rank 0 of a socket rendezvous: one connection per other rank, each read
/// by its own thread into one channel (so rank 0 waits on all at once).
pub(super) struct Root {
    link: Link,
    inner: Mutex<RootInner>,
}

struct RootInner {
    round: u32,
    /// `conns[r - 1]` is rank r's connection.
    conns: Vec<Arc<dyn Conn>>,
    /// `None` only while dropping.
    events: Option<mpsc::Receiver<Event>>,
    /// Per rank, the first event that arrived after its contribution to a
    /// round: it belongs to the next round (where a frame is a violation and
    /// end of stream means the rank left).
    deferred: Vec<Option<Event>>,
    readers: Vec<JoinHandle<()>>,
    broken: Option<String>,
}

enum Event {
    Frame { rank: usize, frame: Frame },
    Failed { rank: usize, error: WireError },
}

impl Event {
    fn rank(&self) -> usize {
        match self {
            Event::Frame { rank, .. } | Event::Failed { rank, .. } => *rank,
        }
    }
}

/// A connection's HELLO, read on its own thread.
struct Hello {
    key: u64,
    conn: Arc<dyn Conn>,
    outcome: std::result::Result<usize, String>,
}

/// Reasons connections were refused during the join, for the timeout
/// message (a rank that "did not join" may have tried and been refused).
#[derive(Default)]
struct Refusals {
    shown: Vec<String>,
    count: usize,
}

impl Refusals {
    fn note(&mut self, why: String) {
        self.count += 1;
        if self.shown.len() < 4 && !self.shown.contains(&why) {
            self.shown.push(why);
        }
    }

    fn describe(&self) -> String {
        match self.count {
            0 => String::new(),
            n => format!("; {n} connection(s) were refused: {}", self.shown.join("; ")),
        }
    }
}

impl Root {
    pub(super) fn join(link: Link, listener: Box<dyn Listen>) -> Result<Root> {
        let started = Instant::now();
        let slots = accept_hellos(&link, &*listener, started + link.timeout);
        // Stop listening before anything else: the socket file and private
        // directory go away, and nobody else can connect.
        drop(listener);
        let conns = slots?;

        let welcome = wire::encode(Kind::Welcome, &link.job, 0, 0, &wire::encode_world(link.world))
            .map_err(|e| Error::Rendezvous(e.to_string()))?;
        let deadline = Instant::now() + link.timeout;
        for (i, conn) in conns.iter().enumerate() {
            if let Err(e) = write_frame(&**conn, deadline, &welcome) {
                let err = Error::Rendezvous(format!("rank {} joined but sending it WELCOME failed: {e}", i + 1));
                abort_all(&link, &conns, 0, &abort_for(&err));
                return Err(err);
            }
        }

        // Bounded, so a flooding rank cannot grow rank 0's memory without end.
        let (tx, rx) = mpsc::sync_channel(2 * link.world + 2);
        let mut readers = Vec::with_capacity(conns.len());
        for (i, conn) in conns.iter().enumerate() {
            let (conn, tx, rank) = (conn.clone(), tx.clone(), i + 1);
            let spawned =
                thread::Builder::new().name(format!("tpar-rdv-{rank}")).spawn(move || read_loop(rank, &*conn, tx));
            match spawned {
                Ok(h) => readers.push(h),
                Err(e) => {
                    let err = Error::io("starting a rendezvous reader thread", e);
                    abort_all(&link, &conns, 0, &abort_for(&err));
                    conns.iter().for_each(|c| c.disconnect());
                    readers.into_iter().for_each(|h| drop(h.join()));
                    return Err(err);
                }
            }
        }
        Ok(Root {
            link,
            inner: Mutex::new(RootInner {
                round: 0,
                conns,
                events: Some(rx),
                deferred: (0..link.world).map(|_| None).collect(),
                readers,
                broken: None,
            }),
        })
    }
}

/// Rank 0's join phase: accepts connections and admits one valid HELLO per
/// rank 1..N-1 until all have joined or `deadline` passes. Refused
/// connections never fail the join. Returns the connections in rank order.
fn accept_hellos(link: &Link, listener: &dyn Listen, deadline: Instant) -> Result<Vec<Arc<dyn Conn>>> {
    let mut join = Join::new(link);
    while join.missing > 0 && Instant::now() < deadline {
        join.accept_waiting(listener);
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(hello) = join.hellos.recv_timeout(ACCEPT_POLL.min(left)) else { continue };
        join.admit(hello);
        // Every other HELLO read by now too: each refused connection holds
        // a socket until it is reaped here, and up to `ACCEPTS_PER_POLL`
        // arrive per poll.
        while join.missing > 0 {
            let Ok(hello) = join.hellos.try_recv() else { break };
            join.admit(hello);
        }
    }
    join.finish()
}

/// What rank 0 knows while its join is in progress.
struct Join<'a> {
    link: &'a Link,
    /// `slots[r]` is rank r's connection once admitted (`slots[0]` stays empty).
    slots: Vec<Option<Arc<dyn Conn>>>,
    missing: usize,
    /// Cloned into each HELLO reader thread, which sends to `hellos`.
    tx: mpsc::Sender<Hello>,
    hellos: mpsc::Receiver<Hello>,
    /// Connections whose HELLO is being read or awaits `admit`, by key.
    pending: HashMap<u64, (Arc<dyn Conn>, JoinHandle<()>)>,
    /// Those of `pending` whose HELLO is still being read: what
    /// `max_pending` limits (a refused connection that awaits `admit` no
    /// longer waits for anything).
    reading: Arc<AtomicUsize>,
    next_key: u64,
    refusals: Refusals,
}

impl<'a> Join<'a> {
    fn new(link: &'a Link) -> Join<'a> {
        let (tx, hellos) = mpsc::channel::<Hello>();
        Join {
            link,
            slots: vec![None; link.world],
            missing: link.world - 1,
            tx,
            hellos,
            pending: HashMap::new(),
            reading: Arc::new(AtomicUsize::new(0)),
            next_key: 0,
            refusals: Refusals::default(),
        }
    }

    /// Takes the connections that are waiting (a bounded number per pass,
    /// so a flood of connections cannot keep the join past its deadline).
    fn accept_waiting(&mut self, listener: &dyn Listen) {
        for _ in 0..ACCEPTS_PER_POLL {
            match listener.accept() {
                Ok(Some(conn)) => self.start_hello_reader(conn),
                Ok(None) => break,
                // Out of file descriptors, a connection reset before accept...:
                // the good ranks may still get through, so keep going.
                Err(e) => {
                    self.refusals.note(format!("accept failed: {e}"));
                    break;
                }
            }
        }
    }

    /// Reads `conn`'s HELLO on a thread of its own, unless too many are
    /// pending already.
    fn start_hello_reader(&mut self, conn: Arc<dyn Conn>) {
        let max_pending = self.link.limits.max_pending;
        if self.reading.load(Ordering::Acquire) >= max_pending {
            conn.disconnect();
            self.refusals.note(format!("more than {max_pending} connections sent no HELLO yet"));
            return;
        }
        let (key, tx, c, l) = (self.next_key, self.tx.clone(), conn.clone(), *self.link);
        self.next_key += 1;
        let reading = self.reading.clone();
        reading.fetch_add(1, Ordering::AcqRel);
        let spawned = thread::Builder::new().name("tpar-rdv-hello".into()).spawn(move || {
            let outcome = read_hello(&l, &*c);
            if outcome.is_err() {
                c.disconnect();
            }
            reading.fetch_sub(1, Ordering::AcqRel);
            let _ = tx.send(Hello { key, conn: c, outcome });
        });
        match spawned {
            Ok(h) => {
                self.pending.insert(key, (conn, h));
            }
            Err(e) => {
                self.reading.fetch_sub(1, Ordering::AcqRel);
                conn.disconnect();
                self.refusals.note(format!("could not start a thread for a connection: {e}"));
            }
        }
    }

    /// Admits a connection whose HELLO was good, for a rank that has not
    /// joined yet; refuses a second one for the same rank.
    fn admit(&mut self, hello: Hello) {
        if let Some((_, h)) = self.pending.remove(&hello.key) {
            let _ = h.join();
        }
        match hello.outcome {
            Ok(rank) if self.slots[rank].is_some() => {
                let why = format!("rank {rank} has already joined (duplicate rank; the first connection wins)");
                send_abort(
                    &*hello.conn,
                    &self.link.job,
                    0,
                    0,
                    &Abort { code: AbortCode::Rejected, waited_ms: 0, reason: why.clone() },
                );
                hello.conn.disconnect();
                self.refusals.note(why);
            }
            Ok(rank) => {
                self.slots[rank] = Some(hello.conn);
                self.missing -= 1;
            }
            Err(why) => self.refusals.note(why),
        }
    }

    /// Ends the join: closes the connections still silent, and returns the
    /// admitted ones, or the timeout (sent to the admitted ones as ABORT).
    fn finish(mut self) -> Result<Vec<Arc<dyn Conn>>> {
        // Connections still silent are not needed (or it is too late): shutting
        // them down makes their HELLO reads return at once.
        for (_, (conn, h)) in self.pending.drain() {
            conn.disconnect();
            let _ = h.join();
        }
        let joined: Vec<Arc<dyn Conn>> = self.slots.iter().flatten().cloned().collect();
        if self.missing == 0 {
            return Ok(joined);
        }
        let link = self.link;
        let absent: Vec<usize> = (1..link.world).filter(|&r| self.slots[r].is_none()).collect();
        let err = Error::RendezvousTimeout {
            what: format!("ranks {absent:?} did not join within {} ms{}", ms(link.timeout), self.refusals.describe()),
            waited_ms: link.timeout.as_millis() as u64,
        };
        abort_all(link, &joined, 0, &abort_for(&err));
        joined.iter().for_each(|c| c.disconnect());
        Err(err)
    }
}

/// Reads and checks a new connection's HELLO; the rank it joins as, or why
/// it is refused (having told the peer when its header was readable).
fn read_hello(link: &Link, conn: &dyn Conn) -> std::result::Result<usize, String> {
    let limit = link.limits.hello_timeout;
    let frame = match read_frame(conn, Some(Instant::now() + limit), wire::HELLO_PAYLOAD) {
        Ok(f) => f,
        Err(WireError::TimedOut) => return Err(format!("a connection sent no complete HELLO within {} ms", ms(limit))),
        Err(WireError::Closed) => return Err("a connection closed without a HELLO".into()),
        Err(e) => return Err(format!("a connection sent a malformed HELLO: {e}")),
    };
    let h = frame.header;
    let check = || -> std::result::Result<usize, String> {
        if h.job != link.job {
            return Err("HELLO with a wrong job id (a process of another job?)".into());
        }
        if h.kind != Kind::Hello {
            return Err(format!("a connection opened with {} instead of HELLO", h.kind.name()));
        }
        if h.round != 0 {
            return Err(format!("HELLO for round {}, expected round 0", h.round));
        }
        let rank = h.sender as usize;
        if rank == 0 || rank >= link.world {
            return Err(format!(
                "HELLO from rank {rank}, outside 1..={} for world size {}",
                link.world - 1,
                link.world
            ));
        }
        let theirs = wire::decode_world(&frame.payload)?;
        if theirs != link.world {
            return Err(format!("rank {rank} was started with world size {theirs}, rank 0 with {}", link.world));
        }
        Ok(rank)
    };
    check().inspect_err(|why| {
        // Reply with the job id the peer sent, never ours: the job id is what
        // admits a rank, and this peer has not shown it knows it.
        let abort = Abort { code: AbortCode::Rejected, waited_ms: 0, reason: why.clone() };
        send_abort(conn, &h.job, 0, 0, &abort);
    })
}

/// Rank 0's reader for rank `rank`: forwards frames until the connection
/// fails or closes, then forwards that and stops.
fn read_loop(rank: usize, conn: &dyn Conn, tx: mpsc::SyncSender<Event>) {
    if let Err(e) = conn.set_read_timeout(None) {
        let _ = tx.send(Event::Failed { rank, error: WireError::Io(e) });
        return;
    }
    loop {
        let event = match read_frame(conn, None, wire::MAX_PAYLOAD) {
            Ok(frame) => Event::Frame { rank, frame },
            Err(error) => Event::Failed { rank, error },
        };
        let last = matches!(event, Event::Failed { .. });
        if tx.send(event).is_err() || last {
            return;
        }
    }
}

/// Sends an ABORT to every connection (best effort).
fn abort_all(link: &Link, conns: &[Arc<dyn Conn>], round: u32, abort: &Abort) {
    for conn in conns {
        send_abort(&**conn, &link.job, 0, round, abort);
    }
}

impl Root {
    /// One round on rank 0: collect GATHER from every rank, send RESULT.
    fn gather(&self, inner: &mut RootInner, round: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let Link { job, world, timeout, .. } = self.link;
        if mine.len() > MAX_ROUND_BYTES - wire::result_overhead(world) {
            return Err(Error::invalid(format!(
                "rank 0's all_gather contribution of {} bytes exceeds the rendezvous limit of {MAX_ROUND_BYTES} bytes per round",
                mine.len()
            )));
        }
        let parts = self.collect(inner, round, mine)?;
        let total = wire::result_overhead(world) + parts.iter().map(Vec::len).sum::<usize>();
        if total > MAX_ROUND_BYTES {
            return Err(Error::invalid(format!(
                "round {round} of all_gather holds {total} bytes, over the rendezvous limit of {MAX_ROUND_BYTES}"
            )));
        }
        let frame = wire::encode(Kind::Result, &job, 0, round, &wire::encode_result(&parts))
            .map_err(|e| Error::Rendezvous(e.to_string()))?;
        let deadline = Instant::now() + timeout;
        for (i, conn) in inner.conns.iter().enumerate() {
            write_frame(&**conn, deadline, &frame).map_err(|e| {
                Error::Rendezvous(format!("sending round {round}'s result to rank {} failed: {e}", i + 1))
            })?;
        }
        Ok(parts)
    }

    /// Waits up to the timeout for every other rank's GATHER of `round`;
    /// every rank's bytes, rank 0's being `mine`.
    fn collect(&self, inner: &mut RootInner, round: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let Link { job, world, timeout, .. } = self.link;
        let deadline = Instant::now() + timeout;
        let mut parts: Vec<Option<Vec<u8>>> = vec![None; world];
        parts[0] = Some(mine.to_vec());
        let mut missing = world - 1;
        let RootInner { events, deferred, .. } = inner;
        let events = events.as_ref().ok_or_else(|| unusable("closed"))?;
        let mut earlier: Vec<Event> = deferred.iter_mut().filter_map(Option::take).collect();
        earlier.reverse();

        while missing > 0 {
            let event = match earlier.pop() {
                Some(e) => e,
                None => match events.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(e) => e,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        let absent: Vec<usize> = (1..world).filter(|&r| parts[r].is_none()).collect();
                        return Err(Error::RendezvousTimeout {
                            what: format!(
                                "ranks {absent:?} did not send round {round} of all_gather within {} ms",
                                ms(timeout)
                            ),
                            waited_ms: timeout.as_millis() as u64,
                        });
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        return Err(Error::Rendezvous("every connection to the other ranks is closed".into()))
                    }
                },
            };
            let rank = event.rank();
            if parts[rank].is_some() {
                if deferred[rank].is_none() {
                    deferred[rank] = Some(event);
                }
                continue;
            }
            parts[rank] = Some(contribution(&job, round, event)?);
            missing -= 1;
        }
        Ok(parts.into_iter().map(Option::unwrap_or_default).collect())
    }
}

/// Rank `event.rank()`'s bytes for `round`, or the error naming it: it
/// left, broke the framing, sent the wrong frame, or aborted.
fn contribution(job: &[u8; 16], round: u32, event: Event) -> Result<Vec<u8>> {
    let rank = event.rank();
    let frame = match event {
        Event::Frame { frame, .. } => frame,
        Event::Failed { error, .. } if error.is_disconnect() => {
            return Err(Error::Rendezvous(format!(
                "rank {rank} closed its connection before round {round} ({error}: its process exited, \
                 crashed or dropped its rendezvous)"
            )))
        }
        Event::Failed { error, .. } => {
            return Err(Error::Protocol { from: format!("rank {rank}"), what: format!("round {round}: {error}") })
        }
    };
    match frame.check(job, rank, Kind::Gather, round) {
        Ok(Checked::Expected(p)) => Ok(p),
        Ok(Checked::Aborted(a)) => Err(Error::Rendezvous(format!("rank {rank} aborted round {round}: {}", a.reason))),
        Err(what) => Err(Error::Protocol { from: format!("rank {rank}"), what: format!("round {round}: {what}") }),
    }
}

impl Rendezvous for Root {
    fn rank(&self) -> usize {
        0
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
        self.gather(&mut inner, round, mine).inspect_err(|err| {
            // Tell the others, so they fail now with the reason instead of
            // timing out; the rendezvous is unusable from here on.
            let abort = abort_for(err);
            abort_all(&self.link, &inner.conns, round, &abort);
            inner.broken = Some(abort.reason);
        })
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let inner = match self.inner.get_mut() {
            Ok(i) => i,
            Err(poisoned) => poisoned.into_inner(),
        };
        inner.conns.iter().for_each(|c| c.disconnect());
        // A reader blocked on a full channel returns once the receiver is gone.
        inner.events = None;
        for h in inner.readers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::testing::*;
    use crate::rendezvous::{connect, connect_with, Limits};
    use std::collections::VecDeque;
    use std::io;
    use std::os::unix::net::UnixStream;

    /// A listener that hands rank 0 ready-made connections, `per_poll` at
    /// a time (then "none waiting" once).
    struct Scripted {
        queue: Mutex<(VecDeque<Arc<dyn Conn>>, usize)>,
        per_poll: usize,
    }

    impl Listen for Scripted {
        fn accept(&self) -> io::Result<Option<Arc<dyn Conn>>> {
            let (queue, given) = &mut *self.queue.lock().unwrap();
            if *given == self.per_poll {
                *given = 0;
                return Ok(None);
            }
            *given += 1;
            Ok(queue.pop_front())
        }
    }

    /// A connection whose peer sends `bytes` (if any) and closes its side;
    /// the peer's end, to read rank 0's answer from.
    fn sent(bytes: Option<&[u8]>) -> (Arc<dyn Conn>, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        if let Some(bytes) = bytes {
            write_frame(&theirs, Instant::now() + LONG, bytes).unwrap();
            theirs.shutdown(std::net::Shutdown::Write).unwrap();
        }
        (Arc::new(ours), theirs)
    }

    /// A stream of bad connections whose HELLOs are refused at once, two
    /// arriving per poll of the listener, never holds rank 0's slots for
    /// HELLOs being read: each is refused with its reason (none is closed
    /// unread as one too many), and the good rank that comes after them
    /// joins. (Rank 0 used to count a refused connection as pending until
    /// its main loop got to it, one per poll, so with more arriving per
    /// poll the count only grew: from the `max_pending`-th bad connection
    /// on, every connection, good ranks included, was closed unread.)
    /// The limit is 64: the old count reaches ~100 over 200 connections (it
    /// grew by one a poll), while a correct rank 0 exceeds it only with 64
    /// HELLO reader threads not yet run at once. At 32 a CI run on a
    /// loaded two-core machine failed that way (connection 161 reset).
    #[test]
    fn refused_connections_do_not_fill_the_pending_limit() {
        let job = [5; 16];
        let limits = Limits { max_pending: 64, ..Limits::for_timeout(LONG) };
        let link = Link { job, world: 2, timeout: LONG, limits };
        let (mut queue, mut peers) = (VecDeque::new(), Vec::new());
        for _ in 0..200 {
            let (conn, peer) = sent(Some(&raw_hello(&job, 1, 3)));
            queue.push_back(conn);
            peers.push(peer);
        }
        // The good rank sends its HELLO once every bad one was answered:
        // rank 0 closes the connections it is still reading when the join
        // ends.
        let (good, good_peer) = sent(None);
        queue.push_back(good.clone());
        let listener = Scripted { queue: Mutex::new((queue, 0)), per_poll: 2 };
        thread::scope(|s| {
            let joined = s.spawn(|| accept_hellos(&link, &listener, Instant::now() + link.timeout));
            for (i, peer) in peers.iter().enumerate() {
                let answer = read_frame(peer, Some(Instant::now() + LONG), wire::MAX_PAYLOAD);
                let reason = answer.map(|f| wire::decode_abort(&f.payload).unwrap().reason);
                assert!(
                    reason.as_ref().is_ok_and(|r| r.contains("started with world size 3")),
                    "bad connection {i}: {reason:?}"
                );
            }
            write_frame(&good_peer, Instant::now() + LONG, &raw_hello(&job, 1, 2)).unwrap();
            let joined = joined.join().unwrap().unwrap_or_else(|e| panic!("the good rank was not admitted: {e}"));
            assert!(joined.len() == 1 && Arc::ptr_eq(&joined[0], &good));
        });
    }

    /// (name, bytes from the job id, ABORT expected: (from a foreign job?, text))
    type RogueCase = (&'static str, fn(&[u8; 16]) -> Vec<u8>, Option<(bool, &'static str)>);

    /// The bad openings of `rogue_connections_are_refused_and_the_good_ranks_still_join`.
    fn rogue_cases() -> Vec<RogueCase> {
        vec![
            ("silent", |_| Vec::new(), None),
            ("truncated header", |j| raw_hello(j, 2, 3)[..20].to_vec(), None),
            (
                "oversized length",
                |j| {
                    let mut b = raw_hello(j, 2, 3);
                    b[36..40].copy_from_slice(&u32::MAX.to_le_bytes());
                    b
                },
                None,
            ),
            (
                "wrong magic",
                |j| {
                    let mut b = raw_hello(j, 2, 3);
                    b[0] = b'X';
                    b
                },
                None,
            ),
            (
                "wrong version",
                |j| {
                    let mut b = raw_hello(j, 2, 3);
                    b[8..10].copy_from_slice(&(wire::VERSION + 1).to_le_bytes());
                    b
                },
                None,
            ),
            ("garbage bytes", |_| (0..200u32).map(|i| (i * 37 % 251) as u8).collect(), None),
            ("http request", |_| b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n\r\n\r\n".to_vec(), None),
            ("wrong job id", |_| raw_hello(&[0xEE; 16], 2, 3), Some((true, "wrong job id"))),
            ("out-of-range rank", |j| raw_hello(j, 3, 3), Some((false, "outside 1..=2"))),
            ("rank 0 impostor", |j| raw_hello(j, 0, 3), Some((false, "outside 1..=2"))),
            ("huge rank", |j| raw_hello(j, u32::MAX, 3), Some((false, "outside 1..=2"))),
            ("world size mismatch", |j| raw_hello(j, 2, 4), Some((false, "world size 4"))),
            ("not a hello", |j| raw_frame(Kind::Gather, j, 2, 1, b""), Some((false, "instead of HELLO"))),
            (
                "hello with a round",
                |j| raw_frame(Kind::Hello, j, 2, 7, &wire::encode_world(3)),
                Some((false, "round 7")),
            ),
            ("hello payload too long", |j| raw_frame(Kind::Hello, j, 2, 0, &[3, 0, 0, 0, 0]), None),
        ]
    }

    /// Table: rank 0 is joining a world of 3, rank 1 is connecting, and a
    /// rogue connection sends bad bytes. Rank 0 must refuse and close the
    /// rogue during the join (rank 2 has not started yet), answering with an
    /// ABORT only when the header was readable (and then with the rogue's
    /// own job id), and rank 2 must still be able to join.
    #[test]
    fn rogue_connections_are_refused_and_the_good_ranks_still_join() {
        let foreign = [0xEE; 16];
        let cases = rogue_cases();
        let limits = Limits { hello_timeout: Duration::from_millis(150), ..Limits::for_timeout(LONG) };
        for (transport, make) in transports() {
            for (name, bytes, want_abort) in &cases {
                let id = make();
                let job = id.job_id();
                let started = Instant::now();
                let results = thread::scope(|s| {
                    let root = s.spawn(|| connect_with(&id, 0, 3, LONG, limits)?.all_gather(b"zero"));
                    let one = s.spawn(|| connect(&id, 1, 3, LONG)?.all_gather(b"one"));
                    let rogue = raw_dial(&id);
                    let _ = write_frame(&*rogue, Instant::now() + LONG, &bytes(&job));
                    let abort = read_until_closed(&*rogue, Duration::from_secs(3));
                    match (want_abort, &abort) {
                        (None, None) => {}
                        (Some((is_foreign, text)), Some((sent_job, reason))) => {
                            assert!(reason.contains(text), "{transport} {name}: ABORT says {reason:?}");
                            // Never tell a stranger the job id.
                            assert_eq!(sent_job, if *is_foreign { &foreign } else { &job }, "{transport} {name}");
                        }
                        _ => panic!("{transport} {name}: ABORT {abort:?}, expected {want_abort:?}"),
                    }
                    let two = s.spawn(|| connect(&id, 2, 3, LONG)?.all_gather(b"two"));
                    [root, one, two].map(|h| h.join().unwrap())
                });
                let want = vec![b"zero".to_vec(), b"one".to_vec(), b"two".to_vec()];
                for (rank, r) in results.into_iter().enumerate() {
                    let got = r.unwrap_or_else(|e| panic!("{transport} {name}: rank {rank} failed: {e}"));
                    assert_eq!(got, want, "{transport} {name}");
                }
                assert!(started.elapsed() < Duration::from_secs(5), "{transport} {name}: took {:?}", started.elapsed());
            }
        }
    }
}
