//! Tokenize once per conversation: a bounded cache from rendered text prefixes to their token
//! ids, so that a chat's follow-up turn tokenizes only its new text.
//!
//! **The rule that makes it exact.** A tokenizer first splits its input at the special tokens
//! written in it (`tokenizer.json`'s added tokens), then normalizes, pre-tokenizes and runs the
//! model on each piece of text between them apart; the only context a piece carries is whether
//! it opens the input (a SentencePiece-style `prepend_scheme: first` prepends only there). The
//! `tokenizers` library's own parallel encoder relies on the same cut. So for a *boundary*
//! token `X` (below) found at byte `c` of a text `S`:
//!
//! `encode(S) = encode(S[..c]) ++ encode(S[c..])`, provided `encode(S[c..])` starts with `X`'s id
//!
//! (`S[c..]` starts with `X`, so its text never opens the input, as in `S`; and `S[..c]`'s last
//! piece ends at `c` in both). A boundary token is a non-normalized added token with neither
//! `lstrip` (it would eat whitespace before `c`) nor `single_word` (it would look at the
//! character before `c`), not starting with whitespace, whose start no other added token can
//! overlap (no token has a proper suffix that is a prefix of it, or that it is a prefix of): so no
//! match can run across `c`. The check that `encode(S[c..])` begins with `X`'s id rules out a
//! longer token matching at `c`; when it fails the text is tokenized whole.
//!
//! Chat templates write such tokens around every message (`<|im_start|>`, `<|eot_id|>`, ...), so
//! a follow-up turn's rendered text extends the previous turn's up to the cut before the previous
//! generation prompt. Cuts are looked for only at the boundary tokens the chat template writes.
//!
//! **The cache.** Each entry is keyed by a text prefix ending at a cut (or at the end of a text):
//! its length and a seeded 128-bit XXH3 of its bytes, so no client id is needed; it holds the
//! prefix's tokens as a chain of shared pieces, so a conversation's turns share their common
//! history. Memory is counted exactly (bytes of the pieces alive) and bounded: past the limit the
//! least recently used entries go. A lookup takes the longest cached prefix of a text that ends
//! at a cut; the rest is tokenized piece by piece (and each piece checked as above), and new
//! entries are made at the last cuts and at the end.
//!
//! **A turn's block hashes** ([`Turn`]). A driver that hashes a prompt's blocks keeps the hashes
//! ([`PromptHashes`]) beside the entries the prompt hit and made, all of them sharing one copy
//! (16 bytes a block, counted in the bytes, and freed with the last entry holding it: each turn
//! keeps its whole prompt's, and older turns' go as their entries are evicted); a follow-up
//! that finds one of those entries is hashed after that entry's full blocks, so only its new
//! blocks are hashed ([`Turn::hashes`]). The entry's tokens are the first of the follow-up's,
//! so its hashes are the first of the follow-up's under the same rule; hashes made under
//! another block size, adapter or cache salt are not used.
//!
//! **Cuts inside text** ([`TextCuts`]). A long piece of text between special tokens (a 4 MB
//! message) is tokenized in slices, so that a prompt over the token limit is refused after the
//! first slices instead of after all of it. A slice ends only where the tokenizer's pipeline is
//! known to restart exactly: for the pipelines [`TextCuts::for_tokenizer`] recognizes (no
//! normalizer or NFC; a GPT-2, cl100k/Llama-3 or Qwen2 regex split, or a split before each
//! space; a BPE model, which tokenizes each pre-token apart), before a space that follows an
//! ASCII letter. There the pre-tokenizer's split of the whole text has a boundary, and the
//! split of each side is the whole text's split on that side:
//!
//! * the pre-token holding the letter ends at the space in every recognized pattern (each of
//!   its letter alternatives ends at the first non-letter; a contraction ends with a letter; a
//!   split before each space starts a piece at every space);
//! * no alternative tried from before the cut reads past the letter successfully (after a
//!   letter only a letter may follow), so ending the text at the cut changes nothing left of it;
//!   the only lookaround, `\s+(?!\S)`, cannot reach the cut across the letter;
//! * the patterns have no lookbehind or anchor, so the split from the cut onward is the same
//!   whether the text starts there or not;
//! * NFC leaves ASCII letters and spaces alone and composes nothing across a space;
//! * no added token may match across the cut: none contains whitespace or has `rstrip` (it
//!   would eat the space).
//!
//! Other pipelines (a SentencePiece-style BPE over the whole text, `Metaspace`, unknown regexes)
//! are tokenized whole. Property-tested against whole tokenization on every fixture.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, IntGauge};
use xxhash_rust::xxh3::Xxh3;

