//! `kvroute demo`: the router and mock workers in-process on loopback, the example trace driven
//! through HTTP, and the replay's summary table, beside the simulator's run of the same requests.
//!
//! The first `--limit` requests of the embedded Mooncake sample (prompts synthesized by Dynamo's
//! rule, as the replay does) are sent as streaming completions with token-id prompts at their
//! trace arrival times. Arrivals and the engines are both sped up by `--speedup`, so the live
//! system is the simulated one in compressed time; measured times are multiplied back by the
//! speedup, so the two columns read in the same (modeled) milliseconds. Differences between them
//! are the live system's: real scheduling, HTTP, event delays and the proxy's own overhead.
//!
//! With `--replicas N` (N > 1), N proxies share the workers, synced through a `nats-server` the
//! demo starts on loopback (when one is installed; else they run unsynced, saying so), and the
//! requests are spread over them in turn. Either way the demo ends with a line `cached share:
//! X`, the engines' cached prompt tokens over all prompt tokens.

use std::io::BufReader;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use flate2::read::GzDecoder;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_mock::{self as mock, MockConfig};
use kvroute_proxy::config::{LimitsConfig, ReplicasConfig, RoutingConfig, ServerConfig, UpstreamConfig};
use kvroute_proxy::{ServeConfig, WorkerConfig};
use kvroute_sim::report::{CompletedRequest, Report, ReportBuilder};
use kvroute_sim::stats::Summary;
use kvroute_sim::trace::TokenRequest;
use kvroute_sim::{SimConfig, Simulation};

mod planner;

/// The options of `kvroute demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Requests of the example trace to run (its first N rows).
    #[arg(long, default_value_t = 200, value_parser = crate::config::count)]
    pub limit: usize,
    /// Speed-up of arrivals and engines alike.
    #[arg(long, default_value_t = 10.0, value_parser = crate::config::positive)]
    pub speedup: f64,
    /// Mock workers (decode workers with `--prefill`).
    #[arg(long, default_value_t = 4, value_parser = crate::config::count)]
    pub workers: usize,
    /// Prefill workers, before the `--workers` ones, which then decode: the disaggregated
    /// two-hop flow, live and simulated (the simulator's default KV link and decider).
    #[arg(long, default_value_t = 0)]
    pub prefill: usize,
    /// The prefill/decode protocol the live proxy speaks to the mocks: vllm or sglang.
    #[arg(long, default_value = "vllm")]
    pub disagg_protocol: kvroute_proxy::EngineKind,
    /// Routing policy spec, as `kvroute serve --policy` and `kvroute replay --policy` take it
    /// (e.g. `kv:scale=2`, `dynamo`).
    #[arg(long, default_value = "kv")]
    pub policy: String,
    /// Log format on stderr: `text` (the demo's lines only), or `json` (every line a JSON log
    /// event, the services' logs and the result table included).
    #[arg(long, value_enum, default_value_t = crate::serve::LogFormat::Text)]
    pub log_format: crate::serve::LogFormat,
    /// Router replicas (proxies) sharing the workers, synced over a local NATS server.
    #[arg(long, default_value_t = 1, value_parser = crate::config::count)]
    pub replicas: usize,
    /// Run the replicas without sync (to measure what sync buys and costs).
    #[arg(long)]
    pub no_sync: bool,
    /// With replicas: how long prefill-done and freed changes may wait for the replica's next
    /// booking (`serve --nats-lazy-ms`). Default 100 ms; 0: at once.
    #[arg(long, default_value_t = 100)]
    pub sync_lazy_ms: u64,
    /// The planner, live and simulated, on a load ramp (low, high, low) of the example trace:
    /// the live proxy's planner starts and stops `kvroute mock` processes. With a FILE, its
    /// planner file (as `serve --planner` takes it); without, the demo's own.
    #[arg(long, num_args = 0..=1, value_name = "FILE")]
    #[allow(clippy::option_option)]
    pub planner: Option<Option<std::path::PathBuf>>,
    /// With `--planner`: writes every planner tick of both runs to FILE, one JSON object a line
    /// (`run`: `simulated` or `live`, then the tick's record, live times and latencies in
    /// modeled time), to see where the two runs part.
    #[arg(long, value_name = "FILE", requires = "planner")]
    pub ticks: Option<std::path::PathBuf>,
}

