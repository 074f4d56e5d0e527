//! The socket rendezvous attacked the way an attacker would, with sockets
//! and what travels on them: a process that holds rank 0's port first and
//! plays rank 0, floods of silent, garbage and half-finished connections
//! while a real group forms, frames recorded by a relay and replayed or
//! altered, and (Unix) peers that run as another user.

#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::other_user::{can_switch_user, child_as_other_user, OTHER_UID};
use crate::rendezvous::testing::{on_ranks, raw_hello, tcp_id, transports, LONG};
use crate::rendezvous::wire::{self, Kind};
use crate::rendezvous::{connect, Endpoint, Id};

/// Header field offsets the attacker reads (pinned by `wire`'s tests).
const JOB_AT: usize = 12;
const ROUND_AT: usize = 32;
const LEN_AT: usize = 36;

/// Reads one whole frame off `s` as raw bytes, the way an attacker that
/// knows the format (it is public) would; `None` at end of stream.
fn sniff(s: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut frame = vec![0u8; wire::HEADER_LEN];
    match s.read(&mut frame[..1])? {
        0 => return Ok(None),
        _ => s.read_exact(&mut frame[1..])?,
    }
    let len = u32::from_le_bytes(frame[LEN_AT..LEN_AT + 4].try_into().unwrap()) as usize;
    if len > wire::MAX_PAYLOAD {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a frame"));
    }
    // A sealed frame (flag bit 0 of byte 11) ends with a 32-byte tag.
    let tag = if frame[11] & 1 != 0 { 32 } else { 0 };
    let start = frame.len();
    frame.resize(start + len + tag, 0);
    s.read_exact(&mut frame[start..])?;
    Ok(Some(frame))
}

fn job_of(frame: &[u8]) -> [u8; 16] {
    frame[JOB_AT..JOB_AT + 16].try_into().unwrap()
}

fn kind_of(frame: &[u8]) -> u8 {
    frame[10]
}

/// What a squatter answers on one connection, as rank 0 would without the
/// secret, with the `n`th of its tricks (it cycles through them as the
/// member dials again): learn the job id from the HELLO, then
/// 0. welcome the member at once (no handshake), answering its rounds
///    with a RESULT that holds bytes of the squatter's choosing;
/// 1. send a CHALLENGE with a made-up tag;
/// 2. send a CHALLENGE that reflects the member's own nonce and HELLO tag;
/// 3. refuse the member (a forged ABORT, to make it give up);
/// 4. answer with the member's HELLO itself.
///
/// After a CHALLENGE it welcomes anything that comes back and answers
/// rounds as in 0. Returns the member's frames it read.
fn play_rank_0_without_the_secret(mut s: TcpStream, forged: &[u8], n: usize) -> Vec<Vec<u8>> {
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut seen = Vec::new();
    let Ok(Some(hello)) = sniff(&mut s) else { return seen };
    let job = job_of(&hello);
    let world = u32::from_le_bytes(hello[40..44].try_into().unwrap()) as usize;
    let welcome = wire::encode(Kind::Welcome, &job, 0, 0, &wire::encode_world(world)).unwrap();
    // HELLO payload: world (4), nonce (32), tag (32).
    let (nonce, tag) = (&hello[44..76], &hello[76..108]);
    let challenge = |tag: &[u8]| {
        let mut p = (world as u32).to_le_bytes().to_vec();
        p.extend_from_slice(nonce);
        p.extend_from_slice(tag);
        wire::encode(Kind::Challenge, &job, 0, 0, &p).unwrap()
    };
    let first = match n % 5 {
        0 => welcome.clone(),
        1 => challenge(&[0x5A; 32]),
        2 => challenge(tag),
        3 => {
            let abort = wire::Abort {
                code: wire::AbortCode::Rejected,
                waited_ms: 0,
                reason: "rank 1 has already joined".into(),
            };
            wire::encode(Kind::Abort, &job, 0, 0, &wire::encode_abort(&abort)).unwrap()
        }
        _ => hello.clone(),
    };
    seen.push(hello);
    if s.write_all(&first).is_err() {
        return seen;
    }
    while let Ok(Some(frame)) = sniff(&mut s) {
        let (kind, round) = (kind_of(&frame), u32::from_le_bytes(frame[ROUND_AT..ROUND_AT + 4].try_into().unwrap()));
        let theirs = frame[wire::HEADER_LEN..].to_vec();
        seen.push(frame);
        let reply = if kind == Kind::Gather.code() {
            let mut parts = vec![forged.to_vec(); world];
            parts[1] = theirs;
            wire::encode(Kind::Result, &job, 0, round, &wire::encode_result(&parts)).unwrap()
        } else {
            welcome.clone()
        };
        if s.write_all(&reply).is_err() {
            break;
        }
    }
    seen
}

