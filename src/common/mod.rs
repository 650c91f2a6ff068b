//! Common OFI code shared by the BTL and the MTL.
pub mod monitor;
pub mod patch_check;
pub mod release;
