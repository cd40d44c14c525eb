//! What sits in front of the fleet during a cell: kvroute's router, HAProxy, or Envoy with
//! kvroute's endpoint picker.
//!
//! Each kind of ingress has its own launcher module ([`router`], [`haproxy`], [`envoy_epp`],
//! which reuses the router's command line); none knows HAProxy's or the others' processes. [`IngressProcess`] is the one place that chooses between them, so a new kind
//! (Envoy, several routers behind one address) is a new module and a new variant here.

pub mod envoy_epp;
pub mod haproxy;
pub mod router;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::fleet::Fleet;
use crate::process::ChildGuard;

pub use haproxy::{Haproxy, HaproxySettings, ServerStat};
pub use router::{RouterSettings, start_router};

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
}

impl IngressProcess {
    /// Starts `ingress` in front of `fleet` for the cell in `dir`: `router_bin` through
    /// [`start_router`] with `router` (rows into `dir/router.csv`, log `dir/router.log`),
    /// HAProxy with `haproxy` (config and log in `dir`), or the `epp` binary beside `router_bin`
    /// (the same cargo profile directory) with `--envoy` and `router`'s flags (rows into
    /// `dir/router.csv`, log `dir/epp.log`, Envoy's in `dir/envoy.log`). `should_stop` (a
    /// Ctrl-C flag) is polled while waiting for it. Returns it and the URL to point the driver at.
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
        })
    }

    /// The router's (or the picker's) worker threads, as its readiness line reported them
    /// (`None` for HAProxy).
    pub fn router_workers(&self) -> Option<u64> {
        match self {
            IngressProcess::Router(guard) | IngressProcess::EnvoyEpp(guard) => {
                guard.readiness().and_then(|r| r.workers)
            }
            IngressProcess::Haproxy(_) => None,
        }
    }

    /// How the router's (or the picker's) threads were scheduled, as its readiness line
    /// reported it (`None` for HAProxy; the picker reports none).
    pub fn router_scheduling(&self) -> Option<String> {
        match self {
            IngressProcess::Router(guard) | IngressProcess::EnvoyEpp(guard) => {
                guard.readiness().and_then(|r| r.scheduling.clone())
            }
            IngressProcess::Haproxy(_) => None,
        }
    }

    /// The router or picker process, to check it is still running (`None` for HAProxy).
    pub fn router_process(&mut self) -> Option<&mut ChildGuard> {
        match self {
            IngressProcess::Router(guard) | IngressProcess::EnvoyEpp(guard) => Some(guard),
            IngressProcess::Haproxy(_) => None,
        }
    }

    /// Stops it once the driver is done: the router on SIGTERM (it flushes its rows first); the
    /// picker and its Envoy on SIGTERM to their group (Envoy exits at once, the picker flushes
    /// its rows); HAProxy after its per-server counts are written to `dir/haproxy-stats.json`. Either is
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
