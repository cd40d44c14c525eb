//! What sits in front of the fleet during a cell: kvroute's router, HAProxy, or Envoy with
//! kvroute's endpoint picker.
//!
//! Each kind of ingress has its own launcher module ([`router`], [`haproxy`], [`envoy_epp`],
//! which reuses the router's command line, [`routers`], several routers behind HAProxy's
//! generator); none knows the others' processes. [`IngressProcess`] is the one place that
//! chooses between them, so a new kind is a new module and a new variant here.

pub mod envoy_epp;
pub mod haproxy;
pub mod router;
pub mod routers;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::Result;
use crate::error::fail;
use serde::{Deserialize, Serialize};

use crate::fleet::Fleet;
use crate::process::{ChildGuard, Readiness};

pub use haproxy::{Balance, Haproxy, HaproxySettings, ServerStat};
pub use router::{RouterSettings, start_router};
pub use routers::{Front, Routers, RoutersRecord, RoutersSettings};

/// The policy the router (or the endpoint picker) of a cell runs, from the cell's policy
/// directory name: without the `envoy-epp-` ([`envoy_epp::picker_policy`]) or
/// `r<N>-<rr|hash>[-share]-` ([`routers::router_policy`]) prefix.
pub fn router_policy(cell: &str) -> &str {
    routers::router_policy(envoy_epp::picker_policy(cell))
}

/// What sits in front of the replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ingress {
    /// kvroute's router (policy from its [`RouterSettings`]).
    #[default]
    Router,
    /// HAProxy with bounded-load consistent hashing on `x-session-id`.
    Haproxy,
    /// Envoy deciding through kvroute's endpoint picker (the router's policy and rows).
    #[serde(rename = "envoy-epp")]
    EnvoyEpp,
    /// Several kvroute routers (each with its [`RouterSettings`]) behind HAProxy
    /// ([`routers`]).
    Routers(RoutersSettings),
}

impl Ingress {
    /// The name of the file that records a sweep run through it, beside the others in one sweep
    /// directory: `sweep.json` (the router), `sweep-haproxy.json`, `sweep-envoy-epp.json`,
    /// `sweep-r4-rr.json`, `sweep-r4-hash-share.json`, …
    pub fn record_file_name(&self) -> String {
        match self {
            Ingress::Router => "sweep.json".to_string(),
            Ingress::Haproxy => "sweep-haproxy.json".to_string(),
            Ingress::EnvoyEpp => "sweep-envoy-epp.json".to_string(),
            Ingress::Routers(r) => {
                format!("sweep-{}.json", r.cell_prefix().trim_end_matches('-'))
            }
        }
    }

    /// What `meta.json`'s `run` records about the routers: `routers` (1 for the router, N),
    /// `front` (`rr`, `session-hash`; `null` for one router), `share_decisions` and
    /// `share_loads`; `None` for HAProxy or Envoy in place of the router.
    pub fn routers_run_record(&self) -> Option<serde_json::Value> {
        match self {
            Ingress::Router => Some(serde_json::json!({
                "routers": 1, "front": null, "share_decisions": false, "share_loads": false,
            })),
            Ingress::Routers(r) => Some(serde_json::json!({
                "routers": r.count, "front": r.front.as_str(), "share_decisions": r.share,
                "share_loads": r.share_loads,
            })),
            Ingress::Haproxy | Ingress::EnvoyEpp => None,
        }
    }
}

/// The process in front of the fleet during one cell: kvroute's router or HAProxy. A sweep
/// starts it where it started the router and finishes it where it stopped the router.
#[derive(Debug)]
pub enum IngressProcess {
    /// The router (`router.csv` in the cell).
    Router(ChildGuard),
    /// HAProxy (no `router.csv`; `haproxy-stats.json` instead).
    Haproxy(Haproxy),
    /// The endpoint picker and its Envoy, one process group (`router.csv` from the picker).
    EnvoyEpp(ChildGuard),
    /// Several routers behind HAProxy (`router-<K>.csv` merged into `router.csv`, and
    /// `routers.json`).
    Routers(Routers),
}

