//! Each side's handshake code run directly, tens of thousands of times,
//! over socket pairs: rank 0's `handshake` (on a worker thread, as rank 0
//! runs it per connection) against a member played here, and a member's
//! `attempt` (one connection's join) against a rank 0 played here. The
//! fuzz plays the honest peer, which holds the secret, and mutates its
//! frames; or a stranger without the secret; or replays frames recorded
//! from earlier connections (HELLOs, PROOFs, CHALLENGEs, sealed WELCOMEs).
//! Every frame goes through the oracle, and the outcome (admitted or
//! refused with what reason and what ABORT; a member joined, trying again
//! with what reason, or failing with what error) must be the one it names.

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU8;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::Rng;

use super::{
    abort_payload, frame, kind_name, mutate, parse, pick, random_bytes, recall, sealed, Fuzz, Parse, Parsed, ABORT,
    CHALLENGE, GATHER, GREETING_LEN, HELLO, LONG, PROOF, RESULT, WELCOME,
};
use crate::rendezvous::auth::{self, Role, Transcript};
use crate::rendezvous::member::{attempt, Attempt};
use crate::rendezvous::root::{handshake, UNVOUCHED};
use crate::rendezvous::wire::{self, AbortCode, HEADER_LEN, MAX_CONTROL_PAYLOAD, MAX_PAYLOAD};
use crate::rendezvous::{read_frame, Conn, Endpoint, Id, Limits, Link};

/// Connections per part. Each feeds one to two frames.
const RANK_0_CASES: usize = 42_000;
const MEMBER_CASES: usize = 38_000;
/// Rank 0's world in the rank-0 part.
const WORLD: usize = 4;
/// Where the member part's member thinks rank 0 is (only its messages use it).
const ENDPOINT: &str = "127.0.0.1:9";

fn limits() -> Limits {
    // Short: nothing here waits for it unless a bug does.
    Limits { handshake_timeout: Duration::from_millis(2000), ..Limits::for_timeout(LONG) }
}

fn link(id: &Id, world: usize) -> Link {
    Link { secret: id.secret, job: id.job, world, timeout: LONG, limits: limits() }
}

/// A random 32-byte value (nonce or made-up tag) from the fuzz's stream.
fn bytes32(rng: &mut StdRng) -> [u8; 32] {
    rng.gen()
}

fn greeting(world: u32, nonce: &[u8; 32], tag: &[u8; 32]) -> Vec<u8> {
    let mut p = world.to_le_bytes().to_vec();
    p.extend_from_slice(nonce);
    p.extend_from_slice(tag);
    p
}

/// Frames until the peer closes, or why not.
fn frames_until_closed(conn: &UnixStream) -> Result<Vec<wire::Frame>, String> {
    let deadline = Instant::now() + LONG;
    let mut frames = Vec::new();
    loop {
        match read_frame(conn, Some(deadline), MAX_PAYLOAD) {
            Ok(f) => frames.push(f),
            Err(e) if e.is_disconnect() => return Ok(frames),
            Err(e) => return Err(format!("after {} frame(s): {e}", frames.len())),
        }
    }
}

/// What rank 0's handshake does with a connection, by the protocol.
#[derive(Debug)]
pub(super) enum RootSays {
    /// Refused: the reason's text, and the ABORT it sends (the job id it
    /// carries, which is the one the peer sent), if any.
    Refuses(String, Option<[u8; 16]>),
    /// Sends a CHALLENGE (the HELLO was authentic and new).
    Challenges,
    /// Admits the connection as (rank, world).
    Admits(usize, usize),
}

