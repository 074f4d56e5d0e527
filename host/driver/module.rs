//! The library's kernels: the PTX module loaded once per context, kernel
//! argument lists, and the launch.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext};

use super::{cu, CurrentContext};
use crate::error::{Error, Result};
use crate::kernels::EmbeddedPtx;

/// The library's kernels loaded into one context.
pub struct KernelModule {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    functions: HashMap<String, sys::CUfunction>,
    pub arch: &'static str,
    /// The PTX has the cluster entries (`kernels::cluster_entries`) and
    /// the device launches thread-block clusters.
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
        let ptx = crate::kernels::choose(major as u32, minor as u32).ok_or_else(|| {
            Error::Unsupported(format!(
                "device {} has compute capability {major}.{minor}; this build has PTX for {} (sm_80 or newer is supported; \
                 set TP_ALLREDUCE_PTX_ARCHS when building to add architectures)",
                ctx.ordinal(),
                crate::kernels::embedded().iter().map(|p| p.arch).collect::<Vec<_>>().join(", ")
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
        let clusters = ptx.sm >= crate::kernels::CLUSTER_MIN_SM
            && super::device_attribute(ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH)? == 1;
        let mut loaded = KernelModule { ctx: ctx.clone(), module, functions: HashMap::new(), arch: ptx.arch, clusters };
        for name in crate::kernels::expected_entries_for(ptx.sm) {
            let cname = std::ffi::CString::new(name.clone())
                .map_err(|_| Error::Unsupported(format!("kernel name {name:?} contains NUL")))?;
            let mut f: sys::CUfunction = std::ptr::null_mut();
            cu!(cuModuleGetFunction(&mut f, module, cname.as_ptr()))?;
            loaded.functions.insert(name, f);
        }
        Ok(loaded)
    }

    pub fn function(&self, name: &str) -> Result<sys::CUfunction> {
        self.functions
            .get(name)
            .copied()
            .ok_or_else(|| Error::Unsupported(format!("kernel `{name}` is not in the loaded PTX ({})", self.arch)))
    }

    /// Most blocks of `threads` threads of kernel `name` one SM holds at once.
    pub fn max_blocks_per_sm(&self, name: &str, threads: u32) -> Result<u32> {
        let f = self.function(name)?;
        let _bound = CurrentContext::bind(&self.ctx)?;
        let mut blocks: i32 = 0;
        cu!(cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, f, threads as i32, 0))?;
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
        let f = self.function(tp_allreduce_kernels::ids::AlgorithmId::P2pCheck.kernel_prefix())?;
        let args = KernelArgs::new().u64(handle.ptr()).u32(salt);
        let _bound = CurrentContext::bind(stream.context())?;
        // SAFETY: the argument list matches `p2p_check(*const DeviceHandle,
        // u32)`; `handle` is library-owned device memory holding a complete
        // DeviceHandle (the caller's contract), whose regions stay mapped
        // until the caller has synchronised the stream; the context is bound.
        unsafe { launch(f, 1, tp_allreduce_kernels::layout::THREADS_PER_BLOCK, stream.cu_stream(), &args) }
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
        KernelArgs { values: Vec::with_capacity(8), kinds: Vec::with_capacity(8) }
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
}

impl Default for KernelArgs {
    fn default() -> Self {
        Self::new()
    }
}

/// Launches `f` with a 1-D grid on `stream`.
///
/// # Safety
/// `args` must match the kernel's parameter list (types and order) and every
/// pointer argument must be valid for the kernel's accesses. The context of
/// `f` (and of `stream`) must be current on this thread: bind it with
/// [`CurrentContext::bind`] first.
pub unsafe fn launch(
    f: sys::CUfunction,
    grid: u32,
    block: u32,
    stream: sys::CUstream,
    args: &KernelArgs,
) -> Result<()> {
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
    cu!(cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, ptrs.as_mut_ptr(), std::ptr::null_mut()))
}
