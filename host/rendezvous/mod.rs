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
//!   (`tpar2:unix:<socket path>:<secret hex>`, `tpar2:tcp:<addr>:<secret
//!   hex>`) that carries a random 128-bit secret, so treat it like a
//!   password; `to_string()` and `parse()` round-trip it (`parse()`
//!   ignores whitespace around it, such as an env file's newline), serde
//!   uses the same form, and `{:?}` and every error leave the secret out.
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
//! kind, flags, job id, sender rank, round, payload length; see
//! `wire.rs`), and every wait is bounded by the `timeout` given to
//! `connect`. The job id is derived from the id's secret and travels in the
//! clear; the secret never goes on a socket.
//!
//! 1. **Join.** Rank 0 listens: a Unix socket of mode 0600 inside a private
//!    0700 directory, or a TCP port. Ranks 1..N-1 connect, retrying while
//!    rank 0 is not up yet. Each connection then runs a handshake in which
//!    both ends prove that they hold the secret, with HMAC-SHA256 tags over
//!    fresh nonces (what each tag covers is in `auth.rs`):
//!    * (Unix sockets) each end checks that the other runs as the same user
//!      (`SO_PEERCRED`);
//!    * the member sends HELLO: its rank, world size, a fresh nonce, and a
//!      tag over them;
//!    * rank 0 checks the HELLO's tag (and that it has not seen its nonce
//!      in this join) and answers CHALLENGE: its world size, a fresh
//!      nonce, and a tag over everything said so far;
//!    * the member checks the CHALLENGE's tag, and only then sends PROOF, a
//!      tag over everything said so far under another label;
//!    * rank 0 checks the PROOF.
//!
//!    From then on every frame of that connection is sealed: it ends with a
//!    tag under a key of this connection and direction (derived from the
//!    secret and both nonces) over a sequence number, the header and the
//!    payload. A frame altered in flight, replayed (from this connection
//!    or another one, this rendezvous or an earlier one) or sent back to
//!    its sender does not open, and the connection fails with that reason.
//!    Rank 0 admits an authenticated connection if its rank is in 1..N-1,
//!    its world size is rank 0's and no connection has joined as that rank
//!    yet (the first one wins); else it refuses it with a sealed ABORT
//!    that says why, and the member fails at once with that reason. A
//!    member also fails at once when the CHALLENGE shows rank 0 was started
//!    with another world size. When all N-1 have joined, rank 0 stops
//!    listening (the socket file and directory are removed) and sends a
//!    sealed WELCOME to each.
//! 2. **Rounds.** For each `all_gather`, ranks 1..N-1 send GATHER(round,
//!    bytes); rank 0 waits for all of them and sends RESULT(round, all
//!    bytes) back. Connections stay open for the next round. Every frame
//!    must open under its connection's session and come from the rank its
//!    connection joined as, for this job, of the expected kind and round; a
//!    rank also checks that RESULT holds its own bytes.
//! 3. **Failure.** A rank that does not arrive in time, closes its
//!    connection (exit, crash, drop) or breaks the protocol fails rank 0's
//!    current call with an error naming it; rank 0 then sends ABORT with the
//!    reason to every other rank, so they fail at once with the same reason
//!    instead of timing out. A rank that loses rank 0 reports rank 0. After
//!    any failure the rendezvous is unusable: every later call fails.
//!
//! **Strangers, floods and squatters.** Rank 0 runs each new connection's
//! handshake on a thread of its own, within a short limit (a second at
//! most), and keeps accepting meanwhile. Anything that fails the handshake
//! is refused and closed (with a plain ABORT that says why when its header
//! was readable, carrying the job id the peer sent), and rank 0 keeps
//! waiting for the good ranks. At most 64 connections that have not sent
//! a HELLO with a valid tag are held at once; a new one closes the oldest
//! of them, so silent or garbage connections, however many, only push one
//! another out, never a connection that has shown the secret. A member
//! trusts nothing before rank 0's CHALLENGE checks out: when the peer
//! fails the handshake (a process squatting on rank 0's port, a plain
//! ABORT, garbage), or the connection ends before WELCOME (rank 0 had no
//! room for it), the member has sent nothing but its HELLO; it closes that
//! connection and dials again, backing off up to 100 ms, until its timeout,
//! and then fails naming the last reason ("nothing there passed
//! authentication as rank 0 of this job" if no peer ever proved itself).
//!
//! Guarantees: a malformed, foreign or hostile connection never crashes a
//! rank, never makes one allocate more than the frame limit, never learns
//! a rank's round bytes, never makes a rank accept bytes it did not send
//! with the secret, and never stops the good ranks from joining; no call
//! blocks longer than its timeout (ranks 1..N-1 wait a short grace beyond
//! it for rank 0's answer, so that they receive its diagnosis — "ranks [2,
//! 5] did not join" — rather than only "rank 0 did not answer"). The
//! timeout therefore also bounds how far apart in time the ranks may reach
//! the same call. One round carries at most [`MAX_ROUND_BYTES`], and rank
//! 0 holds at most that many bytes of received frames at once: a reader
//! reserves a frame's bytes from its header before reading the payload,
//! and a frame that does not fit fails its rank.
//!
//! # Security
//!
//! What admits a rank is the secret in the id: hand the id string to the
//! ranks the way you would a password (an environment variable, a file of
//! mode 0600), never on a command line others can read. With Unix sockets,
//! only processes of the same user can connect (0700 directory of this
//! user, in a parent others cannot write to without the sticky bit; 0600
//! socket) and both ends check the other's uid. With TCP anyone who can
//! reach the port can connect, or bind it before rank 0 does; they cannot
//! join, nor pass for rank 0, nor read or change what the ranks exchange
//! without the secret (the rounds are authenticated, not encrypted: a
//! process that can read loopback traffic sees the bytes), but they can
//! delay the join until the timeout by holding the port. Bind to loopback
//! (`127.0.0.1:<port>`), which suffices for the GPUs of one host;
//! [`Id::new_tcp`] logs a warning for an unspecified address (`0.0.0.0`,
//! `::`), which listens on every network of the host.
//!
//! # Files
//!
//! * `mod.rs` — the [`Rendezvous`] trait, [`Id`], [`connect`], and what
//!   both sides of [`connect`] share: the `Conn` and `Listen` seams
//!   over the transports, deadline-bounded frame I/O, ABORT helpers.
//! * `auth.rs` — the secret, the nonces, every tag and what it covers, and
//!   the sealing of a connection's frames.
//! * `root.rs` — rank 0: accepting connections, their handshakes (and
//!   making room under a flood), admission, WELCOME, collecting each
//!   round, relaying ABORTs.
//! * `member.rs` — ranks 1..N-1: dialing rank 0, the handshake (and
//!   dialing again past peers that fail it), each round's GATHER and
//!   RESULT.
//! * `wire.rs` — the frame format: encoding, reading from any `Read`,
//!   and the checks of what a frame says and of what the receiver expects.
//! * `unix.rs`, `tcp.rs` — the two transports (listen, dial, `Conn`).
//! * `in_process.rs` — [`in_process_group`], no sockets.
//! * `json.rs` — all-gathers of JSON-encoded records (init, registration).
//! * Tests: each file tests its own code; `tests.rs` runs the whole
//!   protocol over both transports, with helpers in `testing.rs`; beside
//!   it, `tests/attacks.rs` attacks it as an attacker would (a squatter on
//!   rank 0's port, floods, a relay that records, replays and alters
//!   frames, peers of another user) and `tests/fuzz/` feeds generated,
//!   mutated and replayed frames to both sides' handshakes, to rank 0 and
//!   to a member, and checks each outcome against what the protocol above
//!   promises. The fuzz may take minutes (its bound is 240 s): it runs with
//!   `TPAR_RDV_FUZZ=1` (CI's `.ci/test.sh` sets it) and otherwise prints a
//!   visible skip.

