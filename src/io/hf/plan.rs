//! A Hugging Face model directory planned before any byte moves: which file each tensor goes
//! to (huggingface_hub's split, or the file plan a DCP directory in Hugging Face storage
//! implies), each file's header, and the index.

use super::{single_or_sharded_name, INDEX_FILE};
use crate::error::{Error, Result};
use crate::io::safetensors::header::{self, Entry};
use crate::tensor::DType;
use std::collections::BTreeMap;

/// The default `max_shard_size` of `save_pretrained` in transformers 5: 50 GB (decimal).
pub const DEFAULT_MAX_SHARD_SIZE: u64 = 50_000_000_000;

/// The largest shard size accepted: 2^63−1 bytes (a file length is a signed 64-bit offset).
const MAX_SHARD_BYTES: u64 = i64::MAX as u64;

/// A shard size as `save_pretrained(max_shard_size=...)` reads it (huggingface_hub's
/// `parse_size_to_int`): a number (decimals allowed) and a decimal unit `KB`, `MB`, `GB`,
/// `TB` (case-insensitive, `int(value * unit)`), or a binary unit `KiB`, `MiB`, `GiB`, `TiB`
/// (which huggingface_hub does not accept), or a plain number of bytes.
pub fn parse_shard_size(s: &str) -> Result<u64> {
    let bad = |reason: String| Error::InvalidArgument {
        op: format!("--max-shard-size {s}"),
        rank: 0,
        reason,
    };
    let t = s.trim();
    const UNITS: [(&str, f64); 8] = [
        ("KIB", 1024.0),
        ("MIB", 1024.0 * 1024.0),
        ("GIB", 1024.0 * 1024.0 * 1024.0),
        ("TIB", 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("KB", 1e3),
        ("MB", 1e6),
        ("GB", 1e9),
        ("TB", 1e12),
    ];
    let upper = t.to_ascii_uppercase();
    let (number, unit) = UNITS
        .iter()
        .find(|(u, _)| upper.ends_with(u))
        .map(|(u, m)| (&t[..t.len() - u.len()], *m))
        .unwrap_or((t, 1.0));
    let number = number.trim();
    let range = format!(
        "the size must be a finite number of bytes from 1 to 2^63−1 ({})",
        i64::MAX
    );
    // A plain number of bytes is taken exactly.
    if unit == 1.0 && !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()) {
        return match number.parse::<u64>() {
            Ok(n @ 1..=MAX_SHARD_BYTES) => Ok(n),
            Ok(0) => Err(bad(format!("`{t}` is less than one byte; {range}"))),
            _ => Err(bad(format!("`{t}` is more than 2^63−1 bytes; {range}"))),
        };
    }
    let value: f64 = number.parse().map_err(|_| {
        bad("expected a size such as `50GB`, `60KB`, `1.5GB`, `512MiB` or a number of bytes".into())
    })?;
    let bytes = value * unit;
    let what = if !bytes.is_finite() {
        "not a finite number"
    } else if bytes < 1.0 {
        "less than one byte"
    } else if bytes >= 9_223_372_036_854_775_808.0 {
        "more than 2^63−1 bytes"
    } else {
        // In range: below 2^63, so the conversion is exact to the byte it truncates to.
        return Ok(bytes as u64);
    };
    Err(bad(format!("`{t}` is {what}; {range}")))
}

/// One tensor of the output: its name in the model directory, where its bytes come from
/// (`source`, an index the caller keeps), its dtype there and in the source, and its shape.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct PlannedTensor {
    pub name: String,
    pub source: usize,
    pub from: DType,
    pub to: DType,
    pub shape: Vec<usize>,
}

impl PlannedTensor {
    /// Its bytes in the output.
    pub(crate) fn nbytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.to.size() as u64
    }
}

/// One output file: its name, its header bytes, and its tensors in data order.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct PlannedFile {
    pub name: String,
    pub header: Vec<u8>,
    pub tensors: Vec<PlannedTensor>,
}

