//! File descriptors for ranks in other processes (`SCM_RIGHTS` over a Unix
//! socket): how cuMem buffers exported as POSIX file descriptors reach the
//! peers that map them. The rendezvous all-gather carries bytes only, so a
//! rank with descriptors to hand out listens on a socket of its own
//! ([`FdServer`]), publishes its path and a random nonce through the
//! rendezvous ([`FdSocket`]), and serves every expected rank on a thread of
//! its own ([`Serving`]) while it fetches its peers' descriptors itself
//! ([`fetch_fds`]): all ranks serve and fetch at once, none waits for
//! another's turn.
//!
//! Protocol (integers little-endian):
//! * request, peer -> owner, 32 bytes: `TPARFDQ1`, the nonce (16 bytes),
//!   the peer's rank (u32), zero (u32);
//! * batches, owner -> peer: a 16-byte header `TPFD`, batch length, total,
//!   batch index (u32 each), with the batch's descriptors attached as one
//!   `SCM_RIGHTS` message; at most [`MAX_FDS_PER_BATCH`] per batch (Linux
//!   refuses more than 253 in one message), in the owner's order.
//!
//! Access control is the directory: `<$XDG_RUNTIME_DIR or the temp
//! dir>/tpar-fd-<16 hex>/`, mode 0700, socket mode 0600, so only the same
//! user can connect; the nonce keeps any other connection from being
//! served. Both ends also check the other's uid (`SO_PEERCRED`): the owner
//! serves no process of another user, whatever path it took to the socket,
//! and a peer fetches only from a path of that shape in a directory of its
//! own user, closed to others, from a server of its own user. The socket
//! and its directory are removed when the server ends (every expected rank
//! served, the deadline passed, or the step abandoned). Every wait is
//! bounded by the step's deadline; a fetcher drains every batch even when
//! it cannot use them, so the owner never waits for a peer that already
//! gave up.
//!
//! The descriptors are cuMem exports: on the NVIDIA driver (checked with
//! 580.159), `fstat` shows each as the control device `/dev/nvidiactl`
//! (a character device owned by root, size 0), so neither its owner nor its
//! size says anything about the allocation behind it; what a fetcher checks
//! is that each is a character device ([`check_cumem_fd`]) before the
//! driver imports it, and the driver checks the sizes it maps.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{getsockopt, recvmsg, sendmsg, sockopt, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{Deserialize, Serialize};

use crate::driver::vmm::adopt_received_fds;
use crate::error::{Error, Result};
use crate::rendezvous::{hex, random_bytes};

/// Descriptors per `SCM_RIGHTS` message (the kernel's limit is 253).
pub(crate) const MAX_FDS_PER_BATCH: usize = 250;
const REQUEST_MAGIC: &[u8; 8] = b"TPARFDQ1";
const REQUEST_LEN: usize = 32;
const BATCH_MAGIC: &[u8; 4] = b"TPFD";
const HEADER_LEN: usize = 16;
const DIR_PREFIX: &str = "tpar-fd-";
const SOCKET_NAME: &str = "fd.sock";
/// How long a connection may take to send its request.
const REQUEST_WAIT: Duration = Duration::from_secs(5);
/// `sun_path` holds 108 bytes including the terminating NUL.
const MAX_SOCKET_PATH: usize = 107;

/// Where a rank hands out its descriptors (published through the rendezvous).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FdSocket {
    pub path: String,
    pub nonce: [u8; 16],
}

/// The end of a step's exchange of descriptors, and when it began.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    start: Instant,
    end: Instant,
}

impl Deadline {
    pub fn after(timeout: Duration) -> Deadline {
        let start = Instant::now();
        Deadline { start, end: start + timeout }
    }

    fn remaining(&self) -> Option<Duration> {
        Some(self.end.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero())
    }

    fn expired(&self, what: String) -> Error {
        Error::RendezvousTimeout { what, waited_ms: self.start.elapsed().as_millis() as u64 }
    }
}

