//! The sequence-mixer suite (issue 12): recurrent token mixers that replace attention's
//! quadratic score matrix by a state carried along the sequence. This module holds their
//! float64 references, written as the sequential recurrence each paper defines, which every
//! kernel and every alternative will be checked against ([`reference`](mod@reference)), their backward
//! references ([`gradients`], [`delta_gradients`]), the chunked forms the kernels follow, run
//! on the CPU ([`chunked`]), and the first CUDA kernel, SSD's forward ([`cuda`]).
//!
//! Not here yet: the case type and its FLOP/byte counts, the other mixers' kernels, the
//! backward kernels, tensor-core tiles, and the runner.

pub mod chunked;
pub mod cuda;
pub mod delta_gradients;
pub mod gradients;
pub mod reference;