/// One request's measurements, in wall-clock time.
#[derive(Debug, Default)]
struct Measured {
    ok: bool,
    arrival: Option<Instant>,
    first: Option<Instant>,
    last_token: Option<Instant>,
    end: Option<Instant>,
    gaps: Vec<Duration>,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if let Some(file) = &args.planner {
        return planner::run(&args, file.as_deref());
    }
    let trace = || BufReader::new(GzDecoder::new(kvroute_sim::EXAMPLE_MOONCAKE_GZ));
    let mut sim = if args.prefill > 0 {
        SimConfig::disaggregated(args.prefill, args.workers)
    } else {
        SimConfig::new(args.workers)
    };
    sim.router.policy = args
        .policy
        .parse::<kvroute_core::router::PolicyConfig>()
        .map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    sim.sample_interval = None;
    let workload = kvroute_sim::trace::read_mooncake(trace(), 512, sim.engine.block_size, Some(args.limit))?;
    let requests = kvroute_sim::trace::read_mooncake_tokens(trace(), 512, Some(args.limit))?;
    let fleet = if args.prefill > 0 {
        format!("{} prefill + {} decode workers", args.prefill, args.workers)
    } else {
        format!("{} workers", args.workers)
    };
    let format = args.log_format;
    crate::serve::say(
        format,
        &format!(
            "demo: {} requests of the example trace, {fleet}, policy {}, {}x speed",
            requests.len(),
            args.policy,
            args.speedup
        ),
    );
    let simulated = Simulation::new(sim.clone())?.run(&workload, &mut |_| {})?.report;
    let (live, share, sync) = super::serve::runtime(0)?.block_on(live(&args, &sim, requests))?;
    let label = match args.replicas {
        1 => format!("{} (live HTTP)", args.policy),
        n => format!("{} (live HTTP, {n} replicas)", args.policy),
    };
    let table =
        kvroute_sim::report::table(&[(format!("{} (simulated)", args.policy), simulated), (label, live)]);
    match format {
        crate::serve::LogFormat::Text => {
            print!("{table}");
            if let Some(sync) = &sync {
                println!("{sync}");
            }
            println!("cached share: {share:.4}");
        }
        crate::serve::LogFormat::Json => {
            let sync = sync.map(|s| s.to_string());
            tracing::info!(%table, sync, cached_share = share, "demo: the result");
        }
    }
    Ok(())
}

/// Replica sync's traffic over a run, from the proxies' `kvroute_sync_*` counters.
#[derive(Debug, Default)]
struct SyncTraffic {
    messages: f64,
    bytes: f64,
    events: f64,
    requests: usize,
    /// The replicas' `kvroute_sync_booking_age_seconds` buckets, summed: (upper bound, count).
    age_buckets: Vec<(f64, f64)>,
}

impl SyncTraffic {
    /// The `q` quantile of the bookings' age on reaching a peer, in ms, interpolated within
    /// its bucket; `None` without bookings.
    fn age_ms(&self, q: f64) -> Option<f64> {
        let total = self.age_buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, count) in &self.age_buckets {
            if count >= rank {
                let upper = if le.is_finite() { le } else { lower };
                let share = if count > below {
                    (rank - below) / (count - below)
                } else {
                    1.0
                };
                return Some((lower + share * (upper - lower)) * 1e3);
            }
            (lower, below) = (le, count);
        }
        None
    }
}

impl std::fmt::Display for SyncTraffic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = |x: f64| x / self.requests.max(1) as f64;
        write!(
            f,
            "sync traffic: {} messages, {} bytes, {} events sent ({:.2} messages, {:.0} bytes per request)",
            self.messages,
            self.bytes,
            self.events,
            per(self.messages),
            per(self.bytes)
        )?;
        if let (Some(p50), Some(p99)) = (self.age_ms(0.5), self.age_ms(0.99)) {
            let n = self.age_buckets.last().map_or(0.0, |b| b.1);
            write!(
                f,
                "\nbooking to peer: p50 {p50:.2} ms, p99 {p99:.2} ms ({n} bookings applied by peers)"
            )?;
        }
        Ok(())
    }
}

/// A histogram's cumulative buckets in a text exposition: (upper bound, count), in order.
fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix("{le=\"")?;
            let (le, rest) = rest.split_once("\"}")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, rest.trim().parse().ok()?))
        })
        .collect()
}

