//! Build script of the component library:
//! 1. compiles `opal_glue/` (C for Open MPI macros and static inline helpers),
//! 2. turns the `mca_params/*.params` tables into `params.rs` (the parameter specs the
//!    registration code iterates, and index constants).
//!
//! Include directories come from the -sys crates (`DEP_OPEN_PAL_INCLUDE`,
//! `DEP_FABRIC_INCLUDE`), so Open MPI and libfabric are found in one place only.
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;

struct Param {
    name: String,
    kind: String,
    default: String,
    level: u32,
    values: Vec<(String, i32)>,
    synonyms: Vec<String>,
    readonly: bool,
    help: String,
    /// int/size: the accepted range (required for int, so every new integer parameter
    /// states its limits and the bad-input test covers them).
    min: Option<i128>,
    max: Option<i128>,
    /// string: a comma-separated list of provider names.
    list: bool,
    /// string: the accepted values (empty means any).
    choices: Vec<String>,
}

fn parse(table: &str, text: &str) -> Vec<Param> {
    let mut out: Vec<Param> = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = || format!("mca_params/{table}.params:{}", n + 1);
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            out.push(Param {
                name: name.trim().to_string(),
                kind: String::new(),
                default: String::new(),
                level: 0,
                values: vec![],
                synonyms: vec![],
                readonly: false,
                help: String::new(),
                min: None,
                max: None,
                list: false,
                choices: vec![],
            });
            continue;
        }
        let p = out
            .last_mut()
            .unwrap_or_else(|| panic!("{}: key outside a [block]", at()));
        let (k, v) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("{}: expected `key = value`", at()));
        let v = v.trim().to_string();
        match k.trim() {
            "type" => p.kind = v,
            "default" => p.default = v,
            "level" => p.level = v.parse().unwrap_or_else(|_| panic!("{}: bad level", at())),
            "help" => p.help = v,
            "readonly" => p.readonly = v == "true",
            "list" => p.list = v == "true",
            "min" => p.min = Some(v.parse().unwrap_or_else(|_| panic!("{}: bad min", at()))),
            "max" => p.max = Some(v.parse().unwrap_or_else(|_| panic!("{}: bad max", at()))),
            "choices" => {
                p.choices = v
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            }
            "synonyms" => {
                p.synonyms = v
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            }
            "values" => {
                p.values = v
                    .split(',')
                    .map(|e| {
                        let (a, b) = e
                            .split_once('=')
                            .unwrap_or_else(|| panic!("{}: enum value needs name=number", at()));
                        (
                            a.trim().to_string(),
                            b.trim()
                                .parse()
                                .unwrap_or_else(|_| panic!("{}: bad enum number", at())),
                        )
                    })
                    .collect()
            }
            other => panic!("{}: unknown key `{other}`", at()),
        }
    }
    for p in &out {
        assert!(
            matches!(p.kind.as_str(), "int" | "bool" | "string" | "enum" | "size"),
            "mca_params/{table}.params [{}]: type must be int, bool, size, string or enum",
            p.name
        );
        assert!(
            (1..=9).contains(&p.level),
            "mca_params/{table}.params [{}]: level 1-9",
            p.name
        );
        assert!(
            !p.help.is_empty(),
            "mca_params/{table}.params [{}]: help is required",
            p.name
        );
        if p.kind == "int" {
            let (Some(lo), Some(hi)) = (p.min, p.max) else {
                panic!(
                    "mca_params/{table}.params [{}]: an int needs `min` and `max`",
                    p.name
                )
            };
            let d: i128 = p.default.parse().expect("int default");
            assert!(
                lo <= d && d <= hi && lo >= i32::MIN as i128 && hi <= i32::MAX as i128,
                "mca_params/{table}.params [{}]: need i32 range min <= default <= max",
                p.name
            );
        }
        if p.kind == "size" {
            let d: i128 = p.default.parse().expect("size default");
            let (lo, hi) = (p.min.unwrap_or(0), p.max.unwrap_or(u64::MAX as i128));
            assert!(
                0 <= lo && lo <= d && d <= hi && hi <= u64::MAX as i128,
                "mca_params/{table}.params [{}]: need 0 <= min <= default <= max",
                p.name
            );
        }
        if !matches!(p.kind.as_str(), "int" | "size") {
            assert!(
                p.min.is_none() && p.max.is_none(),
                "mca_params/{table}.params [{}]: min/max only for int and size",
                p.name
            );
        }
        if p.list || !p.choices.is_empty() {
            assert!(
                p.kind == "string",
                "mca_params/{table}.params [{}]: list/choices only for strings",
                p.name
            );
        }
        if !p.choices.is_empty() {
            assert!(
                p.default.is_empty() || p.choices.contains(&p.default),
                "mca_params/{table}.params [{}]: default must be one of the choices",
                p.name
            );
        }
        if p.kind == "enum" {
            assert!(
                p.values.iter().any(|(n, _)| *n == p.default),
                "mca_params/{table}.params [{}]: default must be one of the values",
                p.name
            );
        }
    }
    out
}

