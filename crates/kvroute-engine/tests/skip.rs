//! Stretches of decode passes: an engine that runs every stretch it plans (its grows at their
//! passes, the rest skipped) ends every pass exactly as one that steps through them all, with
//! the same KV events and its invariants holding after every stretch and pass, a stretch cut
//! short and a request aborted after it included, and a stretch cut at its pass in flight to
//! take a request.

mod common;

use common::{request, with};
use kvroute_core::ids::RequestId;
use kvroute_core::time::Timestamp;
use kvroute_engine::{DecodeStretch, Engine, StretchEnd};

/// How a test touches the engines after cutting a stretch short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Touch {
    None,
    /// The middle running request is aborted after the stretch.
    Abort,
    /// A request comes while the stretch's last pass runs, the stretch truncated to it.
    Arrival,
}

/// Runs two engines under `config` on the same requests (`requests` of them, some sharing a
/// prompt prefix, the later ones added partway), one stepping every pass, the other running
/// every stretch [`Engine::plan_decode_stretch`] plans: its grows at their passes and the rest
/// skipped. Every pass of a stretch ends when the stepped one does, with the stepped pass's KV
/// events, in order, and decodes every running request and nothing else. With a [`Touch`], the
/// first stretch of two or more passes with two or more running (and, to take a request, one
/// left to come) is cut halfway and the engines touched there. Returns
/// the passes run in stretches, those of them that had KV events, and those that finished
/// requests (only a stretch's last pass may).
fn stretch_against_step(
    config: kvroute_engine::EngineConfig,
    requests: u32,
    touch: Touch,
) -> (u64, u64, u64) {
    let mut stepped = Engine::new(config.clone()).expect("valid config");
    let mut skipping = Engine::new(config).expect("valid config");
    let prompt = |i: u32| {
        // Requests in pairs share their first 40 tokens; prompts of 3 to 70 tokens.
        let shared = (i / 2) * 1000..(i / 2) * 1000 + 40;
        shared
            .chain(i * 1000 + 500..i * 1000 + 500 + (3 + 17 * i) % 31)
            .take((3 + 23 * i as usize) % 71)
    };
    let add = |engine: &mut Engine, at: Timestamp, i: u32| {
        engine
            .add_request(at, request(u64::from(i), prompt(i), 30 + 37 * i % 90))
            .expect("the request fits");
    };
    for i in 0..requests / 2 {
        add(&mut stepped, Timestamp::ZERO, i);
        add(&mut skipping, Timestamp::ZERO, i);
    }
    let (mut later, mut real) = (requests / 2, 0);
    let (mut stretched, mut with_events, mut finishing) = (0, 0, 0);
    let (mut stretch, mut ends) = (DecodeStretch::default(), Vec::new());
    let (mut now, mut touched) = (Timestamp::ZERO, false);
    loop {
        // Every few real passes a request arrives, and whenever the engines are idle.
        let idle = skipping.next_wakeup().is_none();
        if later < requests && (real % 5 == 4 || idle) {
            add(&mut stepped, now, later);
            add(&mut skipping, now, later);
            later += 1;
        }
        let Some(at) = skipping.next_wakeup() else {
            break;
        };
        let k = skipping.plan_decode_stretch(&mut stretch);
        assert_eq!(stepped.next_wakeup(), Some(at), "both engines wake together");
        if k == 0 {
            real += 1;
            let out = skipping.step(at).expect("an engine with work steps");
            skipping.check_invariants().expect("engine invariants");
            let expected = stepped.step(at).expect("the stepped engine keeps up");
            assert_eq!(out, expected, "a real pass after a stretch differs");
            now = out.end;
            continue;
        }
        ends.clear();
        skipping.decode_stretch_ends(at, &stretch, &mut ends);
        assert_eq!(ends.len(), k as usize);
        let running = skipping.running_requests().to_vec();
        let planned_finishing = stretch.finishing() as usize;
        let cut = touch != Touch::None
            && !touched
            && k >= 2
            && running.len() >= 2
            && (touch != Touch::Arrival || later < requests);
        let k = if cut { k / 2 } else { k };
        if cut && touch == Touch::Arrival {
            stretch.truncate(k);
        }
        for p in 1..=k {
            let arrival = p == k && cut && touch == Touch::Arrival;
            let StretchEnd { events, finished } = if p == k {
                let last_start = if k >= 2 { ends[k as usize - 2] } else { at };
                if arrival {
                    // The request comes while pass `k` runs (after it started, before it ends).
                    add(&mut skipping, last_start, later);
                }
                skipping.finish_decode_stretch(&mut stretch, k, last_start, ends[k as usize - 1])
            } else if stretch.next_grow() == Some(p) {
                StretchEnd {
                    events: skipping.run_decode_stretch(&mut stretch, p),
                    finished: Vec::new(),
                }
            } else {
                StretchEnd::default()
            };
            let next = stepped.next_wakeup().expect("the stepped engine has work");
            let out = stepped.step(next).expect("the stepped engine keeps up");
            if arrival {
                add(&mut stepped, next, later);
                later += 1;
            }
            assert_eq!(
                out.end,
                ends[p as usize - 1],
                "a skipped pass ends when the stepped one does"
            );
            assert_eq!(
                events, out.events,
                "a skipped pass's KV events are the stepped one's"
            );
            let emitted: Vec<RequestId> = out.emitted.iter().map(|e| e.request).collect();
            assert_eq!(emitted, running, "a skipped pass decodes every running request");
            assert_eq!(
                finished, out.finished,
                "a stretch's last pass finishes the stepped one's requests"
            );
            let planned = if p == k && !cut { planned_finishing } else { 0 };
            assert_eq!(
                finished.len(),
                planned,
                "the plan named the requests the stretch finishes"
            );
            assert!(out.first_token.is_empty() && out.preempted.is_empty());
            with_events += u64::from(!events.is_empty());
            finishing += u64::from(!finished.is_empty());
        }
        skipping.check_invariants().expect("engine invariants");
        assert_eq!(skipping.kv_blocks(), stepped.kv_blocks());
        now = ends[k as usize - 1];
        stretched += u64::from(k);
        if cut {
            if touch == Touch::Abort {
                let id = running[running.len() / 2];
                assert!(skipping.abort_request(id) && stepped.abort_request(id));
                skipping.check_invariants().expect("engine invariants");
            }
            touched = true;
        }
    }
    assert_eq!(touched, touch != Touch::None, "the engines were touched");
    assert_eq!(stepped.next_wakeup(), None, "both engines finish together");
    assert_eq!(later, requests, "every request came");
    assert_eq!(
        skipping.cached_blocks().collect::<Vec<_>>(),
        stepped.cached_blocks().collect::<Vec<_>>()
    );
    (stretched, with_events, finishing)
}