impl PlannedFile {
    /// The file's length.
    pub(crate) fn len(&self) -> u64 {
        self.header.len() as u64 + self.tensors.iter().map(PlannedTensor::nbytes).sum::<u64>()
    }
}

/// The whole model directory: its files in order, and what the index records.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct DirPlan {
    pub files: Vec<PlannedFile>,
    /// Whether the directory has an index.
    pub indexed: bool,
    /// Bytes of all tensors (the index's `total_size`).
    pub total_size: u64,
    /// Elements of all tensors (the index's `total_parameters`).
    pub total_parameters: u64,
}

/// huggingface_hub's `split_state_dict_into_shards_factory` over tensors of `sizes` bytes,
/// in order: a tensor larger than `max` is appended at once as a file of its own (the file
/// being filled stays open); one that would push the open file over `max` closes it and
/// starts a new one; every other joins the open file. Returns each file's tensor indices, in
/// the order the files were appended.
pub(crate) fn split_into_files(sizes: &[u64], max: u64) -> Vec<Vec<usize>> {
    let mut files: Vec<Vec<usize>> = Vec::new();
    let (mut open, mut open_size) = (Vec::new(), 0u64);
    for (i, &size) in sizes.iter().enumerate() {
        if size > max {
            files.push(vec![i]);
            continue;
        }
        if open_size + size > max {
            files.push(std::mem::take(&mut open));
            open_size = 0;
        }
        open.push(i);
        open_size += size;
    }
    if !open.is_empty() {
        files.push(open);
    }
    files
}

/// The plan `save_pretrained` makes of `tensors` (in order) at `max_shard_size`: split as
/// huggingface_hub splits ([`split_into_files`]), one `model.safetensors` without an index,
/// or `model-{i:05}-of-{n:05}.safetensors` files and the index.
pub(crate) fn split_plan(
    tensors: &[PlannedTensor],
    max_shard_size: u64,
    origin: &dyn Fn(&PlannedTensor) -> String,
) -> Result<DirPlan> {
    let sizes: Vec<u64> = tensors.iter().map(PlannedTensor::nbytes).collect();
    let groups = split_into_files(&sizes, max_shard_size);
    let n = groups.len();
    let named = groups
        .into_iter()
        .enumerate()
        .map(|(i, g)| (single_or_sharded_name(i, n), g))
        .collect();
    dir_plan(tensors, named, n > 1, origin)
}

/// The plan of a directory whose files (name, indices into `tensors`) are given, in file
/// order, with an index when `indexed`. Each file's header is what the `safetensors` library
/// writes for its tensors with `__metadata__` `{"format": "pt"}`, as `save_pretrained`
/// passes: tensors by descending dtype, then name. `origin` says where a tensor came from,
/// for the error refusing one named `__metadata__`.
pub(crate) fn dir_plan(
    tensors: &[PlannedTensor],
    named: Vec<(String, Vec<usize>)>,
    indexed: bool,
    origin: &dyn Fn(&PlannedTensor) -> String,
) -> Result<DirPlan> {
    let mut files = Vec::with_capacity(named.len());
    for (name, group) in named {
        let mut ts: Vec<PlannedTensor> = group.iter().map(|&t| tensors[t].clone()).collect();
        ts.sort_by(|l, r| {
            st_order(r.to)
                .cmp(&st_order(l.to))
                .then_with(|| l.name.cmp(&r.name))
        });
        let entries: Vec<Entry> = ts
            .iter()
            .map(|t| Entry {
                name: t.name.clone(),
                dtype: t.to,
                shape: t.shape.clone(),
                nbytes: t.nbytes(),
            })
            .collect();
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let (header, _) = header::encode(&entries, &meta, &|e| {
            ts.iter()
                .find(|t| t.name == e.name)
                .map_or_else(String::new, origin)
        })?;
        files.push(PlannedFile {
            name,
            header,
            tensors: ts,
        });
    }
    Ok(DirPlan {
        indexed,
        total_size: tensors.iter().map(PlannedTensor::nbytes).sum(),
        total_parameters: tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .sum(),
        files,
    })
}