fn gen(table: &str, params: &[Param], code: &mut String) {
    let upper = table.to_uppercase();
    writeln!(code, "/// Parameters of `mca_params/{table}.params`.").unwrap();
    writeln!(code, "pub static {upper}: &[ParamSpec] = &[").unwrap();
    for p in params {
        let kind = match p.kind.as_str() {
            "int" => format!(
                "Kind::Int({})",
                p.default.parse::<i64>().expect("int default")
            ),
            "size" => format!(
                "Kind::Size({})",
                p.default.parse::<u64>().expect("size default")
            ),
            "bool" => format!("Kind::Bool({})", p.default == "true"),
            "string" => format!("Kind::Str({:?})", p.default),
            "enum" => {
                let vals: Vec<String> = p
                    .values
                    .iter()
                    .map(|(n, v)| format!("({v}, {n:?})"))
                    .collect();
                let def = p.values.iter().find(|(n, _)| *n == p.default).unwrap().1;
                format!(
                    "Kind::Enum {{ default: {def}, values: &[{}] }}",
                    vals.join(", ")
                )
            }
            _ => unreachable!(),
        };
        let (min, max) = match p.kind.as_str() {
            "size" => (p.min.unwrap_or(0), p.max.unwrap_or(u64::MAX as i128)),
            _ => (p.min.unwrap_or(0), p.max.unwrap_or(0)),
        };
        writeln!(
            code,
            "    ParamSpec {{ name: {:?}, kind: {kind}, level: {}, readonly: {}, synonyms: &{:?}, help: {:?}, min: {min}, max: {max}, list: {}, choices: &{:?} }},",
            p.name, p.level, p.readonly, p.synonyms, p.help, p.list, p.choices
        )
        .unwrap();
    }
    writeln!(code, "];").unwrap();
    writeln!(code, "/// Indices into [`{upper}`].").unwrap();
    writeln!(code, "pub mod {table} {{").unwrap();
    for (i, p) in params.iter().enumerate() {
        writeln!(
            code,
            "    pub const {}: usize = {i};",
            p.name.to_uppercase()
        )
        .unwrap();
    }
    writeln!(code, "}}").unwrap();
}

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());

    // 1. The parameter tables.
    let mut code =
        String::from("// Generated by build.rs from mca_params/*.params. Do not edit.\n");
    for table in ["common", "mtl", "btl"] {
        let path = root.join(format!("mca_params/{table}.params"));
        println!("cargo:rerun-if-changed={}", path.display());
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        gen(table, &parse(table, &text), &mut code);
    }
    fs::write(out.join("params.rs"), code).expect("write params.rs");

    // 2. The C glue.
    println!("cargo:rerun-if-changed=opal_glue");
    let mut cc = cc::Build::new();
    for f in fs::read_dir(root.join("opal_glue")).expect("opal_glue/") {
        let f = f.expect("opal_glue entry").path();
        if f.extension().is_some_and(|e| e == "c") {
            cc.file(&f);
        }
    }
    for var in ["DEP_OPEN_PAL_INCLUDE", "DEP_FABRIC_INCLUDE"] {
        if let Ok(dirs) = env::var(var) {
            for d in dirs.split(':').filter(|d| !d.is_empty()) {
                cc.include(d);
            }
        }
    }
    // Open MPI's headers inline 128-bit compare-and-swap (opal_lifo, used by the free
    // lists behind ompi_message_alloc); Open MPI itself is built with -mcx16.
    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
        cc.flag("-mcx16");
    }
    cc.flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .extra_warnings(true)
        .flag("-Wno-unused-parameter");
    cc.compile("opal_glue");
}
