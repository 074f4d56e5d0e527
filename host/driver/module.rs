//! The library's kernels: the PTX module loaded once per context, each
//! entry with the parameter list its PTX declares, typed argument lists,
//! and the launches, which check the arguments against that list.

use std::collections::HashMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext};

use super::{cu, CurrentContext};
use crate::embedded_ptx::EmbeddedPtx;
use crate::error::{Error, Result};

/// The library's kernels loaded into one context.
pub struct KernelModule {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    kernels: HashMap<String, Kernel>,
    pub arch: &'static str,
    /// The PTX has the cluster entries (`algorithm::entries::cluster_entries`)
    /// and the device launches thread-block clusters.
    pub clusters: bool,
}

// SAFETY: CUmodule/CUfunction handles are usable from any thread once the
// owning context is bound; the map is immutable after load.
unsafe impl Send for KernelModule {}
// SAFETY: as above.
unsafe impl Sync for KernelModule {}

impl KernelModule {
    /// The module for `ctx`, loaded once per context and kept for the life
    /// of the process. (Unloading when the last user drops it would make a
    /// later call reload it — possibly inside a stream capture, where a
    /// module load invalidates the capture.)
    pub fn for_context(ctx: &Arc<CudaContext>) -> Result<Arc<KernelModule>> {
        static CACHE: OnceLock<Mutex<HashMap<usize, Arc<KernelModule>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        let key = ctx.cu_ctx() as usize;
        let mut map = cache.lock().map_err(|_| Error::Broken("kernel module cache poisoned".into()))?;
        if let Some(m) = map.get(&key) {
            return Ok(m.clone());
        }
        let (major, minor) = ctx.compute_capability().map_err(|e| crate::error::driver("cuDeviceGetAttribute", e))?;
        let ptx = crate::embedded_ptx::choose(major as u32, minor as u32).ok_or_else(|| {
            Error::Unsupported(format!(
                "device {} has compute capability {major}.{minor}; this build has PTX for {} (sm_80 or newer is supported; \
                 set TP_ALLREDUCE_PTX_ARCHS when building to add architectures)",
                ctx.ordinal(),
                crate::embedded_ptx::embedded().iter().map(|p| p.arch).collect::<Vec<_>>().join(", ")
            ))
        })?;
        let module = Arc::new(Self::load(ctx, ptx)?);
        map.insert(key, module.clone());
        Ok(module)
    }

    fn load(ctx: &Arc<CudaContext>, ptx: EmbeddedPtx) -> Result<KernelModule> {
        let _bound = CurrentContext::bind(ctx)?;
        let mut image = ptx.text.as_bytes().to_vec();
        image.push(0);
        let mut log = vec![0u8; 16 * 1024];
        let mut options =
            [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
        let mut values = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
        let mut module: sys::CUmodule = std::ptr::null_mut();
        let loaded = cu!(cuModuleLoadDataEx(
            &mut module,
            image.as_ptr() as *const c_void,
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr()
        ));
        if let Err(e) = loaded {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            return Err(Error::Unsupported(format!(
                "loading the {} PTX failed: {e}; JIT log: {}",
                ptx.arch,
                String::from_utf8_lossy(&log[..end]).trim()
            )));
        }
        // Owned from here on, so an error below unloads it again.
        let clusters = ptx.sm >= crate::embedded_ptx::CLUSTER_MIN_SM
            && super::device_attribute(ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH)? == 1;
        let mut loaded = KernelModule { ctx: ctx.clone(), module, kernels: HashMap::new(), arch: ptx.arch, clusters };
        for (name, params) in entry_signatures(ptx.text)? {
            let cname = std::ffi::CString::new(name)
                .map_err(|_| Error::Unsupported(format!("kernel name {name:?} contains NUL")))?;
            let mut function: sys::CUfunction = std::ptr::null_mut();
            cu!(cuModuleGetFunction(&mut function, module, cname.as_ptr()))?;
            loaded.kernels.insert(name.to_string(), Kernel { function, params, name: Arc::from(name) });
        }
        Ok(loaded)
    }

    /// The entry `name` (looked up once, at init: callers keep the handle).
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        self.kernels
            .get(name)
            .cloned()
            .ok_or_else(|| Error::Unsupported(format!("kernel `{name}` is not in the loaded PTX ({})", self.arch)))
    }

