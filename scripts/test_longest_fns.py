#!/usr/bin/env python3
"""Checks scripts/longest-fns.py on Rust text whose strings, chars and comments hold braces
(run by .ci/run before the length check itself)."""
import importlib.util
import os
import sys
import tempfile

spec = importlib.util.spec_from_file_location(
    "longest_fns", os.path.join(os.path.dirname(__file__), "longest-fns.py"))
lf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lf)

SOURCE = r'''
/// A doc comment with an open brace {
fn braces_in_literals() -> usize {
    let a = "{ {";
    let b = r#"}" { "#;
    let c = '{';
    let d = b'}';
    let e = '\'';
    /* a block { /* nested } */ still comment { */
    // a line comment }
    a.len() + b.len() + c.len_utf8() + d as usize + e.len_utf8()
}

fn with_lifetime<'a>(x: &'a str) -> &'a str {
    if x.is_empty() { "{" } else { x }
}

#[cfg(test)]
mod tests {
    fn skipped() {}
}

fn declared_in_trait();

fn last() {}
'''

with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "x.rs")
    with open(path, "w") as f:
        f.write(SOURCE)
    got = {where.split()[-1]: n for n, where in lf.functions(path)}
want = {"braces_in_literals": 10, "with_lifetime": 3, "last": 1}
if got != want:
    print(f"longest-fns.py counted {got}, expected {want}", file=sys.stderr)
    sys.exit(1)
print("longest-fns.py counts braces in code only")
