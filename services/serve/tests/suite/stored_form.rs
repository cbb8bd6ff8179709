//! The stored form of entities, pinned: what serve wrote to sled yesterday it must read
//! today. Given an instance placed with an allocation, and its provider / when encoded as
//! serve stores them / then the bytes are those written before the states changed shape
//! in memory (boxed, compact resource maps: issue 23), and they decode back equal.

use provledger_events::AggregateId;
use provledger_projections::Projection;
use provledger_serve::{decode_entity, encode_entity, ENTITY_FORMAT};
use provledger_tests::script;
use provledger_tests::workload::{instance_claim, instance_lifecycle, provider_on};
use uuid::Uuid;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn stored() -> Vec<(AggregateId, String)> {
    let provider = Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_00f0_0001);
    let instance = Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_00b0_0001);
    let steps = vec![
        (AggregateId::provider(provider), provider_on("cn1", 16)),
        (
            AggregateId::instance(instance),
            instance_lifecycle(1, 1, provider),
        ),
        (AggregateId::provider(provider), instance_claim(instance)),
    ];
    let projection = Projection::rebuild(&script::seal(&steps));
    [
        AggregateId::instance(instance),
        AggregateId::provider(provider),
    ]
    .into_iter()
    .map(|id| {
        let entity = projection.get(&id).expect("folded");
        let bytes = encode_entity(entity).expect("encode");
        assert_eq!(&decode_entity(&bytes).expect("decode"), entity);
        (id, hex(&bytes))
    })
    .collect()
}

/// Written by the code before issue 23's change (commit bea50a2), after the format byte
/// (`ENTITY_FORMAT`, 7 then: the bump to 8 changed operations only), with one change since:
/// format 10 adds the header's `trace` after `anomaly_count`, one `00` byte for none (the
/// store refolds a format-9 store once on open).
const INSTANCE: &str = "01011001900000000070008000000000b0000101020e8f7d2b8fc6549bac8cfe46141c9c2706ba8edb9b04521b9568d60c66be4fd401fdd0a7b8304603000001fdd0a7b8304603000000000003766d3101000000086d312e736d616c6c03696d6701045643505501010100010103636e31011001900000000070008000000000f000010000000100000000";
const PROVIDER: &str = "02021001900000000070008000000000f000010203426a6de1619dfb4a2f69267221ad145914d21b95a599922c43eec76076f7269001fd00a0b8304603000001fda0afb8304603000000000003636e3103636e3101000104564350551000fbe80301100101045643505501011001900000000070008000000000b0000100010456435055010000";

#[test]
fn entities_are_stored_as_they_were() {
    let stored = stored();
    let format = format!("{ENTITY_FORMAT:02x}");
    for (_, bytes) in &stored {
        assert_eq!(
            &bytes[..2],
            format,
            "an entity is stored behind its format byte"
        );
    }
    assert_eq!(
        &stored[0].1[2..],
        INSTANCE,
        "the instance's stored form changed"
    );
    assert_eq!(
        &stored[1].1[2..],
        PROVIDER,
        "the provider's stored form changed"
    );
}
