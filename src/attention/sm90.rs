//! Hopper (compute capability 9.0, `sm_90a`) building blocks for the attention kernels of
//! issue 11: `wgmma` (warpgroup matrix multiply-accumulate) with operands in shared memory
//! through matrix descriptors, and a probe kernel that checks them on the device
//! (`kernels/attn_wgmma_sm90.cu`). Nothing dispatches to them yet: the probe establishes the
//! descriptor layout (which of the two core-matrix distances the descriptor's "leading" and
//! "stride" byte offsets take, per operand majorness) and the accumulator and register-operand
//! layouts before an attention kernel is built on them.
//!
//! Shapes: the probe computes one 64 × 64 fp32 tile `C` (row-major) from bf16 words: mode 0,
//! `C = A Bᵀ` with `A` and `B` both `[64][K]` (Q Kᵀ's form, both K-major in shared memory);
//! mode 1, `C = A V` with `A` `[64][K]` from registers and `V` `[K][64]` (P V's form, V N-major
//! in shared memory). K is a multiple of 16 up to 128.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::cuda::PRELUDE_SRC;
use crate::gpu::{Gpu, GpuError};

/// Source of the sm_90a building blocks and the probe (after [`PRELUDE_SRC`]).
pub const WGMMA_SRC: &str = include_str!("../../kernels/attn_wgmma_sm90.cu");

/// The probe's operand forms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeMode {
    /// `C = A Bᵀ`, both operands K-major in shared memory.
    KMajor,
    /// `C = A V`, A from registers, V N-major in shared memory (transposed B).
    RegistersTimesNMajor,
}

/// A reading of the no-swizzle descriptor: the leading and stride byte offsets of A and of B.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DescriptorReading {
    /// Leading byte offset of A (unused in register mode).
    pub lead_a: u32,
    /// Stride byte offset of A.
    pub stride_a: u32,
    /// Leading byte offset of B.
    pub lead_b: u32,
    /// Stride byte offset of B.
    pub stride_b: u32,
}

/// The two readings of the descriptor the probe tries for `mode` at reduction length `k`: the
/// first is the one the kernels are to use (the PTX ISA's: for K-major without swizzling, the
/// leading offset is the distance between the two core matrices along K, 128 bytes here, and
/// the stride offset the distance between 8-row blocks, k · 16 bytes; for N-major, the leading
/// offset is the distance between core matrices along K, 64 · 16 bytes here, and the stride
/// offset the distance along N, 128 bytes), the second swaps each operand's pair.
pub fn readings(mode: ProbeMode, k: usize) -> [DescriptorReading; 2] {
    let kmaj = (128u32, 16 * k as u32);
    let b = match mode {
        ProbeMode::KMajor => kmaj,
        ProbeMode::RegistersTimesNMajor => (64 * 16, 128),
    };
    let first = DescriptorReading {
        lead_a: kmaj.0,
        stride_a: kmaj.1,
        lead_b: b.0,
        stride_b: b.1,
    };
    let swapped = DescriptorReading {
        lead_a: kmaj.1,
        stride_a: kmaj.0,
        lead_b: b.1,
        stride_b: b.0,
    };
    [first, swapped]
}

/// Runs the probe once on `gpu`: `a` `[64][k]` and `b` (`[64][k]` for
/// [`ProbeMode::KMajor`], `[k][64]` otherwise) as bf16 words, with `reading`; returns `C`,
/// 64 × 64 fp32, row-major.
///
/// # Errors
/// [`GpuError::Config`] on a device that is not compute capability 9.0 or for a `k` that is
/// not a multiple of 16 up to 128, or inputs of the wrong length; NVRTC and driver errors.
pub fn wgmma_probe(
    gpu: &Gpu,
    mode: ProbeMode,
    a: &[u16],
    b: &[u16],
    k: usize,
    reading: DescriptorReading,
) -> Result<Vec<f32>, GpuError> {
    if gpu.arch() != "sm_90a" {
        return Err(GpuError::Config(format!(
            "the wgmma probe needs compute capability 9.0 (sm_90a), not {}",
            gpu.arch()
        )));
    }
    if k == 0 || !k.is_multiple_of(16) || k > 128 || a.len() != 64 * k || b.len() != 64 * k {
        return Err(GpuError::Config(format!(
            "wgmma probe: k = {k} must be a multiple of 16 up to 128, with 64 * k words in a ({}) \
             and b ({})",
            a.len(),
            b.len()
        )));
    }
    let src = format!("{PRELUDE_SRC}\n{WGMMA_SRC}\n");
    let compiled = gpu.compile("attn_wgmma_sm90.cu", &src)?;
    let smem = (2 * 64 * k * 2) as u32;
    let f = gpu.function(&compiled.module, "wgmma_probe", smem)?;
    let (ad, bd) = (gpu.stream.clone_htod(a)?, gpu.stream.clone_htod(b)?);
    let mut c = gpu.stream.alloc_zeros::<f32>(64 * 64)?;
    let (k_i, mode_i) = (
        k as i32,
        match mode {
            ProbeMode::KMajor => 0i32,
            ProbeMode::RegistersTimesNMajor => 1,
        },
    );
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&ad)
        .arg(&bd)
        .arg(&mut c)
        .arg(&k_i)
        .arg(&mode_i)
        .arg(&reading.lead_a)
        .arg(&reading.stride_a)
        .arg(&reading.lead_b)
        .arg(&reading.stride_b);
    // SAFETY: `wgmma_probe(const u16* A, const u16* B, float* C, int K, int mode, u32 lead_a,
    // u32 stride_a, u32 lead_b, u32 stride_b)`, one warpgroup; A and B hold 64 * K words, C
    // 64 * 64 floats; the dynamic shared memory holds both operands.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem,
        })?
    };
    let out = gpu.stream.clone_dtoh(&c)?;
    gpu.stream.synchronize()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_readings_swap_each_pair() {
        for mode in [ProbeMode::KMajor, ProbeMode::RegistersTimesNMajor] {
            let [a, b] = readings(mode, 64);
            assert_eq!((a.lead_a, a.stride_a), (b.stride_a, b.lead_a));
            assert_eq!((a.lead_b, a.stride_b), (b.stride_b, b.lead_b));
            assert_eq!(a.lead_a, 128);
            assert_eq!(a.stride_a, 64 * 16);
        }
    }
}
