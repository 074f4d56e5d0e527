//! What the GPUs of one host are and how they are connected: the input of
//! the cost model ([`crate::select::cost_model`]), the selection
//! ([`crate::select::selection`]) and the key of the tuning table
//! ([`crate::select::tuning`]).
//!
//! A [`Topology`] comes from [`discover()`] (NVML + the CUDA driver + sysfs)
//! or from a named embedded description ([`embedded::by_name`]) for
//! modelling without hardware.
//!
//! # Machine topology and rank view
//! A discovered topology describes the *devices* of the machine (index =
//! CUDA ordinal). The cost model works on a *rank view*: one entry per rank
//! of a communicator, built by [`Topology::for_ranks`] from the device each
//! rank uses (several ranks may share one device; their pair is
//! [`LinkKind::SameDevice`]). [`Topology::for_world`] builds the default view
//! (rank `r` on device `r`, or all ranks round-robin when there are more
//! ranks than devices).
//!
//! # Fingerprint
//! [`Topology::fingerprint`] is FNV-1a (64 bit) over a canonical text of:
//! the GPU count; per GPU its model name, compute capability, PCIe
//! generation and width; per ordered pair the link kind and whether P2P is
//! supported. Deliberately *not* covered: PCI bus ids (they differ between
//! otherwise identical machines of a fleet and move when cards are
//! re-seated, and a tuning table measured on one such machine is valid on
//! the others), NUMA node numbers (the socket structure is already in the
//! link matrix), memory sizes, the topology's name (so an embedded
//! description of a machine has the fingerprint of the discovered machine),
//! the init-time P2P check results (filled by each communicator; a failed
//! check changes the *transport*, which the tuning table records per
//! measurement) and the island partition (derived from the links). The hash
//! is implemented here, not `std`'s randomized `DefaultHasher`, so the value
//! is the same across runs, builds and platforms.

#![forbid(unsafe_code)]

pub mod discover;
pub mod embedded;
pub mod islands;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::algorithm::IslandSplit;
use crate::error::{Error, Result};

pub use discover::discover;
pub use islands::islands_from_topology;

/// Where two GPUs attached over PCIe meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PcieRelation {
    /// Below one PCIe switch (or a hierarchy of switches) without passing a
    /// host bridge (NVML `SINGLE` / `MULTIPLE`).
    SameSwitch,
    /// Through the root complex of one CPU socket (NVML `HOSTBRIDGE` /
    /// `NODE`).
    SameRootComplex,
    /// Through the link between two CPU sockets (NVML `SYSTEM`).
    CrossSocket,
}

impl PcieRelation {
    pub const fn name(self) -> &'static str {
        match self {
            PcieRelation::SameSwitch => "same-switch",
            PcieRelation::SameRootComplex => "same-root-complex",
            PcieRelation::CrossSocket => "cross-socket",
        }
    }
}

/// The path peer traffic takes between two ranks' devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum LinkKind {
    /// Both ranks use the same GPU: peer traffic stays in device memory.
    SameDevice,
    /// Direct NVLink connections between the two GPUs (`links` lanes).
    NvLink { links: u32 },
    /// Both GPUs attach to NVSwitches (every pair at full NVLink bandwidth).
    NvSwitch,
    /// PCIe peer-to-peer.
    Pcie { relation: PcieRelation },
    /// No peer-to-peer path: traffic between the two goes through host
    /// memory (P2P not supported, or the path could not be determined).
    None,
}

impl LinkKind {
    /// Quality order used to derive islands: larger is a better link.
    /// NVSwitch ranks above any direct NVLink bundle (it gives every pair the
    /// GPU's full NVLink bandwidth).
    pub const fn quality(self) -> u32 {
        match self {
            LinkKind::SameDevice => 1000,
            LinkKind::NvSwitch => 700,
            LinkKind::NvLink { links } => 500 + if links > 99 { 99 } else { links },
            LinkKind::Pcie { relation: PcieRelation::SameSwitch } => 300,
            LinkKind::Pcie { relation: PcieRelation::SameRootComplex } => 200,
            LinkKind::Pcie { relation: PcieRelation::CrossSocket } => 100,
            LinkKind::None => 0,
        }
    }

