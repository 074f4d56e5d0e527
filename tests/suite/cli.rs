//! The `tp-allreduce` binary as a newcomer meets it (no GPU needed): bad
//! arguments are errors before anything runs, `bench` without a GPU plans
//! what was asked, `plan` honours TP_ALLREDUCE_TOPOLOGY and refuses
//! impossible worlds, a closed stdout is not a panic. Also the CI script
//! that counts skipped tests.

use std::io::Read;
use std::process::{Command, Output, Stdio};

fn tp_allreduce(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(crate::multiprocess::bin());
    cmd.args(args).env_remove("TP_ALLREDUCE_TOPOLOGY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the tp-allreduce binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// No GPU visible to the child, whatever this machine has.
const NO_GPU: (&str, &str) = ("CUDA_VISIBLE_DEVICES", "");

#[test]
fn bad_bench_arguments_fail_before_anything_runs() {
    for (args, needle) in [
        (&["bench", "--sizes", "12Q"][..], "bad size"),
        (&["bench", "--ranks-per-gpu", "0"], "at least 1"),
        (&["bench", "--algorithms", "frobnicate"], "frobnicate"),
        (&["bench", "--mode", "lazy"], "lazy"),
        (&["plan", "--world", "0"], "at least 1"),
    ] {
        let out = tp_allreduce(args, &[NO_GPU]);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = text(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?} printed to stdout: {}", text(&out.stdout));
    }
}

#[test]
fn bench_without_a_gpu_plans_what_was_asked() {
    let args = ["bench", "--sizes", "4K,42K", "--dtype", "f16", "--ranks-per-gpu", "4", "--gpus", "0,1"];
    let out = tp_allreduce(&args, &[NO_GPU]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}{stdout}", text(&out.stderr));
    assert!(stdout.starts_with("no CUDA device"), "{stdout}");
    assert!(stdout.contains("8 ranks") && stdout.contains("f16"), "{stdout}");
    let sizes: Vec<&str> = stdout.lines().filter(|l| l.contains(" KiB ") && l.contains(" | ")).collect();
    assert!(sizes.iter().any(|l| l.trim_start().starts_with("4 KiB")), "{stdout}");
    assert!(!stdout.contains("8 MiB"), "only the sizes asked for: {stdout}");
    // Ranks share GPUs: no NCCL speedups.
    assert!(stdout.contains("unavailable (ranks share a GPU)"), "{stdout}");
    let out = tp_allreduce(&["bench", "--gpus", "0,1", "--ranks-per-gpu", "8"], &[NO_GPU]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("at most 8 ranks"), "{}", text(&out.stderr));
}

#[test]
fn plan_takes_the_topology_from_the_environment_and_refuses_bogus_ones() {
    let out = tp_allreduce(&["plan"], &[("TP_ALLREDUCE_TOPOLOGY", "l40s-8x-pcie4")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("tp-allreduce plan: 8 ranks on l40s-8x-pcie4"), "{}", text(&out.stdout));
    let out = tp_allreduce(&["plan"], &[("TP_ALLREDUCE_TOPOLOGY", "dgx-9000")]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("dgx-9000") && err.contains("rtx-pro-6000-8x-pcie5-2socket"), "{err}");
    // --topology wins over the environment.
    let out = tp_allreduce(&["plan", "--topology", "h200-8x-nvswitch"], &[("TP_ALLREDUCE_TOPOLOGY", "dgx-9000")]);
    assert!(text(&out.stdout).contains("h200-8x-nvswitch"), "{}", text(&out.stderr));
}

#[test]
fn plan_refuses_worlds_larger_than_the_topology_and_stays_narrow() {
    let out = tp_allreduce(&["plan", "--world", "16"], &[]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("has 8"), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty());
    let out = tp_allreduce(&["plan"], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success());
    let wide: Vec<&str> = stdout.lines().filter(|l| l.chars().count() > 120).collect();
    assert!(wide.is_empty(), "{wide:#?}");
}

/// A results file whose table is larger than a pipe's buffer.
fn large_results_file() -> std::path::PathBuf {
    use tp_allreduce_cli::bench::report::{write_json, Report};
    use tp_allreduce_cli::bench::stats::{measurement, RowKey};
    use tp_allreduce_cli::bench::Mode;
    let measurements = (1..4000)
        .map(|i| {
            let key = RowKey {
                bytes: i * 64,
                dtype: tp_allreduce::DType::Bf16,
                selection: "auto",
                ran: "one-shot-push",
                world: 8,
                mode: Mode::Graph,
            };
            measurement(key, &mut [5.0 + i as f64])
        })
        .collect();
    let r = Report { world: 8, mode: "graph".into(), measurements, ..Report::default() };
    let path = std::env::temp_dir().join(format!("tp-allreduce-cli-{}.json", std::process::id()));
    write_json(&r, &path).unwrap();
    path
}

#[test]
fn report_into_a_closed_pipe_stops_quietly() {
    let path = large_results_file();
    let mut child = Command::new(crate::multiprocess::bin())
        .arg("report")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one line's worth, then close the pipe (what `| head -1` does).
    let mut first = [0u8; 64];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(status.success(), "{status}: {stderr}");
    // And into an open pipe, every row arrives.
    let path = large_results_file();
    let out = tp_allreduce(&["report", path.to_str().unwrap()], &[]);
    std::fs::remove_file(&path).unwrap();
    assert!(out.status.success());
    assert!(text(&out.stdout).lines().count() > 3999);
}

#[test]
fn the_test_script_counts_distinct_skipped_tests() {
    let log = std::env::temp_dir().join(format!("tp-allreduce-skips-{}.log", std::process::id()));
    std::fs::write(
        &log,
        "skipped: no CUDA device (gpu_a)\nskipped: no CUDA device (gpu_a)\ntest gpu_a ... ok\n\
         skipped: several processes on one GPU need MPS (mp_b)\nskipped: ptxas not found\n\
         test mp_c ... skipped: 4 processes on 2 GPU(s) need MPS (mp_c)\nok\n",
    )
    .unwrap();
    let script = crate::common::repo().join(".ci/count-skips");
    let out = Command::new("bash").arg(script).arg(&log).output().unwrap();
    std::fs::remove_file(&log).unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "4");
}

#[test]
fn the_main_script_says_it_is_building_before_it_builds() {
    let script = std::fs::read_to_string(crate::common::repo().join(".ci/main.sh")).unwrap();
    let said = script.find("echo \"main.sh: building").expect("a line saying what is built");
    let built = script.find("cargo build --release").expect("the build");
    assert!(said < built);
    assert!(!script.contains("--quiet"), "the first build must not be silent");
}

/// `bench` checks each call against the algorithm that ran it: with
/// islands, `auto` picks another algorithm for an eager call (hierarchical,
/// two roundings) than for a graph (a pull, one rounding), and the check of
/// the eager call used the graph's rounding count (issue 35 item 3: "check
/// failed for one-shot-pull ... -2.28125 but the sum is -2.26953125").
/// Ranks share GPU 0 in one process; graph and eager modes; 4 ranks (2+2)
/// and 8 ranks (4+4) with every algorithm.
#[test]
fn bench_checks_each_call_against_the_algorithm_that_ran() {
    let _gpu = crate::common::gpu_lock();
    if crate::common::gpu("bench_checks_each_call_against_the_algorithm_that_ran").is_none() {
        return;
    }
    let cases: [&[&str]; 4] = [
        &["--ranks-per-gpu", "4", "--island-size", "2", "--sizes", "256K", "--algorithms", "auto"],
        &["--ranks-per-gpu", "4", "--island-size", "2", "--sizes", "256K", "--algorithms", "auto", "--mode", "eager"],
        &["--ranks-per-gpu", "8", "--island-size", "4", "--sizes", "42K,256K,1M", "--algorithms", "all"],
        &[
            "--ranks-per-gpu",
            "8",
            "--island-size",
            "4",
            "--sizes",
            "42K,256K,1M",
            "--algorithms",
            "all",
            "--mode",
            "eager",
        ],
    ];
    for case in cases {
        let mut args = vec!["bench", "--gpus", "0", "--repeats", "3", "--no-verify-pass"];
        args.extend_from_slice(case);
        // No tuning table: `auto` is the model's choice, as for a new user.
        let out = tp_allreduce(&args, &[("TP_ALLREDUCE_TUNING_FILE", "/nonexistent/tp-allreduce-tuning.toml")]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "bench {case:?} failed:\n{stderr}\n{stdout}");
        assert!(!stderr.contains("correctness check failed"), "{case:?}: {stderr}");
        eprintln!("bench {case:?}: ok");
    }
}

#[test]
fn the_main_script_says_first_and_last_when_nothing_is_measured() {
    let script = std::fs::read_to_string(crate::common::repo().join(".ci/main.sh")).unwrap();
    let first = script.find("echo \"main.sh: $no_gpu_note\"").expect("the no-GPU note said up front");
    let tools = script.find("bash .ci/tools.sh").expect("the tools step");
    assert!(first < tools, "the no-GPU note must come before the tools' and the build's output");
    let bench = script.find("tp-allreduce bench \"$@\"").expect("the bench");
    let plan_line = script.rfind("main.sh: done: no CUDA device").expect("a closing line without a GPU");
    let measured_line = script.rfind("main.sh: done: measured").expect("a closing line with GPUs");
    assert!(bench < plan_line && bench < measured_line, "the closing lines come after the bench");
    assert!(!script.contains("exec target/release/tp-allreduce"), "an exec'd bench leaves no room for a closing line");
}

#[test]
fn the_log_filter_comes_from_the_environment_and_a_bad_one_is_an_error() {
    // The tool writes the library's log records (measured `auto`'s lines)
    // on stderr under TP_ALLREDUCE_LOG; a filter it cannot read stops it
    // before anything runs, naming the variable.
    let out = tp_allreduce(&["plan", "--world", "2"], &[NO_GPU, ("TP_ALLREDUCE_LOG", "tp_allreduce=loud")]);
    assert!(!out.status.success(), "a bad filter was accepted: {}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("TP_ALLREDUCE_LOG") && err.contains("loud"), "{err}");
    for good in ["debug", "tp_allreduce::comm=debug,warn", "off"] {
        let out = tp_allreduce(&["plan", "--world", "2"], &[NO_GPU, ("TP_ALLREDUCE_LOG", good)]);
        assert!(out.status.success(), "{good}: {}", text(&out.stderr));
    }
}
