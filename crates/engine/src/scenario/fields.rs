//! The fields a section's `Deserialize` impl reads, asked of the impl itself: serde's derive
//! hands its field list to `Deserializer::deserialize_struct`, and a deserializer that only
//! records that list answers `keys_of` without a hand-kept copy.

use serde::de::{self, DeserializeOwned, Visitor};

/// The fields `T` deserializes, in declaration order; empty when `T` is not a struct.
pub(super) fn of<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut fields: &'static [&'static str] = &[];
    // The probe always fails: it has recorded the list by then.
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

struct Probe<'a>(&'a mut &'static [&'static str]);

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("only a struct's fields are probed"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = fields;
        Err(de::Error::custom("fields recorded"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}
