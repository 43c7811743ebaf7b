//! The sans-IO core of kvroute.
//!
//! This crate holds what every other kvroute crate builds on: the typed identities of workers,
//! requests and KV blocks ([`ids`]), block hashing compatible with Dynamo's router ([`hash`]),
//! and the index of which blocks each worker holds ([`index`]).
//!
//! **Architecture invariant:** nothing here reads a clock, an environment variable, a file, a
//! socket or an entropy source, and nothing spawns a thread or a task. Inputs, time included,
//! arrive as arguments; outputs are returned values. The live server and the simulator drive
//! this same code. A test (`tests/layering.rs`) fails if the crate gains a dependency on an
//! async runtime, an HTTP stack or a ZMQ binding.
//!
//! ```
//! use kvroute_core::hash::{BlockHasher, HashSalt};
//! use kvroute_core::ids::{WorkerId, DpRank, WorkerKey};
//! use kvroute_core::index::{IndexConfig, RunIndex, StoredBlock};
//!
//! let hasher = BlockHasher::new(4, &HashSalt::NONE);
//! let tokens: Vec<u32> = (0..10).collect();
//! let locals = hasher.local_hashes(&tokens); // two full blocks; the last two tokens are not hashed
//! let seqs = hasher.sequence_hashes(&locals);
//!
//! let mut index = RunIndex::new(IndexConfig::default());
//! let w = WorkerKey::new(WorkerId(7), DpRank(0));
//! index.add_worker(w);
//! let blocks: Vec<StoredBlock> = locals
//!     .iter()
//!     .zip(&seqs)
//!     .map(|(&local, &seq)| StoredBlock { local, external: seq.into() })
//!     .collect();
//! index.apply_stored(w, None, &blocks).unwrap();
//! let scores = index.find_matches(&locals, false);
//! assert_eq!(scores.depth(w), 2);
//! ```
#![forbid(unsafe_code)]

pub mod events;
pub mod hash;
pub mod ids;
pub mod index;
pub mod key_hasher;
pub mod router;
pub mod time;
