//! The OFI BTL: active messages, RDMA and atomics.
