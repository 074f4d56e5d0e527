//! Tests of the whole socket protocol over both transports: every rank is
//! a real `connect` (threads, or a child process for SIGKILL).

#![forbid(unsafe_code)]

mod attacks;
mod fuzz;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::testing::{
    member_handshake, on_ranks, private_dir, raw_dial, raw_frame, read_until_closed, recv_raw, tcp_id, transports,
    unix_id, Session, LONG,
};
use super::wire::{self, Checked, Kind};
use super::{connect, write_frame, Endpoint, Id, MAX_ROUND_BYTES};
use crate::error::Error;

/// Distinct per rank and round: small, empty, about 1 MiB, small, empty.
fn payload(rank: usize, round: usize) -> Vec<u8> {
    match round % 5 {
        0 | 3 => format!("rank {rank} round {round}").into_bytes(),
        2 => (0..(1 << 20) + rank).map(|i| (i ^ (i >> 8) ^ rank) as u8).collect(),
        _ => Vec::new(),
    }
}

fn all_gather_rounds(make: fn() -> Id) {
    for world in [1, 2, 4, 8] {
        let id = make();
        on_ranks(0..world, |rank| {
            let rdv = connect(&id, rank, world, LONG).unwrap();
            assert_eq!((rdv.rank(), rdv.world_size()), (rank, world));
            for round in 0..5 {
                let got = rdv.all_gather(&payload(rank, round)).unwrap();
                let want: Vec<Vec<u8>> = (0..world).map(|r| payload(r, round)).collect();
                assert!(got == want, "world {world} rank {rank} round {round}: wrong result");
            }
            rdv.barrier().unwrap();
        });
        if let Some(dir) = private_dir(&id) {
            assert!(!dir.exists(), "{} left behind", dir.display());
        }
    }
}

#[test]
fn unix_all_gather_rounds_n_1_2_4_8() {
    all_gather_rounds(unix_id);
}

#[test]
fn tcp_all_gather_rounds_n_1_2_4_8() {
    all_gather_rounds(tcp_id);
}

/// After the join, rank 2 drops its rendezvous (as its process would on
/// exit or SIGKILL): the others' next all_gather fails fast naming it.
#[test]
fn dropped_rank_fails_the_next_round_naming_it() {
    for (transport, make) in transports() {
        let id = make();
        let errs = on_ranks(0..3, |rank| {
            let rdv = connect(&id, rank, 3, LONG).unwrap();
            rdv.barrier().unwrap();
            if rank == 2 {
                return None;
            }
            let started = Instant::now();
            let err = rdv.all_gather(b"again").expect_err("round without rank 2");
            assert!(started.elapsed() < Duration::from_secs(2), "{transport}: {:?}", started.elapsed());
            // Unusable from now on, with the same reason.
            assert!(rdv.barrier().unwrap_err().to_string().contains("rank 2"));
            Some(err)
        });
        for err in errs.into_iter().flatten() {
            let s = err.to_string();
            assert!(s.contains("rank 2 closed its connection"), "{transport}: {s}");
        }
    }
}

#[test]
fn rank_0_exit_fails_the_others_naming_it() {
    for (transport, make) in transports() {
        let id = make();
        on_ranks(0..3, |rank| {
            let rdv = connect(&id, rank, 3, LONG).unwrap();
            rdv.barrier().unwrap();
            if rank == 0 {
                return;
            }
            let started = Instant::now();
            let err = rdv.all_gather(b"again").expect_err("round without rank 0");
            assert!(started.elapsed() < Duration::from_secs(2), "{transport}");
            assert!(err.to_string().contains("rank 0"), "{transport}: {err}");
        });
    }
}

const CHILD_ID_VAR: &str = "TPAR_RDV_TEST_CHILD_ID";

/// Not a test by itself: the child process of
/// `sigkilled_process_fails_the_next_round_naming_it` (this test binary
/// run again with the id in the environment). Joins as rank 2 of 3, does
/// one round, then waits to be killed.
#[test]
#[ignore = "child process of sigkilled_process_fails_the_next_round_naming_it"]
fn child_rank_2_of_3() {
    let Ok(id) = std::env::var(CHILD_ID_VAR) else { return };
    let rdv = connect(&id.parse().unwrap(), 2, 3, LONG).unwrap();
    rdv.all_gather(b"child").unwrap();
    thread::sleep(LONG);
}

