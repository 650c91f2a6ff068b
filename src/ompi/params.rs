//! MCA parameters: the specs generated from `mca_params/*.params` and their
//! registration with Open MPI's variable system.
//!
//! Storage: Open MPI keeps a pointer to each variable's storage for as long as the
//! variable exists, and variables of the common layer outlive our library when Open MPI
//! `dlclose`s it (a BTL that declines is unloaded before the MTL loads a fresh copy).
//! So storage cells come from the C heap and are deliberately never freed: a few
//! hundred bytes per load, and never a dangling pointer inside Open MPI.

use ompi_sys as sys;
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};
use std::sync::Mutex;

/// The value type and default of a parameter.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Int(i64),
    Size(u64),
    Bool(bool),
    Str(&'static str),
    Enum {
        default: i32,
        values: &'static [(i32, &'static str)],
    },
}

/// One row of a parameter table.
#[derive(Debug)]
pub struct ParamSpec {
    pub name: &'static str,
    pub kind: Kind,
    pub level: u32,
    pub readonly: bool,
    pub synonyms: &'static [&'static str],
    pub help: &'static str,
    /// Int and size: the accepted range, from the table's `min`/`max`.
    pub min: i128,
    pub max: i128,
    /// String: a comma-separated list of provider names.
    pub list: bool,
    /// String: the accepted words (empty: any).
    pub choices: &'static [&'static str],
}

/// What [`check_raw`] thinks of a value as the user wrote it.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// Usable, with a remark (the value used is stated in the text).
    Warn(String),
    /// Not usable: the component declines.
    Bad(String),
}

/// Parse an integer the way Open MPI's `strtoull(.., 0)` plus its `k`/`m`/`g` suffixes
/// does, but strictly: Open MPI reads "abc" as 0 and "12abc" as 12 without a word.
/// Surrounding blanks are allowed.
pub fn parse_number(raw: &str, signed: bool) -> Option<i128> {
    let t = raw.trim();
    let (neg, t) = match t.as_bytes().first() {
        Some(b'-') if signed => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let (t, mult) = match t.as_bytes().last().map(|c| c.to_ascii_lowercase()) {
        Some(b'k') => (&t[..t.len() - 1], 1i128 << 10),
        Some(b'm') => (&t[..t.len() - 1], 1i128 << 20),
        Some(b'g') => (&t[..t.len() - 1], 1i128 << 30),
        _ => (t, 1),
    };
    let (digits, radix) = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        (h, 16)
    } else if t.len() > 1 && t.starts_with('0') {
        (&t[1..], 8)
    } else {
        (t, 10)
    };
    if digits.is_empty() || digits.len() > 40 || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let v = i128::from_str_radix(digits, radix)
        .ok()?
        .checked_mul(mult)?;
    Some(if neg { -v } else { v })
}