use kvroute_core::hash::{PromptHasher, PromptHashes};

use crate::model::PromptError;

/// An added token of `tokenizer.json`, as far as the cut rule needs it.
#[derive(Clone, Debug)]
pub struct AddedToken {
    /// Its text.
    pub content: String,
    /// Its id.
    pub id: u32,
    /// Matched in the normalized text rather than the raw text.
    pub normalized: bool,
    /// Eats whitespace on its left.
    pub lstrip: bool,
    /// Eats whitespace on its right.
    pub rstrip: bool,
    /// Matched only as a whole word.
    pub single_word: bool,
}

/// The pre-tokenizer regexes whose splits [`TextCuts::SpaceAfterLetter`] is proven for: GPT-2's
/// (what a `ByteLevel` pre-tokenizer with `use_regex` splits with), cl100k's (Llama-3) and
/// Qwen2's (cl100k's with single digits).
const SPLIT_SAFE_REGEXES: &[&str] = &[
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Where text between special tokens may be cut so that tokenizing the two sides apart gives
/// the tokens of the whole (see the module's documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TextCuts {
    /// Nowhere: the tokenizer's pipeline is not known to restart exactly anywhere in text.
    #[default]
    Nowhere,
    /// Before a space (U+0020) that follows an ASCII letter.
    SpaceAfterLetter,
}

impl TextCuts {
    /// The cuts a tokenizer allows, from its canonical `tokenizer.json` (as
    /// `tokenizers::canonicalize_value` leaves it) and its added tokens.
    pub fn for_tokenizer(canonical: &serde_json::Value, added: &[AddedToken]) -> Self {
        use serde_json::Value;
        let normalizer_ok = match &canonical["normalizer"] {
            Value::Null => true,
            n => n["type"] == "NFC",
        };
        let model = &canonical["model"];
        let model_ok = model["type"] == "BPE" && model["dropout"].is_null();
        // A split whose pieces are a pre-token boundary at every cut.
        let split_ok = |p: &Value| {
            let invert = p["invert"].as_bool().unwrap_or(false);
            let behavior = p["behavior"].as_str().unwrap_or("Isolated");
            p["type"] == "Split"
                && !invert
                && match (&p["pattern"]["Regex"], &p["pattern"]["String"]) {
                    (Value::String(regex), _) => {
                        behavior == "Isolated" && SPLIT_SAFE_REGEXES.contains(&regex.as_str())
                    }
                    (_, Value::String(string)) => behavior == "MergedWithNext" && string == " ",
                    _ => false,
                }
        };
        let pre = &canonical["pre_tokenizer"];
        let pre_ok = match pre["type"].as_str() {
            Some("Sequence") => {
                matches!(pre["pretokenizers"].as_array().map(Vec::as_slice), Some([one]) if split_ok(one))
            }
            _ => split_ok(pre),
        };
        let added_ok = added
            .iter()
            .all(|t| !t.rstrip && !t.content.chars().any(char::is_whitespace));
        match normalizer_ok && model_ok && pre_ok && added_ok {
            true => Self::SpaceAfterLetter,
            false => Self::Nowhere,
        }
    }

    /// The first cut in `text` at or after byte `from` (none at 0).
    pub fn next(self, text: &str, from: usize) -> Option<usize> {
        let bytes = text.as_bytes();
        let from = from.max(1);
        match self {
            Self::Nowhere => None,
            Self::SpaceAfterLetter => memchr::memchr_iter(b' ', bytes.get(from..)?)
                .map(|i| i + from)
                .find(|&at| bytes[at - 1].is_ascii_alphabetic()),
        }
    }
}

/// Text pieces longer than this are tokenized in slices of about this size where
/// [`TextCuts`] allows, so that tokenizing stops soon after passing the limit.
const SLICE_BYTES: usize = 32 << 10;

