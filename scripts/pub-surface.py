#!/usr/bin/env python3
"""The public API of the `fsdp` crate as a user sees it: what is reachable from the crate root.

    scripts/pub-surface.py                       # table of counts, default features
    scripts/pub-surface.py --features tch,nccl,mpi,fault-injection
    scripts/pub-surface.py --per-feature         # default, then what each feature adds
    scripts/pub-surface.py --list                # every reachable path with its kind
    scripts/pub-surface.py --usage-md FILE       # which outside users name each public path
                                                 # (notes/pub-surface.md: with every feature)
    scripts/pub-surface.py --json FILE           # read a rustdoc JSON file instead of building
    scripts/pub-surface.py --why fsdp::io::dcp::verify   # the outside files that name a path

Method: rustdoc's JSON output, which is the compiler's own answer (no source parsing). The
script runs `cargo rustdoc --lib -- -Z unstable-options --output-format json` with
RUSTC_BOOTSTRAP=1, so the stable toolchain will do; it is a doc build (dependencies are only
checked, no code generation). `tch` is built with `tch/doc-only`, which skips libtorch, so every
feature documents on a machine without PyTorch. Output: `$CARGO_TARGET_DIR` (or `target/`)
`/doc/fsdp.json`.

What counts. From the root module, every item rustdoc keeps (it strips private, `pub(crate)`,
`#[doc(hidden)]` and `#[cfg(test)]` items, and pub items of private modules unless they are
re-exported), following `pub use` (one item, or a glob such as `pub use fsdp::*` of the private
module `fsdp`). An item reached by several paths (`fsdp::Error` and `fsdp::error::Error`)
counts once, at its shortest path (breadth-first from the root); `--list` shows the others as
aliases. Counted kinds: modules (not the root), structs, enums, unions, traits, functions,
type aliases, constants, statics, exported macros, re-exports of other crates' items; then,
once per type: `pub` fields of structs, `pub` methods and associated constants of inherent
impls (trait impls are not counted), and apart from the total enum variants and trait items.

`--usage-md` scans the outside users for paths into the crate: `use fsdp::...` trees (nested
groups, `as`, `self`, globs; rustfmt-wrapped), `fsdp::a::b` paths in code, and paths through an
imported name (`use fsdp::io::dcp;` then `dcp::read_metadata`, `use fsdp::Fsdp;` then
`Fsdp::new`). Users: fsdp-ckpt/src, python/src, examples/, readme (README.md's rust blocks),
docs (code blocks in src/ doc comments, hidden `# ` lines included), tests/, fsdp-ckpt/tests/,
benches/, fuzz/. A tokenizer skips comments, strings and char literals. Methods, fields and
trait items are also matched by name (`.name` in a file that uses the crate): an over-count,
so "used by nobody" stays a safe claim.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATE = "fsdp"
FEATURES = ["tch", "nccl", "mpi", "fault-injection"]
# Extra features passed along with one of ours so that its doc build needs no native library.
FEATURE_EXTRAS = {"tch": ["tch/doc-only"]}
# rustdoc JSON formats the script accepts; checked against 57 (stable 1.95, nightly 2026-05).
FORMATS = range(45, 70)

ITEM_KINDS = [
    "module", "struct", "enum", "union", "trait", "function", "type_alias", "constant",
    "static", "macro", "extern re-export",
]
MEMBER_KINDS = ["field", "method", "assoc const"]
EXTRA_KINDS = ["variant", "trait item"]


# ---------------------------------------------------------------------------------------------
# Building and reading rustdoc JSON


def build_json(features, toolchain, offline, quiet):
    """Runs the doc build with `features` and returns the parsed JSON."""
    feats = []
    for f in features:
        feats.append(f)
        feats.extend(FEATURE_EXTRAS.get(f, []))
    cmd = ["cargo"] + (["+" + toolchain] if toolchain else []) + ["rustdoc", "--lib", "-p", CRATE]
    if offline:
        cmd.append("--offline")
    if feats:
        cmd += ["--features", ",".join(feats)]
    cmd += ["--", "-Z", "unstable-options", "--output-format", "json"]
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    target = env.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    if not quiet:
        print("$ RUSTC_BOOTSTRAP=1 " + " ".join(cmd), file=sys.stderr)
    res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL if quiet else None)
    if res.returncode != 0:
        sys.exit(f"pub-surface: the doc build failed ({' '.join(cmd)})")
    out = os.path.join(target, "doc", CRATE.replace("-", "_") + ".json")
    return load(out)


def load(path):
    with open(path) as f:
        doc = json.load(f)
    v = doc.get("format_version")
    if v not in FORMATS:
        print(f"pub-surface: rustdoc JSON format {v} is untested here; counts may be off",
              file=sys.stderr)
    return doc


def kind_of(item):
    k = next(iter(item["inner"])) if isinstance(item["inner"], dict) else item["inner"]
    return {"import": "use", "typedef": "type_alias"}.get(k, k)


def inner(item):
    return item["inner"][next(iter(item["inner"]))]


# ---------------------------------------------------------------------------------------------
# The walk from the root


class Surface:
    """Every reachable path of the crate: `paths[path] = (id, kind)`, `canon[id] = path`."""

    def __init__(self, doc):
        self.doc = doc
        self.ix = doc["index"]
        self.paths = {}  # tuple path -> (id or None, kind); the first one reached, so
        self.modules = {}  # a module that shares its path with a function is also here
        self.canon = {}  # id -> canonical tuple path
        self.kind = {}  # id -> kind (counted kinds and member kinds)
        self.parent = {}  # member id -> parent type id
        self.members = collections.defaultdict(list)  # type id -> [(name, id, kind)]
        self.order = []  # ids in the order they were first reached
        self.extern = []  # paths of re-exports of other crates' items
        self._walk()

    def get(self, i):
        return None if i is None else self.ix.get(str(i))

    def _walk(self):
        root = self.doc["root"]
        queue = collections.deque([(root, (CRATE,))])
        while queue:
            mid, mpath = queue.popleft()
            for iid in inner(self.get(mid))["items"]:
                self._module_item(iid, mpath, queue)
        # Members of types reached by an alias path answer to that path too.
        for path, (i, k) in list(self.paths.items()):
            if i is not None and path != self.canon.get(i):
                for name, mid, mk in self.members.get(i, []):
                    self.paths.setdefault(path + (name,), (mid, mk))

    def _module_item(self, iid, mpath, queue):
        it = self.get(iid)
        if it is None or it.get("crate_id", 0) != 0:
            return
        if it["visibility"] != "public":
            return
        k = kind_of(it)
        if k == "use":
            u = inner(it)
            target = self.get(u["id"])
            if u["is_glob"]:
                if target is None:
                    self.extern.append(mpath + ("*",))
                elif kind_of(target) == "module":
                    for c in inner(target)["items"]:
                        self._module_item(c, mpath, queue)
                elif kind_of(target) == "enum":
                    for v in inner(target)["variants"]:
                        self._reach(self.get(v), mpath + (self.get(v)["name"],), queue)
                return
            if target is None or target.get("crate_id", 0) != 0:
                path = mpath + (u["name"],)
                self.paths.setdefault(path, (None, "extern re-export"))
                self.extern.append(path)
                return
            self._reach(target, mpath + (u["name"],), queue)
            return
        if k in ("impl",):
            return
        self._reach(it, mpath + (it["name"],), queue)

    def _reach(self, it, path, queue):
        iid = it["id"]
        k = kind_of(it)
        if k == "proc_macro":
            k = "macro"
        self.paths.setdefault(path, (iid, k))
        if k == "module":
            self.modules.setdefault(path, iid)
        if iid in self.canon:
            return
        self.canon[iid] = path
        self.kind[iid] = k
        self.order.append(iid)
        if k == "module":
            queue.append((iid, path))
            return
        body = inner(it)
        if k in ("struct", "union"):
            kind = body.get("kind")
            fields = []
            if k == "union":
                fields = body.get("fields", [])
            elif isinstance(kind, dict) and "plain" in kind:
                fields = kind["plain"]["fields"]
            elif isinstance(kind, dict) and "tuple" in kind:
                fields = [f for f in kind["tuple"] if f is not None]
            for f in fields:
                self._member(iid, path, self.get(f), "field")
        if k == "enum":
            for v in body["variants"]:
                self._member(iid, path, self.get(v), "variant")
        if k == "trait":
            for t in body["items"]:
                self._member(iid, path, self.get(t), "trait item")
        for imp in body.get("impls", []) if k in ("struct", "enum", "union") else []:
            im = self.get(imp)
            if im is None or im.get("crate_id", 0) != 0:
                continue
            ib = inner(im)
            if ib.get("trait") is not None or ib.get("is_synthetic") or ib.get("blanket_impl"):
                continue
            for m in ib["items"]:
                mi = self.get(m)
                if mi is None or mi["visibility"] != "public":
                    continue
                mk = {"function": "method", "assoc_const": "assoc const",
                      "assoc_type": "assoc const"}.get(kind_of(mi))
                if mk:
                    self._member(iid, path, mi, mk)

    def _member(self, tid, tpath, mi, mk):
        if mi is None or mi.get("name") is None:
            return
        if mk == "field" and mi["visibility"] != "public":
            return
        mid = mi["id"]
        if mid in self.canon:
            return
        path = tpath + (mi["name"],)
        self.canon[mid] = path
        self.kind[mid] = mk
        self.parent[mid] = tid
        self.members[tid].append((mi["name"], mid, mk))
        self.paths.setdefault(path, (mid, mk))
        self.order.append(mid)

    # -----------------------------------------------------------------------------------------

    def counts(self):
        c = collections.Counter(self.kind[i] for i in self.order)
        c["extern re-export"] = len(self.extern)
        return c

    def span(self, i):
        it = self.get(i)
        s = it.get("span") if it else None
        return s["filename"] if s else None

    def home(self, i):
        """Top-level source module an item is defined in: `src/io/dcp/write.rs` -> `io`."""
        i = self.parent.get(i, i)
        f = self.span(i) or ""
        if not f.startswith("src/"):
            return "?"
        rest = f[4:]
        top = rest.split("/")[0]
        if top.endswith(".rs"):
            top = top[:-3]
        return "(root)" if top == "lib" else top


def table(s, features):
    c = s.counts()
    mods = c["module"]
    lines = [f"fsdp public surface (rustdoc JSON format {s.doc.get('format_version')}, "
             f"features: {','.join(features) or 'default'})", ""]
    rows = []
    rows.append(("reachable pub modules (not the root)", mods))
    items = 0
    for k in ITEM_KINDS[1:]:
        rows.append((f"  {k}", c[k]))
        items += c[k]
    rows.append(("items (modules + the kinds above)", items + mods))
    rows.append(("pub fields", c["field"]))
    rows.append(("pub methods (inherent impls)", c["method"]))
    rows.append(("pub assoc consts (inherent impls)", c["assoc const"]))
    total = items + mods + c["field"] + c["method"] + c["assoc const"]
    rows.append(("TOTAL", total))
    rows.append(("enum variants (apart)", c["variant"]))
    rows.append(("trait items (apart)", c["trait item"]))
    aliases = sum(1 for p, (i, k) in s.paths.items()
                  if i is not None and s.canon.get(i) != p and k in ITEM_KINDS)
    rows.append(("alias paths of items (re-exported twice)", aliases))
    w = max(len(r[0]) for r in rows)
    for name, n in rows:
        lines.append(f"{name:<{w}}  {n:>5}")
    return "\n".join(lines), total


def listing(s):
    out = []
    for i in s.order:
        out.append(f"{s.kind[i]:<12} {'::'.join(s.canon[i])}")
    for p in s.extern:
        out.append(f"{'extern re-export':<12} {'::'.join(p)}")
    for p, (i, k) in sorted(s.paths.items()):
        if i is not None and s.canon.get(i) != p and k in ITEM_KINDS:
            out.append(f"{'alias':<12} {'::'.join(p)} = {'::'.join(s.canon[i])}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Outside users: a tokenizer, `use` trees and paths


IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tokenize(text):
    """Identifiers and punctuation of Rust code (`::` is one token), without comments, strings,
    char literals, lifetimes and numbers; also the doc-comment lines (`///`, `//!`)."""
    toks, docs = [], []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            line = text[i:j]
            if (line.startswith("///") and not line.startswith("////")) or line.startswith("//!"):
                docs.append(line[3:])
            i = j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif ch == '"' or (ch in "bc" and text.startswith('"', i + 1)):
            i = skip_string(text, i + (0 if ch == '"' else 1))
        elif ch in "rb" and re.match(r"(br|r)#*\"", text[i:i + 260]):
            m = re.match(r"(br|r)(#*)\"", text[i:i + 260])
            end = text.find('"' + m.group(2), i + m.end())
            i = n if end < 0 else end + 1 + len(m.group(2))
        elif ch == "r" and text.startswith("r#", i) and IDENT.match(text, i + 2):
            m = IDENT.match(text, i + 2)
            toks.append(m.group())
            i = m.end()
        elif ch == "'" or (ch == "b" and text.startswith("'", i + 1)):
            i += 0 if ch == "'" else 1
            m = re.compile(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'").match(text, i)
            if m:
                i = m.end()  # char literal
            else:
                m = IDENT.match(text, i + 1)
                i = m.end() if m else i + 1  # lifetime or label
        elif ch.isdigit():
            m = re.compile(r"[0-9][0-9A-Za-z_]*(\.[0-9][0-9A-Za-z_]*)?").match(text, i)
            i = m.end()
        elif IDENT.match(text, i):
            m = IDENT.match(text, i)
            toks.append(m.group())
            i = m.end()
        elif text.startswith("::", i):
            toks.append("::")
            i += 2
        else:
            toks.append(ch)
            i += 1
    return toks, docs


def skip_string(text, i):
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return i


RUST_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w,\- ]*)\s*$")
NOT_RUST = {"text", "sh", "bash", "console", "python", "json", "toml", "yaml", "ini", "shell",
            "c", "cpp", "diff", "plain", "txt", "markdown", "md", "py"}


def doc_code(lines, default_rust):
    """The Rust code of the fenced blocks in markdown `lines`, hidden `# ` lines included."""
    out, inside, rust = [], None, False
    for line in lines:
        m = RUST_FENCE.match(line)
        if m and inside is None:
            inside = m.group(1)
            langs = {x.strip() for x in m.group(2).split(",") if x.strip()}
            rust = ("rust" in langs) or (default_rust and not (langs & NOT_RUST))
            continue
        if m and inside is not None and line.strip().startswith(inside[:3]):
            inside = None
            continue
        if inside is not None and rust:
            t = line.strip()
            if t == "#":
                t = ""
            elif t.startswith("# "):
                t = t[2:]
            out.append(t)
    return "\n".join(out)


def parse_use(toks, i):
    """Parses the use tree after `use` at toks[i]; returns ([(path, alias)], index after)."""
    out = []

    def tree(j, prefix):
        segs = list(prefix)
        if j < len(toks) and toks[j] == "::":
            j += 1
        while j < len(toks):
            t = toks[j]
            if t == "{":
                j += 1
                while j < len(toks) and toks[j] != "}":
                    j = tree(j, segs)
                    if j < len(toks) and toks[j] == ",":
                        j += 1
                return j + 1
            if t == "*":
                out.append((tuple(segs), "*"))
                return j + 1
            if IDENT.fullmatch(t):
                if t == "self" and len(segs) == len(prefix) and prefix:
                    alias = segs[-1]
                    if j + 2 < len(toks) and toks[j + 1] == "as":
                        alias, j = toks[j + 2], j + 2
                    out.append((tuple(segs), alias))
                    return j + 1
                segs.append(t)
                j += 1
                if j < len(toks) and toks[j] == "::":
                    j += 1
                    continue
                alias = segs[-1]
                if j + 1 < len(toks) and toks[j] == "as":
                    alias, j = toks[j + 1], j + 2
                out.append((tuple(segs), alias))
                return j
            return j + 1
        return j

    j = tree(i + 1, [])
    while j < len(toks) and toks[j] != ";":
        j += 1
    return out, j + 1


def references(toks):
    """Paths into the crate named in one file's tokens, and the identifiers after a `.` or
    before a single `:` (for members matched by name)."""
    aliases = {}  # local name -> crate path
    globs = []
    refs = set()
    for i, t in enumerate(toks):
        if t == "use" and (i == 0 or toks[i - 1] in (";", "}", "{", "pub", ")", "]")):
            trees, _ = parse_use(toks, i)
            for path, alias in trees:
                if path and path[0] in ("crate", "self", "super"):
                    continue
                if path and path[0] == CRATE:
                    if alias == "*":
                        globs.append(path)
                    else:
                        aliases[alias] = path
                        refs.add(path)
    for i, t in enumerate(toks):
        if (i > 0 and toks[i - 1] == "::") or not IDENT.fullmatch(t):
            continue
        if t == CRATE and i + 1 < len(toks) and toks[i + 1] == "::":
            base = (CRATE,)
        elif t in aliases:
            base = aliases[t]
        else:
            continue
        path = list(base)
        j = i + 1
        while j + 1 < len(toks) and toks[j] == "::" and IDENT.fullmatch(toks[j + 1]):
            path.append(toks[j + 1])
            j += 2
        refs.add(tuple(path))
    names = set()
    for i, t in enumerate(toks):
        if i > 0 and toks[i - 1] == "." and IDENT.fullmatch(t):
            names.add(t)
        if i + 1 < len(toks) and toks[i + 1] == ":" and IDENT.fullmatch(t):
            names.add(t)
    idents = {t for t in toks if IDENT.fullmatch(t)}
    return refs, globs, names, idents


USERS = [  # (label, directory or file, what is read: code, docs (doc comments) or markdown)
    ("fsdp-ckpt", "fsdp-ckpt/src", "code"),
    ("python", "python/src", "code"),
    ("examples", "examples", "code"),
    ("readme", "README.md", "markdown"),
    ("docs", "src", "docs"),
    ("tests", "tests", "code"),
    ("ckpt-tests", "fsdp-ckpt/tests", "code"),
    ("benches", "benches", "code"),
    ("fuzz", "fuzz", "code"),
]
REAL = ["fsdp-ckpt", "python", "examples", "readme", "docs"]
TESTISH = ["tests", "ckpt-tests", "benches", "fuzz"]
SHORT = {"fsdp-ckpt": "ckpt", "python": "py", "examples": "ex", "readme": "rm", "docs": "doc",
         "tests": "t",
         "ckpt-tests": "ckpt-t", "benches": "b", "fuzz": "fz"}


def user_files():
    for label, rel, how in USERS:
        p = os.path.join(ROOT, rel)
        if os.path.isfile(p):
            yield label, p, how
            continue
        for d, dirs, files in os.walk(p):
            dirs[:] = [x for x in dirs if x not in ("target", "corpus", "artifacts")]
            for f in sorted(files):
                if f.endswith(".rs"):
                    yield label, os.path.join(d, f), how


def usage(s):
    """used[id] = {user label: "path" or "name"} and files[id] = {file: "path" or "name"}, per
    reachable id."""
    used = collections.defaultdict(dict)
    files = collections.defaultdict(dict)

    def mark(i, label, rel, how):
        if how == "path":
            used[i][label] = files[i][rel] = "path"
        else:
            used[i].setdefault(label, how)
            files[i].setdefault(rel, how)
    by_name = collections.defaultdict(list)  # member name -> ids
    for i in s.order:
        if s.kind[i] in MEMBER_KINDS + EXTRA_KINDS:
            by_name[s.canon[i][-1]].append(i)
    for label, path, how in user_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if how == "markdown":
            code = doc_code(text.splitlines(), default_rust=True)
        else:
            toks, docs = tokenize(text)
            code = doc_code(docs, default_rust=True)
            if how == "code":
                code = text + "\n" + code
        toks, _ = tokenize(code)
        refs, globs, names, idents = references(toks)
        if not refs and not globs:
            continue
        rel = os.path.relpath(path, ROOT)
        for ref in refs:
            for n in range(len(ref), 1, -1):
                hit = s.paths.get(ref[:n])
                if hit and hit[0] is not None:
                    mark(hit[0], label, rel, "path")
                    if ref[:n] in s.modules:  # `nccl::probe`: the module and the function
                        mark(s.modules[ref[:n]], label, rel, "path")
                    # A path through a type (`Fsdp::new`) also uses the type.
                    if hit[0] in s.parent:
                        mark(s.parent[hit[0]], label, rel, "path")
                    # ... and a path through modules (`io::dcp::verify`) uses them.
                    for m in range(2, n):
                        if ref[:m] in s.modules:
                            mark(s.modules[ref[:m]], label, rel, "path")
                    break
        for g in globs:
            for ident in idents:
                hit = s.paths.get(g + (ident,))
                if hit and hit[0] is not None:
                    mark(hit[0], label, rel, "path")
        for name in names:
            for i in by_name.get(name, []):
                mark(i, label, rel, "name")
    return used, files


def signature_ids(node, acc):
    """Crate item ids that a JSON item body names (`resolved_path` ids)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("resolved_path", "trait") and isinstance(v, dict) and "id" in v:
                acc.add(v["id"])
            signature_ids(v, acc)
    elif isinstance(node, list):
        for v in node:
            signature_ids(v, acc)
    return acc


