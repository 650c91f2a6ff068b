//! The head of every operation context handed to libfabric: the provider's scratch
//! space and the [`OpKind`] that says which struct contains it (a send fragment, a
//! receive buffer or an RDMA operation), so that progress routes each completion.
//!
//! What it owns: nothing; each path owns the structs that hold a [`Ctx`]. What it
//! must not touch: those structs beyond their [`Ctx`].

use crate::fabric::Scratch;

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
}

/// The context of every operation this BTL posts: the provider's scratch space
/// (FI_CONTEXT/FI_CONTEXT2) first, then the kind that says which struct holds it.
#[repr(C)]
pub struct Ctx {
    pub fi: Scratch,
    pub kind: OpKind,
}

impl Ctx {
    pub fn new(kind: OpKind) -> Ctx {
        Ctx {
            fi: Scratch::default(),
            kind,
        }
    }
}
