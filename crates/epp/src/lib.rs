//! `epp`: kvroute as an Envoy endpoint picker (EPP) — the Gateway API Inference Extension's
//! endpoint-picker protocol over Envoy's `ext_proc` gRPC service, deciding with the router's own
//! core: the same [`policies::Policy`] under the same lock (`proxy::state::Shared`), the same
//! block keys (`proxy::service::route_keys`), the same KV-event subscriber, health checks and
//! `router.csv` rows — imported from `proxy`, not copied. Envoy forwards the bytes; the picker
//! only decides and reads back what Envoy did.
//!
//! Module map:
//! - [`server`]: [`Epp`] (start, address, graceful shutdown), [`run_blocking`] (the binary's
//!   main loop), the `ext_proc` service and the gRPC health service.
//! - [`exchange`]: one request's `ext_proc` exchange (full-duplex streamed body: buffer, decide,
//!   stream back; the picked endpoint as header and `envoy.lb` metadata with fallbacks; 503/429;
//!   the served endpoint read back; the row).
//! - [`endpoints`]: replica URLs as `ip:port` endpoints, the watched endpoint file.
//! - [`envoy`]: Envoy's bootstrap for the picker (ext_proc filter + `override_host` policy), the
//!   binary `scripts/envoy.sh` installs, and a process handle.
//! - [`config`]: the configuration ([`EppConfig`]).

#![forbid(unsafe_code)]

pub mod config;
pub mod endpoints;
pub mod envoy;
pub mod exchange;
pub mod server;

pub use config::{EnvoyLaunch, EppConfig};
pub use server::{Epp, EppError, run_blocking};
