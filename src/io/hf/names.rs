//! Which tensors of a checkpoint make the model, and their names in a Hugging Face model
//! directory: the subtree chosen by a prefix, then user renames (regexes, in order).

use crate::error::{Error, Result};
use crate::io::torch_save::PyObj;
use crate::tensor::HostTensor;
use std::collections::HashMap;
use std::path::Path;

/// The subtree `get_state_dict` / `dcp.save({"model": …, "optim": …})` keeps a model in.
pub const MODEL_PREFIX: &str = "model.";
/// The subtree it keeps the optimizer state in, never exported.
pub const OPTIM_PREFIX: &str = "optim.";

/// The top-level entries of a training checkpoint that hold training state, never model
/// weights: `get_state_dict`'s `optim`, and torchtitan's `optimizer` (its
/// `get_optimizer_state_dict(…, flatten_optimizer_state_dict=True)`), `lr_scheduler`,
/// `dataloader` and `train_state`. No tensor under one of them is ever exported as a weight,
/// whatever `--prefix` says.
pub const STATE_ROOTS: [&str; 5] = [
    "optim",
    "optimizer",
    "lr_scheduler",
    "dataloader",
    "train_state",
];

/// The state roots torchtitan saves beside its model keys, which sit at the top level
/// (`CheckpointManager._flattened_model_states_sd`).
const TORCHTITAN_ROOTS: [&str; 4] = ["optimizer", "lr_scheduler", "dataloader", "train_state"];

/// How many names an error lists before it says how many more there are.
const LISTED: usize = 8;

/// Where a checkpoint keeps its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// Under `model.` (`dcp.save({"model": msd, …})`), or wherever `--prefix` says.
    Subtree,
    /// At the top level beside torchtitan's training state ([`TORCHTITAN_ROOTS`]).
    Torchtitan,
}

impl Layout {
    /// The layout of a checkpoint whose object is `obj` and whose flattened tensor keys are
    /// `keys`: torchtitan's when a tensor lies under one of its state roots and the top level
    /// has no `model` entry holding a dict (`{"model": msd, "optimizer": osd}` keeps its model
    /// in the `model.` subtree; torchtitan's `model.`-named keys are top-level keys).
    pub(crate) fn of(obj: &PyObj, keys: &[String]) -> Layout {
        let nested_model = obj.get("model").is_some_and(|m| m.dict_items().is_some());
        let torchtitan_state = keys
            .iter()
            .any(|k| TORCHTITAN_ROOTS.iter().any(|r| under(k, r)));
        if torchtitan_state && !nested_model {
            Layout::Torchtitan
        } else {
            Layout::Subtree
        }
    }
}

/// Whether `key` lies under the top-level entry `root`.
fn under(key: &str, root: &str) -> bool {
    key.strip_prefix(root).is_some_and(|r| r.starts_with('.'))
}

/// The state root `key` lies under, if any ([`STATE_ROOTS`]).
fn state_root(key: &str) -> Option<&'static str> {
    STATE_ROOTS.into_iter().find(|r| under(key, r))
}