/// Rank 2 is another process, joined through the id string, and is
/// SIGKILLed after a round: ranks 0 and 1 fail their next round at once,
/// naming rank 2.
#[test]
fn sigkilled_process_fails_the_next_round_naming_it() {
    use std::process::{Command, Stdio};
    use std::sync::Barrier;
    let id = unix_id();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "rendezvous::tests::child_rank_2_of_3", "--ignored", "--test-threads=1"])
        .env(CHILD_ID_VAR, id.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let killed = Barrier::new(3);
    let errs = thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (id, killed) = (&id, &killed);
                s.spawn(move || {
                    let rdv = connect(id, rank, 3, LONG);
                    let first = rdv
                        .as_ref()
                        .map_err(|e| e.to_string())
                        .and_then(|r| r.all_gather(format!("thread {rank}").as_bytes()).map_err(|e| e.to_string()));
                    killed.wait(); // round 1 done on both threads
                    killed.wait(); // rank 2 killed
                    let first = first.unwrap();
                    assert_eq!(first[2], b"child");
                    let started = Instant::now();
                    let err = rdv.unwrap().all_gather(b"after").expect_err("round without rank 2");
                    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
                    err
                })
            })
            .collect();
        killed.wait();
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        killed.wait();
        let errs: Vec<Error> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(!status.success());
        errs
    });
    for err in errs {
        assert!(err.to_string().contains("rank 2 closed its connection"), "{err}");
    }
}

#[test]
fn oversized_contribution_fails_every_rank() {
    let id = unix_id();
    let errs = on_ranks(0..3, |rank| {
        let rdv = connect(&id, rank, 3, LONG).unwrap();
        let mine = if rank == 1 { vec![0u8; MAX_ROUND_BYTES] } else { b"small".to_vec() };
        rdv.all_gather(&mine).unwrap_err()
    });
    assert!(matches!(errs[1], Error::InvalidUsage(_)), "{}", errs[1]);
    assert!(errs[0].to_string().contains("rank 1 aborted round 1"), "{}", errs[0]);
    assert!(errs[2].to_string().contains("rank 1"), "{}", errs[2]);
    // Together over the limit while each is under it: rank 0 refuses.
    let id = unix_id();
    let errs = on_ranks(0..3, |rank| {
        connect(&id, rank, 3, LONG).unwrap().all_gather(&vec![1u8; MAX_ROUND_BYTES / 2]).unwrap_err()
    });
    assert!(errs.iter().all(|e| e.to_string().contains("over the rendezvous limit")), "{errs:?}");
}

#[test]
fn socket_file_is_0600_in_a_0700_dir_and_both_are_removed() {
    let id = unix_id();
    let Endpoint::Unix(socket) = id.endpoint.clone() else { unreachable!() };
    let dir = socket.parent().unwrap().to_path_buf();
    let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    thread::scope(|s| {
        let root = s.spawn(|| connect(&id, 0, 2, LONG));
        let deadline = Instant::now() + LONG;
        while !socket.exists() {
            assert!(Instant::now() < deadline, "rank 0 never created its socket");
            thread::sleep(Duration::from_millis(1));
        }
        // Published only once its mode is set, so this is never racy.
        assert_eq!(mode(&socket), 0o600);
        assert_eq!(mode(&dir), 0o700);
        let one = connect(&id, 1, 2, LONG).unwrap();
        let root = root.join().unwrap().unwrap();
        // Gone as soon as everyone joined; the connections live on.
        assert!(!socket.exists() && !dir.exists());
        thread::scope(|s| {
            let h = s.spawn(|| one.all_gather(b"1").unwrap());
            assert_eq!(root.all_gather(b"0").unwrap(), h.join().unwrap());
        });
        drop(root);
        drop(one);
    });
    assert!(!dir.exists());
}

#[test]
fn missing_rank_times_out_naming_it() {
    let timeout = Duration::from_millis(500);
    for (transport, make) in transports() {
        let id = make();
        let started = Instant::now();
        let errs = on_ranks(0..2, |rank| connect(&id, rank, 3, timeout).err().expect("joined without rank 2"));
        let elapsed = started.elapsed();
        assert!(elapsed >= timeout && elapsed < timeout + Duration::from_secs(2), "{transport}: {elapsed:?}");
        for (rank, err) in errs.iter().enumerate() {
            let Error::RendezvousTimeout { what, waited_ms } = err else { panic!("{transport} rank {rank}: {err}") };
            assert!(what.contains("ranks [2] did not join within 500 ms"), "{transport} rank {rank}: {what}");
            assert_eq!(*waited_ms, 500);
        }
        assert!(errs[1].to_string().contains("rank 0 reports"), "{}", errs[1]);
        if let Some(dir) = private_dir(&id) {
            assert!(!dir.exists());
        }
    }
}