#![forbid(unsafe_code)]

mod auth;
mod in_process;
mod json;
mod member;
mod root;
mod tcp;
mod unix;
mod wire;

#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;

pub use in_process::in_process_group;
pub(crate) use json::all_gather_json;

use std::fmt;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use auth::{Sealer, Secret};
use member::Member;
use root::Root;
use wire::{Abort, AbortCode, Frame, Kind, WireError};

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

/// `rdv.all_gather(mine)`, checked to hold one part per rank: a user's
/// [`Rendezvous`] that returns another count is a protocol error here,
/// not an index out of bounds further on.
pub(crate) fn all_gather_counted(rdv: &dyn Rendezvous, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let all = rdv.all_gather(mine)?;
    if all.len() != rdv.world_size() {
        return Err(Error::Protocol {
            from: "the rendezvous".into(),
            what: format!("all_gather returned {} part(s) for a world of {} ranks", all.len(), rdv.world_size()),
        });
    }
    Ok(all)
}

/// A user's [`Rendezvous`] whose every `all_gather` is checked to hold one
/// part per rank (what the communicator's setup indexes by rank).
pub(crate) struct Counted(pub Box<dyn Rendezvous>);

impl Rendezvous for Counted {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        all_gather_counted(&*self.0, mine)
    }
    fn barrier(&self) -> Result<()> {
        self.0.barrier()
    }
}