/// Appends the tokens of `text` to `out` (as `encode(text)` gives them), slice by slice where
/// `cuts` allows, and stops once `out` holds more than `limit` tokens; the bytes of `text`
/// tokenized.
fn encode_sliced(
    cuts: TextCuts,
    text: &str,
    limit: usize,
    out: &mut Vec<u32>,
    encode: &impl Fn(&str) -> Result<Vec<u32>, PromptError>,
) -> Result<usize, PromptError> {
    let mut start = 0;
    while start < text.len() && out.len() <= limit {
        let end = match text.len() - start > 2 * SLICE_BYTES {
            true => cuts.next(text, start + SLICE_BYTES).unwrap_or(text.len()),
            false => text.len(),
        };
        out.extend_from_slice(&encode(&text[start..end])?);
        start = end;
    }
    Ok(start)
}

/// The boundary tokens at which a text may be cut (see the module's documentation), and where
/// text between them may be.
#[derive(Clone, Debug, Default)]
pub struct Boundaries {
    /// (text, id), longest first.
    tokens: Vec<(String, u32)>,
    /// Cuts inside text.
    text: TextCuts,
}

impl Boundaries {
    /// The boundary tokens among `added` that `template_text` (a rendered probe conversation)
    /// contains; none when it is `None`.
    pub fn new(added: &[AddedToken], template_text: Option<&str>) -> Self {
        let Some(rendered) = template_text else {
            return Self::default();
        };
        let mut tokens: Vec<(String, u32)> = added
            .iter()
            .filter(|t| is_boundary(t, added) && rendered.contains(t.content.as_str()))
            .map(|t| (t.content.clone(), t.id))
            .collect();
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        tokens.dedup();
        Self {
            tokens,
            text: TextCuts::Nowhere,
        }
    }

    /// These boundaries, with text cut where `text` allows.
    pub fn with_text_cuts(self, text: TextCuts) -> Self {
        Self { text, ..self }
    }

    /// Where text between special tokens may be cut.
    pub fn text_cuts(&self) -> TextCuts {
        self.text
    }

    /// Whether no token qualifies (the cache then tokenizes every text whole).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The boundary tokens' texts.
    pub fn texts(&self) -> impl Iterator<Item = &str> {
        self.tokens.iter().map(|(t, _)| t.as_str())
    }

    /// Every occurrence of a boundary token in `text`: (byte offset, the token's id), in order.
    /// Occurrences cannot overlap (no boundary token overlaps another's start, or its own).
    fn cuts(&self, text: &str) -> Vec<(usize, u32)> {
        let bytes = text.as_bytes();
        let mut firsts: Vec<u8> = self.tokens.iter().map(|(t, _)| t.as_bytes()[0]).collect();
        firsts.sort_unstable();
        firsts.dedup();
        // The tokens that start at `at`, longest first (the order of `tokens`).
        let at = |at: usize| {
            self.tokens
                .iter()
                .find(|(t, _)| bytes[at..].starts_with(t.as_bytes()))
                .map(|(_, id)| (at, *id))
        };
        match *firsts.as_slice() {
            // One pass over the text for the tokens' first bytes (chat templates' special
            // tokens mostly share theirs: `<`).
            [a] => memchr::memchr_iter(a, bytes).filter_map(at).collect(),
            [a, b] => memchr::memchr2_iter(a, b, bytes).filter_map(at).collect(),
            [a, b, c] => memchr::memchr3_iter(a, b, c, bytes).filter_map(at).collect(),
            _ => {
                let mut cuts = Vec::new();
                for (token, id) in &self.tokens {
                    let finder = memchr::memmem::Finder::new(token.as_bytes());
                    cuts.extend(finder.find_iter(bytes).map(|at| (at, *id)));
                }
                cuts.sort_unstable();
                cuts.dedup_by_key(|c| c.0);
                cuts
            }
        }
    }
}

/// Whether `token` may be cut before (see the module's documentation).
fn is_boundary(token: &AddedToken, added: &[AddedToken]) -> bool {
    let x = token.content.as_str();
    let Some(first) = x.chars().next() else {
        return false;
    };
    if token.normalized || token.lstrip || token.single_word || first.is_whitespace() {
        return false;
    }
    // No added token may match across the cut: none has a proper suffix compatible with `x`.
    added.iter().all(|y| {
        y.content
            .char_indices()
            .skip(1)
            .map(|(i, _)| &y.content[i..])
            .all(|tail| !(tail.starts_with(x) || x.starts_with(tail)))
    })
}

