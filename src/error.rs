//! The crate's one error type.
//!
//! Every variant names what was wrong and where (parameter, rank, state name, unit), so that a
//! user can act on the message without reading the crate's source.

use std::path::Path;
use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `fsdp`.
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Error {
    // ----- model description and layout -----
    /// The model description or wrapping policy is inconsistent.
    #[error("invalid model description: {0}")]
    InvalidModel(String),

    /// A parameter order given for a model does not name each of its parameters exactly once.
    #[error(
        "the parameter order does not match the {source_of_params}: missing {missing:?}, \
         not in the {source_of_params} {unknown:?}, repeated {repeated:?}"
    )]
    ParamOrderMismatch {
        /// Where the parameters come from (e.g. `VarStore`).
        source_of_params: String,
        /// Parameters the order leaves out.
        missing: Vec<String>,
        /// Names in the order that are no parameter.
        unknown: Vec<String>,
        /// Names given more than once.
        repeated: Vec<String>,
    },

    /// A name does not refer to any parameter where it was looked up.
    #[error("unknown parameter `{name}` {site}")]
    UnknownParameter {
        /// The name that was looked up.
        name: String,
        /// Where it was looked up.
        site: LookupSite,
    },

    /// An optimizer names the flat parameter of an FSDP unit the layout does not have.
    #[error("unknown FSDP unit `{unit}`: no unit with a flat parameter has this module prefix")]
    UnknownUnit {
        /// The unit's module prefix.
        unit: String,
    },

    /// The parameters of one FSDP unit cannot be flattened together.
    #[error("cannot flatten FSDP unit `{unit}`: {reason}")]
    Flatten {
        /// Module prefix of the unit (`""` is the root).
        unit: String,
        /// Why.
        reason: String,
    },

    // ----- tensors -----
    /// A tensor had another dtype than required.
    #[error("dtype mismatch in {context}: expected {expected}, found {found}")]
    DtypeMismatch {
        /// Where.
        context: String,
        /// What was needed.
        expected: String,
        /// What was given.
        found: String,
    },

    /// A tensor had another shape or element count than required.
    #[error("shape mismatch in {context}: expected {expected:?}, found {found:?}")]
    ShapeMismatch {
        /// Where (parameter and state name when known).
        context: String,
        /// What was needed.
        expected: Vec<usize>,
        /// What was given.
        found: Vec<usize>,
    },

    /// An element range lies outside a tensor.
    #[error("range {start}..{end} out of bounds for {context} with {numel} elements")]
    OutOfBounds {
        /// Where.
        context: String,
        /// Start of the range.
        start: usize,
        /// End of the range (exclusive).
        end: usize,
        /// Number of elements available.
        numel: usize,
    },

    /// A tensor backend other than the host one (libtorch through `tch`) reported an error.
    #[error("tensor backend `{backend}` failed in {op}: {reason}")]
    TensorBackend {
        /// The backend (`tch`).
        backend: String,
        /// The operation, with the tensors' dtypes and shapes when known.
        op: String,
        /// The backend's message.
        reason: String,
    },

    // ----- optimizer state validation (PyTorch's own checks) -----
    /// An optimizer's hyper-parameters are out of range, as `torch.optim` refuses them.
    #[error("{optimizer}: {reason}")]
    InvalidOptimizerConfig {
        /// The optimizer (`Adam`, `AdamW`, `SGD`).
        optimizer: String,
        /// What is out of range, with the value.
        reason: String,
    },

    /// Param groups that cannot be used: a group that does not exist, a parameter listed
    /// twice, a key that no parameter owns, a hyper-parameter missing or of the wrong type.
    #[error("{context}: {}{reason}", group_prefix(.group))]
    InvalidParamGroups {
        /// The optimizer or operation that checked them.
        context: String,
        /// The group involved, when one is.
        group: Option<usize>,
        /// What is wrong.
        reason: String,
    },

    /// A loaded state dict's param groups differ from the optimizer's: in number (`group` is
    /// `None`) or in the size of one group.
    #[error("{context}: {}", format_group_mismatch(.group, *.expected, *.found))]
    ParamGroupsMismatch {
        /// The optimizer or operation that checked them.
        context: String,
        /// `None`: the number of groups differs; `Some(g)`: the size of group `g` differs.
        group: Option<usize>,
        /// What the optimizer has.
        expected: usize,
        /// What the dict has.
        found: usize,
    },

    /// A parameter's state lacks a state the operation needs (`step`, `exp_avg`, …); an empty
    /// `state` means the parameter has no state at all.
    #[error("{context}: {}", format_missing_state(.param, .state))]
    MissingState {
        /// Where: the optimizer, operation or rank.
        context: String,
        /// The parameter (`parameter id 3`, `` `layer.weight` ``).
        param: String,
        /// The state name.
        state: String,
    },

    /// A state holds another kind of value than the operation needs (a sharded tensor where a
    /// plain one is needed, a number where a tensor is).
    #[error("{context}: state `{state}` of {param} must be {expected}, found {found}")]
    WrongStateKind {
        /// Where: the optimizer, operation or rank.
        context: String,
        /// The parameter.
        param: String,
        /// The state name.
        state: String,
        /// What is needed.
        expected: String,
        /// What is there.
        found: String,
    },

    /// A state dict keyed by parameter ids where names are needed, or the reverse, or by both.
    #[error("{dict} must be keyed by {expected}, but it has the key {key}{hint}")]
    WrongKeyType {
        /// Which dict (`a full optimizer state dict`, …).
        dict: String,
        /// The key type needed (`parameter names`, `parameter ids`, `one key type`).
        expected: String,
        /// The first key that does not fit.
        key: String,
        /// What to do about it (empty, or starting with `; `).
        hint: String,
    },

    /// The optimizer holds a parameter the wrapping does not let it hold: an original
    /// parameter flattened into a flat parameter, a flat parameter with `use_orig_params`, a
    /// parameter FSDP does not manage.
    #[error("optimizer parameter {param}: {reason}")]
    WrongOptimParam {
        /// The parameter, as the optimizer holds it.
        param: String,
        /// What it should hold instead.
        reason: String,
    },

    /// A call got an argument that does not fit it on this rank: the dict a rank must pass is
    /// missing, a wrong number of tensors, an impossible group size.
    #[error("{op} on rank {rank}: {reason}")]
    InvalidArgument {
        /// The call.
        op: String,
        /// The calling rank.
        rank: usize,
        /// What does not fit.
        reason: String,
    },

    /// Two settings that must agree do not (a state-dict config for another state-dict type).
    #[error("{what}: expected {expected}, found {found}")]
    ConfigMismatch {
        /// The setting.
        what: String,
        /// What fits.
        expected: String,
        /// What was given.
        found: String,
    },

    /// A worker thread (a background save's writer, a thread rank) panicked.
    #[error("{worker} panicked: {message}")]
    WorkerPanicked {
        /// The worker.
        worker: String,
        /// The panic's message, when it was a string.
        message: String,
    },

    /// Waiting for something other than a collective ran out of time (the data files of a
    /// background save).
    #[error("timed out after {waited:?} waiting for {what}")]
    TimedOut {
        /// What was awaited.
        what: String,
        /// How long.
        waited: Duration,
    },

    /// An internal invariant failed: a bug in this crate, not in the input.
    #[error("internal error in fsdp (please report it): {0}")]
    Internal(String),

    /// Parameters of one flat parameter have different sets of state names.
    #[error(
        "differing optimizer state names for the unflattened parameters {params:?}: {names:?}"
    )]
    DifferingStateNames {
        /// The parameters of the flat parameter.
        params: Vec<String>,
        /// The state-name set of each parameter that has state, in `params` order.
        names: Vec<Vec<String>>,
    },

    /// One state is a tensor for one parameter and something else for another.
    #[error("differing optimizer state types for state `{state}` of the unflattened parameters {params:?}: {kinds:?}")]
    DifferingStateTypes {
        /// State name.
        state: String,
        /// The parameters of the flat parameter.
        params: Vec<String>,
        /// The kind found for each parameter that has the state.
        kinds: Vec<String>,
    },

    /// Zero-dim tensor or plain state (e.g. Adam's `step`) is missing or differs across the
    /// parameters of one flat parameter, or across ranks.
    #[error("all unflattened parameters comprising a single flat parameter must have scalar state with the same value and dtype, but state `{state}` of {params:?} has values {values:?}")]
    ScalarStateMismatch {
        /// State name.
        state: String,
        /// The parameters (or `rank N` labels) involved.
        params: Vec<String>,
        /// Each value, formatted; `missing` where a parameter lacks the state.
        values: Vec<String>,
    },

    /// Positive-dim tensor state has different dtypes across the parameters of one flat parameter.
    #[error("all unflattened parameters comprising a single flat parameter must have positive-dimension tensor state with the same dtype, but state `{state}` of {params:?} has dtypes {dtypes:?}")]
    TensorStateDtypeMismatch {
        /// State name.
        state: String,
        /// The parameters involved.
        params: Vec<String>,
        /// The dtypes found.
        dtypes: Vec<String>,
    },

    /// A zero-dimensional parameter has no state while its flat parameter needs some.
    #[error("flattening a zero-dimension parameter without state is not supported: parameter `{param}`, state `{state}`")]
    ZeroDimParamWithoutState {
        /// Parameter name.
        param: String,
        /// State name.
        state: String,
    },

    /// Some ranks lack optimizer state that rank 0 has.
    #[error("FSDP requires each rank to have at least the optimizer states needed by rank 0's optimizer, but some ranks are missing some of those states:{}", format_missing(.missing))]
    MissingStateOnRanks {
        /// For each rank that misses something: the rank and the parameter names it misses.
        missing: Vec<(usize, Vec<Vec<String>>)>,
    },

    /// An FSDP-managed parameter that requires grad has no state on any rank while its flat
    /// parameter has state (use_orig_params).
    #[error("parameter `{param}` of FSDP unit `{unit}` is not in the optimizer state on any rank")]
    MissingParamState {
        /// Parameter name.
        param: String,
        /// Unit prefix.
        unit: String,
    },

    // ----- agreement and collectives -----
    /// Ranks disagree about the plan of a collective operation (layout, keys, state names).
    #[error("ranks disagree on the plan of `{op}`: ranks {ranks:?} differ from rank {reference}: {detail}")]
    PlanMismatch {
        /// The façade operation.
        op: String,
        /// The rank everything was compared with.
        reference: usize,
        /// The ranks whose plan differs.
        ranks: Vec<usize>,
        /// What differs (keys, state names, layout).
        detail: String,
    },

    /// A collective did not complete in time.
    #[error("collective `{op}` on rank {rank} timed out after {waited:?}; ranks not arrived: {missing:?}")]
    CollectiveTimeout {
        /// Operation name.
        op: String,
        /// The calling rank.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// Ranks that never arrived.
        missing: Vec<usize>,
    },

    /// A peer rank left the group (its handle was dropped or its thread panicked).
    #[error("collective `{op}` on rank {rank} failed: peer rank {peer} has left the group")]
    PeerDied {
        /// Operation name.
        op: String,
        /// The calling rank.
        rank: usize,
        /// The rank that is gone.
        peer: usize,
    },

    /// Ranks called different collectives, or the same one with incompatible arguments.
    #[error("collective mismatch on rank {rank}: {detail}")]
    CollectiveMismatch {
        /// The calling rank.
        rank: usize,
        /// What differed.
        detail: String,
    },

    /// A process-group operation got invalid arguments (bad root, buffer size, ranks).
    #[error("invalid process-group call `{op}` on rank {rank}: {reason}")]
    InvalidCollective {
        /// Operation name.
        op: String,
        /// The calling rank.
        rank: usize,
        /// Why.
        reason: String,
    },

    /// A communication backend is not available (not compiled in, no driver, no library).
    #[error("backend `{backend}` unavailable: {reason}")]
    BackendUnavailable {
        /// Backend name.
        backend: String,
        /// Why.
        reason: String,
    },

    /// A launcher variable (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`)
    /// is missing or does not parse.
    #[error("environment variable `{variable}`: {reason}")]
    Environment {
        /// The variable.
        variable: String,
        /// What is wrong with it (missing, its value and why it does not parse).
        reason: String,
    },

    /// The TCP rendezvous that hands rank 0's bytes (the NCCL unique id) to the other ranks,
    /// or its client of torchrun's agent store (a c10d `TCPStore`), failed at the network
    /// level or received bytes that are not its protocol.
    #[error("rendezvous at {addr} failed on rank {rank}: {reason}")]
    Rendezvous {
        /// The rank that reports.
        rank: usize,
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// What failed.
        reason: String,
    },

    /// An NCCL call returned an error (`nccl` feature).
    #[error("NCCL `{op}` failed on rank {rank}: {code}: {reason}")]
    Nccl {
        /// The NCCL call or the process-group operation it served.
        op: String,
        /// The calling rank.
        rank: usize,
        /// The symbolic `ncclResult_t` name, e.g. `ncclUnhandledCudaError`.
        code: String,
        /// What the code means.
        reason: String,
    },

    /// A CUDA driver call returned an error (`nccl` feature).
    #[error("CUDA driver call `{op}` failed on rank {rank}: {code}")]
    CudaDriver {
        /// The driver call or the process-group operation it served.
        op: String,
        /// The calling rank.
        rank: usize,
        /// The symbolic `CUresult` name, e.g. `CUDA_ERROR_NO_DEVICE`.
        code: String,
    },

    // ----- encoding -----
    /// Serializing or deserializing an object for exchange failed.
    #[error("serialization failed for {what}: {reason}")]
    Serialization {
        /// What was being (de)serialized.
        what: String,
        /// The codec's message.
        reason: String,
    },

    // ----- files (torch.save) -----
    /// Reading or writing a file failed at the operating-system level ([`Error::io`] builds
    /// it; [`Error::io_kind`] tells not-found from permission-denied).
    #[error("I/O error while {op} `{path}`: {source}")]
    Io {
        /// What was being done (`reading`, `writing`, `renaming`, …).
        op: String,
        /// The file involved.
        path: String,
        /// The operating system's error.
        source: IoError,
    },

    /// The file is a legacy (pre-1.6, `_use_new_zipfile_serialization=False`) `torch.save` file.
    #[error("`{file}` is a legacy torch.save file (saved with _use_new_zipfile_serialization=False); re-save it with a current PyTorch: torch.save(torch.load(path), path)")]
    LegacyTorchSave {
        /// The file (or `<memory>`).
        file: String,
    },

    /// The zip container of a `torch.save` file is malformed, truncated, or uses a feature
    /// PyTorch never writes (compression, multi-disk archives).
    #[error("malformed torch.save archive `{file}`{}: {reason} (at byte {offset})", entry_suffix(.entry))]
    TorchSaveArchive {
        /// The file (or `<memory>`).
        file: String,
        /// The zip entry involved, if any.
        entry: Option<String>,
        /// Byte offset in the file where the problem was found.
        offset: u64,
        /// What is wrong.
        reason: String,
    },

    /// A zip entry that a `torch.save` file needs is absent.
    #[error("torch.save archive `{file}` has no entry `{entry}`")]
    MissingArchiveEntry {
        /// The file (or `<memory>`).
        file: String,
        /// The missing entry's name.
        entry: String,
    },

    /// The file stores tensors in an unsupported byte order (only `little` is read).
    #[error("torch.save archive `{file}` has byte order `{byteorder}`; only little-endian files are supported")]
    UnsupportedByteOrder {
        /// The file (or `<memory>`).
        file: String,
        /// The content of the `byteorder` entry.
        byteorder: String,
    },

    /// The pickle stream (`data.pkl` of a `torch.save` file, a DCP `.metadata`) is malformed:
    /// truncated, stack underflow, bad memo index, wrong argument types for a known callable.
    #[error("malformed pickle in `{file}` at byte {offset} (opcode {opcode}): {reason}")]
    Pickle {
        /// The file (or `<memory>`).
        file: String,
        /// Offset of the opcode in the stream.
        offset: usize,
        /// The opcode being executed, by pickle name.
        opcode: String,
        /// What is wrong.
        reason: String,
    },

    /// The pickle stream uses an opcode this reader does not implement.
    #[error("unsupported pickle opcode {name} (0x{opcode:02x}) in `{file}` at byte {offset}")]
    UnsupportedPickleOpcode {
        /// The file (or `<memory>`).
        file: String,
        /// The opcode byte.
        opcode: u8,
        /// Its pickle name (`UNKNOWN` if it is not a pickle opcode at all).
        name: String,
        /// Offset of the opcode in `data.pkl`.
        offset: usize,
    },

    /// The pickle stream refers to a Python global (class or function) outside the small set
    /// that `torch.save` writes for state dicts.
    #[error("unsupported Python global `{}.{}` in `{file}` at byte {offset}", shown(.module), shown(.name))]
    UnsupportedPickleGlobal {
        /// The file (or `<memory>`).
        file: String,
        /// Module, e.g. `torch`.
        module: String,
        /// Name, e.g. `ShortStorage`.
        name: String,
        /// Offset of the opcode in `data.pkl`.
        offset: usize,
    },

    /// A tensor in the file does not fit its storage, or a storage entry has the wrong size.
    #[error("invalid tensor storage `{storage}` in `{file}`: {reason}")]
    TensorStorage {
        /// The file (or `<memory>`).
        file: String,
        /// The storage key (the `data/<key>` entry).
        storage: String,
        /// What is wrong.
        reason: String,
    },

    /// Copies of non-contiguous tensors (expanded or overlapping views of a storage) would
    /// allocate more than the file's storage bytes plus the allowed expansion: a small file
    /// could otherwise make the reader allocate without bound. Raise the limit with
    /// `torch_save::LoadOptions::max_expansion_bytes` (`fsdp-ckpt --max-expansion-bytes`).
    #[error("tensor `{tensor}` in `{file}` (size {size:?}, stride {stride:?}) would bring the bytes copied out of non-contiguous tensors to {copied}, more than the file's {storage_bytes} storage bytes plus the allowed expansion of {max_expansion_bytes} bytes")]
    TensorExpansion {
        /// The file (or `<memory>`).
        file: String,
        /// The tensor's path in the object (`/`-joined keys and indices).
        tensor: String,
        /// Its size.
        size: Box<[usize]>,
        /// Its stride.
        stride: Box<[usize]>,
        /// Bytes copied with this tensor.
        copied: u64,
        /// Bytes of every storage in the file.
        storage_bytes: u64,
        /// The allowed expansion.
        max_expansion_bytes: u64,
    },

    /// Per-rank SHARDED optimizer state dicts (FSDP1 `ShardedTensor`, FSDP2 `DTensor`) that
    /// cannot be consolidated: a rank lacks a key or state the others have, the ranks
    /// disagree on a tensor's global shape or dtype, or the shards do not tile the tensor
    /// exactly once.
    #[error("cannot consolidate the sharded state `{state}` of `{key}` (rank {rank}): {reason}")]
    ShardedMismatch {
        /// The rank (position in the list of files).
        rank: usize,
        /// The parameter key.
        key: String,
        /// The state name.
        state: String,
        /// What is wrong.
        reason: String,
    },

    /// A Python object read from (or to be written to) a file does not have the structure
    /// that a state dict needs.
    #[error("unexpected object at {path}: expected {expected}, found {found}")]
    UnexpectedObject {
        /// Where in the object (e.g. `state[3]['exp_avg']`).
        path: String,
        /// What was needed.
        expected: String,
        /// What was there.
        found: String,
    },

    // ----- sharded checkpoints -----
    /// A path is not a complete checkpoint of this crate's format: no commit marker, a
    /// manifest that fails its checksum or does not parse, another format or version.
    #[error("checkpoint `{dir}` is not usable: {reason}")]
    CheckpointInvalid {
        /// The checkpoint directory.
        dir: String,
        /// What is wrong.
        reason: String,
    },

    /// Stored bytes do not match the manifest: a truncated or replaced file, a failed checksum.
    #[error("checkpoint file `{file}` (rank {rank}) is corrupt in `{tensor}`: {reason}")]
    CheckpointCorrupt {
        /// The data file.
        file: String,
        /// The rank that wrote it.
        rank: usize,
        /// The tensor state being read (`param/state`), or `(header)`.
        tensor: String,
        /// What failed.
        reason: String,
    },

    /// A checkpoint does not fit the model it is loaded into.
    #[error("checkpoint `{dir}` does not fit the model: {reason}")]
    CheckpointMismatch {
        /// The checkpoint directory.
        dir: String,
        /// What differs.
        reason: String,
    },

    /// An output path that a writer may not replace: it is or contains an input, lies inside
    /// one, or holds files that are not an earlier output of the same kind (see
    /// [`crate::storage`]). Nothing was written.
    #[error("refusing to write `{path}`: {reason}")]
    OutputRefused {
        /// The output path.
        path: String,
        /// Why it may not be replaced.
        reason: String,
    },

    /// The per-rank files given to consolidate are not one file per rank in rank order: a file
    /// given twice (same path or same bytes), or names whose rank numbers contradict their
    /// order.
    #[error("rank file `{file}` (given as rank {position}): {reason}")]
    RankFiles {
        /// The offending file.
        file: String,
        /// Its position in the list, i.e. the rank it would be consolidated as.
        position: usize,
        /// What is wrong (the other file involved, or the rank its name carries).
        reason: String,
    },

    /// A tensor cannot be stored in the output format: its shape's element or byte count
    /// overflows what the format can describe, or the format has no place for its kind
    /// (sparse, quantized, meta) or dtype (safetensors has no complex128).
    #[error("tensor `{tensor}` with shape {shape:?} cannot be stored: {reason}")]
    TensorNotStorable {
        /// The tensor's name in the object (its path, e.g. `state/0/exp_avg`).
        tensor: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Why.
        reason: String,
    },

    /// A tensor would be written into a safetensors header under the name `__metadata__`,
    /// the key the format reserves for its metadata: `safetensors`, transformers and this
    /// crate's readers refuse a header holding it twice.
    #[error("tensor `{}` ({origin}) cannot be written to a safetensors file: `__metadata__` is the name the format reserves for its metadata", shown(.tensor))]
    ReservedTensorName {
        /// The name it would get.
        tensor: String,
        /// Where it came from: the source key, and the rename that named it, or the writer.
        origin: String,
    },

    // ----- DCP directories -----
    /// A DCP `.metadata` file does not have the structure PyTorch's `dcp.save` writes (the
    /// pickle itself parses; its objects are not the expected `Metadata` fields).
    #[error("invalid DCP metadata `{}`: {reason}", shown(.file))]
    DcpMetadata {
        /// The `.metadata` file.
        file: String,
        /// What is wrong.
        reason: String,
    },

    /// Two keys of a DCP `.metadata` have the same `planner_data` path: PyTorch's loader would
    /// put one value in both places (and `dcp_to_torch_save` silently drops one key).
    #[error("invalid DCP metadata `{}`: the keys `{}` and `{}` have the same planner_data path {path}; one of them would silently take the other's value, so the checkpoint is refused (a corrupt or hand-edited .metadata)", shown(.file), shown(.first), shown(.second))]
    DcpSharedPath {
        /// The `.metadata` file.
        file: String,
        /// The first key with the path.
        first: String,
        /// The second key with the same path.
        second: String,
        /// The path, as Python prints the tuple.
        path: String,
    },

    /// A key's `planner_data` path in a DCP `.metadata` is not one PyTorch's loader accepts:
    /// it is not the key's own path, it runs through another key's value, or it leaves a gap
    /// in a list.
    #[error("invalid DCP metadata `{}`, key `{}`: {reason}", shown(.file), shown(.key))]
    DcpPlannerData {
        /// The `.metadata` file.
        file: String,
        /// The flattened key (for a gap in a list: the list's key).
        key: String,
        /// What is wrong.
        reason: String,
    },

    /// The chunks of a DCP tensor do not tile its global shape exactly once (a hole, an
    /// overlap, a chunk outside the shape), a chunk or value has no storage record, or a key's
    /// nested path conflicts with another's.
    #[error("DCP checkpoint `{dir}`, key `{}`: {reason}", shown(.key))]
    DcpChunks {
        /// The checkpoint directory.
        dir: String,
        /// The flattened key (`model.net.0.weight`).
        key: String,
        /// What is wrong.
        reason: String,
    },

    /// A DCP data reference is unusable: its file escapes the directory or is missing, the
    /// byte range lies past the file's end, or the stored chunk does not parse or disagrees
    /// with the metadata in dtype or shape.
    #[error("DCP checkpoint `{dir}`, key `{}`, file `{}`: {reason}", shown(.key), shown(.file))]
    DcpStorage {
        /// The checkpoint directory.
        dir: String,
        /// The flattened key.
        key: String,
        /// The data file as the metadata names it (`relative_path`).
        file: String,
        /// What is wrong.
        reason: String,
    },

    /// A compressed DCP item (`transform_descriptors == ["stream.zstd/1"]`) decompresses to
    /// more bytes than it may hold: its tensor chunk's bytes plus the `torch.save` archive
    /// around them, or the limit on a non-tensor value. A few KB of zstd can otherwise expand
    /// to gigabytes (a zstd bomb); reading stops at the limit.
    #[error("DCP checkpoint `{dir}`, key `{}`, file `{}`: the item decompresses to more than the {limit} bytes it may hold ({what}); refusing it (a zstd bomb or a corrupt checkpoint)", shown(.key), shown(.file))]
    DcpExpansion {
        /// The checkpoint directory.
        dir: String,
        /// The flattened key.
        key: String,
        /// The data file as the metadata names it (`relative_path`).
        file: String,
        /// The most bytes the item may decompress to.
        limit: u64,
        /// What the limit is made of.
        what: String,
    },

    /// A compressed DCP item is too short for what the metadata says it holds: its stored
    /// bytes cannot decompress to that many bytes whatever they are (zstd: at most 128 KiB
    /// per 4 stored bytes, `crate::io::dcp` says why). Refused before anything is allocated
    /// or an output is sized on the metadata's word.
    #[error("DCP checkpoint `{dir}`, key `{}`, file `{}`: the item's {stored} stored bytes of zstd frames can decompress to at most {most} bytes, too few for the {needs} bytes of data the metadata says it holds; refusing it before allocating anything (a corrupt or crafted .metadata)", shown(.key), shown(.file))]
    DcpCompressedTooShort {
        /// The checkpoint directory.
        dir: String,
        /// The flattened key.
        key: String,
        /// The data file as the metadata names it (`relative_path`).
        file: String,
        /// The stored (compressed) length of the item.
        stored: u64,
        /// The most those bytes can decompress to.
        most: u64,
        /// The bytes of data the metadata says the item holds.
        needs: u64,
    },

    /// A DCP directory written with `FileSystemWriter(serialization_format=
    /// SerializationFormat.SAFETENSORS)`: each data file is one safetensors file and every
    /// tensor item's recorded range starts at its header, not at the item. PyTorch 2.13's own
    /// `dcp.load` and `dcp_to_torch_save` fail on it; the crate refuses it rather than guess
    /// the layout.
    #[error("DCP checkpoint `{dir}`: file `{}` (key `{}`) is a safetensors file: the directory was written with serialization_format=SerializationFormat.SAFETENSORS, whose .metadata records no usable byte range for any tensor (each points at the file's header); PyTorch 2.13 cannot read it either (its dcp.load and dcp_to_torch_save fail on it), so it is refused", shown(.file), shown(.key))]
    DcpSafetensorsData {
        /// The checkpoint directory.
        dir: String,
        /// The data file as the metadata names it.
        file: String,
        /// The key whose range was looked at.
        key: String,
    },

    /// A DCP directory saved with per-rank metadata (`dcp.save(..., use_collectives=False)`)
    /// lacks the `__{rank}.metadata` of a rank: ranks must be numbered `0..N` without a gap,
    /// and a rank that wrote data files (`__{rank}_{n}.distcp`) must have its metadata.
    #[error("DCP checkpoint `{}` with per-rank metadata: `__{rank}.metadata` is missing ({found}); every rank's file is needed to merge them into one checkpoint", shown(.dir))]
    DcpRankMissing {
        /// The checkpoint directory.
        dir: String,
        /// The rank whose metadata file is missing.
        rank: usize,
        /// What was found instead (the ranks with metadata, the data file naming this rank).
        found: String,
    },

    /// Two per-rank metadata files of a DCP directory describe one key differently (a tensor
    /// on one rank and a non-tensor value on the other, another dtype, global shape or
    /// `planner_data` path), so they are not parts of one checkpoint.
    #[error("DCP checkpoint `{}`, key `{}`: `__{rank}.metadata` and `__{other_rank}.metadata` disagree: {reason}", shown(.dir), shown(.key))]
    DcpRanksDisagree {
        /// The checkpoint directory.
        dir: String,
        /// The flattened key.
        key: String,
        /// The rank that described the key first.
        rank: usize,
        /// The rank that describes it differently.
        other_rank: usize,
        /// How they differ.
        reason: String,
    },

    /// An item that two ranks of a per-rank DCP directory both saved (a replicated tensor
    /// chunk such as an optimizer `step`, or a non-tensor value such as a `param_groups`
    /// option) is stored with different bytes by each: the ranks did not save one state.
    #[error("DCP checkpoint `{}`, key `{}`{}: ranks {} and {} both saved it, with different bytes ({} against {}); a replicated item must be the same on every rank", shown(.dir), shown(.key), .offsets.as_ref().map(|o| format!(" (chunk at {o:?})")).unwrap_or_default(), .first.rank, .second.rank, .first, .second)]
    DcpReplicasDiffer {
        /// The checkpoint directory.
        dir: String,
        /// The flattened key.
        key: String,
        /// The chunk's offsets (`None` for a non-tensor value).
        offsets: Option<Vec<usize>>,
        /// The lowest rank's copy.
        first: Box<StoredCopy>,
        /// The copy that differs from it.
        second: Box<StoredCopy>,
    },

    /// A safetensors file of a DCP directory in Hugging Face storage
    /// (`HuggingFaceStorageWriter`) does not describe its tensors as the writer does: a
    /// malformed header, a missing or malformed `DCP_SHARDING_INFO` entry, an unsupported
    /// dtype, data offsets outside the file.
    #[error("DCP checkpoint in Hugging Face storage, file `{}`{}: {reason}", shown(.file), .key.as_ref().map(|k| format!(", key `{}`", shown(k))).unwrap_or_default())]
    DcpHfFile {
        /// The safetensors file.
        file: String,
        /// The tensor, when one is at fault.
        key: Option<String>,
        /// What is wrong.
        reason: String,
    },

    /// Two safetensors files of a DCP directory in Hugging Face storage describe one tensor
    /// differently (dtype or number of dimensions), or the directory's files are not one
    /// checkpoint (some with `DCP_SHARDING_INFO` and some without, an index naming another
    /// file).
    #[error("DCP checkpoint in Hugging Face storage{}: `{}` and `{}` disagree: {reason}", .key.as_ref().map(|k| format!(", key `{}`", shown(k))).unwrap_or_default(), shown(.file), shown(.other_file))]
    DcpHfDisagree {
        /// The tensor, when one is at fault.
        key: Option<String>,
        /// The file that described it first.
        file: String,
        /// The file that describes it differently.
        other_file: String,
        /// How they differ.
        reason: String,
    },

    /// Exporting a Hugging Face model directory: the checkpoint holds no tensor in the chosen
    /// subtree (an optimizer-only checkpoint), or, with the default `model.` prefix, holds
    /// tensors outside both `model.` and `optim.` that the export would lose.
    #[error("exporting `{input}` as a Hugging Face model: {reason}")]
    HfSelection {
        /// The checkpoint being exported.
        input: String,
        /// What is selected, what is left out, and which option decides it.
        reason: String,
    },

    /// A key rename rule (`--rename FROM=TO`, `--rename-map`) is malformed.
    #[error("rename rule `{}`: {reason}", shown(.rule))]
    HfRename {
        /// The rule as written, or the rename map file.
        rule: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Two tensors would have one name in the output (after the prefix is stripped or added,
    /// and the renames applied).
    #[error("`{}` and `{}` would both be named `{}`; change the renames so that every tensor keeps its own name", shown(.first), shown(.second), shown(.name))]
    HfNameCollision {
        /// The name both would get.
        name: String,
        /// The first tensor's name before renaming.
        first: String,
        /// The second tensor's name before renaming.
        second: String,
    },

    /// A tied weight (`--tie NAME=SOURCE`, or the `tie_word_embeddings` default) cannot be
    /// dropped: a name is missing, or its tensor differs from the source's.
    #[error("tie `{}={}`: {reason}", shown(.name), shown(.kept))]
    HfTie {
        /// The tensor that would be dropped.
        name: String,
        /// The tensor it is tied to, which is kept.
        kept: String,
        /// Why they cannot be tied.
        reason: String,
    },

    /// A model's `config.json` ties its word embeddings (`tie_word_embeddings`), but names no
    /// architecture of the tie table (`src/io/hf/tied_embeddings.txt`), so which tensor is
    /// tied to which is unknown: the ties must be named (`--tie OUTPUT=INPUT`).
    #[error("`{}`: `tie_word_embeddings` is true, but {} the table of tied embeddings ({}): name each tie with `--tie OUTPUT=INPUT` (`tie=` in Python), e.g. `--tie lm_head.weight=model.embed_tokens.weight`", shown(.config), arch_list(.architectures), .known.join(", "))]
    HfTieArchitecture {
        /// The `config.json`.
        config: String,
        /// Its `architectures` entries (none when it has none).
        architectures: Vec<String>,
        /// The architectures the table knows.
        known: Vec<String>,
    },

    /// A Hugging Face model directory's index and files disagree, or a file is missing: the
    /// index maps a tensor to a file that lacks it, a file holds a tensor the index does not
    /// name or names elsewhere, a tensor is in two files, the index is not JSON.
    #[error("Hugging Face model `{}`{}: {reason}", shown(.file), .key.as_ref().map(|k| format!(", tensor `{}`", shown(k))).unwrap_or_default())]
    HfModelDir {
        /// The file at fault (the index, or a `.safetensors` file).
        file: String,
        /// The tensor, when one is at fault.
        key: Option<String>,
        /// What is wrong.
        reason: String,
    },

    // ----- Megatron-Core checkpoints -----
    /// A Megatron-Core checkpoint cannot be read: its `metadata.json` or
    /// `latest_checkpointed_iteration.txt` is missing, malformed or names what is not there,
    /// or it uses a backend or layout this tool refuses (the legacy `zarr` backend).
    #[error("Megatron checkpoint `{}`: {reason}", shown(.dir))]
    Megatron {
        /// The directory (the tree's root, or the `torch_dist` directory).
        dir: String,
        /// What is wrong, and what to do.
        reason: String,
    },

    // ----- DeepSpeed checkpoints -----
    /// A DeepSpeed checkpoint directory's `latest` names a tag whose directory is missing.
    #[error("DeepSpeed checkpoint `{}`: `latest` names the tag `{}`, but there is no directory `{}` beside it", shown(.dir), shown(.tag), shown(.tag))]
    DeepSpeedMissingTag {
        /// The checkpoint directory (the one holding `latest`).
        dir: String,
        /// The tag `latest` holds.
        tag: String,
    },

    /// The rank files of a DeepSpeed ZeRO checkpoint are not one per rank: a rank's
    /// `*_optim_states.pt` file is missing or given twice, or their number is not the
    /// checkpoint's `partition_count`.
    #[error("DeepSpeed checkpoint `{}`: {reason}", shown(.dir))]
    DeepSpeedRankFiles {
        /// The tag directory.
        dir: String,
        /// The number of ranks the checkpoint needs, when known (`partition_count`).
        expected: Option<usize>,
        /// The ranks whose files were found, in order.
        found: Vec<usize>,
        /// What is wrong.
        reason: String,
    },

    /// A flat partition of a DeepSpeed ZeRO checkpoint holds fewer elements than its layout
    /// needs (the file was cut, or belongs to another model or world size).
    #[error("truncated DeepSpeed partition `{tensor}` in `{}` (rank {rank}): the layout needs {needed} elements{} but it holds {found}", shown(.file), param_suffix(.param))]
    DeepSpeedTruncated {
        /// The rank file.
        file: String,
        /// The rank.
        rank: usize,
        /// The tensor (`single_partition_of_fp32_groups[0]`, `state[1]['exp_avg']`).
        tensor: String,
        /// The first parameter that does not fit, when one does not.
        param: Option<String>,
        /// Elements the layout needs.
        needed: usize,
        /// Elements the tensor holds.
        found: usize,
    },

    /// The files of a DeepSpeed checkpoint disagree with each other or with the ZeRO layout:
    /// shapes, lengths, group paddings, `param_slice_mappings`, steps, names; or a value the
    /// reader needs is missing or of another type.
    #[error("inconsistent DeepSpeed checkpoint file `{}`{}{}: {reason}", shown(.file), rank_suffix(.rank), param_suffix(.param))]
    DeepSpeedInconsistent {
        /// The file.
        file: String,
        /// The rank, when the file is one rank's.
        rank: Option<usize>,
        /// The parameter involved, when one is.
        param: Option<String>,
        /// What is wrong.
        reason: String,
    },

    /// A safetensors file is malformed, holds a dtype the crate does not support, or its
    /// `__metadata__` structure entry (see [`crate::io::safetensors`]) does not match its
    /// tensors.
    #[error("invalid safetensors file `{file}`: {reason}")]
    Safetensors {
        /// The file (or `<memory>`).
        file: String,
        /// What is wrong.
        reason: String,
    },

    /// An input path that is none of the forms the offline tools read
    /// ([`crate::commands::recognize`]): a directory without any form's marker, or a special
    /// file.
    #[error("`{}` is not an input this tool reads: {found}", shown(.path))]
    UnrecognizedInput {
        /// The input path.
        path: String,
        /// What was found there instead (the markers looked for, what it holds).
        found: String,
    },

    /// A file a reader opens (an input, or a file inside an input directory) is not what it
    /// must be: a FIFO, a device, a directory, a socket, a symbolic link loop or a link to
    /// nothing where a regular file was expected (or not a directory where a DeepSpeed tag
    /// directory was). Symbolic links are followed (the rule of
    /// [`crate::storage::read_regular`] and every reader).
    #[error("`{}` is a {found}, not a {expected}", shown(.path))]
    NotRegularInput {
        /// The path opened.
        path: String,
        /// What is there (`FIFO`, `character device`, `directory`, `symbolic link loop`, …).
        found: String,
        /// What was expected (`regular file`, `directory`).
        expected: String,
    },

    /// A checkpoint path whose extension names no supported format.
    #[error("cannot tell the format of `{path}` from its extension: use .pt or .pth (torch.save) or .safetensors")]
    UnknownFileFormat {
        /// The path.
        path: String,
    },

    /// Per-rank optimizer state files do not fit the layout at the world size given by their
    /// number (too few or too many files, or files saved with another model or wrapping).
    #[error("{files} per-rank files were given, but {detail}")]
    WorldSizeMismatch {
        /// Number of rank files given (the world size the layout was computed for).
        files: usize,
        /// What does not fit: which rank, parameter and sizes, and the world sizes that would
        /// fit if any.
        detail: String,
    },

    /// A feature exists in PyTorch but is not supported here.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A crash injected by a test at a named point of a save or reshard (feature
    /// `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[error("injected crash at {point}")]
    InjectedCrash {
        /// The point.
        point: String,
    },
}

/// Where [`Error::UnknownParameter`] looked a parameter name up.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum LookupSite {
    /// The model description's parameters.
    ModelDescription,
    /// The optimizer's param groups in the model description.
    DescriptionParamGroups,
    /// Param group `group` of a state dict loaded into the optimizer `optimizer`.
    LoadedParamGroup {
        /// The group's index.
        group: usize,
        /// The optimizer.
        optimizer: String,
    },
    /// `op` (an FSDP2 state-dict call) on `rank`.
    Fsdp2 {
        /// The call.
        op: String,
        /// The rank.
        rank: usize,
    },
    /// A consolidation, where another rank's optimizer holds the parameter.
    OtherRanksOptimizer,
    /// `param_groups[group]` lists it, but this rank's optimizer does not hold it.
    ParamGroupNotHeld {
        /// The group's index.
        group: usize,
    },
    /// `part` of a state dict being rekeyed (`the state`, `param_groups[0]`) names it, but the
    /// given optimizer does not hold it.
    NotInOptimizer {
        /// The part of the state dict.
        part: String,
    },
    /// The state of a full optimizer state dict names it, but the model description does not.
    FullOptimState,
    /// The optimizer holds it, but the model's layout has no such parameter.
    HeldByOptimizer,
    /// A DeepSpeed checkpoint's parameters or buffers.
    DeepSpeedCheckpoint,
}

