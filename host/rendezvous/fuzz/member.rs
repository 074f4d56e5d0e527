//! A member (rank 1..N-1) against a hostile rank 0, played by the test on
//! a listener of its own: WELCOME and good RESULTs, then one bad frame, in
//! the join or in a round. The member must fail with the error the oracle
//! names, naming rank 0, within bound (a held or trickled frame: at its
//! timeout).

#![forbid(unsafe_code)]

use std::io;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::Rng;

use super::{
    abort_payload, frame, mutate, parse, pick, random_bytes, Ending, Fuzz, Parse, Raw, ABORT, GATHER, HELLO, LONG,
    RESULT, WELCOME,
};
use crate::rendezvous::wire::{self, AbortCode, Kind, MAX_PAYLOAD};
use crate::rendezvous::{connect, read_frame, Endpoint, Id};

/// Fake ranks 0 per transport, each with its own listener, and sessions
/// (member connections) per fake.
const WORKERS: u64 = 3;
const SESSIONS: usize = 500;
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

    /// The member's connection, within `LONG`.
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
    /// `None`: the bad frame answers the HELLO; `Some(g)`: it answers the
    /// GATHER of round g + 1, after g good rounds.
    good: Option<u32>,
    /// `parts[r - 1]`: every rank's bytes in round r.
    parts: Vec<Vec<Vec<u8>>>,
    bad: Vec<u8>,
    ending: Ending,
    /// What the member's error must say.
    text: String,
    timeout: Duration,
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

