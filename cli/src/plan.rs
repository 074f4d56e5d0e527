//! `tp-allreduce plan`: what the selection would do on a topology, with the
//! model's predictions against NCCL, the verify-pass scenario (the
//! motivating workload, see README.md) and the model's assumptions. Pure:
//! works without a GPU. `bench` falls back to it on a machine without one.
#![forbid(unsafe_code)]

use std::fmt::Write as _;

use tp_allreduce_kernels::ids::{Collective, DType};
use tp_allreduce_kernels::layout::MAX_RANKS;

use crate::bench::scenarios::{VERIFY_PASS_ALLREDUCES, VERIFY_PASS_BYTES};
use crate::{table, topology_view};
use tp_allreduce::algorithm::Algorithm;
use tp_allreduce::select::cost_model::{Basis, CostModel, CostParams, Options, ParamRow, WireSpec};
use tp_allreduce::select::measured::MeasuredCache;
use tp_allreduce::select::selection::{human_bytes, select_fused, select_with, CollectiveTable, Constraints};
use tp_allreduce::select::topology::{embedded, Topology};
use tp_allreduce::wire::{self as wire_emu, Distribution, Rng, WireFormat};

/// Sizes the report shows by default: 4 KiB .. 8 MiB doubling, plus 42 KiB.
pub fn report_sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (12..=23).map(|k| 1usize << k).collect();
    v.push(VERIFY_PASS_BYTES);
    v.sort_unstable();
    v
}

/// What to plan: ranks placed on GPUs of a (machine) topology.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    pub topology: Topology,
    /// The GPU of each rank.
    pub devices: Vec<usize>,
    pub dtype: DType,
    pub sizes: Vec<usize>,
    /// Graph replay (else eager calls).
    pub capturing: bool,
    /// The wire to plan for (`--wire`); lossy: the compressed-wire report.
    pub wire: WireFormat,
}

/// The machine topology: `name`, else `TP_ALLREDUCE_TOPOLOGY`, else the
/// default (the 8x RTX PRO 6000 PCIe machine). An unknown name is an error
/// that lists the embedded ones.
pub fn topology(name: Option<&str>) -> Result<Topology, String> {
    match name {
        Some(n) => embedded::by_name(n).map_err(|e| e.to_string()),
        None => Ok(embedded::from_env().map_err(|e| e.to_string())?.unwrap_or_else(embedded::default_topology)),
    }
}

impl PlanRequest {
    /// `world` ranks (default: every GPU), `ranks_per_gpu` on each of the
    /// first `world / ranks_per_gpu` GPUs; graph replay, the default sizes.
    pub fn for_world(
        topology: Topology,
        world: Option<usize>,
        ranks_per_gpu: usize,
        dtype: DType,
    ) -> Result<PlanRequest, String> {
        let rpg = ranks_per_gpu.max(1);
        let world = world.unwrap_or(topology.len() * rpg);
        if world == 0 {
            return Err("--world must be at least 1".into());
        }
        if world % rpg != 0 {
            return Err(format!("--world {world} is not a multiple of --ranks-per-gpu {rpg}"));
        }
        let gpus: Vec<usize> = (0..world / rpg).collect();
        Self::on_gpus(topology, &gpus, rpg, dtype)
    }

    /// `ranks_per_gpu` ranks on each of `gpus` of the topology.
    pub fn on_gpus(
        topology: Topology,
        gpus: &[usize],
        ranks_per_gpu: usize,
        dtype: DType,
    ) -> Result<PlanRequest, String> {
        let devices: Vec<usize> = gpus.iter().flat_map(|&g| std::iter::repeat_n(g, ranks_per_gpu.max(1))).collect();
        check_placement(&topology, gpus, devices.len())?;
        Ok(PlanRequest { topology, devices, dtype, sizes: report_sizes(), capturing: true, wire: WireFormat::Lossless })
    }

    pub fn world(&self) -> usize {
        self.devices.len()
    }
}

/// GPUs that exist, named once, and at most [`MAX_RANKS`] ranks.
fn check_placement(topology: &Topology, gpus: &[usize], ranks: usize) -> Result<(), String> {
    let n = topology.len();
    if gpus.len() > n {
        return Err(format!(
            "{} GPUs asked for, but topology `{}` has {n}; for several ranks per GPU use --ranks-per-gpu",
            gpus.len(),
            topology.name
        ));
    }
    if let Some(bad) = gpus.iter().find(|&&g| g >= n) {
        return Err(format!("GPU {bad} does not exist: topology `{}` has GPUs 0..{}", topology.name, n - 1));
    }
    let mut distinct = gpus.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != gpus.len() || gpus.is_empty() {
        return Err("name each GPU once (and at least one)".into());
    }
    if ranks > MAX_RANKS {
        return Err(format!("{ranks} ranks: tp-allreduce supports at most {MAX_RANKS} ranks"));
    }
    Ok(())
}

