//! Tied word embeddings: which tensor `transformers` ties to which when a model's
//! `config.json` says `tie_word_embeddings`, by the architecture it names. Each architecture
//! ties its own output embedding to its own input embedding (the class's
//! `_tied_weights_keys`: GPT-2's `lm_head.weight` is `transformer.wte.weight`, Llama's is
//! `model.embed_tokens.weight`); `save_pretrained` leaves the output out and `from_pretrained`
//! ties it back. The facts are one table, `tied_embeddings.txt` beside this file, which a user
//! reads and extends; an architecture outside it that ties is refused by name, so that a tie is
//! never guessed from names.

use crate::error::{Error, Result};
use std::path::Path;

/// The table: `architecture output input tied-by-default` rows, `#` comments.
const TABLE: &str = include_str!("tied_embeddings.txt");

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiedEmbedding {
    /// The class named by `config.json`'s `architectures` (`GPT2LMHeadModel`).
    pub architecture: &'static str,
    /// The output embedding `save_pretrained` leaves out (`lm_head.weight`).
    pub output: &'static str,
    /// The input embedding it is tied to (`transformer.wte.weight`).
    pub input: &'static str,
    /// Whether the architecture ties when its config leaves `tie_word_embeddings` out (its
    /// config class's default).
    pub tied_by_default: bool,
}

/// Every row of the table, in its order.
pub fn tied_embeddings() -> Result<Vec<TiedEmbedding>> {
    TABLE
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default())
        .filter(|l| !l.trim().is_empty())
        .map(
            |line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                [architecture, output, input, default @ ("true" | "false")] => Ok(TiedEmbedding {
                    architecture,
                    output,
                    input,
                    tied_by_default: default == "true",
                }),
                _ => Err(Error::Internal(format!(
                    "tied_embeddings.txt: malformed row `{line}`"
                ))),
            },
        )
        .collect()
}

/// What a model's `config.json` says of its word embeddings.
#[derive(Debug, Clone)]
pub(crate) struct WordEmbeddingTie {
    file: String,
    /// `tie_word_embeddings` as written; `None` when the config leaves it out.
    tie_word_embeddings: Option<bool>,
    architectures: Vec<String>,
}

