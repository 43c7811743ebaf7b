//! A hasher for keys that are already hashes (or small integer ids), shared by every kvroute
//! crate that keys a map by them.
//!
//! Block hashes are XXH3 outputs or engine digests: their bits are already well mixed, so SipHash
//! would only spend time. One folded 64x64->128 multiply spreads every input bit over the high bits
//! (which hashbrown uses for its control byte) and the low bits (which pick the bucket).

use std::hash::{BuildHasher, Hasher};

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

/// Mixes one or more `u64` words into a 64-bit hash.
#[inline]
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    let wide = u128::from(a ^ b.rotate_left(32)).wrapping_mul(u128::from(MUL));
    (wide as u64) ^ ((wide >> 64) as u64)
}

/// A [`Hasher`] over integer keys that are already hashes.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0 = mix(self.0, i);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }
}

/// Builds [`KeyHasher`]s.
#[derive(Default, Clone, Copy)]
pub struct BuildKeyHasher;

impl BuildHasher for BuildKeyHasher {
    type Hasher = KeyHasher;

    #[inline]
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

/// A standard `HashMap` keyed by hashes or ids, with [`BuildKeyHasher`]: no seed, so nothing
/// depends on a random state.
pub type KeyMap<K, V> = std::collections::HashMap<K, V, BuildKeyHasher>;
