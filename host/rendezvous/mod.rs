//! Rendezvous: the out-of-band all-gather of small messages between the
//! ranks of a communicator (init data, IPC handles, buffer registrations).
//!
//! # Pieces
//!
//! * [`Rendezvous`] — the collective every implementation provides: each
//!   rank calls [`all_gather`](Rendezvous::all_gather) in the same order and
//!   gets every rank's bytes, indexed by rank.
//! * [`Id`] — made once by rank 0 ([`Id::new_unix`] or [`Id::new_tcp`]) and
//!   handed to the other ranks the way NCCL unique ids are: a file, an
//!   environment variable, your launcher. It is a one-line ASCII string
//!   (`tpar1:unix:<socket path>:<job hex>`, `tpar1:tcp:<addr>:<job hex>`);
//!   `to_string()` and `parse()` round-trip it, and serde uses the same form.
//! * [`connect`] — joins rank `rank` of `world_size` through an `Id` over a
//!   Unix socket or TCP, with the protocol below.
//! * [`in_process_group`] — ranks that are threads of one process.
//!
//! # Bring your own channel
//!
//! If the ranks already share a group (torch.distributed, MPI, a launcher's
//! key-value store), implement [`Rendezvous`] over it and hand it to
//! `Comm::from_rendezvous`; no socket is opened then.
//!
//! ```
//! use tp_allreduce::rendezvous::Rendezvous;
//!
//! /// Adapter over an existing group. `gather` stands for the group's own
//! /// all-gather of byte strings (e.g. `dist.all_gather_object` reached
//! /// through your bindings, or `MPI_Allgatherv`).
//! struct MyGroup {
//!     rank: usize,
//!     world: usize,
//!     gather: Box<dyn Fn(&[u8]) -> Vec<Vec<u8>> + Send + Sync>,
//! }
//!
//! impl Rendezvous for MyGroup {
//!     fn rank(&self) -> usize {
//!         self.rank
//!     }
//!     fn world_size(&self) -> usize {
//!         self.world
//!     }
//!     fn all_gather(&self, mine: &[u8]) -> tp_allreduce::Result<Vec<Vec<u8>>> {
//!         let all = (self.gather)(mine);
//!         if all.len() != self.world {
//!             return Err(tp_allreduce::Error::Rendezvous("group returned the wrong count".into()));
//!         }
//!         Ok(all)
//!     }
//! }
//!
//! // A one-rank "group" for the example.
//! let g = MyGroup { rank: 0, world: 1, gather: Box::new(|m: &[u8]| vec![m.to_vec()]) };
//! assert_eq!(g.all_gather(b"hi").unwrap(), vec![b"hi".to_vec()]);
//! g.barrier().unwrap();
//! ```
//!
//! # Protocol of [`connect`]
//!
//! A star around rank 0. Every frame has a checked header (magic, version,
//! kind, job id, sender rank, round, payload length; see `wire.rs`), and
//! every wait is bounded by the `timeout` given to `connect`.
//!
//! 1. **Join.** Rank 0 listens: a Unix socket of mode 0600 inside a private
//!    0700 directory, or a TCP port. Ranks 1..N-1 connect, retrying while
//!    rank 0 is not up yet, and send HELLO (their rank and world size).
//!    Rank 0 reads each new connection's HELLO on its own thread, within a
//!    per-connection limit, and admits it if it is a well-formed HELLO of
//!    this job from a rank in 1..N-1 with the same world size that has not
//!    joined yet (the first connection for a rank wins). Anything else is
//!    refused and closed — with an ABORT that says why when the header was
//!    readable — and rank 0 keeps waiting for the good ranks. When all N-1
//!    have joined, rank 0 stops listening (the socket file and directory are
//!    removed) and sends WELCOME to each.
//! 2. **Rounds.** For each `all_gather`, ranks 1..N-1 send GATHER(round,
//!    bytes); rank 0 waits for all of them and sends RESULT(round, all bytes)
//!    back. Connections stay open for the next round. Every frame must come
//!    from the rank its connection joined as, for this job, of the expected
//!    kind and round; a rank also checks that RESULT holds its own bytes.
//! 3. **Failure.** A rank that does not arrive in time, closes its
//!    connection (exit, crash, drop) or breaks the protocol fails rank 0's
//!    current call with an error naming it; rank 0 then sends ABORT with the
//!    reason to every other rank, so they fail at once with the same reason
//!    instead of timing out. A rank that loses rank 0 reports rank 0. After
//!    any failure the rendezvous is unusable: every later call fails.
//!
//! Guarantees: a malformed, foreign or hostile connection never crashes a
//! rank, never makes one allocate more than the frame limit, and never
//! stops the good ranks from joining; no call blocks longer than its
//! timeout (ranks 1..N-1 wait a short grace beyond it for rank 0's answer,
//! so that they receive its diagnosis — "ranks [2, 5] did not join" —
//! rather than only "rank 0 did not answer"). The timeout therefore also
//! bounds how far apart in time the ranks may reach the same call. One
//! round carries at most [`MAX_ROUND_BYTES`].
//!
//! # Security
//!
//! With Unix sockets, only processes of the same user can connect (0700
//! directory, 0600 socket). With TCP anyone who can reach the port can
//! connect; the random 128-bit job id is what admits a rank, so treat the
//! id string like a password, and bind to loopback (`127.0.0.1:<port>`),
//! which suffices for the GPUs of one host. Binding to another address
//! works but exposes the port to that network.

mod in_process;
mod tcp;
mod unix;
mod wire;

pub use in_process::in_process_group;

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use wire::{Abort, AbortCode, Checked, Frame, Kind, WireError};

/// An all-gather of byte strings over the ranks of a communicator.
///
/// Collective: every rank calls the methods in the same order. An
/// implementation must bound its waits and return an error (rather than
/// block forever) when a rank does not arrive.
pub trait Rendezvous: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Every rank's `mine`, indexed by rank.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }
}

