//! Provider behaviour that the components must work around, found on the providers of
//! libfabric 1.17 and each pinned by a test (tests/fabric.rs, mpi_tests/). One place
//! for them, so that a data path asks "does this provider need X" instead of testing
//! provider names.

/// What is known to be wrong with a provider.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quirks {
    /// A receive shorter than its message goes wrong inside the provider: later
    /// messages from that peer are never delivered (ofi_rxm and net 1.17; the C MTL
    /// hangs the same way on tcp), or the truncation is not reported at all
    /// (ofi_rxd), or a large truncated message hangs (shm). Receives then carry an overflow buffer so that the provider never
    /// truncates, and the MTL detects truncation from the length.
    pub truncation_unsafe: bool,
    /// Matching of unexpected messages ignores the receive's ignore mask, so wildcard
    /// receives miss (or mis-match) messages that arrived before them (shm 1.17).
    pub unexpected_ignores_mask: bool,
    /// Unexpected tagged messages stall the provider: thousands of them, or a few large
    /// ones, and the sends never complete (net 1.17; ofi_rxd 1.17, which also hangs
    /// under concurrent tagged traffic from several threads and in 4-rank rings of
    /// 4 MiB messages). The C MTL stalls the same way. Matching in software, over
    /// untagged messages, passes the same programs (mpi_tests `many_posted`,
    /// `wildcards`, `ssend`, `threads`, `truncation_large`).
    pub unexpected_stalls: bool,
    /// A message past the provider's inject size is slow: shm 1.17 moves it with
    /// `process_vm_readv` (with CMA) or through its segment buffers, several times the
    /// time of an injected one (`fi_pingpong -p shm` at 4096 and 4200 bytes). The MTL's
    /// software matching sends its eager messages there (up to two injects; larger ones
    /// are read), and the BTL its fragments up to 16 KiB, as trains of injects.
    /// Evidence: [docs/providers/shm.md](../../docs/providers/shm.md#sends-past-the-inject-size-are-slow).
    pub send_past_inject_slow: bool,
    /// The provider's atomics crash it: osc rdma's atomics over udp;ofi_rxd 1.17
    /// segfault inside rxd's progress (mpi_tests `onesided` and `atomics`), while the
    /// same programs pass with the atomics done by active messages. The BTL's
    /// `btl_ofi_atomics=auto` then emulates them.
    /// Evidence: [docs/providers/udp_rxd.md](../../docs/providers/udp_rxd.md#atomics-crash-it).
    pub atomics_crash: bool,
    /// The provider buffers no message that arrives before its receive unless asked
    /// (sockets: `total_buffered_recv` is 0 in what `fi_getinfo` returns): such a
    /// message waits in the socket and blocks every later one from that peer, so a
    /// receiver that posts its receives in another order than the sends deadlocks.
    /// The MTL asks for [`UNEXPECTED_BUFFER`] bytes.
    pub unexpected_unbuffered: bool,
    /// Under automatic progress the provider's own thread does the work, at its own
    /// pace (sockets). A receive posted after its message arrived meets the message
    /// only there: until then `FI_PEEK` reports the message as unexpected, and the
    /// MTL's stall breaker would receive it exactly while the older receive took it
    /// ("Stash failed: Truncation error" and hangs in mpi_tests `threads --many 100` at
    /// 4 ranks). Floods stall too (`many_posted`, `comms`). Both components ask for
    /// manual progress there unless their progress parameters say otherwise, so that
    /// their own completion-queue reads do the work.
    /// Evidence: [docs/providers/sockets.md](../../docs/providers/sockets.md#its-progress-thread-lags).
    pub lags_in_auto_progress: bool,
    /// A peer's messages may arrive out of the order they were sent, though the
    /// provider promises `FI_ORDER_SAS` (ofi_rxd 1.17: an 8-byte message overtook the
    /// 0-byte one sent before it on the same communicator and tag in mpi_tests
    /// `threads`; repro/rxd_msg_flood.c shows it without MPI). The MTL's software
    /// matching then numbers each peer's messages and restores their order; ob1 over
    /// the BTL has its own sequence numbers.
    /// Evidence: [docs/providers/udp_rxd.md](../../docs/providers/udp_rxd.md#out-of-order-delivery).
    pub reorders_messages: bool,
    /// Multi-receive buffers lose messages:
    /// - ofi_rxm 1.17 advances a buffer by less than a message past its eager size
    ///   (16 KiB unless `FI_OFI_RXM_BUFFER_SIZE` says otherwise), so the next message
    ///   lands over its end and messages arrive cut or not at all (ob1 over the BTL in
    ///   mpi_tests `collectives` at 4 ranks; mpi_tests/repro/rxm_multi_recv.c without
    ///   MPI);
    /// - shm 1.17 refuses a buffer with -FI_ENOMEM once it holds about 1,024 unexpected
    ///   messages, and the buffer is lost (mpi_tests `many_posted` with 10,000 messages;
    ///   mpi_tests/repro/shm_multi_recv_unexp.c);
    /// - net 1.17 loses messages when several peers flood one rank with fragments of up
    ///   to 20 KB (ob1 over the BTL in mpi_tests `fbox` at 4 ranks).
    ///
    /// The components then post one receive buffer per message, which passes the same
    /// programs at the same latency and bandwidth. Evidence:
    /// [tcp_rxm.md](../../docs/providers/tcp_rxm.md#multi-receive-buffers),
    /// [shm.md](../../docs/providers/shm.md#multi-receive-buffers),
    /// [net.md](../../docs/providers/net.md#multi-receive-buffers).
    pub multi_recv_unsafe: bool,
    /// Many small messages in flight at once break the provider: it delivers some out
    /// of order, cuts them to their first 16 bytes, or stalls (udp;ofi_rxd 1.17: our
    /// MTL's `many_posted`, 5000 unexpected 8-byte messages from one peer;
    /// `mpi_tests/repro/rxd_msg_flood.c` floods with injects without MPI, and passes
    /// with a window of sends in flight, each with a completion). The MTL's software
    /// matching then sends small messages with a completion each, keeps at most
    /// [`SEND_WINDOW`] in flight, and receives into one buffer per message; the BTL
    /// does the same (and posts at least [`FLOOD_RECV_BUFFERS`]).
    /// Evidence: [docs/providers/udp_rxd.md](../../docs/providers/udp_rxd.md#floods-of-small-messages).
    pub flood_unsafe: bool,
    /// Messages longer than one of the provider's packets (its inject size) arrive cut
    /// or mixed with other messages when many are in flight: ofi_rxd 1.17 completed a
    /// receive of a 64 KiB fragment with `FI_ETRUNC` after counting every segment but
    /// placing only part of its bytes, or delivered "40 payload bytes" as 64 (ob1 over
    /// the BTL in mpi_tests `dt_displaced` and `p2p`'s Bsend of 4 MiB, and the MTL's
    /// `p2p` at 8 ranks, where a 4 MiB read completed with a byte never written).
    ///
    /// The cause (`mpi_tests/repro/rxd_unexp_replay.c`, without MPI): rxd finds the
    /// receive that a data packet of a long send belongs to through one field per peer,
    /// set by the send's first packet. Posting a receive that matches an unexpected
    /// message replays that message through the same code, which points the field at
    /// the replayed receive and does not set it back: the rest of a long send that the
    /// same peer has in flight goes to that receive, completed and freed by then. Reads
    /// are not hit (their data packets name the request they belong to); writes are
    /// (their data packets take a send's path).
    ///
    /// So the BTL keeps its fragments within the inject size unless
    /// `btl_ofi_max_send_size` is set, and does a put longer than a packet by the
    /// target's read (`btl::put_by_read::post`), or, without active messages, as writes of one
    /// packet; the MTL sends none longer than a packet: messages up to
    /// `mtl::softmatch::PIECES_EAGER_MAX` go in pieces of one packet, larger ones are
    /// read. Evidence: [docs/providers/udp_rxd.md](../../docs/providers/udp_rxd.md#long-sends-and-writes).
    pub segments_unsafe: bool,
}

