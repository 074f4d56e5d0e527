//! Property test of the socket rendezvous against hostile peers: generated
//! and mutated frames (truncated, absurd lengths, wrong magic, version,
//! kind, flags, job id, sender or round, altered, dropped or foreign tags,
//! replayed handshakes and frames, random bytes, duplicate joins, slow-loris
//! writers) fed to rank 0 and to a member.
//!
//! Parts: `handshake.rs` runs each side's handshake code itself (rank 0's
//! and a member's) over socket pairs, tens of thousands of times, against
//! a peer that holds the secret and mutates its frames or replays old
//! ones, or one that does not hold it; `rank_0.rs` and `member.rs` run the
//! whole `connect` over Unix sockets and TCP on loopback (bad connections
//! during rank 0's join, bad frames in the rounds of either side).
//!
//! Each frame is first run through an oracle (`parse` here, and the
//! expectations in each part) that says what the protocol in the module
//! docs promises for it: refused without a word, an ABORT with a given
//! reason, a new attempt (a member), or an error with a given text naming
//! the peer. Whether a tag is authentic the oracle decides from the bytes
//! alone: a frame is authentic when it is byte for byte one the fuzz made
//! with the secret for that place. The test then checks that rank 0 or the
//! member does exactly that, within bound, and that the good ranks still
//! complete where the protocol allows. Every part is seeded from one seed,
//! printed at the start and in every failure; `TPAR_RDV_FUZZ_SEED=<seed>`
//! replays the same frames (the threads may interleave differently). The
//! counts and the time are printed at the end: `TPAR_RDV_FUZZ=1 cargo test
//! --lib rendezvous::tests::fuzz -- --nocapture` (without `TPAR_RDV_FUZZ=1`
//! the test prints a skip: it may take minutes).

#![forbid(unsafe_code)]

mod handshake;
mod member;
mod rank_0;

use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::panic;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::rendezvous::auth::{Role, Sealer, Transcript};
use crate::rendezvous::testing::transports;
use crate::rendezvous::wire::{self, HEADER_LEN, MAX_PAYLOAD};
use crate::rendezvous::{read_frame, Conn, Endpoint, Id};

/// Environment variable that fixes the seed (to replay a failure).
const SEED_VAR: &str = "TPAR_RDV_FUZZ_SEED";
/// Environment variable that runs the fuzz (`1`): it may take minutes
/// (bound: `BUDGET`), so the default `cargo test` prints a skip instead; CI
/// sets it.
pub(super) const RUN_VAR: &str = "TPAR_RDV_FUZZ";
/// The whole test must end within this; past it, something hangs.
const BUDGET: Duration = Duration::from_secs(240);
/// Bound for steps expected to succeed (a failing run may wait this long).
const LONG: Duration = Duration::from_secs(10);
/// Gap between the bytes of a slow-loris writer.
const TRICKLE_GAP: Duration = Duration::from_millis(20);
/// At least this many frames fed to the two sides' handshake code, and this
/// many bad frames in all.
const MIN_FRAMES: u64 = 100_000;
const MIN_BAD_FRAMES: u64 = 30_000;

/// Header field offsets (pinned by `wire`'s own tests).
const VERSION_AT: usize = 8;
const KIND_AT: usize = 10;
const FLAGS_AT: usize = 11;
const JOB_AT: usize = 12;
const SENDER_AT: usize = 28;
const ROUND_AT: usize = 32;
const LEN_AT: usize = 36;
const TAG_LEN: usize = 32;
/// Payload of HELLO and CHALLENGE: world, nonce, tag.
const GREETING_LEN: usize = 4 + 32 + 32;

/// Kind codes on the wire.
const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const GATHER: u8 = 3;
const RESULT: u8 = 4;
const ABORT: u8 = 5;
const CHALLENGE: u8 = 6;
const PROOF: u8 = 7;

fn kind_name(code: u8) -> &'static str {
    ["?", "HELLO", "WELCOME", "GATHER", "RESULT", "ABORT", "CHALLENGE", "PROOF"]
        .get(code as usize)
        .copied()
        .unwrap_or("?")
}