    /// Whether traffic on this link crosses PCIe (peer-to-peer or staged
    /// through host memory).
    pub const fn is_pcie(self) -> bool {
        matches!(self, LinkKind::Pcie { .. } | LinkKind::None)
    }

    /// Short stable text, used in the fingerprint and in reports.
    pub fn code(self) -> String {
        match self {
            LinkKind::SameDevice => "same-device".into(),
            LinkKind::NvLink { links } => format!("nvlink{links}"),
            LinkKind::NvSwitch => "nvswitch".into(),
            LinkKind::Pcie { relation } => format!("pcie-{}", relation.name()),
            LinkKind::None => "none".into(),
        }
    }
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.code())
    }
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// CUDA device ordinal (in a rank view: the device of that rank).
    pub index: usize,
    /// Marketing name as the driver reports it.
    pub model: String,
    /// `(major, minor)`, e.g. `(12, 0)` for sm_120.
    pub compute_capability: (u32, u32),
    /// PCIe generation of the GPU's host link (the maximum the GPU and slot
    /// support: an idle link trains down, so the current value misleads);
    /// 0 when unknown.
    pub pcie_gen: u32,
    /// PCIe lanes of the host link; 0 when unknown.
    pub pcie_width: u32,
    /// NUMA node of the GPU's PCIe attachment, if the OS reports one.
    pub numa_node: Option<u32>,
    /// PCI bus id, `dddd:bb:dd.f` lower case.
    pub pci_bus_id: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
}

/// One ordered pair of ranks (or devices).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairInfo {
    pub link: LinkKind,
    /// The driver reports peer access (always true for the same device).
    pub p2p_supported: bool,
    /// Result of the communicator's init-time transfer check over this pair:
    /// `None` until a communicator ran it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p2p_check: Option<bool>,
}

impl PairInfo {
    pub const SAME_DEVICE: PairInfo = PairInfo { link: LinkKind::SameDevice, p2p_supported: true, p2p_check: None };

    /// Peer-to-peer usable: supported and not failed by the transfer check.
    pub const fn p2p_usable(&self) -> bool {
        self.p2p_supported && !matches!(self.p2p_check, Some(false))
    }
}

/// A partition of ranks (or devices) into islands (sizes may differ).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Islands {
    pub groups: Vec<Vec<usize>>,
}

impl Islands {
    pub fn count(&self) -> usize {
        self.groups.len()
    }

    /// Members of the first island.
    pub fn size(&self) -> usize {
        self.groups.first().map_or(0, Vec::len)
    }

    /// `Some(m)` when the islands are consecutive blocks of `m` ranks
    /// (`{0..m-1}, {m..2m-1}, ...`): the layout the hierarchical kernel
    /// expects (`Config::island_size`).
    pub fn consecutive_size(&self) -> Option<usize> {
        let m = self.size();
        let consecutive = m > 0
            && self
                .groups
                .iter()
                .enumerate()
                .all(|(g, members)| members.len() == m && members.iter().enumerate().all(|(i, &r)| r == g * m + i));
        consecutive.then_some(m)
    }

    /// Island index of each of `n` members (`None` for members in none).
    pub fn island_of(&self, n: usize) -> Vec<Option<usize>> {
        let mut of = vec![None; n];
        for (g, members) in self.groups.iter().enumerate() {
            for &r in members {
                if r < n {
                    of[r] = Some(g);
                }
            }
        }
        of
    }
}

/// The GPUs of a host and the links between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Embedded name, or what produced it (`discovered`, `... ranks`).
    pub name: String,
    pub gpus: Vec<GpuInfo>,
    /// `pairs[i][j]`: the ordered pair `i -> j`; `pairs[i][i]` is
    /// [`PairInfo::SAME_DEVICE`].
    pub pairs: Vec<Vec<PairInfo>>,
    /// An explicit island partition (by socket or switch), when the source
    /// knows one; [`Topology::islands`] derives one from the links otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub islands: Option<Islands>,
}

