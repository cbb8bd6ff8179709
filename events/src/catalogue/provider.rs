//! Value types of the `provider` aggregate (Placement resource providers).

use std::fmt;

use schemars::JsonSchema;
use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

/// One resource class's inventory on a provider.
/// Capacity is `(total - reserved) * allocation_ratio`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Inventory {
    pub total: u64,
    pub reserved: u64,
    pub allocation_ratio: Ratio,
    pub min_unit: u64,
    pub max_unit: u64,
    pub step_size: u64,
}

impl Inventory {
    /// `(total - reserved) * ratio`, rounded down, in whole units.
    pub fn capacity(&self) -> u64 {
        let base = u128::from(self.total.saturating_sub(self.reserved));
        let cap = base * u128::from(self.allocation_ratio.0) / u128::from(Ratio::SCALE);
        u64::try_from(cap).unwrap_or(u64::MAX)
    }
}

/// An allocation ratio in thousandths, so that capacity arithmetic is exact and
/// deterministic (no `f64` in the ledger). JSON shows it as a number such as `1.5`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ratio(pub u32);

impl Ratio {
    pub const SCALE: u32 = 1000;
    pub const ONE: Ratio = Ratio(1000);

    pub fn from_f64(value: f64) -> Result<Self, InvalidRatio> {
        if !value.is_finite() || value <= 0.0 || value > 1_000_000.0 {
            return Err(InvalidRatio { value });
        }
        Ok(Ratio((value * f64::from(Self::SCALE)).round() as u32))
    }

    pub fn as_f64(self) -> f64 {
        f64::from(self.0) / f64::from(Self::SCALE)
    }
}

/// An allocation ratio out of range.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("allocation_ratio {value} must be a positive number up to 1e6")]
pub struct InvalidRatio {
    pub value: f64,
}

impl fmt::Display for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.as_f64())
    }
}

impl Serialize for Ratio {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_f64(self.as_f64())
        } else {
            s.serialize_u32(self.0)
        }
    }
}

// Written by hand because the Serialize above is: JSON shows thousandths as a number.
impl JsonSchema for Ratio {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Ratio".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "An allocation ratio, stored in thousandths: a positive number up to 1e6 (`1.5`).",
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1_000_000
        })
    }
}

impl<'de> Deserialize<'de> for Ratio {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            Ratio::from_f64(f64::deserialize(d)?).map_err(de::Error::custom)
        } else {
            Ok(Ratio(u32::deserialize(d)?))
        }
    }
}

/// What kind of consumer holds an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConsumerKind {
    Instance,
    Migration,
}

/// Why an allocation still pins a provider that someone wants to delete (Nova seed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AllocationHold {
    /// An instance that runs on this provider.
    Instance,
    /// A migration that is not yet confirmed or reverted.
    UnconfirmedMigration,
    /// An instance that was evacuated elsewhere; the source allocation was never cleaned.
    EvacuationResidue,
    /// Its consumer is gone (a deleted instance, a finished migration): an orphan.
    Orphan,
}

/// One allocation that blocks a provider delete, and why it is there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BlockingAllocation {
    pub consumer: uuid::Uuid,
    pub consumer_kind: ConsumerKind,
    pub hold: AllocationHold,
}
