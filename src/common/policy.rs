//! The data-path settings both components derive from a provider's quirks, decided
//! once: `common::quirks` says what is wrong with a provider, this module says what the
//! components do about it, so that the MTL and the BTL never decide the same thing
//! twice (and never differently).
//!
//! What it owns: the mapping from [`Quirks`] to settings. What it must not touch: the
//! quirks themselves (`quirks.rs`), and the sizes only a component knows (its headers,
//! its parameters), which it applies to these settings itself.

use super::quirks::{self, Quirks};

/// What the components do on a provider, from its [`Quirks`]. Each field names the
/// quirk it answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// The MTL matches in software, over untagged messages and RMA reads, unless
    /// `mtl_ofi_matching` says otherwise ([`Quirks::tag_matching_unsafe`]).
    pub software_matching: bool,
    /// Receives end with an overflow area, so that the provider never truncates
    /// ([`Quirks::truncation_unsafe`]).
    pub overflow_receives: bool,
    /// Ask for manual data progress unless a progress parameter chooses
    /// ([`Quirks::lags_in_auto_progress`]).
    pub manual_progress: bool,
    /// A peek reads the completion queue first, because the provider meets a receive
    /// with a message that arrived before it only in its progress
    /// ([`Quirks::lags_in_auto_progress`]).
    pub lazy_matching: bool,
    /// Bytes of unexpected messages to ask the provider to buffer
    /// (`total_buffered_recv`); 0: leave it to the provider
    /// ([`Quirks::unexpected_unbuffered`]).
    pub unexpected_buffer: usize,
    /// Multi-receive buffers may be used where the provider offers them
    /// (not where [`Quirks::multi_recv_unsafe`] or [`Quirks::flood_unsafe`] holds).
    pub multi_recv: bool,
    /// Small sends in flight at most, each with a completion; 0: no window
    /// ([`Quirks::flood_unsafe`]).
    pub send_window: usize,
    /// Receive buffers the BTL posts at least; 0: `btl_ofi_rd_num` alone
    /// ([`Quirks::flood_unsafe`]).
    pub min_recv_buffers: usize,
    /// No send longer than one of the provider's packets (its inject size): longer
    /// messages go in pieces or by the receiver's read ([`Quirks::segments_unsafe`]).
    pub one_packet_sends: bool,
    /// Sends past the inject size go as trains of injects, for speed
    /// ([`Quirks::send_past_inject_slow`]).
    pub slow_sends_in_pieces: bool,
    /// The MTL's software matching receives into large buffers, so that fewer
    /// messages wait unexpected in the provider ([`Quirks::unexpected_stalls`]).
    pub large_bounces: bool,
    /// Each peer's messages are numbered and put back in the order they were sent
    /// ([`Quirks::reorders_messages`]).
    pub restore_order: bool,
    /// The BTL's `btl_ofi_atomics=auto` emulates the atomics with active messages
    /// ([`Quirks::atomics_crash`]).
    pub emulate_atomics: bool,
}

impl Policy {
    /// The settings for a provider with `quirks`.
    pub fn of_quirks(quirks: &Quirks) -> Policy {
        let flood = quirks.flood_unsafe;
        Policy {
            software_matching: quirks.tag_matching_unsafe(),
            overflow_receives: quirks.truncation_unsafe,
            manual_progress: quirks.lags_in_auto_progress,
            lazy_matching: quirks.lags_in_auto_progress,
            unexpected_buffer: if quirks.unexpected_unbuffered {
                quirks::UNEXPECTED_BUFFER
            } else {
                0
            },
            multi_recv: !(quirks.multi_recv_unsafe || flood),
            send_window: if flood { quirks::SEND_WINDOW } else { 0 },
            min_recv_buffers: if flood { quirks::FLOOD_RECV_BUFFERS } else { 0 },
            one_packet_sends: quirks.segments_unsafe,
            slow_sends_in_pieces: quirks.send_past_inject_slow,
            large_bounces: quirks.unexpected_stalls,
            restore_order: quirks.reorders_messages,
            emulate_atomics: quirks.atomics_crash,
        }
    }

