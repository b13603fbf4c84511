//! The crate's layers call only downward, and the files of one module directory do not import
//! each other in a circle. Every `.rs` file under `src/` is parsed with `syn`, and every path
//! that names an item of the crate is resolved to an absolute module path: `use` trees (groups,
//! nesting, renames, globs, however rustfmt wraps them), paths in expressions, types, patterns
//! and attributes, and the `crate::…`, `super::…`, `self::…` (and child-module) paths inside
//! macro bodies, found in their token streams. Comments and doc comments are not code.
//!
//! Rule 1 (layers): a path from a file must name its own top-level module or one of a lower
//! layer (LAYERS below; README's architecture table lists the same layers). Paths through the
//! crate root's re-exports would hide the real dependency and are refused: inside the crate,
//! name the defining module (`crate::optim_state::ParamKey`, not `crate::ParamKey`). The
//! `fsdp-ckpt` tool is a crate of its own on top, so it can only use the public API.
//!
//! Rule 2 (rooms): inside one directory module, the child files (a child's own submodules
//! count as that child) must not import each other in a circle. The parent (`mod.rs`, or
//! `foo.rs` for `foo/`) is not a sibling: a child using its parent is no edge. An item reached
//! through a re-export counts where it is defined (`super::Writer` re-exported from
//! `write.rs` is an edge to `write.rs`). The root directory is no room: its children are the
//! top-level modules, which rule 1 already orders.
//!
//! What the tree breaks today is listed in KNOWN_VIOLATIONS and KNOWN_CYCLES, each with its
//! reason; an entry that no longer occurs fails the test, so the lists shrink as fixes land.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::Path;

use proc_macro2::{Spacing, Span, TokenStream, TokenTree};
use syn::ext::IdentExt;
use syn::visit::{self, Visit};

/// The layers, lowest first. Modules in one layer must not import each other.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["tensor", "storage"],
    &["model", "placement"],
    &["flat_param", "param_layout", "collectives"],
    &["optim_state", "fully_shard"],
    &["optim", "param_shards"],
    &["io"],
    &["checkpoint"],
    &["state_dict"],
    &["fsdp1", "fsdp2"],
    &["libtorch", "commands"],
];

/// Lower modules a module must not use although the layers allow it, and why: the format
/// layer knows formats, not jobs, so it plans and moves bytes but never communicates (the
/// group drivers are in `commands` and `checkpoint`).
const FORBIDDEN: &[(&str, &str, &str)] = &[(
    "io",
    "collectives",
    "the format layer plans and moves bytes; running a job over a process group is the \
     coordinator's (commands::conversions, checkpoint)",
)];

/// Layer violations the tree has today, as `file: what` (the report without its line number),
/// each with the reason it is still there. Remove an entry when its fix lands.
const KNOWN_VIOLATIONS: &[(&str, &str)] = &[];

/// Sibling-import circles the tree has today: the files of the circle (sorted), and why it is
/// still there. Remove an entry when its fix lands.
const KNOWN_CYCLES: &[(&[&str], &str)] = &[];

#[test]
fn every_module_imports_only_lower_layers_and_no_siblings_in_a_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    files.sort();
    let sources: Vec<(String, String)> = files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(root).unwrap();
            let rel = rel.components().map(|c| c.as_os_str().to_str().unwrap());
            (
                rel.collect::<Vec<_>>().join("/"),
                std::fs::read_to_string(f).unwrap(),
            )
        })
        .collect();
    let sources: Vec<(&str, &str)> = sources
        .iter()
        .map(|(p, t)| (p.as_str(), t.as_str()))
        .collect();
    let report = check(&sources, LAYERS);
    let failures = unexpected(&report, KNOWN_VIOLATIONS, KNOWN_CYCLES);
    assert!(
        failures.is_empty(),
        "imports against the layer order or in a circle:\n{}",
        failures.join("\n")
    );
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The checker.

/// An absolute module (or item) path inside the crate, without the leading `crate`.
type ModPath = Vec<String>;

/// How deep resolution follows imports and globs before it gives up (an import cycle, which
/// rustc would refuse anyway).
const DEPTH: usize = 32;

/// One violation: `key` is stable across line shifts (what KNOWN lists hold), `message` is
/// what the test prints.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Finding {
    file: String,
    line: usize,
    key: String,
    message: String,
}

