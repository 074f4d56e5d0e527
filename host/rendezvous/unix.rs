//! Unix-domain socket endpoint. Access control is the private directory:
//! `Id::new_unix` creates `<base>/tpar-<16 hex>/` with mode 0700, rank 0
//! listens on `rdv.sock` inside it with mode 0600, so only the same user can
//! connect; rank 0 listens only in a directory of its own user whose parent
//! other users cannot write to (or only with the sticky bit, as the temp
//! dir). Both ends also check the other's uid (`SO_PEERCRED`) before the
//! handshake, so a socket reached some other way (a directory opened by
//! mistake, a rank 0 of another user) is refused too. Rank 0 removes both
//! when its join phase ends (and on drop).

#![forbid(unsafe_code)]

use std::fs;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::{Conn, Listen};
use crate::error::{Error, Result};

/// File name of the socket inside the private directory.
pub(crate) const SOCKET_NAME: &str = "rdv.sock";
/// Name of the socket while its mode is being set (see [`bind`]).
const SOCKET_TMP_NAME: &str = "rdv.sock.tmp";
/// Private directory names are this prefix and 16 lowercase hex digits.
pub(crate) const DIR_PREFIX: &str = "tpar-";
/// `sun_path` holds 108 bytes including the terminating NUL.
pub(crate) const MAX_SOCKET_PATH: usize = 107;

/// Checks that `socket` is a path `Id::new_unix` could have made:
/// `/<base>/tpar-<16 hex>/rdv.sock`, absolute, printable ASCII without
/// spaces, no `.`/`..`, short enough for `sun_path`. Rank 0 deletes the
/// socket and its directory, so it must never accept any other shape.
pub(crate) fn check_socket_path(socket: &Path) -> std::result::Result<(), String> {
    let s = socket.to_str().ok_or("the path is not UTF-8")?;
    if !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the path must be printable ASCII without spaces".into());
    }
    if s.len() > MAX_SOCKET_PATH {
        return Err(format!("the path is {} bytes, a Unix socket path holds at most {MAX_SOCKET_PATH}", s.len()));
    }
    if !socket.is_absolute() {
        return Err("the path must be absolute".into());
    }
    if socket.components().any(|c| matches!(c, Component::CurDir | Component::ParentDir)) {
        return Err("the path must not contain `.` or `..`".into());
    }
    if socket.file_name().and_then(|n| n.to_str()) != Some(SOCKET_NAME) {
        return Err(format!("the socket file must be named {SOCKET_NAME}"));
    }
    let dir_name = socket.parent().and_then(Path::file_name).and_then(|n| n.to_str()).unwrap_or("");
    let hex = dir_name.strip_prefix(DIR_PREFIX).unwrap_or("");
    if hex.len() != 16 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(format!("the socket's directory must be named {DIR_PREFIX}<16 lowercase hex digits>"));
    }
    Ok(())
}

/// Where private directories go: `$XDG_RUNTIME_DIR` (per-user, on tmpfs)
/// when it is set to an absolute directory, then the temp dir.
fn bases() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        if xdg.is_absolute() && xdg.is_dir() {
            out.push(xdg);
        }
    }
    out.push(std::env::temp_dir());
    out
}

/// Creates a new private directory (mode 0700) and returns the socket path
/// inside it. The name is random and the creation exclusive, so the
/// directory cannot exist beforehand with someone else's permissions.
pub(crate) fn create_private_dir() -> Result<PathBuf> {
    let mut why = String::from("no candidate directory");
    for base in bases() {
        for _attempt in 0..8 {
            let name = format!("{DIR_PREFIX}{}", super::hex(&super::random_bytes::<8>()?));
            let dir = base.join(name);
            let socket = dir.join(SOCKET_NAME);
            if let Err(e) = check_socket_path(&socket) {
                why = format!("{}: {e}", base.display());
                break;
            }
            match fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    // The umask may have cleared bits of 0700; set it exactly.
                    if let Err(e) = fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)) {
                        let _ = fs::remove_dir(&dir);
                        return Err(Error::io(format!("setting mode 0700 on {}", dir.display()), e));
                    }
                    return Ok(socket);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    why = format!("{}: {e}", dir.display());
                    break;
                }
            }
        }
    }
    Err(Error::Rendezvous(format!(
        "cannot create a private rendezvous directory under $XDG_RUNTIME_DIR or the temp dir ({why}); \
         set TMPDIR to a short, writable, ASCII path"
    )))
}

/// Rank 0's listening socket. Dropping it closes the socket and removes the
/// socket file and the private directory.
pub(crate) struct Listening {
    listener: UnixListener,
    socket: PathBuf,
    dir: PathBuf,
}