/// Sizes of the compressed-wire report: 256 KiB .. 64 MiB doubling.
pub fn wire_report_sizes() -> Vec<usize> {
    (18..=26).map(|k| 1usize << k).collect()
}

/// Seed of the report's inputs: fixed, so the report is reproducible.
pub const WIRE_REPORT_SEED: u64 = 38;

/// The report `tp-allreduce plan` prints.
pub fn plan_report(req: &PlanRequest) -> Result<String, String> {
    if req.wire.is_lossy() {
        return wire_report(req);
    }
    let world = req.world();
    let view = req.topology.for_ranks(&req.devices).map_err(|e| e.to_string())?;
    let c = Constraints::for_topology(&view);
    let mut s = String::new();
    let mode = if req.capturing { "CUDA-graph replay" } else { "eager calls" };
    let _ = writeln!(s, "tp-allreduce plan: {world} ranks on {}, {}, {mode}", view.name, req.dtype.name());
    s.push_str(&topology_view::render(&req.topology, &req.devices));
    let islands = c.islands.map_or("none".to_string(), |i| format!("{i} (from the topology)"));
    let nccl = if c.nccl_available { "available" } else { "unavailable (ranks share a GPU): no NCCL column" };
    let _ = writeln!(s, "transport: {}; hierarchical islands: {islands}", c.transport);
    let _ = writeln!(s, "NCCL: {nccl}; baseline: tuned NCCL (best of ring/tree x LL/Simple)\n");
    s.push_str(&sizes_table(req, &view, &c));
    s.push_str(&basis(req, &view, &c));
    s.push_str(&verify_pass(req, &view, &c));
    s.push_str(&fused_verify_pass(req, &view, &c));
    s.push_str(&gather_scatter(req, &view, &c));
    s.push_str(&assumptions(&CostModel::default()));
    Ok(s)
}

/// `plan --measured`: every measured-`auto` table cached in `cache` for
/// this world size and dtype, each measured median beside the cost
/// model's prediction for the plan's rank view. Tables of another
/// machine (fingerprint) are shown with a note: they never apply there.
pub fn measured_report(req: &PlanRequest, cache: &MeasuredCache) -> Result<String, String> {
    let view = req.topology.for_ranks(&req.devices).map_err(|e| e.to_string())?;
    let c = Constraints::for_topology(&view);
    let model = CostModel::default();
    let opts = Options { capturing: true, islands: c.islands, nccl: Default::default() };
    let mut s = String::new();
    let _ = writeln!(s, "measured auto: cached tables in {}", cache.dir.display());
    let mut shown = 0;
    for (path, decoded) in cache.list() {
        let (key, table) = match decoded {
            Ok(found) => found,
            Err(why) => {
                let _ = writeln!(s, "\n{}: not usable ({why}); the next start measures again", path.display());
                continue;
            }
        };
        if key.world_size != req.world() || key.dtype != req.dtype.name() {
            continue;
        }
        shown += 1;
        let here = if key.fingerprint == view.fingerprint() { "" } else { " (another topology than the plan's view)" };
        let _ = writeln!(
            s,
            "\n{}\n  {} ranks on {}, topology {}{here}; driver {}, kernels {}, islands {}, transport {}, NCCL {}, sweep {}",
            path.display(),
            key.world_size,
            key.gpu_model,
            key.fingerprint,
            key.driver_version,
            key.kernels_hash,
            key.islands,
            key.transport,
            if key.nccl { "measured" } else { "not available" },
            key.sweep
        );
        let mut t = table::new(["size", "algorithm", "measured us", "model us", "model/measured", "winner"], 2..5);
        for e in table.entries.iter().filter(|e| e.dtype == req.dtype) {
            for r in &e.results {
                let predicted = model.predict(&view, r.algorithm, r.transport, e.bytes, &opts).map(|p| p.total_us());
                t.add_row(vec![
                    human_bytes(e.bytes),
                    r.algorithm.name().to_string(),
                    format!("{:.2}", r.median_us),
                    predicted.as_ref().map_or("n/a".into(), |p| format!("{p:.2}")),
                    predicted.as_ref().map_or("-".into(), |p| format!("{:.2}", p / r.median_us)),
                    if r.algorithm == e.winner { "*".into() } else { String::new() },
                ]);
            }
        }
        s.push_str(&table::render(&t));
    }
    if shown == 0 {
        let _ = writeln!(
            s,
            "no measured table for {} ranks and {} (communicators measure at start unless {}=off)",
            req.world(),
            req.dtype.name(),
            tp_allreduce::env::AUTO_MEASURE
        );
    }
    Ok(s)
}

