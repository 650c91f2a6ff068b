//! The one mapping from libfabric's errors to Open MPI's codes, used where an error
//! crosses into Open MPI (a return value or a request's status).
//!
//! What it owns: that mapping. What it must not touch: the errors themselves
//! (`fabric::Error`).

use crate::fabric::Error;
use libfabric_sys as fi;
use ompi_sys as sys;

/// An error as Open MPI's `OPAL_*` code (the `OMPI_*` codes share their values).
pub trait OpalCode {
    /// The Open MPI code that this error becomes at the component boundary.
    fn to_opal(self) -> i32;
}

impl OpalCode for Error {
    fn to_opal(self) -> i32 {
        let c = self.0 as u32;
        match c {
            fi::FI_EAGAIN => sys::OPAL_ERR_TEMP_OUT_OF_RESOURCE,
            fi::FI_ENOMEM | fi::FI_ENOSPC => sys::OPAL_ERR_OUT_OF_RESOURCE,
            fi::FI_EBUSY => sys::OPAL_ERR_RESOURCE_BUSY,
            fi::FI_EINVAL | fi::FI_EBADF | fi::FI_EBADFLAGS => sys::OPAL_ERR_BAD_PARAM,
            fi::FI_ENOSYS | fi::FI_EOPNOTSUPP => sys::OPAL_ERR_NOT_SUPPORTED,
            fi::FI_ENODATA | fi::FI_ENOENT => sys::OPAL_ERR_NOT_FOUND,
            fi::FI_ETIMEDOUT => sys::OPAL_ERR_TIMEOUT,
            fi::FI_EPERM | fi::FI_EACCES => sys::OPAL_ERR_PERM,
            fi::FI_ETRUNC | fi::FI_ETOOSMALL => sys::OPAL_ERR_BUFFER,
            fi::FI_ECONNREFUSED
            | fi::FI_ECONNRESET
            | fi::FI_ECONNABORTED
            | fi::FI_ENOTCONN
            | fi::FI_EHOSTUNREACH
            | fi::FI_ENETUNREACH
            | fi::FI_EADDRNOTAVAIL => sys::OPAL_ERR_UNREACH,
            _ => sys::OPAL_ERROR,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_control_and_memory() {
        assert_eq!(Error::AGAIN.to_opal(), sys::OPAL_ERR_TEMP_OUT_OF_RESOURCE);
        assert_eq!(Error::NOMEM.to_opal(), sys::OPAL_ERR_OUT_OF_RESOURCE);
        assert_eq!(
            Error(fi::FI_ECONNREFUSED as i32).to_opal(),
            sys::OPAL_ERR_UNREACH
        );
        assert_eq!(Error(12345).to_opal(), sys::OPAL_ERROR);
    }
}