/// Small sends in flight at most where [`Quirks::flood_unsafe`] holds.
pub const SEND_WINDOW: usize = 32;

/// Receive buffers (one fragment each) that the BTL posts at least where
/// [`Quirks::flood_unsafe`] holds (`btl_ofi_rd_num`'s default is 8), so that fewer
/// messages arrive unexpected, rxd's weakest path.
pub const FLOOD_RECV_BUFFERS: usize = 64;

/// Bytes of unexpected messages asked of a provider with `unexpected_unbuffered`
/// (the most sockets accepts).
pub const UNEXPECTED_BUFFER: usize = 64 << 20;

impl Quirks {
    /// The MTL should match in software rather than with the provider's tags.
    pub fn tag_matching_unsafe(&self) -> bool {
        self.unexpected_ignores_mask || self.unexpected_stalls
    }
}

/// The quirks of a provider, by its `fi_info` name (`tcp;ofi_rxm`, `shm`, ...).
pub fn of(provider: &str) -> Quirks {
    let layers: Vec<&str> = provider.split(';').collect();
    Quirks {
        truncation_unsafe: layers
            .iter()
            .any(|l| matches!(*l, "ofi_rxm" | "ofi_rxd" | "net" | "sockets" | "shm")),
        unexpected_ignores_mask: layers.first() == Some(&"shm"),
        unexpected_stalls: layers.iter().any(|l| matches!(*l, "ofi_rxd" | "net")),
        send_past_inject_slow: layers.first() == Some(&"shm"),
        atomics_crash: layers.contains(&"ofi_rxd"),
        unexpected_unbuffered: layers.first() == Some(&"sockets"),
        lags_in_auto_progress: layers.first() == Some(&"sockets"),
        reorders_messages: layers.contains(&"ofi_rxd"),
        multi_recv_unsafe: layers.contains(&"ofi_rxm")
            || matches!(layers.first(), Some(&"shm") | Some(&"net")),
        flood_unsafe: layers.contains(&"ofi_rxd"),
        segments_unsafe: layers.contains(&"ofi_rxd"),
    }
}