def exposed(s, seeds):
    """Items named in the signature, a pub field or a trait bound of one of `seeds`,
    transitively (through the items so named): making such an item `pub(crate)` changes the
    seed's signature too."""
    out = set()
    todo = [i for i in seeds if i in s.canon]
    seen = set(todo)
    while todo:
        i = todo.pop()
        it = s.get(i)
        if it is None:
            continue
        body = dict(inner(it))
        body.pop("impls", None)  # a type's trait impls are not its signature
        body.pop("implementations", None)
        ids = signature_ids(body, set())
        # The fields of an enum's variants (`Error::Io { source: IoError }`).
        for v in body.get("variants", []) if kind_of(it) == "enum" else []:
            vk = inner(s.get(v)).get("kind")
            fields = []
            if isinstance(vk, dict) and "struct" in vk:
                fields = vk["struct"]["fields"]
            elif isinstance(vk, dict) and "tuple" in vk:
                fields = [f for f in vk["tuple"] if f is not None]
            for f in fields:
                signature_ids(inner(s.get(f)), ids)
        # Fields of a struct and items of a trait come along with it.
        ids |= {mid for _, mid, mk in s.members.get(i, []) if mk in ("field", "trait item")}
        for j in ids:
            if j in s.canon and j not in seen:
                out.add(j)
                seen.add(j)
                todo.append(j)
    return out


