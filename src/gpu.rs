//! The CUDA device as the runners see it: detection without panics, device facts for the
//! document, NVRTC compilation timed as `compile_s`, memory readings and event timing.
//!
//! Everything here builds on every machine (cudarc loads the CUDA libraries at run time); a
//! machine without them gets [`GpuError::NoDevice`], never a panic.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};

use crate::schema::{self, DeviceKind};

/// Errors of the device layer.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No CUDA driver library, or no device.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    /// NVRTC rejected a kernel source; `log` is the compiler's output.
    #[error("NVRTC failed to compile {name}:\n{log}")]
    Compile {
        /// Kernel source name.
        name: String,
        /// Compiler log.
        log: String,
    },
    /// A kernel configuration was rejected.
    #[error("kernel configuration: {0}")]
    Config(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS error: {0}")]
    Cublas(String),
    /// This device does not run what was asked (a kernel for another architecture): the
    /// runners record the case as `unsupported` with this reason.
    #[error("{0}")]
    Unsupported(String),
}

impl GpuError {
    /// True when the error is the device running out of memory.
    pub fn is_oom(&self) -> bool {
        matches!(self, GpuError::Driver(e) if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY)
            || matches!(self, GpuError::Cublas(m) if m.contains("ALLOC_FAILED"))
    }
}

/// Checks that the CUDA driver and NVRTC libraries can be loaded and that a device exists.
///
/// # Errors
/// [`GpuError::NoDevice`] naming what is missing.
pub fn detect() -> Result<(), GpuError> {
    // SAFETY: these only try to dlopen the libraries; they call no CUDA function.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver {
        return Err(GpuError::NoDevice(
            "the CUDA driver library (libcuda) is not installed on this machine".into(),
        ));
    }
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !nvrtc {
        return Err(GpuError::NoDevice(
            "the NVRTC library (libnvrtc) is not on the loader path; add the CUDA toolkit's lib directory to LD_LIBRARY_PATH".into(),
        ));
    }
    let n = CudaContext::device_count()
        .map_err(|e| GpuError::NoDevice(format!("cuDeviceGetCount failed: {e}")))?;
    if n < 1 {
        return Err(GpuError::NoDevice("the driver reports 0 devices".into()));
    }
    Ok(())
}

/// True when cuBLAS can be loaded.
pub fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// Where a call of the project's public functions runs (`attention::dot_product_attention`,
/// `kernel_sums::kernel_logsumexp`, ...).
#[derive(Clone, Copy)]
pub enum Device<'g> {
    /// This machine's cores (rayon's global pool).
    Cpu,
    /// An opened CUDA device; kernels compile on first use and are cached in the [`Gpu`].
    Cuda(&'g Gpu),
}

/// An opened device with its default stream.
pub struct Gpu {
    /// The primary context of device 0.
    pub ctx: Arc<CudaContext>,
    /// The stream every launch and event uses.
    pub stream: Arc<CudaStream>,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    /// Modules compiled in this process, by name and source ([`Gpu::compile`]).
    modules: std::sync::Mutex<BTreeMap<(String, u64), Arc<CudaModule>>>,
}

/// A compiled and loaded kernel module with the time it took.
pub struct Compiled {
    /// The loaded module.
    pub module: Arc<CudaModule>,
    /// NVRTC compile plus module load time, s.
    pub compile_s: f64,
}