/// Where the `safetensors` library sorts a dtype (its `Dtype` enum's order).
fn st_order(d: DType) -> Option<::safetensors::tensor::Dtype> {
    crate::io::safetensors::to_st_dtype(d)
}

impl DirPlan {
    /// `model.safetensors.index.json` as `save_pretrained` writes it: `json.dumps(index,
    /// indent=2, sort_keys=True) + "\n"` of `{"metadata": {"total_parameters",
    /// "total_size"}, "weight_map": {name: file}}`, non-ASCII escaped as Python does.
    pub(crate) fn index_json(&self) -> Result<Vec<u8>> {
        let weight_map: BTreeMap<&str, &str> = self
            .files
            .iter()
            .flat_map(|f| {
                f.tensors
                    .iter()
                    .map(move |t| (t.name.as_str(), f.name.as_str()))
            })
            .collect();
        let index = serde_json::json!({
            "metadata": {
                "total_parameters": self.total_parameters,
                "total_size": self.total_size,
            },
            "weight_map": weight_map,
        });
        let text = serde_json::to_string_pretty(&index).map_err(|e| Error::Serialization {
            what: INDEX_FILE.into(),
            reason: e.to_string(),
        })?;
        let mut out = String::with_capacity(text.len() + 1);
        for c in text.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
        out.push('\n');
        Ok(out.into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_huggingface_hub_parses_them() {
        assert_eq!(parse_shard_size("50GB").unwrap(), 50_000_000_000);
        assert_eq!(parse_shard_size("60KB").unwrap(), 60_000);
        assert_eq!(parse_shard_size(" 1.5gb ").unwrap(), 1_500_000_000);
        assert_eq!(parse_shard_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_shard_size("4096").unwrap(), 4096);
        for bad in ["", "GB", "-1GB", "0KB", "ten MB", "1PB"] {
            assert!(parse_shard_size(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_shard_size("9223372036854775807").unwrap(),
            i64::MAX as u64
        );
        for (bad, what) in [
            ("1e100", "more than 2^63−1 bytes"),
            ("inf", "not a finite number"),
            ("NaN", "not a finite number"),
            ("18446744073709551615", "more than 2^63−1 bytes"),
            ("9223372036854775808", "more than 2^63−1 bytes"),
            ("0.5", "less than one byte"),
            ("0", "less than one byte"),
        ] {
            let e = parse_shard_size(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("`{bad}` is {what}")), "{e}");
            assert!(e.contains("finite number of bytes from 1 to 2^63−1"), "{e}");
        }
    }

    #[test]
    fn a_tensor_over_the_limit_gets_a_file_of_its_own_appended_at_once() {
        // The example: keys a, BIG, c give file 1 = {BIG} and file 2 = {a, c}.
        assert_eq!(split_into_files(&[10, 500, 10], 100), [vec![1], vec![0, 2]]);
        // huggingface_hub's docstring: [6, 6, 2, 6, 2, 2] GB at 10 GB.
        assert_eq!(
            split_into_files(&[6, 6, 2, 6, 2, 2], 10),
            [vec![0], vec![1, 2], vec![3, 4, 5]]
        );
        assert_eq!(split_into_files(&[5, 5], 10), [vec![0, 1]]);
        assert!(split_into_files(&[], 10).is_empty());
    }

    #[test]
    fn the_index_is_sorted_pretty_json_with_pythons_ascii_escapes() {
        let t = |name: &str| PlannedTensor {
            name: name.into(),
            source: 0,
            from: DType::F32,
            to: DType::F32,
            shape: vec![2],
        };
        let plan = split_plan(&[t("b"), t("a"), t("é")], 16, &|_| String::new()).unwrap();
        let text = String::from_utf8(plan.index_json().unwrap()).unwrap();
        assert_eq!(
            text,
            "{\n  \"metadata\": {\n    \"total_parameters\": 6,\n    \"total_size\": 24\n  },\n  \"weight_map\": {\n    \"a\": \"model-00001-of-00002.safetensors\",\n    \"b\": \"model-00001-of-00002.safetensors\",\n    \"\\u00e9\": \"model-00002-of-00002.safetensors\"\n  }\n}\n"
        );
    }
}
