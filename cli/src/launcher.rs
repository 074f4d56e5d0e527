//! Starting one process per rank on this host: `tp-allreduce launch -n N --
//! <command>` and the environment contract the ranks read.
//!
//! Every rank gets `TP_ALLREDUCE_RANK`, `TP_ALLREDUCE_WORLD_SIZE`,
//! `TP_ALLREDUCE_ID` (the rendezvous id, created here) and
//! `TP_ALLREDUCE_DEVICE` (the CUDA ordinal it should use). Output lines are
//! prefixed with `[rank r]`. If a rank fails (non-zero exit or a signal),
//! the launcher says which and how, gives the others `grace` to notice
//! (their collectives fail within the communicator's timeout) and then
//! kills what is left, so a launch never hangs.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use tp_allreduce::env;
use tp_allreduce::error::{Error, Result};
use tp_allreduce::rendezvous::Id;

/// How a rank ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankOutcome {
    pub rank: usize,
    pub status: String,
    pub success: bool,
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}{}", if s == 9 { " (SIGKILL)" } else { "" }),
        _ => "unknown status".into(),
    }
}

/// SIGKILL to the rank's process group, then reap it.
fn kill_group(child: &mut Child) {
    // The child leads the group the launcher created for it (`process_group(0)`).
    let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
    let _ = child.kill();
    let _ = child.wait();
}

/// Options of [`launch`].
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    pub world_size: usize,
    /// CUDA ordinals, assigned round-robin (empty: all ranks on device 0).
    pub gpus: Vec<usize>,
    /// After a rank fails, how long the others get before they are killed.
    pub grace: Duration,
    /// Whole-launch bound (None: unbounded).
    pub timeout: Option<Duration>,
}

/// Runs `command` once per rank and waits for all. Returns every rank's
/// outcome; `Err` only when processes could not be started.
pub fn launch(opts: &LaunchOptions, command: &[String]) -> Result<Vec<RankOutcome>> {
    if command.is_empty() {
        return Err(Error::invalid("launch: no command given"));
    }
    if opts.world_size == 0 || opts.world_size > tp_allreduce_kernels::layout::MAX_RANKS {
        return Err(Error::invalid(format!("launch: -n must be in 1..={}", tp_allreduce_kernels::layout::MAX_RANKS)));
    }
    let id = Id::new_unix()?;
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut printers = Vec::new();
    for rank in 0..opts.world_size {
        match spawn_rank(opts, command, &id, rank) {
            Ok((child, mut threads)) => {
                children.push(Some(child));
                printers.append(&mut threads);
            }
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    kill_group(c);
                }
                return Err(e);
            }
        }
    }
    let outcomes = wait_all(opts, &mut children);
    for p in printers {
        let _ = p.join();
    }
    // Rank 0 removes its socket; after a crash the launcher does.
    id.remove_files();
    Ok(outcomes)
}

/// Starts rank `rank` with its environment, and the threads that forward
/// its output prefixed with `[rank r]`.
fn spawn_rank(
    opts: &LaunchOptions,
    command: &[String],
    id: &Id,
    rank: usize,
) -> Result<(Child, Vec<std::thread::JoinHandle<()>>)> {
    let device = if opts.gpus.is_empty() { 0 } else { opts.gpus[rank % opts.gpus.len()] };
    // Each rank leads its own process group so that killing it also
    // kills whatever it started (which may hold its output pipes).
    let mut child = Command::new(&command[0])
        .args(&command[1..])
        .process_group(0)
        .env(env::RANK, rank.to_string())
        .env(env::WORLD_SIZE, opts.world_size.to_string())
        .env(env::ID, id.to_string())
        .env(env::DEVICE, device.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("starting rank {rank}: {}", command[0]), e))?;
    let mut threads = Vec::new();
    if let Some(out) = child.stdout.take() {
        threads.push(forward(out, rank, std::io::stdout));
    }
    if let Some(err) = child.stderr.take() {
        threads.push(forward(err, rank, std::io::stderr));
    }
    Ok((child, threads))
}

/// Copies `from` line by line to `to()` with the rank prefix; stops
/// quietly when the destination is closed (`launch ... | head`).
fn forward<R: std::io::Read + Send + 'static, W: Write + 'static>(
    from: R,
    rank: usize,
    to: fn() -> W,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(|l| l.ok()) {
            if writeln!(to(), "[rank {rank}] {line}").is_err() {
                break;
            }
        }
    })
}

/// Polls every rank until all ended; after the first failure the others
/// get `grace`, and the whole launch `timeout`, before they are killed.
fn wait_all(opts: &LaunchOptions, children: &mut [Option<Child>]) -> Vec<RankOutcome> {
    let started = Instant::now();
    let mut outcomes: Vec<Option<RankOutcome>> = vec![None; children.len()];
    let mut first_failure: Option<Instant> = None;
    while outcomes.iter().any(|o| o.is_none()) {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else { continue };
            if let Ok(Some(status)) = child.try_wait() {
                let success = status.success();
                if !success && first_failure.is_none() {
                    first_failure = Some(Instant::now());
                    eprintln!(
                        "launch: rank {rank} failed ({}); the other ranks have {:?} to finish",
                        describe(status),
                        opts.grace
                    );
                }
                outcomes[rank] = Some(RankOutcome { rank, status: describe(status), success });
                *slot = None;
            }
        }
        let overdue = first_failure.is_some_and(|t| t.elapsed() > opts.grace)
            || opts.timeout.is_some_and(|t| started.elapsed() > t);
        if overdue {
            for (rank, slot) in children.iter_mut().enumerate() {
                if let Some(child) = slot.as_mut() {
                    kill_group(child);
                    eprintln!("launch: killed rank {rank} (did not finish in time)");
                    outcomes[rank] =
                        Some(RankOutcome { rank, status: "killed by the launcher".into(), success: false });
                    *slot = None;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    outcomes.into_iter().flatten().collect()
}