impl Gpu {
    /// Opens device `ordinal` after [`detect`] succeeds.
    ///
    /// # Errors
    /// [`GpuError::NoDevice`] on a machine without CUDA; driver errors otherwise.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        detect()?;
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: the runners use one stream, so cross-stream event tracking is not needed;
        // it would add an event record per argument per launch to every timed call.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own, not the legacy default stream, which CUDA graphs cannot capture.
        let stream = ctx.new_stream()?;
        let cc = ctx.compute_capability()?;
        Ok(Gpu {
            ctx,
            stream,
            cc,
            modules: Default::default(),
        })
    }

    /// The NVRTC architecture flag for this device: `sm_90a` on Hopper (for its own
    /// instructions), `sm_XY` otherwise.
    pub fn arch(&self) -> String {
        let (ma, mi) = self.cc;
        if (ma, mi) == (9, 0) {
            "sm_90a".into()
        } else {
            format!("sm_{ma}{mi}")
        }
    }

    /// Compiles `src` with NVRTC to this device's machine code ([`nvrtc_compile_cubin`]) and
    /// loads it; `compile_s` is the compile plus the load. A source this process already
    /// compiled under the same name is reused (`compile_s` 0): tests that run many cases compile
    /// each instantiation once.
    ///
    /// With [`KERNEL_CACHE_ENV`] naming a folder (the runner makes a fresh one per runner
    /// process for its case processes), a source compiled by an earlier case process is loaded
    /// from the machine code kept there, and `compile_s` is the time that first compile and load
    /// took: every row reports what compiling its kernels costs, and each source is compiled once
    /// per runner process (each shard or `--filter` part compiles its own; the repetitions of
    /// `--runs` share it). The cache is keyed by name, source, compile options and NVRTC
    /// version; a missing or unreadable entry is compiled again.
    ///
    /// # Errors
    /// [`GpuError::Compile`] with the compiler log; driver errors from loading.
    pub fn compile(&self, name: &str, src: &str) -> Result<Compiled, GpuError> {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        src.hash(&mut hasher);
        let key = (name.to_string(), hasher.finish());
        if let Some(m) = self.modules.lock().expect("module cache").get(&key) {
            return Ok(Compiled {
                module: m.clone(),
                compile_s: 0.0,
            });
        }
        let arch = self.arch();
        let cache = std::env::var_os(KERNEL_CACHE_ENV)
            .map(|d| KernelCache::new(std::path::PathBuf::from(d), name, src, &arch));
        let (module, compile_s) = match cache.as_ref().and_then(KernelCache::read) {
            Some((cubin, first_s)) => {
                let module = self
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
                (module, first_s)
            }
            None => {
                let t0 = Instant::now();
                let cubin = nvrtc_compile_cubin(name, src, &arch)?;
                let kept = cache.as_ref().map(|_| cubin.clone());
                let module = self
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
                let s = t0.elapsed().as_secs_f64();
                if let (Some(c), Some(cubin)) = (&cache, kept) {
                    c.write(&cubin, s);
                }
                (module, s)
            }
        };
        self.modules
            .lock()
            .expect("module cache")
            .insert(key, module.clone());
        Ok(Compiled { module, compile_s })
    }

    /// Looks up `name` in `module` and raises its dynamic shared-memory limit to at least
    /// `smem_bytes`. The limit belongs to the function, which every user of the cached module
    /// shares, so it is only ever raised: a later user asking for less never lowers what an
    /// earlier one launches with.
    pub fn function(
        &self,
        module: &Arc<CudaModule>,
        name: &str,
        smem_bytes: u32,
    ) -> Result<CudaFunction, GpuError> {
        use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as LIMIT;
        let f = module.load_function(name)?;
        if smem_bytes > 48 * 1024 && f.get_attribute(LIMIT)? < smem_bytes as i32 {
            f.set_attribute(LIMIT, smem_bytes as i32)?;
        }
        Ok(f)
    }

    /// Device memory in use by every process (total − free), bytes.
    pub fn used_bytes(&self) -> Result<u64, GpuError> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok((total - free) as u64)
    }

    /// Runs `f` `inner` times between two timing events on the stream and returns the elapsed
    /// device time and the host's time to issue the calls (from before the first to after the
    /// last launch returned), both in ms. `f` receives the call index (for input rotation).
    pub fn time_calls(
        &self,
        inner: u32,
        mut f: impl FnMut(u32) -> Result<(), GpuError>,
    ) -> Result<crate::harness::Sample, GpuError> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags)?;
        let end = self.ctx.new_event(flags)?;
        start.record(&self.stream)?;
        let t0 = Instant::now();
        for i in 0..inner {
            f(i)?;
        }
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        end.record(&self.stream)?;
        let ms = start.elapsed_ms(&end)?;
        self.ctx.check_err()?;
        Ok(crate::harness::Sample {
            device_ms: ms as f64,
            host_ms,
        })
    }

    /// `n` 16-bit words on the device with every byte 0xFF (each word 0xFFFF: NaN in bf16 and
    /// fp16, and each pair of words NaN in fp32), set on the device: the poison a case's
    /// outputs start from, so that an element the call does not write fails the check (built on
    /// the host, the MoE grid's largest output would need a 7.5 GB host buffer and its copy).
    /// `n = 0` gives an empty slice, as copying an empty host slice does.
    ///
    /// # Errors
    /// Out-of-memory and driver errors.
    pub fn poisoned_u16(&self, n: usize) -> Result<cudarc::driver::CudaSlice<u16>, GpuError> {
        use cudarc::driver::DevicePtrMut;
        if n == 0 {
            return Ok(self.stream.clone_htod(&[0u16; 0][..])?);
        }
        // SAFETY: every byte of the allocation is written by the memset below, on this stream,
        // before anything can read it.
        let mut d = unsafe { self.stream.alloc::<u16>(n) }?;
        {
            let (ptr, _record) = d.device_ptr_mut(&self.stream);
            // SAFETY: `ptr` is `n` u16 (2 n bytes) of this stream's allocation.
            unsafe {
                cudarc::driver::result::memset_d8_async(ptr, 0xFF, 2 * n, self.stream.cu_stream())
            }?;
        }
        Ok(d)
    }

    /// Captures the calls `f` makes (its launches on [`Gpu::stream`]) into a CUDA graph, once,
    /// and returns it ready to replay; `Ok(None)` when the stream captured nothing.
    ///
    /// # Errors
    /// The capture or the instantiation fails (a call that synchronises or allocates host
    /// memory cannot be captured); the stream is left out of capture mode.
    pub fn capture(
        &self,
        f: impl FnOnce() -> Result<(), GpuError>,
    ) -> Result<Option<cudarc::driver::CudaGraph>, GpuError> {
        use cudarc::driver::sys;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let called = f();
        // End the capture whatever happened, so the stream is usable again.
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        called?;
        let graph = graph?;
        if let Some(g) = &graph {
            g.upload()?;
        }
        self.stream.synchronize()?;
        Ok(graph)
    }

    /// Replays `graph` between two events on the stream: its device time and the host's time
    /// to issue the replay, ms.
    ///
    /// # Errors
    /// A launch, event or synchronisation error.
    pub fn time_replay(
        &self,
        graph: &cudarc::driver::CudaGraph,
    ) -> Result<crate::harness::Sample, GpuError> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags)?;
        let end = self.ctx.new_event(flags)?;
        start.record(&self.stream)?;
        let t0 = Instant::now();
        graph.launch()?;
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        end.record(&self.stream)?;
        let ms = start.elapsed_ms(&end)?;
        self.ctx.check_err()?;
        Ok(crate::harness::Sample {
            device_ms: ms as f64,
            host_ms,
        })
    }

    /// The dense bf16 tensor-core ceiling as cuBLAS reaches it here: a `n`×`n`×`n` bf16 GEMM
    /// (fp32 accumulation) on uniform random inputs in [−1, 1) (never zeros or constants, which
    /// run faster than real data), warmed up, then the median of `repeats` timed calls;
    /// TFLOP/s (2·n³ FLOPs per call).
    ///
    /// # Errors
    /// cuBLAS or a launch fails (out of memory for large `n`).
    pub fn bf16_gemm_tflops(&self, n: usize, repeats: usize) -> Result<f64, GpuError> {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
        };
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let blas = cudarc::cublas::CudaBlas::new(self.stream.clone())
            .map_err(|e| GpuError::Cublas(format!("{e:?}")))?;
        // A small xorshift generator: reproducible, no dependency, good enough to toggle bits.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut random = |len: usize| -> Vec<u16> {
            (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                    half::bf16::from_f64(2.0 * u - 1.0).to_bits()
                })
                .collect()
        };
        let a = self.stream.clone_htod(&random(n * n))?;
        let b = self.stream.clone_htod(&random(n * n))?;
        let mut c = self.stream.alloc_zeros::<u16>(n * n)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ni = n as i32;
        let mut gemm = || -> Result<(), GpuError> {
            let (ap, _ga) = a.device_ptr(&self.stream);
            let (bp, _gb) = b.device_ptr(&self.stream);
            let (cp, _gc) = c.device_ptr_mut(&self.stream);
            // SAFETY: A, B and C are live n×n bf16 device buffers; alpha and beta are host
            // f32, matching CUBLAS_COMPUTE_32F.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas.handle(),
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_N,
                    ni,
                    ni,
                    ni,
                    &alpha as *const f32 as *const _,
                    ap as *const _,
                    cudaDataType_t::CUDA_R_16BF,
                    ni,
                    bp as *const _,
                    cudaDataType_t::CUDA_R_16BF,
                    ni,
                    &beta as *const f32 as *const _,
                    cp as *mut _,
                    cudaDataType_t::CUDA_R_16BF,
                    ni,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
                .map_err(|e| GpuError::Cublas(format!("{e:?}")))?;
            }
            Ok(())
        };
        for _ in 0..5 {
            gemm()?;
        }
        self.stream.synchronize()?;
        let mut ms = Vec::with_capacity(repeats);
        for _ in 0..repeats.max(1) {
            ms.push(self.time_calls(1, |_| gemm())?.device_ms);
        }
        let median = crate::harness::summarize(&ms)
            .map(|s| s.median_ms)
            .unwrap_or(f64::NAN);
        Ok(2.0 * (n as f64).powi(3) / (median * 1e-3) / 1e12)
    }

    /// Device memory bandwidth as a device-to-device copy reaches it: `bytes` copied, the
    /// median of `repeats` timed copies; GB/s counting bytes read plus bytes written.
    ///
    /// # Errors
    /// An allocation or the copy fails.
    pub fn copy_gbps(&self, bytes: usize, repeats: usize) -> Result<f64, GpuError> {
        let src = self.stream.clone_htod(&vec![0x5a5a_u16; bytes / 2])?;
        let mut dst = self.stream.alloc_zeros::<u16>(bytes / 2)?;
        for _ in 0..3 {
            self.stream.memcpy_dtod(&src, &mut dst)?;
        }
        self.stream.synchronize()?;
        let mut ms = Vec::with_capacity(repeats);
        for _ in 0..repeats.max(1) {
            ms.push(
                self.time_calls(1, |_| {
                    self.stream.memcpy_dtod(&src, &mut dst)?;
                    Ok(())
                })?
                .device_ms,
            );
        }
        let median = crate::harness::summarize(&ms)
            .map(|s| s.median_ms)
            .unwrap_or(f64::NAN);
        Ok(2.0 * (bytes / 2 * 2) as f64 / (median * 1e-3) / 1e9)
    }

    /// The device's current memory pool, which cudarc's stream allocations come from
    /// (`cuMemAllocAsync` on the stream when the device supports memory pools).
    fn mem_pool(&self) -> Result<cudarc::driver::sys::CUmemoryPool, GpuError> {
        // SAFETY: the device handle comes from the live context.
        Ok(unsafe { cudarc::driver::result::device::get_mem_pool(self.ctx.cu_device())? })
    }

    fn pool_attr(&self, attr: cudarc::driver::sys::CUmemPool_attribute) -> Result<u64, GpuError> {
        let pool = self.mem_pool()?;
        let mut v: u64 = 0;
        // SAFETY: the USED/RESERVED_MEM_* attributes are cuuint64_t values.
        unsafe {
            cudarc::driver::result::mem_pool::get_attribute(
                pool,
                attr,
                &mut v as *mut u64 as *mut std::ffi::c_void,
            )?
        };
        Ok(v)
    }

    /// True when allocations come from the stream-ordered memory pool, so that
    /// [`Gpu::pool_reset_peaks`] and [`Gpu::pool_peaks`] see them.
    pub fn has_pool(&self) -> bool {
        self.ctx.has_async_alloc()
    }

    /// Resets the pool's high-water marks (`CU_MEMPOOL_ATTR_USED_MEM_HIGH` and
    /// `RESERVED_MEM_HIGH`) and returns the bytes in use and reserved now, the baseline
    /// [`Gpu::pool_peaks`] is read against.
    pub fn pool_reset_peaks(&self) -> Result<(u64, u64), GpuError> {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        self.stream.synchronize()?;
        let pool = self.mem_pool()?;
        for attr in [
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: the high-water attributes accept a cuuint64_t 0 (reset).
            unsafe {
                cudarc::driver::result::mem_pool::set_attribute(
                    pool,
                    attr,
                    &mut zero as *mut u64 as *mut std::ffi::c_void,
                )?
            };
        }
        Ok((
            self.pool_attr(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            self.pool_attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        ))
    }

    /// Bytes used and reserved at the pool's high-water marks since [`Gpu::pool_reset_peaks`],
    /// above the baseline it returned.
    pub fn pool_peaks(&self, base: (u64, u64)) -> Result<(u64, u64), GpuError> {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        self.stream.synchronize()?;
        let used = self.pool_attr(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?;
        let reserved = self.pool_attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?;
        Ok((used.saturating_sub(base.0), reserved.saturating_sub(base.1)))
    }

    /// The device's PCI bus id, e.g. `0000:1B:00.0` (to find it in NVML).
    pub fn pci_bus_id(&self) -> Option<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: writes at most `len` bytes, NUL-terminated, into `buf`.
        let r = unsafe {
            cudarc::driver::sys::cuDeviceGetPCIBusId(
                buf.as_mut_ptr(),
                buf.len() as i32,
                self.ctx.cu_device(),
            )
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        // SAFETY: NUL-terminated by the driver on success.
        let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Some(s.to_string_lossy().into_owned())
    }

    /// The device's facts for the document.
    pub fn describe(&self) -> Result<schema::Device, GpuError> {
        let sm = self.sm_count()?;
        let l2 = self.l2_bytes()?;
        Ok(schema::Device {
            kind: DeviceKind::Gpu,
            name: self.ctx.name()?,
            compute_capability: Some(format!("{}.{}", self.cc.0, self.cc.1)),
            sm_count: Some(sm as u32),
            memory_mb: Some(self.ctx.total_mem()? as f64 / 1e6),
            l2_mb: Some(l2 as f64 / 1e6),
            driver_version: kernel_driver_version(),
            cuda_version: driver_api_version(),
            cpu_threads: None,
            host_cpu: None,
            os: None,
            nvrtc_arch: Some(self.arch()),
            power_limit_w: None,
            max_sm_clock_mhz: None,
            max_mem_clock_mhz: None,
        })
    }

    /// L2 cache size in bytes.
    pub fn l2_bytes(&self) -> Result<u64, GpuError> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        Ok(self.ctx.attribute(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u64)
    }

    /// Streaming multiprocessors on the device (132 on the H100 SXM and the H200).
    ///
    /// # Errors
    /// The driver's, when the attribute cannot be read.
    pub fn sm_count(&self) -> Result<usize, GpuError> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        Ok(self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize)
    }
}

