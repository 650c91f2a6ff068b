//! The head of every operation context handed to libfabric: the provider's scratch
//! space and the [`OpKind`] that says which struct contains it (a send fragment, a
//! receive buffer or an RDMA operation), so that progress routes each completion.
//!
//! What it owns: nothing; each path owns the structs that start with a [`Ctx`]. What
//! it must not touch: those structs beyond their first field.

use libfabric_sys as fi;
use std::os::raw::c_void;

/// What kind of operation a completion context belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum OpKind {
    Send,
    Recv,
    Rdma,
}

impl OpKind {
    /// What a log line calls such an operation.
    pub fn what(self) -> &'static str {
        match self {
            OpKind::Send => "a send",
            OpKind::Recv => "a receive",
            OpKind::Rdma => "an RDMA or atomic operation",
        }
    }

    /// The kind of the operation whose context is `ctx`, or `None` for a null context.
    ///
    /// # Safety
    /// `ctx` is null or the context of an operation this BTL posted (it starts with a
    /// [`Ctx`]).
    pub unsafe fn of(ctx: *mut c_void) -> Option<OpKind> {
        // SAFETY: caller's contract.
        (!ctx.is_null()).then(|| unsafe { (*(ctx as *const Ctx)).kind })
    }
}

/// The head of every operation context handed to libfabric: the provider's scratch
/// space (FI_CONTEXT/FI_CONTEXT2) and the kind that says which struct contains it.
#[repr(C)]
pub struct Ctx {
    pub fi: fi::fi_context2,
    pub kind: OpKind,
}

impl Ctx {
    pub fn new(kind: OpKind) -> Ctx {
        Ctx {
            fi: fi::fi_context2::default(),
            kind,
        }
    }

    /// The context handed to libfabric for an operation about to be posted.
    #[inline(always)]
    pub fn as_op_context(&mut self) -> *mut c_void {
        crate::common::quirks::scribble(&mut self.fi);
        self as *mut Ctx as *mut c_void
    }
}
