//! CUDA attention implementations: `flash` (the project's kernel, the default) and `math`
//! (cuBLAS GEMMs for S = Q Kᵀ and O = P V around the project's row-softmax kernel).
//!
//! Kernels live in `kernels/*.cu`, embedded here and compiled by NVRTC at run time for the
//! device's architecture; each case compiles only the instantiation it needs.

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::{AttentionCase, Dtype, Pass};
use crate::gpu::{Gpu, GpuError};

/// Source of the flash forward kernel.
pub const FLASH_SRC: &str = include_str!("../../kernels/flash_attn_fwd.cu");
/// Source of the row-softmax kernel of the math path.
pub const SOFTMAX_SRC: &str = include_str!("../../kernels/softmax_rows.cu");

/// A flash-kernel configuration: kernel version, warps per CTA, 16-row groups per warp and keys
/// per tile. Written `v2w4` (version 2, 4 warps: 16 rows per warp, 64-key tiles, Q fragments in
/// registers) or `v3w4m2b32` (version 3, 4 warps, 2 row groups per warp, 32-key tiles, Q
/// re-read from shared memory); `kernels/flash_attn_fwd.cu` documents both and
/// `kernels/TUNING.md` their measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashConfig {
    /// Kernel version: 2 (`flash_fwd`) or 3 (`flash_fwd_v3`).
    pub version: u8,
    /// Warps per CTA (4 or 8).
    pub warps: usize,
    /// Groups of 16 query rows per warp (1 for version 2; 1 or 2 for version 3).
    pub m_tiles: usize,
    /// Keys per K/V tile (64 for version 2; 32 or 64 for version 3).
    pub key_tile: usize,
}

impl FlashConfig {
    /// Parses `v2w4`, `v2w8`, `v3w{4,8}m{1,2}b{32,64}`.
    ///
    /// # Errors
    /// Names the string and the accepted forms.
    pub fn parse(s: &str) -> Result<FlashConfig, String> {
        let bad = || format!("flash config `{s}`: expected v2w4, v2w8 or v3w<4|8>m<1|2>b<32|64>");
        let num = |t: &str| t.parse::<usize>().map_err(|_| bad());
        if let Some(w) = s.strip_prefix("v2w") {
            let warps = num(w)?;
            if warps != 4 && warps != 8 {
                return Err(bad());
            }
            return Ok(FlashConfig {
                version: 2,
                warps,
                m_tiles: 1,
                key_tile: 64,
            });
        }
        let rest = s.strip_prefix("v3w").ok_or_else(bad)?;
        let (w, rest) = rest.split_once('m').ok_or_else(bad)?;
        let (m, b) = rest.split_once('b').ok_or_else(bad)?;
        let c = FlashConfig {
            version: 3,
            warps: num(w)?,
            m_tiles: num(m)?,
            key_tile: num(b)?,
        };
        let ok =
            matches!(c.warps, 4 | 8) && matches!(c.m_tiles, 1 | 2) && matches!(c.key_tile, 32 | 64);
        if !ok || !c.query_tile().is_multiple_of(c.key_tile) {
            return Err(bad());
        }
        Ok(c)
    }

    /// The written form, e.g. `v3w4m2b32`.
    pub fn name(&self) -> String {
        if self.version == 2 {
            format!("v2w{}", self.warps)
        } else {
            format!("v3w{}m{}b{}", self.warps, self.m_tiles, self.key_tile)
        }
    }

    /// Query rows per CTA.
    pub fn query_tile(&self) -> usize {
        16 * self.warps * self.m_tiles
    }

    /// Dynamic shared memory for `head_dim`: a Q tile and two K and two V tiles, rows padded
    /// by 8 elements.
    pub fn smem_bytes(&self, head_dim: usize) -> u32 {
        ((self.query_tile() + 4 * self.key_tile) * (head_dim + 8) * 2) as u32
    }

