//! The kvroute command line's library half: file formats and benchmarks that the binary
//! (`main.rs`) wires to subcommands, kept here so integration tests can drive them.
//!
//! This crate is an edge: it reads files, the clock and `/proc`, and prints. The core it drives
//! does none of that.

pub mod bench;
pub mod calibrate;
pub mod config;
pub mod demo;
pub mod hardware;
pub mod log_fields;
pub mod opstream;
pub mod plan;
pub mod provenance;
pub mod replay;
pub mod serve;
pub mod tune;
