use super::*;
use kvroute_core::router::Decider;

#[test]
fn session_keys_are_read_and_checked() {
    let c = ServeConfig::from_toml_str(
        "session-header = \"X-Session-Id\"\nsession-idle-timeout-ms = 60000\nmax-sessions = 10\n",
    )
    .unwrap();
    let router = c.validate().unwrap();
    assert_eq!(c.routing.session_header.as_deref(), Some("X-Session-Id"));
    assert_eq!(router.sessions.idle_ttl, Duration::from_secs(60));
    assert_eq!(router.sessions.max_sessions, 10);
    assert!(ServeConfig::from_toml_str("session-headers = \"x\"").is_err());
    for (bad, field) in [
        ("session-header = \"x session\"", "session-header"),
        ("session-header = \"\"", "session-header"),
        ("max-sessions = 0", "max-sessions"),
        ("session-idle-timeout-ms = 0", "session-idle-timeout-ms"),
    ] {
        let err = ServeConfig::from_toml_str(bad).unwrap().validate().unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { field: f, .. } if f == field),
            "{bad}: {err}"
        );
    }
}

#[test]
fn files_reject_unknown_keys_and_flags_parse() {
    let c = ServeConfig::from_toml_str(
        "policy = \"round-robin\"\n[[worker]]\nurl = \"http://127.0.0.1:1\"\ndp = 2\n",
    )
    .unwrap();
    assert_eq!(c.workers[0].dp_size, 2);
    assert!(c.validate().is_ok());
    assert!(ServeConfig::from_toml_str("polcy = \"kv\"").is_err());
    assert!(ServeConfig::from_toml_str("[[worker]]\nurl = \"http://a\"\nport = 1\n").is_err());
    let w = WorkerConfig::parse_flag("http://h:1,events=tcp://h:2,replay=tcp://h:3,dp=2").unwrap();
    assert_eq!(w.events.as_deref(), Some("tcp://h:2"));
    assert_eq!(w.dp_size, 2);
    assert_eq!(w.engine, EngineKind::Vllm);
    let w = WorkerConfig::parse_flag("http://h:1,dp=4,engine=sglang").unwrap();
    assert_eq!(w.engine, EngineKind::Sglang);
    let w = WorkerConfig::parse_flag("http://h:1,dp=4,events=tcp://h:5557,replay=tcp://h:5561").unwrap();
    assert!(w.validate(16, EngineKind::Vllm).is_ok());
    assert!(WorkerConfig::parse_flag("http://h:1,engine=trt").is_err());
    for e in [EngineKind::Vllm, EngineKind::Sglang] {
        assert_eq!(e.name().parse::<EngineKind>(), Ok(e));
    }
    let c = ServeConfig::from_toml_str("[[worker]]\nurl = \"http://h:1\"\nengine = \"sglang\"\n").unwrap();
    assert_eq!(c.workers[0].engine, EngineKind::Sglang);
    assert!(ServeConfig::from_toml_str("[[worker]]\nurl = \"http://h:1\"\nengine = \"trt\"\n").is_err());
    assert!(WorkerConfig::parse_flag("http://h:1,bogus=1").is_err());
    for bad in [
        "ftp://h:1",
        "http://h:1,dp=0",
        "http://h:1,dp=2,events=ipc:///tmp/kv",
        "http://h:1,dp=2,events=tcp://h:65535",
        "http://h:1,block-size=64",
        "http://h:1,role=prefil",
    ] {
        let w = WorkerConfig::parse_flag(bad).unwrap();
        assert!(w.validate(16, EngineKind::Vllm).is_err(), "{bad}");
    }
    let bad = ServeConfig {
        routing: RoutingConfig {
            policy: "nope".into(),
            ..Default::default()
        },
        ..ServeConfig::default()
    };
    assert!(bad.validate().is_err());
}

#[test]
fn the_file_names_the_groups_fields_flat_and_round_trips() {
    let c = ServeConfig::from_toml_str(
        "policy = \"round-robin\"\nnats-heartbeat-ms = 500\nmax-body-bytes = 10\n\
         [[worker]]\nurl = \"http://h:1\"\n",
    )
    .unwrap();
    assert_eq!(c.routing.policy, "round-robin");
    assert_eq!(c.replicas.nats_heartbeat_ms, 500);
    assert_eq!(c.limits.max_body_bytes, 10);
    assert_eq!(c.workers[0].url, "http://h:1");
    let text = toml::to_string(&c).unwrap();
    assert!(text.contains("nats-heartbeat-ms = 500\n"), "{text}");
    assert_eq!(ServeConfig::from_toml_str(&text).unwrap(), c);
    // A group's name is no key.
    assert!(ServeConfig::from_toml_str("[routing]\npolicy = \"kv\"\n").is_err());
}

