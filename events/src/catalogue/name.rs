//! An event's name as its JSON form spells it (the serde variant name, `vm_state_changed`),
//! read without serializing its fields: the feed and every timeline name each event they
//! render, and a JSON tree per event for its first key cost more than the rest of a render.

use std::fmt;

use serde::ser::{self, Impossible, Serialize, Serializer};

/// The name of the enum variant `value` serializes as, or `None` if it is not an enum
/// variant.
pub(super) fn variant_name<T: Serialize + ?Sized>(value: &T) -> Option<&'static str> {
    value.serialize(VariantName).ok()
}

/// What the serializer answers for anything but an enum variant.
#[derive(Debug)]
pub(super) struct NotAVariant;

impl fmt::Display for NotAVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not an enum variant")
    }
}

impl std::error::Error for NotAVariant {}

impl ser::Error for NotAVariant {
    fn custom<T: fmt::Display>(_: T) -> Self {
        NotAVariant
    }
}

/// A serializer that keeps the variant's name and skips every field.
struct VariantName;

/// A variant with fields: they are skipped, the name is the result.
struct Named(&'static str);

impl ser::SerializeStructVariant for Named {
    type Ok = &'static str;
    type Error = NotAVariant;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        _: &'static str,
        _: &T,
    ) -> Result<(), NotAVariant> {
        Ok(())
    }
    fn end(self) -> Result<&'static str, NotAVariant> {
        Ok(self.0)
    }
}

impl ser::SerializeTupleVariant for Named {
    type Ok = &'static str;
    type Error = NotAVariant;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &T) -> Result<(), NotAVariant> {
        Ok(())
    }
    fn end(self) -> Result<&'static str, NotAVariant> {
        Ok(self.0)
    }
}

/// Every method for a value that is not an enum variant refuses it.
macro_rules! not_a_variant {
    ($($method:ident($($arg:ty),*);)*) => {
        $(fn $method(self, $(_: $arg),*) -> Result<&'static str, NotAVariant> {
            Err(NotAVariant)
        })*
    };
}

type Refused = Impossible<&'static str, NotAVariant>;

impl Serializer for VariantName {
    type Ok = &'static str;
    type Error = NotAVariant;
    type SerializeSeq = Refused;
    type SerializeTuple = Refused;
    type SerializeTupleStruct = Refused;
    type SerializeTupleVariant = Named;
    type SerializeMap = Refused;
    type SerializeStruct = Refused;
    type SerializeStructVariant = Named;

    not_a_variant! {
        serialize_bool(bool);
        serialize_i8(i8);
        serialize_i16(i16);
        serialize_i32(i32);
        serialize_i64(i64);
        serialize_u8(u8);
        serialize_u16(u16);
        serialize_u32(u32);
        serialize_u64(u64);
        serialize_f32(f32);
        serialize_f64(f64);
        serialize_char(char);
        serialize_str(&str);
        serialize_bytes(&[u8]);
        serialize_none();
        serialize_unit();
        serialize_unit_struct(&'static str);
    }

    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<&'static str, NotAVariant> {
        Err(NotAVariant)
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<&'static str, NotAVariant> {
        Ok(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: &T,
    ) -> Result<&'static str, NotAVariant> {
        Err(NotAVariant)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: &T,
    ) -> Result<&'static str, NotAVariant> {
        Ok(variant)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Refused, NotAVariant> {
        Err(NotAVariant)
    }
    fn serialize_tuple(self, _: usize) -> Result<Refused, NotAVariant> {
        Err(NotAVariant)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Refused, NotAVariant> {
        Err(NotAVariant)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Named, NotAVariant> {
        Ok(Named(variant))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Refused, NotAVariant> {
        Err(NotAVariant)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Refused, NotAVariant> {
        Err(NotAVariant)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Named, NotAVariant> {
        Ok(Named(variant))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalogue::samples;

    #[test]
    fn every_events_name_is_the_first_key_of_its_json_form() {
        // Given one sample of every event
        for event in samples::all() {
            // When its name is read without serializing it
            let name = variant_name(&event);
            // Then it is the key its JSON form is tagged with
            let json = serde_json::to_value(&event).expect("an event serializes");
            let tag = match &json {
                serde_json::Value::Object(map) => map.keys().next().cloned(),
                serde_json::Value::String(s) => Some(s.clone()),
                _ => None,
            };
            assert_eq!(name.map(str::to_string), tag, "{json}");
        }
    }

    #[test]
    fn a_value_that_is_not_a_variant_has_no_name() {
        assert_eq!(variant_name(&3u8), None);
        assert_eq!(variant_name("text"), None);
        assert_eq!(variant_name(&vec![1, 2]), None);
    }
}