/// The tensors of `keys` (flattened checkpoint keys, in order) that make the model, with
/// their names once `prefix` is stripped. By default (`None`): a torchtitan checkpoint's
/// top-level keys ([`Layout::Torchtitan`]), names as saved; otherwise the `model.` subtree,
/// refused when tensors lie outside both `model.` and the state roots (they would be lost
/// silently). `Some("")`: every tensor outside the state roots. `Some(p)`: the subtree `p` (a
/// trailing `.` is implied), refused when `p` is training state. Tensors under a state root
/// ([`STATE_ROOTS`]) are never picked. Returns (index into `keys`, name). An empty selection
/// is an error naming what the input holds.
pub(crate) fn select(
    input: &Path,
    keys: &[String],
    prefix: Option<&str>,
    layout: Layout,
) -> Result<Vec<(usize, String)>> {
    let refuse = |reason: String| Error::HfSelection {
        input: input.display().to_string(),
        reason,
    };
    let outside_state = || {
        keys.iter()
            .enumerate()
            .filter(|(_, k)| state_root(k).is_none())
            .map(|(i, k)| (i, k.clone()))
            .collect()
    };
    let picked: Vec<(usize, String)> = match prefix {
        None if layout == Layout::Torchtitan => outside_state(),
        None => {
            let outside: Vec<&str> = keys
                .iter()
                .filter(|k| !k.starts_with(MODEL_PREFIX) && state_root(k).is_none())
                .map(String::as_str)
                .collect();
            if !outside.is_empty() {
                return Err(refuse(format!(
                    "{} tensor(s) lie outside both `model.` and the training state ({}): {}; \
                     exporting only `model.` would lose them. Pass --prefix '' to export every \
                     tensor outside the training state (for example a checkpoint saved with \
                     the model's keys at the top level and no optimizer), or --prefix P to \
                     export the subtree P",
                    outside.len(),
                    roots_listed(),
                    listed(&outside)
                )));
            }
            strip(keys, MODEL_PREFIX)
        }
        Some("") => outside_state(),
        Some(p) => {
            let p = if p.ends_with('.') {
                p.to_string()
            } else {
                format!("{p}.")
            };
            if let Some(root) = STATE_ROOTS
                .into_iter()
                .find(|r| p.starts_with(&format!("{r}.")))
            {
                return Err(refuse(format!(
                    "--prefix {p} lies in `{root}.`, which holds training state ({}), never model weights",
                    roots_listed()
                )));
            }
            strip(keys, &p)
        }
    };
    if picked.is_empty() {
        let held: Vec<&str> = keys.iter().map(String::as_str).collect();
        let what = match prefix {
            None if layout == Layout::Torchtitan => {
                "no tensor outside torchtitan's training state".to_string()
            }
            None => "no tensor under `model.`".to_string(),
            Some("") => "no tensor outside the training state".to_string(),
            Some(p) => format!("no tensor under `{p}`"),
        };
        return Err(refuse(if held.is_empty() {
            format!("{what}: it holds no tensors at all (an optimizer-only checkpoint has no model to export)")
        } else {
            format!("{what}; its tensors are {}", listed(&held))
        }));
    }
    Ok(picked)
}

