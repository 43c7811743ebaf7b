//! Trace readers: Mooncake JSON Lines and Azure LLM inference CSV, into a [`Workload`].
//!
//! Readers take text already decompressed (the CLI opens and un-gzips files); they do no I/O of
//! their own beyond the reader they are given.
//!
//! **Mooncake token synthesis** (Dynamo's rule, `lib/mocker/src/loadgen/trace.rs`): each
//! `hash_id` becomes `trace_block_size` copies of the token `hash_id as u32`; the prompt is the
//! first `min(input_length, len(hash_ids) · trace_block_size)` of those tokens; the engines
//! re-chunk them at their own block size. Only the local hashes of the full blocks are kept, so
//! a 12,000-request trace costs megabytes, not the gigabyte its token ids would.
//!
//! **Azure** rows give lengths only: each request gets its own synthesized tokens, so no two
//! prompts share a block.

use std::io::BufRead;

use kvroute_core::time::Timestamp;
use serde::Deserialize;

use crate::workload::{Arrival, PromptBlocks, PromptHasher, SimRequest, Workload};

/// A trace the readers refuse.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// Reading failed.
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line did not parse.
    #[error("line {line}: {message}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        message: String,
    },
    /// A block size of zero.
    #[error("block sizes must be at least 1")]
    ZeroBlockSize,
}

/// One Mooncake row (`created_time`, `input_tokens`, `output_tokens` are accepted aliases).
#[derive(Debug, Deserialize)]
struct MooncakeRow {
    #[serde(alias = "created_time")]
    timestamp: f64,
    #[serde(alias = "input_tokens")]
    input_length: u64,
    #[serde(alias = "output_tokens")]
    output_length: u64,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
/// `trace_block_size` tokens) into a workload at `block_size` tokens per block, keeping at most
/// `limit` rows. Arrivals are the timestamps, shifted so the first row arrives at 0; a row earlier
/// than the first is an error naming its line (rows are in time order).
pub fn read_mooncake(
    reader: impl BufRead,
    trace_block_size: u32,
    block_size: u32,
    limit: Option<usize>,
) -> Result<Workload, TraceError> {
    if trace_block_size == 0 || block_size == 0 {
        return Err(TraceError::ZeroBlockSize);
    }
    let mut workload = Workload::new(block_size);
    let mut hasher = PromptHasher::new(block_size);
    mooncake_rows(reader, limit, |arrival, row| {
        let (locals, prompt_tokens) =
            mooncake_prompt(&mut hasher, &row.hash_ids, row.input_length, trace_block_size);
        workload.requests.push(SimRequest {
            arrival: Arrival::At(arrival),
            locals,
            prompt_tokens,
            output_tokens: u32::try_from(row.output_length).unwrap_or(u32::MAX),
        });
    })?;
    Ok(workload)
}

/// Calls `f` with each row of a Mooncake trace (at most `limit`) and its arrival, shifted so the
/// first row arrives at 0.
fn mooncake_rows(
    reader: impl BufRead,
    limit: Option<usize>,
    mut f: impl FnMut(Timestamp, MooncakeRow),
) -> Result<(), TraceError> {
    let mut first_ms = None;
    let mut rows = 0;
    for (i, line) in reader.lines().enumerate() {
        if limit.is_some_and(|n| rows >= n) {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let row: MooncakeRow = serde_json::from_str(&line).map_err(|e| TraceError::Parse {
            line: i + 1,
            message: e.to_string(),
        })?;
        let first = *first_ms.get_or_insert(row.timestamp);
        let ms = row.timestamp - first;
        if ms < 0.0 {
            return Err(TraceError::Parse {
                line: i + 1,
                message: format!(
                    "timestamp {} ms is before the first row's {first} ms (rows must be in time order)",
                    row.timestamp
                ),
            });
        }
        rows += 1;
        f(Timestamp((ms * 1e6).round() as u64), row);
    }
    Ok(())
}

/// The synthesized prompt of a Mooncake row: its full blocks' local hashes and its length,
/// hashed from its runs without writing the tokens out.
pub(crate) fn mooncake_prompt(
    hasher: &mut PromptHasher,
    hash_ids: &[u64],
    input_length: u64,
    trace_block_size: u32,
) -> (PromptBlocks, u32) {
    hasher.run_locals(mooncake_runs(hash_ids, input_length, trace_block_size))
}

/// Dynamo's token synthesis for a Mooncake row (see the module docs), appended to `tokens`.
pub fn mooncake_tokens(hash_ids: &[u64], input_length: u64, trace_block_size: u32, tokens: &mut Vec<u32>) {
    for (token, count) in mooncake_runs(hash_ids, input_length, trace_block_size) {
        tokens.extend(std::iter::repeat_n(token, count));
    }
}

/// A Mooncake row's prompt as runs of one token: each hash id repeated for its trace block, the
/// whole cut at `input_length`.
fn mooncake_runs(
    hash_ids: &[u64],
    input_length: u64,
    trace_block_size: u32,
) -> impl Iterator<Item = (u32, usize)> + '_ {
    let tbs = trace_block_size as usize;
    let mut left = (input_length as usize).min(hash_ids.len() * tbs);
    hash_ids.iter().map_while(move |&h| {
        let take = left.min(tbs);
        left -= take;
        (take > 0).then_some((h as u32, take))
    })
}

/// A Mooncake row with its prompt as token ids, for drivers that send real prompts (the live
/// demo) rather than block hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRequest {
    /// Arrival, the first row at 0.
    pub arrival: Timestamp,
    /// The synthesized prompt ([`mooncake_tokens`]).
    pub tokens: Vec<u32>,
    /// Tokens to generate.
    pub output_tokens: u32,
}