/// A listening socket in a fresh private directory; dropping it removes both.
pub(crate) struct FdServer {
    listener: UnixListener,
    socket: PathBuf,
    dir: PathBuf,
    nonce: [u8; 16],
}

impl FdServer {
    pub fn bind() -> Result<FdServer> {
        let dir = create_private_dir()?;
        let socket = dir.join(SOCKET_NAME);
        let listener = match UnixListener::bind(&socket) {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                return Err(Error::io(format!("binding {}", socket.display()), e));
            }
        };
        let server = FdServer { listener, socket, dir, nonce: random_bytes::<16>()? };
        std::fs::set_permissions(&server.socket, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::io(format!("setting mode 0600 on {}", server.socket.display()), e))?;
        server.listener.set_nonblocking(true).map_err(|e| Error::io("making the descriptor socket non-blocking", e))?;
        Ok(server)
    }

    pub fn address(&self) -> FdSocket {
        FdSocket { path: self.socket.to_string_lossy().into_owned(), nonce: self.nonce }
    }

    /// Serves `fds` to each of `ranks` once, on a thread of its own, until
    /// all have fetched them or `deadline` passes.
    pub fn serve(self, fds: Vec<OwnedFd>, ranks: &[usize], deadline: Deadline) -> Result<Serving> {
        let stop = Arc::new(AtomicBool::new(false));
        let pending: BTreeSet<usize> = ranks.iter().copied().collect();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tp-allreduce-fds".into())
            .spawn(move || self.serve_all(&fds, pending, deadline, &flag))
            .map_err(|e| Error::io("starting the descriptor-serving thread", e))?;
        Ok(Serving { stop, thread: Some(thread) })
    }

    fn serve_all(
        &self,
        fds: &[OwnedFd],
        mut pending: BTreeSet<usize>,
        deadline: Deadline,
        stop: &AtomicBool,
    ) -> Result<()> {
        let mut refused: Vec<String> = Vec::new();
        while !pending.is_empty() {
            if stop.load(Ordering::Relaxed) {
                return Err(Error::Ipc("the registration step was abandoned".into()));
            }
            if deadline.remaining().is_none() {
                let why =
                    if refused.is_empty() { String::new() } else { format!(" (refused: {})", refused.join("; ")) };
                return Err(deadline
                    .expired(format!("rank(s) {pending:?} did not collect this rank's cuMem file descriptors{why}")));
            }
            match self.listener.accept() {
                Ok((stream, _)) => match self.serve_one(&stream, fds, &pending, deadline) {
                    Ok(rank) => {
                        pending.remove(&rank);
                    }
                    Err(e) if refused.len() < 4 => refused.push(e.to_string()),
                    Err(_) => {}
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("accepting on the descriptor socket", e)),
            }
        }
        Ok(())
    }

    /// Answers one connection; returns the rank served.
    fn serve_one(
        &self,
        stream: &UnixStream,
        fds: &[OwnedFd],
        pending: &BTreeSet<usize>,
        deadline: Deadline,
    ) -> Result<usize> {
        stream.set_nonblocking(false).map_err(|e| Error::io("configuring a descriptor connection", e))?;
        check_peer_uid(stream, "a process asking for descriptors")?;
        set_timeouts(stream, deadline)?;
        // A fetcher asks as soon as it connects: a silent connection must not
        // hold up the ranks behind it for the whole step.
        let ask = deadline.remaining().unwrap_or_default().min(REQUEST_WAIT).max(Duration::from_millis(1));
        stream.set_read_timeout(Some(ask)).map_err(|e| Error::io("setting descriptor socket timeouts", e))?;
        let mut request = [0u8; REQUEST_LEN];
        (&*stream).read_exact(&mut request).map_err(|e| io_error("reading a descriptor request", e, deadline))?;
        let (nonce, rank) = decode_request(&request)?;
        if nonce != self.nonce {
            return Err(protocol("a descriptor request carried the wrong nonce"));
        }
        if !pending.contains(&rank) {
            return Err(protocol(&format!("rank {rank} asked for descriptors it is not due (or already has)")));
        }
        send_fds(stream, fds, deadline)?;
        Ok(rank)
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A server at work. [`finish`](Self::finish) waits for it; dropping it
/// stops it (the step was abandoned). Either way the socket is removed.
pub(crate) struct Serving {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Serving {
    /// Waits until every expected rank fetched the descriptors, or the
    /// deadline passed (an error naming the ranks that did not).
    pub fn finish(mut self) -> Result<()> {
        self.join()
    }

    fn join(&mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| Err(Error::Broken("the descriptor-serving thread panicked".into()))),
            None => Ok(()),
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.join();
    }
}

/// Fetches, as rank `rank`, the `expected` descriptors the owner of
/// `address` serves, handing each batch to `on_batch` (which takes
/// ownership). Every batch is received even after `on_batch` failed; its
/// first error is returned then.
pub(crate) fn fetch_fds(
    address: &FdSocket,
    rank: usize,
    expected: usize,
    deadline: Deadline,
    on_batch: impl FnMut(Vec<OwnedFd>) -> Result<()>,
) -> Result<()> {
    let path = Path::new(&address.path);
    check_socket_path(path)?;
    check_private_dir(path)?;
    let stream = UnixStream::connect(&address.path).map_err(|e| {
        Error::io(
            format!(
                "connecting to {} (the descriptor socket of a rank in another process; ranks in separate \
                 containers need a shared $XDG_RUNTIME_DIR or temp dir)",
                address.path
            ),
            e,
        )
    })?;
    check_peer_uid(&stream, "the process serving descriptors")?;
    set_timeouts(&stream, deadline)?;
    send_all(&stream, &encode_request(&address.nonce, rank), &[], deadline, "sending a descriptor request")?;
    receive_fds(&stream, expected, deadline, on_batch)
}

/// Receives batches until `expected` descriptors arrived (one empty batch
/// when `expected` is 0).
pub(crate) fn receive_fds(
    stream: &UnixStream,
    expected: usize,
    deadline: Deadline,
    mut on_batch: impl FnMut(Vec<OwnedFd>) -> Result<()>,
) -> Result<()> {
    let (mut received, mut index) = (0usize, 0u32);
    let mut first_error = None;
    loop {
        let (header, fds) = receive_batch(stream, deadline)?;
        let (len, total, batch) = decode_header(&header)?;
        if batch != index || total as usize != expected || len as usize != fds.len() || received + fds.len() > expected
        {
            return Err(protocol(&format!(
                "descriptor batch {batch} (expected {index}) announced {len} of {total} (expected {expected} in all, \
                 {received} so far) and carried {}",
                fds.len()
            )));
        }
        received += fds.len();
        index += 1;
        if first_error.is_none() {
            if let Err(e) = on_batch(fds) {
                first_error = Some(e);
            }
        }
        if received == expected {
            return first_error.map_or(Ok(()), Err);
        }
    }
}

/// Sends `fds` in batches (one empty batch when there are none).
pub(crate) fn send_fds(stream: &UnixStream, fds: &[OwnedFd], deadline: Deadline) -> Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let total = raw.len() as u32;
    let batches: Vec<&[RawFd]> = if raw.is_empty() { vec![&[]] } else { raw.chunks(MAX_FDS_PER_BATCH).collect() };
    for (index, batch) in batches.into_iter().enumerate() {
        let header = encode_header(batch.len() as u32, total, index as u32);
        send_batch(stream, &header, batch, deadline)?;
    }
    Ok(())
}

