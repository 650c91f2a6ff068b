//! Open MPI's BTL structs and callbacks as the BTL sees them: the completion an RDMA
//! or atomic caller asked for ([`RdmaCallback`]), a send descriptor's callback
//! ([`notify_sent`]), the active-message callbacks the PML registered ([`deliver`]),
//! the module template whose fields the `btl_ofi_*` variables bind to
//! ([`Template`]), the module array `btl_init` returns, and the job's shape.
//!
//! What it owns: every call of a BTL-interface callback and every read of
//! `mca_btl_base_active_message_trigger`. What it must not touch: the BTL's own
//! state (`btl::module`), and the lifetime of what the PML hands over, which is the
//! PML's.

use crate::fabric::Local;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, Ordering};

pub type BtlModule = sys::mca_btl_base_module_t;

/// The BTL's own module struct `M` behind the module pointer Open MPI calls an entry
/// point with.
///
/// # Safety
/// `btl` points to a live `M`, a `#[repr(C)]` struct whose first field is the
/// `mca_btl_base_module_t` Open MPI knows (a module the BTL's init returned and Open
/// MPI has not finalized), for `'a`.
#[inline(always)]
pub unsafe fn module<'a, M>(btl: *mut BtlModule) -> &'a M {
    // SAFETY: btl points to a live M that starts with the module (the contract).
    unsafe { &*(btl as *const M) }
}

/// The BTL's own endpoint struct `E` behind an endpoint pointer (`None`: null).
///
/// # Safety
/// `ep` is null or points to a live `E` that the BTL's `add_procs` handed out and
/// `del_procs` has not taken back, for `'a`.
#[inline(always)]
pub unsafe fn endpoint<'a, E>(ep: *mut sys::mca_btl_base_endpoint_t) -> Option<&'a E> {
    // SAFETY: ep is null or points to a live E of add_procs (the contract).
    unsafe { (ep as *const E).as_ref() }
}

/// A registration handle the BTL hands out (`register_mem`), as the BTL's own struct:
/// what a local operation needs of it.
pub trait LocalHandle {
    /// The descriptor of its registration (`fi_mr_desc`).
    fn desc(&self) -> *mut c_void;
}

/// What an RDMA or atomic entry point receives, typed: the module `M`, the peer `E`,
/// the local buffer with the descriptor of its handle `R`, the remote handle's `N`
/// bytes as read once (see [`read_handle`]), and the completion.
pub struct RdmaArgs<'a, M, E, const N: usize> {
    pub module: &'a M,
    pub peer: Option<&'a E>,
    pub local: Local,
    pub remote_handle: Option<[u8; N]>,
    pub cb: RdmaCallback,
}

/// The arguments of an RDMA or atomic entry point, whose local buffer is `local_len`
/// bytes long (0 for an atomic without a result).
///
/// # Safety
/// The arguments of one call of an RDMA or atomic entry point: `btl` as for
/// [`module`], `endpoint` as for [`endpoint`]; `local_address` null or valid for
/// `local_len` bytes until the callback, as the BTL interface promises (see
/// `Local::new` and [`RdmaCallback::new`]); `local_handle` null or an `R` of the
/// BTL's `register_mem` that covers it; `remote_handle` null or a handle of `N`
/// readable bytes, which may change while it is read.
#[allow(clippy::too_many_arguments)]
#[inline]
pub unsafe fn rdma_args<'a, M, E, R: LocalHandle, const N: usize>(
    btl: *mut BtlModule,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    local_len: usize,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> RdmaArgs<'a, M, E, N> {
    // SAFETY: the function's contract, argument by argument.
    unsafe {
        let desc = (local_handle as *const R)
            .as_ref()
            .map_or(ptr::null_mut(), R::desc);
        let len = if local_address.is_null() {
            0
        } else {
            local_len
        };
        RdmaArgs {
            module: module(btl),
            peer: self::endpoint(endpoint),
            local: Local::new(local_address, len, desc),
            remote_handle: (!remote_handle.is_null()).then(|| read_handle(remote_handle)),
            cb: RdmaCallback::new(
                endpoint,
                local_address,
                local_handle,
                cbfunc,
                cbcontext,
                cbdata,
            ),
        }
    }
}

/// The modules a BTL runs, at most `N`, published for the component's progress and
/// counters (`iter`) from init until Open MPI finalizes them or closes the component.
///
/// Invariant: a slot holds null or a module `publish` leaked from its box, which only
/// `unpublish` takes back (and then frees it, once Open MPI no longer calls it).
pub struct Published<M, const N: usize>([AtomicPtr<M>; N]);