/// Reads a Mooncake JSONL trace into requests with token prompts, keeping at most `limit` rows;
/// the same rows, arrivals and tokens as [`read_mooncake`].
pub fn read_mooncake_tokens(
    reader: impl BufRead,
    trace_block_size: u32,
    limit: Option<usize>,
) -> Result<Vec<TokenRequest>, TraceError> {
    if trace_block_size == 0 {
        return Err(TraceError::ZeroBlockSize);
    }
    let mut out = Vec::new();
    mooncake_rows(reader, limit, |arrival, row| {
        let mut tokens = Vec::new();
        mooncake_tokens(&row.hash_ids, row.input_length, trace_block_size, &mut tokens);
        out.push(TokenRequest {
            arrival,
            tokens,
            output_tokens: u32::try_from(row.output_length).unwrap_or(u32::MAX),
        });
    })?;
    Ok(out)
}

/// Reads an Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`) into a workload
/// at `block_size` tokens per block, keeping at most `limit` rows. Every prompt gets unique
/// synthesized tokens.
pub fn read_azure(
    reader: impl BufRead,
    block_size: u32,
    limit: Option<usize>,
) -> Result<Workload, TraceError> {
    if block_size == 0 {
        return Err(TraceError::ZeroBlockSize);
    }
    let mut workload = Workload::new(block_size);
    let mut hasher = PromptHasher::new(block_size);
    let mut first_ns = None;
    for (i, line) in reader.lines().enumerate() {
        if limit.is_some_and(|n| workload.requests.len() >= n) {
            break;
        }
        let line = line?;
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("TIMESTAMP")) {
            continue;
        }
        let parse = |message: &str| TraceError::Parse {
            line: i + 1,
            message: message.to_owned(),
        };
        let mut fields = line.split(',');
        let (Some(ts), Some(context), Some(generated)) = (fields.next(), fields.next(), fields.next()) else {
            return Err(parse("expected TIMESTAMP,ContextTokens,GeneratedTokens"));
        };
        let ns = parse_datetime_ns(ts).ok_or_else(|| parse("bad timestamp"))?;
        let context: u32 = context.trim().parse().map_err(|_| parse("bad ContextTokens"))?;
        let generated: u32 = generated
            .trim()
            .parse()
            .map_err(|_| parse("bad GeneratedTokens"))?;
        let first = *first_ns.get_or_insert(ns);
        if ns < first {
            return Err(parse(
                "timestamp before the first row's (rows must be in time order)",
            ));
        }
        let id = workload.requests.len() as u64;
        let tokens = hasher.buffer();
        tokens.extend((0..context).map(|j| unique_token(id, j)));
        workload.requests.push(SimRequest {
            arrival: Arrival::At(Timestamp(ns - first)),
            locals: hasher.locals(),
            prompt_tokens: context,
            output_tokens: generated,
        });
    }
    Ok(workload)
}

/// A token id for position `j` of request `id` that no other request shares (up to hash
/// collisions of 32 bits, which a whole block of them never repeats).
pub(crate) fn unique_token(id: u64, j: u32) -> u32 {
    mix_unique((id << 32 | u64::from(j)).wrapping_add(UNIQUE_GAMMA))
}

/// The constant [`unique_token`] adds before mixing (SplitMix64's increment).
const UNIQUE_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// [`unique_token`]'s finalizer (SplitMix64's), truncated to 32 bits.
#[inline(always)]
fn mix_unique(mut z: u64) -> u32 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u32
}

