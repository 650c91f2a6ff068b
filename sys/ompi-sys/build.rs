//! Bindings to the installed Open MPI 4.1 devel headers.
//!
//! Finds Open MPI the way a user installed it: `OMPI_OFI_MPICC` (an mpicc to ask),
//! `OMPI_OFI_INCDIRS`/`OMPI_OFI_LIBDIRS` (colon-separated overrides), then `mpicc
//! --showme:incdirs` / `--showme:libdirs`, then pkg-config `ompi`. Every failed
//! attempt is printed when all fail. It never builds Open MPI.
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn split(s: &str) -> Vec<PathBuf> {
    s.split([':', ' ', '\n'])
        .filter(|x| !x.is_empty())
        .map(PathBuf::from)
        .collect()
}

fn showme(mpicc: &str, what: &str) -> Result<Vec<PathBuf>, String> {
    let out = Command::new(mpicc)
        .arg(format!("--showme:{what}"))
        .output()
        .map_err(|e| format!("{mpicc} --showme:{what}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{mpicc} --showme:{what}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(split(&String::from_utf8_lossy(&out.stdout)))
}

fn pkg_config(arg: &str, prefix: &str) -> Result<Vec<PathBuf>, String> {
    let out = Command::new("pkg-config")
        .args([arg, "ompi"])
        .output()
        .map_err(|e| format!("pkg-config {arg} ompi: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pkg-config {arg} ompi: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|s| s.strip_prefix(prefix).map(PathBuf::from))
        .collect())
}

fn usable(incs: &[PathBuf]) -> bool {
    incs.iter().any(|d| d.join("ompi/mca/mtl/mtl.h").exists())
}

/// `OMPI_MAJOR_VERSION`, `_MINOR_` and `_RELEASE_` of `ompi/version.h` in the include
/// directories.
fn ompi_version(incs: &[PathBuf]) -> Option<(u32, u32, u32)> {
    let text = incs
        .iter()
        .find_map(|d| std::fs::read_to_string(d.join("ompi/version.h")).ok())?;
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("#define") && w.next() == Some(name))
                .then(|| w.next()?.parse().ok())
                .flatten()
        })
    };
    Some((
        field("OMPI_MAJOR_VERSION")?,
        field("OMPI_MINOR_VERSION")?,
        field("OMPI_RELEASE_VERSION")?,
    ))
}

fn main() {
    for v in ["OMPI_OFI_MPICC", "OMPI_OFI_INCDIRS", "OMPI_OFI_LIBDIRS"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo:rerun-if-changed=wrapper.h");
    let mut failures: Vec<String> = Vec::new();
    let mut found: Option<(Vec<PathBuf>, Vec<PathBuf>)> = None;

    if let Ok(incs) = env::var("OMPI_OFI_INCDIRS") {
        let incs = split(&incs);
        let libs = env::var("OMPI_OFI_LIBDIRS")
            .map(|l| split(&l))
            .unwrap_or_default();
        if usable(&incs) {
            found = Some((incs, libs));
        } else {
            failures.push(format!(
                "OMPI_OFI_INCDIRS={incs:?}: no ompi/mca/mtl/mtl.h (devel headers)"
            ));
        }
    }
    if found.is_none() {
        let mpicc = env::var("OMPI_OFI_MPICC").unwrap_or_else(|_| "mpicc".into());
        match (showme(&mpicc, "incdirs"), showme(&mpicc, "libdirs")) {
            (Ok(i), Ok(l)) if usable(&i) => found = Some((i, l)),
            (Ok(i), Ok(_)) => failures.push(format!(
                "{mpicc}: include dirs {i:?} lack ompi/mca/mtl/mtl.h (Open MPI built without --with-devel-headers?)"
            )),
            (Err(e), _) | (_, Err(e)) => failures.push(e),
        }
    }
    if found.is_none() {
        match (
            pkg_config("--cflags-only-I", "-I"),
            pkg_config("--libs-only-L", "-L"),
        ) {
            (Ok(i), Ok(l)) if usable(&i) => found = Some((i, l)),
            (Ok(i), Ok(_)) => {
                failures.push(format!("pkg-config ompi: {i:?} lack ompi/mca/mtl/mtl.h"))
            }
            (Err(e), _) | (_, Err(e)) => failures.push(e),
        }
    }
    let Some((incs, libs)) = found else {
        panic!(
            "Open MPI devel headers not found (install libopenmpi-dev, or set OMPI_OFI_MPICC / OMPI_OFI_INCDIRS):\n  {}",
            failures.join("\n  ")
        );
    };
    // The bindings and the components follow Open MPI 4.1's internal interfaces; 5.0
    // changed the BTL and MTL structs without changing their version numbers, so a
    // build against it would load and then misread them (../../docs/building-openmpi.md).
    match ompi_version(&incs) {
        Some((4, 1, _)) => {}
        Some((major, minor, release)) => panic!(
            "Open MPI {major}.{minor}.{release} found (include dirs {incs:?}): ompi-ofi builds \
             only against Open MPI 4.1 so far; Open MPI 5 support is not done yet \
             (docs/building-openmpi.md)"
        ),
        None => panic!("Open MPI's ompi/version.h not found in {incs:?}"),
    }
    for l in &libs {
        println!("cargo:rustc-link-search=native={}", l.display());
    }
    println!("cargo:rustc-link-lib=dylib=open-pal");
    println!("cargo:rustc-link-lib=dylib=mpi");
    // Published to dependents (DEP_OPEN_PAL_INCLUDE / DEP_OPEN_PAL_LIBDIRS) for opal_glue.
    let j = |v: &[PathBuf]| {
        v.iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    };
    println!("cargo:include={}", j(&incs));
    println!("cargo:libdirs={}", j(&libs));

    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("opal_.*|ompi_.*|mca_.*")
        .allowlist_type("opal_.*|ompi_.*|mca_.*")
        .allowlist_var("OPAL_.*|OMPI_.*|MCA_.*|opal_.*|ompi_.*|mca_.*|MPI_.*")
        .blocklist_function("opal_.*_inline.*")
        .prepend_enum_name(false)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .derive_default(true)
        .layout_tests(true)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for i in &incs {
        b = b.clang_arg(format!("-I{}", i.display()));
    }
    let bindings = b
        .generate()
        .expect("bindgen over the Open MPI headers failed");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings");
}