/// Test hook for the context modes: with `OMPI_OFI_TEST_SCRIBBLE_CONTEXT=1` in the
/// environment, every operation's `FI_CONTEXT2` space is filled with garbage just
/// before the operation is posted, as a provider that asks for `FI_CONTEXT` or
/// `FI_CONTEXT2` (efa) may do with it until the completion. No provider on this
/// machine asks, so this is how the tests show that nothing the components keep
/// lives in that space (`scripts/test-context-modes`).
pub fn scribble_contexts() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static STATE: AtomicU8 = AtomicU8::new(0);
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var_os("OMPI_OFI_TEST_SCRIBBLE_CONTEXT").is_some_and(|v| v == "1");
            if STATE.swap(if on { 2 } else { 1 }, Ordering::Relaxed) == 0 && on {
                log::warn!(
                    "OMPI_OFI_TEST_SCRIBBLE_CONTEXT=1 (test hook): every operation's FI_CONTEXT2 \
                     space is filled with garbage before it is posted"
                );
            }
            on
        }
    }
}

/// Fill `ctx` with garbage when [`scribble_contexts`] is on.
#[inline(always)]
pub fn scribble(ctx: &mut libfabric_sys::fi_context2) {
    if scribble_contexts() {
        for p in ctx.internal.iter_mut() {
            *p = 0xA5A5_A5A5_A5A5_A5A5usize as *mut std::ffi::c_void;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_name() {
        assert!(of("tcp;ofi_rxm").truncation_unsafe);
        assert!(of("verbs;ofi_rxm").truncation_unsafe);
        assert!(of("udp;ofi_rxd").truncation_unsafe);
        assert!(of("net").truncation_unsafe);
        assert!(of("shm").unexpected_ignores_mask);
        assert!(of("shm").truncation_unsafe);
        assert!(of("udp;ofi_rxd").atomics_crash);
        assert!(of("udp;ofi_rxd").tag_matching_unsafe());
        assert!(of("net").tag_matching_unsafe());
        assert!(of("shm").tag_matching_unsafe());
        assert!(!of("tcp;ofi_rxm").tag_matching_unsafe());
        assert!(!of("tcp").tag_matching_unsafe());
        assert!(!of("tcp;ofi_rxm").atomics_crash);
        assert!(of("sockets").unexpected_unbuffered);
        assert!(of("tcp;ofi_rxm").multi_recv_unsafe);
        assert!(of("verbs;ofi_rxm").multi_recv_unsafe);
        assert!(of("shm").multi_recv_unsafe);
        assert!(of("net").multi_recv_unsafe);
        assert!(!of("udp;ofi_rxd").multi_recv_unsafe);
        assert!(of("udp;ofi_rxd").flood_unsafe);
        assert!(!of("tcp;ofi_rxm").flood_unsafe);
        assert!(!of("shm").flood_unsafe);
        assert!(of("udp;ofi_rxd").segments_unsafe);
        assert!(!of("tcp;ofi_rxm").segments_unsafe);
        assert!(!of("net").segments_unsafe);
        assert!(!of("tcp").unexpected_unbuffered);
        assert_eq!(of("efa"), Quirks::default());
    }
}