/// Is `raw` an acceptable value of `spec`? Pure: the unit tests and the bad-input test
/// (scripts/check-params) rely on the same rules.
pub fn check_raw(spec: &ParamSpec, raw: &str) -> Verdict {
    let range = |v: i128| {
        if v < spec.min || v > spec.max {
            Verdict::Bad(format!(
                "out of range (accepted: {} to {})",
                spec.min, spec.max
            ))
        } else {
            Verdict::Ok
        }
    };
    match spec.kind {
        Kind::Int(_) => match parse_number(raw, true) {
            Some(v) => range(v),
            None => Verdict::Bad(format!(
                "not an integer (accepted: {} to {})",
                spec.min, spec.max
            )),
        },
        Kind::Size(_) => match parse_number(raw, false) {
            Some(v) => range(v),
            None => Verdict::Bad(format!(
                "not a size (a non-negative number, optionally with a k, m or g suffix, at most {})",
                spec.max
            )),
        },
        Kind::Bool(_) => {
            let t = raw.trim().to_ascii_lowercase();
            if matches!(
                t.as_str(),
                "0" | "1" | "t" | "f" | "y" | "n" | "true" | "false" | "yes" | "no" | "enabled" | "disabled"
            ) {
                Verdict::Ok
            } else {
                Verdict::Bad("not a boolean (accepted: true, false, 1, 0, yes, no)".into())
            }
        }
        Kind::Enum { values, .. } => {
            let t = raw.trim();
            let ok = values.iter().any(|(n, s)| {
                s.eq_ignore_ascii_case(t) || t.parse::<i32>().is_ok_and(|v| v == *n)
            });
            if ok {
                Verdict::Ok
            } else {
                let names: Vec<&str> = values.iter().map(|(_, s)| *s).collect();
                Verdict::Bad(format!("unknown value (accepted: {})", names.join(", ")))
            }
        }
        Kind::Str(_) if !spec.choices.is_empty() => {
            if raw.is_empty() || spec.choices.contains(&raw) {
                Verdict::Ok
            } else {
                Verdict::Bad(format!("unknown value (accepted: {})", spec.choices.join(", ")))
            }
        }
        Kind::Str(_) if spec.list => {
            let entries: Vec<&str> = raw.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
            if let Some(e) = entries.iter().find(|e| {
                !e.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | ';' | '-' | '.'))
            }) {
                return Verdict::Bad(format!(
                    "{e:?} is not a provider name (a comma-separated list of names such as tcp or \"tcp;ofi_rxm\")"
                ));
            }
            if entries.is_empty() && !raw.trim().is_empty() {
                return Verdict::Warn("the list names no provider: treated as empty".into());
            }
            Verdict::Ok
        }
        Kind::Str(_) => Verdict::Ok,
    }
}

include!(concat!(env!("OUT_DIR"), "/params.rs"));

/// Who owns a table: the common layer (`opal_common_ofi_*`) or one component.
#[derive(Clone, Copy)]
pub enum Owner {
    Common,
    Component(*const sys::mca_base_component_t),
}

/// A table registered with Open MPI: storage cells, variable indices, and the
/// registration failures (an invalid enum value, for example). [`Registered::problems`]
/// adds what Open MPI accepts but should not (see [`check_raw`]); any error makes the
/// component decline at init.
pub struct Registered {
    specs: &'static [ParamSpec],
    cells: *mut u64,
    pub indices: Vec<c_int>,
    pub rejected: Vec<String>,
    full_prefix: String,
    warned: std::sync::atomic::AtomicBool,
}

// SAFETY: the cells are written by Open MPI during registration (single-threaded,
// inside MCA open) and read afterwards; the pointer itself is never freed.
unsafe impl Send for Registered {}

impl Registered {
    /// Register `specs` for `owner`. For the common table, `synonym_for` names the
    /// component whose `<type>_ofi_<name>` synonyms are added.
    // Never inlined: scripts/valgrind-ours recognises its deliberate leak by this
    // function's name, which an inlined frame does not carry.
    #[inline(never)]
    pub fn register(specs: &'static [ParamSpec], owner: Owner) -> Registered {
        // SAFETY: calloc of a small array; null is handled below.
        let cells = unsafe { libc::calloc(specs.len().max(1), 8) as *mut u64 };
        let full_prefix = match owner {
            Owner::Common => "opal_common_ofi_".to_string(),
            Owner::Component(c) => format!("{}_ofi_", component_type(c)),
        };
        let mut reg = Registered {
            specs,
            cells,
            indices: Vec::new(),
            rejected: Vec::new(),
            full_prefix,
            warned: std::sync::atomic::AtomicBool::new(false),
        };
        if cells.is_null() {
            reg.rejected
                .push("out of memory registering MCA parameters".into());
            return reg;
        }
        for (i, spec) in specs.iter().enumerate() {
            let idx = reg.register_one(i, spec, owner);
            reg.indices.push(idx);
        }
        reg
    }

    fn cell(&self, i: usize) -> *mut u64 {
        // SAFETY: i < specs.len() == the number of cells allocated.
        unsafe { self.cells.add(i) }
    }