/// The oracle for the HELLO: `authentic` is the HELLO the fuzz made with
/// the secret for this connection, if it did; `seen`, the nonces of the
/// authentic HELLOs rank 0 has already vouched for.
pub(super) fn hello_oracle(
    bytes: &[u8],
    job: &[u8; 16],
    authentic: Option<&Parsed>,
    seen: &HashSet<Vec<u8>>,
) -> RootSays {
    let f = match parse(bytes, wire::HANDSHAKE_PAYLOAD) {
        Parse::Incomplete if bytes.is_empty() => return RootSays::Refuses("closed without a HELLO".into(), None),
        Parse::Incomplete => {
            return RootSays::Refuses("malformed HELLO: connection closed inside a frame".into(), None)
        }
        Parse::BadHeader(t) => return RootSays::Refuses(format!("malformed HELLO: {t}"), None),
        Parse::Frame(f) => f,
    };
    let refuse = |t: String| RootSays::Refuses(t, Some(f.job));
    if f.job != *job {
        return refuse("HELLO with a wrong job id".into());
    }
    if f.kind != HELLO || f.sealed {
        let sealed = if f.sealed { "a sealed " } else { "" };
        return refuse(format!("a connection opened with {sealed}{} instead of HELLO", kind_name(f.kind)));
    }
    if f.round != 0 {
        return refuse(format!("HELLO for round {}, expected round 0", f.round));
    }
    if f.payload.len() != GREETING_LEN {
        return refuse(format!("HELLO payload of {} bytes, expected {GREETING_LEN}", f.payload.len()));
    }
    // The tag covers the job, sender, world and nonce: authentic when they
    // and the tag are what the fuzz made with the secret.
    if authentic.is_none_or(|a| (a.sender, &a.payload) != (f.sender, &f.payload)) {
        return refuse("HELLO failed authentication".into());
    }
    if seen.contains(&f.payload[4..36]) {
        return refuse("a HELLO rank 0 has seen before (replayed)".into());
    }
    RootSays::Challenges
}

/// The oracle for the PROOF of a connection that claimed `rank` of
/// `world`, `authentic` being the PROOF the fuzz made for this transcript
/// with the secret, if it could.
fn proof_oracle(bytes: &[u8], job: &[u8; 16], rank: u32, world: usize, authentic: Option<&[u8]>) -> RootSays {
    let mismatch = match world {
        WORLD => String::new(),
        w => format!(" (it was started with world size {w}, rank 0 with {WORLD})"),
    };
    let f = match parse(bytes, wire::HANDSHAKE_PAYLOAD) {
        Parse::Incomplete => {
            return RootSays::Refuses(format!("claims rank {rank} closed before its PROOF{mismatch}"), None)
        }
        Parse::BadHeader(t) => {
            return RootSays::Refuses(format!("claims rank {rank} sent a malformed PROOF: {t}"), None)
        }
        Parse::Frame(f) => f,
    };
    // The peer's HELLO carried this job's id: the ABORT does too.
    let refuse = |t: String| RootSays::Refuses(t, Some(*job));
    if f.kind != PROOF || f.sealed || f.job != *job || f.sender != rank || f.round != 0 {
        return refuse(format!("expected PROOF from rank {rank} of this job"));
    }
    if f.payload.len() != 32 {
        return refuse(format!("PROOF payload of {} bytes, expected 32", f.payload.len()));
    }
    if authentic != Some(&f.bytes[..]) {
        return refuse(format!("PROOF of a connection that claims rank {rank} failed authentication"));
    }
    RootSays::Admits(rank as usize, world)
}

