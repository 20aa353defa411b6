//! tutti-collectives' integration tests, one module per subject, in one test binary: one link
//! and one copy of the generic collectives for all of them instead of one per file (a build of
//! the workspace's tests spent 102 s of CPU on these 17 as binaries of their own, 38 s on this
//! one). Two stay binaries of their own: `direct_leaks`, which counts the process's descriptors
//! and mappings and so must run alone, and `staging`, the GPU suite that tools/gpu-bundle.sh
//! carries to a GPU machine.

mod common;

mod abort_timeout;
mod cost;
mod credits;
mod direct;
mod futures;
mod grid_mem;
mod interleaved;
mod known_answers;
mod lanes;
mod mismatch;
mod mixed_in_place;
mod nonblocking;
mod pieces;
mod plan_reuse;
mod prop;
mod shared;
mod subgroups;
mod tune;