    fn register_one(&mut self, i: usize, spec: &ParamSpec, owner: Owner) -> c_int {
        let cell = self.cell(i);
        let (ty, mut enumerator) = match spec.kind {
            Kind::Int(v) => {
                // SAFETY: cell is 8-byte aligned storage owned by this table.
                unsafe { *(cell as *mut c_int) = v as c_int };
                (sys::MCA_BASE_VAR_TYPE_INT, std::ptr::null_mut())
            }
            Kind::Size(v) => {
                // SAFETY: as above.
                unsafe { *(cell as *mut usize) = v as usize };
                (sys::MCA_BASE_VAR_TYPE_SIZE_T, std::ptr::null_mut())
            }
            Kind::Bool(v) => {
                // SAFETY: as above.
                unsafe { *(cell as *mut bool) = v };
                (sys::MCA_BASE_VAR_TYPE_BOOL, std::ptr::null_mut())
            }
            Kind::Str(v) => {
                // Open MPI strdup()s the default found in the storage at registration.
                let c = CString::new(v).unwrap_or_default();
                // SAFETY: as above; the CString is leaked on purpose, see the module docs
                // (Open MPI copies it, so only a few bytes per load are lost).
                unsafe { *(cell as *mut *mut c_char) = c.into_raw() };
                (sys::MCA_BASE_VAR_TYPE_STRING, std::ptr::null_mut())
            }
            Kind::Enum { default, values } => {
                // SAFETY: as above.
                unsafe { *(cell as *mut c_int) = default };
                (sys::MCA_BASE_VAR_TYPE_INT, make_enum(spec.name, values))
            }
        };
        let name = CString::new(spec.name).unwrap_or_default();
        let help = CString::new(spec.help).unwrap_or_default();
        let (scope, flags) = if spec.readonly {
            (
                sys::MCA_BASE_VAR_SCOPE_CONSTANT,
                sys::MCA_BASE_VAR_FLAG_DEFAULT_ONLY,
            )
        } else {
            (sys::MCA_BASE_VAR_SCOPE_READONLY, 0)
        };
        let level = sys::OPAL_INFO_LVL_1 + spec.level - 1;
        // `mca_base_component_var_register` is `mca_base_var_register` under the
        // component's three names with `MCA_BASE_VAR_FLAG_DWG` (deregister with the
        // component) added, so both owners go through the one call.
        let (project, framework, component, flags) = match owner {
            Owner::Common => (
                c"opal".as_ptr(),
                c"opal_common".as_ptr(),
                c"ofi".as_ptr(),
                flags,
            ),
            // SAFETY: `c` is the header inside one of our exported component statics,
            // which live as long as the library; taking the addresses of its name
            // arrays reads nothing.
            Owner::Component(c) => unsafe {
                (
                    (*c).mca_project_name.as_ptr(),
                    (*c).mca_type_name.as_ptr(),
                    (*c).mca_component_name.as_ptr(),
                    flags | sys::MCA_BASE_VAR_FLAG_DWG,
                )
            },
        };
        // SAFETY: every pointer is valid for the call; the storage cell outlives the
        // variable (never freed), the enumerator is retained by Open MPI.
        let idx = unsafe {
            sys::mca_base_var_register(
                project,
                framework,
                component,
                name.as_ptr(),
                help.as_ptr(),
                ty,
                enumerator,
                0,
                flags,
                level,
                scope,
                cell as *mut c_void,
            )
        };
        if !enumerator.is_null() {
            // SAFETY: we own one reference from mca_base_var_enum_create; Open MPI
            // retained its own when registering.
            unsafe { release_enum(enumerator) };
            enumerator = std::ptr::null_mut();
        }
        let _ = enumerator;
        // idx < 0: Open MPI refused the value it found (e.g. "An invalid value was
        // supplied for an enum variable", or an int that overflows); `problems` reports it.
        idx
    }

    /// The names a user can set this parameter by: the full name, then the
    /// `<type>_ofi_<name>` synonyms of a common parameter.
    fn names(&self, spec: &ParamSpec) -> Vec<String> {
        let mut v = vec![format!("{}{}", self.full_prefix, spec.name)];
        for s in spec.synonyms {
            v.push(format!("{s}_ofi_{}", spec.name));
        }
        v
    }