/// A cache key: a text prefix's length and its seeded 128-bit hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Key {
    len: usize,
    hash: u128,
}

/// A piece of a cached prefix's tokens, after its parent's.
struct Node {
    parent: Option<Arc<Node>>,
    tokens: Box<[u32]>,
    /// Tokens from the start of the text to this piece's end.
    total: usize,
    /// What it is counted as in [`ChatCache::bytes`].
    bytes: usize,
    live: Arc<AtomicUsize>,
}

impl Node {
    fn new(parent: Option<Arc<Node>>, tokens: Vec<u32>, live: &Arc<AtomicUsize>) -> Self {
        let total = parent.as_ref().map_or(0, |p| p.total) + tokens.len();
        // The tokens, the node and its map entry (key, LRU tick, and the maps' own overhead).
        let bytes = tokens.len() * 4 + std::mem::size_of::<Node>() + 128;
        live.fetch_add(bytes, Ordering::Relaxed);
        Self {
            parent,
            tokens: tokens.into_boxed_slice(),
            total,
            bytes,
            live: Arc::clone(live),
        }
    }

    /// The tokens from the start of the text to this node's end.
    fn materialize(self: &Arc<Self>, out: &mut Vec<u32>) {
        let mut chain = Vec::new();
        let mut at = Some(self);
        while let Some(node) = at {
            chain.push(node);
            at = node.parent.as_ref();
        }
        out.reserve(self.total);
        for node in chain.iter().rev() {
            out.extend_from_slice(&node.tokens);
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.live.fetch_sub(self.bytes, Ordering::Relaxed);
        // Free a long chain without recursing down it.
        let mut parent = self.parent.take();
        while let Some(p) = parent {
            match Arc::try_unwrap(p) {
                Ok(mut node) => parent = node.parent.take(),
                Err(_) => break,
            }
        }
    }
}

/// A prompt's block hashes kept beside the entries it made, counted in [`ChatCache::bytes`]
/// while an entry holds them.
struct Kept {
    hashes: PromptHashes,
    bytes: usize,
    live: Arc<AtomicUsize>,
}

impl Kept {
    fn new(hashes: PromptHashes, live: &Arc<AtomicUsize>) -> Self {
        let bytes = hashes.shared_bytes() + std::mem::size_of::<Self>();
        live.fetch_add(bytes, Ordering::Relaxed);
        Self {
            hashes,
            bytes,
            live: Arc::clone(live),
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.live.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A cache entry: its prefix's tokens, its last use, and the block hashes of a prompt that
/// began with them, if a driver kept some ([`Turn::hashes`]).
struct Entry {
    node: Arc<Node>,
    used: u64,
    hashes: Option<Arc<Kept>>,
}

impl Entry {
    /// The kept hashes of this entry's prefix (its full blocks').
    fn earlier(&self) -> Option<PromptHashes> {
        let kept = self.hashes.as_ref()?;
        Some(kept.hashes.prefix(self.node.total))
    }
}

#[derive(Default)]
struct Inner {
    map: HashMap<Key, Entry>,
    /// Entries by last use.
    lru: BTreeMap<u64, Key>,
    tick: u64,
}

impl Inner {
    fn touch(&mut self, key: Key) -> Option<&Entry> {
        self.tick += 1;
        let tick = self.tick;
        let entry = self.map.get_mut(&key)?;
        self.lru.remove(&entry.used);
        entry.used = tick;
        self.lru.insert(tick, key);
        Some(entry)
    }

    fn insert(&mut self, key: Key, node: Arc<Node>) {
        self.tick += 1;
        let entry = Entry {
            node,
            used: self.tick,
            hashes: None,
        };
        if let Some(old) = self.map.insert(key, entry) {
            self.lru.remove(&old.used);
        }
        self.lru.insert(self.tick, key);
    }
}

/// The cache's counters, exported to Prometheus ([`ChatCache::collector`]).
#[derive(Clone, Debug)]
struct Counters {
    hits: IntCounter,
    misses: IntCounter,
    reused_tokens: IntCounter,
    kept_hash_blocks: IntCounter,
    hashed_blocks: IntCounter,
    evictions: IntCounter,
    bytes: IntGauge,
    entries: IntGauge,
}

impl Counters {
    fn new() -> Self {
        let counter =
            |name: &str, help: &str| IntCounter::new(name, help).expect("static metric options are valid");
        let gauge =
            |name: &str, help: &str| IntGauge::new(name, help).expect("static metric options are valid");
        Self {
            hits: counter(
                "kvroute_tokenizer_cache_hits_total",
                "Chat prompts whose rendered text extended a cached prefix (only the rest was tokenized).",
            ),
            misses: counter(
                "kvroute_tokenizer_cache_misses_total",
                "Chat prompts tokenized from the start (no cached prefix).",
            ),
            reused_tokens: counter(
                "kvroute_tokenizer_cache_reused_tokens_total",
                "Prompt tokens taken from the cache instead of tokenized.",
            ),
            kept_hash_blocks: counter(
                "kvroute_tokenizer_cache_kept_hash_blocks_total",
                "Blocks of chat prompts whose hashes were kept from the turn they continue (not hashed again).",
            ),
            hashed_blocks: counter(
                "kvroute_tokenizer_cache_hashed_blocks_total",
                "Blocks of chat prompts hashed (past the kept hashes of the turn they continue, or whole).",
            ),
            evictions: counter(
                "kvroute_tokenizer_cache_evictions_total",
                "Cache entries evicted to stay within tokenizer-cache-bytes.",
            ),
            bytes: gauge(
                "kvroute_tokenizer_cache_bytes",
                "Bytes the tokenizer cache holds (tokens and bookkeeping).",
            ),
            entries: gauge(
                "kvroute_tokenizer_cache_entries",
                "Entries in the tokenizer cache.",
            ),
        }
    }
}

/// What a cached encode gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Encoded {
    /// The text's token ids, equal to tokenizing it whole.
    Tokens(Vec<u32>),
    /// Tokenizing stopped: the text has more than the limit's tokens (at least this many).
    TooLong(usize),
}

/// How an encode used the cache, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lookup {
    /// Tokens taken from the cache.
    pub reused_tokens: usize,
    /// Bytes of text tokenized.
    pub tokenized_bytes: usize,
}

/// The bounded conversation cache (see the module's documentation). Off (tokenizing every text
/// whole) until given a limit.
pub struct ChatCache {
    shared: Arc<Shared>,
}

/// The cache's state, which [`Turn`]s share.
struct Shared {
    inner: Mutex<Inner>,
    limit: AtomicUsize,
    live: Arc<AtomicUsize>,
    seed: u64,
    counters: Counters,
}

impl Shared {
    fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    fn bytes(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update leaves the maps whole: a poisoned lock's data is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn evict(&self, inner: &mut Inner) {
        let limit = self.limit();
        while self.bytes() > limit {
            let Some((_, key)) = inner.lru.pop_first() else {
                break;
            };
            inner.map.remove(&key);
            self.counters.evictions.inc();
        }
        self.counters
            .bytes
            .set(i64::try_from(self.bytes()).unwrap_or(i64::MAX));
        self.counters
            .entries
            .set(i64::try_from(inner.map.len()).unwrap_or(i64::MAX));
    }
}

/// A chat prompt's place in the conversation cache, as [`ChatCache::encode_turn`] found it: the
/// block hashes kept for the cached prefix it continues, if any, and the entries it hit and
/// made, beside which [`Turn::hashes`] keeps the prompt's own hashes for its follow-ups. Those
/// entries' tokens are the first of the prompt's.
#[derive(Clone)]
pub struct Turn {
    cache: Arc<Shared>,
    earlier: Option<PromptHashes>,
    /// The entries, with their tokens.
    entries: Vec<(Key, usize)>,
}

impl std::fmt::Debug for Turn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn")
            .field("earlier_blocks", &self.earlier.as_ref().map(PromptHashes::blocks))
            .field("entries", &self.entries.len())
            .finish_non_exhaustive()
    }
}

