//! Every number the model uses, with its unit and source.

use serde::{Deserialize, Serialize};

/// Every number the model uses. `CostParams::default()` is the calibrated
/// set; [`CostParams::table`] lists each with its unit and source.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostParams {
    /// Launch + prologue + epilogue of one of our kernels replayed in a CUDA
    /// graph: previous kernel's exit to this one's first peer store, plus
    /// the tail after its last poll (us).
    pub launch_graph_us: f64,
    /// The same, launched eagerly (us).
    pub launch_eager_us: f64,
    /// Per dependent hop on top of the link latency: the poll that sees the
    /// data (or flag) arrive (us).
    pub hop_overhead_us: f64,
    /// Per dependent memory round trip a thread makes inside a phase
    /// beyond its hop's poll (input loads that must return before their
    /// peer stores, a further group of receive slots polled after the
    /// previous one): `PhaseSpec::access_rounds` of them (us).
    pub access_round_us: f64,
    /// Flag kernels (every kernel that is not a sentinel kernel): per flag
    /// hop, the flag store, its system-scope fence and the flag poll, on
    /// top of the hop (us).
    pub flag_hop_us: f64,
    /// Flag kernels: per flag hop that publishes posted peer writes, the
    /// system-scope release fence waiting for them to complete (us).
    pub flag_drain_us: f64,
    /// Per additional rank (process) sharing a GPU: their kernels run
    /// side by side under MPS (contended prologue, arrival skew) (us).
    pub shared_gpu_rank_us: f64,
    /// Flag kernels: per flag hop and per additional rank sharing the GPU,
    /// what the flag's system-scope release and acquire add when several
    /// processes' kernels run on one GPU (us).
    pub shared_gpu_flag_us: f64,
    /// Eager pull algorithms copy the input into the registered staging
    /// buffer first: launch of that copy (us).
    pub eager_stage_us: f64,
    /// One-way latency of a store to become visible, per link class (us).
    pub latency_same_device_us: f64,
    pub latency_nvlink_us: f64,
    pub latency_nvswitch_us: f64,
    pub latency_pcie_switch_us: f64,
    pub latency_pcie_root_complex_us: f64,
    pub latency_pcie_cross_socket_us: f64,
    /// Through host memory (host-staged transport): the write into pinned
    /// host memory and the peer's polling read of it (us).
    pub latency_host_staged_us: f64,
    /// A non-posted read costs this many one-way latencies (request and
    /// completion).
    pub read_round_trip_factor: f64,
    /// Achieved / raw PCIe bandwidth of one flow (Gen5 x16: 54 of 63 GB/s).
    pub pcie_efficiency: f64,
    /// Generation assumed when discovery could not read it.
    pub pcie_default_gen: u32,
    /// Per NVLink link and direction, raw (GB/s).
    pub nvlink_link_gbps: f64,
    /// Achieved / raw NVLink bandwidth.
    pub nvlink_efficiency: f64,
    /// Per-GPU NVSwitch bandwidth per direction, achieved (GB/s).
    pub nvswitch_gpu_gbps: f64,
    /// Device-memory bandwidth of a GPU model missing from
    /// `DEVICE_MEMORY` (GB/s, conservative: the slowest listed class).
    pub device_memory_gbps: f64,
    /// Host-memory bandwidth available to staged traffic (GB/s).
    pub host_memory_gbps: f64,
    /// Link efficiency when every rank writes to all peers in a staggered
    /// order (each GPU ~one stream out, one in, all GPUs at once).
    pub staggered_write_efficiency: f64,
    /// Link efficiency when every rank writes to all peers at once.
    pub simultaneous_write_efficiency: f64,
    /// Link efficiency when every rank reads from all peers at once.
    pub simultaneous_read_efficiency: f64,
    /// Link efficiency of a single read stream (vs a single write stream).
    pub single_read_efficiency: f64,
    /// Our ring: achieved / link bandwidth of its chunked FIFO pipeline
    /// (per-chunk flag and credit round trips).
    pub ring_efficiency: f64,
    /// Our ring: most bytes per second one rank streams through its FIFOs,
    /// whatever the link (GB/s; per-chunk flag and credit round trips).
    pub ring_max_gbps: f64,
    /// Copy-engine peer copies: achieved / raw PCIe bandwidth per hop of a
    /// ring (the copy-engine ring).
    pub copy_engine_efficiency: f64,
    /// Per copy-engine ring step on top of the link latency: the copy node,
    /// the flag write and the step kernel that waits for it (us).
    pub copy_engine_step_us: f64,
    /// Socket boundary, one flow alone, per direction (GB/s).
    pub socket_single_flow_gbps: f64,
    /// Socket boundary, aggregate with many flows, per direction (GB/s).
    pub socket_many_flows_gbps: f64,
    /// Socket boundary capacity for reads relative to writes.
    pub socket_read_factor: f64,
    /// NCCL base latency, LL protocol, including its launch (us).
    pub nccl_base_ll_us: f64,
    /// NCCL base latency, Simple protocol, including its launch (us).
    pub nccl_base_simple_us: f64,
    /// NCCL per-step overhead on top of the link latency, LL, PCIe (us).
    pub nccl_step_ll_us: f64,
    /// NCCL per-step overhead on top of the link latency, Simple, PCIe (us).
    pub nccl_step_simple_us: f64,
    /// NCCL per-step latency over an NVLink or NVSwitch edge, both
    /// protocols (us; replaces link latency + per-step overhead there).
    pub nccl_step_nvlink_us: f64,
    /// NCCL LL: most LL-line bytes per second a rank moves, whatever the
    /// link (GB/s; LL lines are half data).
    pub nccl_ll_max_gbps: f64,
    /// Tuned NCCL (more channels): LL wire throughput as a fraction of the
    /// ring's single-flow link bandwidth (LL lines: half of it is data).
    pub nccl_ll_link_fraction: f64,
    /// Stock NCCL (default channel count): the same.
    pub nccl_ll_stock_link_fraction: f64,
    /// NCCL Simple throughput as a fraction of the ring's link bandwidth.
    pub nccl_simple_link_fraction: f64,
    /// NCCL through host memory (SHM transport) throughput per rank (GB/s).
    pub nccl_host_gbps: f64,
    /// NCCL through host memory: per ring step, its proxy-driven copy
    /// through a host buffer (us; our kernels' host-memory hop is
    /// `latency_host_staged_us`).
    pub nccl_host_step_us: f64,
    /// Extra host-side cost of an eager (non-graph) NCCL call (us).
    pub nccl_eager_extra_us: f64,
}