impl Finding {
    /// A finding at `file:line`, known by `file: what`.
    fn new(file: &str, line: usize, what: &str) -> Finding {
        Finding {
            file: file.to_string(),
            line,
            key: format!("{file}: {what}"),
            message: format!("{file}:{line}: {what}"),
        }
    }
}

#[derive(Debug, Default)]
struct Report {
    /// Layer violations, crate-root paths, unparsable files.
    violations: Vec<Finding>,
    /// Sibling circles; `key` is the circle's files, sorted, joined by ", ".
    cycles: Vec<Finding>,
}

/// The names one module declares.
#[derive(Default)]
struct Scope {
    /// Child modules (`mod x;` and `mod x { … }`).
    modules: BTreeSet<String>,
    /// Items defined here.
    items: BTreeSet<String>,
    /// `use` imports: the bound name and the path as written.
    imports: BTreeMap<String, Vec<String>>,
    /// Glob imports, as written without the `*`.
    globs: Vec<Vec<String>>,
}

/// A path as written somewhere in the crate.
struct Reference {
    file: usize,
    /// The module the path is written in (inline modules included).
    ctx: ModPath,
    segs: Vec<String>,
    line: usize,
}

struct Crate {
    scopes: HashMap<ModPath, Scope>,
    /// Modules that are files of their own, and the file.
    files: BTreeMap<ModPath, String>,
}

/// The module a file under `src/` is: `src/io/dcp/read.rs` is `io::dcp::read`, `mod.rs` its
/// directory's module, `lib.rs` the root (`foo.rs` next to `foo/` is `foo` as well).
fn module_of_file(rel: &str) -> ModPath {
    let rel = rel.strip_prefix("src/").unwrap_or(rel);
    let mut parts: Vec<String> = rel.split('/').map(str::to_string).collect();
    let last = parts.pop().unwrap_or_default();
    match last.as_str() {
        "mod.rs" => parts,
        "lib.rs" if parts.is_empty() => parts,
        _ => {
            parts.push(last.trim_end_matches(".rs").to_string());
            parts
        }
    }
}

fn join(module: &[String], name: &str) -> ModPath {
    let mut p = module.to_vec();
    p.push(name.to_string());
    p
}

fn line_of(span: Span) -> usize {
    span.start().line
}

impl Crate {
    /// The absolute path `segs`, written in module `ctx`, names (`None` for anything outside
    /// the crate or unknown), and whether it got there without going through an import.
    fn absolute(&self, ctx: &[String], segs: &[String], depth: usize) -> Option<(ModPath, bool)> {
        if depth == 0 {
            return None;
        }
        match segs.first()?.as_str() {
            "::" => None,
            "crate" => Some((segs[1..].to_vec(), true)),
            "self" | "super" => {
                let mut base = ctx.to_vec();
                let mut rest = segs;
                while let Some((s, tail)) = rest.split_first() {
                    match s.as_str() {
                        "self" => {}
                        "super" => {
                            base.pop()?;
                        }
                        _ => break,
                    }
                    rest = tail;
                }
                base.extend_from_slice(rest);
                Some((base, true))
            }
            name => {
                let (mut path, own) = self.lookup(ctx, name, depth - 1)?;
                path.extend_from_slice(&segs[1..]);
                Some((path, own))
            }
        }
    }

    /// What `name` stands for in `module`: the path it names and whether it is the module's
    /// own (a child module or an item defined there) rather than imported.
    fn lookup(&self, module: &[String], name: &str, depth: usize) -> Option<(ModPath, bool)> {
        if depth == 0 {
            return None;
        }
        let scope = self.scopes.get(module)?;
        if scope.modules.contains(name) || scope.items.contains(name) {
            return Some((join(module, name), true));
        }
        if let Some(raw) = scope.imports.get(name) {
            return self
                .absolute(module, raw, depth - 1)
                .map(|(p, _)| (p, false));
        }
        for glob in &scope.globs {
            if let Some((from, _)) = self.absolute(module, glob, depth - 1) {
                if let Some((p, _)) = self.lookup(&from, name, depth - 1) {
                    return Some((p, false));
                }
            }
        }
        None
    }