/// The state roots as an error lists them.
fn roots_listed() -> String {
    STATE_ROOTS
        .iter()
        .map(|r| format!("`{r}.`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The keys under `prefix`, with it stripped.
fn strip(keys: &[String], prefix: &str) -> Vec<(usize, String)> {
    keys.iter()
        .enumerate()
        .filter_map(|(i, k)| Some((i, k.strip_prefix(prefix)?.to_string())))
        .filter(|(_, k)| !k.is_empty())
        .collect()
}

/// The first few of `names`, quoted, and how many more.
pub(crate) fn listed(names: &[&str]) -> String {
    let mut s: Vec<String> = names
        .iter()
        .take(LISTED)
        .map(|n| format!("`{n}`"))
        .collect();
    if names.len() > LISTED {
        s.push(format!("and {} more", names.len() - LISTED));
    }
    s.join(", ")
}

/// The tensors of a (nested) state dict by their flattened keys, in order: dict keys joined
/// by `.` as DCP's `flatten_state_dict` joins them (list items by their index), so that a
/// `.pt` holding `{"model": {...}}` and the DCP directory of the same dict give the same keys.
pub(crate) fn flatten(obj: &PyObj) -> Vec<(String, HostTensor)> {
    fn walk(o: &PyObj, path: &str, out: &mut Vec<(String, HostTensor)>) {
        let join = |seg: String| {
            if path.is_empty() {
                seg
            } else {
                format!("{path}.{seg}")
            }
        };
        match o {
            PyObj::Tensor(t) => out.push((path.to_string(), t.clone())),
            PyObj::Dict(items) | PyObj::OrderedDict { items, .. } => {
                for (k, v) in items {
                    let seg = match k {
                        PyObj::Str(s) => s.clone(),
                        PyObj::Int(i) => i.to_string(),
                        _ => continue,
                    };
                    walk(v, &join(seg), out);
                }
            }
            PyObj::List(items) | PyObj::Tuple(items) => {
                for (i, v) in items.iter().enumerate() {
                    walk(v, &join(i.to_string()), out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(obj, "", &mut out);
    out
}

/// One key rename: a regular expression and its replacement, applied to every match
/// (Python's `re.sub`). The replacement names groups as `$1` / `${name}`, or as Python
/// writes them, `\1` / `\g<name>`.
#[derive(Debug, Clone)]
pub struct Rename {
    pattern: regex::Regex,
    replacement: String,
    rule: String,
}

impl Rename {
    /// The rule `FROM=TO` (split at the first `=`).
    pub fn parse(rule: &str) -> Result<Rename> {
        let (from, to) = rule.split_once('=').ok_or_else(|| Error::HfRename {
            rule: rule.into(),
            reason: "expected FROM=TO (a regular expression, `=`, its replacement)".into(),
        })?;
        Rename::new(from, to)
    }

    /// The rule replacing matches of `from` by `to`.
    pub fn new(from: &str, to: &str) -> Result<Rename> {
        let rule = format!("{from}={to}");
        let pattern = regex::Regex::new(from).map_err(|e| Error::HfRename {
            rule: rule.clone(),
            reason: format!("not a regular expression: {e}"),
        })?;
        let replacement = python_groups(to);
        if let Some(reason) = unknown_group(&pattern, &replacement) {
            return Err(Error::HfRename { rule, reason });
        }
        Ok(Rename {
            pattern,
            replacement,
            rule,
        })
    }

    /// The rules of a JSON file: an object `{"FROM": "TO", …}` (applied in the file's
    /// order) or a list of `["FROM", "TO"]` pairs.
    pub fn from_json_file(path: &Path) -> Result<Vec<Rename>> {
        let bytes = crate::storage::read_small_file(path)?;
        let bad = |reason: String| Error::HfRename {
            rule: path.display().to_string(),
            reason,
        };
        let pairs: Vec<(String, String)> = match serde_json::from_slice::<OrderedPairs>(&bytes) {
            Ok(OrderedPairs(p)) => p,
            Err(_) => serde_json::from_slice::<Vec<(String, String)>>(&bytes).map_err(|e| {
                bad(format!(
                    "expected a JSON object {{\"FROM\": \"TO\", …}} or a list of [\"FROM\", \"TO\"] pairs: {e}"
                ))
            })?,
        };
        pairs.iter().map(|(f, t)| Rename::new(f, t)).collect()
    }

    /// `name` with this rule applied.
    pub fn apply(&self, name: &str) -> String {
        self.pattern
            .replace_all(name, self.replacement.as_str())
            .into_owned()
    }

    /// The rule as written (`FROM=TO`).
    pub fn rule(&self) -> &str {
        &self.rule
    }
}

/// A JSON object's pairs in the file's order.
struct OrderedPairs(Vec<(String, String)>);

impl<'de> serde::Deserialize<'de> for OrderedPairs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OrderedPairs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of strings")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<OrderedPairs, A::Error> {
                let mut v = Vec::new();
                while let Some(pair) = map.next_entry::<String, String>()? {
                    v.push(pair);
                }
                Ok(OrderedPairs(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// A replacement with Python's group references (`\1`, `\g<name>`) written as the `regex`
/// crate's (`${1}`, `${name}`).
fn python_groups(to: &str) -> String {
    let mut out = String::with_capacity(to.len());
    let mut chars = to.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('\\', Some(d)) if d.is_ascii_digit() => {
                let mut n = String::new();
                while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                    n.push(*d);
                    chars.next();
                }
                out.push_str(&format!("${{{n}}}"));
            }
            ('\\', Some('g')) => {
                let rest: String = chars.clone().collect();
                match rest.strip_prefix("g<").and_then(|r| r.split_once('>')) {
                    Some((name, _)) => {
                        out.push_str(&format!("${{{name}}}"));
                        for _ in 0..name.chars().count() + 3 {
                            chars.next();
                        }
                    }
                    None => out.push(c),
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// Why the replacement `to` (the `regex` crate's syntax: `$1`, `${1}`, `$name`, `${name}`,
/// `$$` for a dollar) refers to a group `pattern` does not have, if it does: the `regex`
/// crate would put nothing there, while Python's `re.sub` refuses it ("invalid group
/// reference", "unknown group name").
fn unknown_group(pattern: &regex::Regex, to: &str) -> Option<String> {
    let groups = pattern.captures_len() - 1;
    let mut rest = to;
    while let Some(at) = rest.find('$') {
        rest = &rest[at + 1..];
        if let Some(after) = rest.strip_prefix('$') {
            rest = after;
            continue;
        }
        let (name, braced) = match rest.strip_prefix('{').and_then(|r| r.split_once('}')) {
            Some((name, after)) => {
                rest = after;
                (name, true)
            }
            None => {
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                let name = &rest[..end];
                rest = &rest[end..];
                (name, false)
            }
        };
        if name.is_empty() {
            continue;
        }
        if let Ok(n) = name.parse::<usize>() {
            if n > groups {
                return Some(format!(
                    "the replacement refers to group {n}, but the pattern has {groups} group{} (Python's re.sub refuses it: invalid group reference {n})",
                    if groups == 1 { "" } else { "s" }
                ));
            }
        } else if !pattern.capture_names().flatten().any(|g| g == name) {
            let digits = name.len() - name.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let hint = if !braced && digits > 0 {
                format!(
                    "; to follow group {} with `{}`, write `${{{}}}{}`",
                    &name[..digits],
                    &name[digits..],
                    &name[..digits],
                    &name[digits..]
                )
            } else {
                String::new()
            };
            return Some(format!(
                "the replacement refers to the group `{}`, which the pattern does not name (Python's re.sub refuses it: unknown group name){hint}",
                crate::error::shown(name)
            ));
        }
    }
    None
}

/// [`rename_all`] of names that are distinct already (a model directory's): without rules
/// they are given back as they are, not copied, and not compared again.
pub(crate) fn renamed_distinct(rules: &[Rename], names: Vec<String>) -> Result<Vec<String>> {
    if !rules.is_empty() || names.iter().any(String::is_empty) {
        return rename_all(rules, &names);
    }
    Ok(names)
}

/// `names` with every rule applied in order; two names that end up equal are an error
/// naming both.
pub(crate) fn rename_all(rules: &[Rename], names: &[String]) -> Result<Vec<String>> {
    let renamed: Vec<String> = names
        .iter()
        .map(|n| rules.iter().fold(n.clone(), |n, r| r.apply(&n)))
        .collect();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, n) in renamed.iter().enumerate() {
        if let Some(&first) = seen.get(n.as_str()) {
            return Err(Error::HfNameCollision {
                name: n.clone(),
                first: names[first].clone(),
                second: names[i].clone(),
            });
        }
        if n.is_empty() {
            return Err(Error::HfRename {
                rule: rules.iter().map(Rename::rule).collect::<Vec<_>>().join(" "),
                reason: format!("`{}` is renamed to the empty string", names[i]),
            });
        }
        seen.insert(n, i);
    }
    Ok(renamed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &[&str]) -> Vec<String> {
        k.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_default_takes_the_model_subtree_and_refuses_tensors_outside_model_and_optim() {
        let k = keys(&["model.a", "optim.state.a.exp_avg", "model.b"]);
        let got = select(Path::new("x"), &k, None, Layout::Subtree).unwrap();
        assert_eq!(got, [(0, "a".to_string()), (2, "b".to_string())]);

        // A raw HF state dict saved to DCP: its own `model.` subtree next to `lm_head.weight`.
        let k = keys(&["model.embed_tokens.weight", "lm_head.weight"]);
        let err = select(Path::new("x"), &k, None, Layout::Subtree)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`lm_head.weight`") && err.contains("--prefix ''"),
            "{err}"
        );
        let all = select(Path::new("x"), &k, Some(""), Layout::Subtree).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].1, "model.embed_tokens.weight");
    }

    #[test]
    fn a_prefix_names_a_subtree_and_an_empty_selection_is_an_error() {
        let k = keys(&["student.w", "teacher.w", "studentx.w"]);
        let got = select(Path::new("x"), &k, Some("student"), Layout::Subtree).unwrap();
        assert_eq!(got, [(0, "w".to_string())]);
        let err = select(
            Path::new("x"),
            &keys(&["optim.state.w.step"]),
            None,
            Layout::Subtree,
        )
        .unwrap_err();
        assert!(matches!(err, Error::HfSelection { .. }), "{err}");
    }

    #[test]
    fn torchtitan_keeps_its_model_at_the_top_level_and_its_state_is_never_picked() {
        let k = keys(&[
            "optimizer.state.model.w.exp_avg",
            "optimizer.state.model.w.step",
            "train_state.step",
            "lr_scheduler.last_epoch",
            "dataloader.world_size",
            "model.w",
            "output.weight",
        ]);
        let flat = PyObj::Dict(vec![(PyObj::Str("model.w".into()), PyObj::None)]);
        assert_eq!(Layout::of(&flat, &k), Layout::Torchtitan);
        let want = [(5, "model.w".to_string()), (6, "output.weight".to_string())];
        assert_eq!(
            select(Path::new("x"), &k, None, Layout::Torchtitan).unwrap(),
            want
        );
        // `--prefix ''`, the old advice, picks the same: no state entry is a weight.
        for layout in [Layout::Torchtitan, Layout::Subtree] {
            assert_eq!(select(Path::new("x"), &k, Some(""), layout).unwrap(), want);
        }
        // A prefix inside the training state is refused, naming it.
        for p in ["optimizer", "optim.state", "train_state."] {
            let err = select(Path::new("x"), &k, Some(p), Layout::Torchtitan).unwrap_err();
            assert!(
                matches!(&err, Error::HfSelection { reason, .. } if reason.contains("training state")),
                "{err}"
            );
        }
        // `{"model": msd, "optimizer": osd}`: the model is the nested `model` dict.
        let nested = PyObj::Dict(vec![(PyObj::Str("model".into()), PyObj::Dict(vec![]))]);
        let k = keys(&["model.w", "optimizer.state.w.exp_avg"]);
        assert_eq!(Layout::of(&nested, &k), Layout::Subtree);
        assert_eq!(
            select(Path::new("x"), &k, None, Layout::Subtree).unwrap(),
            [(0, "w".to_string())]
        );
    }

    #[test]
    fn renames_apply_in_order_with_python_or_rust_group_syntax() {
        let rules = [
            Rename::parse(r"^layers\.(\d+)\.attention\.wq=model.layers.\1.self_attn.q_proj")
                .unwrap(),
            Rename::parse(r"^tok_embeddings=model.embed_tokens").unwrap(),
            Rename::parse(r"^output\.(?P<rest>.*)=lm_head.${rest}").unwrap(),
        ];
        let got = rename_all(
            &rules,
            &keys(&[
                "layers.3.attention.wq.weight",
                "tok_embeddings.weight",
                "output.weight",
            ]),
        )
        .unwrap();
        assert_eq!(
            got,
            [
                "model.layers.3.self_attn.q_proj.weight",
                "model.embed_tokens.weight",
                "lm_head.weight"
            ]
        );
        assert_eq!(python_groups(r"a\g<x>b\12"), "a${x}b${12}");
    }

    #[test]
    fn two_keys_renamed_to_one_name_are_refused_by_name() {
        let rules = [Rename::parse(r"\.(wq|wk)\.=.qk.").unwrap()];
        let err = rename_all(&rules, &keys(&["l.wq.weight", "l.wk.weight"])).unwrap_err();
        match err {
            Error::HfNameCollision {
                name,
                first,
                second,
            } => {
                assert_eq!(
                    (name.as_str(), first.as_str(), second.as_str()),
                    ("l.qk.weight", "l.wq.weight", "l.wk.weight")
                );
            }
            e => panic!("{e}"),
        }
        assert!(Rename::parse("no-equals").is_err());
        for (rule, needle) in [
            ("(a)=$9", "group 9, but the pattern has 1 group"),
            (r"(a)=\9", "group 9, but the pattern has 1 group"),
            ("a=${1}", "group 1, but the pattern has 0 groups"),
            ("(?P<x>a)=${y}", "the group `y`"),
            (r"(?P<x>a)=\g<y>", "the group `y`"),
            ("(a)=$1b", "write `${1}b`"),
        ] {
            let e = Rename::parse(rule).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains(rule), "{rule}: {e}");
        }
        for rule in [
            "(a)=$1",
            "(a)=${1}b",
            "(?P<x>a)=$x",
            "a=$$9",
            "a=$",
            "(a)=\\1",
        ] {
            Rename::parse(rule).unwrap_or_else(|e| panic!("{rule}: {e}"));
        }
        assert!(Rename::parse("(unclosed=x").is_err());
    }
}
