//! kvroute's router as the ingress: its command line and readiness.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::Result;
use crate::error::{err, fail};
use serde::Serialize;

use crate::fleet::{Fleet, ReplicaInfo};
use crate::process::ChildGuard;
use schema::EngineKind;

/// Router settings of one cell.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RouterSettings {
    /// `--policy`.
    pub policy: String,
    /// `--model` (the block-key salt).
    pub model: String,
    /// `--seed`.
    pub seed: u64,
    /// `--index-ttl-s`, for belief-index policies.
    pub index_ttl_s: Option<f64>,
    /// `--index-node-cap`, for belief-index policies.
    pub index_node_cap: Option<u64>,
    /// `--bytes-per-token`: the router's canonical bytes per engine token, measured by the
    /// calibration against the fleet's own `/tokenize` (`None`: the router's default estimate).
    pub bytes_per_token: Option<f64>,
    /// Pass the replicas' KV event endpoints (`--kv-events`).
    pub kv_events: bool,
}

/// The router's command line in front of `replicas` (in fleet order): `router_bin --host
/// 127.0.0.1 --port 0 --replicas … --policy … --rows rows --model … --seed …`, then
/// `--kv-events` (and `--kv-replay` when every replica's replay endpoint is known),
/// `--index-ttl-s`, `--index-node-cap` and `--bytes-per-token` as `settings` asks.
pub fn router_command(
    router_bin: &Path,
    replicas: &[ReplicaInfo],
    settings: &RouterSettings,
    rows: &Path,
) -> Result<Command> {
    let urls: Vec<&str> = replicas.iter().map(|r| r.url.as_str()).collect();
    let mut cmd = Command::new(router_bin);
    cmd.args(["--host", "127.0.0.1", "--port", "0"])
        .args(["--replicas", &urls.join(",")])
        .args(["--policy", &settings.policy])
        .arg("--rows")
        .arg(rows)
        .args(["--model", &settings.model])
        .args(["--seed", &settings.seed.to_string()]);
    if settings.kv_events {
        let endpoints: Vec<String> = replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.kv_events.clone().ok_or_else(|| {
                    err!(
                        Invalid,
                        "replica {i} publishes no KV events, which policy {} needs",
                        settings.policy
                    )
                })
            })
            .collect::<Result<_>>()?;
        cmd.args(["--kv-events", &endpoints.join(",")]);
        // Replay endpoints let the router repair sequence gaps; pass them only when all are known.
        let replay: Option<Vec<String>> = replicas.iter().map(|r| r.kv_replay.clone()).collect();
        if let Some(replay) = replay {
            cmd.args(["--kv-replay", &replay.join(",")]);
        }
    }
    if let Some(ttl) = settings.index_ttl_s {
        cmd.args(["--index-ttl-s", &format!("{ttl}")]);
    }
    if let Some(cap) = settings.index_node_cap {
        cmd.args(["--index-node-cap", &cap.to_string()]);
    }
    if let Some(bpt) = settings.bytes_per_token {
        cmd.args(["--bytes-per-token", &format!("{bpt}")]);
    }
    Ok(cmd)
}

/// Refuses a policy that needs KV events (exact residency) in front of an engine that publishes
/// none, naming the engine's reason, before any process starts.
pub fn check_kv_events(engine: EngineKind, settings: &RouterSettings) -> Result<()> {
    refuse_without_kv_events(engine.as_str(), engine.no_kv_events_reason(), settings)
}

/// [`check_kv_events`] for a whole fleet: its engine's reason, then its source's (an emulated
/// fleet with the llama-slots cache model speaks vLLM's API but publishes no events).
pub fn check_fleet_kv_events(fleet: &Fleet, settings: &RouterSettings) -> Result<()> {
    check_kv_events(fleet.engine(), settings)?;
    refuse_without_kv_events(
        "llama-slots emulated",
        fleet.no_kv_events_reason(),
        settings,
    )
}

fn refuse_without_kv_events(
    fleet: &str,
    reason: Option<&str>,
    settings: &RouterSettings,
) -> Result<()> {
    if settings.kv_events
        && let Some(reason) = reason
    {
        fail!(
            Invalid,
            "policy {} needs the engines' KV events and cannot run on a {fleet} fleet: {reason}. Use a policy that keeps its own belief of residency (prefix-affinity, prefix-hash) or the session policies",
            settings.policy
        );
    }
    Ok(())
}

/// The router's whole command line in front of `fleet` as a cell starts it: [`router_command`]
/// (after [`check_fleet_kv_events`]), plus `--sched-fifo-priority` in front of real-time emulated
/// engines and `--no-upstream-keep-alive` in front of an engine that closes its connections.
pub fn fleet_router_command(
    router_bin: &Path,
    fleet: &Fleet,
    settings: &RouterSettings,
    rows: &Path,
) -> Result<Command> {
    check_fleet_kv_events(fleet, settings)?;
    let mut cmd = router_command(router_bin, &fleet.replicas(), settings, rows)?;
    if let Some(priority) = fleet.replica_sched_fifo_priority() {
        // Real-time emulated engines on the same cores preempt every ordinary thread, so a
        // router left at SCHED_OTHER waits behind them at each wake-up (docs/proxy-bench.md,
        // "The router's overhead in a live cell"); at their level it does not.
        cmd.args(["--sched-fifo-priority", &priority.to_string()]);
    }
    if !fleet.engine().keeps_connections_alive() {
        // llama-server closes a connection after each streamed response (schema::engine).
        cmd.arg("--no-upstream-keep-alive");
    }
    if settings.kv_events
        && let Some(block) = fleet.block_size_tokens()
    {
        // Exact keys in the engines' own block size: a vLLM fleet on CPU caches 32-token
        // blocks, and the router refuses any other size (its token-parity probe).
        cmd.args(["--block-tokens", &block.to_string()]);
    }
    Ok(cmd)
}