/// Limit on one round of [`connect`]'s all-gather: the sum of all ranks'
/// contributions plus 4 bytes per rank plus 4.
pub const MAX_ROUND_BYTES: usize = wire::MAX_PAYLOAD;

/// Largest world size [`connect`] accepts (rank 0 keeps a thread per rank).
pub const MAX_WORLD_SIZE: usize = 1024;

/// The id string's version: `tpar2` ids carry a secret (`tpar1` ids carried
/// the job id itself, and builds that read them would send it in the clear).
const ID_PREFIX: &str = "tpar2";
/// Longest id string `FromStr` accepts.
const MAX_ID_LEN: usize = 256;

/// Where rank 0 listens, and the secret that admits a rank to the job.
/// Created by rank 0 and passed to the others out of band, like a
/// password; see the [module docs](self).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Id {
    endpoint: Endpoint,
    secret: Secret,
    /// Derived from `secret`.
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
        let secret = random_bytes::<{ auth::SECRET_LEN }>()?;
        Ok(Id::with_secret(Endpoint::Unix(unix::create_private_dir()?), secret))
    }

    /// A new id for a TCP rendezvous where rank 0 listens on `addr`. Use a
    /// loopback address with a free port (`127.0.0.1:29500`). An
    /// unspecified address (`0.0.0.0`, `::`) listens on every network of
    /// the host and is logged as a warning; see the module docs.
    pub fn new_tcp(addr: SocketAddr) -> Id {
        if addr.ip().is_unspecified() {
            log::warn!(
                "rendezvous Id::new_tcp({addr}): rank 0 will listen on every network of this host, so anyone who \
                 can reach the port can connect (without the id's secret they cannot join, but they can hold \
                 connections open); use 127.0.0.1:{} for the GPUs of one host",
                addr.port()
            );
        }
        let secret = random_bytes::<{ auth::SECRET_LEN }>().unwrap_or_else(|_| fallback_random());
        Id::with_secret(Endpoint::Tcp(addr), secret)
    }

    fn with_secret(endpoint: Endpoint, secret: Secret) -> Id {
        Id { endpoint, secret, job: auth::job_id(&secret) }
    }

    /// The job id every frame carries (derived from the secret; public).
    pub fn job_id(&self) -> [u8; 16] {
        self.job
    }

    /// Removes what a Unix id left on disk (the socket and the private
    /// directory), if anything: rank 0 removes both once every rank joined,
    /// but not when it died before that. For launchers, after all ranks
    /// exited. A no-op for TCP ids.
    pub fn remove_files(&self) {
        if let Endpoint::Unix(path) = &self.endpoint {
            let _ = std::fs::remove_file(path);
            if let Some(dir) = path.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.endpoint {
            // Paths are checked to be printable ASCII when the id is made.
            Endpoint::Unix(p) => write!(f, "{ID_PREFIX}:unix:{}:{}", p.display(), hex(&self.secret)),
            Endpoint::Tcp(a) => write!(f, "{ID_PREFIX}:tcp:{a}:{}", hex(&self.secret)),
        }
    }
}