/// Listens on `socket` (already checked by [`check_socket_path`]).
pub(crate) fn bind(socket: &Path) -> Result<Listening> {
    let dir = socket.parent().ok_or_else(|| Error::invalid("a Unix rendezvous socket needs a directory"))?;
    let meta = fs::symlink_metadata(dir).map_err(|e| {
        Error::io(
            format!(
                "rank 0 cannot use the rendezvous directory {} (the id must come from Id::new_unix() on this \
                 host, and it serves one rendezvous: rank 0 removes the directory when its join ends)",
                dir.display()
            ),
            e,
        )
    })?;
    check_listening_dir(dir, &meta, nix::unistd::geteuid().as_raw())?;
    // Bind under a temporary name, set the mode, then publish the socket
    // under its real name with link(2): no rank ever sees it before it is
    // 0600, and link (unlike rename) never replaces an existing socket.
    let tmp = dir.join(SOCKET_TMP_NAME);
    remove_stale_socket(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(|e| Error::io(format!("binding {}", tmp.display()), e))?;
    let published = fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(format!("setting mode 0600 on {}", tmp.display()), e))
        .and_then(|()| {
            let linked = match fs::hard_link(&tmp, socket) {
                // A file system without hard links: rename, after checking
                // by hand (the directory is private, so nobody races us).
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists && fs::symlink_metadata(socket).is_err() => {
                    fs::rename(&tmp, socket)
                }
                other => other,
            };
            linked.map_err(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    Error::Rendezvous(format!(
                        "{} already exists: another rank 0 is using this id (each job needs its own Id::new_unix())",
                        socket.display()
                    ))
                } else {
                    Error::io(format!("publishing {}", socket.display()), e)
                }
            })
        });
    let _ = fs::remove_file(&tmp);
    published?;
    let listening = Listening { listener, socket: socket.to_path_buf(), dir: dir.to_path_buf() };
    listening
        .listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("making the rendezvous listener non-blocking", e))?;
    Ok(listening)
}