fn send_batch(stream: &UnixStream, header: &[u8; HEADER_LEN], fds: &[RawFd], deadline: Deadline) -> Result<()> {
    set_timeouts(stream, deadline)?;
    send_all(stream, header, fds, deadline, "sending file descriptors")
}

/// Sends all of `bytes`, with `fds` attached to the first part. Never
/// raises SIGPIPE (a peer that hung up is an error), whatever the host
/// process does with that signal.
fn send_all(stream: &UnixStream, bytes: &[u8], fds: &[RawFd], deadline: Deadline, what: &str) -> Result<()> {
    let rights = [ControlMessage::ScmRights(fds)];
    let mut cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    let mut rest = bytes;
    while !rest.is_empty() {
        match sendmsg::<()>(stream.as_raw_fd(), &[IoSlice::new(rest)], cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(errno_error(what, e, deadline)),
            Ok(0) => return Err(Error::Ipc(format!("{what}: the peer stopped reading"))),
            Ok(sent) => {
                // The descriptors travel with the first byte; the rest is plain data.
                cmsgs = &[];
                rest = &rest[sent.min(rest.len())..];
            }
        }
    }
    Ok(())
}

fn receive_batch(stream: &UnixStream, deadline: Deadline) -> Result<([u8; HEADER_LEN], Vec<OwnedFd>)> {
    set_timeouts(stream, deadline)?;
    let mut header = [0u8; HEADER_LEN];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS_PER_BATCH]);
    let (bytes, fds, truncated) = {
        let mut iov = [IoSliceMut::new(&mut header)];
        let message = loop {
            match recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
                Err(Errno::EINTR) => continue,
                other => break other.map_err(|e| errno_error("receiving file descriptors", e, deadline))?,
            }
        };
        let truncated = message.flags.contains(MsgFlags::MSG_CTRUNC);
        let mut fds = Vec::new();
        // With MSG_CTRUNC nix refuses to walk the control data (below).
        if let (false, Ok(cmsgs)) = (truncated, message.cmsgs()) {
            for cmsg in cmsgs {
                if let ControlMessageOwned::ScmRights(raw) = cmsg {
                    fds.extend(adopt_received_fds(&raw));
                }
            }
        }
        (message.bytes, fds, truncated)
    };
    if truncated {
        // The kernel installed in this process the descriptors that fit
        // before it flagged the truncation: close them.
        drop(adopt_received_fds(&rights_in_control(&space)));
        return Err(Error::Ipc(
            "file descriptors from a peer arrived truncated: this process may have reached its open-file limit \
             (ulimit -n)"
                .into(),
        ));
    }
    if bytes == 0 {
        return Err(Error::Ipc("the peer closed its descriptor socket before sending every descriptor".into()));
    }
    if bytes < HEADER_LEN {
        (&*stream).read_exact(&mut header[bytes..]).map_err(|e| io_error("receiving file descriptors", e, deadline))?;
    }
    Ok((header, fds))
}

