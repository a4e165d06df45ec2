//! kernelpages: measure compute kernels on a GPU and publish their performance pages from the
//! measurements alone.
//!
//! Data flows one way: runners (`runners/`) measure and write suite documents
//! ([`schema::Document`]) to `data/`; [`load`] is the only reader of `data/`; [`site`] builds a
//! page model from what was loaded, renders it and writes the site atomically.
#![warn(missing_docs)]

pub mod attention;
pub mod gpu;
pub mod harness;
pub mod kernel_sums;
pub mod load;
pub mod moe;
pub mod runner;
pub mod schema;
pub mod sequence_mixers;
pub mod site;
