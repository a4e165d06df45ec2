//! Mixture of experts (issue 14): the grouped GEMM over ragged expert groups, top-k routing,
//! the dispatch of tokens into expert order and the weighted combine back, and the SwiGLU
//! expert layer built on them.
//!
//! Layouts are row-major. A batch of T tokens of width H is `x` `[T, H]`; E experts; each
//! token goes to its `top_k` experts, so the dispatched rows number T · top_k (fewer under a
//! capacity limit). Rows sorted by expert are described by `offsets` `[E + 1]`: expert e owns
//! rows `offsets[e] .. offsets[e + 1]` (an expert with no token has an empty range).
//!
//! [`reference`] is the float64 definition every implementation is checked against;
//! [`case`] the grouped-GEMM case of the grid, its group sizes and its FLOP and byte counts;
//! [`cuda`] the grouped GEMM's CUDA kernels (forward, dX, dW) and their launch; [`files`] a case
//! as the runner protocol's files; [`cpu`] the grouped GEMM and its backward on
//! the CPU (float32); [`dispatch_cuda`] top-k routing, the dispatch plan,
//! `moe_dispatch` and `moe_combine` on CUDA; [`sm90`] the grouped GEMM on Hopper (wgmma, TMA);
//! [`layer_cuda`] `MoELayer`, the whole forward from those kernels; [`layer_case`] a
//! whole-layer case of the grid and its files; [`cublas`] the grouped GEMM as a loop of cuBLAS
//! GEMMs, the in-process alternative.

pub mod case;
pub mod cpu;
pub mod cpu_bf16;
pub mod cublas;
pub mod cuda;
pub mod dispatch_cuda;
pub mod files;
pub mod layer_case;
pub mod layer_cuda;
pub mod reference;
pub mod sm90;

/// The value of `#define NAME <integer>` in a kernel source, for the tests that tie the
/// host's constants to the kernels' (`None` when absent or not an integer).
#[cfg(test)]
pub(crate) fn source_define(src: &str, name: &str) -> Option<usize> {
    let prefix = format!("#define {name} ");
    src.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}