    /// `path` with every re-export on the way replaced by what it re-exports, so that it names
    /// the module that defines the item.
    fn canonical(&self, mut path: ModPath) -> ModPath {
        'restart: for _ in 0..DEPTH {
            for i in 0..path.len() {
                let Some((target, _)) = self.lookup(&path[..i], &path[i], DEPTH) else {
                    return path;
                };
                if target[..] != path[..=i] {
                    let mut next = target;
                    next.extend_from_slice(&path[i + 1..]);
                    path = next;
                    continue 'restart;
                }
                if !self.scopes.contains_key(&path[..=i]) {
                    return path; // an item: what follows is its own (methods, variants)
                }
            }
            return path;
        }
        path
    }
}

/// Walks one parsed file, recording the names each module declares and every path.
struct Collector<'a> {
    file: usize,
    path: &'a str,
    ctx: ModPath,
    scopes: &'a mut HashMap<ModPath, Scope>,
    refs: &'a mut Vec<Reference>,
    violations: &'a mut Vec<Finding>,
}

impl Collector<'_> {
    fn scope(&mut self) -> &mut Scope {
        self.scopes.entry(self.ctx.clone()).or_default()
    }

    fn reference(&mut self, segs: Vec<String>, line: usize) {
        self.refs.push(Reference {
            file: self.file,
            ctx: self.ctx.clone(),
            segs,
            line,
        });
    }

    /// Records one `use` tree under `prefix` (the path segments before it).
    fn use_tree(&mut self, tree: &syn::UseTree, prefix: &mut Vec<String>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.unraw().to_string());
                self.use_tree(&p.tree, prefix);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let name = n.ident.unraw().to_string();
                let path = if name == "self" {
                    prefix.clone()
                } else {
                    join(prefix, &name)
                };
                if let Some(bound) = path.last().cloned() {
                    self.scope().imports.entry(bound).or_insert(path.clone());
                }
                self.reference(path, line_of(n.ident.span()));
            }
            syn::UseTree::Rename(r) => {
                let path = join(prefix, &r.ident.unraw().to_string());
                let bound = r.rename.unraw().to_string();
                if bound != "_" {
                    self.scope().imports.entry(bound).or_insert(path.clone());
                }
                self.reference(path, line_of(r.ident.span()));
            }
            syn::UseTree::Glob(g) => {
                self.scope().globs.push(prefix.clone());
                self.reference(prefix.clone(), line_of(g.star_token.span));
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(t, prefix);
                }
            }
        }
    }

    /// Finds the paths in a token stream (macro bodies, attribute arguments): sequences
    /// `a::b…` not preceded by `::`; `$crate` counts as `crate`.
    fn tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let sep = |j: usize| {
            matches!(trees.get(j), Some(TokenTree::Punct(p)) if p.as_char() == ':' && p.spacing() == Spacing::Joint)
                && matches!(trees.get(j + 1), Some(TokenTree::Punct(p)) if p.as_char() == ':')
        };
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(g) => {
                    self.tokens(g.stream());
                    i += 1;
                }
                TokenTree::Ident(first) => {
                    let mut segs = vec![first.unraw().to_string()];
                    let mut j = i + 1;
                    while sep(j) {
                        let Some(TokenTree::Ident(next)) = trees.get(j + 2) else {
                            break;
                        };
                        segs.push(next.unraw().to_string());
                        j += 3;
                    }
                    let after_sep = i >= 2 && sep(i - 2);
                    let metavar = i >= 1
                        && matches!(&trees[i - 1], TokenTree::Punct(p) if p.as_char() == '$')
                        && segs[0] != "crate";
                    if segs.len() >= 2 && !after_sep && !metavar {
                        self.reference(segs, line_of(first.span()));
                    }
                    i = j.max(i + 1);
                }
                _ => i += 1,
            }
        }
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let name = match item {
            syn::Item::Const(i) => Some(&i.ident),
            syn::Item::Enum(i) => Some(&i.ident),
            syn::Item::Fn(i) => Some(&i.sig.ident),
            syn::Item::Macro(i) => i.ident.as_ref(),
            syn::Item::Static(i) => Some(&i.ident),
            syn::Item::Struct(i) => Some(&i.ident),
            syn::Item::Trait(i) => Some(&i.ident),
            syn::Item::TraitAlias(i) => Some(&i.ident),
            syn::Item::Type(i) => Some(&i.ident),
            syn::Item::Union(i) => Some(&i.ident),
            _ => None,
        };
        if let Some(name) = name {
            let name = name.unraw().to_string();
            self.scope().items.insert(name);
        }
        visit::visit_item(self, item);
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        let name = m.ident.unraw().to_string();
        self.scope().modules.insert(name.clone());
        if m.attrs.iter().any(|a| a.path().is_ident("path")) {
            self.violations.push(Finding::new(
                self.path,
                line_of(m.ident.span()),
                &format!("`#[path]` on `mod {name}`: files are mapped to modules by their place"),
            ));
        }
        for a in &m.attrs {
            self.visit_attribute(a);
        }
        if let Some((_, items)) = &m.content {
            self.ctx.push(name);
            self.scope();
            for item in items {
                self.visit_item(item);
            }
            self.ctx.pop();
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        for a in &u.attrs {
            self.visit_attribute(a);
        }
        let mut prefix = Vec::new();
        if u.leading_colon.is_some() {
            prefix.push("::".to_string());
        }
        self.use_tree(&u.tree, &mut prefix);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.leading_colon.is_none() && p.segments.len() >= 2 {
            let segs = p.segments.iter().map(|s| s.ident.unraw().to_string());
            self.reference(segs.collect(), line_of(p.segments[0].ident.span()));
        }
        visit::visit_path(self, p);
    }

    /// `pub(crate)`, `pub(super)`: not a use of anything.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_attribute(&mut self, a: &'ast syn::Attribute) {
        if a.path().is_ident("doc") {
            return;
        }
        if let syn::Meta::List(list) = &a.meta {
            self.tokens(list.tokens.clone());
        }
        visit::visit_attribute(self, a);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.visit_path(&m.path);
        self.tokens(m.tokens.clone());
    }
}

