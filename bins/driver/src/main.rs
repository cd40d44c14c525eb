//! `driver`: write workload plans and replay them closed-loop or open-loop against an
//! OpenAI-compatible server, one `client.csv` row per request.

mod replay;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use driver::{DriverError, ProgressMode, RunConfig, RunSummary};
use workload::spec::{
    DEFAULT_BYTES_PER_TOKEN, DEFAULT_GROUP_PREFIX_TOKENS, DEFAULT_GROUP_SKEW,
    DEFAULT_OUTPUT_TOKENS, DEFAULT_PREFIX_TOKENS, DEFAULT_PRIVATE_CONTEXT_TOKENS, DEFAULT_TURNS,
    DEFAULT_USER_TOKENS,
};
use workload::{ArrivalSpec, OpenStart, Plan, PrefixGroups, Sharing, Sizing, WorkloadSpec};

#[derive(Parser)]
#[command(name = "driver", version, about = "kvroute load driver")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build a plan (format byte + MessagePack) and print its name and fingerprint.
    Plan(PlanArgs),
    /// Print a plan's name, fingerprint and size.
    Inspect {
        /// The plan file.
        #[arg(long)]
        plan: PathBuf,
    },
    /// Closed loop: the plan's users each send a turn, wait for the reply, think, repeat.
    Closed(RunArgs),
    /// Open loop: send at the plan's Poisson arrival times (never rescaled).
    Open(RunArgs),
    /// Replay a Mooncake-format trace open loop (`--trace FILE` or a sweep's `--plan
    /// trace-plan.json`): each hash id a block of text, times scaled, rows as `open` writes them.
    Replay(Box<replay::ReplayArgs>),
    /// Print the replay plan of a trace (one JSON line) without sending anything.
    TracePlan(replay::MappingArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Arrival {
    Closed,
    Open,
}

/// `--conversation-sharing`: the command-line face of [`Sharing`].
#[derive(Clone, Copy, ValueEnum)]
enum SharingArg {
    /// A conversation belongs to one user at a time; its turns go one at a time.
    Exclusive,
    /// Several users may send turns of one conversation at once.
    Shared,
}

/// `--open-start`: the command-line face of [`OpenStart`].
#[derive(Clone, Copy, ValueEnum)]
enum OpenStartArg {
    /// Every conversation starts at turn 1 (plans before format 4).
    Fresh,
    /// Every conversation starts at a uniformly drawn turn: the steady state's turn mix from the
    /// first arrival.
    Stationary,
    /// As `stationary`, after one prefill-only prime per conversation the cache would hold, so
    /// its history is cached when its first turn comes (what the experiment runs; paced by
    /// `--prime-tokens-per-s`).
    Primed,
}

impl OpenStartArg {
    fn start(self, prime_tokens_per_s: u32) -> OpenStart {
        match self {
            OpenStartArg::Fresh => OpenStart::Fresh,
            OpenStartArg::Stationary => OpenStart::Stationary,
            OpenStartArg::Primed => OpenStart::Primed {
                tokens_per_s: prime_tokens_per_s,
            },
        }
    }
}

impl From<SharingArg> for Sharing {
    fn from(a: SharingArg) -> Sharing {
        match a {
            SharingArg::Exclusive => Sharing::Exclusive,
            SharingArg::Shared => Sharing::Shared,
        }
    }
}

#[derive(Args)]
struct PlanArgs {
    /// Where to write the plan.
    #[arg(long)]
    out: PathBuf,
    /// Seed for every text and draw.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Fleet KV capacity in tokens (with --ws: size the working set against it).
    #[arg(long, requires = "ws", conflicts_with = "conversations")]
    capacity_tokens: Option<u64>,
    /// Working set ÷ capacity (0.25, 1, 3, 8, …).
    #[arg(long, requires = "capacity_tokens")]
    ws: Option<f64>,
    /// A fixed number of conversations instead of sizing.
    #[arg(long)]
    conversations: Option<u32>,
    /// Zipf exponent over conversations (0 = uniform).
    #[arg(long, default_value_t = 0.0)]
    skew: f64,
    /// Turns per conversation.
    #[arg(long, default_value_t = DEFAULT_TURNS)]
    turns: u32,
    /// Context prefix at turn 1, in tokens; with --prefix-groups, the private context after the
    /// group's shared prefix (default 1100, or 512 with groups).
    #[arg(long)]
    prefix_tokens: Option<u32>,
    /// Prefix groups: conversations share one of G prefixes (0 = none, every context private).
    #[arg(long, default_value_t = 0)]
    prefix_groups: u32,
    /// Each group's shared prefix, in tokens (with --prefix-groups).
    #[arg(long, default_value_t = DEFAULT_GROUP_PREFIX_TOKENS)]
    group_prefix_tokens: u32,
    /// Zipf exponent of group membership (with --prefix-groups; 0 = uniform).
    #[arg(long, default_value_t = DEFAULT_GROUP_SKEW)]
    group_skew: f64,
    /// Whether several users may send turns of one conversation at once.
    #[arg(long, value_enum, default_value_t = SharingArg::Exclusive)]
    conversation_sharing: SharingArg,
    /// Each user turn, in tokens.
    #[arg(long, default_value_t = DEFAULT_USER_TOKENS)]
    user_tokens: u32,
    /// max_tokens per request (and scripted reply length).
    #[arg(long, default_value_t = DEFAULT_OUTPUT_TOKENS)]
    output_tokens: u32,
    /// Bytes per token of the generated text.
    #[arg(long, default_value_t = DEFAULT_BYTES_PER_TOKEN)]
    bytes_per_token: u32,
    /// Arrival process.
    #[arg(long, value_enum, default_value_t = Arrival::Closed)]
    arrival: Arrival,
    /// Closed loop: concurrent users.
    #[arg(long, default_value_t = 32)]
    users: u32,
    /// Closed loop: mean think time, seconds.
    #[arg(long, default_value_t = 1.0)]
    think_mean_s: f64,
    /// Closed loop: requests per user.
    #[arg(long, default_value_t = 24)]
    requests_per_user: u32,
    /// Open loop: arrival rate, requests per second.
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
    /// Open loop: schedule length, seconds.
    #[arg(long, default_value_t = 120.0)]
    duration_s: f64,
    /// Open loop: where the conversations stand at the first arrival.
    #[arg(long, value_enum, default_value_t = OpenStartArg::Stationary)]
    open_start: OpenStartArg,
    /// Open loop, `--open-start primed`: the primes' pace, prompt tokens per second (the
    /// experiment takes replicas × floor prompt tokens ÷ TTFT floor from its calibration).
    #[arg(long, default_value_t = 20_000)]
    prime_tokens_per_s: u32,
}

#[derive(Args)]
struct RunArgs {
    /// The plan file.
    #[arg(long)]
    plan: PathBuf,
    #[command(flatten)]
    send: SendArgs,
}

/// Where and how a run sends, shared by `closed`, `open` and `replay`.
#[derive(Args)]
pub struct SendArgs {
    /// Server base URL (router, replica or vLLM), e.g. http://127.0.0.1:8000.
    #[arg(long)]
    url: String,
    /// Where to write client.csv (rows stream into <out>.partial during the run).
    #[arg(long)]
    out: PathBuf,
    /// Model name; default: the first id of GET /v1/models.
    #[arg(long)]
    model: Option<String>,
    /// Requests sent in the first S seconds are flagged warmup=1.
    #[arg(long, default_value_t = 0.0)]
    warmup_s: f64,
    /// A request unfinished this long after sending fails with `timeout`.
    #[arg(long, default_value_t = 600.0)]
    timeout_s: f64,
    /// Stop sending new requests after S seconds.
    #[arg(long)]
    duration_s: Option<f64>,
    /// Open loop, one turn at a time per conversation: after --duration-s, do not send a turn
    /// that has already waited longer than MS past its schedule behind its conversation's
    /// previous turn; write it as an `abandoned:` row. Give it the SLO's TTFT bound: such a
    /// turn has missed the SLO whatever happens next, so the run does not drain that backlog.
    #[arg(long, requires = "duration_s")]
    abandon_after_ms: Option<f64>,
    /// Progress line on stderr.
    #[arg(long, value_enum, default_value_t = Progress::Auto)]
    progress: Progress,
    /// Also rewrite the progress line into this file every second (for an orchestrator that
    /// logs stderr and shows progress on its own terminal).
    #[arg(long)]
    progress_file: Option<PathBuf>,
    /// Skip the GET /v1/models check (requires --model).
    #[arg(long)]
    no_preflight: bool,
    /// One connection per request instead of a keep-alive pool (llama.cpp's llama-server closes
    /// a connection after a streamed response while announcing keep-alive).
    #[arg(long)]
    no_keep_alive: bool,
}

impl SendArgs {
    /// The driver's run configuration these flags ask for.
    pub fn run_config(&self) -> RunConfig {
        RunConfig {
            url: self.url.clone(),
            out: self.out.clone(),
            model: self.model.clone(),
            warmup_s: self.warmup_s,
            timeout_s: self.timeout_s,
            duration_s: self.duration_s,
            abandon_after_s: self.abandon_after_ms.map(|ms| ms / 1e3),
            preflight: !self.no_preflight,
            progress: match self.progress {
                Progress::Auto => ProgressMode::Auto,
                Progress::On => ProgressMode::On,
                Progress::Off => ProgressMode::Off,
            },
            progress_file: self.progress_file.clone(),
            keep_alive: !self.no_keep_alive,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Progress {
    Auto,
    On,
    Off,
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("driver: error: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    match Cli::parse().command {
        Command::Plan(a) => make_plan(&a),
        Command::Inspect { plan } => {
            let plan = load_plan(&plan)?;
            println!("{}", describe(&plan, None)?);
            Ok(())
        }
        Command::Closed(a) => drive(&a, Arrival::Closed),
        Command::Open(a) => drive(&a, Arrival::Open),
        Command::Replay(a) => replay::replay(&a),
        Command::TracePlan(a) => replay::describe(&a),
    }
}

fn make_plan(a: &PlanArgs) -> Result<()> {
    let sizing = match (a.capacity_tokens, a.ws, a.conversations) {
        (Some(capacity_tokens), Some(ratio), None) => Sizing::WorkingSet {
            capacity_tokens,
            ratio,
        },
        (None, None, Some(n)) => Sizing::Conversations(n),
        _ => bail!("give either --capacity-tokens with --ws, or --conversations"),
    };
    let prefix_groups =
        PrefixGroups::from_count(a.prefix_groups, a.group_prefix_tokens, a.group_skew);
    let default_prefix = if prefix_groups.is_some() {
        DEFAULT_PRIVATE_CONTEXT_TOKENS
    } else {
        DEFAULT_PREFIX_TOKENS
    };
    let spec = WorkloadSpec {
        seed: a.seed,
        sizing,
        zipf_s: a.skew,
        turns: a.turns,
        prefix_tokens: a.prefix_tokens.unwrap_or(default_prefix),
        user_tokens: a.user_tokens,
        output_tokens: a.output_tokens,
        bytes_per_token: a.bytes_per_token,
        prefix_groups,
        sharing: a.conversation_sharing.into(),
    };
    let arrival = match a.arrival {
        Arrival::Closed => ArrivalSpec::Closed {
            users: a.users,
            think_mean_s: a.think_mean_s,
            requests_per_user: a.requests_per_user,
        },
        Arrival::Open => ArrivalSpec::Open {
            rate_rps: a.rate,
            duration_s: a.duration_s,
            start: a.open_start.start(a.prime_tokens_per_s),
        },
    };
    let plan = Plan::build(&spec, &arrival)?;
    let bytes = plan.to_bytes()?;
    let tmp = a.out.with_extension("tmp");
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &a.out).with_context(|| format!("renaming to {}", a.out.display()))?;
    println!("{}", describe(&plan, Some(&a.out))?);
    Ok(())
}

fn describe(plan: &Plan, out: Option<&Path>) -> Result<String> {
    let mut v = serde_json::json!({
        "name": plan.name(),
        "workload_name": plan.spec.name(),
        "fingerprint": plan.fingerprint_hex()?,
        "workload_fingerprint": plan.workload_fingerprint_hex()?,
        "conversations": plan.conversations.len(),
        "requests": plan.request_count(),
        "working_set_tokens": plan.working_set_tokens().round(),
        "prefix_groups": plan.spec.prefix_groups,
        "conversation_sharing": plan.spec.sharing.as_str(),
    });
    if let ArrivalSpec::Open { start, .. } = plan.arrival {
        // What a run's --warmup-s must cover: the primes, then a settling time.
        let primes = match &plan.schedule {
            workload::Schedule::Open { arrivals } => arrivals.iter().filter(|a| a.prime).count(),
            workload::Schedule::Closed { .. } => 0,
        };
        v["primes"] = serde_json::json!(primes);
        v["prime_period_s"] = serde_json::json!(workload::prime_period_s(&plan.spec, start)?);
    }
    if let Some(out) = out {
        v["out"] = serde_json::Value::String(out.display().to_string());
    }
    Ok(v.to_string())
}

fn load_plan(path: &Path) -> Result<Plan> {
    let bytes = std::fs::read(path).with_context(|| format!("reading plan {}", path.display()))?;
    Plan::from_bytes(&bytes).with_context(|| format!("plan {}", path.display()))
}

fn drive(a: &RunArgs, mode: Arrival) -> Result<()> {
    let plan = load_plan(&a.plan)?;
    let cfg = a.send.run_config();
    let summary = interruptible(&cfg, async {
        match mode {
            Arrival::Closed => driver::run_closed(&plan, &cfg).await,
            Arrival::Open => driver::run_open(&plan, &cfg).await,
        }
    })?;
    println!("{summary}");
    Ok(())
}

/// Runs `run` on one core (the benchmark in crates/driver/README.md was measured this way); on
/// Ctrl-C or SIGTERM stops with an error naming where the rows so far are.
fn interruptible(
    cfg: &RunConfig,
    run: impl std::future::Future<Output = Result<RunSummary, DriverError>>,
) -> Result<RunSummary> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async {
        let interrupted = |what: &str| {
            anyhow::anyhow!(
                "{what}; rows so far are in {}",
                driver::rows::partial_path(&cfg.out).display()
            )
        };
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        tokio::select! {
            r = run => r.map_err(anyhow::Error::from),
            _ = tokio::signal::ctrl_c() => Err(interrupted("interrupted")),
            _ = term.recv() => Err(interrupted("terminated")),
        }
    })
}
