//! Several processes, one rank each, started by `tp-allreduce launch`:
//! cross-process rendezvous (CPU), the launcher's failure reporting (CPU),
//! the allreduce over CUDA IPC with eager and graph paths (GPU), and the
//! SIGKILL fault test (GPU). Ranks sharing one GPU need MPS (without it two
//! contexts time-slice and a round trip costs ~5 ms); those tests skip
//! visibly without it, and `TP_ALLREDUCE_REQUIRE_MPS=1` makes that a failure.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common;

/// The CLI binary (`TP_ALLREDUCE_BIN` overrides the build-time path, for
/// test binaries copied to another machine).
pub(crate) fn bin() -> PathBuf {
    std::env::var_os("TP_ALLREDUCE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tp-allreduce")))
}

pub(crate) fn launch(args: &[&str], env: &[(&str, &str)]) -> Output {
    let exe = bin();
    let mut cmd = Command::new(&exe);
    cmd.arg("launch").args(args);
    // Each launched rank uses one stream. Under MPS the device connections
    // of all clients share one cap, and this test process already holds 32
    // (set for the in-process tests): inheriting 32 per rank exhausts it
    // (CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED with four ranks).
    cmd.env("CUDA_DEVICE_MAX_CONNECTIONS", "2");
    // Measured `auto` is not what these tests check (seconds per start).
    if std::env::var_os(tp_allreduce::env::AUTO_MEASURE).is_none() {
        cmd.env(tp_allreduce::env::AUTO_MEASURE, "off");
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap_or_else(|e| panic!("running {}: {e}", exe.display()))
}

pub(crate) fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A private runtime directory so leftovers are visible.
pub(crate) fn scratch_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn launched_processes_rendezvous() {
    let dir = scratch_dir("probe");
    let exe = bin();
    let o = launch(
        &["-n", "4", "--", exe.to_str().unwrap(), "probe-rendezvous", "--rounds", "25"],
        &[("XDG_RUNTIME_DIR", dir.to_str().unwrap())],
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for r in 0..4 {
        assert!(out.contains(&format!("[rank {r}] rank {r}: 25 rendezvous rounds across 4 processes ok")), "{out}");
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "rendezvous files left behind");
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn launcher_names_a_killed_rank_and_does_not_hang() {
    let started = Instant::now();
    let o = launch(
        &[
            "-n",
            "3",
            "--grace",
            "2",
            "--",
            "sh",
            "-c",
            "if [ \"$TP_ALLREDUCE_RANK\" = 1 ]; then kill -9 $$; fi; sleep 30",
        ],
        &[],
    );
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("rank 1 failed (killed by signal 9 (SIGKILL))"), "{out}");
    assert!(out.contains("killed rank 0") && out.contains("killed rank 2"), "{out}");
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
}

/// Where the ranks of a multi-process test run: `world` ranks over the
/// first `min(world, visible GPUs)` GPUs (the launcher places rank r on
/// `gpus[r % len]`), so the expected world never depends on how many GPUs
/// the machine has.
pub(crate) struct Placement {
    pub gpus: String,
    pub ranks_per_gpu: usize,
}

/// The placement of `world` ranks, or `None` (after a visible skip line)
/// when they cannot run here: no GPU, or ranks that must share a GPU and no
/// MPS (several processes on one GPU time-slice without it: ~4.6 ms per
/// flag round trip). `TP_ALLREDUCE_REQUIRE_MPS=1` turns the MPS skip into a
/// failure.
pub(crate) fn placement(test: &str, world: usize) -> Option<Placement> {
    common::gpu(test)?;
    let gpus = tp_allreduce::driver::device_count().clamp(1, world);
    let ranks_per_gpu = world.div_ceil(gpus);
    if ranks_per_gpu > 1 && std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_none() {
        if std::env::var("TP_ALLREDUCE_REQUIRE_MPS").as_deref() == Ok("1") {
            panic!(
                "{test}: {world} processes on {gpus} GPU(s) need MPS, but TP_ALLREDUCE_REQUIRE_MPS=1 and \
                 CUDA_MPS_PIPE_DIRECTORY is unset"
            );
        }
        common::skipped(&format!("{world} processes on {gpus} GPU(s) need MPS ({test})"));
        return None;
    }
    Some(Placement { gpus: (0..gpus).map(|g| g.to_string()).collect::<Vec<_>>().join(","), ranks_per_gpu })
}

/// Selftest of `n` launched processes (islands of `islands` ranks when
/// given): eager, graph, registration rounds over IPC.
fn selftest(test: &str, n: usize, islands: Option<&str>) {
    let _lock = common::gpu_lock();
    let Some(place) = placement(test, n) else { return };
    let exe = bin();
    let dir = scratch_dir(&format!("selftest{n}"));
    let world = n.to_string();
    let mut args = vec![
        "-n",
        &world,
        "--gpus",
        &place.gpus,
        "--grace",
        "20",
        "--timeout",
        "280",
        "--",
        exe.to_str().unwrap(),
        "selftest",
        "--quick",
    ];
    if let Some(m) = islands {
        args.extend(["--island-size", m]);
    }
    let o = launch(&args, &[("XDG_RUNTIME_DIR", dir.to_str().unwrap()), ("TP_ALLREDUCE_TIMEOUT_MS", "3000")]);
    let out = text(&o);
    eprintln!("{out}");
    assert!(o.status.success(), "{n} processes:\n{out}");
    for r in 0..n {
        assert!(out.contains(&format!("[rank {r}] rank {r}: selftest passed")), "rank {r} did not pass:\n{out}");
        // Register -> use -> deregister -> free, three times, over IPC.
        let passed = out.lines().find(|l| l.starts_with(&format!("[rank {r}] rank {r}: selftest passed"))).unwrap();
        assert!(passed.contains(" 3 registration rounds"), "rank {r} ran no registration rounds: {passed}");
        // The case that once read stale data: a new buffer at a freed
        // registered address (the allocator reused them on the H200).
        let reused: usize = passed
            .split("registration rounds (")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no reuse count in: {passed}"));
        assert!(reused >= 1, "no round reused a freed address, so the stale case never ran: {passed}");
    }
    // Pull algorithms registered their captured inputs over IPC.
    assert!(!out.contains("skipped:"), "{out}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "rendezvous files left behind");
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn multi_process_selftest_2_ranks() {
    selftest("multi_process_selftest_2_ranks", 2, None);
}

#[test]
fn multi_process_selftest_4_ranks_in_islands_of_2() {
    selftest("multi_process_selftest_4_ranks_in_islands_of_2", 4, Some("2"));
}

#[test]
fn sigkill_of_one_rank_fails_the_others_cleanly() {
    let _lock = common::gpu_lock();
    let Some(place) = placement("sigkill_of_one_rank_fails_the_others_cleanly", 4) else { return };
    let exe = bin();
    let gpus = place.gpus;
    let dir = scratch_dir("fault");
    let started = Instant::now();
    let o = launch(
        &[
            "-n",
            "4",
            "--gpus",
            &gpus,
            "--grace",
            "30",
            "--timeout",
            "120",
            "--",
            exe.to_str().unwrap(),
            "selftest",
            "--quick",
            "--fault",
            "2:7",
        ],
        &[("XDG_RUNTIME_DIR", dir.to_str().unwrap()), ("TP_ALLREDUCE_TIMEOUT_MS", "2000")],
    );
    let out = text(&o);
    eprintln!("{out}");
    let elapsed = started.elapsed();
    assert!(out.contains("rank 2 failed (killed by signal 9 (SIGKILL))"), "{out}");
    for r in [0, 1, 3] {
        assert!(
            out.contains(&format!("[rank {r}] rank {r}: survived the fault")),
            "rank {r} did not fail cleanly:\n{out}"
        );
        assert!(out.contains(&format!("launch: rank {r}: exit code 0")), "rank {r} did not exit cleanly:\n{out}");
    }
    assert!(!out.contains("killed by the launcher"), "a survivor hung:\n{out}");
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "rendezvous files left behind");
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn multi_process_host_staged_transport() {
    let _lock = common::gpu_lock();
    let Some(place) = placement("multi_process_host_staged_transport", 2) else { return };
    let exe = bin();
    let gpus = place.gpus;
    let dir = scratch_dir("staged");
    let o = launch(
        &[
            "-n",
            "2",
            "--gpus",
            &gpus,
            "--grace",
            "20",
            "--timeout",
            "200",
            "--",
            exe.to_str().unwrap(),
            "selftest",
            "--quick",
            "--algorithms",
            "one-shot-push,two-shot-push,ring",
        ],
        &[
            ("XDG_RUNTIME_DIR", dir.to_str().unwrap()),
            ("TP_ALLREDUCE_TRANSPORT", "host-staged"),
            ("TP_ALLREDUCE_TIMEOUT_MS", "3000"),
        ],
    );
    let out = text(&o);
    eprintln!("{out}");
    assert!(o.status.success(), "{out}");
    for r in 0..2 {
        assert!(
            out.contains(&format!("[rank {r}] rank {r}/2: device")) && out.contains("transport host-staged"),
            "{out}"
        );
        assert!(out.contains(&format!("[rank {r}] rank {r}: selftest passed")), "{out}");
    }
    // The shared-memory regions were unlinked once every rank had mapped them.
    let leftovers: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("tpar-")).count())
        .into_iter()
        .collect();
    assert_eq!(leftovers.iter().sum::<usize>(), 0, "shared memory left in /dev/shm");
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn bench_with_one_process_per_rank() {
    let _lock = common::gpu_lock();
    let Some(place) = placement("bench_with_one_process_per_rank", 2) else { return };
    let exe = bin();
    let ranks_per_gpu = place.ranks_per_gpu.to_string();
    let dir = scratch_dir("bench");
    let out_dir = dir.join("out");
    let o = Command::new(&exe)
        .args([
            "bench",
            "--processes",
            "--gpus",
            &place.gpus,
            "--ranks-per-gpu",
            &ranks_per_gpu,
            "--sizes",
            "4K,42K,16M,32M",
            "--algorithms",
            "auto,one-shot-pull,two-shot-push",
            "--repeats",
            "3",
            "--iterations",
            "10",
            "--out",
            out_dir.to_str().unwrap(),
        ])
        .env("CUDA_DEVICE_MAX_CONNECTIONS", "2")
        .env("XDG_RUNTIME_DIR", dir.to_str().unwrap())
        .output()
        .expect("bench runs");
    let out = text(&o);
    eprintln!("{out}");
    assert!(o.status.success(), "{out}");
    let rep = tp_allreduce_cli::bench::report::read_json(&out_dir.join("results.json")).expect("results.json");
    assert_eq!(rep.world, 2);
    assert_eq!(rep.measurements.len(), 12, "4 sizes x 3 selections");
    assert!(rep.measurements.iter().all(|m| m.median_us > 0.0 && m.median_us.is_finite()));
    assert_eq!(rep.verify_pass.len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer that starts its first call late (first-call
/// JIT, model-load skew) is waited for within `launch_timeout`, not the
/// stall `timeout`: with a 1 s timeout, rank 1 starts 3 s late and both
/// ranks pass. (With one bound for both, as before, rank 0 timed out.)
#[test]
fn a_peer_starting_late_is_waited_for_within_the_launch_bound() {
    let test = "a_peer_starting_late_is_waited_for_within_the_launch_bound";
    let _lock = common::gpu_lock();
    let Some(place) = placement(test, 2) else { return };
    let exe = bin();
    let dir = scratch_dir("skew");
    let o = launch(
        &[
            "-n",
            "2",
            "--gpus",
            &place.gpus,
            "--grace",
            "20",
            "--timeout",
            "120",
            "--",
            exe.to_str().unwrap(),
            "selftest",
            "--quick",
            "--algorithms",
            "one-shot-pull,one-shot-push",
            "--replays",
            "1",
            "--delay-first-call",
            "1:3000",
        ],
        &[("XDG_RUNTIME_DIR", dir.to_str().unwrap()), ("TP_ALLREDUCE_TIMEOUT_MS", "1000")],
    );
    let out = text(&o);
    eprintln!("{out}");
    assert!(out.contains("[rank 1] rank 1: delaying the first call by 3s"), "{out}");
    assert!(o.status.success(), "{out}");
    for r in 0..2 {
        assert!(out.contains(&format!("[rank {r}] rank {r}: selftest passed")), "rank {r} did not pass:\n{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A context limited to a fifth of the SMs (an MPS client with
/// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20`): the residency caps come from the
/// context's SM count, so 4 ranks in one process (islands 2+2) at 4 MB
/// finish with every algorithm that runs there, checked by the bench. With
/// caps from the whole GPU, a rank's blocks wait for blocks that never fit
/// (issue 35 item 2). Needs MPS (the limit is a client setting).
#[test]
fn a_limited_sm_context_sizes_its_grids_to_its_sms() {
    let test = "a_limited_sm_context_sizes_its_grids_to_its_sms";
    let _lock = common::gpu_lock();
    if common::gpu(test).is_none() {
        return;
    }
    if std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_none() {
        if std::env::var("TP_ALLREDUCE_REQUIRE_MPS").as_deref() == Ok("1") {
            panic!("{test}: needs MPS, but TP_ALLREDUCE_REQUIRE_MPS=1 and CUDA_MPS_PIPE_DIRECTORY is unset");
        }
        common::skipped(&format!("needs MPS for an SM-limited client ({test})"));
        return;
    }
    let args = [
        "bench",
        "--gpus",
        "0",
        "--ranks-per-gpu",
        "4",
        "--island-size",
        "2",
        "--sizes",
        "4M",
        "--repeats",
        "3",
        "--no-verify-pass",
        "--algorithms",
        "two-shot-push,hierarchical,pipelined-hierarchical,one-shot-push,one-shot-pull,two-shot-pull",
    ];
    let out = Command::new(bin())
        .args(args)
        .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "20")
        .env("CUDA_DEVICE_MAX_CONNECTIONS", "8")
        .env("TP_ALLREDUCE_LAUNCH_TIMEOUT_MS", "15000")
        .output()
        .expect("the tp-allreduce binary runs");
    let all = text(&out);
    assert!(out.status.success(), "{test}: bench failed in a 20% SM client:\n{all}");
    for algorithm in ["two-shot-push", "hierarchical", "one-shot-push"] {
        assert!(all.contains(algorithm), "{test}: no row for {algorithm}:\n{all}");
    }
    eprintln!("{test}: ok");
}
