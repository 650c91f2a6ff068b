//! Runtime self-check: who has patched the memory functions of this process?
//!
//! Open MPI's `patcher/overwrite` component and libfabric's memhooks monitor both
//! intercept `munmap` and friends by overwriting the first bytes of the libc function
//! with `movabs r11, <hook>; jmp r11` (`49 bb <8-byte address> 41 ff e3` on x86-64).
//! Two such patches cannot be stacked: the last writer wins and the other patcher's
//! cache silently stops hearing about releases. Reading those bytes and resolving the
//! jump target with `dladdr` tells which library owns each function.
//!
//! Owns: nothing (read-only). Must not: write to code pages, or run on the release path
//! (it allocates its report).
//!
//! Reading code is safe in practice: text pages are mapped readable (`r-x`), and the
//! read never crosses into a page that is not mapped (checked with `mincore` when the
//! 13 bytes straddle a page boundary). The bytes are read with volatile loads because a
//! patcher on another thread may be rewriting them; a torn read can only misclassify,
//! never crash.

use std::ffi::{c_void, CStr};
use std::fmt;

/// Length of the x86-64 trampoline both patchers write.
pub const TRAMPOLINE_LEN: usize = 13;

/// The functions we look at: name, hooked by Open MPI 4.1.4's memory/patcher
/// (`opal/mca/memory/patcher`: mmap, munmap, mremap, madvise, shmat, shmdt, brk), and
/// hooked by libfabric's memhooks (1.17: the same seven). `sbrk` and `free` are hooked by
/// neither; a patch there belongs to some third tool and is reported as information.
pub const FUNCTIONS: &[(&str, bool)] = &[
    ("munmap", true),
    ("mmap", true),
    ("mremap", true),
    ("madvise", true),
    ("shmat", true),
    ("shmdt", true),
    ("brk", true),
    ("sbrk", false),
    ("free", false),
];

/// Who owns a function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// The function does not start with the trampoline.
    Unpatched,
    /// The trampoline jumps into Open MPI (`libopen-pal` or `mca_memory_patcher`).
    OpenMpi { target: usize, object: String },
    /// The trampoline jumps into libfabric (its memhooks monitor).
    Libfabric { target: usize, object: String },
    /// The trampoline jumps somewhere else (`object` is the `dladdr` file name, if any).
    Other {
        target: usize,
        object: Option<String>,
    },
    /// The function could not be inspected (not found, unreadable, other architecture).
    Unknown(String),
}

impl Owner {
    pub fn is_openmpi(&self) -> bool {
        matches!(self, Owner::OpenMpi { .. })
    }
    pub fn is_libfabric(&self) -> bool {
        matches!(self, Owner::Libfabric { .. })
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::Unpatched => write!(f, "unpatched"),
            Owner::OpenMpi { target, object } => write!(f, "Open MPI ({object} @ {target:#x})"),
            Owner::Libfabric { target, object } => {
                write!(f, "libfabric ({object} @ {target:#x})")
            }
            Owner::Other { target, object } => write!(
                f,
                "other patcher ({} @ {target:#x})",
                object.as_deref().unwrap_or("unknown object")
            ),
            Owner::Unknown(why) => write!(f, "unknown ({why})"),
        }
    }
}

/// One inspected function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionReport {
    pub name: &'static str,
    /// Address `dlsym(RTLD_DEFAULT, name)` returned (0 if none).
    pub address: usize,
    /// The object that defines the function (libc, normally).
    pub defined_in: Option<String>,
    /// Whether Open MPI's patcher hooks this function.
    pub hooked_by_openmpi: bool,
    pub owner: Owner,
}

/// The whole check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PatchReport {
    pub functions: Vec<FunctionReport>,
}

impl PatchReport {
    pub fn owner_of(&self, name: &str) -> Option<&Owner> {
        self.functions
            .iter()
            .find(|f| f.name == name)
            .map(|f| &f.owner)
    }

    /// Whether any function is patched by Open MPI (its patcher is installed).
    pub fn openmpi_patched(&self) -> bool {
        self.functions.iter().any(|f| f.owner.is_openmpi())
    }

    /// One warning per function that libfabric owns although Open MPI's patcher also
    /// hooks it: the two patchers overwrite the same bytes, so one of them is deaf.
    pub fn conflicts(&self) -> Vec<String> {
        self.functions
            .iter()
            .filter(|f| f.hooked_by_openmpi && f.owner.is_libfabric())
            .map(|f| {
                format!(
                    "{} is patched by libfabric's memhooks ({}), a function Open MPI's \
                     patcher also hooks: two patchers in one process, one of them misses \
                     releases (stale registrations); use the 'opal' monitor or \
                     FI_MR_CACHE_MONITOR=userfaultfd",
                    f.name, f.owner
                )
            })
            .collect()
    }