/// Leaves the secret out (debug output ends up in logs); `Display` is the
/// whole id.
impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({}, job {}, secret not shown)", self.endpoint, hex(&self.job))
    }
}

impl FromStr for Id {
    type Err = Error;

    fn from_str(s: &str) -> Result<Id> {
        // Ids come from environment files and secrets, which often end in
        // a newline: whitespace around the id is not part of it.
        let s = s.trim_matches(|c: char| c.is_ascii_whitespace());
        // The string holds the secret and errors end up in logs: say what
        // is wrong, never what the string says (not even a part of it).
        let bad = |why: &str| {
            Error::invalid(format!("invalid rendezvous id ({} bytes, not shown: it holds a secret): {why}", s.len()))
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
        let (place, secret_hex) = rest.rsplit_once(':').ok_or_else(|| bad("missing the secret"))?;
        let secret = unhex16(secret_hex).ok_or_else(|| bad("the secret must be 32 lowercase hex digits"))?;
        let endpoint = match kind {
            "unix" => {
                let path = PathBuf::from(place);
                unix::check_socket_path(&path).map_err(|why| bad(&why))?;
                Endpoint::Unix(path)
            }
            "tcp" => Endpoint::Tcp(place.parse().map_err(|_| bad("the address must be IP:port, [IPv6]:port"))?),
            _ => return Err(bad("unknown transport (expected unix or tcp)")),
        };
        Ok(Id::with_secret(endpoint, secret))
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

/// Bytes from the OS random source (`getrandom(2)`).
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    getrandom::getrandom(&mut out).map_err(|e| {
        Error::io("reading the OS random source for a rendezvous secret or nonce", io::Error::other(e.to_string()))
    })?;
    Ok(out)
}

/// Only for `Id::new_tcp`, which cannot fail, when the OS random source
/// cannot be read: SipHash under std's hash keys (themselves taken from the
/// OS random source once per thread), the time and the pid.
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
    /// How long a new connection to rank 0 has for its whole handshake
    /// (HELLO, then PROOF); a member waits twice this for a CHALLENGE
    /// before it tries again.
    handshake_timeout: Duration,
    /// Connections rank 0 holds at once that have not sent a valid HELLO
    /// yet; a new one closes the oldest of them.
    max_pending: usize,
    /// Extra time ranks 1.. wait for rank 0, so rank 0's own timeout fires
    /// first and its diagnosis reaches them.
    grace: Duration,
}

impl Limits {
    fn for_timeout(timeout: Duration) -> Limits {
        Limits {
            handshake_timeout: timeout.min(Duration::from_secs(1)),
            max_pending: 64,
            grace: (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(2)),
        }
    }
}

/// Bound on sending an ABORT (best effort; the peer may be gone or stuck).
const ABORT_WRITE_TIMEOUT: Duration = Duration::from_millis(250);

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
    let link = Link { secret: id.secret, job: id.job, world, timeout, limits };
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
    /// The peer process's user id, where the transport knows it (Unix
    /// sockets: `SO_PEERCRED`); `None` for TCP.
    fn peer_uid(&self) -> io::Result<Option<u32>>;
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

/// Best-effort plain ABORT, to a peer that has not authenticated (the
/// peer may already be gone).
fn send_plain_abort(conn: &dyn Conn, job: &[u8; 16], sender: u32, round: u32, abort: &Abort) {
    if let Ok(frame) = wire::encode(Kind::Abort, job, sender, round, &wire::encode_abort(abort)) {
        let _ = write_frame(conn, Instant::now() + ABORT_WRITE_TIMEOUT, &frame);
    }
}

/// Best-effort sealed ABORT, within an authenticated session.
fn send_abort(conn: &dyn Conn, seal: &mut Sealer, job: &[u8; 16], sender: u32, round: u32, abort: &Abort) {
    if let Ok(frame) = wire::encode_unsealed_body(Kind::Abort, job, sender, round, &wire::encode_abort(abort)) {
        let _ = write_frame(conn, Instant::now() + ABORT_WRITE_TIMEOUT, &seal.seal(frame));
    }
}

/// One sealed frame of `kind`.
fn sealed(seal: &mut Sealer, kind: Kind, job: &[u8; 16], sender: u32, round: u32, payload: &[u8]) -> Result<Vec<u8>> {
    let frame =
        wire::encode_unsealed_body(kind, job, sender, round, payload).map_err(|e| Error::Rendezvous(e.to_string()))?;
    Ok(seal.seal(frame))
}

/// This process's effective user id, which a Unix-socket peer must share.
fn own_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
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
    secret: Secret,
    job: [u8; 16],
    world: usize,
    timeout: Duration,
    limits: Limits,
}