impl<M: 'static, const N: usize> Published<M, N> {
    pub const fn new() -> Self {
        Published([const { AtomicPtr::new(ptr::null_mut()) }; N])
    }

    /// Publish `module` in slot `i`; the pointer Open MPI is to know it by (null, and
    /// the module dropped, past the slots).
    pub fn publish(&self, i: usize, module: Box<M>) -> *mut M {
        let Some(slot) = self.0.get(i) else {
            return ptr::null_mut();
        };
        let m = Box::into_raw(module);
        slot.store(m, Ordering::Release);
        m
    }

    /// Take `module` out of its slot (`None`: the module of every slot), with the box
    /// `publish` gave up.
    pub fn unpublish(&self, module: Option<*mut M>) -> impl Iterator<Item = Box<M>> + '_ {
        self.0.iter().filter_map(move |slot| {
            let m = match module {
                None => slot.swap(ptr::null_mut(), Ordering::AcqRel),
                Some(want) => slot
                    .compare_exchange(want, ptr::null_mut(), Ordering::AcqRel, Ordering::Acquire)
                    .unwrap_or(ptr::null_mut()),
            };
            // SAFETY: a slot holds null or a module publish leaked (the type's
            // invariant), which the swap above took out: nothing else takes it back.
            (!m.is_null()).then(|| unsafe { Box::from_raw(m) })
        })
    }

    /// The published modules, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = &'static M> + '_ {
        self.0.iter().filter_map(|slot| {
            let m = slot.load(Ordering::Acquire);
            // SAFETY: null or a live published module (the type's invariant); a module
            // is freed only after `unpublish` took it out, which Open MPI does (finalize,
            // component close) only once no other call into the component runs.
            unsafe { m.as_ref() }
        })
    }
}

impl<M: 'static, const N: usize> Default for Published<M, N> {
    fn default() -> Self {
        Self::new()
    }
}

/// The array of modules `btl_init` returns, from the C heap (Open MPI frees it with
/// `free`).
pub struct ModuleArray {
    arr: NonNull<*mut BtlModule>,
    len: usize,
}

impl ModuleArray {
    /// Room for `len` modules (at least one), null until set; `None` when out of
    /// memory.
    pub fn new(len: usize) -> Option<ModuleArray> {
        let n = len.max(1);
        // SAFETY: a plain zeroed allocation (null pointers), checked for null below.
        let arr = unsafe { libc::calloc(n, std::mem::size_of::<*mut BtlModule>()) };
        NonNull::new(arr.cast()).map(|arr| ModuleArray { arr, len })
    }

    /// Module `i` (ignored past the array).
    pub fn set(&mut self, i: usize, module: *mut BtlModule) {
        if i < self.len {
            // SAFETY: i < len, within the allocation.
            unsafe { *self.arr.as_ptr().add(i) = module };
        }
    }

    /// The array for Open MPI, which frees it.
    pub fn into_raw(self) -> *mut *mut BtlModule {
        std::mem::ManuallyDrop::new(self).arr.as_ptr()
    }
}

impl Drop for ModuleArray {
    fn drop(&mut self) {
        // SAFETY: from calloc, not handed to Open MPI (into_raw forgets self).
        unsafe { libc::free(self.arr.as_ptr().cast()) };
    }
}

/// What an RDMA or atomic entry point receives for its completion: the callback, its
/// context and data, and the endpoint and local buffer it is called with.
///
/// Invariant (the contract of [`RdmaCallback::new`]): the callback may be called, once,
/// with these arguments, and the local buffer is valid for the operation until then.
#[derive(Clone, Copy, Debug)]
pub struct RdmaCallback {
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
}

// SAFETY: the pointers are the caller's, valid until the callback (the type's
// invariant) whichever thread completes the operation; the BTL interface lets any
// thread that progresses the module call back.
unsafe impl Send for RdmaCallback {}

impl RdmaCallback {
    /// # Safety
    /// The arguments of one call of a BTL RDMA or atomic entry point: `cbfunc` (if
    /// any) may be called once with them, from any thread, until it has been; and
    /// `local_address` is null or valid for the operation's local bytes (for a
    /// fetching atomic, room for the result, at most 8 bytes) until then.
    #[inline]
    pub unsafe fn new(
        endpoint: *mut sys::mca_btl_base_endpoint_t,
        local_address: *mut c_void,
        local_handle: *mut sys::mca_btl_base_registration_handle_t,
        cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
        cbcontext: *mut c_void,
        cbdata: *mut c_void,
    ) -> RdmaCallback {
        RdmaCallback {
            endpoint,
            local_address,
            local_handle,
            cbfunc,
            cbcontext,
            cbdata,
        }
    }

