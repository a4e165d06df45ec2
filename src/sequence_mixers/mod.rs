//! The sequence-mixer suite (issue 12): recurrent token mixers that replace attention's
//! quadratic score matrix by a state carried along the sequence. This module holds their
//! float64 references, written as the sequential recurrence each paper defines, which every
//! kernel and every alternative will be checked against ([`reference`](mod@reference)), their backward
//! references ([`gradients`], [`delta_gradients`]), the chunked forms the kernels follow, run
//! on the CPU ([`chunked`]), and version 1 of each forward on CUDA (float32 on CUDA cores,
//! f32 and bf16 inputs): SSD ([`cuda`], which also holds the shared prelude and [`cuda::Dtype`]),
//! the selective scan ([`scan_cuda`]), Based ([`based_cuda`]) and the gated delta rule
//! ([`delta_cuda`]); `kernels/TUNING-sequence-mixers.md` has their designs and predictions.
//!
//! The runner's side: a grid case with its FLOP, byte and token counts and its random inputs
//! ([`case`]), the protocol files of a case ([`files`]) and the float32 CPU implementation
//! ([`cpu`]), measured by `runners/sequence_mixers.rs` (SSD and the selective scan so far).
//!
//! Not here yet: the backward kernels, tensor-core tiles, and Based and the gated delta rule
//! in the runner.

pub mod based_cuda;
pub mod case;
pub mod chunked;
pub mod cpu;
pub mod cuda;
pub mod delta_cuda;
pub mod delta_gradients;
pub mod files;
pub mod gradients;
pub mod reference;
pub mod scan_cuda;
pub mod ssd_backward;
#[cfg(test)]
mod test_util;
