use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use super::wire::{self, Frame, Kind};
use super::*;

fn free_tcp() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// Runs `world` ranks as threads; returns each rank's result of `body`.
fn run_ranks<T: Send>(
    id: &Id,
    world: usize,
    timeout: Duration,
    body: impl Fn(usize, Box<dyn Rendezvous>) -> T + Sync,
) -> Vec<Result<T>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let body = &body;
                s.spawn(move || connect(id, rank, world, timeout).map(|r| body(rank, r)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn payload(rank: usize, round: usize) -> Vec<u8> {
    let len = match round % 3 {
        0 => 0,
        1 => 17 + rank,
        _ => (1 << 20) + rank,
    };
    (0..len).map(|i| (i * 31 + rank * 7 + round) as u8).collect()
}

fn rounds_ok(id: Id, world: usize) {
    let results = run_ranks(&id, world, Duration::from_secs(10), |rank, rdv| {
        assert_eq!(rdv.rank(), rank);
        assert_eq!(rdv.world_size(), world);
        for round in 0..6 {
            let all = rdv.all_gather(&payload(rank, round)).unwrap();
            assert_eq!(all.len(), world);
            for (r, got) in all.iter().enumerate() {
                assert_eq!(got, &payload(r, round), "round {round}, contribution of rank {r}");
            }
        }
        rdv.barrier().unwrap();
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    id.remove_files();
}

#[test]
fn unix_rounds_in_rank_order() {
    for world in [1, 2, 4, 8] {
        rounds_ok(Id::new_unix().unwrap(), world);
    }
}

#[test]
fn tcp_rounds_in_rank_order() {
    for world in [2, 4, 8] {
        rounds_ok(Id::new_tcp(free_tcp()), world);
    }
}

#[test]
fn id_round_trips_and_rejects_garbage() {
    let u = Id::new_unix().unwrap();
    assert_eq!(u.to_string().parse::<Id>().unwrap(), u);
    u.remove_files();
    let t = Id::new_tcp("127.0.0.1:29500".parse().unwrap());
    assert_eq!(t.to_string().parse::<Id>().unwrap(), t);
    let v6 = Id::new_tcp("[::1]:29500".parse().unwrap());
    assert_eq!(v6.to_string().parse::<Id>().unwrap(), v6);
    let job = "0123456789abcdef0123456789abcdef";
    for bad in [
        "",
        "tpar2:x",
        "tpar1",
        &format!("tpar1:{}:tcp:127.0.0.1:1", &job[..30]),
        &format!("tpar1:{}:udp:127.0.0.1:1", job),
        &format!("tpar1:{}:tcp:not-an-address", job),
        &format!("tpar1:{}:unix:relative/path", job),
        &format!("tpar1:{}zz:unix:/tmp/x", &job[..30]),
    ] {
        assert!(bad.parse::<Id>().is_err(), "accepted {bad:?}");
    }
}

/// A frame header with chosen fields (for hostile inputs).
#[allow(clippy::too_many_arguments)]
fn raw_frame(
    kind: u16,
    job: [u8; 16],
    sender: u32,
    round: u32,
    payload: &[u8],
    magic: [u8; 8],
    version: u16,
    claimed_len: Option<u32>,
) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&magic);
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&kind.to_le_bytes());
    v.extend_from_slice(&job);
    v.extend_from_slice(&sender.to_le_bytes());
    v.extend_from_slice(&round.to_le_bytes());
    v.extend_from_slice(&claimed_len.unwrap_or(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

#[test]
fn hostile_joiners_are_rejected_and_good_ranks_still_join() {
    let world = 3usize;
    let world_bytes = (world as u32).to_le_bytes();
    let id = Id::new_tcp(free_tcp());
    let job = id.job_id();
    let Endpoint::Tcp(addr) = id.endpoint().clone() else { unreachable!() };
    let hello = |sender: u32| {
        raw_frame(Kind::Hello as u16, job, sender, 0, &world_bytes, wire::MAGIC, wire::PROTOCOL_VERSION, None)
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated header", hello(1)[..20].to_vec()),
        ("oversized length", raw_frame(1, job, 1, 0, &[], wire::MAGIC, 1, Some(u32::MAX))),
        ("wrong magic", raw_frame(1, job, 1, 0, &world_bytes, *b"NOTMAGIC", 1, None)),
        ("wrong version", raw_frame(1, job, 1, 0, &world_bytes, wire::MAGIC, 99, None)),
        ("wrong job id", raw_frame(1, [7u8; 16], 1, 0, &world_bytes, wire::MAGIC, 1, None)),
        ("out-of-range rank", hello(3)),
        ("rank 0 impostor", hello(0)),
        ("wrong world size", raw_frame(1, job, 1, 0, &5u32.to_le_bytes(), wire::MAGIC, 1, None)),
        ("not a hello", raw_frame(Kind::Gather as u16, job, 1, 1, b"x", wire::MAGIC, 1, None)),
        ("garbage", (0..200u8).map(|i| i.wrapping_mul(37)).collect()),
        ("silent", Vec::new()),
    ];
    for (name, bytes) in cases {
        let started = Instant::now();
        let id = &id;
        let results = std::thread::scope(|s| {
            let root =
                s.spawn(move || connect(id, 0, world, Duration::from_secs(10)).and_then(|r| r.all_gather(b"zero")));
            // The rogue connects first; the good ranks after it.
            let rogue = s.spawn(move || {
                if let Ok(mut c) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).or_else(|_| {
                    std::thread::sleep(Duration::from_millis(50));
                    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                }) {
                    let _ = c.write_all(&bytes);
                    std::thread::sleep(Duration::from_millis(300));
                }
            });
            std::thread::sleep(Duration::from_millis(100));
            let members: Vec<_> = (1..world)
                .map(|rank| {
                    s.spawn(move || {
                        connect(id, rank, world, Duration::from_secs(10))
                            .and_then(|r| r.all_gather(format!("r{rank}").as_bytes()))
                    })
                })
                .collect();
            let _ = rogue.join();
            let mut out = vec![root.join().unwrap()];
            out.extend(members.into_iter().map(|m| m.join().unwrap()));
            out
        });
        for (rank, r) in results.iter().enumerate() {
            let all = r.as_ref().unwrap_or_else(|e| panic!("{name}: rank {rank} failed: {e}"));
            assert_eq!(all[0], b"zero", "{name}");
            assert_eq!(all[2], b"r2", "{name}");
        }
        assert!(started.elapsed() < Duration::from_secs(6), "{name} took {:?}", started.elapsed());
    }
}

#[test]
fn duplicate_rank_is_rejected_first_wins() {
    let world = 3usize;
    let id = Id::new_tcp(free_tcp());
    let job = id.job_id();
    let Endpoint::Tcp(addr) = id.endpoint().clone() else { unreachable!() };
    let results = std::thread::scope(|s| {
        let root = s.spawn(|| connect(&id, 0, world, Duration::from_secs(10)).and_then(|r| r.all_gather(b"0")));
        std::thread::sleep(Duration::from_millis(50));
        let one = s.spawn(|| connect(&id, 1, world, Duration::from_secs(10)).and_then(|r| r.all_gather(b"1")));
        std::thread::sleep(Duration::from_millis(150));
        // A second "rank 1" must be told it is a duplicate.
        let dup = s.spawn(move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            wire::write_frame(
                &mut c,
                &Frame { kind: Kind::Hello, job, sender: 1, round: 0, payload: (world as u32).to_le_bytes().to_vec() },
            )
            .unwrap();
            wire::read_frame(&mut c, &job)
        });
        let reply = dup.join().unwrap();
        let two = s.spawn(|| connect(&id, 2, world, Duration::from_secs(10)).and_then(|r| r.all_gather(b"2")));
        (root.join().unwrap(), one.join().unwrap(), two.join().unwrap(), reply)
    });
    let reply = results.3.expect("the duplicate gets a reply");
    assert_eq!(reply.kind, Kind::Reject);
    assert!(String::from_utf8_lossy(&reply.payload).contains("duplicate"));
    for r in [results.0, results.1, results.2] {
        assert_eq!(r.unwrap(), vec![b"0".to_vec(), b"1".to_vec(), b"2".to_vec()]);
    }
}

#[test]
fn a_rank_that_never_starts_is_named() {
    let world = 3;
    let id = Id::new_unix().unwrap();
    let t = Duration::from_millis(700);
    let started = Instant::now();
    let (root, one) = std::thread::scope(|s| {
        let root = s.spawn(|| connect(&id, 0, world, t).map(|_| ()));
        let one = s.spawn(|| connect(&id, 1, world, t).map(|_| ()));
        (root.join().unwrap(), one.join().unwrap())
    });
    let e = root.unwrap_err().to_string();
    assert!(e.contains("[2]") && e.contains("did not join"), "{e}");
    assert!(one.is_err());
    assert!(started.elapsed() < Duration::from_secs(3));
    // Rank 0 cleaned up after itself.
    let Endpoint::Unix(p) = id.endpoint() else { unreachable!() };
    assert!(!p.exists());
}

#[test]
fn a_rank_that_disconnects_is_named_and_others_fail_fast() {
    let world = 3;
    let id = Id::new_tcp(free_tcp());
    let started = Instant::now();
    let results = run_ranks(&id, world, Duration::from_secs(10), |rank, rdv| {
        rdv.all_gather(b"first").unwrap();
        if rank == 2 {
            drop(rdv); // "crashes": its socket closes
            return Ok(Vec::new());
        }
        rdv.all_gather(b"second")
    });
    let e0 = results[0].as_ref().unwrap().as_ref().unwrap_err().to_string();
    let e1 = results[1].as_ref().unwrap().as_ref().unwrap_err().to_string();
    assert!(e0.contains("rank 2"), "rank 0: {e0}");
    assert!(e1.contains("rank 2") && e1.contains("aborted"), "rank 1: {e1}");
    assert!(started.elapsed() < Duration::from_secs(5), "must not wait for the timeout");
}

#[test]
fn unix_socket_is_private_and_removed() {
    let id = Id::new_unix().unwrap();
    let Endpoint::Unix(sock) = id.endpoint().clone() else { unreachable!() };
    let dir = sock.parent().unwrap().to_path_buf();
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    let results = run_ranks(&id, 2, Duration::from_secs(5), |rank, rdv| {
        if rank == 0 {
            let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "socket mode {mode:o}");
        }
        rdv.barrier().unwrap();
        rdv.barrier().unwrap();
    });
    for r in results {
        r.unwrap();
    }
    assert!(!sock.exists(), "socket left behind");
    assert!(!dir.exists(), "directory left behind");
}

#[test]
fn oversized_contribution_is_refused_locally() {
    let id = Id::new_tcp(free_tcp());
    let results = run_ranks(&id, 2, Duration::from_secs(5), |_, rdv| {
        rdv.all_gather(&vec![0u8; wire::MAX_CONTRIBUTION + 1]).is_err()
    });
    for r in results {
        assert!(r.unwrap());
    }
}

#[test]
fn in_process_rounds_missing_and_leaving_ranks() {
    let group = in_process_group(4, Duration::from_secs(5));
    let out: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .map(|r| s.spawn(move || (0..5).map(|k| r.all_gather(&payload(r.rank(), k)).unwrap()).collect::<Vec<_>>()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for per_rank in out {
        for (k, all) in per_rank.iter().enumerate() {
            for (r, got) in all.iter().enumerate() {
                assert_eq!(got, &payload(r, k));
            }
        }
    }
    // Rank 2 never arrives: the others time out naming it.
    let group = in_process_group(3, Duration::from_millis(300));
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = group[..2].iter().map(|r| s.spawn(move || r.barrier().unwrap_err().to_string())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(e.contains("[2]"), "{e}");
    }
    // Rank 1 leaves (dropped): the others fail fast, not after the timeout.
    let mut group = in_process_group(3, Duration::from_secs(30));
    let one = group.remove(1);
    let started = Instant::now();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = group.iter().map(|r| s.spawn(move || r.barrier().unwrap_err().to_string())).collect();
        std::thread::sleep(Duration::from_millis(100));
        drop(one);
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(started.elapsed() < Duration::from_secs(5));
    for e in errs {
        assert!(e.contains("left the group"), "{e}");
    }
}

#[test]
fn header_size_matches_the_encoding() {
    let f = Frame { kind: Kind::Welcome, job: [3; 16], sender: 5, round: 9, payload: Vec::new() };
    let bytes = wire::encode(&f);
    assert_eq!(bytes.len(), wire::HEADER_BYTES);
    assert_eq!(wire::read_frame(&mut &bytes[..], &[3; 16]).unwrap(), f);
    let parts = vec![Vec::new(), b"ab".to_vec(), vec![7; 300]];
    assert_eq!(wire::decode_contributions(&wire::encode_contributions(&parts), 3).unwrap(), parts);
    assert!(wire::decode_contributions(&wire::encode_contributions(&parts), 4).is_err());
    let mut truncated = wire::encode_contributions(&parts);
    truncated.pop();
    assert!(wire::decode_contributions(&truncated, 3).is_err());
}
