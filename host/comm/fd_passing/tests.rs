//! The descriptor protocol with real descriptors (of unlinked temporary
//! files, each holding its index) over socket pairs and the server.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::AtomicUsize;

use super::*;
use crate::other_user::{can_switch_user, child_as_other_user, OTHER_UID};

/// `n` open, already unlinked temporary files; file i holds "file i".
fn temp_files(n: usize) -> Vec<OwnedFd> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    (0..n)
        .map(|i| {
            let unique = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("tpar-fd-test-{}-{unique}", std::process::id()));
            let mut f = File::options().read(true).write(true).create_new(true).open(&path).unwrap();
            write!(f, "file {i}").unwrap();
            std::fs::remove_file(&path).unwrap();
            OwnedFd::from(f)
        })
        .collect()
}

/// What a received descriptor's file holds (read without moving the
/// offset the sender shares).
fn contents(fd: OwnedFd) -> String {
    let f = File::from(fd);
    let mut buf = [0u8; 32];
    let n = f.read_at(&mut buf, 0).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn collect(into: &mut Vec<String>) -> impl FnMut(Vec<OwnedFd>) -> Result<()> + '_ {
    move |batch| {
        into.extend(batch.into_iter().map(contents));
        Ok(())
    }
}

fn seconds(s: u64) -> Deadline {
    Deadline::after(Duration::from_secs(s))
}

#[test]
fn requests_and_batch_headers_round_trip() {
    let nonce = [7u8; 16];
    assert_eq!(decode_request(&encode_request(&nonce, 5)).unwrap(), (nonce, 5));
    let mut foreign = encode_request(&nonce, 5);
    foreign[0] = b'X';
    assert!(matches!(decode_request(&foreign), Err(Error::Protocol { .. })));
    assert_eq!(decode_header(&encode_header(3, 300, 1)).unwrap(), (3, 300, 1));
    let too_many = encode_header(MAX_FDS_PER_BATCH as u32 + 1, 1000, 0);
    assert!(matches!(decode_header(&too_many), Err(Error::Protocol { .. })));
}

#[test]
fn descriptors_cross_a_socket_pair_in_order_in_batches() {
    // More than one batch: the kernel takes at most 253 per message.
    let count = MAX_FDS_PER_BATCH + 7;
    let (a, b) = UnixStream::pair().unwrap();
    let sender = std::thread::spawn(move || send_fds(&a, &temp_files(count), seconds(20)));
    let mut got = Vec::new();
    let mut batches = 0;
    receive_fds(&b, count, seconds(20), |batch| {
        batches += 1;
        collect(&mut got)(batch)
    })
    .unwrap();
    sender.join().unwrap().unwrap();
    assert_eq!(batches, 2);
    let want: Vec<String> = (0..count).map(|i| format!("file {i}")).collect();
    assert_eq!(got, want, "every descriptor arrives, in order, referring to its own file");
}

#[test]
fn no_descriptors_is_one_empty_batch() {
    let (a, b) = UnixStream::pair().unwrap();
    send_fds(&a, &[], seconds(5)).unwrap();
    let mut got = Vec::new();
    receive_fds(&b, 0, seconds(5), collect(&mut got)).unwrap();
    assert!(got.is_empty());
}

