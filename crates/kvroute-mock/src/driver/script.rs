//! One script of arrivals and imports through two drivers of [`EngineHost`]: a discrete-event
//! loop as the simulator runs it, and the mock's real-time task on paused time. Both must make
//! the same decisions: admissions, refusals, waits, completion order and KV events.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_core::events::KvEvent;
use kvroute_core::ids::RequestId;
use kvroute_core::time::Timestamp;
use kvroute_engine::{
    Engine, EngineConfig, EngineHost, EnginePrompt, EngineRequest, ImportAdmission, ImportStart, KvTransfer,
};
use tokio::sync::mpsc;

use super::{Job, JobUpdate, Outbox, drive};
use crate::metrics::Stats;

const SCRIPT: &str = include_str!("../../../kvroute-engine/tests/data/host/imports.txt");

struct Line {
    at: Timestamp,
    import: bool,
    name: String,
    prompt: Vec<u32>,
    output: u32,
}

fn script() -> Vec<Line> {
    let lines = SCRIPT
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'));
    lines
        .enumerate()
        .map(|(i, l)| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let n = |k: usize| f[k].parse::<u32>().expect("a number");
            let base = 100_000 * (i as u32 + 1);
            Line {
                at: Timestamp::from_millis(u64::from(n(0))),
                import: f[1] == "import",
                name: f[2].to_owned(),
                prompt: (base..base + n(3)).collect(),
                output: n(4),
            }
        })
        .collect()
}

fn host() -> EngineHost {
    let config = EngineConfig {
        num_blocks: 20,
        max_num_seqs: 8,
        max_num_batched_tokens: 512,
        max_model_len: 8192,
        ..EngineConfig::default()
    };
    EngineHost::new(Engine::new(config).expect("valid"), KvTransfer::default())
}

/// What a driver decided, in a form both can produce.
#[derive(Debug, Default, PartialEq)]
struct Transcript {
    refused: Vec<String>,
    waits: u64,
    /// Completions by (time, name), names only.
    done: Vec<(Timestamp, String)>,
    kv: Vec<String>,
}

impl Transcript {
    fn kv(&mut self, events: &[KvEvent]) {
        for e in events {
            self.kv.push(match e {
                KvEvent::Stored(s) => format!("+{}", s.blocks.len()),
                KvEvent::Removed(r) => format!("-{}", r.block_hashes.len()),
                KvEvent::AllCleared => "clear".to_owned(),
                KvEvent::TierStored(t) => format!("+cpu{}", t.block_hashes.len()),
                KvEvent::TierRemoved(t) => format!("-cpu{}", t.block_hashes.len()),
            });
        }
    }

    fn render(mut self) -> String {
        self.done.sort();
        let done: Vec<_> = self.done.into_iter().map(|(_, n)| n).collect();
        format!(
            "refused: {}\nwaits: {}\ndone: {}\nkv: {}\n",
            self.refused.join(", "),
            self.waits,
            done.join(", "),
            self.kv.join(" ")
        )
    }
}

fn request(i: usize, line: &Line) -> EngineRequest {
    EngineRequest {
        id: RequestId(i as u64),
        prompt: EnginePrompt::Tokens(line.prompt.clone()),
        output_len: line.output,
        lora_name: None,
        cache_namespace: None,
        kv_report: kvroute_engine::KvReportMode::Incremental,
    }
}

