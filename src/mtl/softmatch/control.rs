//! The control messages of software matching, FIN and ACK: sent through the peer's
//! fast box, injected, or, under a send window, as copies in the window or queued for
//! progress while it is full ([`post_waiting_controls`]). Control messages carry no
//! order and are sent from progress too, so nothing here numbers a message or waits
//! for the window; what a FIN or ACK does on arrival is `bounce`'s.

use super::send::{fbox_post, send_copy};
use super::wire::Hdr;
use super::SoftMatch;
use crate::common::fbox;
use crate::fabric;
use crate::mtl::progress;
use crate::mtl::state::Mtl;
use std::sync::atomic::Ordering;

/// Send a control message (FIN or ACK) with `token` to `addr`: through `fbox` when
/// given and not full (control messages carry no order), else through the provider:
/// injected, or, under a send window (a provider that many messages in flight break,
/// [`SoftMatch`]'s `send_window`), from a copy with a completion of its own while the
/// window has room, else queued for progress ([`post_waiting_controls`]). It may be
/// called from progress, so it never waits for the window.
pub(super) fn control(m: &Mtl, addr: u64, fbox: Option<&fbox::Tx>, kind: u32, token: u64) {
    let h = Hdr {
        kind,
        token,
        ..Default::default()
    };
    if fbox.is_some_and(|tx| fbox_post(tx, &h, &[]).is_ok()) {
        return;
    }
    if let Some(sm) = m.soft.as_deref().filter(|sm| sm.send_window > 0) {
        // Control messages carry no order: one may pass those queued before it.
        if sm.has_controls_waiting.load(Ordering::Acquire) || !sm.window_open() {
            if let Some(mut q) = sm.controls() {
                q.push_back((addr, kind, token));
                sm.has_controls_waiting.store(true, Ordering::Release);
            }
        } else {
            control_copy(m, sm, &h, addr);
        }
        return;
    }
    let ep = m.ep();
    let ret = progress::retry(m, |s| ep.inject(s, &h.to_bytes(), addr));
    log_control_error(ret);
}

/// Send control header `h` to `addr` as a copy in the send window, unnumbered (seq 0,
/// as control messages are).
fn control_copy(m: &Mtl, sm: &SoftMatch, h: &Hdr, addr: u64) {
    let ret = send_copy(m, sm, h, &[], addr, &mut Some((0, 0)));
    log_control_error(ret);
}

fn log_control_error(ret: fabric::Result<()>) {
    if let Err(e) = ret {
        log::error!("sending a protocol message failed: {e}");
    }
}

/// Send the control messages that found the send window full, in order, while it has
/// room. Called by progress; one thread at a time, and not again from the progress
/// that a send's retry runs inside it.
pub fn post_waiting_controls(m: &Mtl, sm: &SoftMatch) {
    if sm
        .controls_flushing
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return;
    }
    flush_controls(m, sm);
    sm.controls_flushing.store(false, Ordering::Release);
}

fn flush_controls(m: &Mtl, sm: &SoftMatch) {
    while sm.window_open() {
        let next = {
            let Some(mut q) = sm.controls() else {
                return;
            };
            let next = q.pop_front();
            if q.is_empty() {
                sm.has_controls_waiting.store(false, Ordering::Release);
            }
            next
        };
        let Some((addr, kind, token)) = next else {
            return;
        };
        let h = Hdr {
            kind,
            token,
            ..Default::default()
        };
        control_copy(m, sm, &h, addr);
    }
}
