//! Child processes that cannot outlive their owner.
//!
//! Every process the harness starts (engines, vLLM command replicas, the router, drivers) is
//! wrapped in a [`ChildGuard`]. The guard puts the child in its own process group, so that signals
//! reach the whole tree (vLLM forks worker processes) and a Ctrl-C at the terminal reaches only the
//! orchestrator, which then tears down in order. Dropping the guard — also while unwinding from a
//! panic — SIGKILLs the group and reaps the child.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{err, fail};
use crate::{Error, Result};

/// The readiness line an `engine` or `router` prints once it accepts connections
/// (docs/CONTRACTS.md, "Server binaries announce readiness").
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct Readiness {
    /// `host:port` of the HTTP listener.
    pub listening: String,
    /// ZMQ PUB endpoint of the KV event stream, when events are on.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// ZMQ ROUTER endpoint of the KV event replay socket, when events are on.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// `host:port` of the router's admin listener (`/admin/*`, `/metrics`); routers only.
    #[serde(default)]
    pub admin: Option<String>,
    /// The router's worker threads (`--workers`, else its default); routers only.
    #[serde(default)]
    pub workers: Option<u64>,
    /// How the router's threads are scheduled (`other`, `fifo:N`, or a refusal); routers only.
    #[serde(default)]
    pub scheduling: Option<String>,
}

impl Readiness {
    /// Parses one stdout line; `None` when the line is not a readiness object (banners, logs).
    pub fn parse(line: &str) -> Option<Readiness> {
        let trimmed = line.trim();
        if !trimmed.starts_with('{') {
            return None;
        }
        serde_json::from_str(trimmed).ok()
    }

    /// The HTTP base URL, `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.listening)
    }

    /// The admin base URL, `http://host:port`, when the line names an admin listener.
    pub fn admin_url(&self) -> Option<String> {
        self.admin.as_ref().map(|a| format!("http://{a}"))
    }

    /// The TCP port of the HTTP listener, when `listening` ends in one.
    pub fn port(&self) -> Option<u16> {
        self.listening.rsplit(':').next()?.parse().ok()
    }
}

/// Sends `signal` to the process group `pgid`.
///
/// Returns false when the group no longer exists (already reaped), which callers treat as done.
#[allow(unsafe_code)]
pub fn signal_group(pgid: u32, signal: i32) -> bool {
    let Ok(pgid) = i32::try_from(pgid) else {
        return false;
    };
    if pgid <= 1 {
        // A negative pid of -1 would signal every process we may signal; never do that.
        return false;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; the argument is a plain integer naming
    // a process group this guard created (pgid > 1 checked above).
    unsafe { libc::kill(-pgid, signal) == 0 }
}

/// Process groups of every live [`ChildGuard`] in this process, for [`kill_all`].
static LIVE_GROUPS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn register(pgid: u32) {
    if let Ok(mut live) = LIVE_GROUPS.lock() {
        live.push(pgid);
    }
}

fn unregister(pgid: u32) {
    if let Ok(mut live) = LIVE_GROUPS.lock() {
        live.retain(|&g| g != pgid);
    }
}

/// SIGKILLs the process group of every live [`ChildGuard`]: for an orchestrator that must exit
/// at once (a second Ctrl-C) without running destructors.
pub fn kill_all() {
    let groups = LIVE_GROUPS.lock().map(|g| g.clone()).unwrap_or_default();
    for pgid in groups {
        signal_group(pgid, libc::SIGKILL);
    }
}

/// A spawned child that is killed (SIGKILL to its process group) and reaped when dropped.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Option<Child>,
    log_path: PathBuf,
    stdout_thread: Option<JoinHandle<()>>,
    lines: Option<mpsc::Receiver<String>>,
    readiness: Option<Readiness>,
}