/// What the member says about rank 0's frame `bytes` (then `ending`):
/// `None` if it is the good WELCOME or RESULT; else its error text, and
/// whether it waits for more bytes (fails only at its timeout if held).
fn oracle(plan: &Plan, job: &[u8; 16], bytes: &[u8], ending: Ending) -> Option<(String, bool)> {
    let (rank, world) = (plan.rank, plan.world);
    let round = plan.good.map_or(0, |g| g + 1);
    let join = plan.good.is_none();
    let violation = |t: String| match join {
        true => format!("rendezvous protocol violation from rank 0: {t}"),
        false => format!("rendezvous protocol violation from rank 0: round {round}: {t}"),
    };
    let limit = if join { wire::MAX_CONTROL_PAYLOAD } else { MAX_PAYLOAD };
    let f = match (parse(bytes, limit), ending) {
        (Parse::Incomplete, Ending::Close) if join => {
            return Some((format!("rank 0 closed the connection while rank {rank} was joining"), false))
        }
        (Parse::Incomplete, Ending::Close) => {
            return Some((format!("rank 0 closed the connection in round {round}"), false))
        }
        (Parse::Incomplete, _) if join => return Some((format!("rank {rank} got no WELCOME from rank 0"), true)),
        (Parse::Incomplete, _) => {
            return Some((format!("rank {rank} got no result for round {round} from rank 0"), true))
        }
        (Parse::BadHeader(t), _) if join => return Some((violation(format!("during join: {t}")), false)),
        (Parse::BadHeader(t), _) => return Some((violation(t), false)),
        (Parse::Frame(f), _) => f,
    };
    let text = match f.check(job, 0, if join { WELCOME } else { RESULT }, round) {
        Err(t) => violation(t),
        Ok(Some(a)) => match a.code {
            AbortCode::Timeout => format!("rank 0 reports: {}", a.reason),
            AbortCode::Rejected => format!("rank 0 refused this rank: {}", a.reason),
            AbortCode::Failed => format!("rank 0 aborted the rendezvous: {}", a.reason),
        },
        Ok(None) if join => match f.payload.len() {
            4 if super::u32_at(&f.payload, 0) as usize == world => return None,
            4 => violation(format!("WELCOME for world size {}, expected {world}", super::u32_at(&f.payload, 0))),
            n => violation(format!("world-size payload of {n} bytes, expected 4")),
        },
        Ok(None) => match result_parts(&f.payload, world) {
            Err(t) => violation(t),
            Ok(parts) if parts[rank] == plan.parts[round as usize - 1][rank] => return None,
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
        let parts = (0..rounds).map(|_| (0..world).map(|_| random_bytes(rng, 40)).collect()).collect();
        let mut plan = Plan {
            world,
            rank,
            good,
            parts,
            bad: Vec::new(),
            ending: Ending::Close,
            text: String::new(),
            timeout: LONG,
        };
        let round = good.map_or(0, |g| g + 1);
        let main = if good.is_some() { RESULT } else { WELCOME };
        loop {
            let kind = pick(rng, &[main, main, main, main, HELLO, GATHER, ABORT, RESULT, WELCOME]);
            let semantic = kind == RESULT && good.is_some() && rng.gen_bool(0.3);
            let payload = match kind {
                RESULT if semantic => bad_result(rng, &plan.parts[round as usize - 1], rank),
                RESULT if good.is_some() => wire::encode_result(&plan.parts[round as usize - 1]),
                RESULT => wire::encode_result(&[random_bytes(rng, 8), random_bytes(rng, 8)]),
                ABORT => abort_payload(rng),
                _ => (pick(rng, &[world, world, world + 1, 1]) as u32).to_le_bytes().to_vec(),
            };
            let base = frame(kind, job, 0, round, &payload);
            let mutated = !semantic && (kind == main || rng.gen_bool(0.7));
            let bad = if mutated { mutate(rng, base, world as u32) } else { base };
            let ending = Ending::pick(rng, slow);
            let bad = ending.cut(bad);
            match oracle(&plan, job, &bad, ending) {
                None => continue,
                Some((_, waits)) if waits != slow && ending != Ending::Close => continue,
                Some((text, waits)) => {
                    (plan.bad, plan.ending, plan.text) = (bad, ending, text);
                    plan.timeout = if waits { SHORT } else { LONG };
                    return plan;
                }
            }
        }
    }
}

/// One real member against the fake rank 0: good frames, then the bad one.
fn session(fuzz: &Fuzz, id: &Id, fake: &Fake, worker: u64, case: usize) {
    let mut rng = fuzz.rng((worker << 32) | case as u64);
    let at = fuzz.at(worker, case);
    let job = id.job_id();
    let plan = Plan::new(&mut rng, &job);
    let (rank, world) = (plan.rank, plan.world);
    let started = Instant::now();
    let err = thread::scope(|s| {
        let member = s.spawn(|| -> crate::error::Result<()> {
            let rdv = connect(id, rank, world, plan.timeout)?;
            for r in 1..=plan.good.map_or(1, |g| g + 1) {
                rdv.all_gather(&plan.parts[r as usize - 1][rank])?;
            }
            Ok(())
        });
        let raw = fake.accept(&at);
        fuzz.tally.connected();
        let hello = read_frame(raw.conn(), Some(Instant::now() + LONG), 64).unwrap_or_else(|e| panic!("{at}: {e}"));
        let h = hello.header;
        assert_eq!((h.kind, h.job, h.sender, h.round), (Kind::Hello, job, rank as u32, 0), "{at}");
        assert_eq!(hello.payload, (world as u32).to_le_bytes(), "{at}");
        let mut fed = 1;
        if let Some(good) = plan.good {
            assert!(raw.send(&frame(WELCOME, &job, 0, 0, &(world as u32).to_le_bytes())), "{at}");
            for r in 1..=good + 1 {
                let g = read_frame(raw.conn(), Some(Instant::now() + LONG), MAX_PAYLOAD)
                    .unwrap_or_else(|e| panic!("{at}: no GATHER for round {r}: {e}"));
                let mine = &plan.parts[r as usize - 1][rank];
                assert_eq!((g.header.kind, g.header.round, &g.payload), (Kind::Gather, r, mine), "{at}");
                if r <= good {
                    let result = wire::encode_result(&plan.parts[r as usize - 1]);
                    assert!(raw.send(&frame(RESULT, &job, 0, r, &result)), "{at}");
                }
            }
            fed += good as u64 + 1;
        }
        raw.feed(&plan.bad, plan.ending);
        fuzz.tally.fed(fed, 1);
        fuzz.tally.slow(plan.timeout == SHORT);
        let outcome = member.join().unwrap();
        drop(raw);
        outcome
    });
    let (ending, bad, text) = (plan.ending, &plan.bad, &plan.text);
    let err = err.err().unwrap_or_else(|| panic!("{at}: the member accepted {ending:?} {bad:02x?}")).to_string();
    assert!(
        err.contains(text.as_str()) && err.contains("rank 0"),
        "{at}: {ending:?} {bad:02x?}: {err:?}, expected {text:?}"
    );
    let bound = plan.timeout + Duration::from_secs(3);
    assert!(started.elapsed() < bound, "{at}: the member took {:?} to fail", started.elapsed());
}