#[test]
fn the_server_serves_each_expected_rank_once_and_refuses_strangers() {
    let server = FdServer::bind().unwrap();
    let address = server.address();
    let dir = Path::new(&address.path).parent().unwrap().to_path_buf();
    let mode = std::fs::metadata(&dir).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o700, "the socket's directory is private");
    let serving = server.serve(temp_files(3), &[1, 2], seconds(20)).unwrap();
    // A connection that never asks does not hold up the ranks behind it for
    // the whole step (it is dropped after a few seconds).
    let _silent = UnixStream::connect(&address.path).unwrap();
    // A connection with the wrong nonce is closed without descriptors.
    let stranger = UnixStream::connect(&address.path).unwrap();
    (&stranger).write_all(&encode_request(&[0u8; 16], 1)).unwrap();
    let mut answer = Vec::new();
    (&stranger).read_to_end(&mut answer).unwrap();
    assert!(answer.is_empty(), "a stranger got {} bytes", answer.len());
    let fetchers: Vec<_> = [1usize, 2]
        .into_iter()
        .map(|rank| {
            let address = address.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                fetch_fds(&address, rank, 3, seconds(20), collect(&mut got)).map(|()| got)
            })
        })
        .collect();
    for f in fetchers {
        assert_eq!(f.join().unwrap().unwrap(), ["file 0", "file 1", "file 2"]);
    }
    serving.finish().unwrap();
    assert!(!dir.exists(), "the socket directory was removed");
    // Nobody can fetch after the server ended.
    assert!(fetch_fds(&address, 1, 3, seconds(2), |_| Ok(())).is_err());
}

#[test]
fn a_rank_that_never_fetches_fails_the_server_at_its_deadline() {
    let server = FdServer::bind().unwrap();
    let dir = PathBuf::from(server.address().path).parent().unwrap().to_path_buf();
    let serving = server.serve(temp_files(1), &[3], Deadline::after(Duration::from_millis(200))).unwrap();
    let e = serving.finish().unwrap_err();
    assert!(matches!(e, Error::RendezvousTimeout { .. }), "{e}");
    assert!(e.to_string().contains("rank(s) {3} did not collect"), "{e}");
    assert!(!dir.exists(), "the socket directory was removed");
}

#[test]
fn abandoning_a_server_stops_it_and_removes_its_socket() {
    let server = FdServer::bind().unwrap();
    let dir = PathBuf::from(server.address().path).parent().unwrap().to_path_buf();
    // A deadline far away: only the stop flag can end it (a hang fails the run).
    let serving = server.serve(temp_files(1), &[1], seconds(3600)).unwrap();
    drop(serving);
    assert!(!dir.exists());
}

#[test]
fn a_fetcher_whose_owner_sends_nothing_times_out() {
    let (_a, b) = UnixStream::pair().unwrap();
    let e = receive_fds(&b, 2, Deadline::after(Duration::from_millis(100)), |_| Ok(())).unwrap_err();
    assert!(matches!(e, Error::RendezvousTimeout { .. }), "{e}");
    // An owner that hangs up early is an error, not a hang either.
    let (a, b) = UnixStream::pair().unwrap();
    drop(a);
    let e = receive_fds(&b, 2, seconds(5), |_| Ok(())).unwrap_err();
    assert!(e.to_string().contains("closed its descriptor socket"), "{e}");
}

#[test]
fn a_batch_that_does_not_match_its_header_is_refused() {
    let files = temp_files(1);
    let raw = [files[0].as_raw_fd()];
    // Announces two descriptors, carries one.
    let (a, b) = UnixStream::pair().unwrap();
    send_batch(&a, &encode_header(2, 2, 0), &raw, seconds(5)).unwrap();
    let e = receive_fds(&b, 2, seconds(5), |_| Ok(())).unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
    // A total other than the one the rendezvous announced.
    let (a, b) = UnixStream::pair().unwrap();
    send_batch(&a, &encode_header(1, 1, 0), &raw, seconds(5)).unwrap();
    assert!(matches!(receive_fds(&b, 2, seconds(5), |_| Ok(())), Err(Error::Protocol { .. })));
    // A batch out of order.
    let (a, b) = UnixStream::pair().unwrap();
    send_batch(&a, &encode_header(1, 2, 1), &raw, seconds(5)).unwrap();
    assert!(matches!(receive_fds(&b, 2, seconds(5), |_| Ok(())), Err(Error::Protocol { .. })));
}