// `rights_in_control` reads `cmsg_len` as a `usize` at offset 0 (glibc).
const _: () = assert!(std::mem::offset_of!(libc::cmsghdr, cmsg_level) == std::mem::size_of::<usize>());

/// The descriptors of the `SCM_RIGHTS` messages in a received control
/// buffer, walked by hand: nix refuses a truncated one (`MSG_CTRUNC`),
/// where the kernel still installed the descriptors that fit (and set
/// `cmsg_len` to what it wrote). The buffer starts zeroed, so a header of
/// length 0 ends it.
fn rights_in_control(buf: &[u8]) -> Vec<RawFd> {
    use std::mem::{offset_of, size_of};
    let header = size_of::<libc::cmsghdr>();
    let word = size_of::<usize>();
    let i32_at = |at: usize| buf.get(at..at + 4).map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    let mut out = Vec::new();
    let mut at = 0;
    while at + header <= buf.len() {
        let mut len_bytes = [0u8; size_of::<usize>()];
        len_bytes.copy_from_slice(&buf[at..at + word]);
        let len = usize::from_ne_bytes(len_bytes).min(buf.len() - at);
        if len < header {
            break;
        }
        let level = i32_at(at + offset_of!(libc::cmsghdr, cmsg_level));
        let kind = i32_at(at + offset_of!(libc::cmsghdr, cmsg_type));
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            out.extend((at + header..at + len).step_by(4).filter(|i| i + 4 <= at + len).map(&i32_at));
        }
        at += len.div_ceil(word) * word;
    }
    out
}