/// Limit on one round of [`connect`]'s all-gather: the sum of all ranks'
/// contributions plus 4 bytes per rank plus 4.
pub const MAX_ROUND_BYTES: usize = wire::MAX_PAYLOAD;

/// Largest world size [`connect`] accepts (rank 0 keeps a thread per rank).
pub const MAX_WORLD_SIZE: usize = 1024;

const ID_PREFIX: &str = "tpar1";
/// Longest id string `FromStr` accepts.
const MAX_ID_LEN: usize = 256;

/// Where rank 0 listens and which job the ranks belong to. Created by rank
/// 0 and passed to the others; see the [module docs](self).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Id {
    endpoint: Endpoint,
    job: [u8; 16],
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Endpoint {
    /// Path of the socket, `<base>/tpar-<16 hex>/rdv.sock`.
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix socket {}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp {a}"),
        }
    }
}

impl Id {
    /// A new id for a Unix-socket rendezvous: creates a private directory
    /// (mode 0700, random name) under `$XDG_RUNTIME_DIR`, or the temp dir
    /// when that is unset; rank 0's socket will live inside it. Rank 0's
    /// [`connect`] removes the directory when the join phase ends; an id
    /// that is never connected leaves the empty directory behind.
    pub fn new_unix() -> Result<Id> {
        let job = random_bytes::<16>()?;
        Ok(Id { endpoint: Endpoint::Unix(unix::create_private_dir()?), job })
    }

    /// A new id for a TCP rendezvous where rank 0 listens on `addr`. Use a
    /// loopback address with a free port (`127.0.0.1:29500`); any other
    /// address exposes the port beyond this host (see the module docs).
    pub fn new_tcp(addr: SocketAddr) -> Id {
        let job = random_bytes::<16>().unwrap_or_else(|_| fallback_random());
        Id { endpoint: Endpoint::Tcp(addr), job }
    }

    /// The random job id every frame carries.
    pub fn job_id(&self) -> [u8; 16] {
        self.job
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.endpoint {
            // Paths are checked to be printable ASCII when the id is made.
            Endpoint::Unix(p) => write!(f, "{ID_PREFIX}:unix:{}:{}", p.display(), hex(&self.job)),
            Endpoint::Tcp(a) => write!(f, "{ID_PREFIX}:tcp:{a}:{}", hex(&self.job)),
        }
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({self})")
    }
}

impl FromStr for Id {
    type Err = Error;

    fn from_str(s: &str) -> Result<Id> {
        let bad = |why: &str| {
            let shown: String = s.chars().take(120).collect();
            Error::invalid(format!("invalid rendezvous id {shown:?}: {why}"))
        };
        if s.len() > MAX_ID_LEN {
            return Err(bad(&format!("longer than {MAX_ID_LEN} bytes")));
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad("it must be one line of printable ASCII without spaces"));
        }
        let Some(rest) = s.strip_prefix(ID_PREFIX).and_then(|r| r.strip_prefix(':')) else {
            return Err(if s.starts_with("tpar") {
                bad(&format!("unsupported id version (this build reads {ID_PREFIX}:...)"))
            } else {
                bad(&format!("not a tp-allreduce rendezvous id (expected {ID_PREFIX}:unix:... or {ID_PREFIX}:tcp:...)"))
            });
        };
        let (kind, rest) = rest.split_once(':').ok_or_else(|| bad("missing the transport"))?;
        let (place, job_hex) = rest.rsplit_once(':').ok_or_else(|| bad("missing the job id"))?;
        let job = unhex16(job_hex).ok_or_else(|| bad("the job id must be 32 lowercase hex digits"))?;
        let endpoint = match kind {
            "unix" => {
                let path = PathBuf::from(place);
                unix::check_socket_path(&path).map_err(|why| bad(&why))?;
                Endpoint::Unix(path)
            }
            "tcp" => Endpoint::Tcp(place.parse().map_err(|_| bad("the address must be IP:port, [IPv6]:port"))?),
            other => return Err(bad(&format!("unknown transport {other:?} (expected unix or tcp)"))),
        };
        Ok(Id { endpoint, job })
    }
}

impl serde::Serialize for Id {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Id {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Id, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex16(s: &str) -> Option<[u8; 16]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let b = s.as_bytes();
    if b.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = digit(b[2 * i])? << 4 | digit(b[2 * i + 1])?;
    }
    Some(out)
}

/// Bytes from the OS random source.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .map_err(|e| Error::io("reading /dev/urandom for a rendezvous id", e))?;
    Ok(out)
}

/// Only for `Id::new_tcp`, which cannot fail, when /dev/urandom cannot be
/// read: std's per-process random hash keys, the time and the pid.
fn fallback_random() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
        h.write_u32(std::process::id());
        h.write_usize(i);
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

/// Joins rank `rank` of `world_size` through `id`; collective over all
/// ranks. Rank 0 listens and waits up to `timeout` for the others to join;
/// ranks 1.. connect, retrying until `timeout` while rank 0 is not up yet.
/// Every later call on the result is bounded by `timeout` too. See the
/// [module docs](self) for the protocol and its errors.
pub fn connect(id: &Id, rank: usize, world_size: usize, timeout: Duration) -> Result<Box<dyn Rendezvous>> {
    connect_with(id, rank, world_size, timeout, Limits::for_timeout(timeout))
}

/// Internal knobs, derived from the timeout; tests shorten them.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// How long a new connection to rank 0 has to send its HELLO.
    hello_timeout: Duration,
    /// Connections waiting for their HELLO at once; more are closed.
    max_pending: usize,
    /// Extra time ranks 1.. wait for rank 0, so rank 0's own timeout fires
    /// first and its diagnosis reaches them.
    grace: Duration,
}