impl ChildGuard {
    /// Spawns `command` in a new process group, with stdout and stderr appended to `log_path`.
    ///
    /// Each stdout line is also offered to [`ChildGuard::wait_for_line`], so readiness lines can
    /// be awaited without racing the log copy.
    pub fn spawn(name: &str, mut command: Command, log_path: &Path) -> Result<ChildGuard> {
        if let Some(dir) = log_path.parent() {
            std::fs::create_dir_all(dir).map_err(Error::io("creating log directory", dir))?;
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .map_err(Error::io("opening log file", log_path))?;
        let stderr_log = log
            .try_clone()
            .map_err(Error::io("cloning log handle", log_path))?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr_log))
            .process_group(0);
        let program = command.get_program().to_string_lossy().into_owned();
        let mut child = command.spawn().map_err(|source| Error::Spawn {
            what: format!(
                "{name}: cannot start `{program}` (log {})",
                log_path.display()
            ),
            source,
        })?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| err!(State, "{name}: stdout was not captured"))?;
        register(child.id());
        let (tx, rx) = mpsc::channel();
        let stdout_thread = std::thread::Builder::new()
            .name(format!("log-{name}"))
            .spawn(move || copy_lines(stdout, log, tx))
            .map_err(|source| Error::Spawn {
                what: "spawning log thread".to_string(),
                source,
            })?;
        Ok(ChildGuard {
            name: name.to_string(),
            child: Some(child),
            log_path: log_path.to_path_buf(),
            stdout_thread: Some(stdout_thread),
            lines: Some(rx),
            readiness: None,
        })
    }

    /// The name given at spawn (used in every error message).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file that holds this child's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The child's pid, which is also its process group id; `None` once reaped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Waits until a stdout line satisfies `pick`, the child exits, or `timeout` passes.
    ///
    /// Lines that `pick` rejects are skipped (they are in the log anyway). `should_stop` is polled
    /// so that an interrupt does not have to wait for the timeout.
    pub fn wait_for_line<T>(
        &mut self,
        timeout: Duration,
        mut pick: impl FnMut(&str) -> Option<T>,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            if should_stop() {
                fail!(
                    Interrupted,
                    "{}: interrupted while waiting for it to start",
                    self.name
                );
            }
            let now = Instant::now();
            if now >= deadline {
                fail!(
                    Timeout,
                    "{}: no readiness line within {:.1} s; see its log {}",
                    self.name,
                    timeout.as_secs_f64(),
                    self.log_path.display()
                );
            }
            let rx = self
                .lines
                .as_ref()
                .ok_or_else(|| err!(State, "{}: stdout already closed", self.name))?;
            match rx.recv_timeout((deadline - now).min(Duration::from_millis(100))) {
                Ok(line) => {
                    if let Some(found) = pick(&line) {
                        return Ok(found);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Some(status) = self.try_wait()? {
                        fail!(
                            Exited,
                            "{}: exited ({status}) before it was ready; see its log {}",
                            self.name,
                            self.log_path.display()
                        );
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.lines = None;
                    let status = self.wait_timeout(Duration::from_secs(2))?;
                    fail!(
                        Exited,
                        "{}: closed stdout ({}) before it was ready; see its log {}",
                        self.name,
                        status.map_or_else(|| "still running".to_string(), |s| s.to_string()),
                        self.log_path.display()
                    );
                }
            }
        }
    }

    /// Waits for the JSON readiness line of the contract (kept: [`ChildGuard::readiness`]).
    pub fn wait_ready(
        &mut self,
        timeout: Duration,
        should_stop: &dyn Fn() -> bool,
    ) -> Result<Readiness> {
        let ready = self.wait_for_line(timeout, Readiness::parse, should_stop)?;
        self.readiness = Some(ready.clone());
        Ok(ready)
    }

    /// The readiness line [`ChildGuard::wait_ready`] read, once it has.
    pub fn readiness(&self) -> Option<&Readiness> {
        self.readiness.as_ref()
    }

    /// Non-blocking: the exit status if the child has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => child.try_wait().map_err(|source| Error::Spawn {
                what: format!("{}: waiting on the process", self.name),
                source,
            }),
            None => Ok(None),
        }
    }

    /// Polls for exit until `timeout`; `None` if still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to the child's process group (no-op once reaped).
    pub fn signal(&self, signal: i32) {
        if let Some(pid) = self.pid() {
            signal_group(pid, signal);
        }
    }

    /// SIGKILL now (the `kill -9` fault), then reap.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal_group(child.id(), libc::SIGKILL);
            // The leader itself, in case it left its group.
            let _ = child.kill();
            let _ = child.wait();
            unregister(child.id());
        }
        self.join_log();
    }

    /// Graceful stop: SIGTERM to the group, wait up to `grace`, then SIGKILL. Returns the status
    /// when the child exited within the grace period.
    pub fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        self.signal(libc::SIGTERM);
        let status = self.wait_timeout(grace).ok().flatten();
        if status.is_some() {
            // Reap the group's stragglers (vLLM workers) too.
            if let Some(child) = self.child.take() {
                signal_group(child.id(), libc::SIGKILL);
                unregister(child.id());
            }
            self.join_log();
            return status;
        }
        self.kill();
        None
    }

    fn join_log(&mut self) {
        self.lines = None;
        if let Some(handle) = self.stdout_thread.take() {
            // The copier ends when the pipe closes; if a grandchild still holds it open, leave the
            // thread detached rather than hang.
            if handle.is_finished() {
                let _ = handle.join();
            }
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

fn copy_lines(stdout: impl std::io::Read, mut log: File, tx: mpsc::Sender<String>) {
    let reader = BufReader::new(stdout);
    for line in reader.lines() {
        let Ok(line) = line else { break };
        let _ = writeln!(log, "{line}");
        // The receiver may be gone (nobody waits for lines any more); keep copying to the log.
        let _ = tx.send(line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_parses_engine_and_router_lines() {
        let engine = Readiness::parse(
            r#"{"listening":"127.0.0.1:4001","kv_events":"tcp://127.0.0.1:4002","kv_replay":null}"#,
        )
        .expect("engine line");
        assert_eq!(engine.url(), "http://127.0.0.1:4001");
        assert_eq!(engine.port(), Some(4001));
        assert_eq!(engine.kv_events.as_deref(), Some("tcp://127.0.0.1:4002"));
        assert_eq!(engine.kv_replay, None);
        assert_eq!(engine.admin_url(), None);
        let router = Readiness::parse(
            r#"  {"listening":"127.0.0.1:9","admin":"127.0.0.1:10","workers":2}  "#,
        )
        .expect("router line");
        assert_eq!(router.kv_events, None);
        assert_eq!((router.workers, engine.workers), (Some(2), None));
        assert_eq!(router.admin_url().as_deref(), Some("http://127.0.0.1:10"));
        assert_eq!(Readiness::parse("INFO starting"), None);
        assert_eq!(Readiness::parse(r#"{"other":1}"#), None);
    }
}