    /// The measured default for `head_dim` (see `kernels/TUNING.md`), unless the environment
    /// variable `KP_FLASH_CONFIG` (`64=v2w4,128=v3w4m2b32`, set by the runner's
    /// `--flash-config`) names another.
    pub fn for_head_dim(head_dim: usize) -> Result<FlashConfig, String> {
        if let Ok(spec) = std::env::var("KP_FLASH_CONFIG") {
            for part in spec.split(',').filter(|p| !p.is_empty()) {
                let (d, c) = part.split_once('=').ok_or_else(|| {
                    format!("KP_FLASH_CONFIG part `{part}`: expected head_dim=config")
                })?;
                if d.trim().parse::<usize>().ok() == Some(head_dim) {
                    return FlashConfig::parse(c.trim());
                }
            }
        }
        // v3w4m2b64 was the fastest correct configuration for both head dims on the H200
        // (kernels/TUNING.md, v3).
        Ok(FlashConfig {
            version: 3,
            warps: 4,
            m_tiles: 2,
            key_tile: 64,
        })
    }
}

/// The project's CUDA implementations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Implementation {
    /// Tiled flash attention with tensor-core mma and an online softmax (the default).
    Flash,
    /// Materialised attention: cuBLAS GEMM, softmax kernel, cuBLAS GEMM.
    Math,
}

impl Implementation {
    /// Every implementation, default first.
    pub const ALL: [Implementation; 2] = [Implementation::Flash, Implementation::Math];

    /// Name in documents.
    pub fn name(self) -> &'static str {
        match self {
            Implementation::Flash => "flash",
            Implementation::Math => "math",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<Implementation> {
        Self::ALL.into_iter().find(|i| i.name() == s)
    }

    /// Library column of the document.
    pub fn library(self) -> &'static str {
        match self {
            Implementation::Flash => "kernelpages",
            Implementation::Math => "cuBLAS + kernelpages softmax",
        }
    }

    /// True when [`dispatch`] picks this implementation for `c`: what [`forward`] runs.
    pub fn is_default_for(self, c: &AttentionCase) -> bool {
        dispatch(c) == Some(self)
    }

    /// `Err(reason)` when the implementation rejects the case.
    pub fn supports(self, c: &AttentionCase) -> Result<(), String> {
        if c.pass != Pass::Fwd {
            return Err("backward pass not implemented yet".into());
        }
        c.validate()?;
        if c.dtype == Dtype::F32 {
            return Err("fp32 not implemented yet".into());
        }
        if c.seq_len_q != c.seq_len_kv || c.kv_lens.is_some() {
            return Err("separate query and key lengths not implemented yet".into());
        }
        match self {
            Implementation::Flash => {
                if c.head_dim != 64 && c.head_dim != 128 {
                    return Err(format!(
                        "head_dim {} not compiled (64 and 128 are)",
                        c.head_dim
                    ));
                }
                let tile = FlashConfig::for_head_dim(c.head_dim)?.query_tile();
                if !c.seq_len_q.is_multiple_of(tile) {
                    return Err(format!(
                        "seq_len {} is not a multiple of {tile}",
                        c.seq_len_q
                    ));
                }
            }
            Implementation::Math => {
                if c.kv_heads != c.heads {
                    return Err(
                        "GQA (kv_heads < heads) not supported by the batched GEMM path".into(),
                    );
                }
                if !c.seq_len_q.is_multiple_of(4) {
                    return Err(format!("seq_len {} is not a multiple of 4", c.seq_len_q));
                }
            }
        }
        Ok(())
    }

    /// Bytes of temporaries beyond Q, K, V and O: the fp32 score matrix S and the 16-bit
    /// probabilities P for `math`; nothing for `flash`.
    pub fn temporary_bytes(self, c: &AttentionCase) -> u64 {
        match self {
            Implementation::Flash => 0,
            Implementation::Math => {
                let n = (c.batch * c.heads) as u64 * (c.seq_len_q as u64).pow(2);
                n * 4 + n * 2
            }
        }
    }
}

