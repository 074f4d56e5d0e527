//! `tp-allreduce bench` in one process: every rank a stream of this
//! process, the size sweep (ours and NCCL on the same buffers), then the
//! scenarios, into one [`Report`].
#![forbid(unsafe_code)]

use super::collective::{nccl_group, our_group, CommGroup, NcclGroup, OurGroup};
use super::progress::{total_steps, Progress};
use super::ranks::{Buffers, Ranks};
use super::report::{Report, VerifyPass};
use super::scenarios::{large_message_efficiency, launch_floor, verify_pass};
use super::stats::{measurement_of, set_speedups, Measurement, RowKey};
use super::timing::{time_collective, timed_mode};
use super::trace::{summarize, TraceSummary};
use super::{Mode, Options, Scenarios, Selection};
use crate::table::human_bytes;
use tp_allreduce::algorithm::Algorithm;
use tp_allreduce::comm::Comm;
use tp_allreduce::error::Result;
use tp_allreduce::nccl::NcclComm;
use tp_allreduce::Collective;

/// Runs the whole benchmark and returns the report.
pub fn run(opts: &Options, scenarios: &Scenarios, command_line: &str) -> Result<Report> {
    let ranks = Ranks::new(&opts.gpus, opts.ranks_per_gpu)?;
    let mut comms = our_group(&ranks, &opts.config)?;
    let topology_fingerprint = comms[0].topology().fingerprint();
    let mut notes: Vec<String> = comms[0].notes().to_vec();
    if opts.collective == Collective::AllReduce {
        notes.push(format!("auto selects (graph): {}", comms[0].selection().describe(opts.dtype, true)));
    } else {
        notes.push(format!("collective: {}; every size is one rank's block", opts.collective.name()));
        notes.push(format!(
            "auto selects (graph): {}",
            comms[0].collective_table().describe(opts.collective, opts.mode == Mode::Graph)
        ));
    }
    let nccl = match opts.include_nccl.then(|| nccl_group(&ranks)) {
        Some(Ok(n)) => Some(n),
        Some(Err(why)) => {
            notes.push(format!("NCCL column absent: {why}"));
            None
        }
        None => None,
    };
    if nccl.as_ref().is_some_and(|n| n.len() > 1) && opts.mode == Mode::Graph {
        notes.push("NCCL over several GPUs from one thread cannot be captured per rank: its rows are eager".into());
    }
    let selections = usable_selections(&mut comms[0], &opts.selections, &mut notes);
    let progress = Progress::new(total_steps(opts.sizes.len(), selections.len(), nccl.is_some(), scenarios));
    let mut measurements = Vec::new();
    let mut trace = Vec::new();
    for (i, &bytes) in opts.sizes.iter().enumerate() {
        let mut bufs = Buffers::for_collective(&ranks, opts.collective, bytes, opts.dtype, 0x5EED ^ (i as u64) << 20)?;
        measurements.extend(measure_size(
            &ranks,
            &mut comms,
            nccl.as_deref(),
            (&selections, &mut trace),
            &mut bufs,
            opts,
            &progress,
        )?);
    }
    for c in comms.iter_mut() {
        c.set_algorithm(None)?;
    }
    let mut verify = Vec::new();
    if scenarios.verify_pass {
        verify = verify_passes(&ranks, &comms, nccl.as_deref(), &progress, &mut notes)?;
    }
    let mut fused = Vec::new();
    if let Some(shape) = scenarios.fused {
        let f = fused_scenario(&ranks, &mut comms, (opts, scenarios, &selections), shape, &progress, &mut notes)?;
        fused = f.rows;
        verify.extend(f.verify_pass);
        trace.extend(f.trace);
    }
    drop(comms);
    let launch_floor_us = if scenarios.launch_floor {
        progress.step("launch floor");
        Some(launch_floor(&ranks)?)
    } else {
        None
    };
    let efficiency =
        if scenarios.efficiency { large_message_efficiency(&opts.gpus, &opts.config, &progress)? } else { Vec::new() };
    progress.finish();
    Ok(Report {
        topology_fingerprint,
        world: ranks.world(),
        ranks_per_gpu: opts.ranks_per_gpu,
        mode: opts.mode.name().into(),
        iterations: opts.iterations,
        repeats: opts.repeats,
        notes,
        measurements,
        verify_pass: verify,
        efficiency,
        launch_floor_us,
        trace,
        fused,
        ..Report::for_run("tp-allreduce bench", command_line, &ranks.contexts[0])
    })
}

