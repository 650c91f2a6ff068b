//! One error type over libfabric's negative `FI_E*` return codes. Its mapping to Open
//! MPI's `OPAL_ERR_*` codes is `ompi::error`'s: this room knows nothing of Open MPI.
//! `-FI_EAGAIN` is flow control: callers test [`Error::is_again`] and progress.

use libfabric_sys as fi;
use std::ffi::CStr;
use std::fmt;

/// A libfabric error: the positive `FI_E*` / errno value (libfabric returns it negated).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Error(pub i32);

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub const AGAIN: Error = Error(fi::FI_EAGAIN as i32);
    pub const NOMEM: Error = Error(fi::FI_ENOMEM as i32);
    pub const NODATA: Error = Error(fi::FI_ENODATA as i32);
    pub const NOSYS: Error = Error(fi::FI_ENOSYS as i32);
    pub const BUSY: Error = Error(fi::FI_EBUSY as i32);
    pub const INVAL: Error = Error(fi::FI_EINVAL as i32);
    pub const AVAIL: Error = Error(fi::FI_EAVAIL as i32);
    pub const CANCELED: Error = Error(fi::FI_ECANCELED as i32);
    pub const TRUNC: Error = Error(fi::FI_ETRUNC as i32);
    pub const NOENT: Error = Error(fi::FI_ENOENT as i32);
    pub const OPNOTSUPP: Error = Error(fi::FI_EOPNOTSUPP as i32);
    pub const ALREADY: Error = Error(fi::FI_EALREADY as i32);
    pub const NOMSG: Error = Error(fi::FI_ENOMSG as i32);
    pub const TIMEDOUT: Error = Error(fi::FI_ETIMEDOUT as i32);

    /// Build from a libfabric return value that is known to be negative.
    pub fn from_ret(ret: isize) -> Error {
        Error(ret.unsigned_abs().min(i32::MAX as usize) as i32)
    }

    /// `-FI_EAGAIN`: resources are busy, progress and retry.
    pub fn is_again(self) -> bool {
        self == Error::AGAIN
    }

    /// libfabric's own description of the code (`fi_strerror`).
    pub fn message(self) -> String {
        // SAFETY: fi_strerror returns a pointer to a static NUL-terminated string
        // for any input value.
        unsafe {
            let p = fi::fi_strerror(self.0);
            if p.is_null() {
                format!("libfabric error {}", self.0)
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }
}

/// Turn a libfabric return value into a `Result`: negative is an error, the rest is
/// returned as is (counts and sizes come back positive).
pub fn to_result(ret: isize) -> Result<usize> {
    if ret < 0 {
        Err(Error::from_ret(ret))
    } else {
        Ok(ret as usize)
    }
}

/// [`to_result`] for the many calls that return `int`.
pub fn check(ret: i32) -> Result<()> {
    to_result(ret as isize).map(|_| ())
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Error({}: {})", self.0, self.message())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (-{})", self.message(), self.0)
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_is_error_positive_is_value() {
        assert_eq!(to_result(-(fi::FI_EAGAIN as isize)), Err(Error::AGAIN));
        assert_eq!(to_result(5), Ok(5));
        assert!(Error::AGAIN.is_again());
        assert!(
            Error::AGAIN.message().to_lowercase().contains("again")
                || Error::AGAIN
                    .message()
                    .to_lowercase()
                    .contains("unavailable")
        );
    }
}