    /// Most blocks of `threads` threads of kernel `name` one SM holds at once.
    pub fn max_blocks_per_sm(&self, name: &str, threads: u32) -> Result<u32> {
        let kernel = self.kernel(name)?;
        let _bound = CurrentContext::bind(&self.ctx)?;
        let mut blocks: i32 = 0;
        cu!(cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, kernel.function, threads as i32, 0))?;
        Ok(blocks.max(0) as u32)
    }
}

impl KernelModule {
    /// Launches the init-time P2P check, `p2p_check(handle, salt)`, as one
    /// block on `stream` with the stream's context bound for the launch.
    /// `handle` must be the communicator's device handle as init writes it
    /// (every rank's mapped region, this rank's local state): the kernel
    /// reads and writes exactly those.
    pub(crate) fn launch_p2p_check(
        &self,
        stream: &cudarc::driver::CudaStream,
        handle: &super::DeviceMemory,
        salt: u32,
    ) -> Result<()> {
        let kernel = self.kernel(tp_allreduce_kernels::ids::AlgorithmId::P2pCheck.kernel_prefix())?;
        let args = KernelArgs::new().u64(handle.ptr()).u32(salt);
        let _bound = CurrentContext::bind(stream.context())?;
        // SAFETY: the arguments are `p2p_check(*const DeviceHandle, u32)`
        // (their sizes checked against the PTX by `launch`); `handle` is
        // library-owned device memory holding a complete DeviceHandle (the
        // caller's contract), whose regions stay mapped until the caller has
        // synchronised the stream; the context is bound.
        unsafe { launch(&kernel, 1, tp_allreduce_kernels::layout::THREADS_PER_BLOCK, stream.cu_stream(), &args) }
    }
}

impl Drop for KernelModule {
    fn drop(&mut self) {
        if let Ok(_bound) = CurrentContext::bind(&self.ctx) {
            // SAFETY: the module was loaded by us and is unloaded once.
            let _ = unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

/// Most parameters of an entry (the fused pull takes eleven).
const MAX_PARAMS: usize = 16;

/// The byte sizes of an entry's parameters, as its PTX declares them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signature {
    sizes: [u32; MAX_PARAMS],
    count: usize,
}

impl Signature {
    fn new(sizes: &[u32]) -> Option<Signature> {
        let mut s = Signature { sizes: [0; MAX_PARAMS], count: sizes.len() };
        s.sizes.get_mut(..sizes.len())?.copy_from_slice(sizes);
        Some(s)
    }

    pub fn sizes(&self) -> &[u32] {
        &self.sizes[..self.count]
    }
}

/// Every `.entry` of `ptx` with its parameter sizes: `.param .u64 x`
/// (8 bytes), `.param .u32 x` / `.f32` (4), `.param .align 16 .b8 x[N]`
/// (N: a struct by value).
pub fn entry_signatures(ptx: &str) -> Result<Vec<(&str, Signature)>> {
    let mut entries = Vec::new();
    let mut lines = ptx.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.strip_prefix(".visible .entry ").or_else(|| line.strip_prefix(".entry ")) else {
            continue;
        };
        let name = rest.split('(').next().unwrap_or("").trim();
        let mut sizes = Vec::new();
        for param in lines.by_ref().map(str::trim) {
            if param.starts_with(')') {
                break;
            }
            if !param.starts_with(".param") {
                continue;
            }
            let size = match param.split_once('[') {
                Some((_, n)) => n.split(']').next().and_then(|n| n.trim().parse().ok()),
                None => param.split_whitespace().find_map(|t| match t {
                    ".u64" | ".s64" | ".b64" | ".f64" => Some(8),
                    ".u32" | ".s32" | ".b32" | ".f32" => Some(4),
                    ".u16" | ".s16" | ".b16" | ".f16" => Some(2),
                    ".u8" | ".s8" | ".b8" => Some(1),
                    _ => None,
                }),
            };
            sizes
                .push(size.ok_or_else(|| Error::Unsupported(format!("entry {name}: unreadable parameter `{param}`")))?);
        }
        let signature = Signature::new(&sizes)
            .ok_or_else(|| Error::Unsupported(format!("entry {name}: more than {MAX_PARAMS} parameters")))?;
        entries.push((name, signature));
    }
    Ok(entries)
}

/// One entry of the loaded module: its function and its parameter sizes,
/// which every launch checks its arguments against (a mismatch is an
/// error, never a launch).
#[derive(Clone, Debug)]
pub struct Kernel {
    function: sys::CUfunction,
    params: Signature,
    name: Arc<str>,
}

// SAFETY: a CUfunction of a module loaded for the process lifetime is
// usable from any thread once its context is bound.
unsafe impl Send for Kernel {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for Kernel {}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn signature(&self) -> Signature {
        self.params
    }

