//! The embedded font. Plotters' `ab_glyph` backend finds fonts only in its own registry, so the
//! font must be registered before the first text is measured or drawn; registering it here keeps
//! the figures independent of fontconfig and of whatever fonts the machine has.

use std::sync::OnceLock;

use plotters::style::FontStyle;

use crate::{Error, Result};

/// DejaVu Sans (Bitstream Vera licence, see `assets/DejaVuSans-LICENSE`).
static DEJAVU_SANS: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// The family name every figure draws with. Registered as `sans-serif` so that the SVG files
/// (which name the family instead of embedding glyphs) fall back to the viewer's sans-serif.
pub const FAMILY: &str = "sans-serif";

/// Whether registering succeeded (the first outcome, for every later call).
static REGISTERED: OnceLock<bool> = OnceLock::new();

/// Registers the embedded font once per process; later calls return the first outcome.
pub fn ensure_registered() -> Result<()> {
    let registered = *REGISTERED.get_or_init(|| {
        [FontStyle::Normal, FontStyle::Bold]
            .into_iter()
            .all(|style| plotters::style::register_font(FAMILY, style, DEJAVU_SANS).is_ok())
    });
    if registered { Ok(()) } else { Err(Error::Font) }
}
