//! Renders the figures from a measurements directory: `cargo run -p figures --example render --
//! <measurements dir> <out dir> [figure …]` (figures as `1`…`10` or stems; default all).

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [measurements, out, which @ ..] = args.as_slice() else {
        eprintln!("usage: render <measurements dir> <out dir> [figure …]");
        return ExitCode::FAILURE;
    };
    let mut figs = Vec::new();
    for w in which {
        let Some(f) = figures::FigureId::parse(w) else {
            eprintln!("unknown figure `{w}` (1…10 or a stem)");
            return ExitCode::FAILURE;
        };
        figs.push(f);
    }
    if figs.is_empty() {
        figs = figures::FigureId::ALL.to_vec();
    }
    let src = figures::Sources::discover(Path::new(measurements));
    match figures::render(&src, Path::new(out), &figs) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}", e.chain());
            ExitCode::FAILURE
        }
    }
}
