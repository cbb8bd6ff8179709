//! [`ResourceMap`]: resources by resource class (`VCPU: 2`, `MEMORY_MB: 4096`), as an
//! instance claims them and an allocation holds them. A projection holds one per instance
//! and one per allocation, a million of each on a large cloud, and each holds one to three
//! classes: a `BTreeMap`'s smallest node has room for eleven, about 370 bytes for one
//! class; this sorted `Vec` holds exactly what it has. It serialises as the map it replaces,
//! byte for byte (stored entities keep their format).

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Resource class → amount, sorted by class, each class once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ResourceMap(Vec<(String, u64)>);

impl ResourceMap {
    pub fn get(&self, class: &str) -> Option<&u64> {
        self.0
            .binary_search_by(|(c, _)| c.as_str().cmp(class))
            .ok()
            .map(|i| &self.0[i].1)
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&String, &u64)> + '_ {
        self.0.iter().map(|(c, a)| (c, a))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// As the map views and events carry.
    pub fn to_map(&self) -> BTreeMap<String, u64> {
        self.0.iter().cloned().collect()
    }
}

impl From<&BTreeMap<String, u64>> for ResourceMap {
    fn from(map: &BTreeMap<String, u64>) -> Self {
        // Already sorted and unique: a BTreeMap's order.
        let mut v: Vec<(String, u64)> = map.iter().map(|(c, a)| (c.clone(), *a)).collect();
        v.shrink_to_fit();
        ResourceMap(v)
    }
}

impl From<BTreeMap<String, u64>> for ResourceMap {
    fn from(map: BTreeMap<String, u64>) -> Self {
        let mut v: Vec<(String, u64)> = map.into_iter().collect();
        v.shrink_to_fit();
        ResourceMap(v)
    }
}

impl<'a> IntoIterator for &'a ResourceMap {
    type Item = (&'a String, &'a u64);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, u64)>,
        fn(&'a (String, u64)) -> (&'a String, &'a u64),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(c, a)| (c, a))
    }
}

impl Serialize for ResourceMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(c, a)| (c, a)))
    }
}

impl<'de> Deserialize<'de> for ResourceMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::<String, u64>::deserialize(deserializer).map(ResourceMap::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_reads_and_serialises_as_the_map_it_replaces() {
        // Given a map of classes, made out of order
        let map = BTreeMap::from([
            ("VCPU".to_string(), 2),
            ("MEMORY_MB".to_string(), 4096),
            ("DISK_GB".to_string(), 20),
        ]);
        let compact = ResourceMap::from(&map);
        // Then it reads as the map, in the map's order
        assert_eq!(compact.get("VCPU"), Some(&2));
        assert_eq!(compact.get("GPU"), None);
        assert_eq!(compact.to_map(), map);
        assert_eq!(
            compact.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>(),
            ["DISK_GB", "MEMORY_MB", "VCPU"]
        );
        // And its stored and JSON forms are the map's, byte for byte, both ways
        let config = bincode::config::standard();
        let stored = bincode::serde::encode_to_vec(&compact, config).expect("encode");
        assert_eq!(
            stored,
            bincode::serde::encode_to_vec(&map, config).expect("encode")
        );
        let (back, _): (ResourceMap, usize) =
            bincode::serde::decode_from_slice(&stored, config).expect("decode");
        assert_eq!(back, compact);
        assert_eq!(
            serde_json::to_string(&compact).expect("json"),
            serde_json::to_string(&map).expect("json")
        );
    }
}