/// Two turns are equal when they name the same entries of the same cache.
impl PartialEq for Turn {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.cache, &other.cache) && self.entries == other.entries
    }
}

impl Turn {
    /// The block hashes kept for the cached prefix this prompt continues (a previous turn's,
    /// cut to that prefix's full blocks), if its entry holds some: under the same rule
    /// (block size and salts) only the blocks past them need hashing
    /// ([`PromptHasher::hash_prompt_after`], which uses none made under another rule).
    ///
    /// [`PromptHasher::hash_prompt_after`]: kvroute_core::hash::PromptHasher::hash_prompt_after
    pub fn earlier(&self) -> Option<&PromptHashes> {
        self.earlier.as_ref()
    }

    /// The block hashes of this prompt, whose tokens (as the cache gave them) are `tokens`,
    /// under `hasher`: after the kept hashes of the prefix it continues when they were made
    /// under `hasher`'s rule, so only the blocks past them are hashed ([`PromptHashes::after`]),
    /// else all of them; the same values either way. Kept for the next turn, beside the entries
    /// this prompt hit and made.
    pub fn hashes(&self, hasher: &PromptHasher, tokens: &[u32]) -> PromptHashes {
        let hashes = self
            .earlier
            .as_ref()
            .and_then(|earlier| PromptHashes::after(hasher, tokens, earlier))
            .unwrap_or_else(|| PromptHashes::new(hasher, tokens));
        let kept = self
            .earlier
            .as_ref()
            .map_or(0, |earlier| earlier.reusable_blocks(hasher, tokens.len()));
        let counters = &self.cache.counters;
        counters.kept_hash_blocks.inc_by(kept as u64);
        counters.hashed_blocks.inc_by((hashes.blocks() - kept) as u64);
        self.keep(&hashes);
        hashes
    }