/// A process binds rank 0's TCP port before rank 0 does and plays rank 0
/// to every connection for a while, then goes away, and the real rank 0
/// starts. The member must never take the squatter's bytes (here: a
/// shared-memory name it chose) nor send it its round's bytes, and must
/// join the real rank 0 once it is up, within its timeout.
#[test]
fn a_squatter_on_rank_0s_port_cannot_play_rank_0() {
    let id = tcp_id();
    let Endpoint::Tcp(addr) = id.endpoint else { unreachable!() };
    let forged = b"/tpar-squatter-chose-this".to_vec();
    let squatter = TcpListener::bind(addr).unwrap();
    squatter.set_nonblocking(true).unwrap();
    let squatting = Duration::from_millis(1500);
    let (result, seen) = thread::scope(|s| {
        let member = s.spawn(|| connect(&id, 1, 2, LONG).and_then(|r| r.all_gather(b"member's handle")));
        let (mut seen, mut tricks) = (Vec::new(), 0);
        let until = Instant::now() + squatting;
        while Instant::now() < until && !member.is_finished() {
            match squatter.accept() {
                Ok((conn, _)) => {
                    conn.set_nonblocking(false).unwrap();
                    seen.extend(play_rank_0_without_the_secret(conn, &forged, tricks));
                    tricks += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(1)),
                Err(e) => panic!("squatter: {e}"),
            }
        }
        drop(squatter);
        let root = s.spawn(|| connect(&id, 0, 2, LONG).and_then(|r| r.all_gather(b"zero")));
        let member = member.join().unwrap();
        let root = root.join().unwrap();
        (member.map(|m| (m, root)), (seen, tricks))
    });
    let (seen, tricks) = seen;
    let gathers = seen.iter().filter(|f| kind_of(f) == Kind::Gather.code()).count();
    match result {
        Ok((got, root)) => {
            assert!(!got.contains(&forged), "the member returned the squatter's bytes: {got:?}");
            assert_eq!(got, vec![b"zero".to_vec(), b"member's handle".to_vec()]);
            assert_eq!(root.unwrap(), got);
        }
        Err(e) => panic!("the member did not join the real rank 0 after the squatter left: {e}"),
    }
    assert_eq!(gathers, 0, "the member sent its round's bytes to the squatter");
    assert!(tricks >= 5, "the squatter played only {tricks} connections");
}

