//! The load driver (`driver closed|open`) as a process: its command line, and waiting for it
//! while watching the fleet.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::Result;
use crate::error::fail;
use serde::Serialize;

use crate::fleet::Fleet;
use crate::process::ChildGuard;

/// Driver settings of one run.
#[derive(Debug, Clone, Serialize)]
pub struct DriverSettings {
    /// `closed` or `open`.
    pub mode: &'static str,
    /// `--warmup-s`.
    pub warmup_s: f64,
    /// `--duration-s`: no new requests after it.
    pub duration_s: Option<f64>,
    /// `--timeout-s` per request.
    pub timeout_s: f64,
    /// `--model`.
    pub model: String,
    /// `--abandon-after-ms` (open loop, with `duration_s`): the SLO's TTFT bound, wall ms, so
    /// a turn queued past it after the run's end is written as abandoned instead of sent.
    pub abandon_after_ms: Option<f64>,
    /// Reuse connections (false: `--no-keep-alive`, one connection per request — for a driver
    /// sent straight at engines that close connections after a stream, llama.cpp's; the router
    /// and HAProxy keep them).
    pub keep_alive: bool,
}

/// The driver's command line: `driver_bin MODE --url url --plan plan --out out --model …
/// --warmup-s … --timeout-s … [--duration-s … [--abandon-after-ms …]]`.
pub fn driver_command(
    driver_bin: &Path,
    url: &str,
    plan: &Path,
    out: &Path,
    settings: &DriverSettings,
) -> Command {
    let mut cmd = Command::new(driver_bin);
    cmd.arg(settings.mode)
        .args(["--url", url])
        .arg("--plan")
        .arg(plan)
        .arg("--out")
        .arg(out)
        .args(["--model", &settings.model])
        .args(["--warmup-s", &format!("{}", settings.warmup_s)])
        .args(["--timeout-s", &format!("{}", settings.timeout_s)]);
    if let Some(d) = settings.duration_s {
        cmd.args(["--duration-s", &format!("{d}")]);
        if let Some(a) = settings.abandon_after_ms {
            cmd.args(["--abandon-after-ms", &format!("{a}")]);
        }
    }
    if !settings.keep_alive {
        cmd.arg("--no-keep-alive");
    }
    cmd
}

/// Where the driver rewrites its progress line (`--progress-file`): beside its log
/// (`driver.log` → `driver.progress`), so [`wait_driver`] can show it on an interactive terminal
/// while the driver's stderr goes to the log.
pub fn progress_file(log: &Path) -> PathBuf {
    log.with_extension("progress")
}

/// Starts `driver closed|open` against `url`: plan `plan`, rows into `out`, log into `log`.
pub fn start_driver(
    driver_bin: &Path,
    url: &str,
    plan: &Path,
    out: &Path,
    settings: &DriverSettings,
    log: &Path,
) -> Result<ChildGuard> {
    let mut cmd = driver_command(driver_bin, url, plan, out, settings);
    cmd.arg("--progress-file").arg(progress_file(log));
    ChildGuard::spawn("driver", cmd, log)
}

/// Waits for the driver to exit successfully within `limit`, checking the fleet and
/// `should_stop` (a Ctrl-C flag). `on_tick` runs about every 100 ms with the elapsed time (used
/// to start evidence sampling once the warm-up is over).
pub fn wait_driver(
    driver: &mut ChildGuard,
    fleet: &mut Fleet,
    limit: Duration,
    should_stop: &dyn Fn() -> bool,
    mut on_tick: impl FnMut(Duration) -> Result<()>,
) -> Result<()> {
    let started = Instant::now();
    let mut shown = TerminalProgress::new(progress_file(driver.log_path()));
    loop {
        if should_stop() {
            fail!(Interrupted, "interrupted");
        }
        if let Some(status) = driver.try_wait()? {
            shown.clear();
            if status.success() {
                return Ok(());
            }
            fail!(
                Exited,
                "the driver failed ({status}); see its log {}",
                driver.log_path().display()
            );
        }
        fleet.check_alive()?;
        let elapsed = started.elapsed();
        if elapsed > limit {
            fail!(
                Timeout,
                "the driver did not finish within {:.0} s; see its log {}",
                limit.as_secs_f64(),
                driver.log_path().display()
            );
        }
        on_tick(elapsed)?;
        shown.refresh();
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The driver's progress line redrawn on this process's stderr, once a second, only when stderr
/// is a terminal (a log or a pipe gets nothing: the driver's own log has its summary).
struct TerminalProgress {
    path: PathBuf,
    on: bool,
    drawn: bool,
    last: Option<Instant>,
}

impl TerminalProgress {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            on: std::io::stderr().is_terminal(),
            drawn: false,
            last: None,
        }
    }

    fn refresh(&mut self) {
        if !self.on
            || self
                .last
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.last = Some(Instant::now());
        if let Ok(text) = std::fs::read_to_string(&self.path)
            && let Some(line) = text.lines().next_back()
        {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K  driver: {line}");
            let _ = err.flush();
            self.drawn = true;
        }
    }

    fn clear(&mut self) {
        if self.drawn {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
            self.drawn = false;
        }
    }
}

impl Drop for TerminalProgress {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn driver_command_line() {
        let mut s = DriverSettings {
            mode: "open",
            warmup_s: 0.5,
            duration_s: Some(4.0),
            timeout_s: 20.0,
            model: "kvroute/emulated-8b".into(),
            abandon_after_ms: None,
            keep_alive: true,
        };
        let cmd = driver_command(
            Path::new("/bin/driver"),
            "http://127.0.0.1:9",
            Path::new("p/plan.bin"),
            Path::new("c/client.csv"),
            &s,
        );
        assert_eq!(cmd.get_program(), "/bin/driver");
        assert_eq!(
            args(&cmd).join(" "),
            "open --url http://127.0.0.1:9 --plan p/plan.bin --out c/client.csv --model kvroute/emulated-8b --warmup-s 0.5 --timeout-s 20 --duration-s 4"
        );
        s.abandon_after_ms = Some(166.5);
        let cmd = driver_command(Path::new("d"), "u", Path::new("p"), Path::new("o"), &s);
        assert!(
            args(&cmd)
                .join(" ")
                .ends_with("--duration-s 4 --abandon-after-ms 166.5")
        );
        s.mode = "closed";
        s.duration_s = None;
        // Without a duration there is no end to abandon after.
        let cmd = driver_command(Path::new("d"), "u", Path::new("p"), Path::new("o"), &s);
        assert_eq!(
            args(&cmd).join(" "),
            "closed --url u --plan p --out o --model kvroute/emulated-8b --warmup-s 0.5 --timeout-s 20"
        );
    }

    #[test]
    fn the_progress_file_sits_beside_the_log() {
        assert_eq!(
            progress_file(Path::new("m/s/p/rep-1/driver.log")),
            Path::new("m/s/p/rep-1/driver.progress")
        );
    }
}
