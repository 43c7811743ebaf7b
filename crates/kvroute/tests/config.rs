//! The config pipeline: a TOML file first, the flags over it, key by key.

use clap::Parser;
use kvroute::config::layered;
use kvroute::replay::{ReplayArgs, ReplayConfig};
use kvroute::serve::ServeArgs;
use kvroute_core::router::{RouterConfig, RouterSpec};
use kvroute_testkit::Scratch;
use proptest::prelude::*;

#[test]
fn file_only() {
    let dir = Scratch::new("config");
    let path = dir.write(
        "file-only.toml",
        "workers = 4\nblock-size = 32\npolicy = [\"kv\", \"round-robin\"]\n",
    );
    let c = layered(Some(&path), &ReplayConfig::default()).unwrap();
    assert_eq!(c.workers, Some(4));
    assert_eq!(c.block_size, Some(32));
    assert_eq!(c.policy, Some(vec!["kv".to_owned(), "round-robin".to_owned()]));
    assert_eq!(c.seed, None);
}

#[test]
fn flags_only() {
    let flags = ReplayConfig {
        workers: Some(8),
        kv_loss: Some(0.5),
        ..ReplayConfig::default()
    };
    assert_eq!(layered(None, &flags).unwrap(), flags);
}

#[test]
fn both_and_the_flag_wins() {
    let dir = Scratch::new("config");
    let path = dir.write("both.toml", "workers = 4\nseed = 3\nrate = 2.5\n");
    let flags = ReplayConfig {
        workers: Some(8),
        kv_lag_ms: Some(1.0),
        ..ReplayConfig::default()
    };
    let c = layered(Some(&path), &flags).unwrap();
    assert_eq!(c.workers, Some(8), "the flag beats the file");
    assert_eq!(c.seed, Some(3), "the file's key stays");
    assert_eq!(c.rate, Some(2.5));
    assert_eq!(c.kv_lag_ms, Some(1.0));
}

#[test]
fn an_unknown_key_is_named() {
    let dir = Scratch::new("config");
    let path = dir.write("unknown.toml", "workers = 4\nblok-size = 32\n");
    let err = format!(
        "{:#}",
        layered(Some(&path), &ReplayConfig::default()).unwrap_err()
    );
    assert!(err.contains("blok-size"), "{err}");
    assert!(err.contains("line 2"), "{err}");
    // snake_case is not a second spelling.
    let path = dir.write("snake.toml", "block_size = 32\n");
    let err = format!(
        "{:#}",
        layered(Some(&path), &ReplayConfig::default()).unwrap_err()
    );
    assert!(err.contains("block_size"), "{err}");
}