/// The simulator's way: one virtual clock, events handled at their times.
fn simulated(lines: &[Line]) -> String {
    let mut host = host();
    let mut t = Transcript::default();
    let mut next = 0;
    loop {
        let end = host.in_flight().map(|o| o.end);
        let wake = if end.is_none() {
            host.engine().next_wakeup()
        } else {
            None
        };
        let candidates = [
            lines.get(next).map(|l| l.at),
            end,
            host.next_landing().map(|l| l.0),
            wake,
        ];
        let Some(now) = candidates.into_iter().flatten().min() else {
            break;
        };
        while let Some(line) = lines.get(next).filter(|l| l.at <= now) {
            let refused = if line.import {
                match host.import(now, request(next, line)) {
                    Ok(ImportAdmission::Started(s)) => {
                        t.kv(&s.events);
                        None
                    }
                    Ok(ImportAdmission::Waiting) => {
                        t.waits += 1;
                        None
                    }
                    Err(e) => Some(e),
                }
            } else {
                host.add(now, request(next, line)).err()
            };
            if refused.is_some() {
                t.refused.push(line.name.clone());
            }
            next += 1;
        }
        while let Some((_, id)) = host.next_landing().filter(|l| l.0 <= now) {
            let events = host.land(now, id).expect("importing");
            t.kv(&events);
        }
        if end.is_some_and(|e| e <= now) {
            let out = host.finish_pass().expect("in flight");
            t.kv(&out.events);
            for f in &out.finished {
                t.done.push((now, lines[f.request.0 as usize].name.clone()));
            }
            for start in host.start_waiting_imports(now) {
                match start {
                    ImportStart::Started(s) => t.kv(&s.events),
                    ImportStart::Refused(id, _) => t.refused.push(lines[id.0 as usize].name.clone()),
                }
            }
        }
        host.step(now);
    }
    t.render()
}

/// The mock's way: its engine task, fed in real time (paused, so virtual) by the script.
async fn live(lines: &[Line]) -> String {
    let (jobs, rx) = mpsc::unbounded_channel();
    let (tap, mut taps) = mpsc::unbounded_channel();
    let stats = Arc::new(Mutex::new(Stats::default()));
    let out = Outbox {
        publisher: None,
        rank: 0,
        tap: Some(tap),
    };
    let epoch = tokio::time::Instant::now();
    let task = tokio::spawn(drive(host(), rx, Arc::clone(&stats), out));
    let mut updates = Vec::new();
    for line in lines {
        tokio::time::sleep_until(epoch + Duration::from_nanos(line.at.0)).await;
        let (tx, rx) = mpsc::unbounded_channel();
        let job = Job {
            prompt: line.prompt.clone(),
            output_len: line.output,
            cache_salt: None,
            lora_name: None,
            import: line.import,
            kv_report: kvroute_engine::KvReportMode::Incremental,
            tx,
        };
        jobs.send(job).expect("running");
        updates.push(tokio::spawn(watch(line.name.clone(), epoch, rx)));
    }
    let mut t = Transcript::default();
    for u in updates {
        match u.await.expect("watched") {
            Ok(done) => t.done.push(done),
            Err(name) => t.refused.push(name),
        }
    }
    drop(jobs);
    task.await.expect("driver");
    while let Ok(events) = taps.try_recv() {
        t.kv(&events);
    }
    t.waits = stats.lock().expect("stats").import_waits;
    t.render()
}

/// A request's end: when it finished, or its name if refused.
async fn watch(
    name: String,
    epoch: tokio::time::Instant,
    mut rx: mpsc::UnboundedReceiver<JobUpdate>,
) -> Result<(Timestamp, String), String> {
    while let Some(u) = rx.recv().await {
        match u {
            JobUpdate::Done { .. } => {
                let at = Timestamp(epoch.elapsed().as_nanos() as u64);
                return Ok((at, name));
            }
            JobUpdate::Refused(_) => return Err(name),
            _ => {}
        }
    }
    Err(name)
}

#[tokio::test(start_paused = true)]
async fn the_simulator_and_the_mock_make_the_same_decisions() {
    let lines = script();
    let simulated = simulated(&lines);
    let live = live(&lines).await;
    assert_eq!(simulated, live, "the two drivers disagree");
    expect_test::expect![[r#"
        refused: never
        waits: 2
        done: c, a, after, wait
        kv: +15 +2 +1 -5 -2 +1 +6
    "#]]
    .assert_eq(&simulated);
}
