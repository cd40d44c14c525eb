//! What the workspace's tests share, so that each is written once: the mock replica
//! ([`MockReplica`], a scripted SSE upstream), the deadline-bound wait ([`eventually`]), temp
//! dirs removed on drop ([`temp_dir`], from the `tempfile` crate) and the release binaries
//! ([`release_bin`]).
//!
//! Dev-only: crates take it under `[dev-dependencies]`, never as a dependency.

mod bins;
mod dirs;
mod sse;
mod wait;

pub use bins::{EXPERIMENT_BIN_PACKAGES, release_bin, target_dir, workspace_root};
pub use dirs::temp_dir;
pub use sse::{MockReplica, MockState, Script, Seen, mock_tokens};
pub use tempfile::TempDir;
pub use wait::{WAIT, eventually};