fn layer_of(layers: &[&[&str]], module: &str) -> Option<usize> {
    layers.iter().position(|l| l.contains(&module))
}

/// Checks the crate made of `sources` (`(path, text)`, paths as `src/…`) against `layers`.
fn check(sources: &[(&str, &str)], layers: &[&[&str]]) -> Report {
    let mut report = Report::default();
    let mut krate = Crate {
        scopes: HashMap::new(),
        files: BTreeMap::new(),
    };
    let mut refs = Vec::new();
    for (index, (path, text)) in sources.iter().enumerate() {
        let module = module_of_file(path);
        krate.files.insert(module.clone(), path.to_string());
        for k in 0..module.len() {
            let parent = krate.scopes.entry(module[..k].to_vec()).or_default();
            parent.modules.insert(module[k].clone());
        }
        krate.scopes.entry(module.clone()).or_default();
        let ast = match syn::parse_file(text) {
            Ok(ast) => ast,
            Err(e) => {
                let what = format!("does not parse: {e}");
                report
                    .violations
                    .push(Finding::new(path, line_of(e.span()), &what));
                continue;
            }
        };
        let mut collector = Collector {
            file: index,
            path,
            ctx: module,
            scopes: &mut krate.scopes,
            refs: &mut refs,
            violations: &mut report.violations,
        };
        collector.visit_file(&ast);
    }

    let top_level: BTreeSet<String> = krate.scopes[&ModPath::new()].modules.clone();
    for m in &top_level {
        if layer_of(layers, m).is_none() {
            let file = krate
                .files
                .get(std::slice::from_ref(m))
                .cloned()
                .unwrap_or_else(|| "src/lib.rs".to_string());
            let what = format!("module `{m}` is in no layer (add it to LAYERS and README)");
            report.violations.push(Finding::new(&file, 1, &what));
        }
    }

    // Per room (a module with files of its own below it): child → child edges, each with the
    // first place it is seen (file, line, path as written).
    type Edges = BTreeMap<(String, String), (usize, usize, String)>;
    let mut rooms: BTreeMap<ModPath, Edges> = BTreeMap::new();
    for r in &refs {
        let Some((raw, own)) = krate.absolute(&r.ctx, &r.segs, DEPTH) else {
            continue;
        };
        let file = sources[r.file].0;
        let written = r.segs.join("::");
        let file_module = module_of_file(file);
        // Rule 1. A path through an import was checked at the import.
        if let (Some(from), true) = (file_module.first(), own) {
            let what = match raw.first() {
                Some(to) if top_level.contains(to) => {
                    match (layer_of(layers, from), layer_of(layers, to)) {
                        (Some(lf), Some(lt)) if to != from && lt >= lf => Some(format!(
                            "`{from}` (layer {lf}) uses `{written}`, in `{to}` (layer {lt})"
                        )),
                        _ => FORBIDDEN
                            .iter()
                            .find(|(f, t, _)| f == from && t == to)
                            .map(|(_, _, why)| format!("`{from}` must not use `{written}`: {why}")),
                    }
                }
                _ => Some(format!(
                    "`{written}` goes through the crate root; name the defining module"
                )),
            };
            if let Some(what) = what {
                report.violations.push(Finding::new(file, r.line, &what));
            }
        }
        // Rule 2.
        let target = krate.canonical(raw);
        let k = r
            .ctx
            .iter()
            .zip(&target)
            .take_while(|(a, b)| a == b)
            .count();
        if k > 0 && k < r.ctx.len() && k < target.len() {
            let (a, b) = (&r.ctx[..=k], &target[..=k]);
            if krate.files.contains_key(a) && krate.files.contains_key(b) {
                rooms
                    .entry(r.ctx[..k].to_vec())
                    .or_default()
                    .entry((a[k].clone(), b[k].clone()))
                    .or_insert((r.file, r.line, written));
            }
        }
    }

    for (room, edges) in &rooms {
        let file_of = |child: &String| krate.files[&join(room, child)].clone();
        let mut next: BTreeMap<&String, Vec<&String>> = BTreeMap::new();
        for (a, b) in edges.keys() {
            next.entry(a).or_default().push(b);
        }
        let reach = |from: &String| {
            let mut seen = BTreeSet::new();
            let mut todo = vec![from];
            while let Some(n) = todo.pop() {
                for m in next.get(n).into_iter().flatten() {
                    if seen.insert(*m) {
                        todo.push(m);
                    }
                }
            }
            seen
        };
        let reaches: BTreeMap<&String, BTreeSet<&String>> =
            next.keys().map(|n| (*n, reach(n))).collect();
        let mut done = BTreeSet::new();
        for (n, r) in &reaches {
            if done.contains(n) || !r.contains(n) {
                continue;
            }
            // The strongly connected set around `n`, and the shortest circle through `n`.
            let members: BTreeSet<&String> = r
                .iter()
                .filter(|m| reaches.get(*m).is_some_and(|rm| rm.contains(n)))
                .copied()
                .collect();
            done.extend(members.iter().copied());
            let mut back: BTreeMap<&String, &String> = BTreeMap::new();
            let mut queue = VecDeque::from([*n]);
            let mut last = None;
            while let Some(x) = queue.pop_front() {
                for y in next.get(x).into_iter().flatten() {
                    if *y == *n {
                        last = Some(x);
                        break;
                    }
                    if members.contains(y) && !back.contains_key(y) {
                        back.insert(y, x);
                        queue.push_back(y);
                    }
                }
                if last.is_some() {
                    break;
                }
            }
            let mut circle = vec![last.unwrap()];
            while circle.last() != Some(n) {
                circle.push(back[circle.last().unwrap()]);
            }
            circle.reverse();
            circle.push(*n);
            let files: Vec<String> = members.iter().map(|m| file_of(m)).collect();
            let steps: Vec<String> = circle
                .windows(2)
                .map(|w| {
                    let (f, line, written) = &edges[&(w[0].clone(), w[1].clone())];
                    format!(
                        "    {}:{line}: uses `{written}` ({})",
                        sources[*f].0,
                        file_of(w[1])
                    )
                })
                .collect();
            let (f, line, _) = &edges[&(circle[0].clone(), circle[1].clone())];
            let mut message = format!(
                "{}:{line}: sibling files in `{}` import each other in a circle: {}",
                sources[*f].0,
                room.join("::"),
                circle
                    .iter()
                    .map(|c| file_of(c))
                    .collect::<Vec<_>>()
                    .join(" -> ")
            );
            if members.len() + 1 > circle.len() {
                message += &format!(" (all of {} reach each other)", files.join(", "));
            }
            message += "\n";
            message += &steps.join("\n");
            report.cycles.push(Finding {
                file: sources[*f].0.to_string(),
                line: *line,
                key: files.join(", "),
                message,
            });
        }
    }
    report.violations.sort();
    report.violations.dedup();
    report
}