#[test]
fn the_admin_api_beyond_loopback_needs_a_token_and_timeouts_are_checked() {
    let with = |f: &dyn Fn(&mut ServeConfig)| {
        let mut c = ServeConfig::default();
        f(&mut c);
        c.validate().map(|_| ()).map_err(|e| e.to_string())
    };
    assert_eq!(with(&|_| {}), Ok(()));
    let err = with(&|c| c.server.admin_listen = "0.0.0.0:8100".into()).unwrap_err();
    assert!(err.starts_with("admin-token: required"), "{err}");
    assert_eq!(
        with(&|c| {
            c.server.admin_listen = "0.0.0.0:8100".into();
            c.server.admin_token = Some("s3cret".into());
        }),
        Ok(())
    );
    assert_eq!(with(&|c| c.server.admin_listen = "[::1]:8100".into()), Ok(()));
    let err = with(&|c| c.server.admin_listen = "127.0.0.1:8000".into()).unwrap_err();
    assert!(err.starts_with("admin-listen:"), "{err}");
    let err = with(&|c| c.server.admin_token = Some("two words".into())).unwrap_err();
    assert!(err.starts_with("admin-token:"), "{err}");
    let err = with(&|c| c.server.api_key = vec![String::new()]).unwrap_err();
    assert!(err.starts_with("api-key:"), "{err}");
    let err = with(&|c| c.server.header_read_timeout_ms = 0).unwrap_err();
    assert!(err.starts_with("header-read-timeout-ms:"), "{err}");
    let err = with(&|c| c.server.admin_listen = "localhost".into()).unwrap_err();
    assert!(err.starts_with("admin-listen:"), "{err}");
    let d = ServeConfig::default();
    assert!(d.server.header_read_timeout_ms <= 10_000, "well under a minute");
    let w = WorkerConfig::parse_flag("http://h:1,api-key=sk-1").unwrap();
    assert_eq!(w.api_key.as_deref(), Some("sk-1"));
    assert!(w.validate(16, EngineKind::Vllm).is_ok());
    let c = ServeConfig::from_toml_str(
        "api-key = [\"a\", \"b\"]\n[[worker]]\nurl = \"http://h:1\"\napi-key = \"k\"\n",
    )
    .unwrap();
    assert_eq!(c.server.api_key, ["a", "b"]);
    assert_eq!(c.workers[0].api_key.as_deref(), Some("k"));
}

#[test]
fn roles_fleets_and_deciders() {
    for (flag, role) in [
        ("http://h:1", WorkerRole::Aggregated),
        ("http://h:1,role=agg", WorkerRole::Aggregated),
        ("http://h:1,role=prefill", WorkerRole::Prefill),
        ("http://h:1,role=decode", WorkerRole::Decode),
    ] {
        let w = WorkerConfig::parse_flag(flag).unwrap();
        assert!(w.validate(16, EngineKind::Vllm).is_ok(), "{flag}");
        assert_eq!(w.role(), role, "{flag}");
    }
    // (roles, decider, accepted)
    let cases: &[(&[&str], &str, bool)] = &[
        (&[], "always", true),
        (&["agg", "agg"], "always", true),
        (&["prefill", "decode"], "always", true),
        (&["prefill", "decode", "agg"], "never", true),
        (&["decode"], "512", true),
        (&["prefill"], "always", false),
        (&["prefill", "prefill"], "always", false),
        (&["prefill", "agg"], "always", false),
        (&["prefill", "decode"], "sometimes", false),
        (&["prefill", "decode"], "-3", false),
    ];
    for (roles, decider, accepted) in cases {
        let workers = roles
            .iter()
            .enumerate()
            .map(|(i, r)| WorkerConfig {
                role: (*r).to_owned(),
                ..WorkerConfig::new(format!("http://127.0.0.1:{}", 1 + i))
            })
            .collect();
        let c = ServeConfig {
            routing: RoutingConfig {
                decider: (*decider).to_owned(),
                ..Default::default()
            },
            workers,
            ..ServeConfig::default()
        };
        assert_eq!(
            c.validate().is_ok(),
            *accepted,
            "{roles:?} {decider}: {:?}",
            c.validate()
        );
    }
    let c = ServeConfig::from_toml_str(
        "decider = \"256\"\n[[worker]]\nurl = \"http://h:1\"\nrole = \"prefill\"\n\
         [[worker]]\nurl = \"http://h:2\"\nrole = \"decode\"\n",
    )
    .unwrap();
    let router = c.validate().unwrap();
    assert_eq!(router.decider, Decider::PrefixThreshold { uncached_tokens: 256 });
    assert_eq!(c.routing.disagg_protocol, EngineKind::Vllm);
    assert_eq!(c.workers[0].role(), WorkerRole::Prefill);
}