fn sizes_table(req: &PlanRequest, view: &Topology, c: &Constraints) -> String {
    let model = CostModel::default();
    let header = ["size", "algorithm", "transport", "predicted us", "NCCL us", "speedup", "measured params"];
    let mut t = table::new(header, 3..7);
    let opts = Options { capturing: req.capturing, islands: c.islands, nccl: Default::default() };
    for &bytes in &req.sizes {
        let ch = select_with(&model, None, view, req.world(), req.dtype, bytes, req.capturing, c);
        let (nccl, speedup) = if c.nccl_available {
            (format!("{:.1}", ch.nccl_predicted_us), format!("{:.2}x", ch.nccl_predicted_us / ch.predicted_us))
        } else {
            ("n/a".to_string(), "-".to_string())
        };
        let deps = dependencies(&model, view, ch.algorithm, ch.transport, bytes, &opts);
        let measured = deps.iter().filter(|r| measured_here(view, r.basis)).count();
        t.add_row(vec![
            human_bytes(bytes),
            ch.algorithm.name().to_string(),
            ch.transport.name().to_string(),
            format!("{:.1}", ch.predicted_us),
            nccl,
            speedup,
            format!("{measured} of {}", deps.len()),
        ]);
    }
    table::render(&t)
}

/// The parameters the prediction of `algorithm` at `bytes` depends on
/// (`CostModel::dependencies`).
fn dependencies(
    model: &CostModel,
    view: &Topology,
    algorithm: Algorithm,
    transport: tp_allreduce::Transport,
    bytes: usize,
    opts: &Options,
) -> Vec<ParamRow> {
    model.dependencies(|m| m.predict(view, algorithm, transport, bytes, opts).map_or(f64::NAN, |p| p.total_us()))
}

/// Whether a parameter of `basis` was measured on the kind of link this
/// topology has (or on none: launch, device memory).
fn measured_here(view: &Topology, basis: Basis) -> bool {
    match basis {
        Basis::MeasuredLocal => true,
        Basis::MeasuredPcie => view.is_pcie(),
        Basis::MeasuredNvlink => !view.is_pcie(),
        Basis::Published | Basis::Calibrated | Basis::Assumption => false,
    }
}

/// What each algorithm's figures above rest on: the parameters they depend
/// on that were not measured on this kind of link, with where they come
/// from (docs/COST-MODEL.md has every source).
fn basis(req: &PlanRequest, view: &Topology, c: &Constraints) -> String {
    let model = CostModel::default();
    let opts = Options { capturing: req.capturing, islands: c.islands, nccl: Default::default() };
    let link = if view.is_pcie() { "PCIe" } else { "NVLink" };
    let mut s = format!(
        "
measured params: of the parameters a figure depends on, how many were measured on {link}
or on no link (launch, device memory); the others, per algorithm chosen above:
"
    );
    let mut seen = Vec::new();
    for &bytes in &req.sizes {
        let ch = select_with(&model, None, view, req.world(), req.dtype, bytes, req.capturing, c);
        if seen.contains(&ch.algorithm) {
            continue;
        }
        seen.push(ch.algorithm);
        let deps = dependencies(&model, view, ch.algorithm, ch.transport, bytes, &opts);
        let mut borrowed: Vec<String> = deps
            .iter()
            .filter(|r| !measured_here(view, r.basis))
            .map(|r| format!("{} ({})", r.name, r.basis.label()))
            .collect();
        if ch.algorithm.phases_overlap() {
            borrowed.push("its phases priced as overlapping (assumed from the kernel's structure)".into());
        }
        let listed = if borrowed.is_empty() { "none".to_string() } else { borrowed.join(", ") };
        s.push_str(&wrap(&format!("  {}: {listed}", ch.algorithm), 118, "      "));
    }
    s
}