#[test]
fn hostile_frames_to_rank_0_and_to_a_member_over_both_transports() {
    if std::env::var(RUN_VAR).as_deref() != Ok("1") {
        // Straight to stderr (not captured): .ci/count-skips counts it.
        use std::io::Write;
        let why = format!(
            "skipped: the rendezvous fuzz may take minutes; {RUN_VAR}=1 runs it \
             (hostile_frames_to_rank_0_and_to_a_member_over_both_transports)\n"
        );
        let _ = std::io::stderr().write_all(why.as_bytes());
        return;
    }
    let seed = std::env::var(SEED_VAR).ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random::<u64>);
    println!("rendezvous fuzz: seed {seed} (replay with {SEED_VAR}={seed})");
    let started = Instant::now();
    // On a thread of its own, so that a hang fails the test instead of
    // stalling it: a rank that never returns is the bug this looks for.
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(panic::catch_unwind(|| run(seed)));
    });
    let tallies = match rx.recv_timeout(BUDGET) {
        Ok(Ok(t)) => t,
        Ok(Err(p)) => panic::resume_unwind(p),
        Err(_) => panic!("seed {seed}: the fuzz did not end within {BUDGET:?}: a rank or a check hangs"),
    };
    let elapsed = started.elapsed();
    let (mut frames, mut bad, mut conns, mut handshakes) = (0, 0, 0, 0);
    for (part, transport, t, took) in &tallies {
        let [f, b, c, slow] = t.get();
        if part.starts_with("handshake") {
            handshakes += f;
        }
        println!(
            "  {part:<13} {transport:<4}: {b:>6} bad frames ({slow:>3} slow-loris) of {f:>6} fed, \
             {c:>5} connections, {:>4.1} s",
            took.as_secs_f64()
        );
        (frames, bad, conns) = (frames + f, bad + b, conns + c);
    }
    println!(
        "rendezvous fuzz: {bad} generated/mutated bad frames ({frames} frames in all, {handshakes} of them to the \
         handshake code directly) on {conns} connections in {:.1} s, seed {seed}",
        elapsed.as_secs_f64()
    );
    assert!(handshakes >= MIN_FRAMES, "seed {seed}: only {handshakes} frames fed to the handshakes");
    assert!(bad >= MIN_BAD_FRAMES, "seed {seed}: only {bad} bad frames fed");
}

/// Runs every part on both transports at once; their tallies and times.
fn run(seed: u64) -> Vec<(&'static str, &'static str, Tally, Duration)> {
    type Part = fn(&Fuzz);
    let parts: [(&str, Part); 5] = [
        ("handshake 0", handshake::rank_0),
        ("handshake m", handshake::member),
        ("rank 0 join", rank_0::join),
        ("rank 0 rounds", rank_0::rounds),
        ("member", member::member),
    ];
    let transports = transports();
    let mut fuzzes = Vec::new();
    for (p, (part, f)) in parts.iter().enumerate() {
        for (t, (transport, make_id)) in transports.iter().enumerate() {
            // The handshake parts run over socket pairs: once is enough.
            if part.starts_with("handshake") && t > 0 {
                continue;
            }
            let transport = if part.starts_with("handshake") { "pair" } else { transport };
            let stream = (p * transports.len() + t) as u64;
            fuzzes.push((*f, Fuzz { seed, stream, part, transport, make_id: *make_id, tally: Tally::default() }));
        }
    }
    let took: Vec<Duration> = thread::scope(|s| {
        let runs: Vec<_> = fuzzes
            .iter()
            .map(|(f, fuzz)| {
                s.spawn(move || {
                    let started = Instant::now();
                    f(fuzz);
                    started.elapsed()
                })
            })
            .collect();
        runs.into_iter().map(|h| h.join().unwrap_or_else(|p| panic::resume_unwind(p))).collect()
    });
    fuzzes.into_iter().zip(took).map(|((_, z), t)| (z.part, z.transport, z.tally, t)).collect()
}