#[cfg(test)]
mod api_tests {
    use super::*;
    use crate::rendezvous::testing::{private_dir, tcp_id, unix_id, warnings_during, LONG};
    use std::fs;

    #[test]
    fn id_round_trips_through_display_fromstr_and_serde() {
        let unix = unix_id();
        let ids =
            [unix.clone(), Id::new_tcp("127.0.0.1:29500".parse().unwrap()), Id::new_tcp("[::1]:7".parse().unwrap())];
        for id in &ids {
            let s = id.to_string();
            assert!(s.starts_with("tpar2:") && s.bytes().all(|b| b.is_ascii_graphic()), "{s}");
            assert!(s.ends_with(&hex(&id.secret)), "{s}");
            let back = s.parse::<Id>().unwrap();
            assert_eq!(&back, id);
            assert_eq!((back.secret, back.job_id()), (id.secret, id.job_id()));
            let json = serde_json::to_string(id).unwrap();
            assert_eq!(json, format!("\"{s}\""));
            assert_eq!(&serde_json::from_str::<Id>(&json).unwrap(), id);
            // The job id is derived from the secret and tells nothing of it.
            assert_eq!(id.job_id(), auth::job_id(&id.secret));
            assert!(!s.contains(&hex(&id.job_id())), "{s}");
            // Debug output (logs) leaves the secret out.
            let debug = format!("{id:?}");
            assert!(!debug.contains(&hex(&id.secret)) && debug.contains("secret not shown"), "{debug}");
        }
        assert!(ids[0].to_string().starts_with("tpar2:unix:/"));
        assert_eq!(ids[2].to_string(), format!("tpar2:tcp:[::1]:7:{}", hex(&ids[2].secret)));
        assert_ne!(ids[1].secret, ids[2].secret);
        assert_ne!(ids[1].job_id(), ids[2].job_id());
        fs::remove_dir(private_dir(&unix).unwrap()).unwrap();
    }

