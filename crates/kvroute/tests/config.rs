//! The config pipeline: a TOML file first, the flags over it, key by key.

use std::path::PathBuf;

use clap::Parser;
use kvroute::config::layered;
use kvroute::replay::ReplayConfig;
use kvroute::serve::ServeArgs;

fn file(name: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("kvroute-config-{}-{name}.toml", std::process::id()));
    std::fs::write(&path, text).expect("a config file");
    path
}

#[test]
fn file_only() {
    let path = file(
        "file-only",
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
    let path = file("both", "workers = 4\nseed = 3\nrate = 2.5\n");
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
    let path = file("unknown", "workers = 4\nblok-size = 32\n");
    let err = format!(
        "{:#}",
        layered(Some(&path), &ReplayConfig::default()).unwrap_err()
    );
    assert!(err.contains("blok-size"), "{err}");
    assert!(err.contains("line 2"), "{err}");
    // snake_case is not a second spelling.
    let path = file("snake", "block_size = 32\n");
    let err = format!(
        "{:#}",
        layered(Some(&path), &ReplayConfig::default()).unwrap_err()
    );
    assert!(err.contains("block_size"), "{err}");
}

#[test]
fn a_wrong_type_is_named() {
    let path = file("type", "seed = 1\nworkers = \"many\"\n");
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
    let path = file(
        "serve",
        "queue-capacity = 64\nblock-size = 32\napproximate-tokenizer = true\n\
         [[worker]]\nurl = \"http://127.0.0.1:1\"\ndp = 2\nevents = \"tcp://127.0.0.1:5557\"\n\
         [[worker]]\nurl = \"http://127.0.0.1:2\"\nmax-requests = 8\n",
    );
    let path = path.to_str().unwrap();
    let args = |flags: &[&str]| {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let mut argv = vec!["serve", "--config", path];
        argv.extend_from_slice(flags);
        Cli::parse_from(argv).serve.to_config().unwrap()
    };
    let c = args(&[]);
    assert_eq!((c.queue_capacity, c.block_size), (64, 32));
    assert_eq!(c.workers.len(), 2);
    assert_eq!(c.workers[0].dp_size, 2);
    assert_eq!(c.workers[1].max_requests, 8);
    let c = args(&[
        "--queue-capacity",
        "5",
        "--worker",
        "http://127.0.0.1:3,dp=4,max-requests=9",
    ]);
    assert_eq!((c.queue_capacity, c.block_size), (5, 32));
    assert_eq!(c.workers.len(), 1, "--worker replaces the file's workers");
    assert_eq!((c.workers[0].dp_size, c.workers[0].max_requests), (4, 9));
}