    /// No callback: a part of an operation that completes with its whole.
    pub const NONE: RdmaCallback = RdmaCallback {
        endpoint: ptr::null_mut(),
        local_address: ptr::null_mut(),
        local_handle: ptr::null_mut(),
        cbfunc: None,
        cbcontext: ptr::null_mut(),
        cbdata: ptr::null_mut(),
    };

    #[inline(always)]
    pub fn endpoint(&self) -> *mut sys::mca_btl_base_endpoint_t {
        self.endpoint
    }

    #[inline(always)]
    pub fn local_address(&self) -> *mut c_void {
        self.local_address
    }

    #[inline(always)]
    pub fn local_handle(&self) -> *mut sys::mca_btl_base_registration_handle_t {
        self.local_handle
    }

    /// Write a fetching atomic's previous value (its first `bytes.len()` bytes, at
    /// most 8) to the local buffer, before calling back.
    #[inline]
    pub fn write_result(&self, bytes: &[u8]) {
        if self.local_address.is_null() {
            return;
        }
        let n = bytes.len().min(8);
        // SAFETY: the local buffer has room for the result until the callback (the
        // type's invariant), and the caller does not read it before then.
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), self.local_address.cast(), n) };
    }

    /// Call back (when there is a callback) with `status`. The operation is over for
    /// its caller once this returns; a path calls it once per operation.
    // `btl` is only handed on to the caller's callback, which the BTL interface gives it.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    #[inline]
    pub fn complete(&self, btl: *mut BtlModule, status: c_int) {
        if let Some(cb) = self.cbfunc {
            // SAFETY: the caller's callback with its own arguments, once (the type's
            // invariant); `btl` is the module the operation was posted on.
            unsafe {
                cb(
                    btl,
                    self.endpoint,
                    self.local_address,
                    self.local_handle,
                    self.cbcontext,
                    self.cbdata,
                    status,
                )
            };
        }
    }
}

/// The bytes of a registration handle a peer's `register_mem` made, read from memory
/// another process may be rewriting as we read (osc rdma's table of dynamic regions,
/// see `btl::resolve`): exactly once, with one volatile read, so that the compiler
/// cannot read it again for a later use and see other bytes than the ones checked.
/// The handle need not be aligned.
///
/// # Safety
/// `h` points to `N` readable bytes.
#[inline]
pub unsafe fn read_handle<const N: usize>(
    h: *const sys::mca_btl_base_registration_handle_t,
) -> [u8; N] {
    // SAFETY: h points to N readable bytes (the contract), and [u8; N] has alignment 1,
    // so an unaligned handle reads fine.
    unsafe { ptr::read_volatile(h as *const [u8; N]) }
}

/// Call a send descriptor's callback (when it has one) with `status`. The PML may
/// free the descriptor (`btl_free`) from the callback when the BTL does not own it.
// The pointers are only handed on to the PML's callback, as the BTL interface defines.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
#[inline]
pub fn notify_sent(
    btl: *mut BtlModule,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    des: &mut sys::mca_btl_base_descriptor_t,
    status: c_int,
) {
    if let Some(cb) = des.des_cbfunc {
        // SAFETY: the callback the PML set in its own descriptor, called with that
        // descriptor (borrowed for the call), its endpoint and our module.
        unsafe { cb(btl, endpoint, des, status) };
    }
}