    /// Eager sends longer than one inject go as trains of injects: they are unsafe
    /// ([`Policy::one_packet_sends`]) or slow ([`Policy::slow_sends_in_pieces`]).
    #[inline]
    pub fn sends_in_pieces(&self) -> bool {
        self.one_packet_sends || self.slow_sends_in_pieces
    }
}

/// The settings for a provider, by its `fi_info` name (`tcp;ofi_rxm`, `shm`, ...).
pub fn of(provider: &str) -> Policy {
    Policy::of_quirks(&quirks::of(provider))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provider_without_quirks_gets_the_plain_settings() {
        let p = of("efa");
        assert_eq!(
            p,
            Policy {
                multi_recv: true,
                ..Policy::default()
            }
        );
        assert!(!p.sends_in_pieces());
    }

    #[test]
    fn rxd_windows_its_sends_and_keeps_them_to_one_packet() {
        let p = of("udp;ofi_rxd");
        assert!(p.software_matching && p.overflow_receives);
        assert!(!p.multi_recv, "flood_unsafe forbids multi-receive buffers");
        assert_eq!(p.send_window, quirks::SEND_WINDOW);
        assert_eq!(p.min_recv_buffers, quirks::FLOOD_RECV_BUFFERS);
        assert!(p.one_packet_sends && !p.slow_sends_in_pieces && p.sends_in_pieces());
        assert!(p.large_bounces && p.restore_order && p.emulate_atomics);
        assert!(!p.manual_progress && !p.lazy_matching);
        assert_eq!(p.unexpected_buffer, 0);
    }

    #[test]
    fn shm_matches_in_software_and_splits_slow_sends() {
        let p = of("shm");
        assert!(p.software_matching && p.overflow_receives);
        assert!(
            !p.multi_recv,
            "multi_recv_unsafe forbids multi-receive buffers"
        );
        assert!(p.slow_sends_in_pieces && !p.one_packet_sends && p.sends_in_pieces());
        assert_eq!((p.send_window, p.min_recv_buffers), (0, 0));
        assert!(!p.large_bounces && !p.restore_order && !p.emulate_atomics);
    }

    #[test]
    fn rxm_matches_with_its_tags_but_not_into_multi_receive_buffers() {
        let p = of("tcp;ofi_rxm");
        assert!(!p.software_matching && p.overflow_receives && !p.multi_recv);
        assert_eq!(p.send_window, 0);
        assert!(!p.sends_in_pieces());
    }

    #[test]
    fn sockets_progresses_manually_and_buffers_unexpected_messages() {
        let p = of("sockets");
        assert!(p.manual_progress && p.lazy_matching);
        assert_eq!(p.unexpected_buffer, quirks::UNEXPECTED_BUFFER);
        assert!(p.multi_recv && !p.software_matching);
    }

    #[test]
    fn net_stalls_on_unexpected_messages() {
        let p = of("net");
        assert!(p.software_matching && p.large_bounces && !p.multi_recv);
        assert!(!p.one_packet_sends && !p.restore_order);
    }

    #[test]
    fn every_field_follows_its_quirk() {
        let all = Quirks {
            truncation_unsafe: true,
            unexpected_ignores_mask: true,
            unexpected_stalls: true,
            send_past_inject_slow: true,
            atomics_crash: true,
            unexpected_unbuffered: true,
            lags_in_auto_progress: true,
            reorders_messages: true,
            multi_recv_unsafe: true,
            flood_unsafe: true,
            segments_unsafe: true,
        };
        let p = Policy::of_quirks(&all);
        assert_eq!(
            p,
            Policy {
                software_matching: true,
                overflow_receives: true,
                manual_progress: true,
                lazy_matching: true,
                unexpected_buffer: quirks::UNEXPECTED_BUFFER,
                multi_recv: false,
                send_window: quirks::SEND_WINDOW,
                min_recv_buffers: quirks::FLOOD_RECV_BUFFERS,
                one_packet_sends: true,
                slow_sends_in_pieces: true,
                large_bounces: true,
                restore_order: true,
                emulate_atomics: true,
            }
        );
        assert_eq!(Policy::of_quirks(&Quirks::default()), of("efa"));
    }
}