/// Only a squatter ever answers: the member gives up at its timeout with
/// an error that says rank 0's side failed authentication, and it never
/// returned the squatter's bytes nor sent it its own.
#[test]
fn a_member_that_meets_only_a_squatter_fails_naming_authentication() {
    let id = tcp_id();
    let Endpoint::Tcp(addr) = id.endpoint else { unreachable!() };
    let forged = b"/tpar-squatter-chose-this".to_vec();
    let squatter = TcpListener::bind(addr).unwrap();
    squatter.set_nonblocking(true).unwrap();
    let timeout = Duration::from_millis(800);
    let started = Instant::now();
    let (result, seen) = thread::scope(|s| {
        let member = s.spawn(|| connect(&id, 1, 2, timeout).and_then(|r| r.all_gather(b"member's handle")));
        let (mut seen, mut tricks) = (Vec::new(), 0);
        while !member.is_finished() {
            match squatter.accept() {
                Ok((conn, _)) => {
                    conn.set_nonblocking(false).unwrap();
                    seen.extend(play_rank_0_without_the_secret(conn, &forged, tricks));
                    tricks += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(1)),
                Err(e) => panic!("squatter: {e}"),
            }
        }
        (member.join().unwrap(), seen)
    });
    let took = started.elapsed();
    let err = result.err().unwrap_or_else(|| panic!("the member joined the squatter"));
    assert!(err.to_string().contains("nothing there passed authentication as rank 0"), "{err}");
    assert!(took < timeout + Duration::from_secs(2), "{took:?}");
    assert!(
        seen.iter().all(|f| kind_of(f) != Kind::Gather.code()),
        "the member sent its round's bytes to the squatter"
    );
}

/// Floods rank 0 with connections from several threads until `stop`:
/// silent ones held open, garbage, and ones that begin like a member and
/// stop: a HELLO with the right job id (learnt as a squatter would) and a
/// made-up tag, or, a few times, a HELLO recorded from a real member (made
/// here with the secret, as a squatter would have recorded it), which gets
/// a CHALLENGE and is then left unanswered.
fn flood(id: &Id, stop: &AtomicBool, opened: &AtomicUsize, worker: usize) {
    let job = id.job_id();
    let mut recorded: Vec<Vec<u8>> = (1..4).map(|rank| crate::rendezvous::testing::hello(id, rank, 4).0).collect();
    let mut held = std::collections::VecDeque::new();
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let conn = match &id.endpoint {
            Endpoint::Unix(p) => std::os::unix::net::UnixStream::connect(p).map(Stream::Unix),
            Endpoint::Tcp(a) => TcpStream::connect_timeout(a, Duration::from_millis(200)).map(Stream::Tcp),
        };
        let Ok(mut conn) = conn else {
            thread::sleep(Duration::from_millis(1));
            continue;
        };
        opened.fetch_add(1, Ordering::Relaxed);
        n += 1;
        match (n + worker) % 4 {
            // Silent, held open.
            0 | 1 => {}
            // Garbage, then closed.
            2 => {
                let _ = conn.write_all(&[0x5A; 57]);
                continue;
            }
            // A member's opening, then nothing more.
            _ => {
                let hello = recorded.pop().unwrap_or_else(|| raw_hello(&job, 1 + (n % 3) as u32, 4));
                let _ = conn.write_all(&hello);
            }
        }
        held.push_back(conn);
        if held.len() > 150 {
            held.pop_front();
        }
    }
}

enum Stream {
    Unix(std::os::unix::net::UnixStream),
    Tcp(TcpStream),
}

impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(b),
            Stream::Tcp(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// While four threads flood rank 0 with silent, garbage and half-begun
/// connections (hundreds held open at once), a real group of four forms
/// within its timeout and gathers the right bytes.
#[test]
fn a_flood_of_silent_garbage_and_half_begun_connections_cannot_keep_ranks_out() {
    let timeout = Duration::from_secs(8);
    for (transport, make) in transports() {
        let id = make();
        let stop = AtomicBool::new(false);
        let opened = AtomicUsize::new(0);
        let started = Instant::now();
        let results = thread::scope(|s| {
            let root = s.spawn(|| connect(&id, 0, 4, timeout).and_then(|r| r.all_gather(b"rank 0")));
            let flooders: Vec<_> = (0..4)
                .map(|w| {
                    s.spawn({
                        let (id, stop, opened) = (&id, &stop, &opened);
                        move || flood(id, stop, opened, w)
                    })
                })
                .collect();
            // The flood is on before the members start.
            while opened.load(Ordering::Relaxed) < 300 && started.elapsed() < Duration::from_secs(3) {
                thread::sleep(Duration::from_millis(5));
            }
            let members = on_ranks(1..4, |rank| {
                connect(&id, rank, 4, timeout).and_then(|r| r.all_gather(format!("rank {rank}").as_bytes()))
            });
            let root = root.join().unwrap();
            stop.store(true, Ordering::Relaxed);
            flooders.into_iter().for_each(|h| h.join().unwrap());
            std::iter::once(root).chain(members).collect::<Vec<_>>()
        });
        let want: Vec<Vec<u8>> = (0..4).map(|r| format!("rank {r}").into_bytes()).collect();
        for (rank, r) in results.into_iter().enumerate() {
            let got = r.unwrap_or_else(|e| {
                panic!(
                    "{transport}: rank {rank} failed under the flood ({} connections opened): {e}",
                    opened.load(Ordering::Relaxed)
                )
            });
            assert_eq!(got, want, "{transport}");
        }
        let took = started.elapsed();
        println!(
            "{transport}: the group formed in {took:?} under a flood of {} connections",
            opened.load(Ordering::Relaxed)
        );
        assert!(took < timeout + Duration::from_secs(2), "{transport}: {took:?}");
        id.remove_files();
    }
}

/// What a relay does to a frame on its way.
type Hook = Box<dyn FnMut(Vec<u8>) -> Vec<u8> + Send>;

/// A TCP relay on `listen` that forwards one connection to `to`, frame by
/// frame, passing each through `up` (member to rank 0) or `down`, and
/// records what the member sent.
struct Relay {
    recorded: Arc<Mutex<Vec<u8>>>,
}

impl Relay {
    fn start<'s>(
        s: &'s thread::Scope<'s, '_>,
        listen: TcpListener,
        to: SocketAddr,
        mut up: Hook,
        mut down: Hook,
    ) -> Relay {
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let rec = recorded.clone();
        s.spawn(move || {
            let (member, _) = listen.accept().unwrap();
            let root = loop {
                match TcpStream::connect(to) {
                    Ok(c) => break c,
                    Err(_) => thread::sleep(Duration::from_millis(2)),
                }
            };
            let (mut m_in, mut m_out) = (member.try_clone().unwrap(), member);
            let (mut r_in, mut r_out) = (root.try_clone().unwrap(), root);
            thread::scope(|t| {
                t.spawn(move || {
                    while let Ok(Some(f)) = sniff(&mut m_in) {
                        rec.lock().unwrap().extend_from_slice(&f);
                        if r_out.write_all(&up(f)).is_err() {
                            break;
                        }
                    }
                    let _ = r_out.shutdown(Shutdown::Both);
                });
                while let Ok(Some(f)) = sniff(&mut r_in) {
                    if m_out.write_all(&down(f)).is_err() {
                        break;
                    }
                }
                let _ = m_out.shutdown(Shutdown::Both);
            });
        });
        Relay { recorded }
    }
}

fn pass() -> Hook {
    Box::new(|f| f)
}

/// `id` as reached through a relay listening on a port of its own.
fn via_relay(id: &Id) -> (Id, TcpListener) {
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    (Id { endpoint: Endpoint::Tcp(relay.local_addr().unwrap()), ..id.clone() }, relay)
}