/// What fails the test: findings not in the KNOWN lists, and KNOWN entries that no longer
/// occur.
fn unexpected(
    report: &Report,
    known_violations: &[(&str, &str)],
    known_cycles: &[(&[&str], &str)],
) -> Vec<String> {
    let mut failures = Vec::new();
    let known_v: BTreeSet<&str> = known_violations.iter().map(|(k, _)| *k).collect();
    let known_c: BTreeSet<String> = known_cycles.iter().map(|(k, _)| k.join(", ")).collect();
    for v in &report.violations {
        if !known_v.contains(v.key.as_str()) {
            failures.push(v.message.clone());
        }
    }
    for c in &report.cycles {
        if !known_c.contains(&c.key) {
            failures.push(c.message.clone());
        }
    }
    for k in known_v {
        if !report.violations.iter().any(|v| v.key == k) {
            failures.push(format!(
                "KNOWN_VIOLATIONS entry no longer occurs, remove it: {k}"
            ));
        }
    }
    for k in known_c {
        if !report.cycles.iter().any(|c| c.key == k) {
            failures.push(format!(
                "KNOWN_CYCLES entry no longer occurs, remove it: {k}"
            ));
        }
    }
    failures
}

// ---------------------------------------------------------------------------------------------
// The checker's own tests, on small crates.

