//! Common OFI code shared by the BTL and the MTL.
pub mod select;