/// Environment variable naming a folder that keeps compiled kernels between the processes of
/// one run ([`Gpu::compile`]).
pub const KERNEL_CACHE_ENV: &str = "KP_KERNEL_CACHE";

/// One source's entry in a [`KERNEL_CACHE_ENV`] folder: `<key>.cubin` (machine code) and
/// `<key>.compile_s` (seconds the first compile and load took), `key` a SHA-256 of the name,
/// source, compile options (the architecture among them) and NVRTC version.
struct KernelCache {
    cubin: std::path::PathBuf,
    seconds: std::path::PathBuf,
}

impl KernelCache {
    fn new(dir: std::path::PathBuf, name: &str, src: &str, arch: &str) -> KernelCache {
        use sha2::Digest;
        let nvrtc = nvrtc_version().unwrap_or_default();
        let options = nvrtc_options(arch).join(" ");
        let mut h = sha2::Sha256::new();
        for part in [name, src, options.as_str(), nvrtc.as_str()] {
            h.update(part.as_bytes());
            h.update([0u8]);
        }
        let key: String = h.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        KernelCache {
            cubin: dir.join(format!("{key}.cubin")),
            seconds: dir.join(format!("{key}.compile_s")),
        }
    }

    /// The machine code and first compile time, when both are there and readable.
    fn read(&self) -> Option<(Vec<u8>, f64)> {
        let s: f64 = std::fs::read_to_string(&self.seconds)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cubin = std::fs::read(&self.cubin).ok()?;
        (s.is_finite() && s >= 0.0 && !cubin.is_empty()).then_some((cubin, s))
    }