    /// Everything wrong for the monitor in use: the conflicts, plus, when releases are
    /// expected to come from Open MPI (`opal_expected`), an `munmap` that Open MPI
    /// does not own.
    pub fn problems(&self, opal_expected: bool) -> Vec<String> {
        let mut out = Vec::new();
        if opal_expected {
            match self.owner_of("munmap") {
                Some(o) if o.is_openmpi() => {}
                Some(o) => out.push(format!(
                    "the 'opal' monitor is in use but munmap is {o} instead of patched by \
                     Open MPI: releases will not reach libfabric or our caches"
                )),
                None => out.push("munmap was not inspected".to_string()),
            }
        }
        out.extend(self.conflicts());
        out
    }

    /// One line per function, for logs.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for f in &self.functions {
            if !s.is_empty() {
                s.push_str("; ");
            }
            s.push_str(f.name);
            s.push_str(": ");
            s.push_str(&f.owner.to_string());
        }
        s
    }
}

impl fmt::Display for PatchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary())
    }
}

/// The jump target if `bytes` is the `movabs r11, imm64; jmp r11` trampoline.
pub fn trampoline_target(bytes: &[u8; TRAMPOLINE_LEN]) -> Option<usize> {
    if bytes[0] != 0x49 || bytes[1] != 0xbb || bytes[10..13] != [0x41, 0xff, 0xe3] {
        return None;
    }
    let mut imm = [0u8; 8];
    imm.copy_from_slice(&bytes[2..10]);
    Some(u64::from_le_bytes(imm) as usize)
}

/// Classify the object a trampoline jumps into, by its file name.
pub fn classify_object(target: usize, object: Option<&str>) -> Owner {
    match object {
        Some(p) if p.contains("libopen-pal") || p.contains("mca_memory_patcher") => {
            Owner::OpenMpi {
                target,
                object: p.to_string(),
            }
        }
        Some(p) if p.contains("libfabric") => Owner::Libfabric {
            target,
            object: p.to_string(),
        },
        other => Owner::Other {
            target,
            object: other.map(str::to_string),
        },
    }
}

