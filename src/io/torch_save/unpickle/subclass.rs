//! The tensor subclasses of distributed optimizer state: FSDP1's `ShardedTensor`
//! (`SHARDED_STATE_DICT`) and FSDP2's `DTensor`, each read as this rank's local shard plus
//! the global metadata (global shape, the shard's offsets).
//!
//! Both are pickled through `torch._tensor._rebuild_from_type_v2(
//! torch._utils._rebuild_wrapper_subclass, <class>, args, state)`, whose state holds plain
//! metadata objects (`ShardMetadata`, `DTensorSpec`, `DeviceMesh`, placements, …). Those
//! classes are allow-listed as inert records ([`Class`]): their attributes are kept as data
//! and nothing of theirs runs. Anything else (a `_StridedShard` or `Partial` placement, a
//! process group) stays an unsupported global.

use super::{Ext, Node, Object, Vm, V};
use crate::error::Result;
use std::rc::Rc;

/// A distributed tensor as the stream describes it, before its local shard is built.
#[derive(Debug)]
pub(super) struct ShardedView {
    pub global_shape: Vec<usize>,
    pub offsets: Vec<usize>,
    /// The local shard (a tensor), `None` when this rank holds none.
    pub local: Option<V>,
}

/// The metadata classes the stream may instantiate (`NEWOBJ`, `REDUCE`) and `BUILD`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    ShardedTensor,
    DTensor,
    ProcessGroupState,
    Shard,
    ShardMetadata,
    ShardedTensorMetadata,
    TensorProperties,
    MemoryFormat,
    RemoteDevice,
    ChunkShardingSpec,
    EnumerableShardingSpec,
    DTensorSpec,
    TensorMeta,
    ShardOrderEntry,
    ShardPlacement,
    Replicate,
    DeviceMesh,
    MeshLayout,
    FlatLayout,
    Device,
    Layout,
    /// `deepspeed.runtime.fp16.loss_scaler.LossScaler` (only with [`super::Allow::DeepSpeed`]).
    LossScaler,
    /// `deepspeed.runtime.zero.config.ZeroStageEnum` (only with [`super::Allow::DeepSpeed`]).
    ZeroStageEnum,
    /// `deepspeed.utils.tensor_fragment.fragment_address` (only with
    /// [`super::Allow::DeepSpeed`]).
    FragmentAddress,
}

impl Class {
    /// The allow-listed class `module.name`, if it is one.
    pub(super) fn resolve(module: &str, name: &str) -> Option<Class> {
        const ST: &str = "torch.distributed._shard.sharded_tensor";
        Some(match (module, name) {
            (m, "ShardedTensor") if m == format!("{ST}.api") => Class::ShardedTensor,
            (m, "Shard") if m == format!("{ST}.shard") => Class::Shard,
            (m, "ShardedTensorMetadata") if m == format!("{ST}.metadata") => {
                Class::ShardedTensorMetadata
            }
            (m, "TensorProperties") if m == format!("{ST}.metadata") => Class::TensorProperties,
            (m, "MEM_FORMAT_ENCODING") if m == format!("{ST}.metadata") => Class::MemoryFormat,
            ("torch.distributed._shard.metadata", "ShardMetadata") => Class::ShardMetadata,
            ("torch.distributed.remote_device", "_remote_device") => Class::RemoteDevice,
            ("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec") => {
                Class::ChunkShardingSpec
            }
            ("torch.distributed._shard.sharding_spec.api", "EnumerableShardingSpec") => {
                Class::EnumerableShardingSpec
            }
            ("torch.distributed.tensor", "DTensor") => Class::DTensor,
            ("torch.distributed.tensor._dtensor_spec", "DTensorSpec") => Class::DTensorSpec,
            ("torch.distributed.tensor._dtensor_spec", "TensorMeta") => Class::TensorMeta,
            ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry") => Class::ShardOrderEntry,
            ("torch.distributed.tensor.placement_types", "Shard") => Class::ShardPlacement,
            ("torch.distributed.tensor.placement_types", "Replicate") => Class::Replicate,
            ("torch.distributed.device_mesh", "DeviceMesh") => Class::DeviceMesh,
            ("torch.distributed._mesh_layout", "_MeshLayout") => Class::MeshLayout,
            ("torch.distributed._mesh_layout", "_FlatLayout") => Class::FlatLayout,
            ("torch", "device") => Class::Device,
            ("torch.serialization", "_get_layout") => Class::Layout,
            _ => return None,
        })
    }
}

impl Vm<'_, '_> {
    /// The record's attribute `name`.
    fn attr(&self, rec: &V, class: Class, name: &str) -> Result<V> {
        if let Some(Object::Record { class: c, attrs }) = self.object(rec) {
            if *c == class {
                return attrs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
                    .ok_or_else(|| self.err(format!("{class:?} without `{name}`")));
            }
        }
        Err(self.err(format!("expected a {class:?}, found {}", self.kind(rec))))
    }