    /// Keeps `cubin` and `compile_s`, each written to a temporary name and renamed (a reader
    /// never sees half a file); the seconds last, so an entry with seconds is whole. A failure
    /// is said on standard error, naming the file, and otherwise ignored: the next process
    /// compiles again.
    fn write(&self, cubin: &[u8], compile_s: f64) {
        let put = |path: &std::path::Path, bytes: &[u8]| {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            let r = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
            if let Err(e) = &r {
                let _ = std::fs::remove_file(&tmp);
                eprintln!(
                    "kernel cache: could not write {}: {e}; later processes compile again",
                    path.display()
                );
            }
            r.is_ok()
        };
        if put(&self.cubin, cubin) {
            put(&self.seconds, format!("{compile_s}").as_bytes());
        }
    }
}

/// The options every kernel of the project is compiled with, for `arch`.
fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-default-device".into(),
    ]
}

/// What one NVRTC compile produced.
struct NvrtcOutput {
    /// The compiler log (warnings; ptxas's report with `--ptxas-options=-v`).
    log: String,
    /// The PTX.
    ptx: Vec<std::ffi::c_char>,
    /// The machine code, when `arch` was a real architecture (`sm_XY`).
    cubin: Option<Vec<u8>>,
}

/// The text of NVRTC's NUL-terminated characters (a log, the PTX).
fn c_text(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `src` (named `name` in messages) with NVRTC and `opts`.
///
/// # Errors
/// [`GpuError::Compile`] with the compiler log and the options.
fn nvrtc_run(name: &str, src: &str, opts: &[String]) -> Result<NvrtcOutput, GpuError> {
    use cudarc::nvrtc::result as r;
    use cudarc::nvrtc::sys;
    let fail = |log: String| GpuError::Compile {
        name: name.to_string(),
        log: format!("{log}\n(options: {})", opts.join(" ")),
    };
    let csrc = std::ffi::CString::new(src).map_err(|e| fail(e.to_string()))?;
    let cname = std::ffi::CString::new(name).map_err(|e| fail(e.to_string()))?;
    let prog = r::create_program(&csrc, Some(&cname)).map_err(|e| fail(format!("{e:?}")))?;
    // SAFETY: `prog` was created above and is destroyed once, at the end of this function.
    let compiled = unsafe { r::compile_program(prog, opts) };
    // SAFETY: as above.
    let log = unsafe { r::get_program_log(prog) }
        .map(|l| c_text(&l))
        .unwrap_or_default();
    let out = compiled
        .map_err(|e| fail(format!("{log}\n{e:?}")))
        .and_then(|()| {
            // SAFETY: as above; the program compiled.
            let ptx =
                unsafe { r::get_ptx(prog) }.map_err(|e| fail(format!("reading the PTX: {e:?}")))?;
            let mut size = 0usize;
            // SAFETY: as above; writes one size. A virtual architecture has no CUBIN: size 0.
            let has = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
                == sys::nvrtcResult::NVRTC_SUCCESS
                && size > 0;
            let cubin = if has {
                let mut buf = vec![0u8; size];
                // SAFETY: as above; `buf` holds the `size` bytes NVRTC reported.
                let r = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) };
                if r != sys::nvrtcResult::NVRTC_SUCCESS {
                    return Err(fail(format!("reading the machine code: {r:?}")));
                }
                Some(buf)
            } else {
                None
            };
            Ok(NvrtcOutput {
                log: log.clone(),
                ptx,
                cubin,
            })
        });
    // SAFETY: as above.
    unsafe {
        let _ = r::destroy_program(prog);
    }
    out
}