/// Writes `unique_token(id, first + k)` into `out[k]` for every `k` (positions past `u32::MAX`
/// are not asked for: a prompt has fewer tokens).
pub(crate) fn fill_unique_tokens(out: &mut [u32], id: u64, first: u32) {
    // `id << 32 | j` is `(id << 32) + j` for a 32-bit `j`, so consecutive positions are
    // consecutive integers before the mix: a loop without dependencies between tokens.
    let base = (id << 32 | u64::from(first)).wrapping_add(UNIQUE_GAMMA);
    for (k, slot) in out.iter_mut().enumerate() {
        *slot = mix_unique(base.wrapping_add(k as u64));
    }
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` as nanoseconds since 1970 (UTC, no leap seconds).
fn parse_datetime_ns(s: &str) -> Option<u64> {
    let s = s.trim();
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.split(':').map(|p| p.parse::<u64>().ok());
    let (h, min, sec) = (t.next()??, t.next()??, t.next()??);
    // Out of range is not a time (and would overflow below).
    if !(0..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&day)
        || h > 23
        || min > 59
        || sec > 60
    {
        return None;
    }
    let frac_ns = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().take(9).collect();
        let value: u64 = digits.parse().ok()?;
        value * 10u64.pow(9 - digits.len() as u32)
    };
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    // Past 2554 the nanoseconds do not fit a u64.
    (days * 86_400 + h * 3600 + min * 60 + sec)
        .checked_mul(1_000_000_000)?
        .checked_add(frac_ns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::hash::{BlockHasher, HashSalt};

    #[test]
    fn filled_tokens_are_the_unique_tokens_of_their_positions() {
        for (id, first) in [
            (0, 0),
            (7, 5),
            (u64::MAX, 0),
            (u64::MAX - 3, u32::MAX - 64),
            (1 << 40, 1),
        ] {
            let mut out = [0u32; 65];
            fill_unique_tokens(&mut out, id, first);
            for (k, &t) in out.iter().enumerate() {
                assert_eq!(
                    t,
                    unique_token(id, first + k as u32),
                    "id {id}, position {}",
                    first as usize + k
                );
            }
        }
    }

    #[test]
    fn mooncake_tokens_are_hash_ids_repeated_and_clamped() {
        let text = r#"{"timestamp": 5, "input_length": 10, "output_length": 3, "hash_ids": [7, 9]}
{"timestamp": 8, "input_length": 99, "output_length": 1, "hash_ids": [7]}
"#;
        let w = read_mooncake(text.as_bytes(), 4, 2, None).unwrap();
        let hasher = BlockHasher::new(2, &HashSalt::NONE);
        // 2 hash ids of 4 tokens: 8 tokens available, input_length 10 clamps to 8.
        let tokens = [7, 7, 7, 7, 9, 9, 9, 9];
        assert_eq!(
            w.requests[0].locals.to_vec().as_slice(),
            hasher.local_hashes(&tokens).as_slice()
        );
        assert_eq!(w.requests[0].prompt_tokens, 8);
        assert_eq!(w.requests[0].arrival, Arrival::At(Timestamp::ZERO));
        assert_eq!(w.requests[0].output_tokens, 3);
        // The second row clamps 99 to 4 tokens and arrives 3 ms after the first.
        assert_eq!(w.requests[1].prompt_tokens, 4);
        assert_eq!(w.requests[1].arrival, Arrival::At(Timestamp::from_millis(3)));
        assert_eq!(
            w.requests[1].locals.to_vec().as_slice(),
            hasher.local_hashes(&[7, 7, 7, 7]).as_slice()
        );
    }

    #[test]
    fn mooncake_truncates_inside_a_trace_block() {
        // 7 of 8 tokens; engine blocks of 3: two full blocks [7,7,7] [7,9,9], one token left.
        let text = r#"{"timestamp": 0, "input_length": 7, "output_length": 1, "hash_ids": [7, 9]}"#;
        let w = read_mooncake(text.as_bytes(), 4, 3, None).unwrap();
        let hasher = BlockHasher::new(3, &HashSalt::NONE);
        assert_eq!(w.requests[0].prompt_tokens, 7);
        assert_eq!(
            w.requests[0].locals.to_vec().as_slice(),
            hasher.local_hashes(&[7, 7, 7, 7, 9, 9]).as_slice()
        );
    }

    #[test]
    fn azure_rows_parse_with_relative_times_and_unique_prompts() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.6805900,374,44\n\
                    2023-11-16 18:15:50.9951690,374,44\n";
        let w = read_azure(text.as_bytes(), 16, None).unwrap();
        assert_eq!(w.requests.len(), 2);
        assert_eq!(w.requests[0].arrival, Arrival::At(Timestamp::ZERO));
        assert_eq!(w.requests[1].arrival, Arrival::At(Timestamp(4_314_579_000)));
        assert_eq!(w.requests[0].locals.len(), 23);
        assert_ne!(w.requests[0].locals.get(0), w.requests[1].locals.get(0));
        assert!(read_azure("TIMESTAMP,a\nnonsense\n".as_bytes(), 16, None).is_err());
    }

    #[test]
    fn datetimes_match_unix_time() {
        assert_eq!(parse_datetime_ns("1970-01-01 00:00:01"), Some(1_000_000_000));
        // 2023-11-16 18:15:46 UTC = 1700158546.
        assert_eq!(
            parse_datetime_ns("2023-11-16 18:15:46.5"),
            Some(1_700_158_546_500_000_000)
        );
    }
}
