//! Helpers shared by the rendezvous tests: ids for both transports, a
//! thread per rank, and raw connections that play a rank by hand (with the
//! id's secret, as a real rank would, or without it, as an attacker).

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rand::Rng;

use super::auth::{self, Nonce, Opener, Role, Sealer, Transcript};
use super::member::dial;
use super::wire::{self, Frame, Greeting, Kind};
use super::{read_frame, write_frame, Conn, Endpoint, Id};

/// Bound for calls expected to succeed; a failing test may wait this long.
pub(super) const LONG: Duration = Duration::from_secs(10);

pub(super) fn unix_id() -> Id {
    Id::new_unix().unwrap()
}

/// A loopback id on a port that was free a moment ago, that no other test
/// of this process was given, picked at random below Linux's default
/// ephemeral range (32768..60999): a port the kernel picked for a listener
/// on port 0 could meanwhile become the local port of one of the thousands
/// of client connections the tests open, and rank 0's bind would fail;
/// random, so that test processes running at once rarely pick the same.
pub(super) fn tcp_id() -> Id {
    const PORTS: std::ops::Range<u16> = 20_000..32_000;
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..PORTS.len() {
        let port = rand::thread_rng().gen_range(PORTS);
        if given.contains(&port) {
            continue;
        }
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            given.insert(port);
            return Id::new_tcp(l.local_addr().unwrap());
        }
    }
    panic!("no free loopback port in {PORTS:?}");
}

pub(super) type MakeId = fn() -> Id;

