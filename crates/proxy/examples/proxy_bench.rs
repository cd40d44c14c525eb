//! Runs the proxy benchmark (`xtask/src/proxy_bench.rs`) standalone, before or besides its
//! `cargo xtask proxy-bench` wiring:
//! `cargo build --release -p router-bin && cargo run --release -p proxy --example proxy_bench -- --out docs/proxy-bench-table.md`.

#[path = "../../../xtask/src/proxy_bench.rs"]
mod proxy_bench;

use clap::Parser;

/// Flags: see `proxy_bench::ProxyBenchArgs`.
#[derive(Debug, Parser)]
#[command(name = "proxy_bench")]
struct Cli {
    #[command(flatten)]
    args: proxy_bench::ProxyBenchArgs,
}

fn main() -> anyhow::Result<()> {
    proxy_bench::run(&Cli::parse().args)
}
