//! Forged lengths: every byte of every fixture payload that could start a msgpack length header
//! is, in turn, rewritten to the 32-bit header of its family claiming 4,294,967,295 items or
//! bytes (a peer saying "4 GB follow"). The decoder must never panic and never reserve what a
//! header claims: a reservation of 2^32 `u64`s (32 GiB) would abort the test process, so
//! finishing is the check that allocation follows the bytes present, not the lengths claimed.
//! Where the byte was a real header (the batch's own, at byte 0, always is) the payload must be
//! refused with an error; a byte inside a hash or a string may still decode.

mod common;

use common::{fixture, fixture_names};
use kvroute_wire::EventBatch;

/// The 32-bit header of the same family as the header starting with `marker`, claiming
/// `u32::MAX`, and the length of the original header; `None` if `marker` starts no length
/// header.
fn forged(bytes: &[u8], at: usize) -> Option<(Vec<u8>, usize)> {
    let marker = bytes[at];
    let (family, header_len) = match marker {
        0x80..=0x8f => (0xdf, 1),
        0x90..=0x9f => (0xdd, 1),
        0xa0..=0xbf => (0xdb, 1),
        0xd9 => (0xdb, 2),
        0xda => (0xdb, 3),
        0xdb => (0xdb, 5),
        0xc4 => (0xc6, 2),
        0xc5 => (0xc6, 3),
        0xc6 => (0xc6, 5),
        0xdc => (0xdd, 3),
        0xdd => (0xdd, 5),
        0xde => (0xdf, 3),
        0xdf => (0xdf, 5),
        _ => return None,
    };
    (at + header_len <= bytes.len()).then(|| (vec![family, 0xff, 0xff, 0xff, 0xff], header_len))
}

#[test]
fn length_headers_claiming_4_gib_are_refused_without_allocating_it() {
    let (mut forged_count, mut refused) = (0usize, 0usize);
    for name in fixture_names() {
        let original = fixture(&name);
        for at in 0..original.len() {
            let Some((header, header_len)) = forged(&original, at) else {
                continue;
            };
            let mut bytes = original.clone();
            bytes.splice(at..at + header_len, header);
            forged_count += 1;
            match EventBatch::decode_payload("t", 0, &bytes) {
                Err(e) => {
                    refused += 1;
                    assert!(!e.to_string().is_empty(), "{name} at {at}");
                }
                Ok(_) => assert_ne!(at, 0, "{name}: the batch's own forged header decoded"),
            }
        }
    }
    assert!(
        refused * 2 > forged_count,
        "only {refused} of {forged_count} forged payloads refused"
    );
    assert!(
        forged_count > 100,
        "only {forged_count} headers forged: the fixtures are missing?"
    );
}