/// Compiles CUDA C `src` to PTX with NVRTC for `arch` (e.g. `sm_90a`), with the options every
/// kernel of the project is built with (`--std=c++17`, `-default-device`): what the tests read
/// to inspect the generated code. Needs only the NVRTC library, no device.
///
/// # Errors
/// [`GpuError::Compile`] with the compiler log.
pub fn nvrtc_compile(name: &str, src: &str, arch: &str) -> Result<cudarc::nvrtc::Ptx, GpuError> {
    let out = nvrtc_run(name, src, &nvrtc_options(arch))?;
    Ok(cudarc::nvrtc::Ptx::from_src(c_text(&out.ptx)))
}

/// Compiles CUDA C `src` with NVRTC to machine code (CUBIN) for the real architecture `arch`
/// (e.g. `sm_90a`), with the options of [`nvrtc_compile`]: what [`Gpu::compile`] loads, so the
/// driver does not compile the PTX a second time. NVRTC runs ptxas itself for a real
/// architecture. Needs only the NVRTC library, no device.
///
/// # Errors
/// [`GpuError::Compile`] with the compiler log, or when `arch` is virtual (`compute_XY`).
pub fn nvrtc_compile_cubin(name: &str, src: &str, arch: &str) -> Result<Vec<u8>, GpuError> {
    nvrtc_run(name, src, &nvrtc_options(arch))?
        .cubin
        .ok_or_else(|| GpuError::Compile {
            name: name.to_string(),
            log: format!("no machine code for `{arch}` (a virtual architecture?)"),
        })
}