/// `dladdr`'s file name for an address.
fn object_of(addr: usize) -> Option<String> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the loader's tables for `addr` (any value is allowed)
    // and fills `info`, which is valid for writes.
    let ok = unsafe { libc::dladdr(addr as *const c_void, info.as_mut_ptr()) };
    if ok == 0 {
        return None;
    }
    // SAFETY: dladdr returned non-zero, so it filled `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while
    // the object stays loaded (we copy it at once).
    Some(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The system's page size (4096 when sysconf cannot say).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf takes no pointers and has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Read the first bytes of a function, or say why not.
fn read_prologue(addr: usize) -> Result<[u8; TRAMPOLINE_LEN], String> {
    if addr == 0 {
        return Err("not found".into());
    }
    let page = page_size();
    let last = addr + TRAMPOLINE_LEN - 1;
    if last / page != addr / page {
        let next = last & !(page - 1);
        let mut vec = [0u8; 1];
        // SAFETY: `next` is page-aligned; mincore only checks residency of that one
        // page and writes one byte into `vec`. It fails with ENOMEM if the page is
        // not mapped, which is what we want to know.
        let r = unsafe { libc::mincore(next as *mut c_void, 1, vec.as_mut_ptr()) };
        if r != 0 {
            return Err(format!("the page after {addr:#x} is not mapped"));
        }
    }
    let mut out = [0u8; TRAMPOLINE_LEN];
    for (i, b) in out.iter_mut().enumerate() {
        // SAFETY: `addr` is the address of a function that the loader resolved, so its
        // page is mapped and readable (text is r-x); the last byte's page was checked
        // above. Volatile because another thread's patcher may write these bytes.
        *b = unsafe { std::ptr::read_volatile((addr + i) as *const u8) };
    }
    Ok(out)
}

fn inspect(name: &'static str, hooked_by_openmpi: bool) -> FunctionReport {
    let cname = format!("{name}\0");
    // SAFETY: `cname` is NUL-terminated; RTLD_DEFAULT searches the global scope and
    // returns NULL when the symbol is absent.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, cname.as_ptr().cast()) };
    let address = sym as usize;
    let defined_in = if address != 0 {
        object_of(address)
    } else {
        None
    };
    let owner = if !cfg!(target_arch = "x86_64") {
        Owner::Unknown("the patch check only knows the x86-64 trampoline".into())
    } else {
        match read_prologue(address) {
            Err(e) => Owner::Unknown(e),
            Ok(bytes) => match trampoline_target(&bytes) {
                None => Owner::Unpatched,
                Some(target) => classify_object(target, object_of(target).as_deref()),
            },
        }
    };
    FunctionReport {
        name,
        address,
        defined_in,
        hooked_by_openmpi,
        owner,
    }
}

/// Inspect every function of [`FUNCTIONS`].
pub fn check() -> PatchReport {
    PatchReport {
        functions: FUNCTIONS.iter().map(|&(n, o)| inspect(n, o)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trampoline(target: u64) -> [u8; TRAMPOLINE_LEN] {
        let mut b = [0u8; TRAMPOLINE_LEN];
        b[0] = 0x49;
        b[1] = 0xbb;
        b[2..10].copy_from_slice(&target.to_le_bytes());
        b[10..].copy_from_slice(&[0x41, 0xff, 0xe3]);
        b
    }

    #[test]
    fn recognises_the_trampoline() {
        assert_eq!(
            trampoline_target(&trampoline(0x7f00_dead_beef)),
            Some(0x7f00_dead_beef)
        );
        let mut b = trampoline(1);
        b[12] = 0xe0;
        assert_eq!(trampoline_target(&b), None);
        // glibc's munmap: endbr64; mov eax, 11; syscall ...
        let glibc = [
            0xf3, 0x0f, 0x1e, 0xfa, 0xb8, 0x0b, 0, 0, 0, 0x0f, 0x05, 0x48, 0x3d,
        ];
        assert_eq!(trampoline_target(&glibc), None);
    }

    #[test]
    fn classifies_owners_by_path() {
        let pal = classify_object(1, Some("/usr/lib/x86_64-linux-gnu/libopen-pal.so.40"));
        assert!(pal.is_openmpi());
        assert!(classify_object(1, Some("/x/openmpi/mca_memory_patcher.so")).is_openmpi());
        assert!(
            classify_object(1, Some("/usr/lib/x86_64-linux-gnu/libfabric.so.1")).is_libfabric()
        );
        assert_eq!(
            classify_object(2, Some("/opt/ucx/libucm.so.0")),
            Owner::Other {
                target: 2,
                object: Some("/opt/ucx/libucm.so.0".into())
            }
        );
        assert_eq!(
            classify_object(3, None),
            Owner::Other {
                target: 3,
                object: None
            }
        );
    }

    fn report(owners: &[(&'static str, bool, Owner)]) -> PatchReport {
        PatchReport {
            functions: owners
                .iter()
                .map(|(n, h, o)| FunctionReport {
                    name: n,
                    address: 1,
                    defined_in: None,
                    hooked_by_openmpi: *h,
                    owner: o.clone(),
                })
                .collect(),
        }
    }

    #[test]
    fn problems_for_opal_and_conflicts() {
        let ompi = Owner::OpenMpi {
            target: 1,
            object: "libopen-pal.so.40".into(),
        };
        let lf = Owner::Libfabric {
            target: 2,
            object: "libfabric.so.1".into(),
        };
        let good = report(&[
            ("munmap", true, ompi.clone()),
            ("free", false, Owner::Unpatched),
        ]);
        assert!(good.problems(true).is_empty());
        assert!(good.openmpi_patched());

        let unpatched = report(&[("munmap", true, Owner::Unpatched)]);
        assert_eq!(unpatched.problems(true).len(), 1);
        assert!(unpatched.problems(false).is_empty());

        let conflict = report(&[("munmap", true, ompi), ("madvise", true, lf.clone())]);
        let p = conflict.problems(true);
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("madvise is patched by libfabric"), "{p:?}");
        // libfabric on a function Open MPI does not hook is not a conflict
        assert!(report(&[("sbrk", false, lf)]).conflicts().is_empty());
    }

    #[test]
    fn this_process_is_not_patched() {
        // The unit-test binary never opens Open MPI's memory framework or a libfabric
        // MR cache, so nothing may be patched here.
        let r = check();
        assert_eq!(r.owner_of("munmap"), Some(&Owner::Unpatched), "{r}");
        assert!(
            r.functions
                .iter()
                .find(|f| f.name == "munmap")
                .unwrap()
                .address
                != 0
        );
        assert!(r.problems(false).is_empty(), "{r}");
    }
}
