//! Bindings to the system libfabric.
//!
//! Finds the headers the way a user installed them: `LIBFABRIC_DIR` (a prefix with
//! `include/` and `lib/`), then pkg-config, then the compiler's default paths. Every
//! failed attempt is collected and printed if all of them fail. The `static inline`
//! calls of the fi_* API (fi_domain, fi_close, fi_tsend, ...) are wrapped in C by
//! bindgen's `wrap_static_fns` and compiled here.
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn pkg_config() -> Result<(Vec<PathBuf>, Vec<PathBuf>), String> {
    let run = |arg: &str| -> Result<String, String> {
        let out = Command::new("pkg-config")
            .args([arg, "libfabric"])
            .output()
            .map_err(|e| format!("pkg-config {arg} libfabric: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "pkg-config {arg} libfabric: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let incs = run("--cflags-only-I")?
        .split_whitespace()
        .filter_map(|s| s.strip_prefix("-I").map(PathBuf::from))
        .collect();
    let libs = run("--libs-only-L")?
        .split_whitespace()
        .filter_map(|s| s.strip_prefix("-L").map(PathBuf::from))
        .collect();
    Ok((incs, libs))
}

fn has_header(dirs: &[PathBuf]) -> bool {
    dirs.iter().any(|d| d.join("rdma/fabric.h").exists())
        || (dirs.is_empty() && Path::new("/usr/include/rdma/fabric.h").exists())
}

fn main() {
    println!("cargo:rerun-if-env-changed=LIBFABRIC_DIR");
    println!("cargo:rerun-if-changed=wrapper.h");
    let mut failures = Vec::new();
    let mut found: Option<(Vec<PathBuf>, Vec<PathBuf>)> = None;

    if let Ok(dir) = env::var("LIBFABRIC_DIR") {
        let d = PathBuf::from(&dir);
        let incs = vec![d.join("include")];
        if has_header(&incs) {
            found = Some((incs, vec![d.join("lib"), d.join("lib64")]));
        } else {
            failures.push(format!(
                "LIBFABRIC_DIR={dir}: no include/rdma/fabric.h there"
            ));
        }
    }
    if found.is_none() {
        match pkg_config() {
            Ok(p) if has_header(&p.0) => found = Some(p),
            Ok(p) => failures.push(format!(
                "pkg-config: include dirs {:?} lack rdma/fabric.h",
                p.0
            )),
            Err(e) => failures.push(e),
        }
    }
    if found.is_none() {
        if Path::new("/usr/include/rdma/fabric.h").exists() {
            found = Some((vec![], vec![]));
        } else {
            failures.push("/usr/include/rdma/fabric.h: not found".into());
        }
    }
    let Some((incs, libdirs)) = found else {
        panic!(
            "libfabric headers not found (install libfabric-dev or set LIBFABRIC_DIR):\n  {}",
            failures.join("\n  ")
        );
    };
    for l in &libdirs {
        println!("cargo:rustc-link-search=native={}", l.display());
    }
    println!("cargo:rustc-link-lib=dylib=fabric");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let wrap_c = out.join("fi_static_wrappers");

    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("fi_.*")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*|fi_.*")
        .allowlist_type("FI_.*")
        .prepend_enum_name(false)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .derive_default(true)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrap_c)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for i in &incs {
        b = b.clang_arg(format!("-I{}", i.display()));
    }
    let bindings = b.generate().expect("bindgen over rdma/*.h failed");
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings");

    let mut cc = cc::Build::new();
    cc.file(wrap_c.with_extension("c"))
        .include(env::var("CARGO_MANIFEST_DIR").unwrap())
        .flag("-include")
        .flag(format!(
            "{}/wrapper.h",
            env::var("CARGO_MANIFEST_DIR").unwrap()
        ))
        .warnings(false)
        .flag_if_supported("-fPIC");
    for i in &incs {
        cc.include(i);
    }
    cc.compile("fi_static_wrappers");
    println!(
        "cargo:include={}",
        incs.iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    );
}