/// What ptxas reports for one kernel: registers per thread, spill bytes, stack frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PtxasReport {
    /// Kernel (entry function) name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes spilled to local memory (stores).
    pub spill_bytes: u32,
    /// Stack frame bytes.
    pub stack_bytes: u32,
    /// ptxas's advisories about wgmma in this kernel (codes C7500 to C7599, e.g. C7519:
    /// `warpgroup.arrive` injected around a wgmma, C7510 or C7512: wgmma serialized), each line as
    /// logged: a kernel whose wgmma pipeline ptxas had to break.
    pub wgmma_advisories: Vec<String>,
}

/// Compiles `src` with NVRTC to machine code for `arch` (a real architecture, e.g. `sm_90a`)
/// with `--ptxas-options=-v` and returns ptxas's resource report for every kernel: no device
/// and no `ptxas` binary needed (NVRTC links ptxas in), so kernels/TUNING.md's register and
/// spill figures come from the development machine ([`compile_with_report`]'s report alone).
///
/// # Errors
/// [`GpuError::Compile`] with the compiler log; a virtual `arch`; a report that cannot be
/// parsed.
pub fn ptxas_report(name: &str, src: &str, arch: &str) -> Result<Vec<PtxasReport>, GpuError> {
    Ok(compile_with_report(name, src, arch)?.reports)
}

