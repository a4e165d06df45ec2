//! The grouped GEMM as a loop of cuBLAS GEMMs in this process (`cublas_loop`, issue 14's "a
//! loop of cuBLAS GEMMs (in-process)"): one `cublasGemmEx` per non-empty expert, bf16 operands
//! and result, float32 accumulation (`CUBLAS_COMPUTE_32F`), default math mode. It is the
//! alternative a C++ or Rust user without a grouped kernel writes, with none of Python's
//! per-call overhead; the group sizes must be on the host (the loop sizes each call), which is
//! what a one-launch grouped GEMM avoids.
//!
//! Layouts are the module's row-major ones ([`super`]): x `[M, K]`, w `[E, K, N]`, y `[M, N]`,
//! dY `[M, N]`, dX `[M, K]`, dW `[E, K, N]`. cuBLAS is column-major, so each row-major product
//! is computed as its transpose (a row-major `[r, c]` buffer is a column-major `[c, r]` one):
//! - forward, Y_e = x_e · w_e: Y_eᵀ `[N, m_e]` = w_eᵀ `[N, K]` · x_eᵀ `[K, m_e]`, both `N`;
//! - dX_e = dY_e · w_eᵀ: dX_eᵀ `[K, m_e]` = w_e `[K, N]` (`T` of w_eᵀ) · dY_eᵀ `[N, m_e]`;
//! - dW_e = x_eᵀ · dY_e: dW_eᵀ `[N, K]` = dY_eᵀ `[N, m_e]` · x_e `[m_e, K]` (`T` of x_eᵀ);
//!   an empty expert's dW_e is zeroed by a memset (no GEMM has a zero-length reduction).

use std::ffi::c_void;

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasMath_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use crate::gpu::{Gpu, GpuError};

/// The workspace given to the handle (`cublasSetWorkspace`), bytes: 32 MiB, what cuBLAS
/// recommends for Hopper; set explicitly so that a CUDA graph capture of the loop never asks
/// cuBLAS to allocate.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLAS handle on the GPU's stream with its workspace, for [`CublasLoop::forward`] and
/// [`CublasLoop::backward`].
pub struct CublasLoop {
    blas: CudaBlas,
    /// Kept alive as long as the handle uses it.
    _workspace: CudaSlice<u8>,
}

/// The shape of one column-major `cublasGemmEx`: C `[m, n]` = op(A) · op(B), the reduction of
/// length `k`, and the three leading dimensions (the buffers' addresses are passed beside it).
struct Call {
    ta: cublasOperation_t,
    tb: cublasOperation_t,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
}

fn int(x: usize) -> Result<i32, GpuError> {
    i32::try_from(x).map_err(|_| GpuError::Config(format!("GEMM size {x} exceeds i32")))
}