/// Rank 0's `handshake` against a member played here.
pub(super) fn rank_0(fuzz: &Fuzz) {
    let id = Id::new_tcp(ENDPOINT.parse().unwrap());
    let link = link(&id, WORLD);
    let mut rng = fuzz.rng(0);
    let at = |case: usize| fuzz.at(0, case);
    type Outcome = Result<(usize, usize), String>;
    let (to_worker, jobs) = mpsc::channel::<UnixStream>();
    let (done_tx, done) = mpsc::channel::<Outcome>();
    thread::scope(|s| {
        s.spawn(move || {
            let seen = Mutex::new(HashSet::new());
            for conn in jobs {
                let stage = AtomicU8::new(UNVOUCHED);
                let outcome = handshake(&link, &conn, &stage, &seen);
                if outcome.is_err() {
                    conn.disconnect();
                }
                let _ = done_tx.send(outcome.map(|a| (a.rank, a.world)));
            }
        });
        // The nonces rank 0 has vouched for, and their HELLOs; authentic
        // HELLOs never shown to it (as if recorded by a squatter); authentic
        // PROOFs of earlier connections.
        let (mut seen, mut vouched): (HashSet<Vec<u8>>, Vec<Vec<u8>>) = (HashSet::new(), Vec::new());
        let (mut unshown, mut proofs): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (Vec::new(), Vec::new());
        for case in 0..RANK_0_CASES {
            let at = at(case);
            // Who the member is: mostly a rank of this world, holding the secret.
            let rank = pick(&mut rng, &[1, 1, 2, 3, 2, 3, 0, 4, u32::MAX]);
            let world = pick(&mut rng, &[WORLD, WORLD, WORLD, WORLD, 3, 5]);
            let holds = rng.gen_bool(0.85);
            let nonce = bytes32(&mut rng);
            let tag = if holds {
                auth::hello_tag(&id.secret, &id.job, rank, world as u32, &nonce)
            } else {
                bytes32(&mut rng)
            };
            let made = frame(HELLO, &id.job, rank, 0, &greeting(world as u32, &nonce, &tag));
            // `authentic`: the HELLO made with the secret that this peer
            // sends, altered or not; `can_prove`: whether the peer holds
            // the secret (a replayer only has a recording).
            let (mut hello, mut authentic, mut can_prove) = (made.clone(), holds.then(|| made.clone()), holds);
            match rng.gen_range(0..20) {
                0 if !vouched.is_empty() => {
                    hello = recall(&mut rng, &vouched);
                    (authentic, can_prove) = (Some(hello.clone()), false);
                }
                1 if !unshown.is_empty() => {
                    hello = unshown.swap_remove(rng.gen_range(0..unshown.len()));
                    (authentic, can_prove) = (Some(hello.clone()), false);
                }
                2 if holds && unshown.len() < 64 => {
                    unshown.push(made);
                    continue;
                }
                3..=9 => hello = mutate(&mut rng, hello, WORLD as u32),
                10 => hello = random_bytes(&mut rng, 120),
                _ => {}
            }
            let parsed = authentic.as_ref().and_then(|a| match parse(a, MAX_PAYLOAD) {
                Parse::Frame(f) => Some(f),
                _ => None,
            });
            let says = hello_oracle(&hello, &id.job, parsed.as_ref(), &seen);
            let (ours, theirs) = UnixStream::pair().unwrap();
            assert!((&ours).write_all_ok(&hello), "{at}");
            if !matches!(says, RootSays::Challenges) {
                ours.shutdown(Shutdown::Write).unwrap();
            }
            to_worker.send(theirs).unwrap();
            fuzz.tally.connected();
            fuzz.tally.fed(1, !matches!(says, RootSays::Challenges) as u64);
            let says = match says {
                RootSays::Challenges => {
                    let p = parsed.unwrap();
                    seen.insert(p.payload[4..36].to_vec());
                    vouched.push(p.bytes.clone());
                    if vouched.len() > 64 {
                        vouched.swap_remove(0);
                    }
                    // Bytes after the HELLO's frame come before the PROOF.
                    let rest = hello[p.bytes.len()..].to_vec();
                    let (rank, world) = (p.sender, super::u32_at(&p.payload, 0) as usize);
                    let c = read_frame(&ours, Some(Instant::now() + LONG), MAX_PAYLOAD)
                        .unwrap_or_else(|e| panic!("{at}: no CHALLENGE: {e}"));
                    let h = c.header;
                    let want = (wire::Kind::Challenge, false, id.job, 0, 0);
                    assert_eq!((h.kind, h.sealed, h.job, h.sender, h.round), want, "{at}");
                    let g = wire::decode_greeting(&c.payload, wire::Kind::Challenge).unwrap();
                    assert_eq!(g.world as usize, WORLD, "{at}");
                    let t = Transcript {
                        job: id.job,
                        rank,
                        member_world: world as u32,
                        member_nonce: p.payload[4..36].try_into().unwrap(),
                        root_world: g.world,
                        root_nonce: g.nonce,
                    };
                    assert!(t.challenge_tag_ok(&id.secret, &g.tag), "{at}: rank 0's CHALLENGE does not verify");
                    let good = frame(PROOF, &id.job, rank, 0, &t.proof_tag(&id.secret));
                    let authentic = can_prove.then_some(&good[..]);
                    // Without the secret the best guess is rank 0's own tag, sent back.
                    let best = if can_prove { good.clone() } else { frame(PROOF, &id.job, rank, 0, &g.tag) };
                    let proof = match rng.gen_range(0..10) {
                        0 if !proofs.is_empty() => recall(&mut rng, &proofs),
                        1 => frame(PROOF, &id.job, rank, 0, &bytes32(&mut rng)),
                        2..=4 => mutate(&mut rng, best, WORLD as u32),
                        _ => best,
                    };
                    if can_prove {
                        proofs.push(good.clone());
                        if proofs.len() > 64 {
                            proofs.swap_remove(0);
                        }
                    }
                    let sent: Vec<u8> = rest.iter().chain(&proof).copied().collect();
                    let says = proof_oracle(&sent, &id.job, rank, world, authentic);
                    (&ours).write_all_ok(&proof);
                    ours.shutdown(Shutdown::Write).unwrap();
                    fuzz.tally.fed(1, !matches!(says, RootSays::Admits(..)) as u64);
                    says
                }
                other => other,
            };
            let outcome = done.recv_timeout(LONG).unwrap_or_else(|_| panic!("{at}: rank 0's handshake hangs"));
            let frames = frames_until_closed(&ours).unwrap_or_else(|e| panic!("{at}: {e}"));
            match (&says, &outcome) {
                (RootSays::Admits(r, w), Ok((rank, world))) => {
                    assert_eq!((r, w), (rank, world), "{at}");
                    assert!(frames.is_empty(), "{at}: {frames:?}");
                }
                (RootSays::Refuses(text, abort), Err(why)) => {
                    assert!(why.contains(text.as_str()), "{at}: {hello:02x?}: refused with {why:?}, expected {text:?}");
                    match (abort, frames.as_slice()) {
                        (None, []) => {}
                        (Some(job), [f]) if f.header.kind == wire::Kind::Abort && !f.header.sealed => {
                            assert_eq!(&f.header.job, job, "{at}: an ABORT tells the peer the job id it sent");
                            let reason = wire::decode_abort(&f.payload).unwrap().reason;
                            assert!(reason.contains(text.as_str()), "{at}: ABORT says {reason:?}, expected {text:?}");
                        }
                        _ => panic!("{at}: rank 0 sent {frames:?}, expected ABORT {abort:?}"),
                    }
                }
                _ => panic!("{at}: {hello:02x?}: rank 0's handshake gave {:?}, expected {says:?}", outcome.map(|_| ())),
            }
        }
        drop(to_worker);
    });
}