fn encode_request(nonce: &[u8; 16], rank: usize) -> [u8; REQUEST_LEN] {
    let mut out = [0u8; REQUEST_LEN];
    out[..8].copy_from_slice(REQUEST_MAGIC);
    out[8..24].copy_from_slice(nonce);
    out[24..28].copy_from_slice(&(rank as u32).to_le_bytes());
    out
}

fn decode_request(b: &[u8; REQUEST_LEN]) -> Result<([u8; 16], usize)> {
    if &b[..8] != REQUEST_MAGIC || b[28..] != [0; 4] {
        return Err(protocol("not a tp-allreduce descriptor request"));
    }
    let nonce: [u8; 16] = b[8..24].try_into().unwrap_or_default();
    Ok((nonce, u32::from_le_bytes([b[24], b[25], b[26], b[27]]) as usize))
}

fn encode_header(len: u32, total: u32, index: u32) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[..4].copy_from_slice(BATCH_MAGIC);
    for (i, v) in [len, total, index].into_iter().enumerate() {
        out[4 + 4 * i..8 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    out
}

/// (batch length, total, batch index).
fn decode_header(b: &[u8; HEADER_LEN]) -> Result<(u32, u32, u32)> {
    if &b[..4] != BATCH_MAGIC {
        return Err(protocol("not a tp-allreduce descriptor batch"));
    }
    let word = |i: usize| u32::from_le_bytes([b[4 + 4 * i], b[5 + 4 * i], b[6 + 4 * i], b[7 + 4 * i]]);
    let (len, total, index) = (word(0), word(1), word(2));
    if len as usize > MAX_FDS_PER_BATCH {
        return Err(protocol(&format!("a descriptor batch announced {len} descriptors")));
    }
    Ok((len, total, index))
}

fn protocol(what: &str) -> Error {
    Error::Protocol { from: "a descriptor socket peer".into(), what: what.into() }
}

fn set_timeouts(stream: &UnixStream, deadline: Deadline) -> Result<()> {
    let left = deadline.remaining().ok_or_else(|| deadline.expired("exchanging cuMem file descriptors".into()))?;
    stream
        .set_read_timeout(Some(left))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .map_err(|e| Error::io("setting descriptor socket timeouts", e))
}

fn io_error(what: &str, e: io::Error, deadline: Deadline) -> Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => deadline.expired(what.to_string()),
        _ => Error::io(what, e),
    }
}

fn errno_error(what: &str, e: Errno, deadline: Deadline) -> Error {
    io_error(what, io::Error::from_raw_os_error(e as i32), deadline)
}

/// Where private directories go: `$XDG_RUNTIME_DIR` (per user, on tmpfs)
/// when it is an absolute directory, then the temp dir.
fn bases() -> Vec<PathBuf> {
    let xdg = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|p| p.is_absolute() && p.is_dir());
    xdg.into_iter().chain([std::env::temp_dir()]).collect()
}

/// A new directory of mode 0700 with a random name (created exclusively,
/// so it cannot exist beforehand with someone else's permissions).
fn create_private_dir() -> Result<PathBuf> {
    let mut why = String::from("no candidate directory");
    for base in bases() {
        for _attempt in 0..8 {
            let dir = base.join(format!("{DIR_PREFIX}{}", hex(&random_bytes::<8>()?)));
            if let Err(e) = check_socket_path(&dir.join(SOCKET_NAME)) {
                why = format!("{}: {e}", base.display());
                break;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    // The umask may have cleared bits of 0700; set it exactly.
                    if let Err(e) = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)) {
                        let _ = std::fs::remove_dir(&dir);
                        return Err(Error::io(format!("setting mode 0700 on {}", dir.display()), e));
                    }
                    return Ok(dir);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    why = format!("{}: {e}", dir.display());
                    break;
                }
            }
        }
    }
    Err(Error::Ipc(format!(
        "cannot create a private directory for the descriptor socket under $XDG_RUNTIME_DIR or the temp dir \
         ({why}); set TMPDIR to a short, writable path"
    )))
}

