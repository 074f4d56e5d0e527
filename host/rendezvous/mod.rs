//! Rendezvous: the out-of-band all-gather of small messages between the
//! ranks of a communicator (init data, IPC handles, registrations).
//!
//! * [`Id`] — created by rank 0 (`Id::new_unix()` or `Id::new_tcp(addr)`),
//!   passed to the other ranks as a one-line string the way users already
//!   pass NCCL unique ids (a file, an environment variable, their own
//!   channel), and parsed back with `str::parse`.
//! * [`connect`] — joins rank `rank` of `world` through an `Id`. Rank 0
//!   listens (a Unix socket with mode 0600 inside a private 0700 directory,
//!   or a TCP port, loopback by default); the other ranks connect, retrying
//!   until rank 0 is up. The protocol ([`star`]) is a star with a checked
//!   header on every frame (magic, version, job id, sender, round, bounded
//!   length); hostile or malformed peers are rejected without stopping the
//!   good ones; every step is bounded by the timeout and errors name the
//!   rank at fault.
//! * [`in_process_group`] — for ranks that are threads of one process.
//! * The [`Rendezvous`] trait is the plug for a channel you already have:
//!
//! ```
//! use tp_allreduce::rendezvous::Rendezvous;
//! /// A communicator over an existing group (e.g. torch.distributed or MPI):
//! struct MyGroup { rank: usize, world: usize /* , handle to the group */ }
//! impl Rendezvous for MyGroup {
//!     fn rank(&self) -> usize { self.rank }
//!     fn world_size(&self) -> usize { self.world }
//!     fn all_gather(&self, mine: &[u8]) -> tp_allreduce::Result<Vec<Vec<u8>>> {
//!         // Call the group's all-gather of byte strings here.
//!         Ok(vec![mine.to_vec(); self.world])
//!     }
//! }
//! ```

mod in_process;
mod star;
pub mod wire;

use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

pub use in_process::in_process_group;

use crate::error::{Error, Result};

/// An all-gather of byte strings over the ranks of a communicator.
/// Collective: every rank calls each method in the same order.
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

/// Where rank 0 listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket path (inside a private directory).
    Unix(PathBuf),
    Tcp(SocketAddr),
}

/// A communicator's unique id: a random job id and rank 0's endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Id {
    job: [u8; 16],
    endpoint: Endpoint,
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        if f.read_exact(&mut b).is_ok() {
            return b;
        }
    }
    // Fallback: time and pid mixed (still unique per process and call).
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let mut x = t ^ ((std::process::id() as u128) << 64);
    for byte in b.iter_mut() {
        x = x.wrapping_mul(0x2545_F491_4F6C_DD1D_2545_F491_4F6C_DD1D).wrapping_add(0x9E37_79B9);
        *byte = (x >> 64) as u8;
    }
    b
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Id {
    /// A Unix-socket id: creates a private directory (mode 0700) under
    /// `$XDG_RUNTIME_DIR` or the temporary directory; rank 0 will listen on
    /// a socket (mode 0600) inside it and remove both when it is done.
    pub fn new_unix() -> Result<Id> {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|p| p.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        let job = random_bytes::<16>();
        let dir = base.join(format!("tpar-{}", hex(&job[..6])));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| Error::io(format!("creating the rendezvous directory {}", dir.display()), e))?;
        Ok(Id { job, endpoint: Endpoint::Unix(dir.join("rendezvous.sock")) })
    }

    /// A TCP id: rank 0 binds `addr` (use a loopback address unless ranks
    /// run on several hosts; the port must be free).
    pub fn new_tcp(addr: SocketAddr) -> Id {
        Id { job: random_bytes::<16>(), endpoint: Endpoint::Tcp(addr) }
    }

    pub fn job_id(&self) -> [u8; 16] {
        self.job
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Removes the Unix socket and its directory if they are still there
    /// (rank 0 removes them itself; this is for launchers after a crash).
    pub fn remove_files(&self) {
        if let Endpoint::Unix(path) = &self.endpoint {
            let _ = std::fs::remove_file(path);
            if let Some(dir) = path.parent() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

impl fmt::Display for Id {
    /// `tpar1:<job hex>:unix:<path>` or `tpar1:<job hex>:tcp:<address>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.endpoint {
            Endpoint::Unix(p) => write!(f, "tpar1:{}:unix:{}", hex(&self.job), p.display()),
            Endpoint::Tcp(a) => write!(f, "tpar1:{}:tcp:{a}", hex(&self.job)),
        }
    }
}

impl FromStr for Id {
    type Err = Error;
    fn from_str(s: &str) -> Result<Id> {
        let bad = |why: &str| Error::InvalidUsage(format!("not a tp-allreduce id ({why}): {s:?}"));
        let mut parts = s.trim().splitn(4, ':');
        if parts.next() != Some("tpar1") {
            return Err(bad("must start with tpar1:"));
        }
        let job_hex = parts.next().ok_or_else(|| bad("missing job id"))?;
        if job_hex.len() != 32 || !job_hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("the job id must be 32 hex digits"));
        }
        let mut job = [0u8; 16];
        for (i, byte) in job.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&job_hex[2 * i..2 * i + 2], 16).map_err(|_| bad("bad job id"))?;
        }
        let kind = parts.next().ok_or_else(|| bad("missing transport"))?;
        let rest = parts.next().ok_or_else(|| bad("missing address"))?;
        let endpoint = match kind {
            "unix" => {
                let p = PathBuf::from(rest);
                if !p.is_absolute() || rest.contains('\0') {
                    return Err(bad("the socket path must be absolute"));
                }
                Endpoint::Unix(p)
            }
            "tcp" => Endpoint::Tcp(rest.parse().map_err(|_| bad("bad TCP address"))?),
            _ => return Err(bad("transport must be unix or tcp")),
        };
        Ok(Id { job, endpoint })
    }
}