    /// The items of a list or tuple.
    fn seq_items(&self, v: &V, what: &str) -> Result<Vec<V>> {
        match self.node(v) {
            Some(Node::List(x) | Node::Tuple(x)) => Ok(x.clone()),
            _ => Err(self.err(format!(
                "{what} must be a list or tuple, found {}",
                self.kind(v)
            ))),
        }
    }

    fn int_list(&self, v: &V, what: &str) -> Result<Vec<usize>> {
        self.seq_items(v, what)?
            .iter()
            .map(|x| self.int_arg(x, what))
            .collect()
    }

    /// `_rebuild_from_type_v2(_rebuild_wrapper_subclass, class, args, state)` for a
    /// `ShardedTensor` or `DTensor`.
    pub(super) fn rebuild_subclass(&mut self, class: Class, args: &[V], state: &V) -> Result<V> {
        // args: (class, dtype, size, stride, storage_offset, layout, device, requires_grad).
        let global_shape = match args.get(2) {
            Some(size) => self.int_tuple(size, "the wrapper's size")?,
            None => return Err(self.err("_rebuild_wrapper_subclass needs a size")),
        };
        let sharded = match class {
            Class::ShardedTensor => self.sharded_tensor(global_shape, state)?,
            Class::DTensor => self.dtensor(global_shape, state)?,
            other => return Err(self.err(format!("{other:?} is not a tensor subclass"))),
        };
        Ok(V::Ext(Ext::Sharded(Rc::new(sharded))))
    }

    /// A `ShardedTensor`: state `(local_shards, metadata, pg_state, sharding_spec,
    /// init_rrefs)`; each local shard has its offsets and sizes in its `ShardMetadata`.
    fn sharded_tensor(&self, global_shape: Vec<usize>, state: &V) -> Result<ShardedView> {
        let st = self.seq_items(state, "the ShardedTensor state")?;
        let [shards, meta, ..] = st.as_slice() else {
            return Err(self.err("the ShardedTensor state is too short"));
        };
        let size = self.attr(meta, Class::ShardedTensorMetadata, "size")?;
        if self.int_tuple(&size, "ShardedTensorMetadata.size")? != global_shape {
            return Err(self.err("ShardedTensor: metadata and wrapper sizes differ"));
        }
        let shards = self.seq_items(shards, "local_shards")?;
        let (local, offsets) = match shards.as_slice() {
            [] => (None, global_shape.clone()),
            [shard] => {
                let tensor = self.attr(shard, Class::Shard, "tensor")?;
                let md = self.attr(shard, Class::Shard, "metadata")?;
                let offsets = self.int_list(
                    &self.attr(&md, Class::ShardMetadata, "shard_offsets")?,
                    "shard_offsets",
                )?;
                let sizes = self.int_list(
                    &self.attr(&md, Class::ShardMetadata, "shard_sizes")?,
                    "shard_sizes",
                )?;
                let V::Ext(Ext::Tensor(view)) = &tensor else {
                    return Err(self.err("a ShardedTensor shard without a tensor"));
                };
                if view.size != sizes {
                    return Err(self.err(format!(
                        "ShardedTensor shard of size {:?} declared as {sizes:?}",
                        view.size
                    )));
                }
                self.check_piece(&global_shape, &offsets, &sizes)?;
                (Some(tensor), offsets)
            }
            more => {
                return Err(self.err(format!(
                    "a ShardedTensor with {} local shards on one rank is not supported",
                    more.len()
                )))
            }
        };
        Ok(ShardedView {
            global_shape,
            offsets,
            local,
        })
    }