/// A joined rank (played by hand, with the secret) breaks the protocol in
/// round 1: rank 0 fails naming it and rank 2 fails at once with the reason.
#[test]
fn joined_rank_protocol_violation_aborts_the_others() {
    type Case = (&'static str, fn(&mut Session) -> Vec<u8>, &'static str);
    let cases: [Case; 9] = [
        ("wrong round", |m| m.frame(Kind::Gather, 2, b"x"), "round 2, expected round 1"),
        (
            "wrong sender",
            |m| {
                m.me = 2;
                m.frame(Kind::Gather, 1, b"x")
            },
            "claims sender rank 2",
        ),
        (
            "wrong job",
            |m| {
                m.job = [1; 16];
                m.frame(Kind::Gather, 1, b"x")
            },
            "wrong job id",
        ),
        ("wrong kind", |m| m.frame(Kind::Result, 1, b"x"), "expected a GATHER"),
        ("garbage", |_| vec![0x55; 64], "not a rendezvous frame"),
        (
            "oversized",
            |m| {
                let mut b = m.frame(Kind::Gather, 1, b"");
                b[36..40].copy_from_slice(&(wire::MAX_PAYLOAD as u32 + 1).to_le_bytes());
                b
            },
            "exceeds the limit",
        ),
        ("not sealed", |m| raw_frame(Kind::Gather, &m.job, 1, 1, b"x"), "GATHER frame without a tag"),
        (
            "altered",
            |m| {
                let mut b = m.frame(Kind::Gather, 1, b"xyz");
                b[wire::HEADER_LEN + 1] ^= 1;
                b
            },
            "GATHER frame failed authentication",
        ),
        (
            "tag of a later frame",
            |m| {
                let _skipped = m.frame(Kind::Gather, 1, b"x");
                m.frame(Kind::Gather, 1, b"x")
            },
            "GATHER frame failed authentication",
        ),
    ];
    for (transport, make) in transports() {
        for (name, bytes, text) in &cases {
            let id = make();
            thread::scope(|s| {
                let root = s.spawn(|| connect(&id, 0, 3, LONG)?.all_gather(b"zero"));
                let two = s.spawn(|| connect(&id, 2, 3, LONG)?.all_gather(b"two"));
                let mut one = member_handshake(raw_dial(&id), &id, 1, 3).unwrap();
                let welcome = one.recv().unwrap();
                assert_eq!(welcome.header.kind, Kind::Welcome);
                let started = Instant::now();
                let bad = bytes(&mut one);
                write_frame(&*one.conn, Instant::now() + LONG, &bad).unwrap();
                let root_err = root.join().unwrap().unwrap_err();
                let two_err = two.join().unwrap().unwrap_err();
                assert!(started.elapsed() < Duration::from_secs(3), "{transport} {name}");
                assert!(
                    matches!(&root_err, Error::Protocol { from, what } if from == "rank 1" && what.contains(text)),
                    "{transport} {name}: rank 0 got {root_err}"
                );
                let two_err = two_err.to_string();
                assert!(
                    two_err.contains("rank 0 aborted") && two_err.contains("rank 1"),
                    "{transport} {name}: {two_err}"
                );
                // The offender is told too.
                let abort = recv_raw(&*one.conn).unwrap();
                assert_eq!(abort.header.kind, Kind::Abort, "{transport} {name}");
            });
        }
    }
}

#[test]
fn silent_connection_does_not_delay_the_join() {
    for (transport, make) in transports() {
        let id = make();
        let started = Instant::now();
        thread::scope(|s| {
            let root = s.spawn(|| connect(&id, 0, 3, LONG)?.barrier());
            let silent = raw_dial(&id);
            let id = &id;
            let others: Vec<_> = (1..3).map(|r| s.spawn(move || connect(id, r, 3, LONG)?.barrier())).collect();
            root.join().unwrap().unwrap();
            others.into_iter().for_each(|h| h.join().unwrap().unwrap());
            // Closed when the join ended, not after its handshake limit.
            assert_eq!(read_until_closed(&*silent, Duration::from_secs(2)), None, "{transport}");
        });
        assert!(started.elapsed() < Duration::from_secs(3), "{transport}: {:?}", started.elapsed());
    }
}