impl Limits {
    fn for_timeout(timeout: Duration) -> Limits {
        Limits {
            hello_timeout: timeout.min(Duration::from_secs(5)),
            max_pending: 64,
            grace: (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(2)),
        }
    }
}

/// How often rank 0 polls its non-blocking listener during the join (std
/// has no accept with a timeout; this runs only until everyone has joined).
const ACCEPT_POLL: Duration = Duration::from_millis(2);
/// Connections rank 0 accepts per poll of its listener.
const ACCEPTS_PER_POLL: usize = 16;
/// Bound on sending an ABORT (best effort; the peer may be gone or stuck).
const ABORT_WRITE_TIMEOUT: Duration = Duration::from_millis(250);
/// Backoff cap of ranks 1.. while rank 0 is not listening yet.
const MAX_BACKOFF: Duration = Duration::from_millis(100);

fn connect_with(id: &Id, rank: usize, world: usize, timeout: Duration, limits: Limits) -> Result<Box<dyn Rendezvous>> {
    if world == 0 || world > MAX_WORLD_SIZE {
        return Err(Error::invalid(format!("rendezvous world size must be 1..={MAX_WORLD_SIZE}, got {world}")));
    }
    if rank >= world {
        return Err(Error::invalid(format!("rendezvous rank {rank} out of range for world size {world}")));
    }
    if timeout.is_zero() {
        return Err(Error::invalid("rendezvous timeout must be positive"));
    }
    let link = Link { job: id.job, world, timeout, limits };
    if rank == 0 {
        let listener: Box<dyn Listen> = match &id.endpoint {
            Endpoint::Unix(path) => Box::new(unix::bind(path)?),
            Endpoint::Tcp(addr) => Box::new(tcp::bind(*addr)?),
        };
        Ok(Box::new(Root::join(link, listener)?))
    } else {
        Ok(Box::new(Member::join(link, &id.endpoint, rank)?))
    }
}

/// A connected byte stream (Unix or TCP), shared by reference between the
/// thread that reads it and the one that writes it.
trait Conn: Send + Sync + 'static {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize>;
    fn write(&self, buf: &[u8]) -> io::Result<usize>;
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// Shuts both directions down: a read blocked in another thread
    /// returns at once, and the peer sees end of stream.
    fn disconnect(&self);
}

/// Rank 0's listening socket (non-blocking).
trait Listen {
    /// A waiting connection, if any.
    fn accept(&self) -> io::Result<Option<Arc<dyn Conn>>>;
}

/// Reads and writes a [`Conn`] with every system call bounded by what is
/// left until `deadline` (`None`: unbounded), so a peer that trickles bytes
/// cannot stretch a wait past its deadline.
struct Timed<'a> {
    conn: &'a dyn Conn,
    deadline: Option<Instant>,
}

impl Timed<'_> {
    fn left(&self) -> io::Result<Option<Duration>> {
        match self.deadline {
            None => Ok(None),
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Ok(Some(left)),
                _ => Err(io::ErrorKind::TimedOut.into()),
            },
        }
    }
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(left) = self.left()? {
            self.conn.set_read_timeout(Some(left))?;
        }
        self.conn.read(buf)
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(left) = self.left()? {
            self.conn.set_write_timeout(Some(left))?;
        }
        // SO_SNDTIMEO expiring reads as EAGAIN; say what it means.
        self.conn.write(buf).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock => io::Error::new(io::ErrorKind::TimedOut, "timed out: the peer is not reading"),
            _ => e,
        })
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn read_frame(conn: &dyn Conn, deadline: Option<Instant>, max_payload: usize) -> Result<Frame, WireError> {
    wire::read_frame(&mut Timed { conn, deadline }, max_payload)
}

fn write_frame(conn: &dyn Conn, deadline: Instant, frame: &[u8]) -> io::Result<()> {
    Timed { conn, deadline: Some(deadline) }.write_all(frame)
}

/// Best-effort ABORT: the peer may already be gone.
fn send_abort(conn: &dyn Conn, job: &[u8; 16], sender: u32, round: u32, abort: &Abort) {
    if let Ok(frame) = wire::encode(Kind::Abort, job, sender, round, &wire::encode_abort(abort)) {
        let _ = write_frame(conn, Instant::now() + ABORT_WRITE_TIMEOUT, &frame);
    }
}

fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock().map_err(|_| Error::Rendezvous("poisoned: a thread panicked inside a rendezvous call".into()))
}