pub(super) fn transports() -> [(&'static str, MakeId); 2] {
    [("unix", unix_id), ("tcp", tcp_id)]
}

pub(super) fn private_dir(id: &Id) -> Option<PathBuf> {
    match &id.endpoint {
        Endpoint::Unix(p) => p.parent().map(Path::to_path_buf),
        Endpoint::Tcp(_) => None,
    }
}

/// Runs `f(rank)` on a thread per rank; results in rank order.
pub(super) fn on_ranks<T: Send>(ranks: std::ops::Range<usize>, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> = ranks.map(|r| s.spawn(move || f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Connects a raw socket to rank 0 (retrying until it listens).
pub(super) fn raw_dial(id: &Id) -> Arc<dyn Conn> {
    dial(&id.endpoint, 99, Instant::now() + LONG, LONG, None).unwrap()
}

/// A plain frame.
pub(super) fn raw_frame(kind: Kind, job: &[u8; 16], sender: u32, round: u32, payload: &[u8]) -> Vec<u8> {
    wire::encode(kind, job, sender, round, payload).unwrap()
}

/// A HELLO as a member of `id` makes it (tagged with the secret), and its nonce.
pub(super) fn hello(id: &Id, rank: u32, world: usize) -> (Vec<u8>, Nonce) {
    let nonce = auth::random::<{ auth::NONCE_LEN }>().unwrap();
    let tag = auth::hello_tag(&id.secret, &id.job, rank, world as u32, &nonce);
    let g = Greeting { world: world as u32, nonce, tag };
    (raw_frame(Kind::Hello, &id.job, rank, 0, &wire::encode_greeting(&g)), nonce)
}

/// A HELLO by someone who knows the job id (it travels in the clear) but
/// not the secret: well formed, with a tag that is not the secret's.
pub(super) fn raw_hello(job: &[u8; 16], rank: u32, world: usize) -> Vec<u8> {
    let g = Greeting { world: world as u32, nonce: [7; auth::NONCE_LEN], tag: [0; auth::TAG_LEN] };
    raw_frame(Kind::Hello, job, rank, 0, &wire::encode_greeting(&g))
}

/// Reads one frame within `LONG`, any kind.
pub(super) fn recv_raw(conn: &dyn Conn) -> Result<Frame, String> {
    read_frame(conn, Some(Instant::now() + LONG), wire::MAX_PAYLOAD).map_err(|e| e.to_string())
}

/// One end of a connection played by hand after its handshake: sends and
/// receives sealed frames as a rank would.
pub(super) struct Session {
    pub conn: Arc<dyn Conn>,
    pub seal: Sealer,
    pub open: Opener,
    pub job: [u8; 16],
    pub me: u32,
}

impl Session {
    /// A sealed frame of this end, ready to write (or to tamper with).
    pub fn frame(&mut self, kind: Kind, round: u32, payload: &[u8]) -> Vec<u8> {
        self.seal.seal(wire::encode_unsealed_body(kind, &self.job, self.me, round, payload).unwrap())
    }

    pub fn send(&mut self, kind: Kind, round: u32, payload: &[u8]) {
        let f = self.frame(kind, round, payload);
        write_frame(&*self.conn, Instant::now() + LONG, &f).unwrap();
    }

    /// The next frame, which must open under the session.
    pub fn recv(&mut self) -> Result<Frame, String> {
        let f = recv_raw(&*self.conn)?;
        f.open(&mut self.open).map_err(|e| e.to_string())?;
        Ok(f)
    }
}

/// Plays member `rank` of `world` by hand on `conn` to `id`'s rank 0, up to
/// and including the PROOF: its session, or the frame rank 0 sent instead
/// of a CHALLENGE.
pub(super) fn member_handshake(conn: Arc<dyn Conn>, id: &Id, rank: u32, world: usize) -> Result<Session, Box<Frame>> {
    let (hello, member_nonce) = hello(id, rank, world);
    write_frame(&*conn, Instant::now() + LONG, &hello).unwrap();
    let t = read_challenge(&*conn, id, rank, world, member_nonce)?;
    Ok(send_proof(conn, id, &t))
}

/// Reads rank 0's answer to a HELLO with `member_nonce` and checks that it
/// is a CHALLENGE made with the secret: the transcript, or the frame rank 0
/// sent instead.
pub(super) fn read_challenge(
    conn: &dyn Conn,
    id: &Id,
    rank: u32,
    world: usize,
    member_nonce: Nonce,
) -> Result<Transcript, Box<Frame>> {
    let f = read_frame(conn, Some(Instant::now() + LONG), wire::MAX_PAYLOAD).unwrap();
    if f.header.kind != Kind::Challenge {
        return Err(Box::new(f));
    }
    let c = wire::decode_greeting(&f.payload, Kind::Challenge).unwrap();
    let t = Transcript {
        job: id.job,
        rank,
        member_world: world as u32,
        member_nonce,
        root_world: c.world,
        root_nonce: c.nonce,
    };
    assert!(t.challenge_tag_ok(&id.secret, &c.tag), "rank 0's CHALLENGE does not verify");
    Ok(t)
}

/// Sends the PROOF for `t`; the member's session.
pub(super) fn send_proof(conn: Arc<dyn Conn>, id: &Id, t: &Transcript) -> Session {
    let proof = raw_frame(Kind::Proof, &id.job, t.rank, 0, &t.proof_tag(&id.secret));
    write_frame(&*conn, Instant::now() + LONG, &proof).unwrap();
    let (seal, open) = t.session(&id.secret, Role::Member);
    Session { conn, seal, open, job: id.job, me: t.rank }
}

/// Plays rank 0 of `id` by hand on an accepted `conn`: reads the HELLO,
/// answers a CHALLENGE for `world`, reads and checks the PROOF. The
/// session and the HELLO, or what went wrong (the member may give up).
pub(super) fn root_handshake(conn: Arc<dyn Conn>, id: &Id, world: usize) -> Result<(Session, Frame), String> {
    let read = || read_frame(&*conn, Some(Instant::now() + LONG), wire::HANDSHAKE_PAYLOAD).map_err(|e| e.to_string());
    let h = read()?;
    assert_eq!((h.header.kind, h.header.job, h.header.round), (Kind::Hello, id.job, 0));
    let g = wire::decode_greeting(&h.payload, Kind::Hello).unwrap();
    assert!(auth::hello_tag_ok(&id.secret, &id.job, h.header.sender, g.world, &g.nonce, &g.tag));
    let root_nonce = auth::random::<{ auth::NONCE_LEN }>().unwrap();
    let t = Transcript {
        job: id.job,
        rank: h.header.sender,
        member_world: g.world,
        member_nonce: g.nonce,
        root_world: world as u32,
        root_nonce,
    };
    let c = Greeting { world: world as u32, nonce: root_nonce, tag: t.challenge_tag(&id.secret) };
    let challenge = raw_frame(Kind::Challenge, &id.job, 0, 0, &wire::encode_greeting(&c));
    write_frame(&*conn, Instant::now() + LONG, &challenge).map_err(|e| e.to_string())?;
    let p = read()?;
    assert_eq!(p.header.kind, Kind::Proof);
    assert!(t.proof_tag_ok(&id.secret, &wire::decode_proof(&p.payload).unwrap()));
    let (seal, open) = t.session(&id.secret, Role::Root);
    Ok((Session { conn, seal, open, job: id.job, me: 0 }, h))
}

/// Reads what rank 0 sends a refused connection until it closes it;
/// returns the (plain) ABORT (its job id and reason) if there was one.
/// Panics if the connection is not closed within `bound`.
pub(super) fn read_until_closed(conn: &dyn Conn, bound: Duration) -> Option<([u8; 16], String)> {
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

/// Warnings logged through the `log` facade by the calling thread while
/// `f` runs (a process-wide logger that files each record under its
/// thread, so tests running at once do not see each other's).
pub(super) fn warnings_during(f: impl FnOnce()) -> Vec<String> {
    use std::sync::OnceLock;
    use std::thread::ThreadId;
    struct Recorder(Mutex<Vec<(ThreadId, String)>>);
    impl log::Log for Recorder {
        fn enabled(&self, m: &log::Metadata<'_>) -> bool {
            m.level() <= log::Level::Warn
        }
        fn log(&self, r: &log::Record<'_>) {
            if self.enabled(r.metadata()) {
                let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
                v.push((thread::current().id(), r.args().to_string()));
            }
        }
        fn flush(&self) {}
    }
    static RECORDER: OnceLock<&'static Recorder> = OnceLock::new();
    let rec = *RECORDER.get_or_init(|| {
        let rec: &'static Recorder = Box::leak(Box::new(Recorder(Mutex::new(Vec::new()))));
        let _ = log::set_logger(rec);
        log::set_max_level(log::LevelFilter::Warn);
        rec
    });
    let me = thread::current().id();
    let take = || {
        let mut v = rec.0.lock().unwrap_or_else(|e| e.into_inner());
        let (mine, others) = std::mem::take(&mut *v).into_iter().partition(|(t, _)| *t == me);
        *v = others;
        mine.into_iter().map(|(_, s)| s).collect::<Vec<String>>()
    };
    take();
    f();
    take()
}
