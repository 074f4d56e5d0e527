//! Discovering the running machine's topology.
//!
//! Sources, in order of preference for each fact:
//! * **CUDA driver** (cudarc, loaded at run time): the device list in CUDA
//!   ordinal order (what communicators use), PCI bus ids, compute
//!   capability, memory, and peer access (`cuDeviceCanAccessPeer`,
//!   `cuDeviceGetP2PAttribute(ACCESS_SUPPORTED)`).
//! * **NVML** (`nvml-wrapper`, loads `libnvidia-ml` at run time): model name,
//!   PCIe generation and width (the maximum the GPU *and* slot support: an
//!   idle link trains down, so the current value misleads), NVLink
//!   connections, and the PCIe common ancestor of each pair, which maps to
//!   the [`PcieRelation`]: `INTERNAL`/`SINGLE`/`MULTIPLE` -> same switch,
//!   `HOSTBRIDGE`/`NODE` -> same root complex, `SYSTEM` -> cross socket.
//! * **sysfs** (`/sys/bus/pci/devices/<bus id>/`): NUMA node always, and
//!   PCIe speed/width and the pair relation (from the device paths) when NVML
//!   cannot tell.
//!
//! Without a driver nothing is probed and [`discover`] returns
//! `Error::NoDriver` naming the embedded topologies to model with instead.
//! The driver probe is guarded (`is_culib_present`, then `cuInit` inside
//! `catch_unwind`, as cudarc's dynamic loading panics when a symbol is
//! missing), so discovery never panics. Every CUDA call goes through
//! `crate::driver` (device queries that create no context).

#![forbid(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
use nvml_wrapper::Nvml;

use super::{embedded, GpuInfo, LinkKind, PairInfo, PcieRelation, Topology};
use crate::driver;
use crate::error::{Error, Result};

/// NVML's `NVML_NVLINK_MAX_LINKS`.
const NVLINK_MAX_LINKS: u32 = 18;

/// What the CUDA driver says about one device.
struct CudaDevice {
    name: String,
    cc: (u32, u32),
    bus_id: String,
    memory_bytes: u64,
}

/// Discovers the GPUs visible to this process (CUDA ordinal order) and the
/// links between them. Works with one GPU. Needs the NVIDIA driver (CUDA
/// driver or NVML); without it returns `Error::NoDriver`.
pub fn discover() -> Result<Topology> {
    let cuda = cuda_probe();
    let nvml = Nvml::init();
    let (devices, p2p, source) = match (cuda, &nvml) {
        (Ok((devices, p2p)), Ok(_)) => (devices, Some(p2p), "discovered (CUDA driver + NVML)"),
        (Ok((devices, p2p)), Err(_)) => (devices, Some(p2p), "discovered (CUDA driver + sysfs; NVML unavailable)"),
        (Err(_), Ok(nvml)) => (nvml_devices(nvml)?, None, "discovered (NVML only; CUDA driver unavailable)"),
        (Err(cuda_why), Err(nvml_why)) => {
            return Err(Error::NoDriver(format!(
                "topology discovery needs the NVIDIA driver: CUDA: {cuda_why}; NVML: {nvml_why}. \
                 To model without a GPU use an embedded topology ({})",
                embedded::names().join(", ")
            )))
        }
    };
    if devices.is_empty() {
        return Err(Error::Config(
            "topology discovery: the driver sees no GPU (check CUDA_VISIBLE_DEVICES and the container's device access)"
                .into(),
        ));
    }
    let nvml = nvml.ok();
    let nvml_devs: Vec<Option<nvml_wrapper::Device<'_>>> =
        devices.iter().map(|d| nvml.as_ref().and_then(|n| n.device_by_pci_bus_id(d.bus_id.as_str()).ok())).collect();

    let gpus: Vec<GpuInfo> = devices
        .iter()
        .zip(&nvml_devs)
        .enumerate()
        .map(|(index, (d, nd))| {
            let sysfs = sysfs_dir(&d.bus_id);
            let (sys_gen, sys_width) = sysfs_link(&sysfs);
            let nvml_gen = nd.as_ref().and_then(|n| n.max_pcie_link_gen().ok());
            let nvml_width = nd.as_ref().and_then(|n| n.max_pcie_link_width().ok());
            GpuInfo {
                index,
                model: nd.as_ref().and_then(|n| n.name().ok()).unwrap_or_else(|| d.name.clone()),
                compute_capability: d.cc,
                pcie_gen: nvml_gen.or(sys_gen).unwrap_or(0),
                pcie_width: nvml_width.or(sys_width).unwrap_or(0),
                numa_node: read_trimmed(&sysfs.join("numa_node"))
                    .and_then(|v| v.parse::<i64>().ok())
                    .and_then(|v| u32::try_from(v).ok()),
                pci_bus_id: d.bus_id.clone(),
                memory_bytes: nd.as_ref().and_then(|n| n.memory_info().ok()).map_or(d.memory_bytes, |m| m.total),
            }
        })
        .collect();

    let n = gpus.len();
    let mut pairs = vec![vec![PairInfo::SAME_DEVICE; n]; n];
    for i in 0..n {
        for j in 0..n {
            if i == j {
                continue;
            }
            let p2p_supported = match &p2p {
                Some(m) => m[i][j],
                None => nvml_p2p(&nvml_devs[i], &nvml_devs[j]),
            };
            let link = link_kind(&gpus, &nvml_devs, &devices, i, j, p2p_supported);
            pairs[i][j] = PairInfo { link, p2p_supported, p2p_check: None };
        }
    }
    // The driver may answer asymmetrically; the model needs one kind per pair.
    for (i, j) in (0..n).flat_map(|i| (0..i).map(move |j| (i, j))) {
        let (a, b) = (pairs[i][j].link, pairs[j][i].link);
        let worse = if a.quality() <= b.quality() { a } else { b };
        pairs[i][j].link = worse;
        pairs[j][i].link = worse;
    }
    let t = Topology { name: source.into(), gpus, pairs, islands: None };
    t.validate()?;
    Ok(t)
}