    /// Check every parameter of the table: `(errors, warnings)`. An error names the
    /// parameter, the value as given and what is accepted; the component declines.
    /// A warning states the value used instead. Values given in the environment
    /// (`OMPI_MCA_*`, which is how mpirun passes `--mca`) are checked as written;
    /// values from parameter files are checked as Open MPI converted them.
    pub fn problems(&self) -> (Vec<String>, Vec<String>) {
        let mut errors = self.rejected.clone();
        let mut warnings = Vec::new();
        for (i, spec) in self.specs.iter().enumerate() {
            let idx = self.indices.get(i).copied().unwrap_or(-1);
            let given: Vec<(String, String)> = self
                .names(spec)
                .into_iter()
                .filter_map(|n| {
                    std::env::var(format!("OMPI_MCA_{n}"))
                        .ok()
                        .map(|raw| (n, raw))
                })
                .collect();
            if idx < 0 {
                errors.push(match given.first() {
                    Some((n, raw)) => format!(
                        "{n}={raw:?}: Open MPI rejected the value ({})",
                        match check_raw(spec, raw) {
                            Verdict::Bad(why) => why,
                            _ => "not representable".into(),
                        }
                    ),
                    None => format!(
                        "{}{}: Open MPI rejected the value (see its message above)",
                        self.full_prefix, spec.name
                    ),
                });
                continue;
            }
            for (n, raw) in &given {
                if spec.readonly {
                    warnings.push(format!(
                        "{n} is read-only (a report): the value {raw:?} is ignored"
                    ));
                    continue;
                }
                match check_raw(spec, raw) {
                    Verdict::Ok => {}
                    Verdict::Warn(w) => warnings.push(format!("{n}={raw:?}: {w}")),
                    Verdict::Bad(e) => errors.push(format!("{n}={raw:?}: {e}")),
                }
            }
            if given.is_empty() {
                if let Kind::Int(_) = spec.kind {
                    let v = self.int(i) as i128;
                    if v < spec.min || v > spec.max {
                        errors.push(format!(
                            "{}{}={v}: out of range (accepted: {} to {})",
                            self.full_prefix, spec.name, spec.min, spec.max
                        ));
                    }
                }
            }
        }
        (errors, warnings)
    }

    /// [`Registered::problems`] for an init: log the warnings (once per load) and
    /// return the errors as one decline message, or `Ok`.
    pub fn check(&self) -> Result<(), String> {
        let (errors, warnings) = self.problems();
        if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
            for w in &warnings {
                log::warn!("{w}");
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            let msg = format!("invalid MCA parameter values: {}", errors.join("; "));
            // A configuration error: say it at every verbosity, not only as a decline.
            log::warn!("{msg}; the component declines");
            Err(msg)
        }
    }

    /// Add `<type>_ofi_<name>` synonyms of this (common) table for `component`.
    pub fn add_synonyms(&self, component: *const sys::mca_base_component_t) {
        let ty = component_type(component);
        let (project, framework) = match ty.as_str() {
            "btl" => (c"opal", c"btl"),
            "mtl" => (c"ompi", c"mtl"),
            _ => return,
        };
        for (spec, &idx) in self.specs.iter().zip(&self.indices) {
            if idx < 0 || !spec.synonyms.iter().any(|s| *s == ty) {
                continue;
            }
            let name = CString::new(spec.name).unwrap_or_default();
            // SAFETY: idx is a variable index Open MPI returned; the strings are valid.
            unsafe {
                sys::mca_base_var_register_synonym(
                    idx,
                    project.as_ptr(),
                    framework.as_ptr(),
                    c"ofi".as_ptr(),
                    name.as_ptr(),
                    0,
                );
            }
        }
    }

    /// The value of an int or enum parameter.
    pub fn int(&self, i: usize) -> i64 {
        match self.specs[i].kind {
            // SAFETY: the cell holds a C int for these kinds.
            Kind::Int(_) | Kind::Enum { .. } => unsafe { *(self.cell(i) as *const c_int) as i64 },
            // SAFETY: the cell holds a size_t.
            Kind::Size(_) => unsafe { *(self.cell(i) as *const usize) as i64 },
            // SAFETY: the cell holds a C bool.
            Kind::Bool(_) => unsafe { *(self.cell(i) as *const bool) as i64 },
            Kind::Str(_) => 0,
        }
    }

