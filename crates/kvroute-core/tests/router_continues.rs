//! A prompt routed after the kept hashes of the earlier prompt it continues
//! (`Prompt::Continues`) is routed as the same prompt given as token ids: the same worker, the
//! same overlap, the same booked load, turn after turn, under adapters and cache salts.

use kvroute_core::hash::{BlockHasher, HashSalt, PromptHasher, PromptHashes};
use kvroute_core::ids::{DpRank, ExternalBlockHash, RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{
    IndexEvent, Prompt, RouteOutcome, RouteRequest, Router, RouterConfig, RouterError, WorkerRole,
    WorkerSpec, stored_blocks,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;

const BLOCK: u32 = 4;
const WORKERS: u64 = 3;

fn key(w: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(w), DpRank(0))
}

/// A router whose workers each cached one of `cached` (token prompts, unsalted) and serve
/// adapter `a`.
fn router(cached: &[Vec<u32>]) -> Router {
    let config = RouterConfig {
        block_size: BLOCK,
        seed: 7,
        ..RouterConfig::default()
    };
    let mut r = Router::new(config).expect("a valid config");
    let hasher = BlockHasher::new(BLOCK as usize, &HashSalt::NONE);
    for w in 0..WORKERS {
        r.handle_worker_added(
            Timestamp::ZERO,
            WorkerSpec::new(key(w), WorkerRole::Aggregated, 1 << 10),
        )
        .expect("a new worker");
        // Every worker serves adapter `a`, so a request under it may go anywhere.
        r.handle_adapters(Timestamp::ZERO, key(w), &["a"]);
    }
    for (i, tokens) in cached.iter().enumerate() {
        let (mut locals, mut chain) = (Vec::new(), Vec::new());
        hasher.hash_prompt(tokens, &mut locals, &mut chain);
        let blocks = stored_blocks(&locals, &chain);
        r.handle_kv_event(
            Timestamp::ZERO,
            key(i as u64 % WORKERS),
            IndexEvent::Stored {
                parent: None::<ExternalBlockHash>,
                blocks: &blocks,
            },
        )
        .expect("a valid store");
    }
    r
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn a_continued_prompt_routes_as_its_token_ids(
        cached in proptest::collection::vec(proptest::collection::vec(0u32..6, 0..40), 1..4),
        turns in proptest::collection::vec(
            (proptest::collection::vec(0u32..6, 0..20), any::<bool>(), 0usize..4),
            1..8,
        ),
        lora in prop_oneof![Just(None), Just(Some("a"))],
        salt in prop_oneof![Just(None), Just(Some("t"))],
    ) {
        let (mut plain, mut continued) = (router(&cached), router(&cached));
        let salting = HashSalt { lora_name: lora, namespace: salt };
        let hasher = PromptHasher::new(BLOCK as usize, &salting);
        // A conversation: each turn appends tokens to the last and is routed by both routers,
        // one from its token ids, one after the previous turn's kept hashes (some turns start
        // a conversation anew on a cached prompt, with no kept hashes).
        let mut tokens: Vec<u32> = Vec::new();
        let mut earlier: Option<PromptHashes> = None;
        for (id, (more, anew, from)) in turns.into_iter().enumerate() {
            if anew {
                tokens = cached[from % cached.len()].clone();
                earlier = None;
            }
            tokens.extend(more);
            let id = RequestId(id as u64);
            let request = |prompt| RouteRequest {
                lora_name: lora,
                cache_salt: salt,
                ..RouteRequest::new(id, prompt)
            };
            let want = plain.handle_request(Timestamp::ZERO, &request(Prompt::Tokens(&tokens))).unwrap();
            let prompt = match &earlier {
                Some(earlier) => Prompt::Continues { tokens: &tokens, earlier },
                None => Prompt::Tokens(&tokens),
            };
            let got = continued.handle_request(Timestamp::ZERO, &request(prompt)).unwrap();
            prop_assert!(matches!(got, RouteOutcome::Routed(_)), "{got:?}");
            prop_assert_eq!(got, want);
            prop_assert_eq!(continued.metrics().workers, plain.metrics().workers);
            continued.check_invariants().map_err(TestCaseError::fail)?;
            earlier = Some(PromptHashes::new(&hasher, &tokens));
        }
    }
}

#[test]
fn an_earlier_prompt_longer_than_the_prompt_is_refused() {
    let mut r = router(&[vec![1, 2, 3, 4]]);
    let hasher = PromptHasher::new(BLOCK as usize, &HashSalt::NONE);
    let earlier = PromptHashes::new(&hasher, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let prompt = Prompt::Continues {
        tokens: &[1, 2, 3, 4, 5, 6, 7],
        earlier: &earlier,
    };
    match r.handle_request(Timestamp::ZERO, &RouteRequest::new(RequestId(1), prompt)) {
        Err(RouterError::InconsistentPrompt {
            blocks: 2,
            prompt_tokens: 7,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    r.check_invariants().expect("nothing booked");
    assert_eq!(r.metrics().active_now, 0);
}