/// A path [`FdServer::bind`] could have made: absolute, short enough for a
/// socket, `.../tpar-fd-<16 hex>/fd.sock`. Creating it checks the shape;
/// connecting also checks that its directory is private (a path from a
/// peer is never trusted blindly).
fn check_socket_path(socket: &Path) -> Result<()> {
    let s = socket.to_str().unwrap_or("");
    let dir_name = socket.parent().and_then(Path::file_name).and_then(|n| n.to_str()).unwrap_or("");
    let hex_part = dir_name.strip_prefix(DIR_PREFIX).unwrap_or("");
    let shaped = !s.is_empty()
        && s.len() <= MAX_SOCKET_PATH
        && socket.is_absolute()
        && !s.split('/').any(|c| c == "." || c == "..")
        && socket.file_name().and_then(|n| n.to_str()) == Some(SOCKET_NAME)
        && hex_part.len() == 16
        && hex_part.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !shaped {
        return Err(protocol(&format!("{s:?} is not a descriptor socket path")));
    }
    Ok(())
}

/// This process's effective uid.
fn own_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Checks that the directory of `socket` exists, is a directory of this
/// user and is closed to other users.
fn check_private_dir(socket: &Path) -> Result<()> {
    let dir = socket.parent().unwrap_or(socket);
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::io(format!("the descriptor socket's directory {}", dir.display()), e))?;
    if !meta.is_dir() || meta.mode() & 0o077 != 0 {
        return Err(protocol(&format!("{} is not in a private directory", socket.display())));
    }
    if meta.uid() != own_uid() {
        return Err(protocol(&format!(
            "{} belongs to uid {}, and this process runs as uid {}: not a rank of this job",
            dir.display(),
            meta.uid(),
            own_uid()
        )));
    }
    Ok(())
}

/// Checks (`SO_PEERCRED`) that the process at the other end of `stream`
/// runs as this process's user; `who` names it in the error.
fn check_peer_uid(stream: &UnixStream, who: &str) -> Result<()> {
    let cred = getsockopt(stream, sockopt::PeerCredentials)
        .map_err(|e| Error::io(format!("reading the uid of {who}"), io::Error::from_raw_os_error(e as i32)))?;
    if cred.uid() != own_uid() {
        return Err(protocol(&format!(
            "{who} runs as uid {}, and this process as uid {}: refused (ranks of one job run as one user)",
            cred.uid(),
            own_uid()
        )));
    }
    Ok(())
}

/// Checks a descriptor a peer sent before the driver imports it as a cuMem
/// allocation: it must be a character device, as the NVIDIA driver's
/// exports are (see the module docs); anything else (a file, a socket, a
/// pipe) is refused.
pub(crate) fn check_cumem_fd(fd: BorrowedFd<'_>) -> Result<()> {
    let meta = std::fs::File::from(fd.try_clone_to_owned().map_err(|e| Error::io("duplicating a descriptor", e))?)
        .metadata()
        .map_err(|e| Error::io("fstat of a descriptor a peer sent", e))?;
    use std::os::unix::fs::FileTypeExt;
    if !meta.file_type().is_char_device() {
        return Err(protocol(&format!(
            "a descriptor sent as a cuMem allocation is a {:?} (mode {:o}, uid {}, {} bytes), not the NVIDIA \
             driver's character device",
            meta.file_type(),
            meta.mode() & 0o7777,
            meta.uid(),
            meta.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