impl Default for CostParams {
    fn default() -> Self {
        CostParams {
            launch_graph_us: 1.25,
            launch_eager_us: 3.25,
            hop_overhead_us: 0.3,
            access_round_us: 0.7,
            flag_hop_us: 0.4,
            flag_drain_us: 3.2,
            shared_gpu_rank_us: 0.4,
            shared_gpu_flag_us: 0.15,
            eager_stage_us: 2.0,
            latency_same_device_us: 0.1,
            latency_nvlink_us: 0.75,
            latency_nvswitch_us: 0.75,
            latency_pcie_switch_us: 0.45,
            latency_pcie_root_complex_us: 0.55,
            latency_pcie_cross_socket_us: 0.9,
            latency_host_staged_us: 1.3,
            read_round_trip_factor: 2.0,
            pcie_efficiency: 0.86,
            pcie_default_gen: 4,
            nvlink_link_gbps: 25.0,
            nvlink_efficiency: 0.73,
            nvswitch_gpu_gbps: 330.0,
            device_memory_gbps: 864.0,
            host_memory_gbps: 100.0,
            staggered_write_efficiency: 0.66,
            simultaneous_write_efficiency: 0.567,
            simultaneous_read_efficiency: 0.46,
            single_read_efficiency: 0.955,
            ring_efficiency: 0.66,
            ring_max_gbps: 32.0,
            copy_engine_efficiency: 0.79,
            copy_engine_step_us: 2.9,
            socket_single_flow_gbps: 53.0,
            socket_many_flows_gbps: 24.0,
            socket_read_factor: 0.81,
            nccl_base_ll_us: 5.0,
            nccl_base_simple_us: 6.1,
            nccl_step_ll_us: 0.7,
            nccl_step_simple_us: 5.4,
            nccl_step_nvlink_us: 0.6,
            nccl_ll_max_gbps: 66.0,
            nccl_ll_link_fraction: 1.0,
            nccl_ll_stock_link_fraction: 0.57,
            nccl_simple_link_fraction: 0.66,
            nccl_host_gbps: 10.0,
            nccl_host_step_us: 14.0,
            nccl_eager_extra_us: 2.0,
        }
    }
}