/// What a member's `attempt` does with what rank 0 sent, by the protocol.
#[derive(Debug)]
pub(super) enum MemberSays {
    /// It tries again with a new connection, for this reason.
    Retries(String),
    /// It fails at once with this error.
    Fails(String),
    /// It sends its PROOF (the CHALLENGE was authentic).
    Proves,
    Joins,
}

/// The oracle for rank 0's answer to the HELLO; `authentic` is the
/// CHALLENGE the fuzz made with the secret for this connection, and
/// `root_world` the world size in it.
fn challenge_oracle(
    bytes: &[u8],
    job: &[u8; 16],
    authentic: Option<&[u8]>,
    rank: usize,
    world: usize,
    root_world: usize,
) -> MemberSays {
    let retry = MemberSays::Retries;
    let f = match parse(bytes, MAX_CONTROL_PAYLOAD) {
        Parse::Incomplete => return retry("it closed the connection first".into()),
        Parse::BadHeader(t) => return retry(format!("it sent no CHALLENGE but {t}")),
        Parse::Frame(f) => f,
    };
    if f.kind == ABORT && !f.sealed {
        let said = wire::decode_abort(&f.payload).map(|a| a.reason).unwrap_or_else(|e| e);
        return retry(format!("it refused this rank without authenticating itself, saying: {said}"));
    }
    if f.kind != CHALLENGE || f.sealed || f.job != *job || f.sender != 0 || f.round != 0 {
        return retry("not rank 0's CHALLENGE".into());
    }
    if f.payload.len() != GREETING_LEN {
        return retry(format!("its CHALLENGE is malformed: CHALLENGE payload of {} bytes", f.payload.len()));
    }
    if authentic != Some(&f.bytes[..]) {
        return retry("its CHALLENGE failed authentication".into());
    }
    if root_world != world {
        return MemberSays::Fails(format!("rank 0 was started with world size {root_world}, rank {rank} with {world}"));
    }
    MemberSays::Proves
}