    /// The value of a size parameter.
    pub fn size(&self, i: usize) -> u64 {
        self.int(i).max(0) as u64
    }

    /// The value of a bool parameter.
    pub fn bool(&self, i: usize) -> bool {
        self.int(i) != 0
    }

    /// The value of a string parameter; `None` when unset or empty.
    pub fn string(&self, i: usize) -> Option<String> {
        // SAFETY: a string cell holds null or a NUL-terminated string owned by Open MPI.
        let p = unsafe { *(self.cell(i) as *const *const c_char) };
        if p.is_null() {
            return None;
        }
        // SAFETY: checked non-null above.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        if s.is_empty() {
            None
        } else {
            Some(s)
        }
    }

    /// The name of an enum parameter's current value.
    pub fn enum_name(&self, i: usize) -> Option<&'static str> {
        if let Kind::Enum { values, .. } = self.specs[i].kind {
            let v = self.int(i) as i32;
            values.iter().find(|(n, _)| *n == v).map(|(_, s)| *s)
        } else {
            None
        }
    }

    /// Set a read-only string variable (a status report) in place.
    pub fn set_status(&self, i: usize, value: &str) {
        let Ok(c) = CString::new(value) else { return };
        // SAFETY: the cell holds a string pointer; Open MPI frees string storage with
        // free() at deregistration, so the new value comes from the C heap.
        unsafe {
            let dup = libc::strdup(c.as_ptr());
            let cell = self.cell(i) as *mut *mut c_char;
            let old = *cell;
            *cell = dup;
            if !old.is_null() {
                libc::free(old as *mut c_void);
            }
        }
    }

    /// Is the variable set by the user (not at its default)?
    pub fn is_set(&self, i: usize) -> bool {
        set_by_user(self.indices.get(i).copied().unwrap_or(-1))
    }
}

/// Did the user set the MCA variable `project_framework_component_name` (one that
/// Open MPI registered, such as `btl_ofi_max_send_size`)?
pub fn user_set(project: &str, framework: &str, component: &str, name: &str) -> bool {
    let c = |s: &str| CString::new(s).unwrap_or_default();
    let (p, f, co, n) = (c(project), c(framework), c(component), c(name));
    // SAFETY: four NUL-terminated strings that outlive the call.
    set_by_user(unsafe { sys::mca_base_var_find(p.as_ptr(), f.as_ptr(), co.as_ptr(), n.as_ptr()) })
}

/// Is the MCA variable with index `idx` (negative: none) set other than by default?
fn set_by_user(idx: c_int) -> bool {
    if idx < 0 {
        return false;
    }
    let mut source: sys::mca_base_var_source_t = sys::MCA_BASE_VAR_SOURCE_DEFAULT;
    // SAFETY: idx is a valid variable index; source is a valid out pointer.
    let rc = unsafe {
        sys::mca_base_var_get_value(idx, std::ptr::null_mut(), &mut source, std::ptr::null_mut())
    };
    rc == sys::OPAL_SUCCESS && source != sys::MCA_BASE_VAR_SOURCE_DEFAULT
}

