//! Rank 0 (the whole `connect`) against hostile peers. During the join:
//! bad connections from several workers at once (without the secret),
//! duplicate claimants of rank 1 (with it), slow lorises, while the real
//! ranks 2 and 3 join early and late; rank 0 must refuse each bad one as
//! the oracle says and complete with the good ranks. In the rounds: a
//! joined rank 1 (played here, with the secret) that sends good rounds,
//! then one bad frame; rank 0 must fail naming it, and tell rank 1 and
//! rank 2 why.

#![forbid(unsafe_code)]

use std::thread;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;

use super::handshake::{hello_oracle, RootSays};
use super::{
    abort_payload, frame, mutate, parse, pick, random_bytes, Ending, Fuzz, Parse, Raw, Recipe, ABORT, CHALLENGE,
    GATHER, HELLO, LONG, PROOF, RESULT, WELCOME,
};
use crate::rendezvous::testing::{member_handshake, Session};
use crate::rendezvous::wire::{self, Kind, HEADER_LEN, MAX_PAYLOAD};
use crate::rendezvous::{connect, connect_with, Id, Limits};

/// World of a join session: rank 1 is claimed by raw connections (one
/// wins), ranks 2 and 3 are real and join in either order.
const JOIN_WORLD: usize = 4;
/// Join sessions per transport; workers of one session; bad connections
/// per worker and session.
const JOIN_SESSIONS: u64 = 4;
const JOIN_WORKERS: u64 = 4;
const JOIN_CONNECTIONS: usize = 250;
/// Bad connections per worker and session whose frame never completes
/// and that then hold or trickle: each costs rank 0's handshake limit.
const JOIN_SLOW: usize = 2;
/// Rank 0's limit on a handshake in the fuzz (short, since the slow
/// lorises wait for it, but long enough that a handshake thread that the
/// scheduler delays on a loaded 2-core machine still completes in time),
/// and its join timeout (longer than a whole session).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(400);
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);
/// A refused connection must be closed within this.
const REFUSE_BOUND: Duration = Duration::from_secs(5);

/// Round sessions per transport, run by this many workers at once.
const ROUND_SESSIONS: u64 = 240;
const ROUND_WORKERS: u64 = 2;
/// Good rounds before the bad frame, at most.
const MAX_GOOD_ROUNDS: u32 = 6;
/// Rank 0's timeout where the bad frame never completes (rank 0 waits for
/// it); these sessions are one in `SLOW_EVERY`.
const SHORT: Duration = Duration::from_secs(1);
const SLOW_EVERY: u32 = 30;

pub(super) fn join(fuzz: &Fuzz) {
    let mut ids = fuzz.ids();
    for session in 0..JOIN_SESSIONS {
        join_session(fuzz, ids(), session);
    }
}

/// An ABORT rank 0 must send: the job id it carries, and its reason.
type ExpectedAbort = ([u8; 16], String);

/// What rank 0's join does with one connection from a peer without the
/// secret, by the protocol: it refuses and closes it, with an ABORT (job
/// id, reason) when the frame was complete; `waits`: the frame is
/// incomplete, so a peer that holds the connection is refused only at the
/// handshake limit.
fn join_oracle(bytes: &[u8], job: &[u8; 16]) -> (Option<ExpectedAbort>, bool) {
    if let Parse::Incomplete = parse(bytes, wire::HANDSHAKE_PAYLOAD) {
        return (None, true);
    }
    match hello_oracle(bytes, job, None, &Default::default()) {
        RootSays::Refuses(text, abort) => (abort.map(|j| (j, text)), false),
        other => unreachable!("a HELLO without the secret was {other:?}"),
    }
}