/// Where the 2-H200 measurements of this model are (docs/results/...).
const H200X2: &str = "docs/results/h200-x2/speed-exp-1";
/// Where the PCIe measurements on one H200 are.
const PCIE: &str = "docs/results/h200-1gpu/pcie";

/// Device-memory bandwidth per GPU model (GB/s, the vendor's figure):
/// (case-insensitive part of the model name, GB/s). Models not listed use
/// [`CostParams::device_memory_gbps`]. docs/SOURCES.md [F39].
pub const DEVICE_MEMORY: [(&str, f64); 4] =
    [("H200", 4800.0), ("RTX PRO 6000", 1792.0), ("L40S", 864.0), ("RTX 4090", 1008.0)];

/// How a parameter's value was obtained, and so how far a prediction for a
/// PCIe machine that uses it rests on measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Basis {
    /// Measured here over PCIe: an H200's Gen5 x16 link to host memory
    /// (copy engines, the host-staged transport).
    MeasuredPcie,
    /// Measured here where the link plays no part (launch, device-memory
    /// round trips, ranks sharing one GPU): the same on a PCIe machine.
    MeasuredLocal,
    /// Measured here over NVLink / NVSwitch: borrowed where it prices PCIe.
    MeasuredNvlink,
    /// Someone else's measurement (docs/SOURCES.md).
    Published,
    /// Fitted to published figures.
    Calibrated,
    /// Neither measured nor published.
    Assumption,
}

impl Basis {
    pub const fn label(self) -> &'static str {
        match self {
            Basis::MeasuredPcie => "measured here over PCIe",
            Basis::MeasuredLocal => "measured here, link-independent",
            Basis::MeasuredNvlink => "measured here over NVLink",
            Basis::Published => "published",
            Basis::Calibrated => "calibrated",
            Basis::Assumption => "assumed",
        }
    }

    /// Whether a PCIe prediction that uses it rests on our own
    /// measurement of the kind of link it prices (or of no link).
    pub const fn measured_for_pcie(self) -> bool {
        matches!(self, Basis::MeasuredPcie | Basis::MeasuredLocal)
    }
}

/// One row of the parameter table.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamRow {
    pub name: &'static str,
    pub value: f64,
    pub unit: &'static str,
    pub basis: Basis,
    pub source: String,
}