impl std::fmt::Display for LookupSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LookupSite::ModelDescription => write!(f, "in the model description"),
            LookupSite::DescriptionParamGroups => {
                write!(
                    f,
                    "in the optimizer's param groups of the model description"
                )
            }
            LookupSite::LoadedParamGroup { group, optimizer } => write!(
                f,
                "in param group {group} of the state dict loaded into {optimizer}"
            ),
            LookupSite::Fsdp2 { op, rank } => write!(f, "in {op} on rank {rank}"),
            LookupSite::OtherRanksOptimizer => write!(f, "(another rank's optimizer holds it)"),
            LookupSite::ParamGroupNotHeld { group } => write!(
                f,
                "listed in param_groups[{group}]: this rank's optimizer does not hold it"
            ),
            LookupSite::NotInOptimizer { part } => {
                write!(f, "in {part}: the given optimizer does not hold it")
            }
            LookupSite::HeldByOptimizer => write!(
                f,
                "held by the optimizer (the model's layout has no such parameter)"
            ),
            LookupSite::DeepSpeedCheckpoint => write!(f, "in the DeepSpeed checkpoint"),
            LookupSite::FullOptimState => write!(
                f,
                "in the state of the full optimizer state dict (not in the model description)"
            ),
        }
    }
}

impl Error {
    /// A `map_err` adapter: the operating-system error `e` while `op` (`reading`, `writing`,
    /// `renaming`, …) on `path`.
    pub fn io(
        op: impl Into<String>,
        path: impl AsRef<Path>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let op = op.into();
        let path = path.as_ref().display().to_string();
        move |e| Error::Io {
            op,
            path,
            source: e.into(),
        }
    }