/// Two connections claim rank 1 and both complete the handshake (both
/// hold the secret: two processes started as rank 1): the first one rank 0
/// admits keeps the rank, the other is refused with an authenticated
/// reason, and the rendezvous completes with the winner.
#[test]
fn duplicate_rank_first_connection_wins() {
    for (transport, make) in transports() {
        let id = make();
        let job = id.job_id();
        thread::scope(|s| {
            let root = s.spawn(|| connect(&id, 0, 3, LONG)?.all_gather(b"zero"));
            let claimants = [raw_dial(&id), raw_dial(&id)].map(|c| member_handshake(c, &id, 1, 3).unwrap());
            // Each claimant waits for its reply on a thread of its own: the
            // loser hears at once, the winner only after rank 2 joins.
            let (tx, rx) = mpsc::channel();
            for (i, mut c) in claimants.into_iter().enumerate() {
                let tx = tx.clone();
                s.spawn(move || {
                    let reply = c.recv();
                    tx.send((i, reply, c)).unwrap();
                });
            }
            let (loser, first, lost) = rx.recv_timeout(Duration::from_secs(3)).expect("no claimant was refused");
            let abort = first.unwrap().check(&job, 0, Kind::Welcome, 0).unwrap();
            let Checked::Aborted(abort) = abort else { panic!("{transport}: first reply was {abort:?}") };
            assert!(abort.reason.contains("rank 1 has already joined"), "{transport}: {}", abort.reason);
            assert!(read_until_closed(&*lost.conn, Duration::from_secs(2)).is_none());

            let two = s.spawn(|| connect(&id, 2, 3, LONG)?.all_gather(b"two"));
            let (winner, welcome, mut won) = rx.recv_timeout(LONG).unwrap();
            assert_ne!(winner, loser);
            let welcome = welcome.unwrap().check(&job, 0, Kind::Welcome, 0).unwrap();
            assert_eq!(welcome, Checked::Expected(wire::encode_world(3).to_vec()), "{transport}");
            won.send(Kind::Gather, 1, b"one");
            let result = won.recv().unwrap();
            let Ok(Checked::Expected(p)) = result.check(&job, 0, Kind::Result, 1) else {
                panic!("{transport}: no RESULT")
            };
            let want = vec![b"zero".to_vec(), b"one".to_vec(), b"two".to_vec()];
            assert_eq!(wire::decode_result(&p, 3).unwrap(), want);
            assert_eq!(root.join().unwrap().unwrap(), want);
            assert_eq!(two.join().unwrap().unwrap(), want);
        });
    }
}

/// Rank 0 failed before listening and its directory was removed (what
/// `remove_files` does, as the Python layer does on every failure path):
/// the other ranks fail at once instead of retrying until the timeout.
#[test]
fn members_fail_at_once_when_rank_0s_directory_is_gone() {
    let id = unix_id();
    let dir = private_dir(&id).expect("a Unix id has a private directory");
    assert!(dir.exists());
    id.remove_files();
    let started = Instant::now();
    let err = connect(&id, 1, 2, Duration::from_secs(30)).err().expect("joined without rank 0");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(matches!(err, Error::Rendezvous(_)), "{err}");
    assert!(err.to_string().contains("rendezvous directory"), "{err}");
}

/// While the directory exists (rank 0 slow to start), members keep
/// retrying: the check above does not cut the normal wait short.
#[test]
fn members_wait_for_a_slow_rank_0_while_its_directory_exists() {
    let id = unix_id();
    let late = id.clone();
    let root = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        connect(&late, 0, 2, Duration::from_secs(30)).map(|_| ())
    });
    connect(&id, 1, 2, Duration::from_secs(30)).expect("rank 1 joins a late rank 0");
    root.join().unwrap().expect("rank 0 joins");
}

/// The attack and fuzz tests sit in `tests/` beside this file, and CI runs
/// the fuzz, which the default `cargo test` leaves out: `.ci/test.sh` sets
/// its knob for the test step.
#[test]
fn the_attack_and_fuzz_tests_sit_apart_and_ci_runs_the_fuzz() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("host/rendezvous");
    for (moved, from) in [("tests/attacks.rs", "attacks.rs"), ("tests/fuzz/mod.rs", "fuzz/mod.rs")] {
        assert!(here.join(moved).is_file() && !here.join(from).exists(), "{moved}");
    }
    let ci = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/test.sh")).unwrap();
    let knob = format!("{}=1", fuzz::RUN_VAR);
    assert!(
        ci.lines().any(|l| !l.trim_start().starts_with('#') && l.contains(&knob)),
        ".ci/test.sh does not set {knob}"
    );
}