impl CostParams {
    /// Every parameter with its value, unit and source: what
    /// docs/COST-MODEL.md tabulates (a test checks the doc names them all).
    #[rustfmt::skip]
    pub fn table(&self) -> Vec<ParamRow> {
        use Basis::*;
        let r = |name, value, unit, basis, source: &str| ParamRow { name, value, unit, basis, source: source.replace("{H200X2}", H200X2).replace("{PCIE}", PCIE) };
        vec![
            r("launch_graph_us", self.launch_graph_us, "us", MeasuredLocal, "measured here: one-shot-push at 4 KB on 2 H200, gap 0.74-0.77 + entry to first store 0.38 + tail 0.10 ({H200X2}/summary.txt)"),
            r("launch_eager_us", self.launch_eager_us, "us", Assumption, "assumption: launch_graph_us + ~2 us host launch"),
            r("hop_overhead_us", self.hop_overhead_us, "us", MeasuredLocal, "measured here: the poll of local memory that sees the data, entry to loads back 0.29 us at 4 KB ({H200X2}/summary.txt)"),
            r("access_round_us", self.access_round_us, "us", MeasuredLocal, "measured here with every rank on one H200, where each round is a device-memory round trip as it is on a PCIe receiver (receive slots and inputs are local memory): two-shot-push 12.8-13.0 us vs one-shot-push 6.2-6.9 us at 4-64 KB, 8 ranks (9 more rounds, 0.7 us each; docs/results/h200-x2/final/mps8.json)"),
            r("flag_hop_us", self.flag_hop_us, "us", MeasuredNvlink, "measured here: one-shot-pull 6.3 us, two-shot-pull 10.3 us at 4 KB on 2 H200 ({H200X2}/tuning.toml)"),
            r("flag_drain_us", self.flag_drain_us, "us", MeasuredNvlink, "measured here: two-shot-push 10.2 us ({H200X2}/new.json), ring 10.9 us ({H200X2}/tuning.toml) at 4 KB on 2 H200"),
            r("shared_gpu_rank_us", self.shared_gpu_rank_us, "us", MeasuredLocal, "measured here: 8 ranks on one H200 under MPS, one-shot-push 4-64 KB ({H200X2}/mps8-new.json, docs/results/h200-x2/final/mps8.json), less its one access round"),
            r("shared_gpu_flag_us", self.shared_gpu_flag_us, "us", MeasuredLocal, "measured here: one-shot-pull (2 flag hops) 8.53-9.49 us at 4-64 KB with 8 ranks on one H200, 2.0-2.3 us above the model without it (docs/results/h200-1gpu/b8all.json)"),
            r("eager_stage_us", self.eager_stage_us, "us", Assumption, "assumption: one extra copy launch (the vLLM eager path)"),
            r("latency_same_device_us", self.latency_same_device_us, "us", Assumption, "assumption: L2/HBM visibility"),
            r("latency_nvlink_us", self.latency_nvlink_us, "us", Assumption, "assumption: as latency_nvswitch_us (no machine with direct NVLink measured)"),
            r("latency_nvswitch_us", self.latency_nvswitch_us, "us", MeasuredNvlink, "measured here: first peer store to last poll 0.70-1.18 us at 4 KB on 2 H200 ({H200X2}/summary.txt), less hop_overhead_us"),
            r("latency_pcie_switch_us", self.latency_pcie_switch_us, "us", Published, "SOURCES.md [F8]: Gen5 P2P write latency 0.36-0.45 us"),
            r("latency_pcie_root_complex_us", self.latency_pcie_root_complex_us, "us", Assumption, "assumption: switch figure + root-complex routing"),
            r("latency_pcie_cross_socket_us", self.latency_pcie_cross_socket_us, "us", Assumption, "assumption: two root complexes + the socket link"),
            r("latency_host_staged_us", self.latency_host_staged_us, "us", MeasuredPcie, "measured here: one-shot push through pinned host memory, 2 ranks on one H200 under MPS, 4 KB: first peer store to last poll 1.54-1.60 us (through device memory 0.48-0.51), less hop_overhead_us ({PCIE}/trace2-host-staged.log, trace2-p2p.log)"),
            r("read_round_trip_factor", self.read_round_trip_factor, "x", Assumption, "physics: a non-posted read is a request plus a completion"),
            r("pcie_efficiency", self.pcie_efficiency, "x", MeasuredPcie, "measured here: one H200's Gen5 x16 link, one copy-engine stream of 64 MB device-to-host 53.97 GB/s, host-to-device 52.96, of 63 raw ({PCIE}/pcie-probe.json); SOURCES.md [F7]: 52-56 GB/s GPU-to-GPU"),
            r("pcie_default_gen", f64::from(self.pcie_default_gen), "gen", Assumption, "assumption for GPUs whose link could not be read"),
            r("nvlink_link_gbps", self.nvlink_link_gbps, "GB/s", Published, "NVLink 4: 50 GB/s per link, both directions"),
            r("nvlink_efficiency", self.nvlink_efficiency, "x", MeasuredNvlink, "measured here on NVSwitch: nvswitch_gpu_gbps / 450 GB/s per direction (SOURCES.md [F39])"),
            r("nvswitch_gpu_gbps", self.nvswitch_gpu_gbps, "GB/s", MeasuredNvlink, "measured here: one-shot-push 1 MB to 8 MB on 2 H200, 331 GB/s per direction ({H200X2}/tuned.json)"),
            r("device_memory_gbps", self.device_memory_gbps, "GB/s", Published, "assumption for GPU models missing from DEVICE_MEMORY: its slowest entry (SOURCES.md [F39])"),
            r("host_memory_gbps", self.host_memory_gbps, "GB/s", Assumption, "assumption: one socket's DDR5 share for staging"),
            r("staggered_write_efficiency", self.staggered_write_efficiency, "x", Calibrated, "calibrated: published one-shot push 128 KB-1 MB on 4 GPUs (~35 GB/s per GPU)"),
            r("simultaneous_write_efficiency", self.simultaneous_write_efficiency, "x", Published, "SOURCES.md [F6]: 25.4 / 44.8 GB/s per link, all peers at once"),
            r("simultaneous_read_efficiency", self.simultaneous_read_efficiency, "x", Published, "SOURCES.md [F6]: 20.6 / 44.8 GB/s per link, all peers at once"),
            r("single_read_efficiency", self.single_read_efficiency, "x", Published, "SOURCES.md [F6]: load 42.8 vs store 44.8 GB/s alone"),
            r("ring_efficiency", self.ring_efficiency, "x", Assumption, "assumption: streams no better than NCCL's Simple ring (= nccl_simple_link_fraction)"),
            r("ring_max_gbps", self.ring_max_gbps, "GB/s", MeasuredNvlink, "measured here: ring 256 KB-8 MB on 2 H200 streams 30-44 GB/s ({H200X2}/tuning.toml)"),
            r("copy_engine_efficiency", self.copy_engine_efficiency, "x", Published, "SOURCES.md [F9]: copy-engine flat ring of 8 ranks, 49.64 GB/s per link / 63 raw"),
            r("copy_engine_step_us", self.copy_engine_step_us, "us", MeasuredPcie, "measured here: a dependent 16-byte copy node across PCIe in a CUDA graph 1.79 (device-to-host) - 2.22 us (host-to-device), plus the flag write as a device-local node, 0.72 ({PCIE}/pcie-probe.json)"),
            r("socket_single_flow_gbps", self.socket_single_flow_gbps, "GB/s", Published, "SOURCES.md [F9]: ~53 GB/s for a single hop alone"),
            r("socket_many_flows_gbps", self.socket_many_flows_gbps, "GB/s", Published, "SOURCES.md [F9]: ~24 GB/s aggregate, all flows crossing"),
            r("socket_read_factor", self.socket_read_factor, "x", Published, "SOURCES.md [F6]: read/write ratio under concurrency (20.6 / 25.4)"),
            r("nccl_base_ll_us", self.nccl_base_ll_us, "us", MeasuredNvlink, "measured here: NCCL in graphs on 2 H200, 4-42 KB, less 2 NVLink steps ({H200X2}/new.json); tuning.cc: 6.6"),
            r("nccl_base_simple_us", self.nccl_base_simple_us, "us", MeasuredNvlink, "measured here: NCCL in graphs on 2 H200, 64 KB-8 MB, less 2 NVLink steps ({H200X2}/new.json); tuning.cc: 8.4"),
            r("nccl_step_ll_us", self.nccl_step_ll_us, "us", Calibrated, "calibrated: NCCL's model ~20 us ring LL small on 8 PCIe GPUs; 13.5 us at 1 KB on 4"),
            r("nccl_step_simple_us", self.nccl_step_simple_us, "us", Calibrated, "calibrated: stock NCCL 512 KB and 1 MB on 4 GPUs (tuning.cc PCI: 5.7)"),
            r("nccl_step_nvlink_us", self.nccl_step_nvlink_us, "us", Published, "SOURCES.md [F12]: NCCL tuning.cc, NVLink ring LL step 0.6 us"),
            r("nccl_ll_max_gbps", self.nccl_ll_max_gbps, "GB/s", MeasuredNvlink, "measured here: NCCL LL 16-42 KB on 2 H200 moves ~33 GB/s of data ({H200X2}/new.json)"),
            r("nccl_ll_link_fraction", self.nccl_ll_link_fraction, "x", Calibrated, "calibrated: tuned NCCL 32 and 256 KB on 8 PCIe GPUs"),
            r("nccl_ll_stock_link_fraction", self.nccl_ll_stock_link_fraction, "x", Calibrated, "calibrated: stock NCCL 16-512 KB on 4 GPUs (published comparison)"),
            r("nccl_simple_link_fraction", self.nccl_simple_link_fraction, "x", Calibrated, "calibrated: stock NCCL 1 MB on 4 PCIe GPUs; NCCL 8 MB on 2 H200 ({H200X2}/new.json)"),
            r("nccl_host_gbps", self.nccl_host_gbps, "GB/s", Assumption, "assumption: NCCL's SHM transport through host memory"),
            r("nccl_host_step_us", self.nccl_host_step_us, "us", Published, "SOURCES.md [F8]: ~14 us with P2P disabled (NCCL through host memory)"),
            r("nccl_eager_extra_us", self.nccl_eager_extra_us, "us", Assumption, "assumption: host launch of an eager NCCL call"),
        ]
    }