const LIB: &str = "mod error; mod tensor; mod io; mod checkpoint; mod collectives;";

fn messages(sources: &[(&str, &str)]) -> Vec<String> {
    let report = check(sources, LAYERS);
    let mut all: Vec<String> = report.violations.into_iter().map(|f| f.message).collect();
    all.extend(report.cycles.into_iter().map(|f| f.message));
    all
}

#[test]
fn a_wrapped_crate_group_that_goes_up_is_caught_on_its_line() {
    let found = messages(&[
        ("src/lib.rs", LIB),
        (
            "src/tensor.rs",
            "use crate::{\n    error::Error,\n    checkpoint::Saver,\n};\n",
        ),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("src/tensor.rs:3: `tensor` (layer 1) uses `crate::checkpoint::Saver`"),
        "{found:?}"
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
fn the_format_layer_using_collectives_is_refused_though_they_are_lower() {
    let found = messages(&[
        ("src/lib.rs", LIB),
        ("src/io/mod.rs", "mod dcp;"),
        (
            "src/io/dcp.rs",
            "fn f(pg: &dyn crate::collectives::ProcessGroup) { let _ = crate::tensor::DType::F32; }",
        ),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0]
            .starts_with("src/io/dcp.rs:1: `io` must not use `crate::collectives::ProcessGroup`"),
        "{found:?}"
    );
}

#[test]
fn super_super_resolves_to_the_grandparent() {
    let krate = Crate {
        scopes: HashMap::new(),
        files: BTreeMap::new(),
    };
    let p = |s: &str| -> Vec<String> { s.split("::").map(str::to_string).collect() };
    assert_eq!(
        krate.absolute(&p("io::dcp::read"), &p("super::super::x"), DEPTH),
        Some((p("io::x"), true))
    );
    assert_eq!(krate.absolute(&p("io"), &p("super::super::x"), DEPTH), None);
    // In a file, in an expression: `io::dcp::read` reaching up to `checkpoint`.
    let found = messages(&[
        ("src/lib.rs", LIB),
        ("src/io/mod.rs", "mod dcp;"),
        ("src/io/dcp/mod.rs", "mod read;"),
        (
            "src/io/dcp/read.rs",
            "fn f() {\n    super::super::super::checkpoint::load();\n}\n",
        ),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("src/io/dcp/read.rs:2: `io` (layer 6) uses `super::super::super::checkpoint::load`, in `checkpoint` (layer 7)"), "{found:?}");
}

#[test]
fn paths_in_macros_and_the_crate_root_are_seen_but_not_comments() {
    let found = messages(&[
        ("src/lib.rs", "mod error; mod tensor; mod checkpoint; pub use error::Error;"),
        (
            "src/tensor.rs",
            "//! [`crate::checkpoint`]\n/// crate::checkpoint::X\nfn f() {\n    // crate::checkpoint::Y\n    assert!(crate::checkpoint::ok());\n    let _: crate::Error = todo!();\n}\n",
        ),
    ]);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].starts_with("src/tensor.rs:5: `tensor` (layer 1) uses `crate::checkpoint::ok`"),
        "{found:?}"
    );
    assert!(
        found[1].starts_with("src/tensor.rs:6: `crate::Error` goes through the crate root"),
        "{found:?}"
    );
}

#[test]
fn a_sibling_circle_is_found_with_its_files() {
    let found = messages(&[
        ("src/lib.rs", LIB),
        ("src/io/mod.rs", "mod dcp;"),
        ("src/io/dcp/mod.rs", "mod pickler; mod write; mod read;"),
        ("src/io/dcp/read.rs", "use super::write::W;"),
        (
            "src/io/dcp/pickler.rs",
            "fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::super::write::W;\n}\n",
        ),
        (
            "src/io/dcp/write.rs",
            "use super::{\n    pickler::f,\n};\npub struct W;\n",
        ),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        found[0],
        "src/io/dcp/pickler.rs:4: sibling files in `io::dcp` import each other in a circle: \
         src/io/dcp/pickler.rs -> src/io/dcp/write.rs -> src/io/dcp/pickler.rs\n    \
         src/io/dcp/pickler.rs:4: uses `super::super::write::W` (src/io/dcp/write.rs)\n    \
         src/io/dcp/write.rs:2: uses `super::pickler::f` (src/io/dcp/pickler.rs)"
    );
}

#[test]
fn a_circle_through_a_nested_module_globs_and_re_exports_is_found() {
    // rendezvous/agent_store.rs (part of `rendezvous`) -> tcp_store.rs -> rendezvous, the
    // last edge through `super::*` and the re-exports in collectives/mod.rs and
    // rendezvous/mod.rs.
    let found = messages(&[
        ("src/lib.rs", LIB),
        (
            "src/collectives/mod.rs",
            "mod rendezvous; mod tcp_store; pub use rendezvous::Agent;",
        ),
        (
            "src/collectives/rendezvous/mod.rs",
            "mod agent_store; pub use agent_store::Agent;",
        ),
        (
            "src/collectives/rendezvous/agent_store.rs",
            "use crate::collectives::tcp_store::Client; pub struct Agent;",
        ),
        (
            "src/collectives/tcp_store.rs",
            "use super::*;\npub struct Client;\nfn f() { Agent::new(); }\n",
        ),
    ]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("src/collectives/rendezvous/mod.rs -> src/collectives/tcp_store.rs -> src/collectives/rendezvous/mod.rs"), "{found:?}");
    assert!(
        found[0].contains("src/collectives/tcp_store.rs:3: uses `Agent::new`"),
        "{found:?}"
    );
}

#[test]
fn a_child_using_its_parent_is_no_circle() {
    let found = messages(&[
        ("src/lib.rs", LIB),
        ("src/io/mod.rs", "mod dcp;"),
        (
            "src/io/dcp/mod.rs",
            "mod read; mod write;\nuse read::R;\nuse write::W;\npub struct Shared;\n#[cfg(test)]\nmod tests { use super::read::R; }\n",
        ),
        ("src/io/dcp/read.rs", "use super::Shared;\npub struct R;\nmod tests { use super::super::Shared; }\n"),
        ("src/io/dcp/write.rs", "use super::{Shared, read::R};\npub struct W;\n"),
    ]);
    assert!(found.is_empty(), "{found:?}");
}

#[test]
fn known_entries_that_no_longer_occur_fail() {
    let report = check(&[("src/lib.rs", LIB)], LAYERS);
    assert!(unexpected(&report, &[], &[]).is_empty());
    let stale = unexpected(
        &report,
        &[("src/tensor.rs: gone", "fixed")],
        &[(&["src/a.rs", "src/b.rs"], "fixed")],
    );
    assert_eq!(stale.len(), 2, "{stale:?}");
}