/// A relay records everything a member sends in one rendezvous; in a
/// later rendezvous of the same id, the attacker connects first and replays
/// it byte for byte. Rank 0 must not take it for the member: the real
/// member joins and the round holds its fresh bytes.
#[test]
fn frames_recorded_in_one_rendezvous_are_refused_in_the_next() {
    let id = tcp_id();
    let Endpoint::Tcp(addr) = id.endpoint else { unreachable!() };
    let (relayed, listen) = via_relay(&id);
    let recorded = thread::scope(|s| {
        let relay = Relay::start(s, listen, addr, pass(), pass());
        let root = s.spawn(|| connect(&id, 0, 2, LONG).and_then(|r| r.all_gather(b"zero")));
        let got = connect(&relayed, 1, 2, LONG).and_then(|r| r.all_gather(b"old handle")).unwrap();
        assert_eq!(root.join().unwrap().unwrap(), got);
        relay.recorded
    });
    let replay = recorded.lock().unwrap().clone();
    assert!(!replay.is_empty());
    let (root, member) = thread::scope(|s| {
        let root = s.spawn(|| connect(&id, 0, 2, LONG).and_then(|r| r.all_gather(b"zero")));
        let attacker = crate::rendezvous::testing::raw_dial(&id);
        crate::rendezvous::write_frame(&*attacker, Instant::now() + LONG, &replay).unwrap();
        thread::sleep(Duration::from_millis(100));
        let member = connect(&id, 1, 2, LONG).and_then(|r| r.all_gather(b"new handle"));
        (root.join().unwrap(), member)
    });
    let want = vec![b"zero".to_vec(), b"new handle".to_vec()];
    assert_eq!(root.as_ref().map_err(|e| e.to_string()), Ok(&want), "rank 0");
    assert_eq!(member.as_ref().map_err(|e| e.to_string()), Ok(&want), "the member");
}

/// A relay between a member and rank 0 alters a GATHER in flight (one
/// payload byte): rank 0 must refuse it, not gather the altered bytes.
#[test]
fn a_frame_altered_in_flight_is_refused() {
    let id = tcp_id();
    let Endpoint::Tcp(addr) = id.endpoint else { unreachable!() };
    let (relayed, listen) = via_relay(&id);
    let (root, member) = thread::scope(|s| {
        let up: Hook = Box::new(|mut f| {
            if kind_of(&f) == Kind::Gather.code() && f.len() > wire::HEADER_LEN {
                f[wire::HEADER_LEN] ^= 0x20;
            }
            f
        });
        Relay::start(s, listen, addr, up, pass());
        let root = s.spawn(|| connect(&id, 0, 2, LONG).and_then(|r| r.all_gather(b"zero")));
        let member = connect(&relayed, 1, 2, LONG).and_then(|r| r.all_gather(b"handle"));
        (root.join().unwrap(), member)
    });
    let root = root.map_err(|e| e.to_string());
    assert!(root.as_ref().is_err_and(|e| e.contains("rank 1")), "rank 0 gathered {root:?}");
    assert!(member.is_err(), "the member got {member:?}");
}

/// A relay answers a member's round 2 with rank 0's RESULT of round 1
/// (round field rewritten to 2): the member contributed the same bytes to
/// both rounds, so only authentication of each frame in its place can
/// tell; the member must refuse it.
#[test]
fn a_result_replayed_in_a_later_round_is_refused() {
    let id = tcp_id();
    let Endpoint::Tcp(addr) = id.endpoint else { unreachable!() };
    let (relayed, listen) = via_relay(&id);
    let (root, member) = thread::scope(|s| {
        let mut first: Option<Vec<u8>> = None;
        let down: Hook = Box::new(move |f| {
            if kind_of(&f) != Kind::Result.code() {
                return f;
            }
            match &first {
                None => {
                    first = Some(f.clone());
                    f
                }
                Some(old) => {
                    let mut old = old.clone();
                    old[ROUND_AT..ROUND_AT + 4].copy_from_slice(&f[ROUND_AT..ROUND_AT + 4]);
                    old
                }
            }
        });
        Relay::start(s, listen, addr, pass(), down);
        let root = s.spawn(|| {
            let r = connect(&id, 0, 2, LONG)?;
            Ok::<_, crate::error::Error>((r.all_gather(b"zero, round 1")?, r.all_gather(b"zero, round 2")?))
        });
        let member = connect(&relayed, 1, 2, LONG).and_then(|r| Ok((r.all_gather(b"same")?, r.all_gather(b"same"))));
        (root.join().unwrap(), member)
    });
    let (one, two) = member.unwrap();
    assert_eq!(one, vec![b"zero, round 1".to_vec(), b"same".to_vec()]);
    let two = two.map_err(|e| e.to_string());
    assert!(two.is_err(), "the member took a replayed RESULT for round 2: {two:?}");
    drop(root);
}