/// The directory is the access control: a real directory of user `uid`,
/// closed to others (as a descriptor socket's must be), in a parent that no
/// other user can rename it in or out of (theirs, root's or `uid`'s, and
/// writable by others only with the sticky bit, as the temp dir is).
fn check_listening_dir(dir: &Path, meta: &fs::Metadata, uid: u32) -> Result<()> {
    let refuse = |why: String| Err(Error::Rendezvous(format!("{why}; refusing to listen in {}", dir.display())));
    if !meta.is_dir() || meta.mode() & 0o077 != 0 {
        return refuse(format!(
            "{} is not a private directory (type {:?}, mode {:o})",
            dir.display(),
            meta.file_type(),
            meta.mode() & 0o7777
        ));
    }
    if meta.uid() != uid {
        return refuse(format!("{} belongs to uid {}, and this process runs as uid {uid}", dir.display(), meta.uid()));
    }
    let parent = dir.parent().unwrap_or(dir);
    let up = fs::metadata(parent)
        .map_err(|e| Error::io(format!("the rendezvous directory's parent {}", parent.display()), e))?;
    if up.uid() != uid && up.uid() != 0 {
        return refuse(format!("its parent {} belongs to uid {}, who could move it", parent.display(), up.uid()));
    }
    if up.mode() & 0o022 != 0 && up.mode() & 0o1000 == 0 {
        return refuse(format!(
            "its parent {} (mode {:o}) is writable by other users without the sticky bit: they could move it",
            parent.display(),
            up.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Removes a socket file left by a rank 0 that crashed between bind and
/// publish; anything that is not a socket is left alone (bind then fails).
fn remove_stale_socket(path: &Path) {
    if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = fs::remove_file(path);
    }
}

impl Listen for Listening {
    fn accept(&self) -> io::Result<Option<Arc<dyn Conn>>> {
        match self.listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                Ok(Some(Arc::new(stream)))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.socket);
        let _ = fs::remove_dir(&self.dir);
    }
}

/// One attempt to reach rank 0; `NotFound`/`ConnectionRefused` mean it is
/// not listening yet, `WouldBlock` that its backlog is full. Never waits: a
/// blocking connect(2) to a Unix socket whose backlog is full waits for
/// room without a bound of its own, past the caller's timeout.
pub(crate) fn connect(socket: &Path) -> io::Result<Arc<dyn Conn>> {
    use nix::sys::socket::{self as sock, AddressFamily, SockFlag, SockType, UnixAddr};
    let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
    let fd = sock::socket(AddressFamily::Unix, SockType::Stream, flags, None)?;
    // A Unix-socket connect completes at once or fails (EAGAIN: no room).
    sock::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(socket)?)?;
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(Arc::new(stream))
}

impl Conn for UnixStream {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&mut &*self).read(buf)
    }
    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        (&mut &*self).write(buf)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, t)
    }
    fn disconnect(&self) {
        let _ = UnixStream::shutdown(self, Shutdown::Both);
    }
    fn peer_uid(&self) -> io::Result<Option<u32>> {
        let cred = nix::sys::socket::getsockopt(self, nix::sys::socket::sockopt::PeerCredentials)?;
        Ok(Some(cred.uid()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_path_shapes() {
        let good = "/run/user/1000/tpar-0123456789abcdef/rdv.sock";
        assert_eq!(check_socket_path(Path::new(good)), Ok(()));
        let long = format!("/{}/tpar-0123456789abcdef/rdv.sock", "d".repeat(90));
        let bad = [
            ("relative", "tmp/tpar-0123456789abcdef/rdv.sock"),
            ("wrong file", "/tmp/tpar-0123456789abcdef/other.sock"),
            ("wrong dir", "/tmp/mydir/rdv.sock"),
            ("uppercase hex", "/tmp/tpar-0123456789ABCDEF/rdv.sock"),
            ("short hex", "/tmp/tpar-0123/rdv.sock"),
            ("dot dot", "/tmp/../tpar-0123456789abcdef/rdv.sock"),
            ("space", "/tmp/a b/tpar-0123456789abcdef/rdv.sock"),
            ("too long", long.as_str()),
            ("root", "/rdv.sock"),
        ];
        for (name, p) in bad {
            assert!(check_socket_path(Path::new(p)).is_err(), "{name}: {p} accepted");
        }
    }

    #[test]
    fn bind_refuses_a_directory_open_to_others() {
        let socket = create_private_dir().unwrap();
        let dir = socket.parent().unwrap().to_path_buf();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        let err = bind(&socket).err().expect("bind in a 0755 directory");
        assert!(err.to_string().contains("not a private directory"), "{err}");
        fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn bind_refuses_an_existing_socket() {
        let socket = create_private_dir().unwrap();
        let first = bind(&socket).unwrap();
        let err = bind(&socket).err().expect("second bind");
        assert!(err.to_string().contains("another rank 0"), "{err}");
        drop(first);
        assert!(!socket.parent().unwrap().exists());
    }

    /// A private directory (`tpar-<16 hex>`, mode 0700) under `base`.
    fn private_dir_under(base: &Path) -> PathBuf {
        let dir = base.join(format!("{DIR_PREFIX}{}", super::super::hex(&super::super::random_bytes::<8>().unwrap())));
        fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        dir.join(SOCKET_NAME)
    }

    /// Rank 0 listens only in a directory of its own user, inside a parent
    /// that others cannot rename it in or out of: one they may write to
    /// needs the sticky bit (as the temp dir has). (The descriptor sockets
    /// check their directory's owner the same way.)
    #[test]
    fn bind_refuses_a_parent_others_may_write_to_without_the_sticky_bit() {
        let base = std::env::temp_dir()
            .join(format!("tpar-test-base-{}", super::super::hex(&super::super::random_bytes::<8>().unwrap())));
        fs::create_dir(&base).unwrap();
        for (mode, ok) in [(0o777, false), (0o775, false), (0o757, false), (0o1777, true), (0o755, true), (0o700, true)]
        {
            fs::set_permissions(&base, fs::Permissions::from_mode(mode)).unwrap();
            let socket = private_dir_under(&base);
            match bind(&socket) {
                Ok(listening) => {
                    assert!(ok, "bound under a parent of mode {mode:o}");
                    drop(listening);
                }
                Err(e) => {
                    assert!(!ok, "mode {mode:o}: {e}");
                    assert!(e.to_string().contains("sticky"), "mode {mode:o}: {e}");
                    fs::remove_dir(socket.parent().unwrap()).unwrap();
                }
            }
        }
        fs::remove_dir(&base).unwrap();
    }

    /// A private directory that belongs to another user is not this rank
    /// 0's (root can enter it, and would otherwise listen there).
    #[test]
    fn bind_refuses_a_directory_of_another_user() {
        const OTHER_UID: u32 = 65534;
        let socket = create_private_dir().unwrap();
        let dir = socket.parent().unwrap().to_path_buf();
        if let Err(e) = std::os::unix::fs::chown(&dir, Some(OTHER_UID), None) {
            fs::remove_dir(&dir).unwrap();
            use std::io::Write;
            let why = format!("skipped: cannot chown a directory to uid {OTHER_UID} ({e}; needs root) (bind_refuses_a_directory_of_another_user)\n");
            let _ = std::io::stderr().write_all(why.as_bytes());
            return;
        }
        // Dropping a listener removes the directory; else remove it here.
        let err = bind(&socket).err();
        let _ = fs::remove_dir(&dir);
        let err = err.expect("bound in a directory of another user");
        assert!(err.to_string().contains(&format!("belongs to uid {OTHER_UID}")), "{err}");
    }
}
