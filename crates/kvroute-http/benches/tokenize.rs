//! Prompt tokenization speed: `Model::encode` on the ~300-byte completion prompts that
//! `kvroute bench serve` sends, with the built-in tiny model and with the Llama-3-shaped
//! conformance fixture (a trained byte-level BPE behind Llama-3's split regex).
//!
//! `cargo bench -p kvroute-server --bench tokenize` (elements = prompts, bytes = prompt bytes).

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use kvroute_http::Model;
use kvroute_http::model::SpecialTokens;

fn prompts() -> Vec<String> {
    (0..64)
        .map(|i| {
            let prefix = i % 8;
            format!(
                "System prompt number {prefix}: you are a helpful assistant that answers briefly and well. \
                 Context for group {prefix} follows, repeated so the prompt spans several blocks of tokens. \
                 The user asks question {i}: what is the capital of the country with index {i}?"
            )
        })
        .collect()
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let prompts = prompts();
    let bytes: usize = prompts.iter().map(String::len).sum();
    let models = [
        ("tiny", Model::tiny().expect("the tiny model loads")),
        (
            "llama3-shaped",
            Model::from_json(include_str!("../tests/data/tokenizers/llama3.json"), None)
                .expect("the llama3 fixture loads"),
        ),
    ];
    let mut group = c.benchmark_group("encode");
    for (name, model) in &models {
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(*name, |b| {
            b.iter(|| {
                for prompt in &prompts {
                    black_box(
                        model
                            .encode(black_box(prompt), SpecialTokens::Omit)
                            .expect("prompts encode"),
                    );
                }
            })
        });
    }
    group.finish();
    for (name, model) in &models {
        let start = std::time::Instant::now();
        let mut rounds = 0u32;
        while start.elapsed().as_secs_f64() < 1.0 {
            for prompt in &prompts {
                black_box(
                    model
                        .encode(black_box(prompt), SpecialTokens::Omit)
                        .expect("prompts encode"),
                );
            }
            rounds += 1;
        }
        let per_prompt = start.elapsed().as_secs_f64() / f64::from(rounds) / prompts.len() as f64;
        println!(
            "{{\"model\":\"{name}\",\"prompt_bytes\":{},\"ns_per_prompt\":{:.0}}}",
            bytes / prompts.len(),
            per_prompt * 1e9
        );
    }
}