    /// `Ok` when `given` are the sizes of the declared parameters.
    fn check(&self, given: impl Iterator<Item = u32> + Clone) -> Result<()> {
        if given.clone().eq(self.params.sizes().iter().copied()) {
            return Ok(());
        }
        Err(Error::Unsupported(format!(
            "kernel `{}` declares parameters of {:?} bytes but was launched with {:?} (the host and the PTX \
             disagree: rebuild)",
            self.name,
            self.params.sizes(),
            given.collect::<Vec<_>>()
        )))
    }
}

/// A kernel argument list: each entry points at one argument value, which
/// must outlive the launch call (the driver copies them at launch).
pub struct KernelArgs {
    values: Vec<u64>,
    kinds: Vec<ArgKind>,
}

#[derive(Clone, Copy)]
enum ArgKind {
    U64,
    U32,
    F32,
}

impl KernelArgs {
    pub fn new() -> Self {
        KernelArgs { values: Vec::with_capacity(12), kinds: Vec::with_capacity(12) }
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.values.push(v);
        self.kinds.push(ArgKind::U64);
        self
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.values.push(v as u64);
        self.kinds.push(ArgKind::U32);
        self
    }
    pub fn f32(mut self, v: f32) -> Self {
        self.values.push(v.to_bits() as u64);
        self.kinds.push(ArgKind::F32);
        self
    }

    fn sizes(&self) -> impl Iterator<Item = u32> + Clone + '_ {
        self.kinds.iter().map(|k| if matches!(k, ArgKind::U64) { 8 } else { 4 })
    }
}

impl Default for KernelArgs {
    fn default() -> Self {
        Self::new()
    }
}

/// One `#[repr(C)]` parameter struct passed by value (`kernelParams =
/// [&params]`; the driver copies its bytes into the kernel's parameter
/// space at launch, so it only has to live for the launch call — a graph
/// capture records the copy).
#[derive(Clone, Copy)]
pub struct ParamStruct<'a> {
    ptr: *const c_void,
    size: usize,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> ParamStruct<'a> {
    pub fn of<P: Copy>(params: &'a P) -> ParamStruct<'a> {
        ParamStruct { ptr: params as *const P as *const c_void, size: std::mem::size_of::<P>(), _borrow: PhantomData }
    }
}