    /// Keeps `hashes`, the block hashes of this prompt (or of its first tokens), beside the
    /// entries it hit and made (those still cached), replacing what they kept; counted in the
    /// cache's bytes, evicting past its bound.
    fn keep(&self, hashes: &PromptHashes) {
        let cache = &self.cache;
        let kept = Arc::new(Kept::new(hashes.clone(), &cache.live));
        let mut inner = cache.lock();
        for (key, tokens) in &self.entries {
            if let Some(entry) = inner.map.get_mut(key)
                && entry.node.total == *tokens
            {
                entry.hashes = Some(Arc::clone(&kept));
            }
        }
        drop(kept);
        cache.evict(&mut inner);
    }
}

impl std::fmt::Debug for ChatCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatCache")
            .field("limit", &self.shared.limit())
            .field("bytes", &self.shared.bytes())
            .finish_non_exhaustive()
    }
}

impl Default for ChatCache {
    fn default() -> Self {
        Self::new(0)
    }
}

/// A new piece of a text to tokenize: `start..end`, and the boundary token's id it must begin
/// with (`None` for the piece that opens the text).
struct Piece {
    start: usize,
    end: usize,
    first: Option<u32>,
    /// Whether an entry ends here.
    keep: bool,
}

/// New pieces shorter than this are merged with the next, unless one of the last cuts ends
/// them: a body of many tiny messages makes few entries.
const MIN_PIECE_BYTES: usize = 1024;
/// The last cuts of a text always end a piece: a follow-up turn extends the text up to one of
/// them (the one before the generation prompt).
const LAST_CUTS_KEPT: usize = 2;