#[test]
fn a_wrong_type_is_named() {
    let dir = Scratch::new("config");
    let path = dir.write("type.toml", "seed = 1\nworkers = \"many\"\n");
    let err = format!(
        "{:#}",
        layered(Some(&path), &ReplayConfig::default()).unwrap_err()
    );
    assert!(err.contains("`workers`"), "{err}");
    assert!(err.contains("line 2"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn serve_workers_come_from_tables_or_flags_with_the_same_keys() {
    let dir = Scratch::new("config");
    let path = dir.write(
        "serve.toml",
        "queue-capacity = 64\nblock-size = 32\napproximate-tokenizer = true\n\
         [[worker]]\nurl = \"http://127.0.0.1:1\"\ndp = 2\nevents = \"tcp://127.0.0.1:5557\"\n\
         [[worker]]\nurl = \"http://127.0.0.1:2\"\nmax-requests = 8\n",
    );
    let path = path.to_str().unwrap();
    let args = |flags: &[&str]| {
        let mut argv = vec!["--config", path];
        argv.extend_from_slice(flags);
        serve_config(&argv).unwrap()
    };
    let c = args(&[]);
    assert_eq!((c.routing.queue_capacity, c.routing.block_size), (64, 32));
    assert_eq!(c.workers.len(), 2);
    assert_eq!(c.workers[0].dp_size, 2);
    assert_eq!(c.workers[1].max_requests, 8);
    let c = args(&[
        "--queue-capacity",
        "5",
        "--worker",
        "http://127.0.0.1:3,dp=4,max-requests=9",
    ]);
    assert_eq!((c.routing.queue_capacity, c.routing.block_size), (5, 32));
    assert_eq!(c.workers.len(), 1, "--worker replaces the file's workers");
    assert_eq!((c.workers[0].dp_size, c.workers[0].max_requests), (4, 9));
}

#[test]
fn serve_discovery_keys_and_flags_agree() {
    let serve = |argv: &[&str]| {
        let mut all = vec!["--approximate-tokenizer"];
        all.extend_from_slice(argv);
        serve_config(&all)
    };
    let dir = Scratch::new("config");
    let path = dir.write(
        "discovery.toml",
        "discover-dns = \"srv:_http._tcp.vllm\"\ndiscover-dns-server = \"127.0.0.1:5353\"\n\
         discover-file = \"/etc/kvroute/workers\"\ndiscover-interval-ms = 250\n\
         discover-worker-template = \"http://{host}:{port},events=tcp://{host}:5557\"\n\
         discover-drain-timeout-ms = 9000\n",
    );
    let from_file = serve(&["--config", path.to_str().unwrap()]).unwrap();
    let from_flags = serve(&[
        "--discover-dns",
        "srv:_http._tcp.vllm",
        "--discover-dns-server",
        "127.0.0.1:5353",
        "--discover-file",
        "/etc/kvroute/workers",
        "--discover-interval-ms",
        "250",
        "--discover-worker-template",
        "http://{host}:{port},events=tcp://{host}:5557",
        "--discover-drain-timeout-ms",
        "9000",
    ])
    .unwrap();
    assert_eq!(from_file, from_flags);
    let spec = from_flags.discovery().unwrap().unwrap();
    assert_eq!(spec.dns.unwrap().name, "_http._tcp.vllm");
    assert_eq!(spec.interval.as_millis(), 250);
    // A flag beats the file's key; a bad value is named by its flag.
    let c = serve(&["--config", path.to_str().unwrap(), "--discover-interval-ms", "40"]).unwrap();
    assert_eq!(c.discovery.discover_interval_ms, 40);
    let err = format!("{:#}", serve(&["--discover-dns", "workers"]).unwrap_err());
    assert!(err.starts_with("--discover-port:"), "{err}");
    let err = format!("{:#}", serve(&["--discover-dns-type", "mx"]).unwrap_err());
    assert!(err.contains("a or srv"), "{err}");
}

#[test]
fn serve_tenants_come_from_tables_and_their_headers_from_keys_or_flags() {
    let serve = |argv: &[&str]| {
        let mut all = vec!["--approximate-tokenizer"];
        all.extend_from_slice(argv);
        serve_config(&all)
    };
    let dir = Scratch::new("config");
    let path = dir.write(
        "tenants.toml",
        "tenant-header = \"x-tenant\"\npriority-header = \"x-priority\"\nforward-priority = true\n\
         [[tenant]]\nname = \"chat\"\napi-keys = [\"sk-chat\"]\nweight = 3\n\
         [[tenant]]\nname = \"batch\"\nheader-values = [\"batch\"]\nrequests-per-interval = 10\n",
    );
    let from_file = serve(&["--config", path.to_str().unwrap()]).unwrap();
    let t = &from_file.tenants;
    assert_eq!(t.tenants.len(), 2);
    assert_eq!(t.tenants[0].api_keys, ["sk-chat"]);
    assert_eq!(t.tenants[1].requests_per_interval, Some(10));
    let weights: Vec<u32> = t.fair().weights.iter().map(|w| w.get()).collect();
    assert_eq!(weights, [1, 3, 1]);
    let router = from_file.validate().unwrap();
    assert_eq!(router.fair, t.fair());
    // The headers' keys are flags too, and a flag beats the file.
    let flagged = serve(&[
        "--config",
        path.to_str().unwrap(),
        "--tenant-header",
        "x-team",
        "--forward-priority=false",
    ])
    .unwrap();
    assert_eq!(flagged.tenants.tenant_header.as_deref(), Some("x-team"));
    assert!(!flagged.tenants.forward_priority);
    let bad = dir.write("tenants-bad.toml", "[[tenant]]\nname = \"a\"\nweight = 0\n");
    let err = format!("{:#}", serve(&["--config", bad.to_str().unwrap()]).unwrap_err());
    assert!(err.contains("weight"), "{err}");
}

/// The router `kvroute serve` would run with `flags` (and the built-in tokenizer), through the
/// command's own loader: flags, defaults, checks.
fn serve_router(flags: &[&str]) -> anyhow::Result<RouterConfig> {
    let mut argv = vec!["--approximate-tokenizer"];
    argv.extend_from_slice(flags);
    Ok(serve_config(&argv)?.validate()?)
}

/// The configuration `kvroute serve` loads with `argv`, through the command's own loader: its
/// file, then its flags, then the defaults.
fn serve_config(argv: &[&str]) -> anyhow::Result<kvroute_proxy::ServeConfig> {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let mut all = vec!["serve"];
    all.extend_from_slice(argv);
    Cli::try_parse_from(all)?.serve.to_config()
}

/// The router `kvroute replay` would simulate with `flags`, through the command's own loader.
fn replay_router(flags: &[&str]) -> anyhow::Result<RouterConfig> {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        replay: ReplayArgs,
    }
    let mut argv = vec!["replay"];
    argv.extend_from_slice(flags);
    let mut runs = kvroute::replay::router_configs(&Cli::try_parse_from(argv)?.replay)?;
    assert_eq!(runs.len(), 1, "{flags:?}");
    Ok(runs.remove(0).1)
}

/// `serve`'s router as `replay` builds it: the index bound the live proxy sets on its own
/// (`max-blocks-per-worker`, a memory bound; in a simulation the engines' own evictions bound
/// the index) is the one setting beside the shared options.
fn as_replay_builds_it(serve: RouterConfig) -> RouterConfig {
    assert_eq!(serve.max_blocks_per_worker.map(|n| n.get()), Some(1 << 20));
    RouterConfig {
        max_blocks_per_worker: None,
        ..serve
    }
}

/// The router options of both commands, each flag set as both take it (block size named, as
/// the two commands' defaults differ).
const SPECS: &[&[&str]] = &[
    &[],
    &["--policy", "kv"],
    &["--policy", "kv:staged:scale=2", "--cache", "approximate"],
    &["--policy", "kv:full"],
    &["--policy", "dynamo"],
    &["--policy", "dynamo:full"],
    &["--policy", "dynamo:staged:scale=2:credit=0.5"],
    &["--policy", "kv:temperature=0.1"],
    &["--policy", "kv:spread=0.05"],
    &["--policy", "round-robin"],
    &["--policy", "random"],
    &["--policy", "least-loaded"],
    &["--policy", "power-of-two"],
    &["--policy", "sglang-cache-aware"],
    &["--policy", "llmd-weighted"],
    &["--cache", "events"],
    &["--cache", "predict"],
    &["--cache", "predict:ttl=2.5"],
    &["--cache", "approximate:ttl=120:max-blocks=65536:prune=0.5"],
    &["--cache", "approximate:ttl=none"],
    &["--decider", "never"],
    &["--decider", "always"],
    &["--decider", "512"],
    &["--queue-capacity", "0"],
    &["--queue-capacity", "7"],
    &["--when-empty", "reject"],
    &["--when-empty", "queue"],
    &["--when-empty", "queue", "--queue-capacity", "0"],
    &["--busy-requests-fraction", "0"],
    &["--busy-requests-fraction", "0.9"],
    &["--seed", "7"],
    &["--block-size", "16"],
];

#[test]
fn every_router_spec_one_command_takes_the_other_takes_into_the_same_router() {
    for flags in SPECS {
        let mut flags = flags.to_vec();
        if !flags.contains(&"--block-size") {
            flags.extend(["--block-size", "64"]);
        }
        let serve = serve_router(&flags).unwrap_or_else(|e| panic!("serve {flags:?}: {e:#}"));
        let replay = replay_router(&flags).unwrap_or_else(|e| panic!("replay {flags:?}: {e:#}"));
        assert_eq!(as_replay_builds_it(serve), replay, "{flags:?}");
        // The serve flags a replay report prints run the router it simulated.
        let printed = RouterSpec::from_config(&replay).unwrap().to_string();
        let again: Vec<&str> = printed.split(' ').collect();
        let serve_again = serve_router(&again).unwrap_or_else(|e| panic!("serve {printed}: {e:#}"));
        assert_eq!(as_replay_builds_it(serve_again), replay, "{printed}");
    }
    // replay's `--predict-on-route-s S` is `--cache predict:ttl=S`.
    assert_eq!(
        replay_router(&["--predict-on-route-s", "2.5"]).unwrap(),
        replay_router(&["--cache", "predict:ttl=2.5"]).unwrap()
    );
    let both = replay_router(&["--predict-on-route-s", "2", "--cache", "predict"]).unwrap_err();
    assert!(format!("{both:#}").contains("give one"), "{both:#}");
}

#[test]
fn a_bad_router_spec_gets_the_same_error_from_both_commands() {
    let bad: &[(&[&str], &str)] = &[
        (&["--policy", "kv:bogus"], "\"bogus\""),
        (&["--policy", "nosuch"], "valid names"),
        (&["--policy", "kv-aware:full"], "valid names"),
        (&["--policy", "kv:scale=x"], "scale"),
        (&["--policy", "kv:spread=-1"], "spread_tolerance"),
        (&["--policy", "kv:credit=2"], "overlap_credit"),
        (&["--policy", "random:full"], "takes no options"),
        (&["--cache", "approx"], "events, predict or approximate"),
        (&["--cache", "approximate:ttl=0"], "ttl"),
        (&["--cache", "predict:size=3"], "unknown option"),
        (&["--decider", "sometimes"], "decider"),
        (&["--busy-requests-fraction", "NaN"], "--busy-requests-fraction"),
        (&["--busy-requests-fraction=-1"], "--busy-requests-fraction"),
        (&["--when-empty", "wait"], "reject or queue"),
    ];
    for (flags, word) in bad {
        let serve = format!("{:#}", serve_router(flags).unwrap_err());
        let replay = format!("{:#}", replay_router(flags).unwrap_err());
        assert_eq!(serve, replay, "{flags:?}");
        assert!(serve.contains(word), "{flags:?}: {serve}");
        assert!(serve.starts_with(flags[0].split('=').next().unwrap()), "{serve}");
    }
}

fn policy_spec() -> impl Strategy<Value = String> {
    let option = prop_oneof![
        Just("full".to_owned()),
        Just("staged".to_owned()),
        (0u32..64).prop_map(|v| format!("scale={}", f64::from(v) / 4.0)),
        (0u32..=8).prop_map(|v| format!("credit={}", f64::from(v) / 8.0)),
        (0u32..10).prop_map(|v| format!("temperature={}", f64::from(v) / 10.0)),
        (0u32..10).prop_map(|v| format!("spread={}", f64::from(v) / 100.0)),
    ];
    let cost = (
        prop_oneof![Just("kv"), Just("dynamo")],
        prop::collection::vec(option, 0..4),
    )
        .prop_map(|(name, options)| {
            std::iter::once(name.to_owned())
                .chain(options)
                .collect::<Vec<_>>()
                .join(":")
        });
    prop_oneof![
        prop::sample::select(kvroute_core::router::PolicyConfig::NAMES).prop_map(str::to_owned),
        cost
    ]
}

fn cache_spec() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("events".to_owned()),
        (
            prop_oneof![Just("predict"), Just("approximate")],
            prop_oneof![
                Just(String::new()),
                (1u32..600_000).prop_map(|ms| format!(":ttl={}", f64::from(ms) / 1e3))
            ],
            prop_oneof![
                Just(String::new()),
                (1u64..1 << 24).prop_map(|n| format!(":max-blocks={n}"))
            ],
        )
            .prop_map(|(view, ttl, cap)| format!("{view}{ttl}{cap}")),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Generated specs: both commands take them into the same router, and the flags printed
    /// for it run the same router again.
    #[test]
    fn generated_router_specs_agree_across_commands(
        policy in policy_spec(),
        cache in cache_spec(),
        decider in prop_oneof![Just("always".to_owned()), Just("never".to_owned()), (0u64..100_000).prop_map(|n| n.to_string())],
        queue in 0usize..4096,
        when_empty in prop_oneof![Just("reject"), Just("queue")],
    ) {
        let queue = queue.to_string();
        let flags = [
            "--policy", &policy, "--cache", &cache, "--decider", &decider,
            "--queue-capacity", &queue, "--when-empty", when_empty, "--block-size", "32",
        ];
        let serve = as_replay_builds_it(serve_router(&flags).unwrap());
        let replay = replay_router(&flags).unwrap();
        prop_assert_eq!(&serve, &replay);
        let printed = RouterSpec::from_config(&replay).unwrap().to_string();
        let again: Vec<&str> = printed.split(' ').collect();
        prop_assert_eq!(as_replay_builds_it(serve_router(&again).unwrap()), replay);
    }
}

#[test]
fn a_router_spec_in_either_commands_file_makes_the_same_router() {
    let keys = "cache = \"approximate:ttl=120\"\ndecider = \"256\"\nblock-size = 64\n";
    let dir = Scratch::new("config");
    let serve = dir.write(
        "spec-serve.toml",
        format!("policy = \"kv:staged:scale=2\"\n{keys}"),
    );
    let replay = dir.write(
        "spec-replay.toml",
        format!("policy = [\"kv:staged:scale=2\"]\n{keys}"),
    );
    let serve = serve_router(&["--config", serve.to_str().unwrap()]).unwrap();
    let replay = replay_router(&["--config", replay.to_str().unwrap()]).unwrap();
    assert_eq!(as_replay_builds_it(serve), replay);
    assert_eq!(
        RouterSpec::from_config(&replay).unwrap().to_string(),
        "--policy kv:scale=2 --cache approximate:ttl=120 --decider 256 --block-size 64 --seed 0 \
         --queue-capacity 1024 --when-empty reject"
    );
}

/// The planner file's `[engine]` takes the model and its GPUs as `replay` does: the blocks are
/// what fits, the timing model the roofline; a wrong key or value is named.
#[test]
fn the_planner_files_engine_takes_a_model_and_its_gpus() {
    use kvroute::plan::PlanFile;
    use kvroute_engine::capacity::{Deployment, PassLimits};
    let text =
        "[planner]\nmode = \"agg\"\n\n[engine]\nmodel = \"Qwen/Qwen3-14B\"\ngpu = \"A100-80GB\"\ntp = 2\n";
    let engine = PlanFile::parse(text).unwrap().live_engine().unwrap();
    let (model, gpu) = (
        kvroute_engine::ModelSpec::builtin("qwen3-14b").unwrap(),
        kvroute_engine::GpuSpec::builtin("a100-sxm-80gb").unwrap(),
    );
    let mock = kvroute_mock::MockConfig::default_engine();
    let blocks = Deployment {
        model: &model,
        gpu: &gpu,
        tensor_parallel: 2,
        gpu_memory_utilization: 0.9,
    }
    .kv_blocks(PassLimits {
        block_size: mock.block_size,
        max_num_batched_tokens: mock.max_num_batched_tokens,
        max_num_seqs: mock.max_num_seqs,
    })
    .unwrap();
    assert_eq!(engine.num_blocks, blocks);
    match &engine.timing {
        kvroute_engine::TimingConfig::Roofline(r) => {
            assert_eq!((&r.model, &r.gpu, r.tensor_parallel), (&model, &gpu, 2));
        }
        other => panic!("not the roofline: {other:?}"),
    }
    let typo = PlanFile::parse(&text.replace("tp = 2", "tensor_parallel = 2")).unwrap_err();
    assert!(format!("{typo:#}").contains("tensor_parallel"), "{typo:#}");
    let bad = PlanFile::parse(&text.replace("A100-80GB", "tpu-v5"))
        .unwrap()
        .live_engine()
        .unwrap_err();
    assert!(format!("{bad:#}").contains("tpu-v5"), "{bad:#}");
}

/// `--timing FILE` reads a whole timing model (as `[timing]`), over the roofline a model
/// would otherwise get.
#[test]
fn a_timing_file_beats_the_models_roofline() {
    use kvroute::hardware::{EngineChoice, Timing};
    let dir = Scratch::new("config");
    let path = dir.write("timing.toml", "kind = \"polynomial\"\n");
    let choice = EngineChoice {
        model: Some("llama-3.1-8b".to_owned()),
        ..EngineChoice::default()
    };
    let base = kvroute_mock::MockConfig::default_engine();
    let roofline = choice.build(&base).unwrap().engine.timing;
    assert!(matches!(roofline, kvroute_engine::TimingConfig::Roofline(_)));
    let with_file = EngineChoice {
        timing: Some(Timing::Named(path.display().to_string())),
        ..choice
    };
    assert_eq!(
        with_file.build(&base).unwrap().engine.timing,
        kvroute_engine::TimingConfig::Polynomial
    );
}