    /// The `io::ErrorKind` of an [`Error::Io`]; `None` for every other variant.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            Error::Io { source, .. } => Some(source.kind()),
            _ => None,
        }
    }
}

/// An operating-system I/O error as [`Error::Io`] carries it: its `io::ErrorKind`, OS error
/// code and message, in a form that ranks can exchange (serde) and compare.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IoError {
    #[serde(with = "io_kind_serde")]
    kind: std::io::ErrorKind,
    raw_os_error: Option<i32>,
    message: String,
}

impl IoError {
    /// An error of `kind` with `message`, for failures found before any system call (a path
    /// without a file name, a NUL byte in a path).
    pub fn new(kind: std::io::ErrorKind, message: impl Into<String>) -> Self {
        IoError {
            kind,
            raw_os_error: None,
            message: message.into(),
        }
    }

    /// The kind (`NotFound`, `PermissionDenied`, `StorageFull`, …).
    pub fn kind(&self) -> std::io::ErrorKind {
        self.kind
    }

    /// The OS error code (`errno`), when the error came from the OS.
    pub fn raw_os_error(&self) -> Option<i32> {
        self.raw_os_error
    }
}

impl From<std::io::Error> for IoError {
    fn from(e: std::io::Error) -> Self {
        IoError {
            kind: e.kind(),
            raw_os_error: e.raw_os_error(),
            message: e.to_string(),
        }
    }
}