/// One part of the fuzz on one transport.
struct Fuzz {
    seed: u64,
    /// Distinguishes the parts' random streams.
    stream: u64,
    part: &'static str,
    transport: &'static str,
    make_id: fn() -> Id,
    tally: Tally,
}

impl Fuzz {
    /// The random stream of `worker` of this part.
    fn rng(&self, worker: u64) -> StdRng {
        StdRng::seed_from_u64(self.seed ^ (self.stream << 48) ^ worker.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// Ids for one worker's sessions, one after the other. Unix ids are
    /// new each time; TCP ids keep the port of the first: a new port per
    /// session would be hundreds of binds per run, each racing (between
    /// the check that the port is free and rank 0's bind) with any other
    /// test process picking ports on this host.
    fn ids(&self) -> impl FnMut() -> Id {
        let (make, mut tcp) = (self.make_id, None);
        move || {
            if let Some(addr) = tcp {
                return Id::new_tcp(addr);
            }
            let id = make();
            if let Endpoint::Tcp(addr) = id.endpoint {
                tcp = Some(addr);
            }
            id
        }
    }

    /// Prefix of every failure message: enough to find and replay the case.
    fn at(&self, worker: u64, case: usize) -> String {
        format!("seed {} {} {} worker {worker} case {case}", self.seed, self.part, self.transport)
    }
}

#[derive(Default)]
struct Tally {
    frames: AtomicU64,
    bad: AtomicU64,
    connections: AtomicU64,
    /// Bad peers that held or trickled a frame that never completes.
    slow: AtomicU64,
}

impl Tally {
    fn fed(&self, frames: u64, bad: u64) {
        self.frames.fetch_add(frames, Ordering::Relaxed);
        self.bad.fetch_add(bad, Ordering::Relaxed);
    }
    fn connected(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }
    /// Counts a bad peer whose frame never completes and that holds or
    /// trickles it (`is_slow`).
    fn slow(&self, is_slow: bool) {
        self.slow.fetch_add(is_slow as u64, Ordering::Relaxed);
    }
    fn get(&self) -> [u64; 4] {
        [&self.frames, &self.bad, &self.connections, &self.slow].map(|a| a.load(Ordering::Relaxed))
    }
}

/// A test-side socket: the concrete stream, so that it can half-close.
enum Raw {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Raw {
    fn conn(&self) -> &dyn Conn {
        match self {
            Raw::Unix(s) => s,
            Raw::Tcp(s) => s,
        }
    }

    /// Connects to `id`'s rank 0, retrying while it is not listening yet;
    /// `at` says who dials, for the failure message.
    fn dial(id: &Id, at: &str) -> Raw {
        let deadline = Instant::now() + LONG;
        loop {
            let attempt = match &id.endpoint {
                Endpoint::Unix(path) => UnixStream::connect(path).map(Raw::Unix),
                Endpoint::Tcp(addr) => TcpStream::connect(addr).map(Raw::Tcp),
            };
            match attempt {
                Ok(raw) => return raw,
                Err(e) if Instant::now() < deadline => {
                    assert!(
                        matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused),
                        "{at}: dialing {id}: {e}"
                    );
                    thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("{at}: rank 0 did not listen at {id} within {LONG:?}: {e}"),
            }
        }
    }

    /// The same socket as a `Conn` of its own (a second descriptor).
    fn conn_arc(&self) -> Arc<dyn Conn> {
        match self {
            Raw::Unix(s) => Arc::new(s.try_clone().unwrap()),
            Raw::Tcp(s) => Arc::new(s.try_clone().unwrap()),
        }
    }

    fn into_conn(self) -> Arc<dyn Conn> {
        match self {
            Raw::Unix(s) => Arc::new(s),
            Raw::Tcp(s) => Arc::new(s),
        }
    }

    /// Writes all of `bytes` (bounded); false if the peer closed first.
    fn send(&self, bytes: &[u8]) -> bool {
        crate::rendezvous::write_frame(self.conn(), Instant::now() + LONG, bytes).is_ok()
    }

    /// Sends `bytes` and ends as `ending` says. A write error is fine: the
    /// peer may refuse before it has read everything.
    fn feed(&self, bytes: &[u8], ending: Ending) {
        match ending {
            Ending::Close => {
                self.send(bytes);
                let _ = match self {
                    Raw::Unix(s) => s.shutdown(Shutdown::Write),
                    Raw::Tcp(s) => s.shutdown(Shutdown::Write),
                };
            }
            Ending::Hold => {
                self.send(bytes);
            }
            Ending::Trickle => {
                for b in bytes {
                    if self.conn().write(std::slice::from_ref(b)).is_err() {
                        return;
                    }
                    thread::sleep(TRICKLE_GAP);
                }
            }
        }
    }

    /// Frames the peer sends until it closes the connection, or why not
    /// (a malformed frame, or not closed within `bound`).
    fn frames_until_closed(&self, bound: Duration) -> Result<Vec<wire::Frame>, String> {
        let deadline = Instant::now() + bound;
        let mut frames = Vec::new();
        loop {
            match read_frame(self.conn(), Some(deadline), MAX_PAYLOAD) {
                Ok(f) => frames.push(f),
                Err(e) if e.is_disconnect() => return Ok(frames),
                Err(e) => return Err(format!("after {} frame(s): {e}", frames.len())),
            }
        }
    }
}

/// How a bad peer ends after its bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ending {
    /// Half-closes: the receiver sees the end of the stream.
    Close,
    /// Keeps the connection open and sends nothing more.
    Hold,
    /// Slow loris: one byte per `TRICKLE_GAP`, then holds. Only used with
    /// fewer bytes than a header, so the frame never completes.
    Trickle,
}

impl Ending {
    /// `slow`: hold or trickle (the caller then sends a frame that never
    /// completes, which the receiver waits for until its timeout, so the
    /// caller makes these few); else mostly `Close`, sometimes `Hold`.
    fn pick(rng: &mut StdRng, slow: bool) -> Ending {
        match (slow, rng.gen_range(0..10)) {
            (true, 0..=4) => Ending::Trickle,
            (true, _) | (false, 0) => Ending::Hold,
            (false, _) => Ending::Close,
        }
    }

    /// The bytes actually sent: a trickle stops short of a header.
    fn cut(self, mut bytes: Vec<u8>) -> Vec<u8> {
        if self == Ending::Trickle {
            bytes.truncate(HEADER_LEN - 1);
        }
        bytes
    }
}

/// A frame as the oracle reads it.
struct Parsed {
    kind: u8,
    sealed: bool,
    job: [u8; 16],
    sender: u32,
    round: u32,
    payload: Vec<u8>,
    /// Header, payload and tag: all of the frame's bytes.
    bytes: Vec<u8>,
}

/// What a receiver reading one frame of `bytes` (then nothing) finds.
enum Parse {
    /// The bytes end inside the header or the payload.
    Incomplete,
    /// The header says it is no frame for this receiver: the error text.
    BadHeader(String),
    Frame(Parsed),
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// The oracle's reading of the first frame of `bytes` by a receiver whose
/// payload limit is `limit`, written from the format in `wire.rs`'s docs.
fn parse(bytes: &[u8], limit: usize) -> Parse {
    if bytes.len() < HEADER_LEN {
        return Parse::Incomplete;
    }
    if bytes[..8] != *b"TPARDZV\0" {
        return Parse::BadHeader("not a rendezvous frame".into());
    }
    let version = u16_at(bytes, VERSION_AT);
    if version != 2 {
        return Parse::BadHeader(format!("protocol version {version}, this build speaks 2"));
    }
    let kind = bytes[KIND_AT];
    if !(HELLO..=PROOF).contains(&kind) {
        return Parse::BadHeader(format!("unknown frame kind {kind}"));
    }
    let flags = bytes[FLAGS_AT];
    if flags & !1 != 0 {
        return Parse::BadHeader(format!("unknown frame flags {flags:#04x}"));
    }
    let len = u32_at(bytes, LEN_AT) as usize;
    let max = limit.min(MAX_PAYLOAD);
    if len > max {
        return Parse::BadHeader(format!("frame length {len} exceeds the limit of {max} bytes"));
    }
    let sealed = flags & 1 != 0;
    let end = HEADER_LEN + len + if sealed { TAG_LEN } else { 0 };
    let Some(all) = bytes.get(..end) else { return Parse::Incomplete };
    Parse::Frame(Parsed {
        kind,
        sealed,
        job: bytes[JOB_AT..JOB_AT + 16].try_into().unwrap(),
        sender: u32_at(bytes, SENDER_AT),
        round: u32_at(bytes, ROUND_AT),
        payload: bytes[HEADER_LEN..HEADER_LEN + len].to_vec(),
        bytes: all.to_vec(),
    })
}

impl Parsed {
    /// What a session's receiver says about the seal of this frame, which
    /// it reads as the next one: `authentic` when its bytes are the ones the
    /// sender sealed for that place.
    fn open(&self, authentic: &[u8]) -> Result<(), String> {
        let name = kind_name(self.kind);
        if !self.sealed {
            return Err(format!("{name} frame without a tag"));
        }
        match self.bytes == authentic {
            true => Ok(()),
            false => Err(format!("{name} frame failed authentication")),
        }
    }

    /// What a receiver expecting a `want` frame of `round` from `sender`
    /// of `job` says about this one: `Ok(None)` for the expected frame,
    /// `Ok(Some(abort))` for an ABORT, `Err(text)` for a violation.
    fn check(&self, job: &[u8; 16], sender: usize, want: u8, round: u32) -> Result<Option<wire::Abort>, String> {
        let name = kind_name(self.kind);
        if self.job != *job {
            return Err(format!("{name} frame with a wrong job id"));
        }
        if self.sender as usize != sender {
            return Err(format!("{name} frame claims sender rank {} on the connection of rank {sender}", self.sender));
        }
        if self.kind == ABORT {
            if self.payload.len() < 9 {
                return Err(format!("ABORT payload of {} bytes, expected at least 9", self.payload.len()));
            }
            // The reason's cleaning is `wire`'s business, tested there.
            return wire::decode_abort(&self.payload).map(Some);
        }
        if self.kind != want {
            return Err(format!("expected a {} frame, got {name}", kind_name(want)));
        }
        if self.round != round {
            return Err(format!("{} frame for round {}, expected round {round}", kind_name(want), self.round));
        }
        Ok(None)
    }
}

/// A plain frame of `kind` for the fuzz to start from, written from the
/// format in `wire.rs`'s docs.
fn frame(kind: u8, job: &[u8; 16], sender: u32, round: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_LEN + payload.len() + TAG_LEN);
    b.extend_from_slice(b"TPARDZV\0");
    b.extend_from_slice(&2u16.to_le_bytes());
    b.push(kind);
    b.push(0);
    b.extend_from_slice(job);
    b.extend_from_slice(&sender.to_le_bytes());
    b.extend_from_slice(&round.to_le_bytes());
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(payload);
    b
}

/// A frame of `kind` sealed as the next one of `seal`'s direction.
fn sealed(seal: &mut Sealer, kind: u8, job: &[u8; 16], sender: u32, round: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = frame(kind, job, sender, round, payload);
    b[FLAGS_AT] = 1;
    seal.seal(b)
}

/// How a bad frame of a session is made (see [`Recipe`]).
#[derive(Clone, Debug)]
enum How {
    /// Sealed as it should be: authentic, wrong only in what it says.
    Sealed,
    /// Sealed, then mutated (the seed of the mutations).
    Mutated(u64),
    /// Sealed as the frame after the one due.
    LaterSeal,
    /// Not sealed.
    Plain,
    /// These bytes instead of a frame.
    Random(Vec<u8>),
}

/// A frame of one end of a session, decided before the session exists.
/// `build` makes it with a stand-in sealer (to know what the oracle says)
/// and again with the session's (when it is sent); the mutations depend on
/// the bytes' lengths only, never on the key, so both come out alike but
/// for the tag.
#[derive(Clone, Debug)]
struct Recipe {
    kind: u8,
    job: Option<[u8; 16]>,
    sender: u32,
    round: u32,
    payload: Vec<u8>,
    how: How,
    /// For the mutations' sender edges.
    world: u32,
}

impl Recipe {
    /// A bad frame in place of a `kind` frame of `round` from `sender`:
    /// mostly that kind, sealed and mutated, or sealed but saying
    /// something wrong; sometimes another kind, plain, sealed out of
    /// order, or random bytes. `payload` makes a right payload.
    fn bad(
        rng: &mut StdRng,
        kind: u8,
        sender: u32,
        round: u32,
        world: u32,
        payload: impl Fn(&mut StdRng) -> Vec<u8>,
    ) -> Recipe {
        let kind = match rng.gen_range(0..10) {
            0..=4 => kind,
            _ => pick(rng, &[HELLO, WELCOME, GATHER, RESULT, ABORT, ABORT, CHALLENGE, PROOF]),
        };
        let payload = match kind {
            ABORT => abort_payload(rng),
            HELLO | CHALLENGE => random_bytes(rng, GREETING_LEN),
            WELCOME => world.to_le_bytes().to_vec(),
            PROOF => random_bytes(rng, TAG_LEN),
            _ => payload(rng),
        };
        let job = rng.gen_bool(0.08).then(|| rng.gen());
        let sender = if rng.gen_bool(0.1) { pick(rng, &[0, 1, 2, world, u32::MAX]) } else { sender };
        let round = if rng.gen_bool(0.1) { pick(rng, &[0, round.wrapping_sub(1), round + 1, u32::MAX]) } else { round };
        let how = match rng.gen_range(0..20) {
            0..=6 => How::Sealed,
            7..=14 => How::Mutated(rng.gen()),
            15 | 16 => How::LaterSeal,
            17 | 18 => How::Plain,
            _ => How::Random(random_bytes(rng, 120)),
        };
        Recipe { kind, job, sender, round, payload, how, world }
    }

    /// (The bytes to send, the frame that would be authentic in their
    /// place.)
    fn build(&self, seal: &mut Sealer, job: &[u8; 16]) -> (Vec<u8>, Vec<u8>) {
        let job = self.job.as_ref().unwrap_or(job);
        let authentic = sealed(seal, self.kind, job, self.sender, self.round, &self.payload);
        let sent = match &self.how {
            How::Sealed => authentic.clone(),
            How::Mutated(seed) => mutate(&mut StdRng::seed_from_u64(*seed), authentic.clone(), self.world),
            How::LaterSeal => sealed(seal, self.kind, job, self.sender, self.round, &self.payload),
            How::Plain => frame(self.kind, job, self.sender, self.round, &self.payload),
            How::Random(b) => b.clone(),
        };
        (sent, authentic)
    }

    /// `build` with a stand-in session.
    fn preview(&self, job: &[u8; 16]) -> (Vec<u8>, Vec<u8>) {
        let t = Transcript {
            job: *job,
            rank: 0,
            member_world: 0,
            member_nonce: [0; 32],
            root_world: 0,
            root_nonce: [0; 32],
        };
        self.build(&mut t.session(&[0; 16], Role::Member).0, job)
    }
}

/// Random bytes, mostly short.
fn random_bytes(rng: &mut StdRng, max: usize) -> Vec<u8> {
    let len = rng.gen_range(0..=max);
    (0..len).map(|_| rng.gen()).collect()
}

fn pick<T: Copy>(rng: &mut StdRng, from: &[T]) -> T {
    from[rng.gen_range(0..from.len())]
}

/// One of `from` (recorded frames), copied.
fn recall(rng: &mut StdRng, from: &[Vec<u8>]) -> Vec<u8> {
    from[rng.gen_range(0..from.len())].clone()
}

/// An ABORT payload with a random code and a short random reason.
fn abort_payload(rng: &mut StdRng) -> Vec<u8> {
    let mut p = vec![rng.gen_range(0..5)];
    p.extend_from_slice(&rng.gen::<u64>().to_le_bytes());
    let reason = random_bytes(rng, 40);
    p.extend(reason.iter().map(|b| if rng.gen_bool(0.8) { b' ' + b % 94 } else { *b }));
    p
}

/// Applies one to three random mutations to `b`: a header field set to an
/// edge or random value (magic, version, kind, flags, job id, sender,
/// round, length: zero, off by one, over the limit, "negative"), a cut, a
/// flipped or appended byte (in a sealed frame's tag too), a new payload,
/// a tag dropped or added, or random bytes instead of a frame.
fn mutate(rng: &mut StdRng, mut b: Vec<u8>, world: u32) -> Vec<u8> {
    for _ in 0..rng.gen_range(1..=3) {
        let header = b.len() >= HEADER_LEN;
        let put32 = |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        let (any8, any16, any32, coin): (u8, u16, u32, bool) = (rng.gen(), rng.gen(), rng.gen(), rng.gen());
        match rng.gen_range(0..14) {
            0 if header => b[rng.gen_range(0..8)] ^= rng.gen_range(1..=255u8),
            1 if header => {
                let v = pick(rng, &[0, 1, 3, 0x100, 0x102, u16::MAX, any16]);
                b[VERSION_AT..VERSION_AT + 2].copy_from_slice(&v.to_le_bytes());
            }
            2 if header => {
                b[KIND_AT] = pick(rng, &[0, HELLO, WELCOME, GATHER, RESULT, ABORT, CHALLENGE, PROOF, 8, 255, any8]);
            }
            12 if header => b[FLAGS_AT] = pick(rng, &[0, 1, 2, 3, 0x80, 0xFF, any8]),
            13 if header && b[FLAGS_AT] & 1 == 1 && b.len() >= HEADER_LEN + TAG_LEN => {
                // Drop the tag, or replace it.
                let end = b.len() - TAG_LEN;
                match coin {
                    true => b.truncate(end),
                    false => rng.fill(&mut b[end..]),
                }
            }
            13 if header => {
                // Claim a seal, with a made-up tag.
                b[FLAGS_AT] |= 1;
                b.extend((0..TAG_LEN).map(|_| rng.gen::<u8>()));
            }
            3 if header && coin => b[JOB_AT + rng.gen_range(0..16)] ^= 1 << rng.gen_range(0..8),
            3 if header => rng.fill(&mut b[JOB_AT..JOB_AT + 16]),
            4 if header => {
                put32(&mut b, SENDER_AT, pick(rng, &[0, 1, 2, world - 1, world, world + 1, u32::MAX, any32]))
            }
            5 if header => {
                let now = u32_at(&b, ROUND_AT);
                let v = pick(rng, &[0, 1, now.wrapping_sub(1), now.wrapping_add(1), u32::MAX, any32]);
                put32(&mut b, ROUND_AT, v);
            }
            6 if header => {
                let now = u32_at(&b, LEN_AT);
                let edges = [
                    0,
                    now.wrapping_sub(1),
                    now.wrapping_add(1),
                    now.wrapping_add(TAG_LEN as u32),
                    GREETING_LEN as u32,
                    4105,
                    MAX_PAYLOAD as u32,
                    MAX_PAYLOAD as u32 + 1,
                ];
                let edge = pick(rng, &edges);
                let v = pick(rng, &[edge, 0x8000_0000, u32::MAX, u32::MAX - 3, any32 % 9000, any32]);
                put32(&mut b, LEN_AT, v);
            }
            7 if !b.is_empty() => b.truncate(rng.gen_range(0..b.len())),
            8 if !b.is_empty() => {
                let at = rng.gen_range(0..b.len());
                b[at] ^= rng.gen_range(1..=255u8);
            }
            9 => b.extend(random_bytes(rng, 64)),
            10 => b = random_bytes(rng, 200),
            11 if header => {
                b.truncate(HEADER_LEN);
                b.extend(random_bytes(rng, 100));
                if rng.gen_bool(0.7) {
                    let len = (b.len() - HEADER_LEN) as u32;
                    put32(&mut b, LEN_AT, len);
                }
            }
            _ => {}
        }
    }
    b
}