/// Everything one NVRTC compile for a real architecture gives: the PTX, the machine code and
/// ptxas's report of every kernel ([`compile_with_report`]).
#[derive(Clone, Debug)]
pub struct CompiledWithReport {
    /// The PTX text.
    pub ptx: String,
    /// The machine code (CUBIN), as [`nvrtc_compile_cubin`] returns it.
    pub cubin: Vec<u8>,
    /// ptxas's resource report, as [`ptxas_report`] returns it.
    pub reports: Vec<PtxasReport>,
}

/// Compiles `src` once with NVRTC for the real architecture `arch` (e.g. `sm_90a`) with
/// `--ptxas-options=-v`, and returns the PTX, the machine code and ptxas's report together:
/// what [`nvrtc_compile`], [`nvrtc_compile_cubin`] and [`ptxas_report`] give one by one, for a
/// test that checks all three at the cost of one compile. Needs only the NVRTC library.
///
/// # Errors
/// [`GpuError::Compile`] with the compiler log; when `arch` is virtual (no machine code); a
/// report that cannot be parsed.
pub fn compile_with_report(
    name: &str,
    src: &str,
    arch: &str,
) -> Result<CompiledWithReport, GpuError> {
    let mut opts = nvrtc_options(arch);
    opts.push("--ptxas-options=-v".into());
    let out = nvrtc_run(name, src, &opts)?;
    let fail = |log: String| GpuError::Compile {
        name: name.to_string(),
        log,
    };
    let cubin = out.cubin.ok_or_else(|| {
        fail(format!(
            "no machine code for `{arch}` (a virtual architecture?)"
        ))
    })?;
    let reports =
        parse_ptxas(&out.log).ok_or_else(|| fail(format!("no ptxas report in:\n{}", out.log)))?;
    Ok(CompiledWithReport {
        ptx: c_text(&out.ptx),
        cubin,
        reports,
    })
}

/// Parses `ptxas -v` output: "Compiling entry function 'k'", "N bytes stack frame, N bytes
/// spill stores", "Used N registers", and the wgmma advisories (codes C75xx) of each kernel.
fn parse_ptxas(log: &str) -> Option<Vec<PtxasReport>> {
    let num_before = |line: &str, what: &str| -> Option<u32> {
        let i = line.find(what)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    let mut out: Vec<PtxasReport> = Vec::new();
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            out.push(PtxasReport {
                kernel: rest.split('\'').next()?.to_string(),
                registers: 0,
                spill_bytes: 0,
                stack_bytes: 0,
                wgmma_advisories: Vec::new(),
            });
        } else if let Some(last) = out.last_mut() {
            if let Some(n) = num_before(line, "bytes stack frame") {
                last.stack_bytes = n;
            }
            if let Some(n) = num_before(line, "bytes spill stores") {
                last.spill_bytes = n;
            }
            if let Some(n) = num_before(line, "registers") {
                last.registers = n;
            }
        }
    }
    // Advisories name their function ("... in function 'k'", C7512: "... for the function
    // 'k'") and may come before its entry.
    for line in log.lines().filter(|l| l.contains("(C75")) {
        let name = line.rfind("function '").map_or("", |i| {
            line[i + "function '".len()..]
                .split('\'')
                .next()
                .unwrap_or("")
        });
        // One that names no kernel of the log (a device function's name, no name, a form not
        // seen yet) goes to every kernel rather than nowhere.
        match out.iter_mut().find(|r| r.kernel == name) {
            Some(r) => r.wgmma_advisories.push(line.trim().to_string()),
            None => out
                .iter_mut()
                .for_each(|r| r.wgmma_advisories.push(line.trim().to_string())),
        }
    }
    (!out.is_empty()).then_some(out)
}

/// CUDA driver API version as `major.minor` (what `cuDriverGetVersion` reports).
pub fn driver_api_version() -> Option<String> {
    let mut v = 0i32;
    // SAFETY: only called after `detect` found the driver library; writes one int.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS)
        .then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// Kernel-module driver version from `/proc/driver/nvidia/version` (Linux), e.g. `580.159.04`.
pub fn kernel_driver_version() -> Option<String> {
    let s = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    s.split_whitespace()
        .find(|w| {
            w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.matches('.').count() >= 1
        })
        .map(str::to_string)
}

/// NVRTC's version as `major.minor`, when the library loads.
pub fn nvrtc_version() -> Option<String> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return None;
    }
    let (mut ma, mut mi) = (0i32, 0i32);
    // SAFETY: the library loads (checked above); writes two ints.
    (unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut ma, &mut mi) }
        == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS)
        .then(|| format!("{ma}.{mi}"))
}

