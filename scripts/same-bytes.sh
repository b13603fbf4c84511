#!/usr/bin/env bash
# Same bytes (issue 41, item 5): every writing command of `fsdp-ckpt`, run on every
# `tests/golden` fixture by the release binary of a base revision and by the one of this
# working tree, must write the same bytes and print the same text. The base is main before
# this branch's change (`git merge-base main HEAD`), so that what landed on main since is not
# counted as this branch's difference; `--base main` compares with main as it is now.
#
#   scripts/same-bytes.sh [--base REV] [--base-bin PATH] [--new-bin PATH] [--keep]
#
# The base tree is exported with `git archive` (no worktree is registered) into a temporary
# directory and built with `cargo build --release -p fsdp-ckpt` into `target/same-bytes-base`
# (kept, so a second run only rebuilds what changed); the new binary is this tree's
# `target/release/fsdp-ckpt`. `--base-bin`/`--new-bin` use existing binaries instead.
#
# Each case runs both binaries with the same arguments and the same output path, one after
# the other, and compares: the exit status, standard output and standard error (`--quiet`:
# no progress bars; paths are the same, so every message must be the same text), and the
# whole output (every file and directory under it, names, kinds and bytes). One thing may
# differ, and only inside DCP `.metadata` files: the `save_id` of `StorageMeta`, which the DCP
# writer (`src/io/dcp/pickler.rs`, `save_id()`) makes from the clock and the process id, as
# PyTorch makes a random UUID. It is a 36-character string of fixed shape, so the two files
# must have the same length and the same bytes once the one value after the `save_id` key
# is masked; nothing else is masked. Inputs a command refuses count too: both binaries must
# refuse them with the same message.
#
# Writing commands and their forms: `convert` file to file (`.pt` and `.safetensors`),
# `convert --to dcp` (plain and `--compress zstd`), `convert --to hf` (with each fixture's
# `config.json` where one lies beside it), `convert DCP --to fsdp --model DESC --world-size 2`
# (every DCP directory with every `desc.json`), `consolidate` to `.pt` and `.safetensors`
# (`--optim` for DeepSpeed), `reshard` (of the checkpoints `--to fsdp` wrote, to 1 and 3
# ranks), `consolidate-torch`, `consolidate-sharded`, `shard-torch` (`pt` and `safetensors`);
# and the readers `inspect` (text and `--json`) and `verify`. Prints the number of cases,
# how many wrote an output, and the number of differences; exits 1 if there is any.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

base=
base_bin=
new_bin=
keep=0
while [ $# -gt 0 ]; do
    case "$1" in
        --base) base=$2; shift 2 ;;
        --base-bin) base_bin=$2; shift 2 ;;
        --new-bin) new_bin=$2; shift 2 ;;
        --keep) keep=1; shift ;;
        -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
        *) echo "same-bytes: unknown argument $1" >&2; exit 2 ;;
    esac
done

scratch=$(mktemp -d "${TMPDIR:-/tmp}/same-bytes.XXXXXX")
cleanup() {
    if [ "$keep" = 1 ]; then
        echo "kept $scratch" >&2
    else
        rm -rf "$scratch"
    fi
}
trap cleanup EXIT

if [ -z "$base_bin" ]; then
    if [ -z "$base" ]; then
        base="merge-base of main and HEAD"
        rev=$(git merge-base main HEAD)
    else
        rev=$(git rev-parse --verify "$base^{commit}")
    fi
    echo "== building the base binary ($base = $rev)" >&2
    mkdir -p "$scratch/base"
    git archive "$rev" | tar -x -C "$scratch/base"
    cargo build --release --quiet -p fsdp-ckpt --manifest-path "$scratch/base/Cargo.toml" \
        --target-dir "$root/target/same-bytes-base"
    base_bin="$root/target/same-bytes-base/release/fsdp-ckpt"
fi
if [ -z "$new_bin" ]; then
    echo "== building the new binary (this working tree)" >&2
    cargo build --release --quiet -p fsdp-ckpt
    new_bin="$root/target/release/fsdp-ckpt"
fi

base_bin=$(realpath "$base_bin")
new_bin=$(realpath "$new_bin")
python3 - "$base_bin" "$new_bin" "$root/tests/golden" "$scratch/run" <<'EOF'
import glob, os, re, shutil, subprocess, sys