/// Launches `kernel` with a 1-D grid on `stream`, after checking `args`
/// against the kernel's declared parameters.
///
/// # Safety
/// Every pointer argument must be valid for the kernel's accesses. The
/// context of `kernel` (and of `stream`) must be current on this thread:
/// bind it with [`CurrentContext::bind`] first.
pub unsafe fn launch(kernel: &Kernel, grid: u32, block: u32, stream: sys::CUstream, args: &KernelArgs) -> Result<()> {
    kernel.check(args.sizes())?;
    // u32 arguments must be passed as 4-byte values; keep separate storage.
    let mut small: Vec<u32> = Vec::with_capacity(args.values.len());
    for (v, k) in args.values.iter().zip(args.kinds.iter()) {
        if matches!(k, ArgKind::U32 | ArgKind::F32) {
            small.push(*v as u32);
        }
    }
    let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(args.values.len());
    let mut s = 0;
    for (i, k) in args.kinds.iter().enumerate() {
        match k {
            ArgKind::U64 => ptrs.push(&args.values[i] as *const u64 as *mut c_void),
            ArgKind::U32 | ArgKind::F32 => {
                ptrs.push(&small[s] as *const u32 as *mut c_void);
                s += 1;
            }
        }
    }
    cu!(cuLaunchKernel(kernel.function, grid, 1, 1, block, 1, 1, 0, stream, ptrs.as_mut_ptr(), std::ptr::null_mut()))
}

/// Launches `kernel` with a 1-D grid of `grid` blocks of `block` threads on
/// `stream`, passing `params` by value as its one parameter, after
/// checking that the kernel declares exactly one parameter of that size.
/// With `cluster > 1` the grid is cut into thread-block clusters of
/// `cluster` blocks (`cuLaunchKernelEx` with the cluster-dimension
/// attribute; sm_90 and newer; a graph capture records the attribute).
///
/// # Safety
/// * `params` has the layout of the kernel's parameter struct (shared
///   through `tp_allreduce_kernels::params`; the size is checked here).
/// * Every address in `params` must be valid for the kernel's accesses for
///   as long as the launch (or any replay of a graph capturing it) runs.
/// * `grid` and `block` must be a shape the kernel supports (the caller
///   checks residency and the block limit: the kernel validates nothing);
///   with `cluster > 1`, `grid` is a multiple of `cluster`, `cluster` at
///   most 8 (the portable cluster size), and the kernel is an entry
///   written for clusters.
/// * The kernel's context is current on this thread.
pub unsafe fn launch_by_value(
    kernel: &Kernel,
    grid: u32,
    block: u32,
    cluster: u32,
    stream: sys::CUstream,
    params: ParamStruct<'_>,
) -> Result<()> {
    kernel.check(std::iter::once(params.size as u32))?;
    let mut args = [params.ptr as *mut c_void];
    let f = kernel.function;
    if cluster <= 1 {
        return cu!(cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, args.as_mut_ptr(), std::ptr::null_mut()));
    }
    // SAFETY: an all-zero launch attribute is a valid (ignored) value.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attribute.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster, y: 1, z: 1 };
    let config = sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream,
        attrs: &mut attribute,
        numAttrs: 1,
    };
    cu!(cuLaunchKernelEx(&config, f, args.as_mut_ptr(), std::ptr::null_mut()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_come_from_the_parameter_lists() {
        let ptx = "\
.visible .entry ring_f32(
\t.param .u64 .ptr .align 1 ring_f32_param_0,
\t.param .u32 ring_f32_param_1,
\t.param .f32 ring_f32_param_2
)
.maxnreg 128
{
}
.visible .entry one_shot_push_f32(
\t.param .align 16 .b8 one_shot_push_f32_param_0[288]
)
{
}
";
        let entries = entry_signatures(ptx).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!((entries[0].0, entries[0].1.sizes()), ("ring_f32", &[8, 4, 4][..]));
        assert_eq!((entries[1].0, entries[1].1.sizes()), ("one_shot_push_f32", &[288][..]));
    }

    #[test]
    fn every_embedded_entry_has_a_readable_signature() {
        for p in crate::embedded_ptx::embedded() {
            let entries = entry_signatures(p.text).unwrap();
            assert!(entries.len() > 60, "{}: {} entries", p.arch, entries.len());
        }
    }
}