/// The trivial rendezvous of a single rank.
struct Alone;

impl Rendezvous for Alone {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![mine.to_vec()])
    }
}

/// Joins the rendezvous of `id` as rank `rank` of `world` (collective; every
/// step bounded by `timeout`).
pub fn connect(id: &Id, rank: usize, world: usize, timeout: Duration) -> Result<Box<dyn Rendezvous>> {
    if world == 0 || rank >= world {
        return Err(Error::invalid(format!("rendezvous: rank {rank} of world size {world}")));
    }
    if world == 1 {
        return Ok(Box::new(Alone));
    }
    let job = id.job;
    match &id.endpoint {
        Endpoint::Unix(path) if rank == 0 => {
            use std::os::unix::fs::PermissionsExt;
            let listener = UnixListener::bind(path)
                .map_err(|e| Error::io(format!("rank 0: binding the rendezvous socket {}", path.display()), e))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| Error::io("restricting the rendezvous socket to its owner", e))?;
            listener.set_nonblocking(true).map_err(|e| Error::io("configuring the rendezvous socket", e))?;
            let cleanup = path.parent().map(|d| (path.clone(), d.to_path_buf()));
            let star = star::Star::root(listener, world, job, timeout, cleanup.clone());
            if star.is_err() {
                if let Some((s, d)) = cleanup {
                    let _ = std::fs::remove_file(s);
                    let _ = std::fs::remove_dir(d);
                }
            }
            Ok(Box::new(star?))
        }
        Endpoint::Unix(path) => {
            let path = path.clone();
            Ok(Box::new(star::Star::member(move || UnixStream::connect(&path), rank, world, job, timeout)?))
        }
        Endpoint::Tcp(addr) if rank == 0 => {
            let listener = TcpListener::bind(addr).map_err(|e| Error::io(format!("rank 0: binding {addr}"), e))?;
            listener.set_nonblocking(true).map_err(|e| Error::io("configuring the rendezvous socket", e))?;
            Ok(Box::new(star::Star::root(listener, world, job, timeout, None)?))
        }
        Endpoint::Tcp(addr) => {
            let addr = *addr;
            Ok(Box::new(star::Star::member(
                move || TcpStream::connect_timeout(&addr, Duration::from_secs(1)),
                rank,
                world,
                job,
                timeout,
            )?))
        }
    }
}

#[cfg(test)]
mod tests;