/// A bad opening for rank 0's join, by a peer that knows the job id (it
/// travels in the clear) but not the secret: the bytes, how the peer ends,
/// and what rank 0 must answer. `slow`: a frame that never completes, then
/// held or trickled.
fn bad_join(rng: &mut StdRng, job: &[u8; 16], slow: bool) -> (Vec<u8>, Ending, Option<ExpectedAbort>) {
    loop {
        let kind = pick(rng, &[HELLO, HELLO, HELLO, HELLO, WELCOME, GATHER, RESULT, ABORT, CHALLENGE, PROOF]);
        let sender = rng.gen_range(0..=JOIN_WORLD as u32 + 1);
        let payload = match kind {
            HELLO | CHALLENGE => {
                let mut p = (pick(rng, &[JOIN_WORLD, JOIN_WORLD, 1, 3, 5]) as u32).to_le_bytes().to_vec();
                p.extend(random_bytes(rng, 64).into_iter().chain(std::iter::repeat(0)).take(64));
                p
            }
            WELCOME => (JOIN_WORLD as u32).to_le_bytes().to_vec(),
            ABORT => abort_payload(rng),
            _ => random_bytes(rng, 40),
        };
        let base = frame(kind, job, sender, 0, &payload);
        let mut bytes = if kind == HELLO || rng.gen_bool(0.7) { mutate(rng, base, JOIN_WORLD as u32) } else { base };
        let ending = Ending::pick(rng, slow);
        bytes = ending.cut(bytes);
        if slow && bytes.len() >= HEADER_LEN {
            bytes.truncate(rng.gen_range(0..HEADER_LEN));
        }
        match join_oracle(&bytes, job) {
            // A held incomplete frame is slow: only where asked for.
            (_, waits) if waits != slow && ending != Ending::Close => continue,
            (abort, _) => return (bytes, ending, abort),
        }
    }
}

/// One rank 0 joining a world of 4 through `JOIN_WORKERS` ×
/// `JOIN_CONNECTIONS` bad connections, 1 to 3 claimants of rank 1, and
/// the real ranks 2 and 3 (one before the fuzz, one after it).
fn join_session(fuzz: &Fuzz, id: Id, session: u64) {
    let mut rng = fuzz.rng(session << 8);
    let at = fuzz.at(session << 8, 0);
    let limits = Limits { handshake_timeout: HANDSHAKE_TIMEOUT, ..Limits::for_timeout(JOIN_TIMEOUT) };
    let (early, late) = if rng.gen_bool(0.5) { (2, 3) } else { (3, 2) };
    let claimants = rng.gen_range(1..=3);
    let want: Vec<Vec<u8>> = (0..JOIN_WORLD).map(|r| format!("rank {r}").into_bytes()).collect();
    let (id, want) = (&id, &want);
    thread::scope(|s| {
        let root = s.spawn(|| connect_with(id, 0, JOIN_WORLD, JOIN_TIMEOUT, limits)?.all_gather(&want[0]));
        let real = move |rank: usize| connect(id, rank, JOIN_WORLD, JOIN_TIMEOUT)?.all_gather(&want[rank]);
        let early = s.spawn(move || real(early));
        let claims: Vec<_> = (0..claimants).map(|_| s.spawn(|| claim_rank_1(fuzz, id, want, &at))).collect();
        let workers: Vec<_> =
            (0..JOIN_WORKERS).map(|w| s.spawn(move || join_worker(fuzz, id, (session << 8) | (w + 1)))).collect();
        // Join them all before judging, so that a failed worker does not
        // leave rank 0 waiting for the late rank.
        let failed = workers.into_iter().map(|h| h.join()).find_map(Result::err);
        let late = s.spawn(move || real(late));
        let results = [root, early, late].map(|h| h.join().unwrap());
        let won = claims.into_iter().map(|h| h.join()).collect::<Vec<_>>();
        if let Some(panic) = failed {
            std::panic::resume_unwind(panic);
        }
        for r in results {
            let got = r.unwrap_or_else(|e| panic!("{at}: a good rank failed after the bad connections: {e}"));
            assert_eq!(&got, want, "{at}");
        }
        let won: usize = won.into_iter().map(|w| w.unwrap() as usize).sum();
        assert_eq!(won, 1, "{at}: {won} of {claimants} claimants of rank 1 were admitted");
    });
    id.remove_files();
}

