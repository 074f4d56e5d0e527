//! A member (the whole `connect`, rank 1..N-1) against a hostile rank 0,
//! played by the test on a listener of its own with the secret: the
//! handshake, WELCOME and good RESULTs, then one bad frame, in the join or
//! in a round. In a round, or where the bad frame is authenticated, the
//! member must fail with the error the oracle names, naming rank 0, within
//! bound (a held or trickled frame: at its timeout). In the join, where it
//! cannot trust the frame, it must dial again and join the honest rank 0
//! this fake then plays.

#![forbid(unsafe_code)]

use std::io;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::Rng;

use super::handshake::{welcome_oracle, MemberSays};
use super::{parse, random_bytes, Ending, Fuzz, How, Parse, Raw, Recipe, LONG, RESULT, WELCOME};
use crate::rendezvous::testing::{root_handshake, Session};
use crate::rendezvous::wire::{self, AbortCode, Kind, MAX_PAYLOAD};
use crate::rendezvous::{connect, Endpoint, Id};

/// Fake ranks 0 per transport, each with its own listener, and sessions
/// (members) per fake.
const WORKERS: u64 = 3;
const SESSIONS: usize = 300;
/// Good rounds before the bad frame, at most.
const MAX_GOOD_ROUNDS: u32 = 4;
/// The member's timeout where the bad frame never completes (it waits for
/// it); these sessions are one in `SLOW_EVERY`.
const SHORT: Duration = Duration::from_millis(800);
const SLOW_EVERY: u32 = 100;

pub(super) fn member(fuzz: &Fuzz) {
    thread::scope(|s| {
        for worker in 0..WORKERS {
            s.spawn(move || {
                let (id, fake) = Fake::listen(fuzz);
                for case in 0..SESSIONS {
                    session(fuzz, &id, &fake, worker, case);
                }
                drop(fake);
                id.remove_files();
            });
        }
    });
}

/// The test's rank 0: a listener at the id's endpoint.
enum Fake {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Fake {
    fn listen(fuzz: &Fuzz) -> (Id, Fake) {
        if fuzz.transport == "tcp" {
            // Held for the whole part, so the kernel's choice is safe here.
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.set_nonblocking(true).unwrap();
            return (Id::new_tcp(l.local_addr().unwrap()), Fake::Tcp(l));
        }
        let id = (fuzz.make_id)();
        let Endpoint::Unix(path) = &id.endpoint else { unreachable!("{}: {id}", fuzz.transport) };
        let l = UnixListener::bind(path).unwrap();
        l.set_nonblocking(true).unwrap();
        (id, Fake::Unix(l))
    }

    /// The member's next connection, within `LONG`.
    fn accept(&self, at: &str) -> Raw {
        let deadline = Instant::now() + LONG;
        loop {
            let accepted = match self {
                Fake::Unix(l) => l.accept().map(|(s, _)| s.set_nonblocking(false).map(|()| Raw::Unix(s))),
                Fake::Tcp(l) => l.accept().map(|(s, _)| s.set_nonblocking(false).map(|()| Raw::Tcp(s))),
            };
            match accepted {
                Ok(raw) => return raw.unwrap(),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    thread::sleep(Duration::from_micros(200))
                }
                Err(e) => panic!("{at}: the member did not connect: {e}"),
            }
        }
    }
}

/// One member session, decided before it runs.
struct Plan {
    world: usize,
    rank: usize,
    /// `None`: the bad frame comes in place of WELCOME; `Some(g)`: in place
    /// of the RESULT of round g + 1, after g good rounds.
    good: Option<u32>,
    /// `parts[r - 1]`: every rank's bytes in round r.
    parts: Vec<Vec<Vec<u8>>>,
    bad: Recipe,
    ending: Ending,
    /// What the member does: fails with this text, or (`retries`) dials
    /// again, and then joins the honest rank 0.
    text: String,
    retries: bool,
    timeout: Duration,
}

/// A well-framed RESULT payload that is wrong in what it says: this rank's
/// bytes changed, a contribution too many or too few, a trailing byte, or
/// cut short.
fn bad_result(rng: &mut StdRng, parts: &[Vec<u8>], rank: usize) -> Vec<u8> {
    let mut parts = parts.to_vec();
    match rng.gen_range(0..5) {
        0 if !parts[rank].is_empty() => {
            let at = rng.gen_range(0..parts[rank].len());
            parts[rank][at] ^= 1;
        }
        0 => parts[rank].push(rng.gen()),
        1 => parts.push(random_bytes(rng, 8)),
        2 => drop(parts.pop()),
        3 => {
            let mut p = wire::encode_result(&parts);
            p.push(rng.gen());
            return p;
        }
        _ => {
            let mut p = wire::encode_result(&parts);
            p.truncate(rng.gen_range(0..p.len()));
            return p;
        }
    }
    wire::encode_result(&parts)
}