/// Hand a received fragment's payload to the callback the PML registered for `tag`;
/// `false` when none is registered. The callback may read and write the payload
/// until it returns.
// `btl` is only handed on to the PML's callback, as the BTL interface defines.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
#[inline]
pub fn deliver(btl: *mut BtlModule, tag: u8, payload: &mut [u8]) -> bool {
    if tag as u32 >= sys::MCA_BTL_TAG_MAX {
        return false;
    }
    // SAFETY: the trigger table is Open MPI's static array of MCA_BTL_TAG_MAX entries
    // (tag checked above), filled by the PMLs before any traffic and not written
    // after; one entry is read by value through a raw pointer (no reference to the
    // mutable static).
    let trig = unsafe {
        *(&raw const sys::mca_btl_base_active_message_trigger
            as *const sys::mca_btl_active_message_callback_t)
            .add(tag as usize)
    };
    let Some(cb) = trig.cbfunc else {
        return false;
    };
    let mut seg = sys::mca_btl_base_segment_t {
        seg_addr: sys::opal_ptr_t {
            pval: payload.as_mut_ptr().cast(),
        },
        seg_len: payload.len() as u64,
    };
    let mut des = sys::mca_btl_base_descriptor_t {
        des_segments: &mut seg,
        des_segment_count: 1,
        ..Default::default()
    };
    // SAFETY: the PML's callback with its data; the descriptor and its segment live on
    // this stack and the payload is borrowed mutably for the call.
    unsafe { cb(btl, tag, &mut des, trig.cbdata) };
    true
}

/// The reachability bitmap `add_procs` fills: a bit per proc it was passed.
pub struct Reachable {
    bitmap: *mut sys::opal_bitmap_t,
    procs: usize,
}

impl Reachable {
    /// # Safety
    /// `bitmap` is null or the bitmap of at least `procs` bits that `add_procs`
    /// received, valid for the call.
    #[inline]
    pub unsafe fn new(bitmap: *mut sys::opal_bitmap_t, procs: usize) -> Reachable {
        Reachable { bitmap, procs }
    }

    /// Mark proc `i` reachable (nothing without a bitmap, or past its procs).
    #[inline]
    pub fn mark(&self, i: usize) {
        if i < self.procs {
            // SAFETY: the bitmap is null or has room for `procs` bits (the contract
            // of `new`), and i < procs.
            unsafe { super::proc::mark_reachable(self.bitmap, i) };
        }
    }
}

/// The module template whose generic fields `mca_btl_base_param_register` binds to the
/// component's variables. On the C heap and never freed: Open MPI keeps pointers to
/// its fields for as long as the variables exist, which may be after an unload.
pub struct Template(AtomicPtr<BtlModule>);

unsafe extern "C" {
    fn mca_btl_base_param_register(
        version: *mut sys::mca_base_component_t,
        module: *mut BtlModule,
    ) -> c_int;
    fn ompi_ofi_btl_glue_job_size() -> u32;
}

impl Template {
    pub const fn new() -> Template {
        Template(AtomicPtr::new(ptr::null_mut()))
    }

    /// Make the template (once), let `fill` set its fields, and register the generic
    /// BTL variables of `component` on it. Run from the component's register, which
    /// Open MPI serialises. `false` when out of memory.
    // Never inlined: scripts/valgrind-ours recognises the template's deliberate leak
    // by this function's name, which an inlined frame would lose.
    #[inline(never)]
    pub fn register(
        &self,
        component: *const sys::mca_base_component_t,
        fill: impl FnOnce(&mut BtlModule),
    ) -> bool {
        let mut t = self.0.load(Ordering::Acquire);
        if t.is_null() {
            // SAFETY: a plain allocation, checked; a zeroed module is a valid value
            // (integers, nullable pointers, None).
            t = unsafe { libc::calloc(1, std::mem::size_of::<BtlModule>()) }.cast();
            if t.is_null() {
                return false;
            }
            self.0.store(t, Ordering::Release);
        }
        // SAFETY: the template is ours, and registration (serialised by Open MPI) is
        // the only time anything writes it but the variable system.
        fill(unsafe { &mut *t });
        // SAFETY: the component struct is a static of this library and the template
        // lives forever, as the variables bound to its fields need.
        unsafe { mca_btl_base_param_register(component.cast_mut(), t) };
        true
    }

    /// A copy of the template with the variables' current values (`None` before
    /// registration), to build a module from.
    pub fn copy(&self) -> Option<BtlModule> {
        let t = self.0.load(Ordering::Acquire);
        // SAFETY: null or the template made by `register`, which is never freed; the
        // variable system writes its fields only while parameters are set, which Open
        // MPI does not do during BTL init.
        (!t.is_null()).then(|| unsafe { *t })
    }
}

impl Default for Template {
    fn default() -> Self {
        Template::new()
    }
}

/// How many other processes of the job share this node, and the job's size.
pub fn job_locality() -> (i32, u32) {
    // SAFETY: both are set up by Open MPI (opal_process_info, the modex) before BTL
    // init, and only read here.
    unsafe {
        (
            sys::opal_process_info.num_local_peers,
            ompi_ofi_btl_glue_job_size(),
        )
    }
}
