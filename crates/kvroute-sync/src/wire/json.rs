//! The JSON layout of versions 1 to 3 (`{"v":3,"from":…,"body":{…}}`), the format before
//! version 4. This build refuses it on the wire ([`super::decode`] names its version); the codec
//! stays for `kvroute bench sync`, which measures it beside version 4 on the same messages.

use serde::{Deserialize, Serialize};

use super::{Body, DecodeError, Envelope, MAX_CHAIN_BLOCKS, MAX_EVENTS, SyncItem, WorkerChange, secret_key};

/// The last JSON version.
pub const JSON_VERSION: u32 = 3;

#[derive(Serialize)]
struct Out<'a> {
    v: u32,
    from: u64,
    body: &'a Body,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct In {
    /// Checked through [`Header`] first.
    #[serde(rename = "v")]
    _version: u32,
    from: u64,
    body: Body,
}

/// A JSON message's version and sender, as far as they can be read.
#[derive(Deserialize)]
pub(super) struct Header {
    pub v: u32,
    #[serde(default)]
    pub from: Option<u64>,
}

/// Serializes `envelope` as version 3 did.
pub fn encode(envelope: &Envelope) -> Vec<u8> {
    // Plain data with string keys: serialization cannot fail.
    serde_json::to_vec(&Out {
        v: JSON_VERSION,
        from: envelope.from,
        body: &envelope.body,
    })
    .unwrap_or_default()
}

/// Parses and checks a version 3 message, as version 3 did. Never panics.
pub fn decode(bytes: &[u8]) -> Result<Envelope, DecodeError> {
    let Header { v, from } = serde_json::from_slice(bytes)?;
    if v != JSON_VERSION {
        return Err(DecodeError::Version {
            format: super::Format::Json,
            version: v,
            from,
        });
    }
    let In { from, body, .. } = serde_json::from_slice(bytes)?;
    let events = match &body {
        Body::Events { events, .. } | Body::Snapshot { events, .. } => events.as_slice(),
        Body::Heartbeat { .. } | Body::SnapshotRequest => &[],
    };
    if events.len() > MAX_EVENTS {
        return Err(DecodeError::TooManyEvents(events.len()));
    }
    for e in events {
        match e {
            SyncItem::Added { c, .. } if c.len() > MAX_CHAIN_BLOCKS => {
                return Err(DecodeError::ChainTooLong(c.len()));
            }
            SyncItem::Worker(WorkerChange::Added { config, .. }) => {
                if let Some(key) = secret_key(config) {
                    return Err(DecodeError::Secret(key));
                }
            }
            _ => {}
        }
    }
    Ok(Envelope { from, body })
}
