//! Renders the figures from a measurements directory: `cargo run -p figures --example render --
//! <measurements dir> <out dir> [figure …]` (figures as `1`…`9` or stems; default all).

use std::path::Path;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [measurements, out, which @ ..] = args.as_slice() else {
        anyhow::bail!("usage: render <measurements dir> <out dir> [figure …]");
    };
    let figs = if which.is_empty() {
        figures::FigureId::ALL.to_vec()
    } else {
        which
            .iter()
            .map(|w| {
                figures::FigureId::parse(w)
                    .ok_or_else(|| anyhow::anyhow!("unknown figure `{w}` (1…9 or a stem)"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    let src = figures::Sources::discover(Path::new(measurements));
    for f in figures::render(&src, Path::new(out), &figs)? {
        println!("{}", f.display());
    }
    Ok(())
}