/// The oracle for what rank 0 sends after the PROOF; `authentic` is the
/// frame the fuzz sealed as the first of the session (valid or not in
/// what it says).
pub(super) fn welcome_oracle(bytes: &[u8], job: &[u8; 16], authentic: &[u8], rank: usize, world: usize) -> MemberSays {
    let f = match parse(bytes, MAX_CONTROL_PAYLOAD) {
        Parse::Incomplete => {
            return MemberSays::Retries(format!("rank 0 closed the connection while rank {rank} was joining"))
        }
        Parse::BadHeader(t) => return MemberSays::Retries(format!("rank 0 sent no WELCOME but {t}")),
        Parse::Frame(f) => f,
    };
    if let Err(t) = f.open(authentic) {
        return MemberSays::Retries(t);
    }
    let violation = |t: String| MemberSays::Fails(format!("rendezvous protocol violation from rank 0: {t}"));
    match f.check(job, 0, WELCOME, 0) {
        Err(t) => violation(t),
        Ok(Some(a)) => MemberSays::Fails(match a.code {
            AbortCode::Timeout => format!("rank 0 reports: {}", a.reason),
            AbortCode::Rejected => format!("rank 0 refused this rank: {}", a.reason),
            AbortCode::Failed => format!("rank 0 aborted the rendezvous: {}", a.reason),
        }),
        Ok(None) => match f.payload.len() {
            4 if super::u32_at(&f.payload, 0) as usize == world => MemberSays::Joins,
            4 => violation(format!("WELCOME for world size {}, expected {world}", super::u32_at(&f.payload, 0))),
            n => violation(format!("world-size payload of {n} bytes, expected 4")),
        },
    }
}