impl CublasLoop {
    /// A handle bound to `gpu.stream`, default math mode (bf16 tensor cores, float32
    /// accumulation), its workspace allocated on the stream.
    ///
    /// # Errors
    /// [`GpuError::Cublas`] when the handle cannot be made or configured; out of memory for
    /// the workspace.
    pub fn new(gpu: &Gpu) -> Result<CublasLoop, GpuError> {
        let blas =
            CudaBlas::new(gpu.stream.clone()).map_err(|e| GpuError::Cublas(format!("{e:?}")))?;
        // SAFETY: cuBLAS only writes its workspace; nothing reads it.
        let mut workspace = unsafe { gpu.stream.alloc::<u8>(WORKSPACE_BYTES)? };
        {
            let (wp, _g) = workspace.device_ptr_mut(&gpu.stream);
            // SAFETY: the handle is live; the workspace lives in the same struct as the
            // handle, which is only used on this stream.
            unsafe {
                cudarc::cublas::sys::cublasSetMathMode(
                    *blas.handle(),
                    cublasMath_t::CUBLAS_DEFAULT_MATH,
                )
                .result()
                .map_err(|e| GpuError::Cublas(format!("cublasSetMathMode: {e:?}")))?;
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    wp as *mut c_void,
                    WORKSPACE_BYTES,
                )
                .result()
                .map_err(|e| GpuError::Cublas(format!("cublasSetWorkspace: {e:?}")))?;
            }
        }
        Ok(CublasLoop {
            blas,
            _workspace: workspace,
        })
    }

    /// # Safety
    /// `a`, `b`, `c` are device addresses of bf16 buffers holding the matrices the call
    /// describes.
    unsafe fn gemm(&self, call: &Call, a: u64, b: u64, c: u64) -> Result<(), GpuError> {
        let (one, zero) = (1.0f32, 0.0f32);
        cudarc::cublas::result::gemm_ex(
            *self.blas.handle(),
            call.ta,
            call.tb,
            int(call.m)?,
            int(call.n)?,
            int(call.k)?,
            &one as *const f32 as *const c_void,
            a as *const c_void,
            cudaDataType_t::CUDA_R_16BF,
            int(call.lda)?,
            b as *const c_void,
            cudaDataType_t::CUDA_R_16BF,
            int(call.ldb)?,
            &zero as *const f32 as *const c_void,
            c as *mut c_void,
            cudaDataType_t::CUDA_R_16BF,
            int(call.ldc)?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| GpuError::Cublas(format!("{e:?}")))
    }

    /// y `[M, N]` = x_e `[m_e, K]` · w\[e\] `[K, N]` for each group, `offsets` `[E + 1]` on the
    /// host (M = `offsets[E]`), bf16 bits; one GEMM per non-empty group, none for an empty one.
    /// The float64 definition is [`super::reference::grouped_matmul`].
    ///
    /// # Errors
    /// [`GpuError::Config`] when a buffer is smaller than the shape needs or the offsets do not
    /// ascend; [`GpuError::Cublas`] from a call.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<u16>,
        offsets: &[usize],
        k: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        let (groups, rows) = check_offsets(offsets)?;
        need("x", x.len(), rows * k)?;
        need("w", w.len(), groups * k * n)?;
        need("y", y.len(), rows * n)?;
        let (xp, _gx) = x.device_ptr(&gpu.stream);
        let (wp, _gw) = w.device_ptr(&gpu.stream);
        let (yp, _gy) = y.device_ptr_mut(&gpu.stream);
        for (e, r) in offsets.windows(2).enumerate() {
            let m_e = r[1] - r[0];
            if m_e == 0 {
                continue;
            }
            let call = Call {
                ta: cublasOperation_t::CUBLAS_OP_N,
                tb: cublasOperation_t::CUBLAS_OP_N,
                m: n,
                n: m_e,
                k,
                lda: n,
                ldb: k,
                ldc: n,
            };
            // SAFETY: the sizes were checked above; element offsets in bf16 (2 bytes).
            unsafe {
                self.gemm(
                    &call,
                    wp + 2 * (e * k * n) as u64,
                    xp + 2 * (r[0] * k) as u64,
                    yp + 2 * (r[0] * n) as u64,
                )?;
            }
        }
        Ok(())
    }

    /// The backward of [`CublasLoop::forward`] for the output gradient `dy` `[M, N]`: dX
    /// `[M, K]` = dY_e · w\[e\]ᵀ per group and dW `[E, K, N]` = x_eᵀ · dY_e (zeros for an empty
    /// group, by a memset), two GEMMs per non-empty group. The float64 definition is
    /// [`super::reference::grouped_matmul_backward`].
    ///
    /// # Errors
    /// As [`CublasLoop::forward`]; a driver error from the memset.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        dy: &CudaSlice<u16>,
        dx: &mut CudaSlice<u16>,
        dw: &mut CudaSlice<u16>,
        offsets: &[usize],
        k: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        let (groups, rows) = check_offsets(offsets)?;
        need("x", x.len(), rows * k)?;
        need("w", w.len(), groups * k * n)?;
        need("dy", dy.len(), rows * n)?;
        need("dx", dx.len(), rows * k)?;
        need("dw", dw.len(), groups * k * n)?;
        let (xp, _gx) = x.device_ptr(&gpu.stream);
        let (wp, _gw) = w.device_ptr(&gpu.stream);
        let (dyp, _gdy) = dy.device_ptr(&gpu.stream);
        let (dxp, _gdx) = dx.device_ptr_mut(&gpu.stream);
        let (dwp, _gdw) = dw.device_ptr_mut(&gpu.stream);
        for (e, r) in offsets.windows(2).enumerate() {
            let m_e = r[1] - r[0];
            let dw_e = dwp + 2 * (e * k * n) as u64;
            if m_e == 0 {
                // SAFETY: dW_e is k · n bf16 inside dw (checked above), on this stream.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        dw_e,
                        0,
                        2 * k * n,
                        gpu.stream.cu_stream(),
                    )?;
                }
                continue;
            }
            let dx_call = Call {
                ta: cublasOperation_t::CUBLAS_OP_T,
                tb: cublasOperation_t::CUBLAS_OP_N,
                m: k,
                n: m_e,
                k: n,
                lda: n,
                ldb: n,
                ldc: k,
            };
            let dw_call = Call {
                ta: cublasOperation_t::CUBLAS_OP_N,
                tb: cublasOperation_t::CUBLAS_OP_T,
                m: n,
                n: k,
                k: m_e,
                lda: n,
                ldb: k,
                ldc: n,
            };
            // SAFETY: the sizes were checked above; element offsets in bf16 (2 bytes).
            unsafe {
                self.gemm(
                    &dx_call,
                    wp + 2 * (e * k * n) as u64,
                    dyp + 2 * (r[0] * n) as u64,
                    dxp + 2 * (r[0] * k) as u64,
                )?;
                self.gemm(
                    &dw_call,
                    dyp + 2 * (r[0] * n) as u64,
                    xp + 2 * (r[0] * k) as u64,
                    dw_e,
                )?;
            }
        }
        Ok(())
    }
}

/// The groups and rows of ascending `offsets` starting at 0.
fn check_offsets(offsets: &[usize]) -> Result<(usize, usize), GpuError> {
    if offsets.first() != Some(&0) || offsets.windows(2).any(|w| w[1] < w[0]) {
        return Err(GpuError::Config(format!(
            "offsets must ascend from 0, got {offsets:?}"
        )));
    }
    Ok((offsets.len() - 1, offsets[offsets.len() - 1]))
}

/// [`GpuError::Config`] naming the buffer when it holds fewer than `want` elements.
fn need(name: &str, len: usize, want: usize) -> Result<(), GpuError> {
    if len < want {
        return Err(GpuError::Config(format!(
            "`{name}` holds {len} elements, the shape needs {want}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_and_sizes_are_checked_with_names() {
        assert_eq!(check_offsets(&[0, 5, 5, 8]).unwrap(), (3, 8));
        assert_eq!(check_offsets(&[0]).unwrap(), (0, 0));
        let e = check_offsets(&[1, 5]).unwrap_err().to_string();
        assert!(e.contains("ascend from 0"), "{e}");
        assert!(check_offsets(&[0, 5, 3]).is_err());
        assert!(check_offsets(&[]).is_err());
        let e = need("dw", 10, 12).unwrap_err().to_string();
        assert!(
            e.contains("`dw` holds 10 elements, the shape needs 12"),
            "{e}"
        );
        assert!(need("y", 12, 12).is_ok());
    }
}
