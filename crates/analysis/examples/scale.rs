//! How long the report takes on a large sweep: writes a synthetic sweep (deterministic) to a
//! temporary directory, times `analyze_dir` on it, prints a table and removes the directory.
//!
//! `cargo run --release -p analysis --example scale [-- REQUESTS_PER_REP]`

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

const POINTS: &[&str] = &["ws1-s0", "ws3-s1", "ws8-s1.4"];
const POLICIES: &[&str] = &["session-affinity", "prefix-affinity", "round-robin"];
const REPS: u32 = 3;

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// xorshift64*: deterministic, no RNG crate needed for synthetic rows.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

fn write_rep(dir: &Path, policy: &str, n: usize, rng: &mut Lcg) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut client = String::from(
        "request_id,session_id,turn,scheduled_s,sent_s,first_token_s,last_s,ttft_ms,itl_p50_ms,tpot_ms,e2el_ms,prompt_tokens,output_tokens,cached_tokens,status,error,warmup,send_lag_ms,chunks\n",
    );
    let mut router = String::from(
        "request_id,session_id,arrival_s,policy,replica,branch,predicted_match_tokens,outstanding_chosen,outstanding_min,decide_ns,overhead_us,tokenize_ms,upstream_status,cached_tokens,prompt_tokens,error,attempts\n",
    );
    let mut turns = vec![0u32; 2000];
    for i in 0..n {
        let sent = i as f64 * 600.0 / n as f64;
        let s = rng.below(2000) as usize;
        turns[s] += 1;
        let ttft = 100.0 + rng.below(1400) as f64;
        let itl = 5.0 + rng.below(25) as f64;
        let cached = 16 * rng.below(80);
        let warm = u8::from(sent < 30.0);
        let _ = writeln!(
            client,
            "q{i},s{s},{},{sent:.6},{sent:.6},{:.6},{:.6},{ttft:.3},{itl:.3},{itl:.3},2000.000,1400,128,{cached},200,,{warm},0.100,128",
            turns[s],
            sent + ttft / 1000.0,
            sent + 2.0
        );
        let _ = writeln!(
            router,
            "q{i},s{s},{:.6},{policy},{},match,{},1,0,2000,{},,200,{cached},1400,,1",
            sent + 5.0,
            rng.below(8),
            16 * rng.below(80),
            100 + rng.below(800)
        );
    }
    std::fs::write(dir.join("client.csv"), client)?;
    std::fs::write(dir.join("router.csv"), router)?;
    std::fs::write(
        dir.join("meta.json"),
        r#"{"workload_name":"w","plan_fingerprint":"p","slo":{"ttft_ms":990,"itl_ms":24},
"window":{"warmup_s":30,"measured_start_s":30,"measured_end_s":600},
"fleet":{"capacity_tokens":500000},"complete":true,"accepted":true}"#,
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let per_rep: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(20_000);
    let root = Scratch(std::env::temp_dir().join(format!("kvroute-scale-{}", std::process::id())));
    let mut rng = Lcg(0x9e37_79b9_7f4a_7c15);
    for point in POINTS {
        for policy in POLICIES {
            for rep in 1..=REPS {
                let dir = root.0.join(point).join(policy).join(format!("rep-{rep}"));
                write_rep(&dir, policy, per_rep, &mut rng)?;
            }
        }
    }
    let reps = POINTS.len() * POLICIES.len() * REPS as usize;
    let rows = reps * per_rep * 2;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "| run | reps | rows (client + router) | seconds | rows/s |"
    )?;
    writeln!(out, "|---|---|---|---|---|")?;
    for run in 1..=3 {
        let t = Instant::now();
        let report = analysis::analyze_dir(&root.0, &analysis::ReportConfig::default())?;
        let s = t.elapsed().as_secs_f64();
        assert_eq!(report.points.len(), POINTS.len());
        writeln!(
            out,
            "| {run} | {reps} | {rows} | {s:.2} | {:.0} |",
            rows as f64 / s
        )?;
    }
    Ok(())
}