/// The RESULT payload's parts as the protocol defines them, or why not.
fn result_parts(p: &[u8], world: usize) -> Result<Vec<Vec<u8>>, String> {
    let word = |at: usize| {
        p.get(at..at + 4)
            .map(|b| super::u32_at(b, 0) as usize)
            .ok_or_else(|| format!("RESULT payload cut at byte {at}"))
    };
    let count = word(0)?;
    if count != world {
        return Err(format!("RESULT holds {count} contributions, expected {world}"));
    }
    let (mut at, mut parts) = (4, Vec::new());
    for rank in 0..world {
        let len = word(at)?;
        at += 4;
        let end = at.checked_add(len).filter(|&e| e <= p.len());
        let end = end.ok_or_else(|| format!("RESULT entry of rank {rank} ({len} bytes) runs past the payload"))?;
        parts.push(p[at..end].to_vec());
        at = end;
    }
    match p.len() - at {
        0 => Ok(parts),
        n => Err(format!("RESULT payload has {n} trailing bytes")),
    }
}

/// What member `rank` says about rank 0's frame `bytes` in round `round`
/// (then `ending`), `authentic` being the frame rank 0's session would
/// seal in its place and `parts` every rank's bytes in that round: `None`
/// if it is the good RESULT; else its error text, and whether it waits for
/// more bytes (fails only at its timeout if held).
fn round_oracle(
    rank: usize,
    parts: &[Vec<u8>],
    job: &[u8; 16],
    (bytes, authentic): (&[u8], &[u8]),
    ending: Ending,
    round: u32,
) -> Option<(String, bool)> {
    let world = parts.len();
    let violation = |t: String| format!("rendezvous protocol violation from rank 0: round {round}: {t}");
    let f = match (parse(bytes, MAX_PAYLOAD), ending) {
        (Parse::Incomplete, Ending::Close) => {
            return Some((format!("rank 0 closed the connection in round {round}"), false))
        }
        (Parse::Incomplete, _) => {
            return Some((format!("rank {rank} got no result for round {round} from rank 0"), true))
        }
        (Parse::BadHeader(t), _) => return Some((violation(t), false)),
        (Parse::Frame(f), _) => f,
    };
    let text = match f.open(authentic).and_then(|()| f.check(job, 0, RESULT, round)) {
        Err(t) => violation(t),
        Ok(Some(a)) => match a.code {
            AbortCode::Timeout => format!("rank 0 reports: {}", a.reason),
            AbortCode::Rejected => format!("rank 0 refused this rank: {}", a.reason),
            AbortCode::Failed => format!("rank 0 aborted the rendezvous: {}", a.reason),
        },
        Ok(None) => match result_parts(&f.payload, world) {
            Err(t) => violation(t),
            Ok(got) if got[rank] == parts[rank] => return None,
            Ok(_) => violation(format!("RESULT does not hold rank {rank}'s own contribution")),
        },
    };
    Some((text, false))
}

impl Plan {
    fn new(rng: &mut StdRng, job: &[u8; 16]) -> Plan {
        let slow = rng.gen_range(0..SLOW_EVERY) == 0;
        let world = rng.gen_range(2..=4);
        let rank = rng.gen_range(1..world);
        let most = if slow { 1 } else { MAX_GOOD_ROUNDS };
        let good = rng.gen_bool(0.7).then(|| rng.gen_range(0..=most));
        let rounds = good.map_or(1, |g| g + 1);
        let parts: Vec<Vec<Vec<u8>>> =
            (0..rounds).map(|_| (0..world).map(|_| random_bytes(rng, 40)).collect()).collect();
        loop {
            let bad = match good {
                None => Recipe::bad(rng, WELCOME, 0, 0, world as u32, |_| (world as u32).to_le_bytes().to_vec()),
                Some(g) => {
                    let all = &parts[g as usize];
                    match rng.gen_bool(0.3) {
                        true => Recipe {
                            kind: RESULT,
                            job: None,
                            sender: 0,
                            round: g + 1,
                            payload: bad_result(rng, all, rank),
                            how: How::Sealed,
                            world: world as u32,
                        },
                        false => Recipe::bad(rng, RESULT, 0, g + 1, world as u32, |_| wire::encode_result(all)),
                    }
                }
            };
            let ending = Ending::pick(rng, slow);
            let (sent, authentic) = bad.preview(job);
            let sent = ending.cut(sent);
            let (text, retries, waits) = match good {
                None => match (parse(&sent, wire::MAX_CONTROL_PAYLOAD), ending) {
                    // Held: the member waits for WELCOME until its timeout.
                    (Parse::Incomplete, Ending::Hold | Ending::Trickle) => {
                        (format!("rank {rank} got no WELCOME from rank 0"), false, true)
                    }
                    _ => match welcome_oracle(&sent, job, &authentic, rank, world) {
                        MemberSays::Joins => continue,
                        MemberSays::Retries(t) => (t, true, false),
                        MemberSays::Fails(t) => (t, false, false),
                        MemberSays::Proves => unreachable!(),
                    },
                },
                Some(g) => match round_oracle(rank, &parts[g as usize], job, (&sent, &authentic), ending, g + 1) {
                    None => continue,
                    Some((t, waits)) => (t, false, waits),
                },
            };
            if waits != slow && ending != Ending::Close {
                continue;
            }
            let timeout = if waits { SHORT } else { LONG };
            return Plan { world, rank, good, parts, bad, ending, text, retries, timeout };
        }
    }
}