impl ChatCache {
    /// A cache of at most `limit_bytes` (0: off).
    pub fn new(limit_bytes: usize) -> Self {
        let shared = Shared {
            inner: Mutex::new(Inner::default()),
            limit: AtomicUsize::new(limit_bytes),
            live: Arc::new(AtomicUsize::new(0)),
            seed: std::collections::hash_map::RandomState::new().hash_one(0x006b_7672_6f75_7465_u64),
            counters: Counters::new(),
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Sets the bound (0 turns the cache off and empties it).
    pub fn set_limit(&self, limit_bytes: usize) {
        self.shared.limit.store(limit_bytes, Ordering::Relaxed);
        let mut inner = self.shared.lock();
        self.shared.evict(&mut inner);
    }

    /// The bound, bytes.
    pub fn limit(&self) -> usize {
        self.shared.limit()
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.shared.bytes()
    }

    /// Entries held now.
    pub fn entries(&self) -> usize {
        self.shared.lock().map.len()
    }

    /// (hits, misses) so far.
    pub fn hits_and_misses(&self) -> (u64, u64) {
        (self.shared.counters.hits.get(), self.shared.counters.misses.get())
    }

    /// (kept, hashed) blocks of chat prompts so far ([`Turn::hashes`]).
    pub fn kept_and_hashed_blocks(&self) -> (u64, u64) {
        let c = &self.shared.counters;
        (c.kept_hash_blocks.get(), c.hashed_blocks.get())
    }

    /// The Prometheus collector of the cache's metrics (hits, misses, reused tokens,
    /// evictions, bytes, entries), for a registry.
    pub fn collector(&self) -> Box<dyn Collector> {
        Box::new(CacheCollector(self.shared.counters.clone()))
    }

    /// The tokens of `text` (special tokens in it recognized, none added), `encode` being the
    /// tokenizer; at most `limit` of them, past which it stops with [`Encoded::TooLong`] where
    /// it can. Equal to `encode(text)` whatever the cache holds.
    pub fn encode(
        &self,
        boundaries: &Boundaries,
        text: &str,
        limit: usize,
        encode: impl Fn(&str) -> Result<Vec<u32>, PromptError>,
    ) -> Result<(Encoded, Lookup), PromptError> {
        self.encode_turn(boundaries, text, limit, encode)
            .map(|(encoded, lookup, _)| (encoded, lookup))
    }

    /// [`ChatCache::encode`], with the prompt's [`Turn`] when its tokens went through the
    /// cache (not when it is off, nor when they were tokenized whole or were too many).
    pub fn encode_turn(
        &self,
        boundaries: &Boundaries,
        text: &str,
        limit: usize,
        encode: impl Fn(&str) -> Result<Vec<u32>, PromptError>,
    ) -> Result<(Encoded, Lookup, Option<Turn>), PromptError> {
        let whole = |text: &str| {
            whole_sliced(boundaries.text, text, limit, &encode)
                .map(|(encoded, lookup)| (encoded, lookup, None))
        };
        let cache = &self.shared;
        if cache.limit() == 0 || boundaries.is_empty() {
            return whole(text);
        }
        let cuts = boundaries.cuts(text);
        // The key of the prefix ending at each cut, and of the whole text.
        let mut keys = Vec::with_capacity(cuts.len() + 1);
        let mut hasher = Xxh3::with_seed(cache.seed);
        let mut at = 0;
        for &(cut, _) in cuts.iter().chain([&(text.len(), 0)]) {
            hasher.update(&text.as_bytes()[at..cut]);
            at = cut;
            keys.push(Key {
                len: cut,
                hash: hasher.digest128(),
            });
        }
        // The longest cached prefix: the whole text, else the last cut that has one; with the
        // hashes kept for it.
        let found = {
            let mut inner = cache.lock();
            let mut hit = |i: usize| {
                inner
                    .touch(keys[i])
                    .map(|entry| (i, Arc::clone(&entry.node), entry.earlier()))
            };
            hit(cuts.len()).or_else(|| (0..cuts.len()).rev().find_map(hit))
        };
        let mut out = Vec::new();
        let mut turn = Turn {
            cache: Arc::clone(cache),
            earlier: None,
            entries: Vec::new(),
        };
        let (next_cut, mut parent) = match found {
            Some((i, node, earlier)) => {
                cache.counters.hits.inc();
                cache.counters.reused_tokens.inc_by(node.total as u64);
                turn.earlier = earlier;
                turn.entries.push((keys[i], node.total));
                // Room for the rest's tokens too (a hint: at most a token a byte, for most
                // tokenizers), so that the cached tokens are copied once.
                let rest = text.len() - cuts.get(i).map_or(text.len(), |c| c.0);
                out.reserve_exact(node.total + rest);
                node.materialize(&mut out);
                if i == cuts.len() {
                    let lookup = Lookup {
                        reused_tokens: out.len(),
                        tokenized_bytes: 0,
                    };
                    return Ok(match out.len() > limit {
                        true => (Encoded::TooLong(out.len()), lookup, None),
                        false => (Encoded::Tokens(out), lookup, Some(turn)),
                    });
                }
                (i, Some(node))
            }
            None => {
                cache.counters.misses.inc();
                (0, None)
            }
        };
        let reused = out.len();
        let pieces = plan(&cuts, next_cut, parent.is_some(), text.len());
        let mut made = Vec::new();
        let mut tokenized = 0;
        let mut pending: Vec<u32> = Vec::new();
        for piece in &pieces {
            let before = out.len();
            tokenized += encode_sliced(
                boundaries.text,
                &text[piece.start..piece.end],
                limit,
                &mut out,
                &encode,
            )?;
            if let Some(first) = piece.first
                && out.get(before) != Some(&first)
            {
                // A longer token matched at the cut: the rule does not apply; tokenize whole.
                return whole(text);
            }
            if out.len() > limit {
                let lookup = Lookup {
                    reused_tokens: reused,
                    tokenized_bytes: tokenized,
                };
                return Ok((Encoded::TooLong(out.len()), lookup, None));
            }
            pending.extend_from_slice(&out[before..]);
            if piece.keep {
                let node = Arc::new(Node::new(
                    parent.take(),
                    std::mem::take(&mut pending),
                    &cache.live,
                ));
                let key = keys[cuts.partition_point(|c| c.0 < piece.end)];
                turn.entries.push((key, node.total));
                made.push((key, Arc::clone(&node)));
                parent = Some(node);
            }
        }
        {
            let mut inner = cache.lock();
            for (key, node) in made {
                inner.insert(key, node);
            }
            cache.evict(&mut inner);
        }
        let lookup = Lookup {
            reused_tokens: reused,
            tokenized_bytes: tokenized,
        };
        Ok((Encoded::Tokens(out), lookup, Some(turn)))
    }
}

/// The pieces of a text from cut `next_cut` (the text's start when `hit` is false) to its end:
/// each ends at a cut or at the end; entries end at pieces of at least [`MIN_PIECE_BYTES`], the
/// last [`LAST_CUTS_KEPT`] cuts and the end.
fn plan(cuts: &[(usize, u32)], next_cut: usize, hit: bool, len: usize) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let (mut start, mut first) = match hit {
        true => (cuts[next_cut].0, Some(cuts[next_cut].1)),
        false => (0, None),
    };
    let mut entry_start = start;
    let from = if hit { next_cut + 1 } else { 0 };
    let last_kept = cuts.len().saturating_sub(LAST_CUTS_KEPT);
    for (i, &(cut, id)) in cuts.iter().enumerate().skip(from) {
        if cut == start {
            // A cut at the text's start: the piece that opens the text begins with it.
            continue;
        }
        let keep = cut - entry_start >= MIN_PIECE_BYTES || i >= last_kept;
        pieces.push(Piece {
            start,
            end: cut,
            first,
            keep,
        });
        if keep {
            entry_start = cut;
        }
        start = cut;
        first = Some(id);
    }
    pieces.push(Piece {
        start,
        end: len,
        first,
        keep: true,
    });
    pieces
}

/// Exports the counters.
struct CacheCollector(Counters);

impl Collector for CacheCollector {
    fn desc(&self) -> Vec<&Desc> {
        let c = &self.0;
        [
            c.hits.desc(),
            c.misses.desc(),
            c.reused_tokens.desc(),
            c.kept_hash_blocks.desc(),
            c.hashed_blocks.desc(),
            c.evictions.desc(),
            c.bytes.desc(),
            c.entries.desc(),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let c = &self.0;
        [
            c.hits.collect(),
            c.misses.collect(),
            c.reused_tokens.collect(),
            c.kept_hash_blocks.collect(),
            c.hashed_blocks.collect(),
            c.evictions.collect(),
            c.bytes.collect(),
            c.entries.collect(),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// The answer for `text` tokenized from its start, slice by slice where `cuts` allows
/// (stopping once past `limit` tokens): nothing reused.
fn whole_sliced(
    cuts: TextCuts,
    text: &str,
    limit: usize,
    encode: &impl Fn(&str) -> Result<Vec<u32>, PromptError>,
) -> Result<(Encoded, Lookup), PromptError> {
    let mut out = Vec::new();
    let lookup = Lookup {
        reused_tokens: 0,
        tokenized_bytes: encode_sliced(cuts, text, limit, &mut out, encode)?,
    };
    Ok(match out.len() > limit {
        true => (Encoded::TooLong(out.len()), lookup),
        false => (Encoded::Tokens(out), lookup),
    })
}

/// The answer for `text` tokenized whole into `tokens`: nothing reused; past `limit` tokens,
/// [`Encoded::TooLong`].
pub(crate) fn whole_answer(tokens: Vec<u32>, text: &str, limit: usize) -> (Encoded, Lookup) {
    let lookup = Lookup {
        reused_tokens: 0,
        tokenized_bytes: text.len(),
    };
    match tokens.len() > limit {
        true => (Encoded::TooLong(tokens.len()), lookup),
        false => (Encoded::Tokens(tokens), lookup),
    }
}