fn component_type(c: *const sys::mca_base_component_t) -> String {
    // SAFETY: c points to one of our component structs, whose type name is a
    // NUL-terminated array.
    unsafe { CStr::from_ptr((*c).mca_type_name.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Enumerators are built at registration and handed to Open MPI, which copies the
/// strings. Serialised because Open MPI's variable system is not thread-safe anyway.
static ENUM_LOCK: Mutex<()> = Mutex::new(());

fn make_enum(name: &str, values: &[(i32, &'static str)]) -> *mut sys::mca_base_var_enum_t {
    let _g = ENUM_LOCK.lock();
    let strings: Vec<CString> = values
        .iter()
        .map(|(_, s)| CString::new(*s).unwrap_or_default())
        .collect();
    let mut table: Vec<sys::mca_base_var_enum_value_t> = values
        .iter()
        .zip(&strings)
        .map(|((v, _), s)| sys::mca_base_var_enum_value_t {
            value: *v,
            string: s.as_ptr(),
        })
        .collect();
    table.push(sys::mca_base_var_enum_value_t {
        value: 0,
        string: std::ptr::null(),
    });
    let ename = CString::new(format!("ompi_ofi_{name}")).unwrap_or_default();
    let mut out: *mut sys::mca_base_var_enum_t = std::ptr::null_mut();
    // SAFETY: table is NUL-terminated and valid for the call; Open MPI copies the
    // value strings into the enumerator it creates.
    let rc = unsafe { sys::mca_base_var_enum_create(ename.as_ptr(), table.as_ptr(), &mut out) };
    if rc != sys::OPAL_SUCCESS {
        std::ptr::null_mut()
    } else {
        out
    }
}

unsafe extern "C" {
    fn ompi_ofi_glue_obj_release(obj: *mut c_void);
}

/// # Safety
/// `e` must be an enumerator we hold a reference to.
unsafe fn release_enum(e: *mut sys::mca_base_var_enum_t) {
    // SAFETY: forwarded contract.
    unsafe { ompi_ofi_glue_obj_release(e as *mut c_void) }
}

/// The parameter table of docs/parameters.md, generated from the same specs.
pub fn markdown_table() -> String {
    let mut s = String::from("| parameter | default | level | meaning |\n|---|---|---|---|\n");
    for (prefix, specs) in [
        ("opal_common_ofi_", COMMON),
        ("mtl_ofi_", MTL),
        ("btl_ofi_", BTL),
    ] {
        for p in specs {
            let def = match p.kind {
                Kind::Int(v) => format!("{v} ({} to {})", p.min, p.max),
                Kind::Size(v) if p.max < u64::MAX as i128 => {
                    format!("{v} ({} to {})", p.min, p.max)
                }
                Kind::Size(v) => v.to_string(),
                Kind::Str(v) if !p.choices.is_empty() => {
                    format!("{v} ({})", p.choices.join(" \\| "))
                }
                Kind::Bool(v) => v.to_string(),
                Kind::Str(v) => {
                    if v.is_empty() {
                        "(empty)".into()
                    } else {
                        v.to_string()
                    }
                }
                Kind::Enum { default, values } => {
                    let names: Vec<&str> = values.iter().map(|(_, n)| *n).collect();
                    let d = values
                        .iter()
                        .find(|(v, _)| *v == default)
                        .map(|(_, n)| *n)
                        .unwrap_or("");
                    format!("{d} ({})", names.join(" \\| "))
                }
            };
            let syn = if p.synonyms.is_empty() {
                String::new()
            } else {
                format!(
                    " (also {})",
                    p.synonyms
                        .iter()
                        .map(|s| format!("`{s}_ofi_{}`", p.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            s.push_str(&format!(
                "| `{prefix}{}`{syn} | {def} | {} | {} |\n",
                p.name,
                p.level,
                p.help.replace('|', "\\|")
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_well_formed() {
        for specs in [COMMON, MTL, BTL] {
            let mut names: Vec<_> = specs.iter().map(|p| p.name).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), specs.len(), "duplicate parameter names");
        }
        assert_eq!(COMMON[common::PROVIDER_EXCLUDE].name, "provider_exclude");
        assert!(matches!(
            COMMON[common::PROVIDER_EXCLUDE].kind,
            Kind::Str("shm,sockets,tcp,udp,rstream,usnic,net")
        ));
        assert!(matches!(
            MTL[mtl::TAG_MODE].kind,
            Kind::Enum { default: 1, .. }
        ));
    }

    #[test]
    fn numbers_are_parsed_strictly() {
        for (raw, want) in [
            ("12", Some(12)),
            (" 7 ", Some(7)),
            ("-3", Some(-3)),
            ("+3", Some(3)),
            ("0x10", Some(16)),
            ("010", Some(8)),
            ("2k", Some(2048)),
            ("1M", Some(1 << 20)),
            ("abc", None),
            ("12abc", None),
            ("", None),
            ("1e3", None),
            ("-", None),
            ("0x", None),
            ("k", None),
        ] {
            assert_eq!(parse_number(raw, true), want, "{raw:?}");
        }
        assert_eq!(parse_number("-1", false), None);
    }

    fn spec(table: &'static [ParamSpec], name: &str) -> &'static ParamSpec {
        table.iter().find(|p| p.name == name).unwrap()
    }

    #[test]
    fn raw_values_are_checked_by_kind() {
        let bad = |s: &ParamSpec, v: &str| matches!(check_raw(s, v), Verdict::Bad(_));
        let mode = spec(BTL, "mode");
        assert_eq!(check_raw(mode, "2"), Verdict::Ok);
        for v in ["3", "-1", "abc", "", "99999999999"] {
            assert!(bad(mode, v), "btl mode {v:?}");
        }
        let size = spec(BTL, "rcache_max_bytes");
        assert_eq!(check_raw(size, "1g"), Verdict::Ok);
        for v in ["-1", "18446744073709551616", "1x"] {
            assert!(bad(size, v), "size {v:?}");
        }
        let b = spec(BTL, "disable_sep");
        assert_eq!(check_raw(b, "yes"), Verdict::Ok);
        assert!(bad(b, "maybe") && bad(b, "2") && bad(b, ""));
        let e = spec(MTL, "tag_mode");
        assert_eq!(check_raw(e, "OFI_TAG_1"), Verdict::Ok);
        assert_eq!(check_raw(e, "2"), Verdict::Ok);
        assert!(bad(e, "bogus") && bad(e, "99") && bad(e, ""));
        let c = spec(BTL, "progress_mode");
        assert_eq!(check_raw(c, "manual"), Verdict::Ok);
        assert!(bad(c, "bogus"));
        let l = spec(COMMON, "provider_include");
        assert_eq!(check_raw(l, "tcp, shm,udp;ofi_rxd"), Verdict::Ok);
        assert_eq!(check_raw(l, ""), Verdict::Ok);
        assert!(matches!(check_raw(l, ",,,"), Verdict::Warn(_)));
        assert!(bad(l, "tcp|shm") && bad(l, "tc p"));
    }

    #[test]
    fn every_int_declares_its_range() {
        for specs in [COMMON, MTL, BTL] {
            for p in specs {
                if let Kind::Int(d) = p.kind {
                    assert!(p.min <= d as i128 && d as i128 <= p.max, "{}", p.name);
                    assert_eq!(check_raw(p, &d.to_string()), Verdict::Ok, "{}", p.name);
                    assert!(matches!(
                        check_raw(p, &(p.max + 1).to_string()),
                        Verdict::Bad(_)
                    ));
                }
            }
        }
    }

    /// docs/parameters.md's table is this table: `OMPI_OFI_UPDATE_DOCS=1 cargo test
    /// docs_parameter_table` rewrites it after a change to `mca_params/`.
    #[test]
    fn docs_parameter_table_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/parameters.md");
        let doc = std::fs::read_to_string(path).expect("docs/parameters.md");
        let head = "| parameter | default | level | meaning |\n";
        let start = doc
            .find(head)
            .expect("the parameter table in docs/parameters.md");
        let end = doc[start..]
            .find("\n\n")
            .map_or(doc.len(), |e| start + e + 1);
        let table = markdown_table();
        if doc[start..end] != table && std::env::var_os("OMPI_OFI_UPDATE_DOCS").is_some() {
            let new = format!("{}{}{}", &doc[..start], table, &doc[end..]);
            std::fs::write(path, new).expect("write docs/parameters.md");
            return;
        }
        assert!(
            doc[start..end] == table,
            "docs/parameters.md's parameter table differs from mca_params/: run \
             OMPI_OFI_UPDATE_DOCS=1 cargo test docs_parameter_table"
        );
    }

    #[test]
    fn markdown_lists_every_parameter() {
        let t = markdown_table();
        for p in COMMON {
            assert!(t.contains(&format!("`opal_common_ofi_{}`", p.name)));
        }
        assert!(t.contains("`mtl_ofi_tag_mode`"));
        assert!(t.contains("`btl_ofi_num_cq_read`"));
    }
}
