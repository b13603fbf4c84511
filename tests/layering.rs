//! The crate's layers call only downward: every `crate::` path in `src/` must name a module of
//! a lower layer than the file's own (or the same module). README's architecture table lists
//! the same layers; this test keeps it true. The `fsdp-ckpt` tool is a crate of its own on
//! top, so it can only use the public API.
//!
//! Comments are skipped (doc links may point anywhere), and so are paths through the crate
//! root's re-exports, which would hide the real dependency: inside the crate, name the
//! defining module (`crate::optim_state::ParamKey`, not `crate::ParamKey`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The layers, lowest first. Modules in one layer must not import each other.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["tensor"],
    &["model", "placement"],
    &["flat_param", "param_layout", "collectives"],
    &["optim_state", "fully_shard"],
    &["optim", "param_shards"],
    &["io"],
    &["checkpoint"],
    &["fsdp"],
    &["state_dict"],
    &["offline", "libtorch"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The top-level module a source file belongs to (`None` for `lib.rs`, which only
/// re-exports).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    if first == "lib.rs" {
        return None;
    }
    Some(first.trim_end_matches(".rs").to_string())
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The identifiers that follow `crate::` in code lines (whole-line comments skipped); a
/// grouped `crate::{a, b::c}` yields `a` and `b`.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (line_no, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(pos) = rest.find("crate::") {
            let preceded_by_ident = rest[..pos]
                .chars()
                .last()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            rest = &rest[pos + "crate::".len()..];
            if preceded_by_ident {
                continue;
            }
            if let Some(group) = rest.strip_prefix('{') {
                let body = group.split('}').next().unwrap_or("");
                for item in body.split(',') {
                    let ident = item.trim().split("::").next().unwrap_or("").trim();
                    if !ident.is_empty() {
                        found.push((line_no + 1, ident.to_string()));
                    }
                }
                continue;
            }
            let ident: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !ident.is_empty() {
                found.push((line_no + 1, ident));
            }
        }
    }
    found
}

#[test]
fn every_module_imports_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut violations = BTreeSet::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        let Some(own) = layer_of(&module) else {
            violations.insert(format!(
                "{}: module `{module}` is in no layer (add it to LAYERS and README)",
                file.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for (line, target) in crate_paths(&text) {
            if target == module || target == "self" {
                continue;
            }
            match layer_of(&target) {
                Some(l) if l < own => {}
                Some(l) => {
                    violations.insert(format!(
                        "{}:{line}: `{module}` (layer {own}) uses `crate::{target}` (layer {l})",
                        file.display()
                    ));
                }
                None => {
                    violations.insert(format!(
                        "{}:{line}: `crate::{target}` goes through the crate root; name the defining module",
                        file.display()
                    ));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "imports against the layer order:\n{}",
        violations.into_iter().collect::<Vec<_>>().join("\n")
    );
}

/// `io::pickle` is the codec under `io::torch_save` and `io::dcp`: it knows neither format
/// (each brings its allow-list and objects), so nothing in it names them.
#[test]
fn the_pickle_codec_uses_no_format_built_on_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/io/pickle");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    assert!(!files.is_empty());
    let mut violations = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            if [
                "io::torch_save",
                "io::dcp",
                "super::super",
                "super::torch_save",
                "super::dcp",
            ]
            .iter()
            .any(|p| code.contains(p))
            {
                violations.push(format!("{}:{}: {code}", file.display(), i + 1));
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

#[test]
fn the_checker_sees_grouped_and_plain_paths_but_not_comments() {
    let text = "use crate::optim_state::ParamKey;\n// crate::fsdp::Fsdp\nuse crate::{model, io::torch_save};\nlet x = crate::tensor::DType::F32; // ok\n";
    let found: Vec<String> = crate_paths(text).into_iter().map(|(_, m)| m).collect();
    assert_eq!(found, ["optim_state", "model", "io", "tensor"]);
}