fn unusable(why: &str) -> Error {
    Error::Rendezvous(format!("unusable after an earlier error: {why}"))
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// The text an ABORT carries for an error: a timeout's `what` alone (the
/// receiver rebuilds a timeout error around it), else the whole message.
fn abort_for(err: &Error) -> Abort {
    match err {
        Error::RendezvousTimeout { what, waited_ms } => {
            Abort { code: AbortCode::Timeout, waited_ms: *waited_ms, reason: what.clone() }
        }
        other => Abort { code: AbortCode::Failed, waited_ms: 0, reason: other.to_string() },
    }
}

/// The error a rank reports when `from` sent it an ABORT.
fn error_from_abort(from: &str, a: Abort) -> Error {
    match a.code {
        AbortCode::Timeout => {
            Error::RendezvousTimeout { what: format!("{from} reports: {}", a.reason), waited_ms: a.waited_ms }
        }
        AbortCode::Rejected => Error::Rendezvous(format!("{from} refused this rank: {}", a.reason)),
        AbortCode::Failed => Error::Rendezvous(format!("{from} aborted the rendezvous: {}", a.reason)),
    }
}

/// What every rank of a socket rendezvous knows about the job.
#[derive(Clone, Copy)]
struct Link {
    job: [u8; 16],
    world: usize,
    timeout: Duration,
    limits: Limits,
}

// ---------------------------------------------------------------- rank 0 --

/// Rank 0 of a socket rendezvous: one connection per other rank, each read
/// by its own thread into one channel (so rank 0 waits on all at once).
struct Root {
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
    fn join(link: Link, listener: Box<dyn Listen>) -> Result<Root> {
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
    let world = link.world;
    let mut slots: Vec<Option<Arc<dyn Conn>>> = vec![None; world];
    let mut missing = world - 1;
    let (tx, rx) = mpsc::channel::<Hello>();
    // Connections whose HELLO is being read, by key.
    let mut pending: HashMap<u64, (Arc<dyn Conn>, JoinHandle<()>)> = HashMap::new();
    let mut next_key = 0u64;
    let mut refusals = Refusals::default();

    while missing > 0 && Instant::now() < deadline {
        // Take the connections that are waiting (a bounded number per pass,
        // so a flood of connections cannot keep this loop past the deadline).
        for _ in 0..ACCEPTS_PER_POLL {
            match listener.accept() {
                Ok(Some(conn)) => {
                    if pending.len() >= link.limits.max_pending {
                        conn.disconnect();
                        refusals.note(format!("more than {} connections sent no HELLO yet", link.limits.max_pending));
                        continue;
                    }
                    let (key, tx, c, l) = (next_key, tx.clone(), conn.clone(), *link);
                    next_key += 1;
                    let spawned = thread::Builder::new().name("tpar-rdv-hello".into()).spawn(move || {
                        let outcome = read_hello(&l, &*c);
                        if outcome.is_err() {
                            c.disconnect();
                        }
                        let _ = tx.send(Hello { key, conn: c, outcome });
                    });
                    match spawned {
                        Ok(h) => {
                            pending.insert(key, (conn, h));
                        }
                        Err(e) => {
                            conn.disconnect();
                            refusals.note(format!("could not start a thread for a connection: {e}"));
                        }
                    }
                }
                Ok(None) => break,
                // Out of file descriptors, a connection reset before accept...:
                // the good ranks may still get through, so keep going.
                Err(e) => {
                    refusals.note(format!("accept failed: {e}"));
                    break;
                }
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(hello) = rx.recv_timeout(ACCEPT_POLL.min(left)) else { continue };
        if let Some((_, h)) = pending.remove(&hello.key) {
            let _ = h.join();
        }
        match hello.outcome {
            Ok(rank) if slots[rank].is_some() => {
                let why = format!("rank {rank} has already joined (duplicate rank; the first connection wins)");
                send_abort(
                    &*hello.conn,
                    &link.job,
                    0,
                    0,
                    &Abort { code: AbortCode::Rejected, waited_ms: 0, reason: why.clone() },
                );
                hello.conn.disconnect();
                refusals.note(why);
            }
            Ok(rank) => {
                slots[rank] = Some(hello.conn);
                missing -= 1;
            }
            Err(why) => refusals.note(why),
        }
    }

    // Connections still silent are not needed (or it is too late): shutting
    // them down makes their HELLO reads return at once.
    for (_, (conn, h)) in pending.drain() {
        conn.disconnect();
        let _ = h.join();
    }
    let joined: Vec<Arc<dyn Conn>> = slots.iter().flatten().cloned().collect();
    if missing == 0 {
        return Ok(joined);
    }
    let absent: Vec<usize> = (1..world).filter(|&r| slots[r].is_none()).collect();
    let err = Error::RendezvousTimeout {
        what: format!("ranks {absent:?} did not join within {} ms{}", ms(link.timeout), refusals.describe()),
        waited_ms: link.timeout.as_millis() as u64,
    };
    abort_all(link, &joined, 0, &abort_for(&err));
    joined.iter().for_each(|c| c.disconnect());
    Err(err)
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
        let deadline = Instant::now() + timeout;
        let mut parts: Vec<Option<Vec<u8>>> = vec![None; world];
        parts[0] = Some(mine.to_vec());
        let mut missing = world - 1;
        let RootInner { events, deferred, conns, .. } = inner;
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
            let frame = match event {
                Event::Frame { frame, .. } => frame,
                Event::Failed { error, .. } if error.is_disconnect() => {
                    return Err(Error::Rendezvous(format!(
                        "rank {rank} closed its connection before round {round} ({error}: its process exited, \
                         crashed or dropped its rendezvous)"
                    )))
                }
                Event::Failed { error, .. } => {
                    return Err(Error::Protocol {
                        from: format!("rank {rank}"),
                        what: format!("round {round}: {error}"),
                    })
                }
            };
            match frame.check(&job, rank, Kind::Gather, round) {
                Ok(Checked::Expected(p)) => {
                    parts[rank] = Some(p);
                    missing -= 1;
                }
                Ok(Checked::Aborted(a)) => {
                    return Err(Error::Rendezvous(format!("rank {rank} aborted round {round}: {}", a.reason)))
                }
                Err(what) => {
                    return Err(Error::Protocol {
                        from: format!("rank {rank}"),
                        what: format!("round {round}: {what}"),
                    })
                }
            }
        }

        let parts: Vec<Vec<u8>> = parts.into_iter().map(Option::unwrap_or_default).collect();
        let total = wire::result_overhead(world) + parts.iter().map(Vec::len).sum::<usize>();
        if total > MAX_ROUND_BYTES {
            return Err(Error::invalid(format!(
                "round {round} of all_gather holds {total} bytes, over the rendezvous limit of {MAX_ROUND_BYTES}"
            )));
        }
        let frame = wire::encode(Kind::Result, &job, 0, round, &wire::encode_result(&parts))
            .map_err(|e| Error::Rendezvous(e.to_string()))?;
        let deadline = Instant::now() + timeout;
        for (i, conn) in conns.iter().enumerate() {
            write_frame(&**conn, deadline, &frame).map_err(|e| {
                Error::Rendezvous(format!("sending round {round}'s result to rank {} failed: {e}", i + 1))
            })?;
        }
        Ok(parts)
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

// ------------------------------------------------------------- ranks 1.. --

/// Rank 1..N-1 of a socket rendezvous: one connection, to rank 0.
struct Member {
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
fn dial(endpoint: &Endpoint, rank: usize, deadline: Instant, timeout: Duration) -> Result<Arc<dyn Conn>> {
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
    fn join(link: Link, endpoint: &Endpoint, rank: usize) -> Result<Member> {
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
    use std::fs;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    /// Bound for calls expected to succeed; a failing test may wait this long.
    const LONG: Duration = Duration::from_secs(10);

    fn unix_id() -> Id {
        Id::new_unix().unwrap()
    }

    /// A loopback port that was free a moment ago.
    fn tcp_id() -> Id {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        Id::new_tcp(addr)
    }

    type MakeId = fn() -> Id;

    fn transports() -> [(&'static str, MakeId); 2] {
        [("unix", unix_id), ("tcp", tcp_id)]
    }

    fn private_dir(id: &Id) -> Option<PathBuf> {
        match &id.endpoint {
            Endpoint::Unix(p) => p.parent().map(Path::to_path_buf),
            Endpoint::Tcp(_) => None,
        }
    }

    /// Runs `f(rank)` on a thread per rank; results in rank order.
    fn on_ranks<T: Send>(ranks: std::ops::Range<usize>, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
        let f = &f;
        thread::scope(|s| {
            let handles: Vec<_> = ranks.map(|r| s.spawn(move || f(r))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Distinct per rank and round: small, empty, about 1 MiB, small, empty.
    fn payload(rank: usize, round: usize) -> Vec<u8> {
        match round % 5 {
            0 | 3 => format!("rank {rank} round {round}").into_bytes(),
            2 => (0..(1 << 20) + rank).map(|i| (i ^ (i >> 8) ^ rank) as u8).collect(),
            _ => Vec::new(),
        }
    }

    fn all_gather_rounds(make: fn() -> Id) {
        for world in [1, 2, 4, 8] {
            let id = make();
            on_ranks(0..world, |rank| {
                let rdv = connect(&id, rank, world, LONG).unwrap();
                assert_eq!((rdv.rank(), rdv.world_size()), (rank, world));
                for round in 0..5 {
                    let got = rdv.all_gather(&payload(rank, round)).unwrap();
                    let want: Vec<Vec<u8>> = (0..world).map(|r| payload(r, round)).collect();
                    assert!(got == want, "world {world} rank {rank} round {round}: wrong result");
                }
                rdv.barrier().unwrap();
            });
            if let Some(dir) = private_dir(&id) {
                assert!(!dir.exists(), "{} left behind", dir.display());
            }
        }
    }

    #[test]
    fn unix_all_gather_rounds_n_1_2_4_8() {
        all_gather_rounds(unix_id);
    }

    #[test]
    fn tcp_all_gather_rounds_n_1_2_4_8() {
        all_gather_rounds(tcp_id);
    }

    #[test]
    fn id_round_trips_through_display_fromstr_and_serde() {
        let unix = unix_id();
        let ids =
            [unix.clone(), Id::new_tcp("127.0.0.1:29500".parse().unwrap()), Id::new_tcp("[::1]:7".parse().unwrap())];
        for id in &ids {
            let s = id.to_string();
            assert!(s.starts_with("tpar1:") && s.bytes().all(|b| b.is_ascii_graphic()), "{s}");
            assert!(s.ends_with(&hex(&id.job_id())), "{s}");
            assert_eq!(&s.parse::<Id>().unwrap(), id);
            let json = serde_json::to_string(id).unwrap();
            assert_eq!(json, format!("\"{s}\""));
            assert_eq!(&serde_json::from_str::<Id>(&json).unwrap(), id);
        }
        assert!(ids[0].to_string().starts_with("tpar1:unix:/"));
        assert_eq!(ids[2].to_string(), format!("tpar1:tcp:[::1]:7:{}", hex(&ids[2].job_id())));
        assert_ne!(ids[1].job_id(), ids[2].job_id());
        fs::remove_dir(private_dir(&unix).unwrap()).unwrap();
    }

    #[test]
    fn id_fromstr_rejects_malformed() {
        let job = "00112233445566778899aabbccddeeff";
        let sock = "/tmp/tpar-0123456789abcdef/rdv.sock";
        let cases = [
            ("".to_string(), "not a tp-allreduce"),
            ("hello".into(), "not a tp-allreduce"),
            (format!("tpar2:tcp:127.0.0.1:5:{job}"), "unsupported id version"),
            (format!("tpar1:udp:127.0.0.1:5:{job}"), "unknown transport"),
            ("tpar1:tcp".into(), "missing the transport"),
            ("tpar1:tcp:127.0.0.1".into(), "missing the job id"),
            (format!("tpar1:tcp:127.0.0.1:5:{}", &job[..31]), "job id must be"),
            (format!("tpar1:tcp:127.0.0.1:5:{}", job.to_uppercase()), "job id must be"),
            (format!("tpar1:tcp:127.0.0.1:5:{job}0"), "job id must be"),
            (format!("tpar1:tcp:localhost:5:{job}"), "IP:port"),
            (format!("tpar1:tcp:127.0.0.1:{job}"), "IP:port"),
            (format!("tpar1:tcp:127.0.0.1:99999:{job}"), "IP:port"),
            (format!("tpar1:unix:relative/tpar-0123456789abcdef/rdv.sock:{job}"), "absolute"),
            (format!("tpar1:unix:/tmp/other/rdv.sock:{job}"), "tpar-"),
            (format!("tpar1:unix:/etc/passwd:{job}"), "rdv.sock"),
            (format!("tpar1:unix:{sock}:{job}\n"), "one line"),
            (format!("tpar1:unix:/tmp/a b/x:{job}"), "one line"),
            (format!("tpar1:unix:/tmp/é/x:{job}"), "one line"),
            (format!("tpar1:tcp:127.0.0.1:5:{job}{}", "0".repeat(300)), "longer than"),
        ];
        for (s, want) in cases {
            let err = s.parse::<Id>().expect_err(&s);
            assert!(matches!(err, Error::InvalidUsage(_)), "{s:?}: {err}");
            assert!(err.to_string().contains(want), "{s:?}: {err} (wanted {want:?})");
        }
        assert!(format!("tpar1:unix:{sock}:{job}").parse::<Id>().is_ok());
        assert!(serde_json::from_str::<Id>("\"tpar1:tcp:x\"").is_err());
    }

    #[test]
    fn connect_rejects_bad_arguments() {
        let id = tcp_id();
        for (rank, world, timeout) in
            [(0, 0, LONG), (2, 2, LONG), (0, MAX_WORLD_SIZE + 1, LONG), (0, 1, Duration::ZERO)]
        {
            let err = connect(&id, rank, world, timeout).err().expect("bad arguments accepted");
            assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
        }
        let port0 = Id::new_tcp("127.0.0.1:0".parse().unwrap());
        assert!(matches!(connect(&port0, 0, 1, LONG).err(), Some(Error::InvalidUsage(_))));
    }

    /// Connects a raw socket to rank 0 (retrying until it listens).
    fn raw_dial(id: &Id) -> Arc<dyn Conn> {
        dial(&id.endpoint, 99, Instant::now() + LONG, LONG).unwrap()
    }

    fn raw_frame(kind: Kind, job: &[u8; 16], sender: u32, round: u32, payload: &[u8]) -> Vec<u8> {
        wire::encode(kind, job, sender, round, payload).unwrap()
    }

    fn raw_hello(job: &[u8; 16], rank: u32, world: usize) -> Vec<u8> {
        raw_frame(Kind::Hello, job, rank, 0, &wire::encode_world(world))
    }

    /// Reads what rank 0 sends a refused connection until it closes it;
    /// returns the ABORT (its job id and reason) if there was one. Panics
    /// if the connection is not closed within `bound`.
    fn read_until_closed(conn: &dyn Conn, bound: Duration) -> Option<([u8; 16], String)> {
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

    /// Table: rank 0 is joining a world of 3, rank 1 is connecting, and a
    /// rogue connection sends bad bytes. Rank 0 must refuse and close the
    /// rogue during the join (rank 2 has not started yet), answering with an
    /// ABORT only when the header was readable (and then with the rogue's
    /// own job id), and rank 2 must still be able to join.
    #[test]
    fn rogue_connections_are_refused_and_the_good_ranks_still_join() {
        let foreign = [0xEE; 16];
        // (name, bytes from the job id, ABORT expected: (from a foreign job?, text))
        type Case = (&'static str, fn(&[u8; 16]) -> Vec<u8>, Option<(bool, &'static str)>);
        let cases: Vec<Case> = vec![
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
        ];
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

    #[test]
    fn silent_connection_does_not_delay_the_join() {
        for (transport, make) in transports() {
            let id = make();
            let started = Instant::now();
            thread::scope(|s| {
                let root = s.spawn(|| connect(&id, 0, 3, LONG)?.barrier());
                let silent = raw_dial(&id);
                let id = &id;
                let others: Vec<_> = (1..3).map(|r| s.spawn(move || connect(id, r, 3, LONG)?.barrier())).collect();
                root.join().unwrap().unwrap();
                others.into_iter().for_each(|h| h.join().unwrap().unwrap());
                // Closed when the join ended, not after its 5 s HELLO limit.
                assert_eq!(read_until_closed(&*silent, Duration::from_secs(2)), None, "{transport}");
            });
            assert!(started.elapsed() < Duration::from_secs(3), "{transport}: {:?}", started.elapsed());
        }
    }

    /// Two connections claim rank 1 with valid HELLOs: the first one rank 0
    /// admits keeps the rank, the other is refused with a reason, and the
    /// rendezvous completes with the winner.
    #[test]
    fn duplicate_rank_first_connection_wins() {
        for (transport, make) in transports() {
            let id = make();
            let job = id.job_id();
            thread::scope(|s| {
                let root = s.spawn(|| connect(&id, 0, 3, LONG)?.all_gather(b"zero"));
                let claimants = [raw_dial(&id), raw_dial(&id)];
                let (tx, rx) = mpsc::channel();
                for (i, c) in claimants.iter().enumerate() {
                    write_frame(&**c, Instant::now() + LONG, &raw_hello(&job, 1, 3)).unwrap();
                    let (c, tx) = (c.clone(), tx.clone());
                    s.spawn(move || {
                        tx.send((i, read_frame(&*c, Some(Instant::now() + LONG), 4096).map_err(|e| e.to_string())))
                    });
                }
                // The loser hears at once; the winner only after rank 2 joins.
                let (loser, first) = rx.recv_timeout(Duration::from_secs(3)).expect("no claimant was refused");
                let abort = first.unwrap().check(&job, 0, Kind::Welcome, 0).unwrap();
                let Checked::Aborted(abort) = abort else { panic!("{transport}: first reply was {abort:?}") };
                assert!(abort.reason.contains("rank 1 has already joined"), "{transport}: {}", abort.reason);
                assert!(read_until_closed(&*claimants[loser], Duration::from_secs(2)).is_none());

                let two = s.spawn(|| connect(&id, 2, 3, LONG)?.all_gather(b"two"));
                let (winner, welcome) = rx.recv_timeout(LONG).unwrap();
                assert_ne!(winner, loser);
                let welcome = welcome.unwrap().check(&job, 0, Kind::Welcome, 0).unwrap();
                assert_eq!(welcome, Checked::Expected(wire::encode_world(3).to_vec()), "{transport}");
                let c = &*claimants[winner];
                write_frame(c, Instant::now() + LONG, &raw_frame(Kind::Gather, &job, 1, 1, b"one")).unwrap();
                let result = read_frame(c, Some(Instant::now() + LONG), wire::MAX_PAYLOAD).unwrap();
                let Ok(Checked::Expected(p)) = result.check(&job, 0, Kind::Result, 1) else {
                    panic!("{transport}: no RESULT")
                };
                let want = vec![b"zero".to_vec(), b"one".to_vec(), b"two".to_vec()];
                assert_eq!(wire::decode_result(&p, 3).unwrap(), want);
                assert_eq!(root.join().unwrap().unwrap(), want);
                assert_eq!(two.join().unwrap().unwrap(), want);
            });
        }
    }

    #[test]
    fn missing_rank_times_out_naming_it() {
        let timeout = Duration::from_millis(500);
        for (transport, make) in transports() {
            let id = make();
            let started = Instant::now();
            let errs = on_ranks(0..2, |rank| connect(&id, rank, 3, timeout).err().expect("joined without rank 2"));
            let elapsed = started.elapsed();
            assert!(elapsed >= timeout && elapsed < timeout + Duration::from_secs(2), "{transport}: {elapsed:?}");
            for (rank, err) in errs.iter().enumerate() {
                let Error::RendezvousTimeout { what, waited_ms } = err else {
                    panic!("{transport} rank {rank}: {err}")
                };
                assert!(what.contains("ranks [2] did not join within 500 ms"), "{transport} rank {rank}: {what}");
                assert_eq!(*waited_ms, 500);
            }
            assert!(errs[1].to_string().contains("rank 0 reports"), "{}", errs[1]);
            if let Some(dir) = private_dir(&id) {
                assert!(!dir.exists());
            }
        }
    }

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

    /// After the join, rank 2 drops its rendezvous (as its process would on
    /// exit or SIGKILL): the others' next all_gather fails fast naming it.
    #[test]
    fn dropped_rank_fails_the_next_round_naming_it() {
        for (transport, make) in transports() {
            let id = make();
            let errs = on_ranks(0..3, |rank| {
                let rdv = connect(&id, rank, 3, LONG).unwrap();
                rdv.barrier().unwrap();
                if rank == 2 {
                    return None;
                }
                let started = Instant::now();
                let err = rdv.all_gather(b"again").expect_err("round without rank 2");
                assert!(started.elapsed() < Duration::from_secs(2), "{transport}: {:?}", started.elapsed());
                // Unusable from now on, with the same reason.
                assert!(rdv.barrier().unwrap_err().to_string().contains("rank 2"));
                Some(err)
            });
            for err in errs.into_iter().flatten() {
                let s = err.to_string();
                assert!(s.contains("rank 2 closed its connection"), "{transport}: {s}");
            }
        }
    }

    #[test]
    fn rank_0_exit_fails_the_others_naming_it() {
        for (transport, make) in transports() {
            let id = make();
            on_ranks(0..3, |rank| {
                let rdv = connect(&id, rank, 3, LONG).unwrap();
                rdv.barrier().unwrap();
                if rank == 0 {
                    return;
                }
                let started = Instant::now();
                let err = rdv.all_gather(b"again").expect_err("round without rank 0");
                assert!(started.elapsed() < Duration::from_secs(2), "{transport}");
                assert!(err.to_string().contains("rank 0"), "{transport}: {err}");
            });
        }
    }

    const CHILD_ID_VAR: &str = "TPAR_RDV_TEST_CHILD_ID";

    /// Not a test by itself: the child process of
    /// `sigkilled_process_fails_the_next_round_naming_it` (this test binary
    /// run again with the id in the environment). Joins as rank 2 of 3, does
    /// one round, then waits to be killed.
    #[test]
    #[ignore = "child process of sigkilled_process_fails_the_next_round_naming_it"]
    fn child_rank_2_of_3() {
        let Ok(id) = std::env::var(CHILD_ID_VAR) else { return };
        let rdv = connect(&id.parse().unwrap(), 2, 3, LONG).unwrap();
        rdv.all_gather(b"child").unwrap();
        thread::sleep(LONG);
    }

    /// Rank 2 is another process, joined through the id string, and is
    /// SIGKILLed after a round: ranks 0 and 1 fail their next round at once,
    /// naming rank 2.
    #[test]
    fn sigkilled_process_fails_the_next_round_naming_it() {
        use std::process::{Command, Stdio};
        use std::sync::Barrier;
        let id = unix_id();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "rendezvous::tests::child_rank_2_of_3", "--ignored", "--test-threads=1"])
            .env(CHILD_ID_VAR, id.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let killed = Barrier::new(3);
        let errs = thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let (id, killed) = (&id, &killed);
                    s.spawn(move || {
                        let rdv = connect(id, rank, 3, LONG);
                        let first = rdv
                            .as_ref()
                            .map_err(|e| e.to_string())
                            .and_then(|r| r.all_gather(format!("thread {rank}").as_bytes()).map_err(|e| e.to_string()));
                        killed.wait(); // round 1 done on both threads
                        killed.wait(); // rank 2 killed
                        let first = first.unwrap();
                        assert_eq!(first[2], b"child");
                        let started = Instant::now();
                        let err = rdv.unwrap().all_gather(b"after").expect_err("round without rank 2");
                        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
                        err
                    })
                })
                .collect();
            killed.wait();
            child.kill().unwrap(); // SIGKILL
            let status = child.wait().unwrap();
            killed.wait();
            let errs: Vec<Error> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            assert!(!status.success());
            errs
        });
        for err in errs {
            assert!(err.to_string().contains("rank 2 closed its connection"), "{err}");
        }
    }

    /// A joined rank (played by a raw socket) breaks the protocol in round 1:
    /// rank 0 fails naming it and rank 2 fails at once with the reason.
    #[test]
    fn joined_rank_protocol_violation_aborts_the_others() {
        type Case = (&'static str, fn(&[u8; 16]) -> Vec<u8>, &'static str);
        let cases: [Case; 6] = [
            ("wrong round", |j| raw_frame(Kind::Gather, j, 1, 2, b"x"), "round 2, expected round 1"),
            ("wrong sender", |j| raw_frame(Kind::Gather, j, 2, 1, b"x"), "claims sender rank 2"),
            ("wrong job", |_| raw_frame(Kind::Gather, &[1; 16], 1, 1, b"x"), "wrong job id"),
            ("wrong kind", |j| raw_frame(Kind::Result, j, 1, 1, b"x"), "expected a GATHER"),
            ("garbage", |_| vec![0x55; 64], "not a rendezvous frame"),
            (
                "oversized",
                |j| {
                    let mut b = raw_frame(Kind::Gather, j, 1, 1, b"");
                    b[36..40].copy_from_slice(&(wire::MAX_PAYLOAD as u32 + 1).to_le_bytes());
                    b
                },
                "exceeds the limit",
            ),
        ];
        for (transport, make) in transports() {
            for (name, bytes, text) in &cases {
                let id = make();
                let job = id.job_id();
                thread::scope(|s| {
                    let root = s.spawn(|| connect(&id, 0, 3, LONG)?.all_gather(b"zero"));
                    let two = s.spawn(|| connect(&id, 2, 3, LONG)?.all_gather(b"two"));
                    let one = raw_dial(&id);
                    write_frame(&*one, Instant::now() + LONG, &raw_hello(&job, 1, 3)).unwrap();
                    let welcome = read_frame(&*one, Some(Instant::now() + LONG), 64).unwrap();
                    assert_eq!(welcome.header.kind, Kind::Welcome);
                    let started = Instant::now();
                    write_frame(&*one, Instant::now() + LONG, &bytes(&job)).unwrap();
                    let root_err = root.join().unwrap().unwrap_err();
                    let two_err = two.join().unwrap().unwrap_err();
                    assert!(started.elapsed() < Duration::from_secs(3), "{transport} {name}");
                    assert!(
                        matches!(&root_err, Error::Protocol { from, what } if from == "rank 1" && what.contains(text)),
                        "{transport} {name}: rank 0 got {root_err}"
                    );
                    let two_err = two_err.to_string();
                    assert!(
                        two_err.contains("rank 0 aborted") && two_err.contains("rank 1"),
                        "{transport} {name}: {two_err}"
                    );
                    // The offender is told too.
                    let abort = read_frame(&*one, Some(Instant::now() + LONG), wire::MAX_PAYLOAD).unwrap();
                    assert_eq!(abort.header.kind, Kind::Abort, "{transport} {name}");
                });
            }
        }
    }

    /// Rank 1 against a fake rank 0 (the test, on a TCP port it holds)
    /// that answers badly during the join or in round 1: rank 1 must fail
    /// with an error naming rank 0 and saying what was wrong, within bound.
    #[test]
    fn member_refuses_a_bad_rank_0() {
        #[derive(PartialEq)]
        enum At {
            Join,
            Round,
        }
        let abort = |code, reason: &str| wire::encode_abort(&Abort { code, waited_ms: 700, reason: reason.into() });
        let parts = |v: &[&[u8]]| wire::encode_result(&v.iter().map(|p| p.to_vec()).collect::<Vec<_>>());
        // (name, when, what rank 0 sends (empty: it closes), expected text)
        type Reply<'a> = Box<dyn Fn(&[u8; 16]) -> Vec<u8> + 'a>;
        let cases: Vec<(&str, At, Reply<'_>, &str)> = vec![
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
        ];
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

    #[test]
    fn oversized_contribution_fails_every_rank() {
        let id = unix_id();
        let errs = on_ranks(0..3, |rank| {
            let rdv = connect(&id, rank, 3, LONG).unwrap();
            let mine = if rank == 1 { vec![0u8; MAX_ROUND_BYTES] } else { b"small".to_vec() };
            rdv.all_gather(&mine).unwrap_err()
        });
        assert!(matches!(errs[1], Error::InvalidUsage(_)), "{}", errs[1]);
        assert!(errs[0].to_string().contains("rank 1 aborted round 1"), "{}", errs[0]);
        assert!(errs[2].to_string().contains("rank 1"), "{}", errs[2]);
        // Together over the limit while each is under it: rank 0 refuses.
        let id = unix_id();
        let errs = on_ranks(0..3, |rank| {
            connect(&id, rank, 3, LONG).unwrap().all_gather(&vec![1u8; MAX_ROUND_BYTES / 2]).unwrap_err()
        });
        assert!(errs.iter().all(|e| e.to_string().contains("over the rendezvous limit")), "{errs:?}");
    }

    #[test]
    fn socket_file_is_0600_in_a_0700_dir_and_both_are_removed() {
        let id = unix_id();
        let Endpoint::Unix(socket) = id.endpoint.clone() else { unreachable!() };
        let dir = socket.parent().unwrap().to_path_buf();
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        thread::scope(|s| {
            let root = s.spawn(|| connect(&id, 0, 2, LONG));
            let deadline = Instant::now() + LONG;
            while !socket.exists() {
                assert!(Instant::now() < deadline, "rank 0 never created its socket");
                thread::sleep(Duration::from_millis(1));
            }
            // Published only once its mode is set, so this is never racy.
            assert_eq!(mode(&socket), 0o600);
            assert_eq!(mode(&dir), 0o700);
            let one = connect(&id, 1, 2, LONG).unwrap();
            let root = root.join().unwrap().unwrap();
            // Gone as soon as everyone joined; the connections live on.
            assert!(!socket.exists() && !dir.exists());
            thread::scope(|s| {
                let h = s.spawn(|| one.all_gather(b"1").unwrap());
                assert_eq!(root.all_gather(b"0").unwrap(), h.join().unwrap());
            });
            drop(root);
            drop(one);
        });
        assert!(!dir.exists());
    }
}