/// `[[model]]` tables make one stack each (name, tokenizer, block size, policy, workers
/// of its table and pinned to it, a subject of its own); mixing them with the
/// single-model keys, or pinning a worker to a model not served, is refused by name.
#[test]
fn model_tables_make_one_stack_each_and_bad_ones_are_refused_by_name() {
    let text = "policy = \"round-robin\"\nnats-subject-prefix = \"fleet\"\n\
        [[model]]\nname = \"org/a-1\"\napproximate-tokenizer = true\n\
        [[model.worker]]\nurl = \"http://h:1\"\n\
        [[model]]\nname = \"b\"\nmodel-dir = \"/m/b\"\nblock-size = 32\npolicy = \"kv\"\n\
        [[worker]]\nurl = \"http://h:2\"\nmodel = \"b\"\n\
        [[worker]]\nurl = \"http://h:3\"\n";
    let c = ServeConfig::from_toml_str(text).unwrap();
    c.validate().unwrap();
    let stacks = c.stacks().unwrap();
    let got: Vec<(&str, u32, &str, Vec<&str>, &str)> = stacks
        .iter()
        .map(|s| {
            (
                s.model.model_name.as_str(),
                s.routing.block_size,
                s.routing.policy.as_str(),
                s.workers.iter().map(|w| w.url.as_str()).collect(),
                s.replicas.nats_subject_prefix.as_str(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("org/a-1", 16, "round-robin", vec!["http://h:1"], "fleet.org_a-1"),
            ("b", 32, "kv", vec!["http://h:2"], "fleet.b"),
        ]
    );
    let unpinned: Vec<String> = c.unpinned_workers().into_iter().map(|w| w.url).collect();
    assert_eq!(unpinned, ["http://h:3"]);
    assert_eq!(
        stacks[1].tokenizer().unwrap(),
        TokenizerSource::Dir("/m/b".as_ref())
    );
    // The file form round-trips, without the single-model keys.
    let written = toml::to_string(&c).unwrap();
    assert!(!written.contains("model-name"), "{written}");
    assert_eq!(ServeConfig::from_toml_str(&written).unwrap(), c);
    // One model: a worker may name it, and no other.
    let one =
        ServeConfig::from_toml_str("model-name = \"m\"\n[[worker]]\nurl = \"http://h:1\"\nmodel = \"m\"\n");
    one.unwrap().validate().unwrap();
    let models = "[[model]]\nname = \"a\"\napproximate-tokenizer = true\n";
    for (text, says) in [
        (
            format!("model-name = \"x\"\n{models}"),
            "model-name: the single-model keys",
        ),
        (
            format!("block-size = 32\nmodel-dir = \"/m\"\n{models}"),
            "model-dir/block-size",
        ),
        (
            format!("{models}[[model]]\nname = \"a\"\napproximate-tokenizer = true\n"),
            "named twice",
        ),
        (
            format!("{models}[[worker]]\nurl = \"http://h:1\"\nmodel = \"c\"\n"),
            "none of the [[model]]",
        ),
        (
            "[[model]]\nname = \"a\"\n".to_owned(),
            "model \"a\": model-dir: model-dir: is required",
        ),
        (format!("{models}policy = \"nope\"\n"), "model \"a\": policy"),
        (
            format!(
                "{models}[[model]]\nname = \"a b\"\napproximate-tokenizer = true\n[[model]]\nname = \"a_b\"\napproximate-tokenizer = true\n"
            ),
            "in a sync subject",
        ),
        (format!("{models}colour = 1\n"), "colour"),
        (
            "model-name = \"m\"\n[[worker]]\nurl = \"http://h:1\"\nmodel = \"n\"\n".to_owned(),
            "is not the model served",
        ),
    ] {
        let e = ServeConfig::from_toml_str(&text)
            .and_then(|c| c.validate().map(|_| c))
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{text:?}: {e}");
    }
}

#[test]
fn sglang_bootstrap_ports() {
    let c = ServeConfig::from_toml_str(
        "disagg-protocol = \"sglang\"\n[[worker]]\nurl = \"http://h:1\"\nrole = \"prefill\"\n\
         bootstrap-port = 8998\n[[worker]]\nurl = \"http://h:2\"\nrole = \"decode\"\n",
    )
    .unwrap();
    assert!(c.validate().is_ok());
    assert_eq!(c.routing.disagg_protocol, EngineKind::Sglang);
    assert_eq!(c.workers[0].bootstrap_port, Some(8998));
    let err = ServeConfig::from_toml_str("disagg-protocol = \"nixl\"").unwrap_err();
    assert!(err.to_string().contains("unknown variant"), "{err}");
    let w = WorkerConfig::parse_flag("http://h:1,role=prefill,bootstrap-port=8998").unwrap();
    assert_eq!(w.bootstrap_port, Some(8998));
    assert!(w.validate(16, EngineKind::Sglang).is_ok());
    let err = w.validate(16, EngineKind::Vllm).unwrap_err();
    assert!(err.to_string().contains("disagg-protocol"), "{err}");
    let w = WorkerConfig::parse_flag("http://h:1,role=decode,bootstrap-port=8998").unwrap();
    assert!(w.validate(16, EngineKind::Sglang).is_err());
    assert!(WorkerConfig::parse_flag("http://h:1,bootstrap-port=70000").is_err());
}