/// The sum of metric `name`'s values (all label sets) in a text exposition.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn live(
    args: &DemoArgs,
    sim: &SimConfig,
    requests: Vec<TokenRequest>,
) -> anyhow::Result<(Report, f64, Option<SyncTraffic>)> {
    let model = Arc::new(Model::tiny()?);
    let mut mc = MockConfig::new(args.workers);
    mc.prefill_workers = args.prefill;
    mc.transfer = sim.transfer;
    mc.engine = sim.engine.clone();
    mc.engine.speedup = sim.engine.speedup * args.speedup;
    let mocks = mock::start(&mc, Arc::clone(&model)).await?;
    let workers = mocks
        .iter()
        .map(|m| WorkerConfig::parse_flag(&m.worker_flag()))
        .collect::<Result<Vec<_>, _>>()?;
    let config = serve_config(args, sim.engine.block_size, workers);
    // Replicas: a local NATS server when one is installed.
    let nats = if args.replicas > 1 && !args.no_sync {
        match kvroute_sync::server::NatsServer::start() {
            Ok(server) => Some(server),
            Err(e) => {
                eprintln!("demo: {e}; the {} replicas run without sync", args.replicas);
                None
            }
        }
    } else {
        None
    };
    let mut proxies = Vec::with_capacity(args.replicas);
    for _ in 0..args.replicas {
        let mut config = config.clone();
        config.replicas.nats = nats.as_ref().map(kvroute_sync::server::NatsServer::url);
        proxies.push(kvroute_proxy::start(config, Some(Arc::clone(&model))).await?);
    }
    // Let the event subscribers connect (they would recover through replay anyway).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let client = kvroute_http::net::client(Duration::from_secs(5));
    let urls: Vec<Arc<str>> = proxies
        .iter()
        .map(|p| format!("{}/v1/completions", p.url()).into())
        .collect();
    let (start, measured) = replay(&client, &urls, requests, args.speedup).await?;
    let (mut overlap, mut lost) = ((0, 0), 0);
    let mut sync = nats.as_ref().map(|_| SyncTraffic {
        requests: measured.len(),
        ..SyncTraffic::default()
    });
    for proxy in &proxies {
        let c = proxy.driver.snapshot().counters;
        overlap.0 += c.overlap_blocks;
        overlap.1 += c.prompt_blocks;
        lost += proxy
            .driver
            .metrics
            .kv_stream_incidents
            .with_label_values(&["gap_lost"])
            .get();
        if let Some(s) = &mut sync {
            let text = proxy.driver.metrics.render();
            s.messages += metric_sum(&text, "kvroute_sync_messages_sent_total");
            s.bytes += metric_sum(&text, "kvroute_sync_bytes_sent_total");
            s.events += metric_sum(&text, "kvroute_sync_events_sent_total");
            for (i, (le, count)) in buckets(&text, "kvroute_sync_booking_age_seconds_bucket")
                .into_iter()
                .enumerate()
            {
                match s.age_buckets.get_mut(i) {
                    Some(b) => b.1 += count,
                    None => s.age_buckets.push((le, count)),
                }
            }
        }
    }
    drop(proxies);
    drop(mocks);
    // The engines' cached prompt tokens over all prompt tokens (of the requests that finished).
    let done = measured.iter().filter(|m| m.ok);
    let (cached, prompt) = done.fold((0, 0), |(c, p), m| (c + m.cached_tokens, p + m.prompt_tokens));
    let share = cached as f64 / prompt.max(1) as f64;
    Ok((
        report(args, sim, &measured, start, overlap, lost, None),
        share,
        sync,
    ))
}

/// The demo's proxy configuration: loopback listeners, `args`' policy, `block_size`, room for
/// the trace's long prompts, `workers`.
fn serve_config(args: &DemoArgs, block_size: u32, workers: Vec<WorkerConfig>) -> ServeConfig {
    ServeConfig {
        server: ServerConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..Default::default()
        },
        routing: RoutingConfig {
            policy: args.policy.clone(),
            block_size,
            disagg_protocol: args.disagg_protocol,
            ..Default::default()
        },
        limits: LimitsConfig {
            max_body_bytes: 64 << 20,
            max_prompt_tokens: 1 << 21,
        },
        upstream: UpstreamConfig {
            health_interval_ms: 1000,
            ..Default::default()
        },
        replicas: ReplicasConfig {
            nats_lazy_ms: args.sync_lazy_ms,
            ..Default::default()
        },
        workers,
        ..ServeConfig::default()
    }
}

/// Sends `requests` at their arrival times divided by `speedup`, in turn to `urls`, and
/// measures each; returns when the first was due, and the measurements in order.
async fn replay(
    client: &kvroute_http::net::HttpClient,
    urls: &[Arc<str>],
    requests: Vec<TokenRequest>,
    speedup: f64,
) -> anyhow::Result<(Instant, Vec<Measured>)> {
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (i, r) in requests.into_iter().enumerate() {
        let at = start + Duration::from_secs_f64(r.arrival.as_secs_f64() / speedup);
        let (client, url) = (client.clone(), Arc::clone(&urls[i % urls.len()]));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            let mut m = send(&client, &url, &r).await.unwrap_or_default();
            m.arrival = Some(at);
            m
        }));
    }
    let mut measured = Vec::with_capacity(tasks.len());
    for t in tasks {
        measured.push(t.await.context("a request task failed")?);
    }
    Ok((start, measured))
}

