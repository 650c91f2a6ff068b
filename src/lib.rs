//! ompi-ofi: Open MPI's OFI components (common code, the MTL and the BTL) in Rust.
//!
//! The shared object built from this crate exports exactly two symbols,
//! `mca_btl_ofi_component` and `mca_mtl_ofi_component`; Open MPI loads it under both
//! names (`mca_btl_ofi.so`, `mca_mtl_ofi.so`) and the dynamic loader maps it once, so
//! the common state in [`common`] exists once per process.
//!
//! Layout (see docs/design.md): [`fabric`] owns libfabric objects safely, [`common`] holds
//! provider selection, the shared fabric/domain and the memory monitor, [`mtl`] and
//! [`btl`] are the two data paths, [`ompi`] is the boundary with Open MPI (component
//! structs, MCA parameters, output, modex).

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod btl;
pub mod common;
pub mod fabric;
pub mod mtl;
pub mod ompi;
