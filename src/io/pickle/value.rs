//! What the machine's stack, memo and arena hold: Python's plain values, containers by arena
//! index, and what a format adds (its globals `G`, stack values `X` and arena nodes `N`).

use std::collections::HashMap;
use std::rc::Rc;

/// A value on the stack or in the memo.
#[derive(Debug, Clone)]
pub(crate) enum Value<G, X> {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside 64 bits: its little-endian two's-complement bytes, shortest form.
    BigInt(Rc<[u8]>),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    /// An allow-listed global, as the format resolved it.
    Global(G),
    /// A node of the arena, by index: shared references and cycles stay indices.
    Obj(usize),
    /// A value only the format builds (a tensor, a storage record).
    Ext(X),
}

/// A node of the arena: a container, or something only the format builds.
#[derive(Debug)]
pub(crate) enum Node<G, X, N> {
    Tuple(Vec<Value<G, X>>),
    List(Vec<Value<G, X>>),
    Dict(Dict<G, X>),
    Ext(N),
}

/// A dict item: key and value.
pub(crate) type Item<G, X> = (Value<G, X>, Value<G, X>);

/// The items of a dict, in insertion order.
#[derive(Debug)]
pub(crate) struct Dict<G, X> {
    items: Vec<Item<G, X>>,
    /// Position of each key [`Dict::insert`] can compare in `items`.
    index: HashMap<Key, usize>,
}

impl<G, X> Default for Dict<G, X> {
    fn default() -> Self {
        Dict {
            items: Vec::new(),
            index: HashMap::new(),
        }
    }
}

/// Hashable identity of a dict key, for Python's replace-on-equal-key semantics.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    None,
    Int(i64),
    Float(u64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
}

impl<G, X> Dict<G, X> {
    /// The (key, value) pairs, in insertion order.
    pub(crate) fn items(&self) -> &[Item<G, X>] {
        &self.items
    }

    /// Whether the dict holds no item.
    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Appends the pair `k: v`, even if an equal key is there already (the reader then
    /// applies Python's semantics where it reads the dict).
    pub(crate) fn push(&mut self, k: Value<G, X>, v: Value<G, X>) {
        self.items.push((k, v));
    }

    /// Sets `k` to `v` as Python does for the keys it can compare here (None, bool, int,
    /// float, str, bytes): an equal key's value is replaced in its place. Other keys are
    /// appended.
    pub(crate) fn insert(&mut self, k: Value<G, X>, v: Value<G, X>) {
        let key = match &k {
            Value::None => Some(Key::None),
            Value::Bool(b) => Some(Key::Int(i64::from(*b))),
            Value::Int(i) => Some(Key::Int(*i)),
            Value::Float(x) => Some(Key::Float(x.to_bits())),
            Value::Str(s) => Some(Key::Str(s.clone())),
            Value::Bytes(b) => Some(Key::Bytes(b.clone())),
            _ => None,
        };
        match key {
            Some(key) => match self.index.get(&key) {
                Some(&i) => self.items[i].1 = v,
                None => {
                    self.index.insert(key, self.items.len());
                    self.items.push((k, v));
                }
            },
            None => self.items.push((k, v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type V = Value<(), ()>;

    fn keys(d: &Dict<(), ()>) -> Vec<String> {
        d.items()
            .iter()
            .map(|(k, v)| format!("{k:?}={v:?}"))
            .collect()
    }

    #[test]
    fn insert_replaces_an_equal_key_in_place_and_push_keeps_every_pair() {
        let mut replace = Dict::default();
        let mut keep = Dict::default();
        for (k, v) in [
            (V::Str("a".into()), V::Int(1)),
            (V::Bool(true), V::Int(2)),
            (V::Int(1), V::Int(3)),
            (V::Str("a".into()), V::Int(4)),
        ] {
            replace.insert(k.clone(), v.clone());
            keep.push(k, v);
        }
        // `True == 1` in Python: the int key replaces the bool's value.
        assert_eq!(keys(&replace), ["Str(\"a\")=Int(4)", "Bool(true)=Int(3)"]);
        assert_eq!(keep.items().len(), 4);
    }
}