/// A connection claiming rank 1 with the secret (a complete handshake):
/// true if rank 0 admitted it (it then plays rank 1 in round 1), false if
/// it was refused as a duplicate.
fn claim_rank_1(fuzz: &Fuzz, id: &Id, want: &[Vec<u8>], at: &str) -> bool {
    let job = id.job_id();
    let raw = Raw::dial(id, at);
    fuzz.tally.connected();
    let mut s = member_handshake(raw.into_conn(), id, 1, JOIN_WORLD).unwrap_or_else(|f| panic!("{at}: {f:?}"));
    fuzz.tally.fed(2, 0);
    let reply = s.recv().unwrap_or_else(|e| panic!("{at}: a claimant got no answer: {e}"));
    if reply.header.kind == Kind::Abort {
        let reason = wire::decode_abort(&reply.payload).unwrap().reason;
        assert!(reason.contains("rank 1 has already joined"), "seed {}: claimant refused: {reason}", fuzz.seed);
        assert!(reply.header.sealed, "{at}: a duplicate is refused within its session");
        assert!(s.recv().is_err(), "{at}: the refused claimant's connection stays open");
        return false;
    }
    assert_eq!((reply.header.kind, reply.payload.as_slice()), (Kind::Welcome, &[JOIN_WORLD as u8, 0, 0, 0][..]));
    s.send(Kind::Gather, 1, &want[1]);
    fuzz.tally.fed(1, 0);
    let result = s.recv().unwrap();
    assert_eq!(result.header.kind, Kind::Result);
    assert_eq!(wire::decode_result(&result.payload, JOIN_WORLD).unwrap(), want);
    let _ = job;
    true
}

/// `JOIN_CONNECTIONS` bad connections to rank 0, one after the other,
/// each checked against the oracle.
fn join_worker(fuzz: &Fuzz, id: &Id, worker: u64) {
    let mut rng = fuzz.rng(worker);
    let job = id.job_id();
    let slow: Vec<usize> = (0..JOIN_SLOW).map(|_| rng.gen_range(0..JOIN_CONNECTIONS)).collect();
    for case in 0..JOIN_CONNECTIONS {
        let is_slow = slow.contains(&case);
        let (bytes, ending, abort) = bad_join(&mut rng, &job, is_slow);
        let at = fuzz.at(worker, case);
        let raw = Raw::dial(id, &at);
        fuzz.tally.connected();
        raw.feed(&bytes, ending);
        fuzz.tally.fed(1, 1);
        fuzz.tally.slow(is_slow);
        let frames = raw
            .frames_until_closed(REFUSE_BOUND)
            .unwrap_or_else(|e| panic!("{at}: {ending:?} {bytes:02x?}: not refused cleanly: {e}"));
        match (&abort, frames.as_slice()) {
            (None, []) => {}
            (Some((sent_job, text)), [f]) if f.header.kind == Kind::Abort => {
                let reason = wire::decode_abort(&f.payload).unwrap().reason;
                assert!(reason.contains(text.as_str()), "{at}: {bytes:02x?}: ABORT says {reason:?}, expected {text:?}");
                // The ABORT carries the job id the peer sent, never ours.
                assert_eq!(&f.header.job, sent_job, "{at}: {bytes:02x?}");
            }
            _ => panic!("{at}: {ending:?} {bytes:02x?}: rank 0 sent {frames:?}, expected ABORT {abort:?}"),
        }
    }
}

pub(super) fn rounds(fuzz: &Fuzz) {
    thread::scope(|s| {
        for worker in 0..ROUND_WORKERS {
            s.spawn(move || {
                let mut ids = fuzz.ids();
                for session in 0..ROUND_SESSIONS / ROUND_WORKERS {
                    round_session(fuzz, ids(), (worker << 16) | session);
                }
            });
        }
    });
}