/// Connected components of `0..n` under `joined` (symmetric), numbered in
/// order of their smallest member.
pub(crate) fn components(n: usize, joined: impl Fn(usize, usize) -> bool) -> Vec<usize> {
    let mut id = vec![usize::MAX; n];
    let mut next = 0;
    while let Some(start) = id.iter().position(|&x| x == usize::MAX) {
        id[start] = next;
        let mut stack = vec![start];
        while let Some(a) = stack.pop() {
            for (b, slot) in id.iter_mut().enumerate() {
                if *slot == usize::MAX && joined(a, b) {
                    *slot = next;
                    stack.push(b);
                }
            }
        }
        next += 1;
    }
    id
}

/// FNV-1a, 64 bit: small, specified, identical on every platform.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Topology {
    /// Number of GPUs (or ranks, in a rank view).
    pub fn len(&self) -> usize {
        self.gpus.len()
    }

    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    pub fn pair(&self, i: usize, j: usize) -> &PairInfo {
        &self.pairs[i][j]
    }

    pub fn link(&self, i: usize, j: usize) -> LinkKind {
        self.pairs[i][j].link
    }

    /// Checks the shape and the invariants a deserialised or hand-written
    /// topology must satisfy; the message names the offending entry.
    pub fn validate(&self) -> Result<()> {
        let n = self.gpus.len();
        if n == 0 {
            return Err(Error::Config(format!("topology `{}` has no GPU", self.name)));
        }
        if self.pairs.len() != n || self.pairs.iter().any(|row| row.len() != n) {
            return Err(Error::Config(format!(
                "topology `{}`: the pair matrix must be {n}x{n} (one row and column per GPU)",
                self.name
            )));
        }
        for i in 0..n {
            for j in 0..n {
                let p = self.pairs[i][j];
                if i == j && p.link != LinkKind::SameDevice {
                    return Err(Error::Config(format!("topology `{}`: pair ({i},{i}) must be same-device", self.name)));
                }
                if p.link == LinkKind::SameDevice && self.gpus[i].pci_bus_id != self.gpus[j].pci_bus_id {
                    return Err(Error::Config(format!(
                        "topology `{}`: pair ({i},{j}) is same-device but the bus ids differ",
                        self.name
                    )));
                }
                if p.link != self.pairs[j][i].link {
                    return Err(Error::Config(format!(
                        "topology `{}`: link ({i},{j}) is {} but ({j},{i}) is {}",
                        self.name, p.link, self.pairs[j][i].link
                    )));
                }
            }
        }
        if let Some(islands) = &self.islands {
            let mut seen = vec![false; n];
            for g in &islands.groups {
                if g.is_empty() {
                    return Err(Error::Config(format!("topology `{}`: an island is empty", self.name)));
                }
                for &r in g {
                    if r >= n || seen[r] {
                        return Err(Error::Config(format!(
                            "topology `{}`: island member {r} is out of range or listed twice",
                            self.name
                        )));
                    }
                    seen[r] = true;
                }
            }
            if seen.iter().any(|s| !s) {
                return Err(Error::Config(format!("topology `{}`: the islands must cover every GPU", self.name)));
            }
        }
        Ok(())
    }

    /// The canonical text the fingerprint hashes (see the module docs).
    pub fn fingerprint_text(&self) -> String {
        use fmt::Write as _;
        let mut s = String::from("tp-allreduce-topology-v1\n");
        let _ = writeln!(s, "gpus={}", self.gpus.len());
        for g in &self.gpus {
            let _ = writeln!(
                s,
                "gpu model={} cc={}.{} pcie=gen{}x{}",
                g.model.trim(),
                g.compute_capability.0,
                g.compute_capability.1,
                g.pcie_gen,
                g.pcie_width
            );
        }
        for (i, row) in self.pairs.iter().enumerate() {
            for (j, p) in row.iter().enumerate() {
                let _ = writeln!(s, "pair {i} {j} {} p2p={}", p.link.code(), u8::from(p.p2p_supported));
            }
        }
        s
    }

    /// Stable hex fingerprint (16 hex digits) of what determines
    /// performance; see the module docs for what it covers and why.
    pub fn fingerprint(&self) -> String {
        format!("{:016x}", fnv1a64(self.fingerprint_text().as_bytes()))
    }

    /// Distinct GPU models, in order of first appearance, joined by `+`.
    pub fn gpu_model(&self) -> String {
        let mut models: Vec<&str> = Vec::new();
        for g in &self.gpus {
            if !models.contains(&g.model.as_str()) {
                models.push(&g.model);
            }
        }
        models.join(" + ")
    }

    /// Whether any two distinct devices talk over PCIe (P2P or through host
    /// memory): the case where the selection's "never slower than NCCL"
    /// rule applies with more than two ranks.
    pub fn is_pcie(&self) -> bool {
        self.pairs.iter().flatten().any(|p| p.link.is_pcie())
    }

    /// Whether every pair of distinct devices has usable peer-to-peer.
    pub fn all_p2p_usable(&self) -> bool {
        self.pairs.iter().flatten().all(PairInfo::p2p_usable)
    }

    /// Whether two ranks share one device (NCCL cannot run then).
    pub fn has_shared_device(&self) -> bool {
        let n = self.len();
        (0..n).any(|i| (0..n).any(|j| i != j && self.pairs[i][j].link == LinkKind::SameDevice))
    }

    /// Records the communicator's transfer-check result for `a <-> b`
    /// (both directions).
    pub fn set_p2p_check(&mut self, a: usize, b: usize, passed: bool) {
        if a != b && a < self.len() && b < self.len() {
            self.pairs[a][b].p2p_check = Some(passed);
            self.pairs[b][a].p2p_check = Some(passed);
        }
    }

    /// The island partition: the explicit one if the source gave one, else
    /// the one derived from the link matrix ([`Topology::derive_islands`]).
    pub fn islands(&self) -> Option<Islands> {
        self.islands.clone().or_else(|| self.derive_islands())
    }

    /// Derives islands from the link matrix ([`islands_from_topology`]):
    /// the coarsest boundary (socket, root complex, PCIe switch) that cuts
    /// the ranks into two or more groups of two or more; ranks sharing a GPU
    /// or connected by NVLink are never split; sizes may differ.
    pub fn derive_islands(&self) -> Option<Islands> {
        islands_from_topology(self).map(|(groups, _)| Islands { groups })
    }

    /// [`Topology::islands`] as the algorithms use them: `Some` when they
    /// split the ranks into two or more islands of a shape the Hierarchical
    /// kernel runs.
    pub fn island_split(&self) -> Option<IslandSplit> {
        let islands = self.islands()?;
        IslandSplit::from_groups(&islands.groups, self.len()).ok().filter(IslandSplit::splits)
    }

    /// The rank view of a communicator: rank `r` runs on device
    /// `devices[r]` of this (machine) topology. Pairs of ranks on one device
    /// become [`LinkKind::SameDevice`]. Islands: the machine's explicit
    /// partition mapped to ranks, kept when it still splits them into two or
    /// more groups of at least two (else derived from the view's links).
    pub fn for_ranks(&self, devices: &[usize]) -> Result<Topology> {
        if devices.is_empty() {
            return Err(Error::invalid("a rank view needs at least one rank"));
        }
        if let Some(&bad) = devices.iter().find(|&&d| d >= self.len()) {
            return Err(Error::invalid(format!(
                "rank view: device {bad} does not exist (topology `{}` has {} GPUs)",
                self.name,
                self.len()
            )));
        }
        let gpus: Vec<GpuInfo> = devices.iter().map(|&d| self.gpus[d].clone()).collect();
        let pairs = devices
            .iter()
            .map(|&a| devices.iter().map(|&b| if a == b { PairInfo::SAME_DEVICE } else { self.pairs[a][b] }).collect())
            .collect();
        let islands = self.islands.as_ref().and_then(|machine| {
            let of = machine.island_of(self.len());
            let mut groups: Vec<Vec<usize>> = vec![Vec::new(); machine.count()];
            for (r, &d) in devices.iter().enumerate() {
                groups[of[d]?].push(r);
            }
            groups.retain(|g| !g.is_empty());
            (groups.len() >= 2 && groups.iter().all(|g| g.len() >= 2)).then_some(Islands { groups })
        });
        let distinct = {
            let mut d = devices.to_vec();
            d.sort_unstable();
            d.dedup();
            d.len()
        };
        let name = if distinct == devices.len() && devices.iter().enumerate().all(|(r, &d)| r == d) {
            if devices.len() == self.len() {
                self.name.clone()
            } else {
                format!("{} (first {} GPUs)", self.name, devices.len())
            }
        } else {
            let gpus = if distinct == 1 { "1 GPU".to_string() } else { format!("{distinct} GPUs") };
            format!("{} ({} ranks on {gpus})", self.name, devices.len())
        };
        Ok(Topology { name, gpus, pairs, islands })
    }

    /// The default rank view for `world` ranks: rank `r` on device `r` when
    /// `world <= len()`, else round-robin (`r % len()`), which is how several
    /// ranks share one GPU on a single-device test machine.
    pub fn for_world(&self, world: usize) -> Result<Topology> {
        if world == 0 {
            return Err(Error::invalid("world size must be at least 1"));
        }
        if world == self.len() {
            return Ok(self.clone());
        }
        let devices: Vec<usize> = (0..world).map(|r| r % self.len().max(1)).collect();
        self.for_ranks(&devices)
    }

    /// JSON text (what `tp-allreduce topology --json` can print).
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| Error::Config(format!("encoding topology: {e}")))
    }

    pub fn from_json(text: &str) -> Result<Topology> {
        let t: Topology = serde_json::from_str(text).map_err(|e| Error::Config(format!("topology JSON: {e}")))?;
        t.validate()?;
        Ok(t)
    }

    /// A few lines for humans: GPUs, link matrix, islands, fingerprint.
    pub fn summary(&self) -> String {
        use fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(s, "topology: {} ({} GPUs, fingerprint {})", self.name, self.len(), self.fingerprint());
        for g in &self.gpus {
            let numa = g.numa_node.map_or("-".to_string(), |n| n.to_string());
            let _ = writeln!(
                s,
                "  gpu {}: {} sm_{}{} PCIe gen{} x{} numa {} bus {} {} GiB",
                g.index,
                g.model,
                g.compute_capability.0,
                g.compute_capability.1,
                g.pcie_gen,
                g.pcie_width,
                numa,
                g.pci_bus_id,
                g.memory_bytes >> 30
            );
        }
        let n = self.len();
        let abbrev = |l: LinkKind| match l {
            LinkKind::SameDevice => "X".to_string(),
            LinkKind::NvLink { links } => format!("NV{links}"),
            LinkKind::NvSwitch => "NVS".into(),
            LinkKind::Pcie { relation: PcieRelation::SameSwitch } => "PIX".into(),
            LinkKind::Pcie { relation: PcieRelation::SameRootComplex } => "PHB".into(),
            LinkKind::Pcie { relation: PcieRelation::CrossSocket } => "SYS".into(),
            LinkKind::None => "-".into(),
        };
        let _ = write!(s, "  links  ");
        for j in 0..n {
            let _ = write!(s, "{j:>5}");
        }
        let _ = writeln!(s);
        for i in 0..n {
            let _ = write!(s, "  {i:>5}  ");
            for j in 0..n {
                let p = self.pairs[i][j];
                let mark = if p.p2p_usable() { "" } else { "*" };
                let _ = write!(s, "{:>5}", format!("{}{mark}", abbrev(p.link)));
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(
            s,
            "  (X same device, NVn NVLink x n, NVS NVSwitch, PIX same PCIe switch, PHB same root complex, SYS across sockets, - no path; * no usable P2P)"
        );
        match self.islands() {
            Some(i) => {
                let _ = writeln!(s, "  islands: {:?}", i.groups);
            }
            None => {
                let _ = writeln!(s, "  islands: none");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests;
