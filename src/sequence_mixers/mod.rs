//! The sequence-mixer suite (issue 12): recurrent token mixers that replace attention's
//! quadratic score matrix by a state carried along the sequence. This module holds their
//! float64 references, written as the sequential recurrence each paper defines, which every
//! kernel and every alternative is checked against ([`reference`](mod@reference)), their backward
//! references ([`gradients`], [`delta_gradients`], [`based_gradients`]), the chunked forms the kernels follow, run
//! on the CPU ([`chunked`]), each forward on CUDA (f32 and bf16 inputs; bf16 products on
//! tensor cores where the shape allows): SSD ([`cuda`], which also holds the shared prelude
//! and [`cuda::Dtype`]), the selective scan ([`scan_cuda`]), Based ([`based_cuda`]) and the
//! gated delta rule ([`delta_cuda`]); and the backward of the selective scan
//! ([`scan_cuda::ScanBackward`]), of SSD ([`ssd_backward`]), of Based ([`based_backward`]:
//! SSD's backward for its linear branch, then its window's) and of the gated delta rule
//! ([`delta_backward`]).
//! `kernels/TUNING-sequence-mixers.md` has their designs, predictions and measurements.
//!
//! The entry points a user calls, with host tensors, one per mixer: [`api::ssd`],
//! [`api::selective_scan`], [`api::gated_delta_rule`] and [`api::based`]
//! ([`api::based_with_state`] carries Based's window cache between pieces too).
//!
//! The runner's side: a grid case with its FLOP, byte and token counts and its random inputs
//! ([`case`]), the protocol files of a case ([`files`]) and the float32 CPU implementation
//! ([`cpu`]), measured by `runners/sequence_mixers.rs`.

pub mod api;
pub mod based_backward;
pub mod based_cuda;
pub mod based_gradients;
pub mod case;
pub mod chunked;
pub mod cpu;
pub mod cuda;
pub mod delta_backward;
pub mod delta_cuda;
pub mod delta_gradients;
pub mod files;
pub mod gradients;
pub mod reference;
pub mod scan_cuda;
pub mod ssd_backward;
#[cfg(test)]
mod test_util;