    /// Device-memory bandwidth of a GPU model (GB/s): its `DEVICE_MEMORY`
    /// entry, else [`CostParams::device_memory_gbps`].
    pub fn device_memory_of(&self, model: &str) -> f64 {
        let model = model.to_ascii_lowercase();
        DEVICE_MEMORY
            .iter()
            .find(|(part, _)| model.contains(&part.to_ascii_lowercase()))
            .map_or(self.device_memory_gbps, |&(_, gbps)| gbps)
    }

    /// `DEVICE_MEMORY` as markdown (what docs/COST-MODEL.md shows).
    pub fn device_memory_markdown() -> String {
        let mut s = String::from("| GPU model (name contains) | device memory |\n|---|---|\n");
        for (part, gbps) in DEVICE_MEMORY {
            s.push_str(&format!("| {part} | {gbps} GB/s |\n"));
        }
        s
    }

    /// [`CostParams::table`] as markdown (what docs/COST-MODEL.md shows).
    pub fn markdown_table(&self) -> String {
        let mut s = String::from("| parameter | value | unit | basis | source |\n|---|---|---|---|---|\n");
        for r in self.table() {
            s.push_str(&format!("| `{}` | {} | {} | {} | {} |\n", r.name, r.value, r.unit, r.basis.label(), r.source));
        }
        s
    }

    /// Raw PCIe bandwidth per lane and direction for a generation (GB/s).
    pub fn pcie_lane_gbps(gen: u32) -> f64 {
        match gen {
            1 => 0.25,
            2 => 0.5,
            3 => 0.985,
            4 => 1.969,
            5 => 3.938,
            6 => 7.563,
            _ => 15.125,
        }
    }

    /// Achieved single-flow P2P write bandwidth of a GPU's PCIe link (GB/s).
    pub fn pcie_gbps(&self, gen: u32, width: u32) -> f64 {
        let gen = if gen == 0 { self.pcie_default_gen } else { gen };
        let width = if width == 0 { 16 } else { width };
        Self::pcie_lane_gbps(gen) * f64::from(width) * self.pcie_efficiency
    }
}