/// Sends one streaming completion and measures it.
async fn send(
    client: &kvroute_http::net::HttpClient,
    url: &str,
    r: &TokenRequest,
) -> anyhow::Result<Measured> {
    let body = serde_json::json!({
        "model": "tiny",
        "prompt": r.tokens,
        "max_tokens": r.output_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let request = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(&body)?)))?;
    let response = client.request(request).await?;
    let mut m = Measured::default();
    if !response.status().is_success() {
        return Ok(m);
    }
    let mut body = response.into_body();
    let mut last_frame: Option<Instant> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        let now = Instant::now();
        let text = String::from_utf8_lossy(&data);
        if text.contains("\"usage\"") {
            for line in text.lines() {
                let Some(json) = line.strip_prefix("data: ") else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
                    continue;
                };
                let u = &v["usage"];
                if u.is_object() {
                    m.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                    m.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                    m.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                }
            }
        }
        if text.contains("[DONE]") {
            m.ok = true;
            m.end = Some(now);
            break;
        }
        // A frame with tokens.
        if m.first.is_none() {
            m.first = Some(now);
        } else if let Some(prev) = last_frame {
            m.gaps.push(now - prev);
        }
        last_frame = Some(now);
        m.last_token = Some(now);
    }
    Ok(m)
}

/// The replay's report, from the live measurements (times scaled by the speedup) through the
/// simulator's [`ReportBuilder`], the one home of the report's formulas.
fn report(
    args: &DemoArgs,
    sim: &SimConfig,
    measured: &[Measured],
    start: Instant,
    overlap: (u64, u64),
    lost: u64,
    worker_seconds: Option<f64>,
) -> Report {
    // Modeled nanoseconds from the start.
    let ns = |t: Instant| ((t - start).as_nanos() as f64 * args.speedup) as u64;
    let workers = (args.prefill + args.workers) as u64;
    let mut b = ReportBuilder::new(&args.policy, workers, sim.gpus_per_worker, measured.len() as u64);
    let (mut itl, mut cached, mut input) = (Vec::new(), 0, 0);
    for m in measured {
        let (true, Some(arrival), Some(end)) = (m.ok, m.arrival, m.end) else {
            b.rejected += 1;
            continue;
        };
        b.complete(&CompletedRequest {
            arrival_ns: ns(arrival),
            first_token_ns: m.first.map(ns),
            last_token_ns: m.last_token.map_or(ns(end), ns),
            finished_ns: ns(end),
            input_tokens: m.prompt_tokens,
            output_tokens: m.completion_tokens,
        });
        itl.extend(m.gaps.iter().map(|g| g.as_secs_f64() * 1e3 * args.speedup));
        cached += m.cached_tokens;
        input += m.prompt_tokens;
    }
    b.itl = Summary::exact(&mut itl);
    b.prefix_cache_tokens = (cached, input);
    b.router_overlap_blocks = overlap;
    b.kv_events_lost = lost;
    b.worker_seconds = worker_seconds;
    b.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booking_age_quantiles_come_from_the_summed_buckets() {
        let text = "# HELP x\n\
            kvroute_sync_booking_age_seconds_bucket{le=\"0.001\"} 50\n\
            kvroute_sync_booking_age_seconds_bucket{le=\"0.002\"} 98\n\
            kvroute_sync_booking_age_seconds_bucket{le=\"0.004\"} 100\n\
            kvroute_sync_booking_age_seconds_bucket{le=\"+Inf\"} 100\n\
            kvroute_sync_booking_age_seconds_sum 0.1\n";
        let b = buckets(text, "kvroute_sync_booking_age_seconds_bucket");
        assert_eq!(b.len(), 4);
        let s = SyncTraffic {
            age_buckets: b,
            ..SyncTraffic::default()
        };
        // Half the bookings are at or under 1 ms; the 99th is halfway into (2, 4] ms.
        assert!((s.age_ms(0.5).unwrap() - 1.0).abs() < 1e-9);
        assert!((s.age_ms(0.99).unwrap() - 3.0).abs() < 1e-9);
        assert_eq!(SyncTraffic::default().age_ms(0.5), None);
    }
}