/// A round session, decided before it runs: world 3, rank 1 played here.
struct RoundPlan {
    good: u32,
    /// `payloads[r - 1][rank]`: each rank's bytes in round r (rank 1's in
    /// the bad round are unused).
    payloads: Vec<[Vec<u8>; 3]>,
    /// Rank 1's bad frame, built with its session's sealer when sent.
    bad: Recipe,
    ending: Ending,
    /// What rank 0's error (and the ABORT it sends) must say.
    text: String,
    timeout: Duration,
}

/// What rank 0 says about rank 1's frame in round `r`: `None` if it is a
/// good GATHER; else the error text, and whether rank 0 waits for more
/// bytes (so a held connection fails only at the timeout).
/// `authentic`: the frame rank 1's session would seal in its place.
fn round_oracle(bytes: &[u8], authentic: &[u8], job: &[u8; 16], r: u32, ending: Ending) -> Option<(String, bool)> {
    let violation = |t: String| format!("rendezvous protocol violation from rank 1: round {r}: {t}");
    match parse(bytes, MAX_PAYLOAD) {
        Parse::Incomplete if ending == Ending::Close => {
            Some((format!("rank 1 closed its connection before round {r}"), false))
        }
        Parse::Incomplete => Some((format!("ranks [1] did not send round {r} of all_gather"), true)),
        Parse::BadHeader(t) => Some((violation(t), false)),
        Parse::Frame(f) => match f.open(authentic).and_then(|()| f.check(job, 1, GATHER, r)) {
            Ok(None) => None,
            Ok(Some(a)) => Some((format!("rank 1 aborted round {r}: {}", a.reason), false)),
            Err(t) => Some((violation(t), false)),
        },
    }
}

impl RoundPlan {
    fn new(rng: &mut StdRng, job: &[u8; 16]) -> RoundPlan {
        let slow = rng.gen_range(0..SLOW_EVERY) == 0;
        let good = rng.gen_range(0..=if slow { 1 } else { MAX_GOOD_ROUNDS });
        let bytes = |rng: &mut StdRng| match rng.gen_range(0..20) {
            0 => random_bytes(rng, 150_000),
            _ => random_bytes(rng, 48),
        };
        let payloads = (0..=good).map(|_| [bytes(rng), bytes(rng), bytes(rng)]).collect();
        let r = good + 1;
        loop {
            let bad = Recipe::bad(rng, GATHER, 1, r, 3, |rng| random_bytes(rng, 64));
            let ending = Ending::pick(rng, slow);
            let (sent, authentic) = bad.preview(job);
            match round_oracle(&ending.cut(sent), &authentic, job, r, ending) {
                None => continue,
                Some((_, waits)) if waits != slow && ending != Ending::Close => continue,
                Some((text, waits)) => {
                    let timeout = if waits { SHORT } else { LONG };
                    return RoundPlan { good, payloads, bad, ending, text, timeout };
                }
            }
        }
    }

    fn want(&self, r: u32) -> Vec<Vec<u8>> {
        self.payloads[r as usize - 1].to_vec()
    }
}

