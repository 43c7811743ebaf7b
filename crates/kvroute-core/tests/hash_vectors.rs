//! Test vectors for [`BlockHasher`], computed independently of this crate with Python's `xxhash`
//! package (python-xxhash 3.x/4.x, libxxhash 0.8.x). To recompute them:
//!
//! ```text
//! python3 -m venv /tmp/xx && /tmp/xx/bin/pip install xxhash && /tmp/xx/bin/python - <<'EOF'
//! import struct, xxhash
//! M = (1 << 64) - 1
//! def local(tokens, seed=1337):            # token ids as u32 little-endian
//!     return xxhash.xxh3_64_intdigest(struct.pack("<%dI" % len(tokens), *tokens), seed=seed)
//! def chain(locals_):                      # seq[0] = local[0]; then le64(prev) || le64(local)
//!     out = [locals_[0]]
//!     for l in locals_[1:]:
//!         out.append(xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], l), seed=1337))
//!     return out
//! def salt_seed(lora=None, ns=None):       # empty or None adds nothing
//!     s = 1337
//!     if lora: s = (s + xxhash.xxh3_64_intdigest(lora.encode(), seed=0)) & M
//!     if ns: s = (s + xxhash.xxh3_64_intdigest(ns.encode(), seed=1)) & M
//!     return s
//! def blocks(tokens, bs, seed=1337):       # full blocks only
//!     return [local(tokens[i:i + bs], seed) for i in range(0, len(tokens) - bs + 1, bs)]
//! print("iota16", local(list(range(16))))
//! print("large", local([151643, 151644, 151645, 4294967295]))
//! print("four", local([1, 2, 3, 4]))
//! print("sevens", local([7] * 16))
//! ls = blocks(list(range(48)), 16)
//! print("chain locals", ls)
//! print("chain seqs", chain(ls))
//! print("partial 10@4", blocks(list(range(10)), 4))
//! print("seed lora", salt_seed(lora="my-adapter"))
//! print("seed ns", salt_seed(ns="tenant-a"))
//! print("seed both", salt_seed(lora="my-adapter", ns="tenant-a"))
//! for name, seed in [("lora", salt_seed(lora="my-adapter")), ("ns", salt_seed(ns="tenant-a")),
//!                    ("both", salt_seed("my-adapter", "tenant-a"))]:
//!     print("salted", name, blocks(list(range(8)), 4, seed))
//! print("salted both chain", chain(blocks(list(range(8)), 4, salt_seed("my-adapter", "tenant-a"))))
//! print("iota64x2", blocks(list(range(130)), 64))
//! print("large64", local([151643 + i for i in range(63)] + [4294967295]))
//! print("both64", blocks(list(range(128)), 64, salt_seed("my-adapter", "tenant-a")))
//! EOF
//! ```

use kvroute_core::hash::{BlockHasher, HashSalt, XXH3_SEED, next_sequence_hash};
use kvroute_core::ids::{LocalBlockHash, SequenceHash};

const LORA: &str = "my-adapter";
const NAMESPACE: &str = "tenant-a";

fn locals(hashes: &[LocalBlockHash]) -> Vec<u64> {
    hashes.iter().map(|h| h.0).collect()
}

fn seqs(hashes: &[SequenceHash]) -> Vec<u64> {
    hashes.iter().map(|h| h.0).collect()
}

fn unsalted(block_size: usize) -> BlockHasher {
    BlockHasher::new(block_size, &HashSalt::NONE)
}

#[test]
fn seed_is_dynamos() {
    assert_eq!(XXH3_SEED, 1337);
    assert_eq!(HashSalt::NONE.local_seed(), 1337);
}

#[test]
fn local_hash_of_tokens_0_to_16() {
    let tokens: Vec<u32> = (0..16).collect();
    let h = unsalted(16);
    assert_eq!(h.local_hash(&tokens), LocalBlockHash(15310707395893867146));
    assert_eq!(locals(&h.local_hashes(&tokens)), [15310707395893867146]);
}

#[test]
fn local_hash_of_large_token_ids() {
    // Ids past u16 and u32::MAX itself: all four bytes of every token must be hashed, little-endian.
    let tokens = [151643, 151644, 151645, u32::MAX];
    assert_eq!(
        unsalted(4).local_hash(&tokens),
        LocalBlockHash(5526824743570706265)
    );
}

#[test]
fn local_hashes_of_64_token_blocks() {
    // 256 bytes: XXH3's long path (the specialised one for 64-token blocks), salted or not, in
    // every entry point; a trailing partial block is not hashed.
    let tokens: Vec<u32> = (0..130).collect();
    let h = unsalted(64);
    let want = [3480597578098033343, 3318286205056455972];
    assert_eq!(locals(&h.local_hashes(&tokens)), want);
    assert_eq!(h.local_hash(&tokens[..64]).0, want[0]);
    assert_eq!(h.local_hash(&tokens[64..128]).0, want[1]);
    let mut buf = Vec::new();
    h.hash_prompt_shared(&tokens, &mut buf);
    assert_eq!(locals(&buf), want);
    let large: Vec<u32> = (151643..151643 + 63).chain([u32::MAX]).collect();
    assert_eq!(h.local_hash(&large).0, 9766203397679640328);
    let salted = BlockHasher::new(
        64,
        &HashSalt {
            lora_name: Some(LORA),
            namespace: Some(NAMESPACE),
        },
    );
    assert_eq!(
        locals(&salted.local_hashes(&tokens[..128])),
        [1582243102023348012, 4206727210965875118]
    );
}