impl WordEmbeddingTie {
    /// Reads `tie_word_embeddings` and `architectures` from `config` (read from `file`).
    pub(crate) fn of(config: &serde_json::Value, file: &Path) -> Result<Self> {
        // transformers' configurations are strict dataclasses: a field of the wrong type (a
        // null too) is refused there ("Field 'tie_word_embeddings' expected bool"), so it is
        // here.
        let tie_word_embeddings = match config.get("tie_word_embeddings") {
            None => None,
            Some(serde_json::Value::Bool(b)) => Some(*b),
            Some(other) => {
                return Err(Error::HfModelDir {
                    file: file.display().to_string(),
                    key: None,
                    reason: format!(
                        "`tie_word_embeddings` is {} ({}), but transformers expects a bool (true or false) and refuses this configuration",
                        crate::error::shown(&other.to_string()),
                        json_kind(other)
                    ),
                })
            }
        };
        let architectures = config
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| {
                a.iter()
                    .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        Ok(WordEmbeddingTie {
            file: file.display().to_string(),
            tie_word_embeddings,
            architectures,
        })
    }

    /// The ties `(output, input)` `transformers` applies to this model: none when the config
    /// does not tie (`tie_word_embeddings` false, or left out by an architecture that does not
    /// tie by default), else each named architecture's row. A tying config whose architecture
    /// is not in the table is refused ([`Error::HfTieArchitecture`]) unless `explicit` (the user
    /// named the ties with `--tie`): equal tensors are no proof of a tie, so none is guessed.
    pub(crate) fn ties(&self, explicit: bool) -> Result<Vec<(String, String)>> {
        let table = tied_embeddings()?;
        let rows: Vec<Option<&TiedEmbedding>> = self
            .architectures
            .iter()
            .map(|a| table.iter().find(|r| r.architecture == a))
            .collect();
        let tied = self
            .tie_word_embeddings
            .unwrap_or_else(|| rows.iter().flatten().any(|r| r.tied_by_default));
        if !tied {
            return Ok(Vec::new());
        }
        if (rows.is_empty() || rows.iter().any(Option::is_none)) && !explicit {
            return Err(Error::HfTieArchitecture {
                config: self.file.clone(),
                architectures: self.architectures.clone(),
                known: table.iter().map(|r| r.architecture.to_string()).collect(),
            });
        }
        let mut out: Vec<(String, String)> = Vec::new();
        for r in rows.into_iter().flatten() {
            let tie = (r.output.to_string(), r.input.to_string());
            if !out.contains(&tie) {
                out.push(tie);
            }
        }
        Ok(out)
    }
}

/// The kind of a JSON value, for messages.
pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "a JSON null",
        serde_json::Value::Bool(_) => "a JSON bool",
        serde_json::Value::Number(_) => "a JSON number",
        serde_json::Value::String(_) => "a JSON string",
        serde_json::Value::Array(_) => "a JSON array",
        serde_json::Value::Object(_) => "a JSON object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ties(config: &str, explicit: bool) -> Result<Vec<(String, String)>> {
        let json: serde_json::Value = serde_json::from_str(config).unwrap();
        WordEmbeddingTie::of(&json, Path::new("config.json"))?.ties(explicit)
    }

    fn tie(output: &str, input: &str) -> Vec<(String, String)> {
        vec![(output.into(), input.into())]
    }

    #[test]
    fn the_table_parses_and_names_each_architecture_once() {
        let rows = tied_embeddings().unwrap();
        assert_eq!(rows.len(), 8);
        let mut names: Vec<_> = rows.iter().map(|r| r.architecture).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), rows.len());
        assert!(rows.iter().all(|r| r.output == "lm_head.weight"));
    }

    #[test]
    fn each_architecture_ties_its_own_names_and_defaults() {
        let gpt2 = tie("lm_head.weight", "transformer.wte.weight");
        let on = r#"{"architectures": ["GPT2LMHeadModel"], "tie_word_embeddings": true}"#;
        assert_eq!(ties(on, false).unwrap(), gpt2);
        // Left out: GPT-2's config class ties by default, GPT-NeoX's and Llama's do not.
        assert_eq!(
            ties(r#"{"architectures": ["GPT2LMHeadModel"]}"#, false).unwrap(),
            gpt2
        );
        for arch in ["GPTNeoXForCausalLM", "LlamaForCausalLM"] {
            let cfg = format!(r#"{{"architectures": ["{arch}"]}}"#);
            assert_eq!(ties(&cfg, false).unwrap(), vec![]);
        }
        let off = r#"{"architectures": ["GPT2LMHeadModel"], "tie_word_embeddings": false}"#;
        assert_eq!(ties(off, false).unwrap(), vec![]);
        let neox = r#"{"architectures": ["GPTNeoXForCausalLM"], "tie_word_embeddings": true}"#;
        assert_eq!(
            ties(neox, false).unwrap(),
            tie("lm_head.weight", "gpt_neox.embed_in.weight")
        );
    }

    #[test]
    fn an_unknown_tying_architecture_is_refused_unless_ties_are_named() {
        for cfg in [
            r#"{"architectures": ["MyForCausalLM"], "tie_word_embeddings": true}"#,
            r#"{"tie_word_embeddings": true}"#,
        ] {
            match ties(cfg, false).unwrap_err() {
                e @ Error::HfTieArchitecture { .. } => {
                    let text = e.to_string();
                    assert!(text.contains("--tie"), "{text}");
                    assert!(text.contains("GPT2LMHeadModel"), "{text}");
                }
                e => panic!("{e}"),
            }
            assert_eq!(ties(cfg, true).unwrap(), vec![]);
        }
        // Not tied: nothing to know.
        let untied = r#"{"architectures": ["MyForCausalLM"], "tie_word_embeddings": false}"#;
        assert_eq!(ties(untied, false).unwrap(), vec![]);
        assert_eq!(
            ties(r#"{"architectures": ["MyForCausalLM"]}"#, false).unwrap(),
            vec![]
        );
        assert!(matches!(
            ties(r#"{"tie_word_embeddings": "yes"}"#, false),
            Err(Error::HfModelDir { .. })
        ));
    }
}
