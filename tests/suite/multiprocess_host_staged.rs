//! Host-staged graph replays across processes (issue 13 item 8, suspected):
//! posted writes to host memory are not obviously ordered by kernel
//! boundaries alone, so a OneShotPush re-arm of receive buffers could land
//! after the next kernel's payload, and a two-shot or ring generation
//! could be reused early. If so, a replayed graph of many back-to-back
//! allreduces gives a wrong sum or a timeout. Two processes run `selftest`
//! over the host-staged transport with 1000 replays per algorithm of a
//! graph of 50 allreduces (one elementwise kernel between each), inputs
//! changed every replay and every allreduce's output checked against the
//! f64 reference (and bitwise across ranks).

use crate::common;
use crate::multiprocess::{bin, launch, placement, scratch_dir, text};

const REPLAYS: usize = 1000;
const ALGORITHMS: [&str; 3] = ["one-shot-push", "two-shot-push", "ring"];

#[test]
fn host_staged_graph_replays_across_processes() {
    let test = "host_staged_graph_replays_across_processes";
    let _lock = common::gpu_lock();
    let Some(place) = placement(test, 2) else { return };
    let exe = bin();
    let dir = scratch_dir("staged-replays");
    let replays = REPLAYS.to_string();
    let algorithms = ALGORITHMS.join(",");
    let o = launch(
        &[
            "-n",
            "2",
            "--gpus",
            &place.gpus,
            "--grace",
            "20",
            "--timeout",
            "540",
            "--",
            exe.to_str().unwrap(),
            "selftest",
            "--quick",
            "--algorithms",
            &algorithms,
            "--replays",
            &replays,
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
    let want = format!("{} graph replays", REPLAYS * ALGORITHMS.len());
    for r in 0..2 {
        let prefix = format!("[rank {r}] rank {r}");
        assert!(out.contains(&format!("{prefix}/2: device")) && out.contains("transport host-staged"), "{out}");
        let passed = out
            .lines()
            .find(|l| l.starts_with(&format!("{prefix}: selftest passed")))
            .unwrap_or_else(|| panic!("rank {r} did not pass:\n{out}"));
        assert!(passed.contains(&want), "rank {r} did not run {want}: {passed}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