    /// A `DTensor`: state `(None, {"_local_tensor": t, "_spec": DTensorSpec})`. On a 1-D mesh
    /// a `Shard(d)` placement gives this rank `torch.chunk`'s piece `coordinate` along `d`; a
    /// `Replicate` one the whole tensor.
    fn dtensor(&self, global_shape: Vec<usize>, state: &V) -> Result<ShardedView> {
        let dict = match self.seq_items(state, "the DTensor state")?.as_slice() {
            [V::None, d] => d.clone(),
            _ => return Err(self.err("the DTensor state must be (None, dict)")),
        };
        let get = |name: &str| -> Result<V> {
            if let Some(Node::Dict(d)) = self.node(&dict) {
                if let Some((_, v)) = d
                    .items()
                    .iter()
                    .find(|(k, _)| matches!(k, V::Str(s) if &**s == name))
                {
                    return Ok(v.clone());
                }
            }
            Err(self.err(format!("the DTensor state has no `{name}`")))
        };
        let local = get("_local_tensor")?;
        let V::Ext(Ext::Tensor(view)) = &local else {
            return Err(self.err("DTensor._local_tensor is not a tensor"));
        };
        let spec = get("_spec")?;
        let mesh = self.attr(&spec, Class::DTensorSpec, "mesh")?;
        let coords = self.int_tuple(
            &self.attr(&mesh, Class::DeviceMesh, "_coordinate_on_dim")?,
            "DeviceMesh._coordinate_on_dim",
        )?;
        let layout = self.attr(&mesh, Class::DeviceMesh, "_layout")?;
        // One `_FlatLayout` per mesh dimension, each of a (possibly flattened) shape.
        let mut mesh_shape = Vec::new();
        for axis in self.seq_items(&self.attr(&layout, Class::MeshLayout, "axes")?, "axes")? {
            let shape = self.int_tuple(&self.attr(&axis, Class::FlatLayout, "shape")?, "shape")?;
            mesh_shape.push(shape.iter().product::<usize>());
        }
        let placements = self.seq_items(
            &self.attr(&spec, Class::DTensorSpec, "placements")?,
            "DTensorSpec.placements",
        )?;
        let ([n], [c], [placement]) = (&mesh_shape[..], &coords[..], &placements[..]) else {
            return Err(self.err(format!(
                "a DTensor on a mesh of shape {mesh_shape:?} is not supported (1-D meshes are)"
            )));
        };
        let mut offsets = vec![0; global_shape.len()];
        let mut expected = global_shape.clone();
        if let Ok(dim) = self.attr(placement, Class::ShardPlacement, "dim") {
            let d = self.int_arg(&dim, "Shard.dim")?;
            let Some(&len) = global_shape.get(d) else {
                return Err(self.err(format!("Shard({d}) of a {}-D tensor", global_shape.len())));
            };
            let chunk = len.div_ceil((*n).max(1));
            offsets[d] = c.saturating_mul(chunk).min(len);
            expected[d] = chunk.min(len - offsets[d]);
        } else if !self.is_record(placement, Class::Replicate) {
            return Err(self.err(format!(
                "unsupported DTensor placement {}",
                self.kind(placement)
            )));
        }
        if view.size != expected {
            return Err(self.err(format!(
                "DTensor local tensor of size {:?}, but the placement gives rank coordinate {c} of {n} a {expected:?} piece of {global_shape:?}",
                view.size
            )));
        }
        Ok(ShardedView {
            global_shape,
            offsets,
            local: Some(local),
        })
    }

    /// `BUILD` of a record: a dict state, or a `(dict or None, dict or None)` (state,
    /// slot state) pair, sets attributes; any other state (a `TensorProperties` tuple) is
    /// kept whole as `__state__`.
    pub(super) fn build_record(&mut self, i: usize, state: V) -> Result<()> {
        let dict_attrs = |vm: &Self, v: &V| -> Option<Vec<(String, V)>> {
            match (v, vm.node(v)) {
                (V::None, _) => Some(Vec::new()),
                (_, Some(Node::Dict(d))) => d
                    .items()
                    .iter()
                    .map(|(k, v)| match k {
                        V::Str(k) => Some((k.to_string(), v.clone())),
                        _ => None,
                    })
                    .collect(),
                _ => None,
            }
        };
        let new = match (dict_attrs(self, &state), self.tuple_items(&state)) {
            (Some(a), _) => a,
            (None, Some([a, b])) => match (dict_attrs(self, a), dict_attrs(self, b)) {
                (Some(mut a), Some(b)) => {
                    a.extend(b);
                    a
                }
                _ => vec![("__state__".to_string(), state.clone())],
            },
            _ => vec![("__state__".to_string(), state.clone())],
        };
        if let Some(Node::Ext(Object::Record { attrs, .. })) = self.node_mut(i) {
            for (k, v) in new {
                match attrs.iter_mut().find(|(n, _)| *n == k) {
                    Some(slot) => slot.1 = v,
                    None => attrs.push((k, v)),
                }
            }
        }
        Ok(())
    }

    fn is_record(&self, v: &V, class: Class) -> bool {
        matches!(self.object(v), Some(Object::Record { class: c, .. }) if *c == class)
    }

    /// Checks that a piece at `offsets` of `sizes` lies inside `global`.
    fn check_piece(&self, global: &[usize], offsets: &[usize], sizes: &[usize]) -> Result<()> {
        let inside = global.len() == offsets.len()
            && global.len() == sizes.len()
            && global
                .iter()
                .zip(offsets.iter().zip(sizes))
                .all(|(&g, (&o, &s))| o.checked_add(s).is_some_and(|e| e <= g));
        if inside {
            Ok(())
        } else {
            Err(self.err(format!(
                "a shard at {offsets:?} of size {sizes:?} does not fit in {global:?}"
            )))
        }
    }
}