/// The kernel name and the NVRTC source (the kernel file plus one `extern "C"` wrapper) of the
/// flash instantiation for case `c` with configuration `fc`.
pub fn flash_instance(c: &AttentionCase, fc: FlashConfig) -> (String, String) {
    let dt = match c.dtype {
        Dtype::Bf16 => "bf16",
        Dtype::F16 => "f16",
        Dtype::F32 => "f32",
    };
    let mask = if c.causal { "causal" } else { "full" };
    let name = format!("flash_fwd_{dt}_d{}_{mask}_{}", c.head_dim, fc.name());
    let (bf, causal, d) = (c.dtype == Dtype::Bf16, c.causal, c.head_dim);
    let call = if fc.version == 2 {
        format!("flash_fwd<{d}, {}, {bf}, {causal}>", fc.warps)
    } else {
        format!(
            "flash_fwd_v3<{d}, {}, {}, {}, {bf}, {causal}>",
            fc.warps, fc.m_tiles, fc.key_tile
        )
    };
    let src = format!(
        "{FLASH_SRC}\nextern \"C\" __global__ void __launch_bounds__({threads}) {name}(\
         const u16* Q, const u16* K, const u16* V, u16* O, int T, int H, int KVH, \
         float scale_log2) {{ {call}(Q, K, V, O, T, H, KVH, scale_log2); }}\n",
        threads = 32 * fc.warps,
    );
    (name, src)
}

/// The implementation [`forward`] runs for `c`: `flash` when it supports the case, else
/// `math` when it does, else none (the reason is in [`Implementation::supports`]).
pub fn dispatch(c: &AttentionCase) -> Option<Implementation> {
    Implementation::ALL
        .into_iter()
        .find(|i| i.supports(c).is_ok())
}

/// Attention forward on the device with the implementation [`dispatch`] picks: compiles it,
/// launches it once on `inp` writing `o` (`[B, H, T, D]`, the case's dtype), and returns which
/// implementation ran. For repeated calls, keep the [`Runner`] instead.
///
/// # Errors
/// [`GpuError::Config`] when no implementation supports the case (with every reason);
/// compile, launch and out-of-memory errors otherwise.
pub fn forward(
    gpu: &Gpu,
    c: &AttentionCase,
    inp: &DeviceInputs,
    o: &mut CudaSlice<u16>,
) -> Result<Implementation, GpuError> {
    let Some(imp) = dispatch(c) else {
        let why: Vec<String> = Implementation::ALL
            .into_iter()
            .filter_map(|i| i.supports(c).err().map(|e| format!("{}: {e}", i.name())))
            .collect();
        return Err(GpuError::Config(format!(
            "no implementation supports this case ({})",
            why.join("; ")
        )));
    };
    let (mut runner, _) = Runner::new(gpu, imp, c)?;
    runner.launch(gpu, c, inp, o)?;
    Ok(imp)
}

/// One input set on the device.
pub struct DeviceInputs {
    /// Q bits.
    pub q: CudaSlice<u16>,
    /// K bits.
    pub k: CudaSlice<u16>,
    /// V bits.
    pub v: CudaSlice<u16>,
}

/// A compiled implementation with its temporaries, ready to launch on any input set.
pub enum Runner {
    /// Flash kernel.
    Flash {
        /// The instantiation for this case.
        func: CudaFunction,
        /// Grid (T/BR, H, B), 32·warps threads, dynamic shared memory.
        cfg: LaunchConfig,
    },
    /// cuBLAS + softmax.
    Math {
        /// cuBLAS handle bound to the stream.
        blas: Box<CudaBlas>,
        /// Softmax instantiation.
        softmax: CudaFunction,
        /// fp32 scores, `[B·H, T, T]`.
        s: CudaSlice<f32>,
        /// 16-bit probabilities, `[B·H, T, T]`.
        p: CudaSlice<u16>,
        /// The cuBLAS workspace given to the handle ([`CUBLAS_WORKSPACE_BYTES`]).
        workspace: CudaSlice<u8>,
    },
}