impl std::fmt::Display for IoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for IoError {}

/// `io::ErrorKind` by its name, so that it crosses the wire; a kind this build does not know
/// comes back as `Other`.
mod io_kind_serde {
    use std::io::ErrorKind;

    pub(super) const KINDS: &[ErrorKind] = &[
        ErrorKind::NotFound,
        ErrorKind::PermissionDenied,
        ErrorKind::ConnectionRefused,
        ErrorKind::ConnectionReset,
        ErrorKind::HostUnreachable,
        ErrorKind::NetworkUnreachable,
        ErrorKind::ConnectionAborted,
        ErrorKind::NotConnected,
        ErrorKind::AddrInUse,
        ErrorKind::AddrNotAvailable,
        ErrorKind::NetworkDown,
        ErrorKind::BrokenPipe,
        ErrorKind::AlreadyExists,
        ErrorKind::WouldBlock,
        ErrorKind::NotADirectory,
        ErrorKind::IsADirectory,
        ErrorKind::DirectoryNotEmpty,
        ErrorKind::ReadOnlyFilesystem,
        ErrorKind::StaleNetworkFileHandle,
        ErrorKind::InvalidInput,
        ErrorKind::InvalidData,
        ErrorKind::TimedOut,
        ErrorKind::WriteZero,
        ErrorKind::StorageFull,
        ErrorKind::NotSeekable,
        ErrorKind::QuotaExceeded,
        ErrorKind::FileTooLarge,
        ErrorKind::ResourceBusy,
        ErrorKind::ExecutableFileBusy,
        ErrorKind::Deadlock,
        ErrorKind::CrossesDevices,
        ErrorKind::TooManyLinks,
        ErrorKind::ArgumentListTooLong,
        ErrorKind::Interrupted,
        ErrorKind::Unsupported,
        ErrorKind::UnexpectedEof,
        ErrorKind::OutOfMemory,
        ErrorKind::Other,
    ];