#[test]
fn local_hash_of_a_four_token_block() {
    assert_eq!(
        unsalted(4).local_hash(&[1, 2, 3, 4]),
        LocalBlockHash(14643705804678351452)
    );
}

#[test]
fn local_hash_is_position_independent() {
    // The same 16 tokens give the same local hash wherever the block stands.
    let mut tokens: Vec<u32> = (100..116).collect();
    tokens.extend([7u32; 16]);
    let h = unsalted(16);
    let hashes = h.local_hashes(&tokens);
    assert_eq!(hashes[1], LocalBlockHash(8771127959296939342));
    assert_eq!(h.local_hash(&[7; 16]), LocalBlockHash(8771127959296939342));
}

#[test]
fn sequence_chain_of_three_blocks() {
    let tokens: Vec<u32> = (0..48).collect();
    let h = unsalted(16);
    let ls = h.local_hashes(&tokens);
    assert_eq!(
        locals(&ls),
        [15310707395893867146, 15292316782987903195, 5532946206955930018]
    );
    let expected = [15310707395893867146, 13769157705258532664, 11879827756109914528];
    assert_eq!(seqs(&h.sequence_hashes(&ls)), expected);

    // The same chain, one step at a time; the first block's sequence hash is its local hash.
    let s0 = next_sequence_hash(None, ls[0]);
    let s1 = next_sequence_hash(Some(s0), ls[1]);
    let s2 = next_sequence_hash(Some(s1), ls[2]);
    assert_eq!(seqs(&[s0, s1, s2]), expected);
}

#[test]
fn only_full_blocks_are_hashed() {
    let tokens: Vec<u32> = (0..10).collect();
    let h = unsalted(4);
    let hashes = h.local_hashes(&tokens);
    assert_eq!(locals(&hashes), [9143094415614847814, 12124091508212882195]);
    // The trailing partial block changes nothing.
    assert_eq!(h.local_hashes(&tokens[..8]), hashes);
    assert_eq!(h.local_hashes(&[tokens.as_slice(), &[99]].concat()), hashes);
    assert!(h.local_hashes(&tokens[..3]).is_empty());
    assert!(h.sequence_hashes(&[]).is_empty());
}

#[test]
fn salt_seeds() {
    let lora = HashSalt {
        lora_name: Some(LORA),
        namespace: None,
    };
    let ns = HashSalt {
        lora_name: None,
        namespace: Some(NAMESPACE),
    };
    let both = HashSalt {
        lora_name: Some(LORA),
        namespace: Some(NAMESPACE),
    };
    assert_eq!(lora.local_seed(), 2360313164392603308);
    assert_eq!(ns.local_seed(), 1948188790972764086);
    assert_eq!(both.local_seed(), 4308501955365366057);
    // Lora and namespace are hashed with different seeds: swapping the strings changes the seed.
    let swapped = HashSalt {
        lora_name: Some(NAMESPACE),
        namespace: Some(LORA),
    };
    assert_ne!(swapped.local_seed(), both.local_seed());
}

#[test]
fn empty_strings_are_absent() {
    let empty = HashSalt {
        lora_name: Some(""),
        namespace: Some(""),
    };
    assert_eq!(empty.local_seed(), XXH3_SEED);
    let tokens: Vec<u32> = (0..8).collect();
    assert_eq!(BlockHasher::new(4, &empty), unsalted(4));
    assert_eq!(
        BlockHasher::new(4, &empty).local_hashes(&tokens),
        unsalted(4).local_hashes(&tokens)
    );
    let lora_empty_ns = HashSalt {
        lora_name: Some(LORA),
        namespace: Some(""),
    };
    let lora = HashSalt {
        lora_name: Some(LORA),
        namespace: None,
    };
    assert_eq!(lora_empty_ns.local_seed(), lora.local_seed());
}

#[test]
fn salted_local_hashes() {
    let tokens: Vec<u32> = (0..8).collect();
    let cases = [
        (
            HashSalt {
                lora_name: Some(LORA),
                namespace: None,
            },
            [13692202469334984872, 14659540909498545450],
        ),
        (
            HashSalt {
                lora_name: None,
                namespace: Some(NAMESPACE),
            },
            [17009624042690211646, 10000672136415158886],
        ),
        (
            HashSalt {
                lora_name: Some(LORA),
                namespace: Some(NAMESPACE),
            },
            [3751823939624705714, 11728034150926228479],
        ),
    ];
    for (salt, expected) in cases {
        assert_eq!(
            locals(&BlockHasher::new(4, &salt).local_hashes(&tokens)),
            expected,
            "{salt:?}"
        );
    }
}

#[test]
fn salted_chain_uses_the_plain_chain_seed() {
    // Salt changes the local hashes only; the chain step is always seeded with 1337.
    let both = HashSalt {
        lora_name: Some(LORA),
        namespace: Some(NAMESPACE),
    };
    let h = BlockHasher::new(4, &both);
    let tokens: Vec<u32> = (0..8).collect();
    let ls = h.local_hashes(&tokens);
    assert_eq!(
        seqs(&h.sequence_hashes(&ls)),
        [3751823939624705714, 6692600235417328464]
    );
    // The chain does not depend on the hasher's salt: an unsalted hasher chains the same locals
    // to the same sequence hashes.
    assert_eq!(unsalted(4).sequence_hashes(&ls), h.sequence_hashes(&ls));
}