#[test]
fn a_failing_consumer_still_drains_every_batch() {
    let count = MAX_FDS_PER_BATCH + 1;
    let (a, b) = UnixStream::pair().unwrap();
    let sender = std::thread::spawn(move || send_fds(&a, &temp_files(count), seconds(20)));
    let mut calls = 0;
    let e = receive_fds(&b, count, seconds(20), |_| {
        calls += 1;
        Err(Error::Ipc("import failed".into()))
    })
    .unwrap_err();
    assert!(e.to_string().contains("import failed"), "{e}");
    assert_eq!(calls, 1, "the consumer is not called again after failing");
    sender.join().unwrap().expect("the owner sent every batch");
}

#[test]
fn paths_from_peers_must_have_the_socket_shape() {
    for bad in [
        "relative/tpar-fd-0123456789abcdef/fd.sock",
        "/tmp/tpar-fd-0123456789abcdef/other.sock",
        "/tmp/tpar-fd-0123/fd.sock",
        "/tmp/tpar-fd-0123456789ABCDEF/fd.sock",
        "/tmp/../tpar-fd-0123456789abcdef/fd.sock",
        "/etc/passwd",
        "",
    ] {
        assert!(check_socket_path(Path::new(bad)).is_err(), "{bad:?} accepted");
    }
    assert!(check_socket_path(Path::new("/run/user/1000/tpar-fd-0123456789abcdef/fd.sock")).is_ok());
    // A well-shaped path in a directory open to others is not used.
    let address = FdSocket { path: "/tmp/tpar-fd-0123456789abcdef/fd.sock".into(), nonce: [0; 16] };
    assert!(fetch_fds(&address, 0, 1, seconds(1), |_| Ok(())).is_err());
}

/// A cuMem export is a character device (the NVIDIA control device); a
/// peer's file, socket or pipe in its place is refused before the driver
/// sees it.
#[test]
fn only_character_devices_pass_for_cumem_descriptors() {
    use std::os::fd::AsFd;
    let null = File::open("/dev/null").unwrap();
    check_cumem_fd(null.as_fd()).unwrap();
    let file = temp_files(1).pop().unwrap();
    let e = check_cumem_fd(file.as_fd()).unwrap_err();
    assert!(e.to_string().contains("not the NVIDIA driver's character device"), "{e}");
    let (a, _b) = UnixStream::pair().unwrap();
    assert!(check_cumem_fd(a.as_fd()).is_err());
}

const CHILD_VAR: &str = "TPAR_FD_ATTACK_CHILD";


/// Not a test by itself: the requester of another user in
/// `the_server_refuses_a_peer_of_another_user` (it knows the path and the
/// nonce, and asks as rank 1).
#[test]
#[ignore = "child process of the_server_refuses_a_peer_of_another_user"]
fn child_requester_of_another_user() {
    let Ok(arg) = std::env::var(CHILD_VAR) else { return };
    let (path, nonce) = arg.split_once(' ').unwrap();
    let nonce: [u8; 16] = (0..16)
        .map(|i| u8::from_str_radix(&nonce[2 * i..2 * i + 2], 16).unwrap())
        .collect::<Vec<_>>()
        .try_into()
        .unwrap();
    let stream = UnixStream::connect(path).unwrap();
    (&stream).write_all(&encode_request(&nonce, 1)).unwrap();
    let mut got = Vec::new();
    let r = receive_fds(&stream, 2, seconds(3), collect(&mut got));
    println!("child requester: {r:?} {got:?}");
}

