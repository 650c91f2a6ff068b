//! Safe owners of libfabric objects. Each owner closes its object in `Drop` and keeps
//! its parent alive, so objects are closed in the right order by construction.
pub mod error;
pub use error::{check, to_result, Error, Result};