base_bin, new_bin, golden, scratch = sys.argv[1:]
os.makedirs(scratch)
OUT = os.path.join(scratch, "o")
KEEP = os.path.join(scratch, "keep")
os.makedirs(KEEP)
SAVE_ID = re.compile(rb"(save_id[\x00-\xff]{0,8}?)[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

cases = wrote = 0
diffs = []


def tree(top):
    """Every path under `top` (relative), with its kind and (files) bytes."""
    if not os.path.lexists(top):
        return {}
    if os.path.isfile(top) and not os.path.islink(top):
        return {"": ("file", open(top, "rb").read())}
    found = {"": ("dir", None)}
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, top)
            if os.path.islink(p):
                found[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                found[rel] = ("dir", None)
            else:
                found[rel] = ("file", open(p, "rb").read())
    return found


def masked(name, data):
    if name.endswith(".metadata"):
        return SAVE_ID.sub(lambda m: m.group(1) + b"X" * 36, data)
    return data


def run(binary, args):
    p = subprocess.run([binary, "--quiet"] + args, capture_output=True, cwd=scratch)
    return p.returncode, p.stdout, p.stderr


def case(label, args, out_name=None, keep_as=None):
    """Runs `args` (the string OUT stands for the output path) with both binaries."""
    global cases, wrote
    cases += 1
    out = os.path.join(OUT, out_name) if out_name else None
    argv = [out if a == "OUT" else a for a in args]
    got = []
    for b in (base_bin, new_bin):
        shutil.rmtree(OUT, ignore_errors=True)
        os.makedirs(OUT)
        rc, so, se = run(b, argv)
        got.append((rc, so, se, tree(out) if out else {}))
    (rb, ob, eb, tb), (rn, on, en, tn) = got
    why = []
    if rb != rn:
        why.append(f"exit status {rb} vs {rn}")
    if ob != on:
        why.append("standard output differs")
    if eb != en:
        why.append(f"standard error differs: {eb[-300:]!r} vs {en[-300:]!r}")
    if set(tb) != set(tn):
        why.append(f"entries differ: {sorted(set(tb) ^ set(tn))[:5]}")
    for rel in sorted(set(tb) & set(tn)):
        kb, db = tb[rel]
        kn, dn = tn[rel]
        if kb != kn:
            why.append(f"`{rel}`: {kb} vs {kn}")
        elif kb == "file" and masked(rel or out_name, db) != masked(rel or out_name, dn):
            why.append(f"`{rel or out_name}`: bytes differ ({len(db)} vs {len(dn)} bytes)")
        elif kb == "link" and db != dn:
            why.append(f"`{rel}`: link targets differ")
    if rn == 0 and tn:
        wrote += 1
        if keep_as:
            dst = os.path.join(KEEP, keep_as)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.move(out, dst)
    if why:
        diffs.append((label, why))
    return rn == 0


def rel(p):
    return os.path.relpath(p, golden)


# Inputs: every file a format names by its extension, and every directory `inspect` reads
# (with the base binary; a directory neither binary reads is still a case of its own).
files = sorted(
    p for ext in ("pt", "pth", "bin", "ckpt", "safetensors")
    for p in glob.glob(os.path.join(golden, "**", "*." + ext), recursive=True)
)
dirs = []
for d, sub, _ in os.walk(golden):
    for n in sorted(sub):
        p = os.path.join(d, n)
        if run(base_bin, ["inspect", p])[0] == 0:
            dirs.append(p)
dirs.sort()
descs = sorted(glob.glob(os.path.join(golden, "**", "desc.json"), recursive=True))
dcp_dirs = [d for d in dirs if run(base_bin, ["verify", d])[0] == 0 or
            b"DCP" in run(base_bin, ["inspect", d])[1]]

for p in files + dirs:
    r = rel(p)
    case(f"inspect {r}", ["inspect", p])
    case(f"inspect --json {r}", ["inspect", "--json", p])
for d in dirs:
    case(f"verify {rel(d)}", ["verify", d])

for f in files:
    r = rel(f)
    for ext in ("pt", "safetensors"):
        case(f"convert {r} out.{ext}", ["convert", f, "OUT"], f"out.{ext}")
for p in files + dirs:
    r = rel(p)
    case(f"convert {r} --to dcp", ["convert", p, "OUT", "--to", "dcp"], "dcp")
    case(f"convert {r} --to dcp --compress zstd",
         ["convert", p, "OUT", "--to", "dcp", "--compress", "zstd"], "dcp")
    case(f"convert {r} --to hf", ["convert", p, "OUT", "--to", "hf"], "hf")
    parent = os.path.dirname(p.rstrip("/"))
    for c in sorted(glob.glob(os.path.join(parent, "*", "config.json"))):
        case(f"convert {r} --to hf --config {rel(c)}",
             ["convert", p, "OUT", "--to", "hf", "--config", c], "hf")
for d in dirs:
    r = rel(d)
    for ext in ("pt", "safetensors"):
        case(f"consolidate {r} out.{ext}", ["consolidate", d, "OUT"], f"out.{ext}")
        case(f"consolidate --optim {r} out.{ext}",
             ["consolidate", "--optim", d, "OUT"], f"out.{ext}")

# `--to fsdp`: every DCP directory with every model description; what it writes is the
# crate's checkpoint, which the second stage reads.
ckpts = []
for d in dcp_dirs:
    for i, desc in enumerate(descs):
        name = f"ckpt{len(ckpts)}"
        if case(f"convert {rel(d)} --to fsdp --model {rel(desc)} --world-size 2",
                ["convert", d, "OUT", "--to", "fsdp", "--model", desc, "--world-size", "2"],
                "ckpt", keep_as=name):
            ckpts.append((f"{rel(d)} as {rel(desc)}", os.path.join(KEEP, name), desc))
for what, c, desc in ckpts:
    case(f"inspect (checkpoint of {what})", ["inspect", c])
    case(f"verify (checkpoint of {what})", ["verify", c])
    for ws in ("1", "3"):
        case(f"reshard (checkpoint of {what}) --world-size {ws}",
             ["reshard", c, "OUT", "--world-size", ws], "re")
    case(f"reshard (checkpoint of {what}) --world-size 2 --policy {rel(desc)}",
         ["reshard", c, "OUT", "--world-size", "2", "--policy", desc], "re")
    for ext in ("pt", "safetensors"):
        case(f"consolidate (checkpoint of {what}) out.{ext}", ["consolidate", c, "OUT"],
             f"out.{ext}")
    case(f"convert (checkpoint of {what}) --to dcp", ["convert", c, "OUT", "--to", "dcp"], "dcp")
    case(f"convert (checkpoint of {what}) --to hf", ["convert", c, "OUT", "--to", "hf"], "hf")

# The per-rank files of `torch.save`d optimizer state: consolidate-torch and shard-torch
# with the `desc.json` beside them, consolidate-sharded of SHARDED dicts.
for d in sorted({os.path.dirname(p) for p in glob.glob(os.path.join(golden, "**", "rank0.pt"),
                                                      recursive=True)}):
    r = rel(d)
    ranks = sorted(glob.glob(os.path.join(d, "rank*.pt")),
                   key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0]))
    desc = os.path.join(d, "desc.json")
    for ext in ("pt", "safetensors"):
        case(f"consolidate-sharded {r}/rank*.pt -o full.{ext}",
             ["consolidate-sharded"] + ranks + ["-o", "OUT"], f"full.{ext}")
    if not os.path.exists(desc):
        continue
    fulls = sorted(glob.glob(os.path.join(d, "full*.pt")))
    for named in ([], ["--named-optimizer"]):
        for ext in ("pt", "safetensors"):
            keep = f"full{len(os.listdir(KEEP))}.pt" if ext == "pt" and not named else None
            if case(f"consolidate-torch --model {r}/desc.json {' '.join(named)} -o full.{ext}",
                    ["consolidate-torch", "--model", desc] + named + ranks + ["-o", "OUT"],
                    f"full.{ext}", keep_as=keep) and keep:
                fulls.append(os.path.join(KEEP, keep))
    for full in fulls:
        for ws in ("2", "3"):
            for ext in ("pt", "safetensors"):
                case(f"shard-torch --model {r}/desc.json {rel(full)} --world-size {ws} "
                     f"--ext {ext}",
                     ["shard-torch", "--model", desc, full, "--world-size", ws, "-o", "OUT",
                      "--ext", ext], "shards")
for d in sorted({os.path.dirname(p) for p in glob.glob(os.path.join(golden, "**", "shard0.pt"),
                                                      recursive=True)}):
    shards = sorted(glob.glob(os.path.join(d, "shard*.pt")))
    case(f"consolidate-sharded {rel(d)}/shard*.pt -o full.pt",
         ["consolidate-sharded"] + shards + ["-o", "OUT"], "full.pt")

for label, why in diffs:
    print(f"DIFFERENT: {label}")
    for w in why:
        print(f"    {w}")
print(f"{cases} cases ({wrote} wrote an output, the others compared as refusals or reports): "
      f"{len(diffs)} differences")
sys.exit(1 if diffs else 0)
EOF
