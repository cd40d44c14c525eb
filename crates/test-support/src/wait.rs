//! The one deadline-bound wait.

use std::future::Future;
use std::time::Duration;

/// How long tests wait for something that happens in milliseconds when all is well: long enough
/// for a loaded 2-core machine, short enough that a hang fails the test instead of the run.
pub const WAIT: Duration = Duration::from_secs(20);

/// Waits until `check()` holds, checking it again every 5 ms, and panics naming `what` when it
/// does not hold within `within`. The condition is what is awaited (the pause only yields):
/// never a sleep standing in for an event.
///
/// A synchronous condition: `eventually("…", WAIT, || std::future::ready(cond())).await`.
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