    #[test]
    fn id_fromstr_rejects_malformed() {
        let key = "00112233445566778899aabbccddeeff";
        let sock = "/tmp/tpar-0123456789abcdef/rdv.sock";
        let cases = [
            ("".to_string(), "not a tp-allreduce"),
            ("hello".into(), "not a tp-allreduce"),
            // Ids of earlier builds carried the job id instead of a secret.
            (format!("tpar1:tcp:127.0.0.1:5:{key}"), "unsupported id version"),
            (format!("tpar3:tcp:127.0.0.1:5:{key}"), "unsupported id version"),
            (format!("tpar2:udp:127.0.0.1:5:{key}"), "unknown transport"),
            ("tpar2:tcp".into(), "missing the transport"),
            ("tpar2:tcp:127.0.0.1".into(), "missing the secret"),
            (format!("tpar2:tcp:127.0.0.1:5:{}", &key[..31]), "secret must be"),
            (format!("tpar2:tcp:127.0.0.1:5:{}", key.to_uppercase()), "secret must be"),
            (format!("tpar2:tcp:127.0.0.1:5:{key}0"), "secret must be"),
            (format!("tpar2:tcp:localhost:5:{key}"), "IP:port"),
            (format!("tpar2:tcp:127.0.0.1:{key}"), "IP:port"),
            (format!("tpar2:tcp:127.0.0.1:99999:{key}"), "IP:port"),
            (format!("tpar2:unix:relative/tpar-0123456789abcdef/rdv.sock:{key}"), "absolute"),
            (format!("tpar2:unix:/tmp/other/rdv.sock:{key}"), "tpar-"),
            (format!("tpar2:unix:/etc/passwd:{key}"), "rdv.sock"),
            (format!("tpar2:unix:{sock}\n:{key}"), "one line"),
            (format!("tpar2:unix:/tmp/a b/x:{key}"), "one line"),
            (format!("tpar2:unix:/tmp/é/x:{key}"), "one line"),
            (format!("tpar2:tcp:127.0.0.1:5:{key}{}", "0".repeat(300)), "longer than"),
        ];
        for (s, want) in cases {
            let err = s.parse::<Id>().expect_err(&s);
            assert!(matches!(err, Error::InvalidUsage(_)), "{s:?}: {err}");
            assert!(err.to_string().contains(want), "{s:?}: {err} (wanted {want:?})");
        }
        assert!(format!("tpar2:unix:{sock}:{key}").parse::<Id>().is_ok());
        assert!(serde_json::from_str::<Id>("\"tpar2:tcp:x\"").is_err());
    }

    /// Ids come from environment files and secrets, which often end in a
    /// newline, and errors land in logs: a near-miss id is accepted when
    /// only surrounding whitespace is off, and an error never shows the
    /// secret (nor a piece of it) in its Display or Debug form.
    #[test]
    fn near_miss_ids_never_echo_the_secret() {
        let key = "00112233445566778899aabbccddeeff";
        let sock = "/tmp/tpar-0123456789abcdef/rdv.sock";
        for good in [format!("tpar2:tcp:127.0.0.1:5:{key}"), format!("tpar2:unix:{sock}:{key}")] {
            let want = good.parse::<Id>().unwrap();
            let near_misses = [
                format!("{good}\n"),
                format!("{good}\r\n"),
                format!("{good}\r"),
                format!("{good} "),
                format!(" {good}"),
                format!("\t{good}\n"),
                good.replace(key, &key.to_uppercase()),
                format!("{good}0"),
                format!("{good}\n{good}"),
                format!("{good}:{key}"),
                format!("{good}{}", " ".repeat(300)),
                format!("{}{good}", "0".repeat(300)),
                good.replacen("tpar2", "tpar3", 1),
                good.replacen(':', ";", 2),
            ];
            for s in near_misses {
                let err = match s.parse::<Id>() {
                    Ok(id) => {
                        assert_eq!(id, want, "{s:?}");
                        continue;
                    }
                    Err(e) => e,
                };
                assert!(matches!(err, Error::InvalidUsage(_)), "{s:?}: {err}");
                for shown in [err.to_string(), format!("{err:?}")] {
                    for piece in [&key[..8], &key[8..16], &key[16..24], &key[24..]] {
                        assert!(
                            !shown.contains(piece) && !shown.contains(&piece.to_uppercase()),
                            "{s:?}: the error shows the secret: {shown}"
                        );
                    }
                }
            }
        }
    }

    /// A wildcard address exposes the port to every network of the host:
    /// `Id::new_tcp` says so through `log`; loopback and specific
    /// addresses stay quiet.
    #[test]
    fn new_tcp_on_an_unspecified_address_warns() {
        for addr in ["0.0.0.0:29500", "[::]:29500"] {
            let warned = warnings_during(|| drop(Id::new_tcp(addr.parse().unwrap())));
            assert!(
                warned.len() == 1 && warned[0].contains("every network") && warned[0].contains(addr),
                "{addr}: {warned:?}"
            );
        }
        for addr in ["127.0.0.1:29500", "[::1]:29500", "10.1.2.3:29500"] {
            let warned = warnings_during(|| drop(Id::new_tcp(addr.parse().unwrap())));
            assert!(warned.iter().all(|w| !w.contains("every network")), "{addr}: {warned:?}");
        }
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
}