/// Versions of the CUDA libraries the runner loaded: `nvrtc`, `cublas` (when present),
/// `cuda_driver_api`, and `cudarc` (the crate).
pub fn library_versions() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert("cudarc".into(), "0.19".into());
    if let Some(v) = driver_api_version() {
        m.insert("cuda_driver_api".into(), v);
    }
    if let Some(v) = nvrtc_version() {
        m.insert("nvrtc".into(), v);
    }
    if cublas_present() {
        use cudarc::cublas::sys::libraryPropertyType as P;
        let mut parts = [0i32; 3];
        let mut ok = true;
        for (i, p) in [P::MAJOR_VERSION, P::MINOR_VERSION, P::PATCH_LEVEL]
            .into_iter()
            .enumerate()
        {
            // SAFETY: cuBLAS loads (checked above); writes one int.
            ok &= unsafe { cudarc::cublas::sys::cublasGetProperty(p, &mut parts[i]) }
                == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
        }
        if ok {
            m.insert(
                "cublas".into(),
                format!("{}.{}.{}", parts[0], parts[1], parts[2]),
            );
        }
    }
    m
}

#[cfg(test)]
mod tests {
    #[test]
    fn ptxas_logs_parse() {
        let log = "ptxas info    : 0 bytes gmem\nptxas info    : (C7519) warpgroup.arrive is injected in around line 12 by compiler to allow use of registers in GMMA in function 'k'\nptxas info    : Compiling entry function 'k' for 'sm_90a'\nptxas info    : Function properties for k\nptxas         .     8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\nptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size\n";
        let r = super::parse_ptxas(log).unwrap();
        assert_eq!(
            r,
            vec![super::PtxasReport {
                kernel: "k".into(),
                registers: 255,
                spill_bytes: 8,
                stack_bytes: 8,
                wgmma_advisories: vec!["ptxas info    : (C7519) warpgroup.arrive is injected in around line 12 by compiler to allow use of registers in GMMA in function 'k'".into()],
            }]
        );
        assert!(super::parse_ptxas("nothing").is_none());
        // C7512 names its function "for the function 'k'" (ptxas of CUDA 13.0); the advisory
        // belongs to that kernel, not to the other one in the log.
        let c7512 = "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'k2'";
        let log = format!("{c7512}\nptxas info    : Compiling entry function 'k1' for 'sm_90a'\nptxas info    : Used 40 registers\nptxas info    : Compiling entry function 'k2' for 'sm_90a'\nptxas info    : Used 168 registers\n");
        let r = super::parse_ptxas(&log).unwrap();
        assert_eq!(r.len(), 2);
        assert!(r[0].wgmma_advisories.is_empty(), "{r:?}");
        assert_eq!(r[1].wgmma_advisories, vec![c7512.to_string()]);
        // An advisory naming no kernel of the log is every kernel's.
        let other = c7512.replace("'k2'", "'helper'");
        let r = super::parse_ptxas(&log.replace(c7512, &other)).unwrap();
        assert!(
            r.iter().all(|r| r.wgmma_advisories == vec![other.clone()]),
            "{r:?}"
        );
    }

    #[test]
    fn the_kernel_cache_keeps_machine_code_and_the_first_compile_time() {
        let dir = tempfile::tempdir().unwrap();
        let c = super::KernelCache::new(dir.path().to_path_buf(), "k.cu", "src", "sm_90a");
        assert!(c.read().is_none(), "an empty folder has no entry");
        c.write(b"\x7fELF machine code", 1.25);
        assert_eq!(c.read(), Some((b"\x7fELF machine code".to_vec(), 1.25)));
        // Another source, name or architecture is another entry.
        for (name, src, arch) in [
            ("k.cu", "src2", "sm_90a"),
            ("j.cu", "src", "sm_90a"),
            ("k.cu", "src", "sm_80"),
        ] {
            let other = super::KernelCache::new(dir.path().to_path_buf(), name, src, arch);
            assert!(other.read().is_none(), "{name} {src} {arch}");
        }
        // An entry without its seconds (a writer that stopped half-way) is compiled again.
        std::fs::remove_file(&c.seconds).unwrap();
        assert!(c.read().is_none());
        // No temporary file is left behind.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| n.ends_with(".cubin")), "{names:?}");
    }

    #[test]
    fn detect_never_panics() {
        // On CI there is no libcuda: this must be a clean error. On the device it is Ok.
        match super::detect() {
            Ok(()) => {}
            Err(e) => assert!(e.to_string().starts_with("no CUDA device"), "{e}"),
        }
    }
}