    pub fn serialize<S: serde::Serializer>(kind: &ErrorKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{kind:?}"))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ErrorKind, D::Error> {
        let name: String = serde::Deserialize::deserialize(d)?;
        Ok(KINDS
            .iter()
            .copied()
            .find(|k| format!("{k:?}") == name)
            .unwrap_or(ErrorKind::Other))
    }
}

/// One rank's stored copy of a DCP item ([`Error::DcpReplicasDiffer`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredCopy {
    /// The rank that saved it.
    pub rank: usize,
    /// Its data file, relative to the checkpoint directory.
    pub file: String,
    /// The start of its byte range.
    pub offset: u64,
    /// The length of its byte range.
    pub length: u64,
}

impl std::fmt::Display for StoredCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` bytes {}..+{}",
            shown(&self.file),
            self.offset,
            self.length
        )
    }
}

/// The longest user-supplied name (a key, a file name from a checkpoint's metadata, a Python
/// global) a message quotes whole, in characters.
pub(crate) const SHOWN_NAME_CHARS: usize = 200;

/// A user-supplied name as a message quotes it: whole up to [`SHOWN_NAME_CHARS`] characters;
/// a longer one as its first 160 and last 30 characters around the count left out, so that
/// a hostile 5000-character key cannot flood the terminal. Control characters (a NUL byte,
/// an escape sequence, a newline) are escaped as Rust writes them (`\0`, `\u{1b}`, `\n`),
/// never echoed raw.
pub(crate) fn shown(name: &str) -> std::borrow::Cow<'_, str> {
    let name: std::borrow::Cow<'_, str> = if name.chars().any(char::is_control) {
        name.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_debug().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect::<String>()
            .into()
    } else {
        name.into()
    };
    let n = name.chars().count();
    if n <= SHOWN_NAME_CHARS {
        return name;
    }
    let head: String = name.chars().take(160).collect();
    let tail: String = name.chars().skip(n - 30).collect();
    format!("{head}…[{} characters left out]…{tail}", n - 190).into()
}

fn arch_list(architectures: &[String]) -> String {
    match architectures {
        [] => "it names no architecture (`architectures`) from".into(),
        [one] => format!("its architecture `{}` is not in", shown(one)),
        many => format!(
            "its architectures {} are not all in",
            many.iter()
                .map(|a| format!("`{}`", shown(a)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn group_prefix(group: &Option<usize>) -> String {
    group
        .map(|g| format!("param group {g}: "))
        .unwrap_or_default()
}

fn format_group_mismatch(group: &Option<usize>, expected: usize, found: usize) -> String {
    match group {
        None => format!("loaded state dict has a different number of parameter groups: expected {expected}, found {found}"),
        Some(g) => format!("loaded state dict contains a parameter group that doesn't match the size of optimizer's group: group {g} has {found} parameters, expected {expected}"),
    }
}

fn format_missing_state(param: &str, state: &str) -> String {
    if state.is_empty() {
        format!("{param} has no optimizer state")
    } else {
        format!("state of {param} has no `{state}`")
    }
}

fn rank_suffix(rank: &Option<usize>) -> String {
    rank.map(|r| format!(" (rank {r})")).unwrap_or_default()
}

fn param_suffix(param: &Option<String>) -> String {
    param
        .as_ref()
        .map(|p| format!(" for parameter `{}`", shown(p)))
        .unwrap_or_default()
}

fn entry_suffix(entry: &Option<String>) -> String {
    entry
        .as_ref()
        .map(|e| format!(", entry `{e}`"))
        .unwrap_or_default()
}

fn format_missing(missing: &[(usize, Vec<Vec<String>>)]) -> String {
    let mut s = String::new();
    for (rank, keys) in missing {
        s.push_str(&format!(
            "\nRank {rank} is missing states for the parameters: {keys:?}"
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_keep_their_kind_across_the_wire() {
        for (i, kind) in io_kind_serde::KINDS.iter().enumerate() {
            let os = std::io::Error::new(*kind, format!("failure {i}"));
            let err = Error::io("reading", "/some/file")(os);
            let json = serde_json::to_string(&err).unwrap();
            let back: Error = serde_json::from_str(&json).unwrap();
            assert_eq!(back, err);
            assert_eq!(back.io_kind(), Some(*kind), "{json}");
            assert_eq!(
                back.to_string(),
                format!("I/O error while reading `/some/file`: failure {i}")
            );
        }
    }

    #[test]
    fn an_os_error_keeps_its_code() {
        let err = Error::io("opening", "x")(std::io::Error::from_raw_os_error(libc::ENOSPC));
        let Error::Io { source, .. } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(source.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(err.io_kind(), Some(std::io::ErrorKind::StorageFull));
    }
}

#[cfg(test)]
mod shown_tests {
    use super::*;

    #[test]
    fn a_long_user_name_is_quoted_shortened_with_the_count_left_out() {
        assert_eq!(shown("optim.param_groups.0.lr"), "optim.param_groups.0.lr");
        let long = "k".repeat(5000);
        let e = Error::DcpPlannerData {
            file: "ckpt/.metadata".into(),
            key: long,
            reason: "bad".into(),
        };
        let text = e.to_string();
        assert!(text.len() < 400, "{} characters: {text}", text.len());
        assert!(text.contains("[4810 characters left out]"), "{text}");
    }
}