/// The cuBLAS workspace the `math` path gives its handle (`cublasSetWorkspace`): 32 MiB, the
/// size cuBLAS recommends for Hopper. Allocated once per runner, so a memory reading can keep it
/// apart from the call's own memory.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl Runner {
    /// Compiles what `imp` needs for `c` and allocates its temporaries. Returns the runner and
    /// the NVRTC compile + load time in s.
    ///
    /// # Errors
    /// Compile errors with the NVRTC log; out-of-memory for the temporaries.
    pub fn new(
        gpu: &Gpu,
        imp: Implementation,
        c: &AttentionCase,
    ) -> Result<(Runner, f64), GpuError> {
        let dt = match c.dtype {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        };
        let mask = if c.causal { "causal" } else { "full" };
        match imp {
            Implementation::Flash => {
                let fc = FlashConfig::for_head_dim(c.head_dim).map_err(GpuError::Config)?;
                let (name, src) = flash_instance(c, fc);
                let compiled = gpu.compile(&format!("{name}.cu"), &src)?;
                let smem = fc.smem_bytes(c.head_dim);
                let func = gpu.function(&compiled.module, &name, smem)?;
                let cfg = LaunchConfig {
                    grid_dim: (
                        (c.seq_len_q / fc.query_tile()) as u32,
                        c.heads as u32,
                        c.batch as u32,
                    ),
                    block_dim: (32 * fc.warps as u32, 1, 1),
                    shared_mem_bytes: smem,
                };
                Ok((Runner::Flash { func, cfg }, compiled.compile_s))
            }
            Implementation::Math => {
                let compiled = gpu.compile("softmax_rows.cu", SOFTMAX_SRC)?;
                let softmax =
                    gpu.function(&compiled.module, &format!("softmax_rows_{dt}_{mask}"), 0)?;
                let blas = CudaBlas::new(gpu.stream.clone())
                    .map_err(|e| GpuError::Cublas(format!("{e:?}")))?;
                // SAFETY: cuBLAS only writes its workspace.
                let mut workspace = unsafe { gpu.stream.alloc::<u8>(CUBLAS_WORKSPACE_BYTES)? };
                {
                    let (wp, _gw) = workspace.device_ptr_mut(&gpu.stream);
                    // SAFETY: the workspace outlives the handle's use of it (both live in the
                    // same Runner, and the handle is only used by `launch` on this stream).
                    unsafe {
                        cudarc::cublas::sys::cublasSetWorkspace_v2(
                            *blas.handle(),
                            wp as *mut std::ffi::c_void,
                            CUBLAS_WORKSPACE_BYTES,
                        )
                        .result()
                        .map_err(|e| GpuError::Cublas(format!("cublasSetWorkspace: {e:?}")))?;
                    }
                }
                let n = c.batch * c.heads * c.seq_len_q * c.seq_len_q;
                // SAFETY: S is fully written by the first GEMM and P by the softmax kernel before
                // either is read.
                let s = unsafe { gpu.stream.alloc::<f32>(n)? };
                let p = unsafe { gpu.stream.alloc::<u16>(n)? };
                Ok((
                    Runner::Math {
                        blas: Box::new(blas),
                        softmax,
                        s,
                        p,
                        workspace,
                    },
                    compiled.compile_s,
                ))
            }
        }
    }

    /// Bytes of library workspace held across calls (the cuBLAS workspace of `math`).
    pub fn workspace_bytes(&self) -> u64 {
        match self {
            Runner::Flash { .. } => 0,
            Runner::Math { workspace, .. } => workspace.len() as u64,
        }
    }

    /// Launches one forward call on the stream (asynchronously), writing `o`.
    ///
    /// # Errors
    /// Launch or cuBLAS errors.
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        c: &AttentionCase,
        inp: &DeviceInputs,
        o: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let t = c.seq_len_q as i32;
        match self {
            Runner::Flash { func, cfg } => {
                let (h, kvh) = (c.heads as i32, c.kv_heads as i32);
                let scale_log2 = (c.scale() * std::f64::consts::LOG2_E) as f32;
                let mut b = gpu.stream.launch_builder(func);
                b.arg(&inp.q)
                    .arg(&inp.k)
                    .arg(&inp.v)
                    .arg(o)
                    .arg(&t)
                    .arg(&h)
                    .arg(&kvh)
                    .arg(&scale_log2);
                // SAFETY: the arguments match `flash_fwd_*(const u16* Q, const u16* K,
                // const u16* V, u16* O, int T, int H, int KVH, float)`; Q and O hold
                // B·H·T·D elements and K, V B·KVH·T·D (allocated from the same case), the grid
                // covers T/BR query tiles × H × B, and `supports` checked T % BR == 0.
                unsafe { b.launch(*cfg)? };
                Ok(())
            }
            Runner::Math {
                blas,
                softmax,
                s,
                p,
                ..
            } => {
                let bh = (c.batch * c.heads) as i32;
                let d = c.head_dim as i32;
                let elem = match c.dtype {
                    Dtype::Bf16 => cudaDataType_t::CUDA_R_16BF,
                    Dtype::F16 => cudaDataType_t::CUDA_R_16F,
                    Dtype::F32 => cudaDataType_t::CUDA_R_32F,
                };
                let alpha = c.scale() as f32;
                let (one, zero) = (1.0f32, 0.0f32);
                let tt = t as i64 * t as i64;
                let td = t as i64 * d as i64;
                let stream = gpu.stream.clone();
                {
                    let (qp, _gq) = inp.q.device_ptr(&stream);
                    let (kp, _gk) = inp.k.device_ptr(&stream);
                    let (sp, _gs) = s.device_ptr_mut(&stream);
                    // S_bh (row-major T×T) = scale · Q_bh K_bhᵀ. Column-major view: Sᵀ (T×T) =
                    // op(K)=Kᵀ... i.e. C = Aᵀ B with A = K (D×T col-major), B = Q (D×T).
                    // SAFETY: pointers are live device allocations of the sizes implied by the
                    // strides; alpha/beta are host f32 matching CUBLAS_COMPUTE_32F.
                    unsafe {
                        cudarc::cublas::result::gemm_strided_batched_ex(
                            *blas.handle(),
                            cublasOperation_t::CUBLAS_OP_T,
                            cublasOperation_t::CUBLAS_OP_N,
                            t,
                            t,
                            d,
                            &alpha as *const f32 as *const _,
                            kp as *const _,
                            elem,
                            d,
                            td,
                            qp as *const _,
                            elem,
                            d,
                            td,
                            &zero as *const f32 as *const _,
                            sp as *mut _,
                            cudaDataType_t::CUDA_R_32F,
                            t,
                            tt,
                            bh,
                            cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                        .map_err(|e| GpuError::Cublas(format!("{e:?}")))?;
                    }
                }
                let rows = (bh as u32) * (t as u32);
                let cfg = LaunchConfig {
                    grid_dim: (rows, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut lb = gpu.stream.launch_builder(softmax);
                lb.arg(&*s).arg(&mut *p).arg(&t);
                // SAFETY: `softmax_rows_*(const float* S, u16* P, int T)` with S and P of
                // B·H·T·T elements; one CTA per row; `supports` checked T % 4 == 0.
                unsafe { lb.launch(cfg)? };
                {
                    let (pp, _gp) = p.device_ptr(&stream);
                    let (vp, _gv) = inp.v.device_ptr(&stream);
                    let (op, _go) = o.device_ptr_mut(&stream);
                    // O_bh (row-major T×D) = P_bh V_bh. Column-major: Oᵀ (D×T) = Vᵀ (D×T) ·
                    // Pᵀ (T×T): C = A B with A = V (D×T col-major, lda D), B = P (T×T, ldb T).
                    // SAFETY: as above; output type is the 16-bit dtype.
                    unsafe {
                        cudarc::cublas::result::gemm_strided_batched_ex(
                            *blas.handle(),
                            cublasOperation_t::CUBLAS_OP_N,
                            cublasOperation_t::CUBLAS_OP_N,
                            d,
                            t,
                            t,
                            &one as *const f32 as *const _,
                            vp as *const _,
                            elem,
                            d,
                            td,
                            pp as *const _,
                            elem,
                            t,
                            tt,
                            &zero as *const f32 as *const _,
                            op as *mut _,
                            elem,
                            d,
                            td,
                            bh,
                            cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                        .map_err(|e| GpuError::Cublas(format!("{e:?}")))?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// Uploads one input set.
pub fn upload(gpu: &Gpu, q: &[u16], k: &[u16], v: &[u16]) -> Result<DeviceInputs, GpuError> {
    Ok(DeviceInputs {
        q: gpu.stream.clone_htod(q)?,
        k: gpu.stream.clone_htod(k)?,
        v: gpu.stream.clone_htod(v)?,
    })
}

/// Device copies of `src` (distinct buffers, same values) for L2 rotation.
pub fn replicate(gpu: &Gpu, src: &DeviceInputs) -> Result<DeviceInputs, GpuError> {
    Ok(DeviceInputs {
        q: gpu.stream.clone_dtod(&src.q)?,
        k: gpu.stream.clone_dtod(&src.k)?,
        v: gpu.stream.clone_dtod(&src.v)?,
    })
}