impl IngressProcess {
    /// Starts `ingress` in front of `fleet` for the cell in `dir`: `router_bin` through
    /// [`start_router`] with `router` (rows into `dir/router.csv`, log `dir/router.log`),
    /// HAProxy with `haproxy` (config and log in `dir`), or the `epp` binary beside `router_bin`
    /// (the same cargo profile directory) with `--envoy` and `router`'s flags (rows into
    /// `dir/router.csv`, log `dir/epp.log`, Envoy's in `dir/envoy.log`), or several routers with
    /// `router` behind HAProxy with `haproxy`'s threads and timeouts ([`Routers::start`]).
    /// `should_stop` (a Ctrl-C flag) is polled while waiting for it. Returns it and the URL to
    /// point the driver at.
    pub fn start(
        ingress: Ingress,
        router_bin: &Path,
        fleet: &Fleet,
        router: &RouterSettings,
        haproxy: &HaproxySettings,
        dir: &Path,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<(IngressProcess, String)> {
        Ok(match ingress {
            Ingress::Router => {
                let (guard, url, _admin) = start_router(
                    router_bin,
                    fleet,
                    router,
                    &dir.join("router.csv"),
                    &dir.join("router.log"),
                    should_stop,
                )?;
                (IngressProcess::Router(guard), url)
            }
            Ingress::Haproxy => {
                let h = Haproxy::start(&fleet.urls(), haproxy, dir, should_stop)?;
                let url = h.url().to_string();
                (IngressProcess::Haproxy(h), url)
            }
            Ingress::EnvoyEpp => {
                let (guard, url, _admin) = envoy_epp::start_envoy_epp(
                    &router_bin.with_file_name("epp"),
                    fleet,
                    router,
                    &dir.join("router.csv"),
                    &dir.join("epp.log"),
                    dir,
                    should_stop,
                )?;
                (IngressProcess::EnvoyEpp(guard), url)
            }
            Ingress::Routers(settings) => {
                let r = Routers::start(
                    router_bin,
                    fleet,
                    router,
                    haproxy,
                    settings,
                    dir,
                    should_stop,
                )?;
                let url = r.url().to_string();
                (IngressProcess::Routers(r), url)
            }
        })
    }

    /// The readiness line of the router, the picker or router `r0`.
    fn readiness(&self) -> Option<&Readiness> {
        match self {
            IngressProcess::Router(guard) | IngressProcess::EnvoyEpp(guard) => guard.readiness(),
            IngressProcess::Routers(r) => r.first_readiness(),
            IngressProcess::Haproxy(_) => None,
        }
    }

    /// The router's (or the picker's, or each of several routers') worker threads, as its
    /// readiness line reported them (`None` for HAProxy).
    pub fn router_workers(&self) -> Option<u64> {
        self.readiness().and_then(|r| r.workers)
    }

    /// How the router's (or the picker's, or each of several routers') threads were scheduled,
    /// as its readiness line reported it (`None` for HAProxy; the picker reports none).
    pub fn router_scheduling(&self) -> Option<String> {
        self.readiness().and_then(|r| r.scheduling.clone())
    }

    /// Fails naming the router or picker process (any of several routers, or HAProxy in front
    /// of them) that has exited, and its log; HAProxy in place of the router is not checked.
    pub fn check_running(&mut self) -> Result<()> {
        match self {
            IngressProcess::Router(guard) | IngressProcess::EnvoyEpp(guard) => {
                if let Some(status) = guard.try_wait()? {
                    fail!(
                        Exited,
                        "the {} exited during the run ({status}); see its log {}",
                        guard.name(),
                        guard.log_path().display()
                    );
                }
                Ok(())
            }
            IngressProcess::Routers(r) => r.check_running(),
            IngressProcess::Haproxy(_) => Ok(()),
        }
    }

    /// Stops it once the driver is done: the router on SIGTERM (it flushes its rows first); the
    /// picker and its Envoy on SIGTERM to their group (Envoy exits at once, the picker flushes
    /// its rows); HAProxy after its per-server counts are written to `dir/haproxy-stats.json`;
    /// several routers through [`Routers::finish`] (`router.csv` merged, `routers.json`). Any is
    /// killed when it has not exited within `grace`; then the answer is a warning to show
    /// (its output may be cut).
    pub fn finish(self, dir: &Path, grace: Duration) -> Result<Option<String>> {
        let (name, log, status): (_, PathBuf, _) = match self {
            IngressProcess::Router(mut guard) => {
                let status = guard.terminate(grace);
                ("router", guard.log_path().to_path_buf(), status)
            }
            IngressProcess::EnvoyEpp(mut guard) => {
                let status = guard.terminate(grace);
                ("endpoint picker", guard.log_path().to_path_buf(), status)
            }
            IngressProcess::Haproxy(mut h) => {
                h.write_stats(&dir.join("haproxy-stats.json"))?;
                let status = h.terminate(grace);
                ("HAProxy", h.log_path().to_path_buf(), status)
            }
            IngressProcess::Routers(r) => {
                let warnings = r.finish(dir, grace)?;
                return Ok((!warnings.is_empty()).then(|| warnings.join("; ")));
            }
        };
        Ok(status.is_none().then(|| {
            format!(
                "the {name} did not exit within {:.0} s and was killed; its output may be cut (log {})",
                grace.as_secs_f64(),
                log.display()
            )
        }))
    }
}