/// A process of another user that reaches the socket (its directory
/// opened to everyone by mistake) and knows the nonce gets no descriptors.
#[test]
fn the_server_refuses_a_peer_of_another_user() {
    if !can_switch_user("the_server_refuses_a_peer_of_another_user") {
        return;
    }
    let server = FdServer::bind().unwrap();
    let address = server.address();
    let dir = Path::new(&address.path).parent().unwrap().to_path_buf();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(&address.path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let serving = server.serve(temp_files(2), &[1], seconds(3)).unwrap();
    let out = child_as_other_user("comm::fd_passing::tests::child_requester_of_another_user")
        .env(CHILD_VAR, format!("{} {}", address.path, hex(&address.nonce)))
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let served = serving.finish();
    assert!(said.contains("child requester: Err"), "the other user was served: {said}");
    let e = served.expect_err("rank 1 was served to another user");
    assert!(e.to_string().contains("uid"), "{e}");
}

/// Not a test by itself: the server of another user in
/// `a_fetcher_refuses_a_server_of_another_user`; prints its address.
#[test]
#[ignore = "child process of a_fetcher_refuses_a_server_of_another_user"]
fn child_server_of_another_user() {
    if std::env::var(CHILD_VAR).is_err() {
        return;
    }
    // Before the address goes out: the parent kills this process as soon as
    // its fetch is refused, and a kill between a temporary file's creation
    // and its unlinking would leave the file behind.
    let files = temp_files(2);
    let server = FdServer::bind().unwrap();
    let address = server.address();
    println!("ADDRESS {} {}", address.path, hex(&address.nonce));
    std::io::stdout().flush().unwrap();
    let r = server.serve(files, &[1], seconds(3)).unwrap().finish();
    println!("child server: {r:?}");
}

/// A server of another user (its own private directory, mode 0700) is
/// not fetched from.
#[test]
fn a_fetcher_refuses_a_server_of_another_user() {
    use std::io::BufRead;
    if !can_switch_user("a_fetcher_refuses_a_server_of_another_user") {
        return;
    }
    let mut child = child_as_other_user("comm::fd_passing::tests::child_server_of_another_user")
        .env(CHILD_VAR, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let address = loop {
        let line = lines.next().expect("the child printed no address").unwrap();
        if let Some((_, rest)) = line.split_once("ADDRESS ") {
            let (path, nonce) = rest.split_once(' ').unwrap();
            let nonce: Vec<u8> = (0..16).map(|i| u8::from_str_radix(&nonce[2 * i..2 * i + 2], 16).unwrap()).collect();
            break FdSocket { path: path.into(), nonce: nonce.try_into().unwrap() };
        }
    };
    let mut got = Vec::new();
    let r = fetch_fds(&address, 1, 2, seconds(3), collect(&mut got));
    let _ = child.kill();
    let _ = child.wait();
    // The killed child's socket and directory.
    let _ = std::fs::remove_dir_all(Path::new(&address.path).parent().unwrap());
    let prefix = format!("tpar-fd-test-{}-", child.id());
    let left: Vec<String> = std::fs::read_dir("/tmp")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "the killed child left its temporary files in /tmp: {left:?}");
    let e = r.err().unwrap_or_else(|| panic!("fetched {got:?} from a server of uid {OTHER_UID}"));
    assert!(e.to_string().contains("uid"), "{e}");
}

/// More descriptors in one message than a batch's control buffer holds
/// (253, the kernel's limit, where a batch holds 250): the kernel installs
/// the 250 that fit in this process and flags `MSG_CTRUNC`. The receiver
/// fails, and closes those 250 too: afterwards no copy of the sent socket
/// is open anywhere, so its peer reads end of stream.
#[test]
fn a_truncated_control_message_leaves_no_descriptor_open() {
    let (sent, watch) = UnixStream::pair().unwrap();
    let copies: Vec<OwnedFd> = (0..253).map(|_| OwnedFd::from(sent.try_clone().unwrap())).collect();
    drop(sent);
    let raw: Vec<RawFd> = copies.iter().map(AsRawFd::as_raw_fd).collect();
    let (a, b) = UnixStream::pair().unwrap();
    send_all(&a, &encode_header(250, 253, 0), &raw, seconds(5), "sending 253 descriptors").unwrap();
    drop(copies);
    let e = receive_fds(&b, 253, seconds(5), |_| Ok(())).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
    drop((a, b));
    watch.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let read = (&watch).read(&mut [0u8; 1]);
    assert!(
        matches!(read, Ok(0)),
        "a copy of the sent socket is still open (the receiver leaked the descriptors it got): {read:?}"
    );
}