/// `text` broken at spaces into lines of at most `width` characters (a
/// longer word stays whole), every line after the first led by `indent`,
/// each ending in a newline.
fn wrap(text: &str, width: usize, indent: &str) -> String {
    let body = text.trim_start();
    let mut line = text[..text.len() - body.len()].to_string();
    let mut fresh = true;
    let mut out = String::new();
    for word in body.split_whitespace() {
        if !fresh && line.chars().count() + 1 + word.chars().count() > width {
            out.push_str(&line);
            out.push('\n');
            line = indent.to_string();
            fresh = true;
        }
        if !fresh {
            line.push(' ');
        }
        line.push_str(word);
        fresh = false;
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// All-gather and reduce-scatter, each size asked for one rank's block: what the collective
/// table chooses, ours (one hop, payload completion) against NCCL's ring
/// (one pass).
fn gather_scatter(req: &PlanRequest, view: &Topology, c: &Constraints) -> String {
    let model = CostModel::default();
    let opts = Options { capturing: req.capturing, islands: c.islands, nccl: Default::default() };
    let table = CollectiveTable::build(&model, view, c);
    let mut s = String::from("\nall-gather / reduce-scatter (block: one rank's share):\n");
    let header = ["block", "collective", "chosen", "ours us", "NCCL us", "speedup"];
    let mut t = table::new(header, 3..6);
    for &bytes in &req.sizes {
        for collective in [Collective::AllGather, Collective::ReduceScatter] {
            let Some(e) = table.lookup(collective, bytes, req.capturing) else { continue };
            let ours = Algorithm::OURS.into_iter().find(|a| a.collective() == collective);
            let ours_us = ours
                .and_then(|a| model.predict(view, a, c.transport, bytes, &opts).ok())
                .map_or(f64::NAN, |p| p.total_us());
            let nccl_us = model.predict_nccl_collective(view, c.transport, bytes * req.world(), &opts).total_us();
            let nccl = if c.nccl_available { format!("{nccl_us:.1}") } else { "n/a".into() };
            let speedup = match (c.nccl_available, e.algorithm) {
                (true, Algorithm::Nccl) => "1.00x".to_string(),
                (true, _) => format!("{:.2}x", nccl_us / ours_us),
                (false, _) => "-".to_string(),
            };
            t.add_row(vec![
                human_bytes(bytes),
                collective.name().to_string(),
                e.algorithm.name().to_string(),
                format!("{ours_us:.1}"),
                nccl,
                speedup,
            ]);
        }
    }
    s.push_str(&table::render(&t));
    s
}

fn verify_pass(req: &PlanRequest, view: &Topology, c: &Constraints) -> String {
    let model = CostModel::default();
    let world = req.world();
    let bytes = VERIFY_PASS_BYTES;
    let ch = select_with(&model, None, view, world, req.dtype, bytes, req.capturing, c);
    let ours_ms = VERIFY_PASS_ALLREDUCES as f64 * ch.predicted_us / 1e3;
    let nccl_ms = VERIFY_PASS_ALLREDUCES as f64 * ch.nccl_predicted_us / 1e3;
    let mut s = format!(
        "\nverify pass ({VERIFY_PASS_ALLREDUCES} allreduces of {} {}, the motivating workload):\n",
        human_bytes(bytes),
        req.dtype.name()
    );
    let _ = write!(s, "  {}: {ours_ms:.2} ms per pass", ch.algorithm);
    if c.nccl_available {
        let _ =
            write!(s, "; tuned NCCL: {nccl_ms:.2} ms ({:.1}x, {:.2} ms saved)", nccl_ms / ours_ms, nccl_ms - ours_ms);
    }
    let _ = writeln!(s, "\n  why: {}", ch.reason);
    if let Ok(p) = model.predict(
        view,
        ch.algorithm,
        ch.transport,
        bytes,
        &Options { capturing: req.capturing, islands: c.islands, nccl: Default::default() },
    ) {
        let b = p.breakdown;
        let _ = writeln!(
            s,
            "  where its {:.1} us go: launch {:.0}%, dependent hops {:.0}%, data {:.0}%",
            b.total(),
            100.0 * b.launch_us / b.total(),
            100.0 * b.latency_us / b.total(),
            100.0 * (b.wire_us + b.contention_us + b.local_us) / b.total()
        );
    }
    let _ = writeln!(s, "  every algorithm at {} (model, us):", human_bytes(bytes));
    let opts = Options { capturing: req.capturing, islands: c.islands, nccl: Default::default() };
    let header = ["algorithm", "total", "launch", "latency", "wire", "contention", "local", "note"];
    let mut t = table::new(header, 1..7);
    for a in Algorithm::allreduce_algorithms().chain([Algorithm::Nccl]) {
        let mut row = vec![a.name().to_string()];
        match model.predict(view, a, c.transport, bytes, &opts) {
            Ok(p) => {
                let b = p.breakdown;
                let cells = [b.total(), b.launch_us, b.latency_us, b.wire_us, b.contention_us, b.local_us];
                row.extend(cells.iter().map(|v| format!("{v:.1}")));
                row.push(
                    c.available(a, world, bytes).err().map(|w| format!("not selectable: {w}")).unwrap_or_default(),
                );
            }
            Err(why) => {
                row.extend(std::iter::repeat_n("-".to_string(), 6));
                row.push(format!("not applicable: {why}"));
            }
        }
        t.add_row(row);
    }
    s.push_str(&table::render(&t));
    s
}

/// The verify pass with the layer epilogue (allreduce + residual add +
/// RMSNorm, `Comm::all_reduce_add_rms_norm`): the fused selection's choice
/// against our allreduce or NCCL followed by the separate kernel.
fn fused_verify_pass(req: &PlanRequest, view: &Topology, c: &Constraints) -> String {
    let model = CostModel::default();
    let (world, bytes) = (req.world(), VERIFY_PASS_BYTES);
    let per_pass = |us: f64| VERIFY_PASS_ALLREDUCES as f64 * us / 1e3;
    let fused = select_fused(view, world, req.dtype, bytes, req.capturing, c);
    let plain = select_with(&model, None, view, world, req.dtype, bytes, req.capturing, c);
    let separate_us = model.separate_epilogue_us(bytes, req.capturing);
    let separate = plain.predicted_us + separate_us;
    // The default configuration, as the model prices it (the island
    // pushes' fused kernels are opt-in: `Config::fused_island_kernels`).
    let fused_here = fused.algorithm.fuses_epilogue_by_default();
    let how = if fused_here { "fused" } else { "+ add_rms_norm" };
    let mut s = format!(
        "\nverify pass with the layer epilogue ({VERIFY_PASS_ALLREDUCES} x (allreduce + residual add + RMSNorm)):\n"
    );
    let _ = writeln!(s, "  fused call: {:.2} ms per pass ({} {how})", per_pass(fused.predicted_us), fused.algorithm);
    let _ = writeln!(s, "  our allreduce + add_rms_norm: {:.2} ms ({})", per_pass(separate), plain.algorithm);
    if c.nccl_available {
        let nccl = per_pass(plain.nccl_predicted_us + separate_us);
        let _ = writeln!(s, "  tuned NCCL + add_rms_norm: {nccl:.2} ms");
    }
    let _ = writeln!(s, "  why: {}", fused.reason);
    s
}

fn assumptions(model: &CostModel) -> String {
    let p = &model.params;
    let mut s = String::from("\nmodel assumptions (docs/COST-MODEL.md has the parameter table and residuals):\n");
    let _ = writeln!(
        s,
        "  - launch+prologue+epilogue {:.2} us per kernel in a graph (+{:.1} us per extra rank on a GPU);",
        p.launch_graph_us, p.shared_gpu_rank_us
    );
    let _ = writeln!(
        s,
        "    each dependent hop costs the link latency ({:.2} us NVSwitch, {:.2} us same switch, {:.2} us root complex,\n    \
         {:.2} us across sockets, {:.1} us through host memory)",
        p.latency_nvswitch_us,
        p.latency_pcie_switch_us,
        p.latency_pcie_root_complex_us,
        p.latency_pcie_cross_socket_us,
        p.latency_host_staged_us
    );
    let _ = writeln!(
        s,
        "    + {:.2} us to see it (push algorithms carry completion in their payload: one hop per phase);\n    \
         flag kernels (pull, ring) add {:.2} us per flag, {:.2} us more when it publishes peer writes",
        p.hop_overhead_us, p.flag_hop_us, p.flag_drain_us
    );
    let _ = writeln!(
        s,
        "  - PCIe single-flow bandwidth {:.0}% of raw (Gen5 x16: {:.0} GB/s); all-to-all keeps {:.0}% (staggered writes),",
        p.pcie_efficiency * 100.0,
        p.pcie_gbps(5, 16),
        p.staggered_write_efficiency * 100.0
    );
    let _ = writeln!(
        s,
        "    {:.0}% (simultaneous writes), {:.0}% (simultaneous reads)",
        p.simultaneous_write_efficiency * 100.0,
        p.simultaneous_read_efficiency * 100.0
    );
    let _ = writeln!(
        s,
        "  - copy-engine ring: copies keep {:.0}% of raw PCIe per hop (Gen5 x16: {:.0} GB/s); each of its 2(N-1) steps",
        p.copy_engine_efficiency * 100.0,
        CostParams::pcie_lane_gbps(5) * 16.0 * p.copy_engine_efficiency
    );
    let _ = writeln!(s, "    adds {:.1} us (copy, flag write, step kernel) + the link latency", p.copy_engine_step_us);
    let _ = writeln!(
        s,
        "  - the socket boundary carries {:.0} GB/s for one flow, {:.0} GB/s aggregate with many; reads get {:.0}% of it",
        p.socket_single_flow_gbps,
        p.socket_many_flows_gbps,
        p.socket_read_factor * 100.0
    );
    s.push_str(
        "  - calibrated within +-20% on our own 2-H200 and 1-H200 measurements (one-shot push, NCCL) and on NCCL's\n    \
         published PCIe figures (docs/COST-MODEL.md); our kernels on PCIe and every unmeasured topology are predictions\n",
    );
    let _ = writeln!(
        s,
        "  - ours is chosen only when predicted >= {:.0}% faster than tuned NCCL; `tp-allreduce tune` measures instead",
        tp_allreduce::select::selection::MODEL_MARGIN * 100.0
    );
    s
}

/// `plan --wire fp8|int8`: the cost model's two-shot push over the
/// compressed wire against the lossless selection and NCCL per size, where
/// compression stops paying, and the wire's accuracy from the CPU
/// emulation (`tp_allreduce::wire`). No kernel exists yet: both halves
/// say so.
pub fn wire_report(req: &PlanRequest) -> Result<String, String> {
    let world = req.world();
    let wire = req.wire;
    let view = req.topology.for_ranks(&req.devices).map_err(|e| e.to_string())?;
    let c = Constraints::for_topology(&view);
    let model = CostModel::default();
    let opts = Options { capturing: req.capturing, islands: c.islands, nccl: Default::default() };
    let ratio = tp_allreduce::select::cost_model::wire_ratio(wire, req.dtype);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "tp-allreduce plan --wire {}: {world} ranks on {}, {}, {}",
        wire.name(),
        view.name,
        req.dtype.name(),
        if req.capturing { "CUDA-graph replay" } else { "eager calls" }
    );
    let _ = writeln!(
        s,
        "NOT BUILT YET: no kernel implements the {} wire (issue 38); communicators refuse it. A model prediction for \
         the design and an accuracy estimate emulated on the CPU.",
        wire.name()
    );
    let _ = writeln!(
        s,
        "wire: {} codes + one f32 scale per {} elements = {:.4} of the {} bytes; two-shot-push only\n",
        wire.name(),
        wire_emu::GROUP,
        ratio,
        req.dtype.name()
    );
    let lossy_name = format!("2-shot {} us", wire.name());
    let header = ["size", "lossless pick", "us", "2-shot us", &lossy_name, "NCCL us", "vs pick", "vs NCCL"];
    let mut t = table::new(header, 2..8);
    let mut pays_from: Option<usize> = None;
    let mut pays_over_two_shot: Option<usize> = None;
    for &bytes in &req.sizes {
        let ch = select_with(&model, None, &view, world, req.dtype, bytes, req.capturing, &c);
        let lossy = model.predict_wire(
            &view,
            Algorithm::TwoShotPush,
            ch.transport,
            bytes,
            &opts,
            WireSpec { format: wire, dtype: req.dtype },
        );
        let two_shot = model.predict(&view, Algorithm::TwoShotPush, ch.transport, bytes, &opts);
        match (&lossy, &two_shot) {
            (Ok(l), Ok(t)) if l.total_us() < t.total_us() => {
                pays_over_two_shot.get_or_insert(bytes);
            }
            _ => pays_over_two_shot = None,
        }
        let (lossy_us, vs, vs_nccl) = match &lossy {
            Ok(p) => (
                format!("{:.1}", p.total_us()),
                format!("{:.2}x", ch.predicted_us / p.total_us()),
                if c.nccl_available { format!("{:.2}x", ch.nccl_predicted_us / p.total_us()) } else { "-".into() },
            ),
            Err(why) => (format!("n/a ({why})"), "-".into(), "-".into()),
        };
        match lossy.as_ref().map(|p| p.total_us() < ch.predicted_us) {
            Ok(true) => {
                pays_from.get_or_insert(bytes);
            }
            _ => pays_from = None,
        }
        t.add_row(vec![
            human_bytes(bytes),
            ch.algorithm.name().to_string(),
            format!("{:.1}", ch.predicted_us),
            two_shot.map_or("n/a".into(), |p| format!("{:.1}", p.total_us())),
            lossy_us,
            if c.nccl_available { format!("{:.1}", ch.nccl_predicted_us) } else { "n/a".into() },
            vs,
            vs_nccl,
        ]);
    }
    s.push_str(&table::render(&t));
    let _ = match pays_from {
        Some(b) => writeln!(
            s,
            "floor: the {} wire is predicted to pay from {} up (every listed size from there); below it the lossless \
             wire is faster (TP_ALLREDUCE_WIRE_MIN_BYTES overrides)",
            wire.name(),
            human_bytes(b)
        ),
        None => writeln!(
            s,
            "floor: two-shot-push over the {} wire is not predicted to beat the lossless selection at the largest \
             listed size",
            wire.name()
        ),
    };
    let _ = match pays_over_two_shot {
        Some(b) => {
            writeln!(s, "       against lossless two-shot-push (the same algorithm) it pays from {} up", human_bytes(b))
        }
        None => writeln!(s, "       it does not beat lossless two-shot-push at the largest listed size either"),
    };
    let _ = writeln!(
        s,
        "model: the phases carry {ratio:.4} of the bytes; each phase adds a quantise pass (read the data, write the codes) \
         at device-memory bandwidth, not hidden behind the links (docs/COST-MODEL.md)\n"
    );
    s.push_str(&accuracy_table(wire, req.dtype, world));
    Ok(s)
}

/// The accuracy half of [`wire_report`]: emulated two-shot push of
/// activation-like rows against the exact (f64) sum.
pub fn accuracy_table(wire: WireFormat, dtype: DType, world: usize) -> String {
    let (rows, hidden) = (16, 4096);
    let mut s = format!(
        "accuracy, emulated on the CPU: the kernels are not built yet. {world} ranks, {rows} rows x {hidden} {} per \
         rank, seed {WIRE_REPORT_SEED}; error against the exact f64 sum S, relative = |out - S| / max(|S|, rms(S))\n",
        dtype.name()
    );
    let header = ["inputs", "wire", "max rel err", "mean rel err", "beyond bound", "ranks identical"];
    let mut t = table::new(header, 2..5);
    let mut rng = Rng::new(WIRE_REPORT_SEED);
    for dist in Distribution::ALL {
        let inputs = dist.inputs(&mut rng, world, rows, hidden, dtype);
        for w in [WireFormat::Lossless, wire] {
            let a = wire_emu::measure(w, dtype, &inputs);
            t.add_row(vec![
                dist.name().to_string(),
                w.name().to_string(),
                format!("{:.2e}", a.max_rel),
                format!("{:.2e}", a.mean_rel),
                format!("{:.4}%", 100.0 * a.beyond_bound),
                if a.ranks_identical { "yes".into() } else { "NO".into() },
            ]);
        }
    }
    s.push_str(&table::render(&t));
    s.push_str(
        "bound: per element, fp8: 1/16 of each other rank's contribution + 1/16 of the sum + 2^-10/448 of each \
         group's amax; int8: 1/254 of the amax of each group the value passed; plus f32 summation and the output's \
         rounding (derivation: kernels-rs/src/wire.rs). lossless = the same emulation with no quantisation: the \
         output dtype's rounding alone.\n",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(name: &str, world: Option<usize>, rpg: usize) -> Result<String, String> {
        let t = embedded::by_name(name).unwrap();
        plan_report(&PlanRequest::for_world(t, world, rpg, DType::Bf16)?)
    }

    #[test]
    fn wrapping_keeps_the_lead_and_indents_what_follows() {
        assert_eq!(wrap("  a: bb cc dd", 9, "    "), "  a: bb\n    cc dd\n");
        assert_eq!(wrap("  a: bb", 80, "    "), "  a: bb\n");
        assert_eq!(wrap("x averyveryverylongword y", 6, " "), "x\n averyveryverylongword\n y\n");
    }

    #[test]
    fn report_for_every_embedded_topology_fits_120_columns() {
        for name in embedded::names() {
            let r = report(name, None, 1).unwrap();
            for needle in ["42 KiB", "8 MiB", "verify pass", "model assumptions", "residual add + RMSNorm"] {
                assert!(r.contains(needle), "{name}: {needle}\n{r}");
            }
            assert!(!r.contains("NaN"), "{name}:\n{r}");
            assert!(!r.contains("CONTEXT.md"), "{name}:\n{r}");
            let wide: Vec<&str> = r.lines().filter(|l| l.chars().count() > 120).collect();
            assert!(wide.is_empty(), "{name}: lines over 120 columns: {wide:#?}");
        }
    }

    #[test]
    fn ranks_sharing_a_gpu_list_it_once_and_show_no_nccl_speedup() {
        let r = report("h200-8x-nvswitch", Some(4), 4).unwrap();
        assert!(r.contains("unavailable (ranks share a GPU)"), "{r}");
        assert_eq!(r.lines().filter(|l| l.contains("NVIDIA H200")).count(), 1, "{r}");
        let row = r.lines().find(|l| l.trim_start().starts_with("42 KiB")).unwrap();
        assert!(row.contains("n/a") && !row.contains('x'), "{row}");
        assert!(!r.contains("tuned NCCL:"), "{r}");
    }

    #[test]
    fn impossible_worlds_are_errors() {
        assert!(report(embedded::DEFAULT, Some(0), 1).unwrap_err().contains("at least 1"));
        let e = report(embedded::DEFAULT, Some(16), 1).unwrap_err();
        assert!(e.contains("has 8") && e.contains("--ranks-per-gpu"), "{e}");
        assert!(report(embedded::DEFAULT, Some(16), 2).unwrap_err().contains("at most 8 ranks"));
        assert!(report(embedded::DEFAULT, Some(6), 4).unwrap_err().contains("multiple"));
        let t = embedded::default_topology();
        assert!(PlanRequest::on_gpus(t.clone(), &[9], 1, DType::Bf16).unwrap_err().contains("GPU 9 does not exist"));
        assert!(PlanRequest::on_gpus(t, &[1, 1], 1, DType::Bf16).is_err());
    }

    #[test]
    fn motivating_report_shows_a_win_at_42_kb() {
        let r = report(embedded::DEFAULT, None, 1).unwrap();
        let line = r.lines().find(|l| l.trim_start().starts_with("42 KiB")).unwrap();
        assert!(!line.contains("nccl"), "{line}");
        assert!(r.contains("tuned NCCL:"), "{r}");
    }

    /// Fusing never makes the modelled verify pass slower than our
    /// allreduce followed by the separate kernel.
    #[test]
    fn the_fused_verify_pass_is_at_most_the_unfused_one() {
        for name in embedded::names() {
            let r = report(name, None, 1).unwrap();
            let ms = |label: &str| -> f64 {
                let line = r.lines().find(|l| l.trim_start().starts_with(label)).unwrap();
                line.split(": ").nth(1).and_then(|v| v.split(" ms").next()).unwrap().trim().parse().unwrap()
            };
            let (fused, ours) = (ms("fused call:"), ms("our allreduce + add_rms_norm:"));
            assert!(fused <= ours + 1e-9, "{name}: fused {fused} ms > unfused {ours} ms");
        }
    }

    #[test]
    fn the_measured_report_shows_each_measurement_beside_the_model() {
        use tp_allreduce::algorithm::Transport;
        use tp_allreduce::select::measured::{table_from_timings, CacheKey, Timing};
        let req = PlanRequest::for_world(embedded::default_topology(), Some(8), 1, DType::Bf16).unwrap();
        let view = req.topology.for_ranks(&req.devices).unwrap();
        let dir = std::env::temp_dir().join(format!("tp-allreduce-plan-measured-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = MeasuredCache { dir: dir.clone() };
        assert!(measured_report(&req, &cache).unwrap().contains("no measured table for 8 ranks"));
        let key = CacheKey {
            fingerprint: view.fingerprint(),
            gpu_model: view.gpu_model(),
            driver_version: 13000,
            kernels_hash: "96a58b29d5ff5273".into(),
            library_version: "0.1.0".into(),
            world_size: 8,
            islands: "none".into(),
            transport: "p2p".into(),
            nccl: true,
            config: String::new(),
            dtype: "bf16".into(),
            sweep: "on".into(),
        };
        let t = |algorithm, median_us| Timing {
            bytes: 42 << 10,
            algorithm,
            transport: Transport::PeerToPeer,
            median_us,
            shape: None,
            correct: true,
        };
        let table = table_from_timings(&key, DType::Bf16, &[t(Algorithm::OneShotPush, 9.25), t(Algorithm::Nccl, 27.5)])
            .unwrap();
        cache.write(&key, &table).unwrap();
        let report = measured_report(&req, &cache).unwrap();
        assert!(report.contains("9.25") && report.contains("27.50") && report.contains("model us"), "{report}");
        assert!(!report.contains("another topology"), "{report}");
        let four = PlanRequest::for_world(embedded::default_topology(), Some(4), 1, DType::Bf16).unwrap();
        assert!(measured_report(&four, &cache).unwrap().contains("no measured table for 4 ranks"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn topology_names_resolve_and_bogus_ones_fail() {
        assert_eq!(topology(Some("l40s-8x-pcie4")).unwrap().name, "l40s-8x-pcie4");
        let e = topology(Some("dgx-9000")).unwrap_err();
        assert!(e.contains("rtx-pro-6000-8x-pcie5-2socket"), "{e}");
    }

    /// The wire report says what it is (no kernel, emulated on the CPU),
    /// and the emulation holds its own bound on every input.
    #[test]
    fn wire_report_is_labelled_and_within_its_bound() {
        let topology = super::topology(Some("rtx-pro-6000-4x-switch")).unwrap();
        let mut req = PlanRequest::for_world(topology, None, 1, DType::Bf16).unwrap();
        req.wire = WireFormat::Int8;
        req.sizes = wire_report_sizes();
        let r = plan_report(&req).unwrap();
        assert!(r.contains("NOT BUILT YET") && r.contains("emulated on the CPU: the kernels are not built yet"), "{r}");
        assert!(r.contains("floor:"), "{r}");
        let rows: Vec<&str> = r.lines().filter(|l| l.contains("| int8 ") || l.contains("| lossless |")).collect();
        assert_eq!(rows.len(), 8, "{r}");
        for row in rows {
            assert!(row.contains("0.0000%") && row.trim_end().ends_with("yes"), "{row}");
        }
    }
}