#[test]
fn stretches_across_block_boundaries_match_stepping() {
    // Blocks of 8 tokens; the default pool of 64 blocks fills, so blocks are evicted (`removed`
    // events inside stretches) and the free blocks bound some stretches.
    let (stretched, with_events, finishing) =
        stretch_against_step(with(|c| c.block_size = 8), 12, Touch::None);
    assert!(
        stretched > 0 && with_events > 0 && finishing > 0,
        "stretches crossed blocks and finished requests: {stretched}, {with_events}, {finishing}"
    );
}

#[test]
fn stretches_match_stepping_under_every_timing_path() {
    use kvroute_engine::timing::{RooflineConfig, RooflineEfficiency};
    use kvroute_engine::{Dispersion, GpuSpec, ModelSpec, StepJitter, TimingConfig};
    let jitter = StepJitter {
        dispersion: Dispersion::Lognormal(0.3),
        seed: 7,
    };
    let roofline = TimingConfig::Roofline(RooflineConfig {
        model: ModelSpec::builtin("llama-3.1-8b").expect("built in"),
        gpu: GpuSpec::builtin("h100-sxm").expect("built in"),
        tensor_parallel: 1,
        efficiency: RooflineEfficiency::TYPICAL,
    });
    let configs = [
        with(|c| c.step_jitter = Some(jitter)),
        with(|c| c.timing = roofline.clone()),
        with(|c| {
            c.timing = roofline.clone();
            c.step_jitter = Some(jitter);
        }),
        with(|c| c.enable_prefix_caching = false),
        with(|c| {
            c.block_size = 16;
            c.num_blocks = 40;
        }),
    ];
    for config in configs {
        let (stretched, _, _) = stretch_against_step(config, 10, Touch::None);
        assert!(stretched > 0, "some passes were run in stretches");
    }
}

#[test]
fn a_stretch_cut_short_then_an_abort_leave_the_others_exact() {
    let (stretched, _, _) = stretch_against_step(with(|c| c.block_size = 16), 8, Touch::Abort);
    assert!(stretched > 0, "some passes were run in stretches");
}

#[test]
fn a_stretch_truncated_to_its_pass_in_flight_takes_a_request_exactly() {
    for block_size in [8, 16] {
        let (stretched, _, _) = stretch_against_step(with(|c| c.block_size = block_size), 10, Touch::Arrival);
        assert!(stretched > 0, "some passes were run in stretches");
    }
}