/// Devices in ordinal order and the peer-access matrix, or why not.
fn cuda_probe() -> std::result::Result<(Vec<CudaDevice>, Vec<Vec<bool>>), String> {
    if !driver::driver_available() {
        return Err("libcuda could not be loaded or cuInit failed".into());
    }
    catch_unwind(AssertUnwindSafe(|| cuda_probe_inner().map_err(|e| e.to_string())))
        .unwrap_or_else(|_| Err("the CUDA driver lacks an entry point discovery needs (driver too old?)".into()))
}

fn cuda_probe_inner() -> Result<(Vec<CudaDevice>, Vec<Vec<bool>>)> {
    let handles: Vec<_> = (0..driver::device_count()).map(driver::device).collect::<Result<_>>()?;
    let mut devices = Vec::with_capacity(handles.len());
    for &dev in &handles {
        let info = driver::device_info(dev)?;
        devices.push(CudaDevice {
            name: info.name,
            cc: info.compute_capability,
            bus_id: normalize_bus_id(&info.pci_bus_id),
            memory_bytes: info.memory_bytes,
        });
    }
    let n = handles.len();
    let mut p2p = vec![vec![true; n]; n];
    for i in 0..n {
        for j in 0..n {
            if i != j {
                // An old driver without the attribute: trust cuDeviceCanAccessPeer.
                let supported = driver::p2p_access_supported(handles[i], handles[j]).unwrap_or(true);
                p2p[i][j] = driver::can_access_peer(handles[i], handles[j])? && supported;
            }
        }
    }
    Ok((devices, p2p))
}

/// Devices from NVML alone (no CUDA driver): NVML index order, which is PCI
/// bus order and may differ from CUDA's ordinals.
fn nvml_devices(nvml: &Nvml) -> Result<Vec<CudaDevice>> {
    let count = nvml.device_count().map_err(|e| Error::NoDriver(format!("NVML device count: {e}")))?;
    (0..count)
        .map(|i| {
            let d = nvml.device_by_index(i).map_err(|e| Error::NoDriver(format!("NVML device {i}: {e}")))?;
            let cc =
                d.cuda_compute_capability().map(|c| (c.major.max(0) as u32, c.minor.max(0) as u32)).unwrap_or((0, 0));
            Ok(CudaDevice {
                name: d.name().unwrap_or_else(|_| "unknown NVIDIA GPU".into()),
                cc,
                bus_id: d.pci_info().map(|p| normalize_bus_id(&p.bus_id)).unwrap_or_default(),
                memory_bytes: d.memory_info().map(|m| m.total).unwrap_or(0),
            })
        })
        .collect()
}

fn nvml_p2p(a: &Option<nvml_wrapper::Device<'_>>, b: &Option<nvml_wrapper::Device<'_>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => [P2pCapabilitiesIndex::Read, P2pCapabilitiesIndex::Write]
            .into_iter()
            .all(|idx| matches!(a.p2p_status(b, idx), Ok(P2pStatus::Ok))),
        _ => false,
    }
}

/// Number of active NVLink links of `dev` whose far end is `peer_bus`, and
/// whether `dev` has active links to something that is not a visible GPU
/// (an NVSwitch).
fn nvlinks(dev: &nvml_wrapper::Device<'_>, peer_bus: &str, gpu_buses: &[String]) -> (u32, bool) {
    let mut direct = 0;
    let mut switch = false;
    for l in 0..NVLINK_MAX_LINKS {
        let link = dev.link_wrapper_for(l);
        if !matches!(link.is_active(), Ok(true)) {
            continue;
        }
        match link.remote_pci_info() {
            Ok(info) => {
                let remote = normalize_bus_id(&info.bus_id);
                if remote == peer_bus {
                    direct += 1;
                } else if !gpu_buses.contains(&remote) {
                    switch = true;
                }
            }
            Err(_) => switch = true,
        }
    }
    (direct, switch)
}