/// Ranks 0 and 2 real, rank 1 raw: good rounds, then the bad frame.
fn round_session(fuzz: &Fuzz, id: Id, worker: u64) {
    let mut rng = fuzz.rng(worker);
    let at = fuzz.at(worker, 0);
    let job = id.job_id();
    let plan = RoundPlan::new(&mut rng, &job);
    let (id, plan, at) = (&id, &plan, &at);
    let real = move |rank: usize| {
        let rdv = connect(id, rank, 3, plan.timeout).unwrap_or_else(|e| panic!("{at}: rank {rank} did not join: {e}"));
        let mut got = Vec::new();
        for r in 1..=plan.good + 1 {
            match rdv.all_gather(&plan.payloads[r as usize - 1][rank]) {
                Ok(parts) => got.push(parts),
                Err(e) => return (got, Some(e)),
            }
        }
        (got, None)
    };
    let (zero, two, abort) = thread::scope(|s| {
        let zero = s.spawn(move || real(0));
        let two = s.spawn(move || real(2));
        let abort = play_rank_1(fuzz, id, plan, at);
        (zero.join().unwrap(), two.join().unwrap(), abort)
    });
    let (text, good) = (&plan.text, plan.good as usize);
    let bad = &plan.bad.preview(&job).0;
    for (rank, (got, err)) in [(0, zero), (2, two)] {
        assert_eq!(got.len(), good, "{at}: rank {rank} completed {} of {good} good rounds", got.len());
        for (r, parts) in got.iter().enumerate() {
            assert!(*parts == plan.want(r as u32 + 1), "{at}: rank {rank} round {}: wrong result", r + 1);
        }
        let err = err.unwrap_or_else(|| panic!("{at}: rank {rank} accepted {:?} {bad:02x?}", plan.ending)).to_string();
        assert!(
            err.contains(text.as_str()),
            "{at}: {:?} {bad:02x?}: rank {rank} says {err:?}, expected {text:?}",
            plan.ending
        );
        // Rank 0 names rank 1; rank 2 names rank 0, which relays it.
        assert!(err.contains("rank 1") || err.contains("ranks [1]"), "{at}: rank {rank}: {err}");
        assert!(rank == 0 || err.contains("rank 0"), "{at}: rank {rank}: {err}");
    }
    let reason = abort.unwrap_or_else(|| panic!("{at}: rank 0 sent rank 1 no ABORT"));
    assert!(reason.contains(text.as_str()), "{at}: rank 1 was told {reason:?}, expected {text:?}");
}

/// Rank 1 by hand, with the secret: joins, plays the good rounds, sends
/// the bad frame; returns the reason of the (sealed) ABORT rank 0 sent
/// back, if any.
fn play_rank_1(fuzz: &Fuzz, id: &Id, plan: &RoundPlan, at: &str) -> Option<String> {
    let job = id.job_id();
    let raw = Raw::dial(id, at);
    fuzz.tally.connected();
    let mut s: Session = member_handshake(raw.conn_arc(), id, 1, 3).unwrap_or_else(|f| panic!("{at}: {f:?}"));
    let welcome = s.recv().unwrap_or_else(|e| panic!("{at}: {e}"));
    assert_eq!(welcome.header.kind, Kind::Welcome, "{at}");
    for r in 1..=plan.good {
        s.send(Kind::Gather, r, &plan.payloads[r as usize - 1][1]);
        let result = s.recv().unwrap_or_else(|e| panic!("{at}: rank 1 got no RESULT for round {r}: {e}"));
        assert_eq!((result.header.kind, result.header.round), (Kind::Result, r), "{at}");
        assert!(wire::decode_result(&result.payload, 3).unwrap() == plan.want(r), "{at}: round {r}");
    }
    let (bad, _) = plan.bad.build(&mut s.seal, &job);
    raw.feed(&plan.ending.cut(bad), plan.ending);
    fuzz.tally.fed(plan.good as u64 + 3, 1);
    fuzz.tally.slow(plan.timeout == SHORT);
    let frames = raw
        .frames_until_closed(plan.timeout + LONG)
        .unwrap_or_else(|e| panic!("{at}: rank 0 did not close rank 1's connection: {e}"));
    match frames.as_slice() {
        [] => None,
        [f] if f.header.kind == Kind::Abort => {
            f.open(&mut s.open).unwrap_or_else(|e| panic!("{at}: rank 0's ABORT does not open: {e}"));
            Some(wire::decode_abort(&f.payload).unwrap().reason)
        }
        _ => panic!("{at}: after the bad frame rank 1 got {frames:?}"),
    }
}