/// Spawns `cmd` (a router command line) as `name` with its output in `log` and waits (30 s at
/// most, polling `should_stop`) for its readiness line. Returns it, its serving URL and its
/// admin URL.
pub fn spawn_router(
    name: &str,
    cmd: Command,
    log: &Path,
    should_stop: &dyn Fn() -> bool,
) -> Result<(ChildGuard, String, String)> {
    let mut guard = ChildGuard::spawn(name, cmd, log)?;
    let ready = guard.wait_ready(Duration::from_secs(30), should_stop)?;
    let admin = ready.admin_url().ok_or_else(|| {
        err!(Answer,
            "the router's readiness line names no admin listener (an older router binary?); see its log {}",
            log.display()
        )
    })?;
    Ok((guard, ready.url(), admin))
}

/// Starts the router in front of `fleet` ([`fleet_router_command`]), rows into `rows`, log into
/// `log`, and waits (30 s at most, polling `should_stop`) for its readiness line. Returns it, its
/// serving URL (what the driver sends to) and its admin URL (`/admin/*`, `/metrics`: on its own
/// loopback listener, never on the serving port).
pub fn start_router(
    router_bin: &Path,
    fleet: &Fleet,
    settings: &RouterSettings,
    rows: &Path,
    log: &Path,
    should_stop: &dyn Fn() -> bool,
) -> Result<(ChildGuard, String, String)> {
    let cmd = fleet_router_command(router_bin, fleet, settings, rows)?;
    spawn_router("router", cmd, log, should_stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(index: usize, kv: bool, replay: bool) -> ReplicaInfo {
        ReplicaInfo {
            index,
            url: format!("http://127.0.0.1:{}", 4000 + index),
            kv_events: kv.then(|| format!("tcp://127.0.0.1:{}", 5000 + index)),
            kv_replay: replay.then(|| format!("tcp://127.0.0.1:{}", 6000 + index)),
            pid: None,
            log_path: None,
            slowdown: 1.0,
        }
    }

    fn line(cmd: &Command) -> String {
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        args.join(" ")
    }

    #[test]
    fn router_command_lines() {
        let mut s = RouterSettings {
            policy: "session-bounded".into(),
            model: "kvroute/emulated-8b".into(),
            seed: 3,
            ..RouterSettings::default()
        };
        let two = [replica(0, true, false), replica(1, true, true)];
        let cmd = router_command(
            Path::new("/bin/router"),
            &two,
            &s,
            Path::new("c/router.csv"),
        )
        .unwrap();
        assert_eq!(cmd.get_program(), "/bin/router");
        assert_eq!(
            line(&cmd),
            "--host 127.0.0.1 --port 0 --replicas http://127.0.0.1:4000,http://127.0.0.1:4001 --policy session-bounded --rows c/router.csv --model kvroute/emulated-8b --seed 3"
        );
        s.policy = "exact-residency".into();
        s.kv_events = true;
        s.index_ttl_s = Some(2.5);
        s.index_node_cap = Some(1000);
        s.bytes_per_token = Some(3.91);
        let cmd = router_command(Path::new("r"), &two, &s, Path::new("rows")).unwrap();
        assert!(
            line(&cmd).ends_with(
                "--seed 3 --kv-events tcp://127.0.0.1:5000,tcp://127.0.0.1:5001 --index-ttl-s 2.5 --index-node-cap 1000 --bytes-per-token 3.91"
            ),
            "replay endpoints only when every replica has one: {}",
            line(&cmd)
        );
        let both = [replica(0, true, true), replica(1, true, true)];
        let cmd = router_command(Path::new("r"), &both, &s, Path::new("rows")).unwrap();
        assert!(
            line(&cmd)
                .contains(" --kv-replay tcp://127.0.0.1:6000,tcp://127.0.0.1:6001 --index-ttl-s"),
            "{}",
            line(&cmd)
        );
        let e = router_command(
            Path::new("r"),
            &[replica(0, false, false)],
            &s,
            Path::new("x"),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "replica 0 publishes no KV events, which policy exact-residency needs"
        );
        let e = check_kv_events(EngineKind::LlamaCpp, &s).unwrap_err();
        assert!(
            e.to_string().starts_with(
                "policy exact-residency needs the engines' KV events and cannot run on a llama-cpp fleet: llama.cpp's llama-server publishes no KV events"
            ),
            "{e}"
        );
        assert!(check_kv_events(EngineKind::Vllm, &s).is_ok());
        s.kv_events = false;
        assert!(check_kv_events(EngineKind::LlamaCpp, &s).is_ok());
    }
}