def usage_md(s, features, base=None):
    """The usage map; `base`, the surface with default features, marks what features add."""
    used, files = usage(s)
    items = [i for i in s.order if s.kind[i] in ITEM_KINDS]
    members = [i for i in s.order if s.kind[i] in MEMBER_KINDS + EXTRA_KINDS]

    def users(i, how=None):
        u = used.get(i, {})
        return [lab for lab in REAL + TESTISH if lab in u and (how is None or u[lab] == how)]

    def cls(i):
        u = users(i)
        if any(x in REAL for x in u):
            return "a"
        return "b" if u else "c"

    def name(i):
        gated = "\u2020" if base is not None and s.canon[i] not in base.paths else ""
        call = "()" if s.kind[i] in ("method", "function") else ""
        return "::".join(s.canon[i][1:]) + call + gated

    expo_any = exposed(s, [i for i in used if cls(i) in "ab"])
    expo_real = exposed(s, [i for i in used if cls(i) == "a"])

    def star(i):
        c = cls(i)
        return "*" if (c == "b" and i in expo_real) or (c == "c" and i in expo_any) else ""

    homes = collections.OrderedDict()
    for i in sorted(items, key=lambda i: (s.home(i), s.canon[i])):
        homes.setdefault(s.home(i), []).append(i)

    feats = ",".join(features)
    out = [f"# Generated: `scripts/pub-surface.py{' --features ' + feats if feats else ''} "
           "--usage-md FILE`\n"]
    text, total = table(s, features)
    out.append("### Counts\n\n```text\n" + text + "\n```\n")
    if base is not None:
        out.append("`\u2020` marks a path that exists only with the features above (not with "
                   "the default features).\n")
    out.append("### Summary by top-level module (items; methods and fields below)\n")
    at = len(out)
    out.append("Module = the file under `src/` that defines the item; paths are the shortest "
               "from the crate root (without `fsdp::`). (a) used by fsdp-ckpt, python, examples "
               "or docs (README.md, or a doc comment's example: `(doc)` marks an item only "
               "a doc comment uses, often its own); (b) only by tests, fsdp-ckpt's tests, "
               "benches or fuzz (which, in brackets); (c) by nobody outside the crate. `*` "
               "on a (b) item: named in the signature, a pub field or a trait bound of an (a) "
               "item, directly or through other such items, so real users receive it without "
               "naming it; `*` on a (c) item: the same for any used item. Either way, making "
               "it `pub(crate)` changes that item's signature too.\n")
    agg = collections.Counter()
    for home, ids in homes.items():
        groups = {"a": [], "b": [], "c": []}
        for i in ids:
            c = cls(i)
            agg[c] += 1
            tag = " (" + ",".join(SHORT[x] for x in users(i)) + ")" if c == "b" else ""
            if c == "a" and [x for x in users(i) if x in REAL] == ["docs"]:
                tag = " (doc)"
            groups[c].append(f"`{name(i)}`{star(i)}{tag}")
        out.append(f"#### {home} ({len(ids)} items: a {len(groups['a'])}, b {len(groups['b'])}, "
                   f"c {len(groups['c'])})\n")
        for c, title in (("a", "(a) real users"), ("b", "(b) tests/benches/fuzz only"),
                         ("c", "(c) nobody outside")):
            if groups[c]:
                out.append(f"- **{title}**: " + ", ".join(groups[c]))
        out.append("")
    stars = collections.Counter(cls(i) for i in items if star(i))
    per_user = ", ".join(f"{lab} {sum(1 for i in items if lab in used.get(i, {}))}"
                         for lab in REAL + TESTISH)
    out.insert(at, f"Items: (a) {agg['a']}, (b) {agg['b']} (`*` {stars['b']}), "
                   f"(c) {agg['c']} (`*` {stars['c']}). Items each user names: {per_user}.\n")

    # Members.
    out.append("### Methods, fields, associated constants\n")
    out.append("Matched by path (`Type::name`, through `use`) or else by name (`.name`, "
               "`name:` in a file that uses the crate), which over-counts: common names (`new`, "
               "`len`) look used everywhere, so (a) and (b) are upper bounds and (c) means the "
               "name appears in no outside file at all. Enum variants and trait items are left "
               "out of these lists (see the full table). Modules with nothing in (b) or (c) are "
               "not listed.\n")
    mc = collections.Counter()
    by_home = collections.OrderedDict()
    for i in sorted(members, key=lambda i: (s.home(i), s.canon[i])):
        if s.kind[i] in EXTRA_KINDS:
            continue
        c = cls(i)
        mc[c] += 1
        by_home.setdefault(s.home(i), {"a": [], "b": [], "c": []})[c].append(i)
    out.append(f"Members: (a) {mc['a']}, (b) {mc['b']}, (c) {mc['c']}.\n")
    for home, g in by_home.items():
        if g["b"] or g["c"]:
            out.append(f"#### {home} (members: a {len(g['a'])}, b {len(g['b'])}, "
                       f"c {len(g['c'])})\n")
            if g["b"]:
                out.append("- **(b) tests/benches/fuzz only**: "
                           + ", ".join(f"`{name(i)}`" for i in g["b"]))
            if g["c"]:
                out.append("- **(c) nobody outside**: " + ", ".join(f"`{name(i)}`" for i in g["c"]))
            out.append("")

    # Collisions.
    out.append("### Name collisions among public items\n")
    out.append("Distinct items with the same last path segment: types, traits, functions, "
               "constants, and methods that share a free function's name (not modules, fields, "
               "or methods among themselves). Users: "
               + ", ".join(f"{v} = {k}" for k, v in SHORT.items())
               + ". Files: where the item is named by path; in brackets, files that only have "
               "the name after a `.` (a method call on a value of some type, so any of the "
               "same-named methods).\n")
    last = collections.defaultdict(list)
    for i in s.order:
        if s.kind[i] in ITEM_KINDS and s.kind[i] != "module":
            last[s.canon[i][-1]].append(i)
    for i in s.order:
        if s.kind[i] == "method" and s.canon[i][-1] in last:
            last[s.canon[i][-1]].append(i)
    out.append("| name | path | defined in | users | files |")
    out.append("| --- | --- | --- | --- | --- |")
    for nm in sorted(last, key=lambda n: (n[0].islower(), n)):
        ids = last[nm]
        if len(ids) < 2:
            continue
        for i in ids:
            u = ", ".join(SHORT[x] for x in users(i)) or "-"
            fp = sorted(f for f, h in files.get(i, {}).items() if h == "path")
            fn = sorted(f for f, h in files.get(i, {}).items() if h == "name")
            fl = ", ".join(fp[:6]) + (f" +{len(fp) - 6}" if len(fp) > 6 else "")
            if fn:
                fl += (" " if fl else "") + "[" + ", ".join(fn[:4]) \
                      + (f" +{len(fn) - 4}" if len(fn) > 4 else "") + "]"
            span = s.get(i)["span"]
            where = f"{span['filename']}:{span['begin'][0]}" if span else "?"
            out.append(f"| `{nm}` | `{name(i)}` ({s.kind[i]}) | {where} | {u} | {fl or '-'} |")
    out.append("")

    # Full table.
    out.append("### Every public item and its users\n")
    out.append("Users by path; for members, users that only have the name in brackets. "
               + ", ".join(f"{v} = {k}" for k, v in SHORT.items()) + ".\n")
    out.append("| path | kind | users | class |")
    out.append("| --- | --- | --- | --- |")
    for home, ids in homes.items():
        for i in ids:
            u = ", ".join(SHORT[x] for x in users(i)) or "-"
            out.append(f"| `{name(i)}` | {s.kind[i]} | {u} | {cls(i)}{star(i)} |")
            for _, mid, mk in s.members.get(i, []):
                pu = [SHORT[x] for x in users(mid, "path")]
                nu = [SHORT[x] for x in users(mid, "name")]
                us = (", ".join(pu) + (" [" + ", ".join(nu) + "]" if nu else "")).strip()
                out.append(f"| `{name(mid)}` | {mk} | {us or '-'} | {cls(mid)}{star(mid)} |")
    aliases = sorted((p, i) for p, (i, k) in s.paths.items()
                     if i is not None and s.canon.get(i) != p and k in ITEM_KINDS)
    out.append("\nAlias paths (the same item reached twice): "
               + ", ".join(f"`{'::'.join(p[1:])}` = `{name(i)}`" for p, i in aliases) + "\n")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", default="",
                    help="comma-separated features to build with (default: default features)")
    ap.add_argument("--per-feature", action="store_true",
                    help="also build with each feature alone and print what it adds")
    ap.add_argument("--json", help="read this rustdoc JSON file instead of building")
    ap.add_argument("--base-json", help="with --usage-md and --features: the default features' "
                    "rustdoc JSON, to mark what the features add (built when not given)")
    ap.add_argument("--toolchain", help="rustup toolchain for the build, e.g. nightly")
    ap.add_argument("--offline", action="store_true", help="pass --offline to cargo")
    ap.add_argument("--list", action="store_true", help="print every reachable path")
    ap.add_argument("--usage-md", metavar="FILE", help="write the usage map as markdown")
    ap.add_argument("--why", metavar="PATH", action="append", default=[],
                    help="print the outside files that name PATH (e.g. fsdp::io::dcp::verify)")
    ap.add_argument("-q", "--quiet", action="store_true", help="hide cargo's output")
    a = ap.parse_args()

    features = [f for f in a.features.split(",") if f]
    for f in features:
        if f not in FEATURES:
            sys.exit(f"pub-surface: unknown feature {f} (known: {', '.join(FEATURES)})")
    s = Surface(load(a.json) if a.json else build_json(features, a.toolchain, a.offline, a.quiet))
    text, _ = table(s, features)
    print(text)
    if a.list:
        print()
        print(listing(s))
    if a.per_feature:
        print()
        base = set(s.paths)
        basec = s.counts()
        for f in FEATURES:
            if f in features:
                continue
            fs = Surface(build_json(sorted(set(features) | {f}), a.toolchain, a.offline, a.quiet))
            fc = fs.counts()
            added = sorted(set(fs.paths) - base)
            _, tot = table(fs, features + [f])
            delta = {k: fc[k] - basec[k] for k in ITEM_KINDS + MEMBER_KINDS if fc[k] != basec[k]}
            print(f"+{f}: total {tot} ("
                  + ", ".join(f"{k} {v:+d}" for k, v in delta.items()) + ")")
            if a.list:
                for p in added:
                    print(f"    {fs.paths[p][1]:<12} {'::'.join(p)}")
    if a.why:
        _, files = usage(s)
        for q in a.why:
            hit = s.paths.get(tuple(q.split("::")))
            if hit is None:
                print(f"{q}: not a public path")
                continue
            print(f"{q} ({hit[1]}):")
            for f, how in sorted(files.get(hit[0], {}).items()):
                print(f"    {f}" + ("  (by name)" if how == "name" else ""))
    if a.usage_md:
        base = None
        if features:
            base = Surface(load(a.base_json) if a.base_json
                           else build_json([], a.toolchain, a.offline, a.quiet))
        with open(a.usage_md, "w") as f:
            f.write(usage_md(s, features, base))
        print(f"\nwrote {a.usage_md}", file=sys.stderr)


if __name__ == "__main__":
    main()