/// One real member against the fake rank 0: good frames, then the bad one
/// (and, if the member dials again, an honest rank 0).
fn session(fuzz: &Fuzz, id: &Id, fake: &Fake, worker: u64, case: usize) {
    let mut rng = fuzz.rng((worker << 32) | case as u64);
    let at = fuzz.at(worker, case);
    let job = id.job_id();
    let plan = Plan::new(&mut rng, &job);
    let (rank, world) = (plan.rank, plan.world);
    let rounds = plan.good.map_or(1, |g| g + 1);
    let started = Instant::now();
    let outcome = thread::scope(|s| {
        let member = s.spawn(|| -> crate::error::Result<Vec<Vec<Vec<u8>>>> {
            let rdv = connect(id, rank, world, plan.timeout)?;
            (1..=rounds).map(|r| rdv.all_gather(&plan.parts[r as usize - 1][rank])).collect()
        });
        let mut session = accept_member(fake, id, world, rank, &at);
        fuzz.tally.connected();
        let mut fed = 2;
        if let Some(good) = plan.good {
            session.send(Kind::Welcome, 0, &(world as u32).to_le_bytes());
            serve_rounds(&mut session, &plan, 1..=good + 1, good + 1, &at);
            fed += good as u64 + 2;
        }
        let (bad, _) = plan.bad.build(&mut session.seal, &job);
        feed(&session, &plan.ending.cut(bad), plan.ending);
        fuzz.tally.fed(fed, 1);
        fuzz.tally.slow(plan.timeout == SHORT);
        if plan.retries {
            // The member dials again: this time rank 0 is honest.
            let mut again = accept_member(fake, id, world, rank, &at);
            fuzz.tally.connected();
            again.send(Kind::Welcome, 0, &(world as u32).to_le_bytes());
            serve_rounds(&mut again, &plan, 1..=1, 1, &at);
            fuzz.tally.fed(3, 0);
        }
        let outcome = member.join().unwrap();
        drop(session);
        outcome
    });
    let (ending, text) = (plan.ending, &plan.text);
    let bad = plan.bad.preview(&job).0;
    if plan.retries {
        let got = outcome.unwrap_or_else(|e| panic!("{at}: {ending:?} {bad:02x?}: the member did not try again: {e}"));
        assert!(got == vec![plan.parts[0].clone()], "{at}: wrong result after the new attempt");
    } else {
        let err =
            outcome.err().unwrap_or_else(|| panic!("{at}: the member accepted {ending:?} {bad:02x?}")).to_string();
        assert!(
            err.contains(text.as_str()) && err.contains("rank 0"),
            "{at}: {ending:?} {bad:02x?}: {err:?}, expected {text:?}"
        );
    }
    let bound = plan.timeout + Duration::from_secs(3);
    assert!(started.elapsed() < bound, "{at}: the member took {:?}", started.elapsed());
}

/// The member's next connection, with the handshake done by the fake
/// rank 0 (which holds the secret).
fn accept_member(fake: &Fake, id: &Id, world: usize, rank: usize, at: &str) -> Session {
    let raw = fake.accept(at);
    let (session, hello) = root_handshake(raw.into_conn(), id, world).unwrap_or_else(|e| panic!("{at}: {e}"));
    assert_eq!(
        (hello.header.sender as usize, hello.payload[..4].to_vec()),
        (rank, (world as u32).to_le_bytes().to_vec()),
        "{at}"
    );
    session
}

/// Answers the member's GATHERs of `rounds` with the right RESULT, except
/// (`up_to` being the last round) the last one's, which the caller sends.
fn serve_rounds(s: &mut Session, plan: &Plan, rounds: std::ops::RangeInclusive<u32>, up_to: u32, at: &str) {
    let rank = plan.rank;
    for r in rounds {
        let g = s.recv().unwrap_or_else(|e| panic!("{at}: no GATHER for round {r}: {e}"));
        let mine = &plan.parts[r as usize - 1][rank];
        assert_eq!((g.header.kind, g.header.round, &g.payload), (Kind::Gather, r, mine), "{at}");
        if r < up_to || plan.retries {
            s.send(Kind::Result, r, &wire::encode_result(&plan.parts[r as usize - 1]));
        }
    }
}

/// Sends `bytes` on the session's socket and ends as `ending` says (see
/// `Raw::feed`).
fn feed(s: &Session, bytes: &[u8], ending: Ending) {
    let conn = &*s.conn;
    match ending {
        Ending::Close => {
            let _ = crate::rendezvous::write_frame(conn, Instant::now() + LONG, bytes);
            conn.disconnect();
        }
        Ending::Hold => {
            let _ = crate::rendezvous::write_frame(conn, Instant::now() + LONG, bytes);
        }
        Ending::Trickle => {
            for b in bytes {
                if conn.write(std::slice::from_ref(b)).is_err() {
                    return;
                }
                thread::sleep(super::TRICKLE_GAP);
            }
        }
    }
}