fn link_kind(
    gpus: &[GpuInfo],
    nvml_devs: &[Option<nvml_wrapper::Device<'_>>],
    devices: &[CudaDevice],
    i: usize,
    j: usize,
    p2p_supported: bool,
) -> LinkKind {
    if gpus[i].pci_bus_id == gpus[j].pci_bus_id && !gpus[i].pci_bus_id.is_empty() {
        return LinkKind::SameDevice;
    }
    if !p2p_supported {
        return LinkKind::None;
    }
    let buses: Vec<String> = devices.iter().map(|d| d.bus_id.clone()).collect();
    if let (Some(a), Some(b)) = (&nvml_devs[i], &nvml_devs[j]) {
        if matches!(a.p2p_status(b, P2pCapabilitiesIndex::NvLink), Ok(P2pStatus::Ok)) {
            let (direct, a_switch) = nvlinks(a, &gpus[j].pci_bus_id, &buses);
            let (_, b_switch) = nvlinks(b, &gpus[i].pci_bus_id, &buses);
            if direct > 0 {
                return LinkKind::NvLink { links: direct };
            }
            if a_switch && b_switch {
                return LinkKind::NvSwitch;
            }
        }
        // `topology_common_ancestor` takes the peer handle by value: fetch
        // a second handle of the same device.
        let level = a
            .nvml()
            .device_by_pci_bus_id(gpus[j].pci_bus_id.as_str())
            .and_then(|peer| a.topology_common_ancestor(peer));
        if let Ok(level) = level {
            return LinkKind::Pcie { relation: relation_of(level) };
        }
    }
    LinkKind::Pcie { relation: sysfs_relation(&gpus[i], &gpus[j]) }
}

/// NVML common-ancestor level -> PCIe relation (see the module docs).
pub fn relation_of(level: TopologyLevel) -> PcieRelation {
    match level {
        TopologyLevel::Internal | TopologyLevel::Single | TopologyLevel::Multiple => PcieRelation::SameSwitch,
        TopologyLevel::HostBridge | TopologyLevel::Node => PcieRelation::SameRootComplex,
        TopologyLevel::System => PcieRelation::CrossSocket,
    }
}

/// `0000:1A:00.0` / `00000000:1a:00.0` -> `0000:1a:00.0`.
pub fn normalize_bus_id(raw: &str) -> String {
    let raw = raw.trim().trim_end_matches('\0').to_ascii_lowercase();
    let mut parts = raw.splitn(2, ':');
    match (parts.next(), parts.next()) {
        (Some(domain), Some(rest)) if rest.contains(':') => match u32::from_str_radix(domain, 16) {
            Ok(d) => format!("{d:04x}:{rest}"),
            Err(_) => raw.clone(),
        },
        _ => raw.clone(),
    }
}

fn sysfs_dir(bus_id: &str) -> PathBuf {
    Path::new("/sys/bus/pci/devices").join(bus_id)
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// `"32.0 GT/s PCIe"` -> generation 5.
pub fn gen_from_speed(speed: &str) -> Option<u32> {
    let gts: f64 = speed.split_whitespace().next()?.parse().ok()?;
    Some(match gts {
        x if x < 3.0 => 1,
        x if x < 6.0 => 2,
        x if x < 10.0 => 3,
        x if x < 20.0 => 4,
        x if x < 40.0 => 5,
        x if x < 80.0 => 6,
        _ => 7,
    })
}

/// Generation and width of the link from sysfs: the lower of the device's
/// and its upstream port's maximum (an idle link reports a trained-down
/// current speed); the current values when the maxima are missing.
fn sysfs_link(dir: &Path) -> (Option<u32>, Option<u32>) {
    let read_gen = |d: &Path, f: &str| read_trimmed(&d.join(f)).and_then(|s| gen_from_speed(&s));
    let read_width = |d: &Path, f: &str| read_trimmed(&d.join(f)).and_then(|s| s.parse::<u32>().ok());
    let parent = std::fs::canonicalize(dir).ok().and_then(|p| p.parent().map(Path::to_path_buf));
    let cap = |a: Option<u32>, b: Option<u32>| match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let gen = cap(read_gen(dir, "max_link_speed"), parent.as_deref().and_then(|p| read_gen(p, "max_link_speed")))
        .or_else(|| read_gen(dir, "current_link_speed"));
    let width = cap(read_width(dir, "max_link_width"), parent.as_deref().and_then(|p| read_width(p, "max_link_width")))
        .or_else(|| read_width(dir, "current_link_width"));
    (gen, width)
}

/// The PCIe relation from the sysfs device paths
/// (`/sys/devices/pci0000:00/<root port>/<switch ports...>/<gpu>`): a shared
/// component below the root port means a shared switch; the same host
/// bridge only, the same root complex; otherwise the NUMA nodes decide.
fn sysfs_relation(a: &GpuInfo, b: &GpuInfo) -> PcieRelation {
    let path = |g: &GpuInfo| -> Option<Vec<String>> {
        let p = std::fs::canonicalize(sysfs_dir(&g.pci_bus_id)).ok()?;
        let comps: Vec<String> = p.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
        let start = comps.iter().position(|c| c.starts_with("pci"))?;
        Some(comps[start..comps.len() - 1].to_vec())
    };
    relation_from_paths(path(a).as_deref(), path(b).as_deref(), a.numa_node, b.numa_node)
}

/// Pure part of `sysfs_relation`: paths are the components from the host
/// bridge (`pci0000:00`) down to the GPU's parent port.
pub fn relation_from_paths(
    a: Option<&[String]>,
    b: Option<&[String]>,
    numa_a: Option<u32>,
    numa_b: Option<u32>,
) -> PcieRelation {
    if let (Some(a), Some(b)) = (a, b) {
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        // [host bridge, root port, switch upstream, switch downstream, ...]
        if common >= 3 {
            return PcieRelation::SameSwitch;
        }
        if common >= 1 {
            return PcieRelation::SameRootComplex;
        }
    }
    match (numa_a, numa_b) {
        (Some(x), Some(y)) if x == y => PcieRelation::SameRootComplex,
        _ => PcieRelation::CrossSocket,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_normalised() {
        assert_eq!(normalize_bus_id("00000000:1A:00.0"), "0000:1a:00.0");
        assert_eq!(normalize_bus_id("0000:C1:00.0\0"), "0000:c1:00.0");
        assert_eq!(normalize_bus_id("garbage"), "garbage");
    }

    #[test]
    fn link_speeds_map_to_generations() {
        assert_eq!(gen_from_speed("32.0 GT/s PCIe"), Some(5));
        assert_eq!(gen_from_speed("16.0 GT/s PCIe"), Some(4));
        assert_eq!(gen_from_speed("8.0 GT/s PCIe"), Some(3));
        assert_eq!(gen_from_speed("2.5 GT/s PCIe"), Some(1));
        assert_eq!(gen_from_speed("Unknown"), None);
    }

    #[test]
    fn nvml_levels_map_to_relations() {
        assert_eq!(relation_of(TopologyLevel::Single), PcieRelation::SameSwitch);
        assert_eq!(relation_of(TopologyLevel::Multiple), PcieRelation::SameSwitch);
        assert_eq!(relation_of(TopologyLevel::HostBridge), PcieRelation::SameRootComplex);
        assert_eq!(relation_of(TopologyLevel::Node), PcieRelation::SameRootComplex);
        assert_eq!(relation_of(TopologyLevel::System), PcieRelation::CrossSocket);
    }

    #[test]
    fn sysfs_paths_map_to_relations() {
        let p = |s: &str| s.split('/').map(String::from).collect::<Vec<_>>();
        let sw_a = p("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0");
        let sw_b = p("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0");
        let rp = p("pci0000:00/0000:00:03.0");
        let other = p("pci0000:80/0000:80:01.0");
        assert_eq!(relation_from_paths(Some(&sw_a), Some(&sw_b), Some(0), Some(0)), PcieRelation::SameSwitch);
        assert_eq!(relation_from_paths(Some(&sw_a), Some(&rp), Some(0), Some(0)), PcieRelation::SameRootComplex);
        assert_eq!(relation_from_paths(Some(&sw_a), Some(&other), Some(0), Some(1)), PcieRelation::CrossSocket);
        assert_eq!(relation_from_paths(Some(&sw_a), Some(&other), Some(0), Some(0)), PcieRelation::SameRootComplex);
        assert_eq!(relation_from_paths(None, None, None, None), PcieRelation::CrossSocket);
    }

    /// Without a driver discovery fails with a clear error; with one it
    /// returns a valid topology. Either way it must not panic.
    #[test]
    fn discover_degrades_gracefully() {
        match discover() {
            Ok(t) => {
                t.validate().unwrap();
                assert!(!t.is_empty());
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(matches!(e, Error::NoDriver(_) | Error::Config(_)), "{msg}");
                if matches!(e, Error::NoDriver(_)) {
                    assert!(msg.contains("rtx-pro-6000-8x-pcie5-2socket"), "{msg}");
                }
            }
        }
    }
}