/// The uid the Unix-socket tests run a peer as, and the variable that
/// hands the child its id.
const CHILD_ID_VAR: &str = "TPAR_ATTACK_CHILD_ID";

/// Not a test by itself: the member of another user in
/// `unix_rank_0_refuses_a_member_of_another_user`.
#[test]
#[ignore = "child process of unix_rank_0_refuses_a_member_of_another_user"]
fn child_member_of_another_user() {
    let Ok(id) = std::env::var(CHILD_ID_VAR) else { return };
    let got = connect(&id.parse().unwrap(), 1, 2, Duration::from_secs(3)).and_then(|r| r.all_gather(b"other user"));
    println!("child member: {got:?}");
}

/// Rank 0 on a Unix socket whose directory and socket were opened to
/// everyone (a mistake, or a path reached some other way): a process of
/// another user that holds the whole id string must still not join.
#[test]
fn unix_rank_0_refuses_a_member_of_another_user() {
    use std::os::unix::fs::PermissionsExt;
    if !can_switch_user("unix_rank_0_refuses_a_member_of_another_user") {
        return;
    }
    let id = crate::rendezvous::testing::unix_id();
    let Endpoint::Unix(socket) = id.endpoint.clone() else { unreachable!() };
    let dir = socket.parent().unwrap().to_path_buf();
    let root = thread::scope(|s| {
        let root = s.spawn(|| connect(&id, 0, 2, Duration::from_secs(3)).and_then(|r| r.all_gather(b"zero")));
        let deadline = Instant::now() + LONG;
        while !socket.exists() {
            assert!(Instant::now() < deadline, "rank 0 never listened");
            thread::sleep(Duration::from_millis(1));
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
        let out = child_as_other_user("rendezvous::tests::attacks::child_member_of_another_user")
            .env(CHILD_ID_VAR, id.to_string())
            .output()
            .unwrap();
        println!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        root.join().unwrap()
    });
    id.remove_files();
    let root = root.map_err(|e| e.to_string());
    assert!(root.as_ref().is_err_and(|e| e.contains("uid")), "rank 0 admitted a process of uid {OTHER_UID}: {root:?}");
}

/// Not a test by itself: rank 0 of another user in
/// `unix_member_refuses_a_rank_0_of_another_user`; prints its id first.
#[test]
#[ignore = "child process of unix_member_refuses_a_rank_0_of_another_user"]
fn child_rank_0_of_another_user() {
    if std::env::var(CHILD_ID_VAR).is_err() {
        return;
    }
    let id = Id::new_unix().unwrap();
    println!("ID {id}");
    io::stdout().flush().unwrap();
    let got = connect(&id, 0, 2, Duration::from_secs(3)).and_then(|r| r.all_gather(b"other user's rank 0"));
    println!("child rank 0: {got:?}");
}

/// A rank 0 of another user (its own private directory, its own id): a
/// member given that id must not join it, nor send it its bytes.
#[test]
fn unix_member_refuses_a_rank_0_of_another_user() {
    use std::io::BufRead;
    if !can_switch_user("unix_member_refuses_a_rank_0_of_another_user") {
        return;
    }
    let mut child = child_as_other_user("rendezvous::tests::attacks::child_rank_0_of_another_user")
        .env(CHILD_ID_VAR, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = io::BufReader::new(child.stdout.take().unwrap()).lines();
    let id: Id = loop {
        let line = lines.next().expect("the child printed no id").unwrap();
        if let Some((_, id)) = line.split_once("ID ") {
            break id.parse().unwrap();
        }
    };
    let got = connect(&id, 1, 2, Duration::from_secs(2)).and_then(|r| r.all_gather(b"root's handle"));
    let _ = child.kill();
    let _ = child.wait();
    // The killed child's socket and directory.
    id.remove_files();
    let got = got.map_err(|e| e.to_string());
    assert!(got.as_ref().is_err_and(|e| e.contains("uid")), "the member joined a rank 0 of uid {OTHER_UID}: {got:?}");
}