/// The fused scenario (`--fused`) over `shape`, forced to the one
/// algorithm `--algorithms` names, if it names one.
fn fused_scenario(
    ranks: &Ranks,
    comms: &mut [Comm],
    (opts, scenarios, selections): (&Options, &Scenarios, &[Selection]),
    shape: (usize, usize),
    progress: &Progress,
    notes: &mut Vec<String>,
) -> Result<super::fused_epilogue_runs::FusedResults> {
    let forced = super::fused_forced(selections);
    for c in comms.iter_mut() {
        c.set_algorithm(forced)?;
    }
    match forced {
        Some(a) => notes.push(format!("fused scenario forced to {a} (--algorithms)")),
        None => {
            notes.push(format!("fused calls select (graph): {}", comms[0].fused_selection().describe(opts.dtype, true)))
        }
    }
    let f = super::fused_epilogue_runs::in_process(ranks, comms, opts, shape, scenarios.verify_pass, progress)?;
    for c in comms.iter_mut() {
        c.set_algorithm(None)?;
    }
    if opts.include_nccl {
        notes.push("fused scenario: nccl+separate runs with one process per rank (--processes)".into());
    }
    Ok(f)
}

/// The verify pass with `auto`, then with NCCL where it can be captured
/// per rank (else a note says why not).
fn verify_passes(
    ranks: &Ranks,
    comms: &[Comm],
    nccl: Option<&[NcclComm]>,
    progress: &Progress,
    notes: &mut Vec<String>,
) -> Result<Vec<VerifyPass>> {
    progress.step("verify pass (auto)");
    let mut verify = vec![verify_pass(&OurGroup { comms }, ranks, "auto")?];
    if let Some(n) = nccl {
        progress.step("verify pass (nccl)");
        let g = NcclGroup { comms: n, streams: &ranks.streams };
        if g.capturable_per_rank() {
            verify.push(verify_pass(&g, ranks, "nccl")?);
        } else {
            notes.push("verify pass: NCCL over several GPUs from one thread is not captured; use --processes".into());
        }
    }
    Ok(verify)
}

/// The selections this group can run (NCCL rows come from `include_nccl`);
/// each one skipped gets a note saying why.
pub(crate) fn usable_selections(comm: &mut Comm, wanted: &[Selection], notes: &mut Vec<String>) -> Vec<Selection> {
    let mut usable = Vec::new();
    for sel in wanted {
        match sel.forced() {
            Some(Algorithm::Nccl) => {}
            Some(a) => match comm.set_algorithm(Some(a)) {
                Ok(()) => usable.push(*sel),
                Err(e) => notes.push(format!("{a} skipped: {e}")),
            },
            None => usable.push(*sel),
        }
    }
    usable
}

/// Every selection's row at one size, then NCCL's (which sets the
/// speedups).
fn measure_size(
    ranks: &Ranks,
    comms: &mut [Comm],
    nccl: Option<&[NcclComm]>,
    (selections, trace): (&[Selection], &mut Vec<TraceSummary>),
    bufs: &mut Buffers,
    opts: &Options,
    progress: &Progress,
) -> Result<Vec<Measurement>> {
    let (bytes, dtype, world) = (bufs.bytes(), bufs.dtype, ranks.world());
    let mut rows = Vec::new();
    for sel in selections {
        for c in comms.iter_mut() {
            c.set_algorithm(sel.forced())?;
        }
        progress.step(&format!("{} {}", human_bytes(bytes), sel.name()));
        let group = OurGroup { comms };
        // The algorithm of the timed calls (graph or eager: `auto` may
        // choose differently for the two).
        let ran = group.describe(bufs.collective, bytes, dtype, timed_mode(&group, opts) == Mode::Graph);
        let mut samples = time_collective(&group, ranks, bufs, opts)?;
        let key = RowKey { bytes, dtype, selection: &sel.name(), ran: &ran, world, mode: opts.mode };
        rows.push(measurement_of(bufs.collective, key, &mut samples));
        for (r, c) in comms.iter().enumerate() {
            if let Some(records) = c.take_trace_records()? {
                trace.extend(summarize(&records, bytes, &sel.name(), r));
            }
        }
        settle();
    }
    if let Some(n) = nccl {
        progress.step(&format!("{} nccl", human_bytes(bytes)));
        let group = NcclGroup { comms: n, streams: &ranks.streams };
        let mut o = opts.clone();
        if !group.capturable_per_rank() {
            o.mode = Mode::Eager;
        }
        let mut samples = time_collective(&group, ranks, bufs, &o)?;
        let key = RowKey { bytes, dtype, selection: "nccl", ran: "nccl", world, mode: o.mode };
        let nccl_row = measurement_of(bufs.collective, key, &mut samples);
        set_speedups(&mut rows, &nccl_row);
        rows.push(nccl_row);
    }
    Ok(rows)
}

/// Sleeps briefly between configurations so clocks/thermals settle a bit.
fn settle() {
    std::thread::sleep(std::time::Duration::from_millis(5));
}