/// A member's `attempt` against a rank 0 played here.
pub(super) fn member(fuzz: &Fuzz) {
    let id = Id::new_tcp(ENDPOINT.parse().unwrap());
    let endpoint = Endpoint::Tcp(ENDPOINT.parse().unwrap());
    let mut rng = fuzz.rng(0);
    type Outcome = Result<(), (bool, String)>;
    let (to_worker, jobs) = mpsc::channel::<(UnixStream, usize, usize)>();
    let (done_tx, done) = mpsc::channel::<Outcome>();
    thread::scope(|s| {
        let (id, endpoint) = (&id, &endpoint);
        s.spawn(move || {
            for (conn, rank, world) in jobs {
                let conn: Arc<dyn Conn> = Arc::new(conn);
                let outcome = match attempt(&link(id, world), endpoint, rank, &conn, Instant::now()) {
                    Ok(_) => Ok(()),
                    Err(Attempt::Retry { why, .. }) => Err((true, why)),
                    Err(Attempt::Fail(e)) => Err((false, e.to_string())),
                };
                conn.disconnect();
                let _ = done_tx.send(outcome);
            }
        });
        // Authentic CHALLENGEs and first sealed frames of earlier connections.
        let (mut challenges, mut welcomes): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (Vec::new(), Vec::new());
        for case in 0..MEMBER_CASES {
            let at = fuzz.at(0, case);
            let world = rng.gen_range(2..=4);
            let rank = rng.gen_range(1..world);
            let (ours, theirs) = UnixStream::pair().unwrap();
            to_worker.send((theirs, rank, world)).unwrap();
            fuzz.tally.connected();
            let hello =
                read_frame(&ours, Some(Instant::now() + LONG), MAX_PAYLOAD).unwrap_or_else(|e| panic!("{at}: {e}"));
            let h = hello.header;
            assert_eq!(
                (h.kind, h.sealed, h.job, h.sender, h.round),
                (wire::Kind::Hello, false, id.job, rank as u32, 0),
                "{at}"
            );
            let g = wire::decode_greeting(&hello.payload, wire::Kind::Hello).unwrap();
            assert_eq!(g.world as usize, world, "{at}");
            assert!(auth::hello_tag_ok(&id.secret, &id.job, rank as u32, g.world, &g.nonce, &g.tag), "{at}");

            // Rank 0's answer: mostly its CHALLENGE, made with the secret or
            // not, altered or not; else another frame, an old CHALLENGE, or
            // the member's own HELLO tag sent back.
            let root_world = if rng.gen_range(0..12) == 0 { pick(&mut rng, &[1, 2, 3, 5]) } else { world };
            let t = Transcript {
                job: id.job,
                rank: rank as u32,
                member_world: world as u32,
                member_nonce: g.nonce,
                root_world: root_world as u32,
                root_nonce: bytes32(&mut rng),
            };
            let good = frame(
                CHALLENGE,
                &id.job,
                0,
                0,
                &greeting(root_world as u32, &t.root_nonce, &t.challenge_tag(&id.secret)),
            );
            let challenge = match rng.gen_range(0..24) {
                0 if !challenges.is_empty() => recall(&mut rng, &challenges),
                1 => frame(CHALLENGE, &id.job, 0, 0, &greeting(root_world as u32, &t.root_nonce, &g.tag)),
                2 => frame(CHALLENGE, &id.job, 0, 0, &greeting(root_world as u32, &t.root_nonce, &bytes32(&mut rng))),
                3 => hello.raw_header.iter().chain(&hello.payload).copied().collect(),
                4 => frame(ABORT, &id.job, 0, 0, &abort_payload(&mut rng)),
                5 => {
                    frame(pick(&mut rng, &[WELCOME, GATHER, RESULT, PROOF]), &id.job, 0, 0, &random_bytes(&mut rng, 40))
                }
                6 => random_bytes(&mut rng, 100),
                7..=13 => mutate(&mut rng, good.clone(), world as u32),
                _ => good.clone(),
            };
            challenges.push(good.clone());
            if challenges.len() > 64 {
                challenges.swap_remove(0);
            }
            let says = challenge_oracle(&challenge, &id.job, Some(&good), rank, world, root_world);
            // Bytes after the CHALLENGE's frame come before the next frame.
            let rest = match parse(&challenge, MAX_CONTROL_PAYLOAD) {
                Parse::Frame(f) => challenge[f.bytes.len()..].to_vec(),
                _ => Vec::new(),
            };
            (&ours).write_all_ok(&challenge);
            let proves = matches!(says, MemberSays::Proves);
            let challenged = proves;
            if !proves {
                ours.shutdown(Shutdown::Write).unwrap();
            }
            fuzz.tally.fed(1, !proves as u64);
            let says = if proves {
                let p = read_frame(&ours, Some(Instant::now() + LONG), MAX_PAYLOAD)
                    .unwrap_or_else(|e| panic!("{at}: no PROOF: {e}"));
                let h = p.header;
                assert_eq!(
                    (h.kind, h.sealed, h.job, h.sender, h.round),
                    (wire::Kind::Proof, false, id.job, rank as u32, 0),
                    "{at}"
                );
                assert!(t.proof_tag_ok(&id.secret, &p.payload), "{at}: the member's PROOF does not verify");
                // The first frame of the session: sealed by rank 0 with
                // the session's key; right or wrong in what it says.
                let seal = || t.session(&id.secret, Role::Root).0;
                let world_of = |w: usize| (w as u32).to_le_bytes();
                let (first, authentic) = match rng.gen_range(0..20) {
                    0 => {
                        let a = sealed(&mut seal(), ABORT, &id.job, 0, 0, &abort_payload(&mut rng));
                        (a.clone(), a)
                    }
                    1 => {
                        let w = sealed(&mut seal(), WELCOME, &id.job, 0, 0, &world_of(world + 1));
                        (w.clone(), w)
                    }
                    2 => {
                        let (job, sender, round) =
                            (pick(&mut rng, &[id.job, [9; 16]]), rng.gen_range(0..2), rng.gen_range(0..2));
                        let kind = pick(&mut rng, &[WELCOME, RESULT, GATHER, HELLO, CHALLENGE]);
                        let w = sealed(&mut seal(), kind, &job, sender, round, &world_of(world));
                        (w.clone(), w)
                    }
                    3 => {
                        // Sealed as the second frame of the session.
                        let mut s = seal();
                        let first = sealed(&mut s, WELCOME, &id.job, 0, 0, &world_of(world));
                        (sealed(&mut s, WELCOME, &id.job, 0, 0, &world_of(world)), first)
                    }
                    4 => {
                        let good = sealed(&mut seal(), WELCOME, &id.job, 0, 0, &world_of(world));
                        (frame(WELCOME, &id.job, 0, 0, &world_of(world)), good)
                    }
                    5 if !welcomes.is_empty() => {
                        let good = sealed(&mut seal(), WELCOME, &id.job, 0, 0, &world_of(world));
                        (recall(&mut rng, &welcomes), good)
                    }
                    6..=12 => {
                        let good = sealed(&mut seal(), WELCOME, &id.job, 0, 0, &world_of(world));
                        (mutate(&mut rng, good.clone(), world as u32), good)
                    }
                    _ => {
                        let good = sealed(&mut seal(), WELCOME, &id.job, 0, 0, &world_of(world));
                        (good.clone(), good)
                    }
                };
                welcomes.push(authentic.clone());
                if welcomes.len() > 64 {
                    welcomes.swap_remove(0);
                }
                let sent: Vec<u8> = rest.iter().chain(&first).copied().collect();
                let says = welcome_oracle(&sent, &id.job, &authentic, rank, world);
                (&ours).write_all_ok(&first);
                ours.shutdown(Shutdown::Write).unwrap();
                fuzz.tally.fed(1, !matches!(says, MemberSays::Joins) as u64);
                says
            } else {
                says
            };
            let outcome = done.recv_timeout(LONG).unwrap_or_else(|_| panic!("{at}: the member's attempt hangs"));
            match (&says, &outcome) {
                (MemberSays::Joins, Ok(())) => {}
                (MemberSays::Retries(text), Err((true, why))) | (MemberSays::Fails(text), Err((false, why))) => {
                    assert!(why.contains(text.as_str()), "{at}: the member says {why:?}, expected {text:?}");
                    // Before rank 0 proved itself, the member says so.
                    let unproven = why.contains("did not authenticate as rank 0");
                    assert!(matches!(says, MemberSays::Fails(_)) || unproven != challenged, "{at}: {why}");
                }
                _ => panic!("{at}: the member's attempt gave {outcome:?}, expected {says:?}"),
            }
        }
        drop(to_worker);
    });
}

/// `write_all` to a socket pair end, bounded; false if the peer closed.
trait WriteAllOk {
    fn write_all_ok(self, bytes: &[u8]) -> bool;
}

impl WriteAllOk for &UnixStream {
    fn write_all_ok(self, bytes: &[u8]) -> bool {
        crate::rendezvous::write_frame(self, Instant::now() + LONG, bytes).is_ok()
    }
}

const _: () = assert!(HEADER_LEN == 40);
