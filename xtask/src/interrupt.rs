//! Ctrl-C (and SIGTERM) handling: the first signal asks the sweep to stop at a safe point
//! (children killed, no half cell marked complete); a second one exits at once.

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

/// Whether a stop was requested.
pub fn requested() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Installs the handlers on a background thread.
pub fn install() {
    let spawned = std::thread::Builder::new()
        .name("signals".into())
        .spawn(|| {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                use tokio::signal::unix::{SignalKind, signal};
                let (Ok(mut int), Ok(mut term)) = (
                    signal(SignalKind::interrupt()),
                    signal(SignalKind::terminate()),
                ) else {
                    return;
                };
                loop {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                    if STOP.swap(true, Ordering::Relaxed) {
                        eprintln!("\nxtask: second interrupt, killing children and exiting now");
                        fleet::kill_all();
                        std::process::exit(130);
                    }
                    eprintln!(
                        "\nxtask: interrupted; stopping at a safe point (press Ctrl-C again to exit at once)"
                    );
                }
            });
        });
    if let Err(e) = spawned {
        eprintln!("xtask: cannot install the Ctrl-C handler ({e}); Ctrl-C will not clean up");
    }
}
