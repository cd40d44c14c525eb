//! Drawing: one generic routine per figure, run once on the bitmap backend (PNG) and once on
//! the SVG backend, plus the pieces they share (header, heatmap grid, hatching, colours).
//!
//! Labels round for legibility; the CSV beside each figure holds the exact numbers.

use std::path::Path;

use plotters::chart::MeshStyle;
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::data::{
    BELIEF_POLICIES, BeliefData, CapacityContext, CapacityRatioData, CapacityWinnersData, LADDER,
    LadderData, LoadCurveData, MechRole, MechanismData, NoDataCell, Outage, PolicyCapacityData,
    PressureData, RoutersData, TimelineData, TraceData, WinnersData, band_label, set_aside_note,
};
use crate::font::{self, FAMILY};
use crate::input::{Context, num};
use crate::{Error, Result};
use analysis::Verdict;
use analysis::capacity::CapacityVerdict;
use analysis::stats::Spread;
use schema::ATTAINMENT_TARGET;

/// A figure that can draw itself on any plotters backend.
pub trait Figure {
    /// Canvas size, px.
    fn size(&self) -> (u32, u32);
    /// Draws the whole figure on `root`.
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>;
}

fn de<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> Error {
    Error::Draw(e.to_string())
}

/// Draws `fig` into `png` and `svg`.
pub fn render_files<F: Figure>(fig: &F, png: &Path, svg: &Path) -> Result<()> {
    font::ensure_registered()?;
    {
        let root = BitMapBackend::new(png, fig.size()).into_drawing_area();
        fig.draw(&root)?;
        root.present().map_err(|e| Error::Save {
            path: png.to_path_buf(),
            message: e.to_string(),
        })?;
    }
    let root = SVGBackend::new(svg, fig.size()).into_drawing_area();
    fig.draw(&root)?;
    root.present().map_err(|e| Error::Save {
        path: svg.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(())
}

fn style(size: f64, color: &RGBColor, h: HPos, v: VPos) -> TextStyle<'static> {
    (FAMILY, size).into_font().color(color).pos(Pos::new(h, v))
}

const INK: RGBColor = RGBColor(30, 30, 30);
const MUTED: RGBColor = RGBColor(90, 90, 90);
const EMPTY_CELL: RGBColor = RGBColor(225, 225, 225);

/// The colour a policy is drawn in, the same in every figure.
pub fn policy_color(policy: &str) -> RGBColor {
    match policy {
        "round-robin" => RGBColor(127, 127, 127),
        "least-outstanding" => RGBColor(140, 86, 75),
        "session-affinity" => RGBColor(31, 119, 180),
        "session-bounded" => RGBColor(23, 190, 207),
        "prefix-hash" => RGBColor(188, 189, 34),
        "prefix-affinity" => RGBColor(255, 127, 14),
        "prefix-affinity-spill-off" => RGBColor(214, 39, 40),
        "exact-residency" => RGBColor(44, 160, 44),
        "exact-residency-spec" => RGBColor(148, 103, 189),
        _ => RGBColor(227, 119, 194),
    }
}

/// Colours for series that are not policies (points in the decay panel).
const SERIES: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn lighten(c: RGBColor, keep: f64) -> RGBColor {
    let m = |v: u8| (255.0 - (255.0 - f64::from(v)) * keep).round() as u8;
    RGBColor(m(c.0), m(c.1), m(c.2))
}

/// Title and subtitle lines; returns the area below them.
fn header<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    lines: &[String],
) -> Result<DrawingArea<DB, Shift>> {
    root.fill(&WHITE).map_err(de)?;
    let (w, _) = root.dim_in_pixel();
    let cx = (w / 2) as i32;
    root.draw(&Text::new(
        title.to_string(),
        (cx, 14),
        style(26.0, &INK, HPos::Center, VPos::Top),
    ))
    .map_err(de)?;
    let mut y = 50;
    for l in lines {
        root.draw(&Text::new(
            l.clone(),
            (cx, y),
            style(15.0, &MUTED, HPos::Center, VPos::Top),
        ))
        .map_err(de)?;
        y += 21;
    }
    let (_, rest) = root.split_vertically(y + 8);
    Ok(rest)
}

/// Axis labels `label_px` tall, axis titles `desc_px` tall, and one faint grid line between
/// labelled ones: the mesh style of every chart-based figure.
fn quiet_mesh<'m, 'a, 'b, X: Ranged, Y: Ranged, DB: DrawingBackend>(
    mesh: &'m mut MeshStyle<'a, 'b, X, Y, DB>,
    label_px: i32,
    desc_px: i32,
) -> &'m mut MeshStyle<'a, 'b, X, Y, DB> {
    mesh.label_style((FAMILY, label_px))
        .axis_desc_style((FAMILY, desc_px))
        .max_light_lines(1)
        .light_line_style(RGBColor(240, 240, 240))
}

/// The series legend of every chart-based figure: a light boxed key at `position`.
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
    font_px: i32,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.9))
        .border_style(MUTED)
        .label_font((FAMILY, font_px))
        .draw()
        .map_err(de)
}

fn context_lines(ctx: &Context, reps: &str) -> Vec<String> {
    vec![
        format!("sweep {} · workload {}", ctx.sweep, ctx.workload),
        ctx.fleet.clone(),
        format!("{reps} · {}", ctx.slo_text()),
    ]
}

/// Anti-diagonal hatching clipped to a pixel rectangle: marks a within-spread cell.
fn hatch<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    (x0, y0): (i32, i32),
    (x1, y1): (i32, i32),
) -> Result<()> {
    let (w, h) = (x1 - x0, y1 - y0);
    let stroke = RGBColor(70, 70, 70).mix(0.45).stroke_width(1);
    let mut d = 12;
    while d < w + h {
        let a = if d <= w {
            (x0 + d, y0)
        } else {
            (x1, y0 + d - w)
        };
        let b = if d <= h {
            (x0, y0 + d)
        } else {
            (x0 + d - h, y1)
        };
        area.draw(&PathElement::new(vec![a, b], stroke))
            .map_err(de)?;
        d += 12;
    }
    Ok(())
}

/// A dotted frame inset in a pixel rectangle: marks a too-few-reps cell, kept visibly unlike
/// the within-spread hatching because "no spread to judge" is not "spreads overlap".
fn dotted_outline<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    (x0, y0): (i32, i32),
    (x1, y1): (i32, i32),
) -> Result<()> {
    let inset = 10;
    let (l, t, r, b) = (x0 + inset, y0 + inset, x1 - inset, y1 - inset);
    area.draw(&DashedPathElement::new(
        vec![(l, t), (r, t), (r, b), (l, b), (l, t)],
        4,
        6,
        INK.stroke_width(3),
    ))
    .map_err(de)
}

/// How a heatmap cell is marked: plain where the comparison separates, hatched where it does
/// not (spreads overlap, or apart by less than the resolution), a dotted frame where there is no
/// spread to judge by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marking {
    Plain,
    Hatched,
    Dotted,
}

impl Marking {
    fn of(v: Verdict) -> Marking {
        match v {
            Verdict::Separates => Marking::Plain,
            Verdict::WithinSpread => Marking::Hatched,
            // Neither has a spread to judge by; the cell's verdict line says which.
            Verdict::TooFewReps | Verdict::Deterministic => Marking::Dotted,
        }
    }

    fn of_capacity(v: CapacityVerdict) -> Marking {
        match v {
            CapacityVerdict::Separates => Marking::Plain,
            CapacityVerdict::WithinSpread | CapacityVerdict::WithinResolution => Marking::Hatched,
            CapacityVerdict::TooFewSeeds | CapacityVerdict::NotBracketed => Marking::Dotted,
        }
    }
}

/// One cell of a heatmap: where, its fill, its text lines, and how it is marked.
struct HeatCell {
    col: usize,
    row: usize,
    fill: RGBColor,
    lines: Vec<String>,
    marking: Marking,
}

/// A working set × skew grid: rows are working-set ratios (largest on top), columns skews.
fn heatmap<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    ws_values: &[f64],
    s_values: &[f64],
    cells: &[HeatCell],
    no_data: &[NoDataCell],
) -> Result<()> {
    let (w, h) = area.dim_in_pixel();
    let (left, bottom, top, right) = (170i32, 80i32, 10i32, 20i32);
    let (nx, ny) = (s_values.len() as i32, ws_values.len() as i32);
    let cw = (w as i32 - left - right) / nx.max(1);
    let ch = (h as i32 - top - bottom) / ny.max(1);
    let rect = |col: i32, row: i32| {
        let x0 = left + col * cw;
        let y0 = top + (ny - 1 - row) * ch;
        ((x0, y0), (x0 + cw, y0 + ch))
    };
    for col in 0..nx {
        for row in 0..ny {
            let (a, b) = rect(col, row);
            let cell = cells
                .iter()
                .find(|c| c.col as i32 == col && c.row as i32 == row);
            let fill = cell.map_or(EMPTY_CELL, |c| c.fill);
            area.draw(&Rectangle::new([a, b], fill.filled()))
                .map_err(de)?;
            let c = match cell {
                Some(c) => c,
                None => {
                    let aside = no_data.iter().find(|n| {
                        index_of(s_values, n.zipf_s) as i32 == col
                            && index_of(ws_values, n.working_set_ratio) as i32 == row
                    });
                    let lines = match aside {
                        Some(n) => {
                            let mut l = vec!["all reps set aside:".to_string()];
                            l.extend(n.set_aside.iter().cloned());
                            l
                        }
                        None => vec!["not run".to_string()],
                    };
                    let n = lines.len() as i32;
                    for (i, l) in lines.into_iter().enumerate() {
                        area.draw(&Text::new(
                            l,
                            (
                                (a.0 + b.0) / 2,
                                (a.1 + b.1) / 2 + (2 * i as i32 - (n - 1)) * 10,
                            ),
                            style(15.0, &MUTED, HPos::Center, VPos::Center),
                        ))
                        .map_err(de)?;
                    }
                    continue;
                }
            };
            match c.marking {
                Marking::Plain => {}
                Marking::Hatched => hatch(area, a, b)?,
                Marking::Dotted => dotted_outline(area, a, b)?,
            }
            let n = c.lines.len() as i32;
            let line_h = 25;
            let y_first = (a.1 + b.1) / 2 - (n - 1) * line_h / 2;
            for (i, l) in c.lines.iter().enumerate() {
                let size = if i == 0 { 21.0 } else { 17.0 };
                let (tw, th) = area
                    .estimate_text_size(l, &style(size, &INK, HPos::Center, VPos::Center))
                    .map_err(de)?;
                let (tx, ty) = ((a.0 + b.0) / 2, y_first + i as i32 * line_h);
                // a white plate keeps the text legible over hatching and dark fills
                area.draw(&Rectangle::new(
                    [
                        (tx - tw as i32 / 2 - 4, ty - th as i32 / 2 - 2),
                        (tx + tw as i32 / 2 + 4, ty + th as i32 / 2 + 3),
                    ],
                    WHITE.mix(0.8).filled(),
                ))
                .map_err(de)?;
                area.draw(&Text::new(
                    l.clone(),
                    (tx, ty),
                    style(size, &INK, HPos::Center, VPos::Center),
                ))
                .map_err(de)?;
            }
        }
    }
    for col in 0..nx {
        for row in 0..ny {
            let (a, b) = rect(col, row);
            area.draw(&Rectangle::new([a, b], WHITE.stroke_width(2)))
                .map_err(de)?;
        }
    }
    for (col, s) in s_values.iter().enumerate() {
        let (a, b) = rect(col as i32, 0);
        area.draw(&Text::new(
            format!("s = {}", num(*s)),
            ((a.0 + b.0) / 2, b.1 + 10),
            style(16.0, &INK, HPos::Center, VPos::Top),
        ))
        .map_err(de)?;
    }
    let grid_bottom = top + ny * ch;
    area.draw(&Text::new(
        "skew (Zipf exponent over conversations)",
        (left + nx * cw / 2, grid_bottom + 44),
        style(17.0, &INK, HPos::Center, VPos::Top),
    ))
    .map_err(de)?;
    for (row, ws) in ws_values.iter().enumerate() {
        let (a, b) = rect(0, row as i32);
        area.draw(&Text::new(
            format!("{}×", num(*ws)),
            (a.0 - 10, (a.1 + b.1) / 2),
            style(16.0, &INK, HPos::Right, VPos::Center),
        ))
        .map_err(de)?;
    }
    area.draw(&Text::new(
        "working set ÷ fleet KV capacity",
        (30, top + ny * ch / 2),
        style(17.0, &INK, HPos::Center, VPos::Center).transform(FontTransform::Rotate270),
    ))
    .map_err(de)?;
    Ok(())
}

/// A heatmap cell's flag where every policy met its SLO (`Point::below_pressure`).
const BELOW_PRESSURE: &str = "below pressure";

/// The subtitle line that says what the heatmaps' attainments are.
fn attainment_note() -> String {
    format!(
        "SLO met: median share of measured requests within the SLO; below pressure: every \
         policy met it on ≥ {:.0}%, so goodput there measures the offered load",
        schema::ATTAINMENT_TARGET * 100.0
    )
}

/// A median attainment as a whole percentage, `—` when there is none.
fn percent(share: Option<f64>) -> String {
    share.map_or_else(|| "—".to_string(), |v| format!("{:.0}%", v * 100.0))
}

fn index_of(values: &[f64], v: f64) -> usize {
    values.iter().position(|x| *x == v).unwrap_or(0)
}

fn verdict_line(v: Verdict) -> String {
    match v {
        Verdict::Separates => "separates".into(),
        Verdict::WithinSpread => "within spread".into(),
        Verdict::TooFewReps => "too few reps".into(),
        Verdict::Deterministic => "deterministic (virtual)".into(),
    }
}

/// Diverging colour: blue below zero, red above, white at zero, saturating at ±`max`.
fn diverging(v: f64, max: f64) -> RGBColor {
    let t = if max > 0.0 {
        (v / max).clamp(-1.0, 1.0)
    } else {
        0.0
    };
    let c = if t >= 0.0 {
        RGBColor(214, 96, 77)
    } else {
        RGBColor(67, 147, 195)
    };
    lighten(c, t.abs() * 0.85)
}

/// Splits `text` at spaces into lines of at most `max` characters (a longer word keeps its own
/// line).
fn wrap(text: &str, max: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut cur = String::new();
    for word in text.split(' ') {
        if !cur.is_empty() && cur.chars().count() + 1 + word.chars().count() > max {
            lines.push(std::mem::take(&mut cur));
        }
        if !cur.is_empty() {
            cur.push(' ');
        }
        cur.push_str(word);
    }
    if !cur.is_empty() {
        lines.push(cur);
    }
    lines
}

/// Characters of a subtitle line (15 px) that fit the 1300-px maps.
const NOTE_CHARS: usize = 155;
/// Characters of a subtitle line (15 px) that fit figure 10.
const WIDE_NOTE_CHARS: usize = 250;
/// Characters of a panel title (20 px) that fit the 1300-px maps.
const PANEL_TITLE_CHARS: usize = 105;

/// A panel's title (wrapped, 20 px) and note lines (15 px, muted), centred; returns the area
/// below them.
fn panel_header<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    lines: &[String],
) -> Result<DrawingArea<DB, Shift>> {
    let (w, _) = area.dim_in_pixel();
    let cx = (w / 2) as i32;
    let mut y = 6;
    for t in wrap(title, PANEL_TITLE_CHARS) {
        area.draw(&Text::new(
            t,
            (cx, y),
            style(20.0, &INK, HPos::Center, VPos::Top),
        ))
        .map_err(de)?;
        y += 26;
    }
    y += 4;
    for l in lines {
        area.draw(&Text::new(
            l.clone(),
            (cx, y),
            style(15.0, &MUTED, HPos::Center, VPos::Top),
        ))
        .map_err(de)?;
        y += 20;
    }
    Ok(area.split_vertically(y + 10).1)
}

/// Lines a panel's title and notes take (for sizing the canvas).
fn panel_header_lines(title: &str, lines: usize) -> (usize, usize) {
    (wrap(title, PANEL_TITLE_CHARS).len(), lines)
}

/// Pixel height of a panel header of `(title lines, note lines)`.
fn panel_header_px((titles, notes): (usize, usize)) -> u32 {
    (6 + 26 * titles + 4 + 20 * notes + 10) as u32
}

/// The subtitle lines of every capacity panel and of figure 10: the sweep, seeds and
/// resolution, the report's basis, the rule and what was held equal.
fn capacity_lines(c: &CapacityContext, chars: usize) -> Vec<String> {
    let r = c.resolution * 100.0;
    let mut lines = vec![format!(
        "sweep {} · {}, median [min–max] over seeds · resolution {}%: each seed's failing rate is within {}% above its capacity · rules {}",
        c.sweep,
        c.seeds_text(),
        num(r),
        num(r),
        c.rules
    )];
    lines.extend(wrap(&format!("basis: {}", c.basis), chars));
    lines.extend(wrap(
        &format!(
            "capacity: the highest offered open-loop rate (req/s, model time) at which the policy alone met the SLO on ≥ {}% of its measured requests. Held equal per seed: the same plans (conversations, prefixes, arrivals), the same fleet and the calibration's SLO for every policy; each policy's rate is its own search's",
            num(c.target * 100.0)
        ),
        chars,
    ));
    lines
}

/// A capacity [median \[min–max\]] as a cell writes it; `not bracketed` without one.
fn capacity_text(s: Option<Spread>) -> String {
    s.map_or_else(
        || "not bracketed".to_string(),
        |s| format!("{:.3} [{:.3}–{:.3}]", s.median, s.min, s.max),
    )
}

/// The short names a crowded cell lists policies by.
fn short_policy(policy: &str) -> &str {
    match policy {
        "round-robin" => "RR",
        "least-outstanding" => "LO",
        "session-affinity" => "SA",
        "session-bounded" => "SB",
        "prefix-hash" => "PH",
        "prefix-affinity" => "PA",
        "prefix-affinity-spill-off" => "PA-off",
        "exact-residency" => "ER",
        "exact-residency-spec" => "ER-spec",
        other => other,
    }
}

/// The split of the maps' canvas: the title block, then the capacity panel and the fixed-rate
/// panel, each a header above a heatmap of `MAP_PX`.
const MAP_PX: u32 = 720;

/// Draws a map figure's two panels below its title: (a) capacity first, (b) the fixed-rate
/// view second. `a` and `b` draw each panel's body.
fn two_panels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    lines: &[String],
    (a_title, a_notes): (&str, &[String]),
    (b_title, b_notes): (&str, &[String]),
    a: impl FnOnce(&DrawingArea<DB, Shift>) -> Result<()>,
    b: impl FnOnce(&DrawingArea<DB, Shift>) -> Result<()>,
) -> Result<()> {
    let body = header(root, title, lines)?;
    let a_px = panel_header_px(panel_header_lines(a_title, a_notes.len())) + MAP_PX;
    let (top, bottom) = body.split_vertically(a_px);
    a(&panel_header(&top, a_title, a_notes)?)?;
    b(&panel_header(&bottom, b_title, b_notes)?)
}

/// Height of a map figure: the title block, both panels' headers and their heatmaps.
fn two_panel_height(lines: usize, a: (usize, usize), b: (usize, usize)) -> u32 {
    (50 + 21 * lines + 8) as u32 + panel_header_px(a) + panel_header_px(b) + 2 * MAP_PX
}

/// Figure 1 ready to draw.
pub struct PressureFigure<'a> {
    /// Its fixed-rate numbers (panel b).
    pub data: &'a PressureData,
    /// Its capacity numbers (panel a).
    pub capacity: &'a CapacityRatioData,
    /// Title context of the fixed-rate sweep.
    pub ctx: &'a Context,
    /// What set the fixed-rate sweep's load (`GridInput::drive`).
    pub drive: &'a str,
}

const FIG1_TITLE: &str = "Pressure map: prefix-affinity vs session-affinity";

impl PressureFigure<'_> {
    fn lines(&self) -> Vec<String> {
        vec![
            "(a) first: each policy's own capacity at the SLO; (b) second: goodput when both run at one rate per point"
                .to_string(),
        ]
    }

    fn a_title(&self) -> String {
        "(a) Capacity: prefix-affinity's own capacity ÷ session-affinity's (medians over plan seeds)"
            .to_string()
    }

    fn a_notes(&self) -> Vec<String> {
        let mut l = capacity_lines(&self.capacity.context, NOTE_CHARS);
        l.push(
            "cell: the report's ratio of medians and its verdict, then each side's capacity, req/s (model time): median [min–max] over seeds"
                .to_string(),
        );
        l
    }

    fn b_title(&self) -> String {
        format!(
            "(b) Secondary: prefix-affinity's goodput margin over session-affinity {}",
            self.drive
        )
    }

    fn b_notes(&self) -> Vec<String> {
        let mut l = context_lines(self.ctx, &self.data.reps.text());
        l.push(attainment_note());
        l
    }
}

impl Figure for PressureFigure<'_> {
    fn size(&self) -> (u32, u32) {
        let h = two_panel_height(
            self.lines().len(),
            panel_header_lines(&self.a_title(), self.a_notes().len()),
            panel_header_lines(&self.b_title(), self.b_notes().len()),
        );
        (1300, h)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        two_panels(
            root,
            FIG1_TITLE,
            &self.lines(),
            (&self.a_title(), &self.a_notes()),
            (&self.b_title(), &self.b_notes()),
            |area| self.capacity_panel(area),
            |area| self.fixed_rate_panel(area),
        )
    }
}

impl PressureFigure<'_> {
    fn capacity_panel<DB: DrawingBackend>(&self, body: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.capacity;
        let (w, _) = body.dim_in_pixel();
        let (grid, bar) = body.split_horizontally(w - 190);
        let log = |r: Option<f64>| r.filter(|r| *r > 0.0).map_or(0.0, f64::ln);
        let max = d
            .cells
            .iter()
            .map(|c| log(c.ratio).abs())
            .fold(0.0, f64::max);
        let cells: Vec<HeatCell> = d
            .cells
            .iter()
            .map(|c| HeatCell {
                col: index_of(&d.s_values, c.zipf_s),
                row: index_of(&d.ws_values, c.working_set_ratio),
                fill: diverging(log(c.ratio), max),
                lines: vec![
                    c.ratio
                        .map_or_else(|| "—".to_string(), |r| format!("×{r:.3}")),
                    c.verdict.as_str().to_string(),
                    format!("PA {}", capacity_text(c.prefix_affinity)),
                    format!("SA {}", capacity_text(c.session_affinity)),
                ],
                marking: Marking::of_capacity(c.verdict),
            })
            .collect();
        heatmap(&grid, &d.ws_values, &d.s_values, &cells, &[])?;
        colorbar(
            &bar,
            max,
            |v| format!("×{:.2}", v.exp()),
            &[
                "× session-affinity",
                "  (log scale)",
                "red: prefix-affinity",
                "  higher",
                "blue: session-affinity",
                "  higher",
                "hatched: within",
                "  spread or within",
                "  resolution",
                "dotted frame: too",
                "  few seeds or not",
                "  bracketed",
            ],
        )
    }

    fn fixed_rate_panel<DB: DrawingBackend>(&self, body: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let (w, _) = body.dim_in_pixel();
        let (grid, bar) = body.split_horizontally(w - 190);
        let max = d
            .cells
            .iter()
            .map(|c| c.margin_rps.abs())
            .fold(0.0, f64::max);
        let cells: Vec<HeatCell> = d
            .cells
            .iter()
            .map(|c| {
                let mut lines = vec![format!("{:+.2} req/s", c.margin_rps)];
                if let Some(r) = c.relative {
                    lines.push(format!("{:+.0} %", r * 100.0));
                }
                lines.push(verdict_line(c.verdict));
                lines.push(format!(
                    "SLO met: PA {} · SA {}",
                    percent(c.pa_attainment),
                    percent(c.sa_attainment)
                ));
                if c.below_pressure {
                    lines.push(BELOW_PRESSURE.to_string());
                }
                HeatCell {
                    col: index_of(&d.s_values, c.zipf_s),
                    row: index_of(&d.ws_values, c.working_set_ratio),
                    fill: diverging(c.margin_rps, max),
                    lines,
                    marking: Marking::of(c.verdict),
                }
            })
            .collect();
        heatmap(&grid, &d.ws_values, &d.s_values, &cells, &d.no_data)?;
        colorbar(
            &bar,
            max,
            |v| format!("{v:+.2}"),
            &[
                "req/s",
                "red: prefix-affinity",
                "  ahead",
                "blue: session-affinity",
                "  ahead",
                "hatched: within",
                "  spread (min–max",
                "  ranges overlap)",
                "dotted frame: too",
                "  few reps (< 2 on",
                "  a side, no spread)",
            ],
        )
    }
}

/// A diverging colour bar from −`max` to +`max` with its three values labelled by `label` and
/// `notes` below it.
fn colorbar<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    max: f64,
    label: impl Fn(f64) -> String,
    notes: &[&str],
) -> Result<()> {
    let (_, h) = area.dim_in_pixel();
    let (x0, x1, y0) = (20i32, 50i32, 30i32);
    let y1 = h as i32 - 40 - 20 * notes.len() as i32;
    let steps = (y1 - y0).max(1);
    for i in 0..steps {
        let v = max - 2.0 * max * f64::from(i) / f64::from(steps);
        area.draw(&Rectangle::new(
            [(x0, y0 + i), (x1, y0 + i + 1)],
            diverging(v, max).filled(),
        ))
        .map_err(de)?;
    }
    area.draw(&Rectangle::new([(x0, y0), (x1, y1)], INK.stroke_width(1)))
        .map_err(de)?;
    for (v, y) in [(max, y0), (0.0, (y0 + y1) / 2), (-max, y1)] {
        area.draw(&Text::new(
            label(v),
            (x1 + 6, y),
            style(14.0, &INK, HPos::Left, VPos::Center),
        ))
        .map_err(de)?;
    }
    for (i, l) in notes.iter().enumerate() {
        area.draw(&Text::new(
            *l,
            (4, y1 + 14 + 20 * i as i32),
            style(13.0, &MUTED, HPos::Left, VPos::Top),
        ))
        .map_err(de)?;
    }
    Ok(())
}

/// Figure 2 ready to draw.
pub struct WinnersFigure<'a> {
    /// Its fixed-rate numbers (panel b).
    pub data: &'a WinnersData,
    /// Its capacity numbers (panel a).
    pub capacity: &'a CapacityWinnersData,
    /// Title context of the fixed-rate sweep.
    pub ctx: &'a Context,
    /// What set the fixed-rate sweep's load (`GridInput::drive`).
    pub drive: &'a str,
}

const FIG2_TITLE: &str = "Winners map: the highest capacity, and the highest goodput at one rate";

/// Names per line where a cell lists tied policies.
const TIED_PER_LINE: usize = 4;

impl WinnersFigure<'_> {
    fn lines(&self) -> Vec<String> {
        vec![
            "(a) first: the policy with the highest median capacity at the SLO; (b) second: the highest median goodput when every policy runs at one rate per point"
                .to_string(),
        ]
    }

    fn a_title(&self) -> String {
        "(a) Capacity: the policy with the highest median own capacity, against session-affinity and the runner-up"
            .to_string()
    }

    fn a_notes(&self) -> Vec<String> {
        let mut l = capacity_lines(&self.capacity.context, NOTE_CHARS);
        l.push(
            "cell: winner, its capacity (req/s, model time: median [min–max]), its ratio to session-affinity (SA) and verdict, the runner-up and the verdict between the two"
                .to_string(),
        );
        l.push(
            "hatched: the winner does not separate from the runner-up (within spread or resolution), or several share the highest median; dotted frame: not every policy bracketed"
                .to_string(),
        );
        let mut seen: Vec<&str> = Vec::new();
        for c in &self.capacity.cells {
            if c.best.len() > 1 {
                for b in &c.best {
                    if !seen.contains(&b.as_str()) {
                        seen.push(b);
                    }
                }
            }
        }
        seen.sort_by_key(|p| crate::input::policy_rank(p));
        let named: Vec<String> = seen
            .iter()
            .filter(|p| short_policy(p) != **p)
            .map(|p| format!("{} {p}", short_policy(p)))
            .collect();
        if !named.is_empty() {
            l.extend(wrap(
                &format!("tied policies: {}", named.join(", ")),
                NOTE_CHARS,
            ));
        }
        l
    }

    fn b_title(&self) -> String {
        format!(
            "(b) Secondary: highest median goodput, with runner-up, {}",
            self.drive
        )
    }

    fn b_notes(&self) -> Vec<String> {
        let mut l = context_lines(self.ctx, &self.data.reps.text());
        l.push(
            "hatched: winner and runner-up within spread (no clear winner); dotted frame: too few reps to judge (under 2 reps on a side, so no spread)"
                .to_string(),
        );
        l.push(attainment_note());
        l
    }
}

impl Figure for WinnersFigure<'_> {
    fn size(&self) -> (u32, u32) {
        let h = two_panel_height(
            self.lines().len(),
            panel_header_lines(&self.a_title(), self.a_notes().len()),
            panel_header_lines(&self.b_title(), self.b_notes().len()),
        );
        (1300, h)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        two_panels(
            root,
            FIG2_TITLE,
            &self.lines(),
            (&self.a_title(), &self.a_notes()),
            (&self.b_title(), &self.b_notes()),
            |area| self.capacity_panel(area),
            |area| self.fixed_rate_panel(area),
        )
    }
}

impl WinnersFigure<'_> {
    fn capacity_panel<DB: DrawingBackend>(&self, body: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.capacity;
        let cells: Vec<HeatCell> = d
            .cells
            .iter()
            .map(|c| {
                let (fill, lines, marking) = match c.best.as_slice() {
                    [] => (
                        EMPTY_CELL,
                        vec![
                            "no winner:".to_string(),
                            "not every policy bracketed".to_string(),
                        ],
                        Marking::Dotted,
                    ),
                    [w] => {
                        let mut l = vec![w.clone(), format!("{} req/s", capacity_text(c.spread))];
                        l.push(if c.baseline_among_best {
                            "is session-affinity (the baseline)".to_string()
                        } else {
                            format!(
                                "{} SA: {}",
                                c.ratio
                                    .map_or_else(|| "—".to_string(), |r| format!("×{r:.3}")),
                                c.vs_baseline_text()
                            )
                        });
                        match &c.runner_up {
                            Some((ru, s)) => {
                                l.push(format!("runner-up: {ru} {:.3}", s.median));
                                l.push(c.verdict_text().to_string());
                            }
                            None => l.push("no runner-up".to_string()),
                        }
                        (
                            lighten(policy_color(w), 0.55),
                            l,
                            c.verdict.map_or(Marking::Dotted, Marking::of_capacity),
                        )
                    }
                    tied => {
                        let mut l = vec![format!("{} tied", tied.len())];
                        for chunk in tied.chunks(TIED_PER_LINE) {
                            l.push(
                                chunk
                                    .iter()
                                    .map(|p| short_policy(p))
                                    .collect::<Vec<_>>()
                                    .join(", "),
                            );
                        }
                        l.push(format!(
                            "{} req/s (median)",
                            c.median
                                .map_or_else(|| "—".to_string(), |m| format!("{m:.3}"))
                        ));
                        l.push(if c.baseline_among_best {
                            "session-affinity among them".to_string()
                        } else {
                            format!(
                                "{} SA: {}",
                                c.ratio
                                    .map_or_else(|| "—".to_string(), |r| format!("×{r:.3}")),
                                c.vs_baseline_text()
                            )
                        });
                        (RGBColor(240, 240, 240), l, Marking::Hatched)
                    }
                };
                HeatCell {
                    col: index_of(&d.s_values, c.zipf_s),
                    row: index_of(&d.ws_values, c.working_set_ratio),
                    fill,
                    lines,
                    marking,
                }
            })
            .collect();
        heatmap(body, &d.ws_values, &d.s_values, &cells, &[])
    }

    fn fixed_rate_panel<DB: DrawingBackend>(&self, body: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let cells: Vec<HeatCell> = d
            .cells
            .iter()
            .map(|c| HeatCell {
                col: index_of(&d.s_values, c.zipf_s),
                row: index_of(&d.ws_values, c.working_set_ratio),
                fill: lighten(policy_color(&c.winner), 0.55),
                lines: {
                    let mut l = vec![
                        c.winner.clone(),
                        format!(
                            "{:.2} req/s, SLO met {}",
                            c.winner_rps,
                            percent(c.winner_attainment)
                        ),
                        format!(
                            "runner-up: {} {:.2} ({})",
                            c.runner_up,
                            c.runner_up_rps,
                            percent(c.runner_up_attainment)
                        ),
                        verdict_line(c.verdict),
                    ];
                    if c.below_pressure {
                        l.push(BELOW_PRESSURE.to_string());
                    }
                    l
                },
                marking: Marking::of(c.verdict),
            })
            .collect();
        heatmap(body, &d.ws_values, &d.s_values, &cells, &d.no_data)
    }
}

fn pad_range(lo: f64, hi: f64, floor: f64, ceil: f64) -> (f64, f64) {
    let span = (hi - lo).max(0.05);
    ((lo - 0.12 * span).max(floor), (hi + 0.12 * span).min(ceil))
}

/// Figure 3 ready to draw.
pub struct MechanismFigure<'a> {
    /// Its numbers.
    pub data: &'a MechanismData,
    /// Title context.
    pub ctx: &'a Context,
}

impl Figure for MechanismFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (1200, 900)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let mut lines = context_lines(self.ctx, &d.reps.text());
        lines.push(
            "hit-rate difference = height above session-affinity (■) at the same point; bars: min–max over reps"
                .to_string(),
        );
        lines.extend(set_aside_note(&d.not_drawn));
        let body = header(
            root,
            "Mechanism: engine prefix-hit rate vs busiest replica's share, spill on vs off",
            &lines,
        )?;
        let (bx0, bx1) = pad_range(
            d.markers
                .iter()
                .map(|m| m.busiest_share.min)
                .fold(1.0, f64::min),
            d.markers
                .iter()
                .map(|m| m.busiest_share.max)
                .fold(0.0, f64::max),
            0.0,
            1.0,
        );
        let (hy0, hy1) = pad_range(
            d.markers
                .iter()
                .map(|m| m.prefix_hit_rate.min)
                .fold(1.0, f64::min),
            d.markers
                .iter()
                .map(|m| m.prefix_hit_rate.max)
                .fold(0.0, f64::max),
            0.0,
            1.0,
        );
        let mut chart = ChartBuilder::on(&body)
            .margin(25)
            .x_label_area_size(60)
            .y_label_area_size(80)
            .build_cartesian_2d(bx0..bx1, hy0..hy1)
            .map_err(de)?;
        let pct = |v: &f64| format!("{:.0} %", v * 100.0);
        quiet_mesh(
            chart
                .configure_mesh()
                .x_desc("busiest replica's share of requests")
                .y_desc("engine prefix-hit rate (cached ÷ prompt tokens)")
                .x_label_formatter(&pct)
                .y_label_formatter(&pct),
            15,
            17,
        )
        .draw()
        .map_err(de)?;
        // one path per point: reference → spill on → spill off
        let mut points: Vec<&str> = d.markers.iter().map(|m| m.point.as_str()).collect();
        points.dedup();
        for p in &points {
            let path: Vec<(f64, f64)> = d
                .markers
                .iter()
                .filter(|m| m.point == *p)
                .map(|m| (m.busiest_share.median, m.prefix_hit_rate.median))
                .collect();
            chart
                .draw_series(std::iter::once(PathElement::new(
                    path,
                    RGBColor(160, 160, 160).stroke_width(1),
                )))
                .map_err(de)?;
        }
        for role in [MechRole::Reference, MechRole::SpillOn, MechRole::SpillOff] {
            let ms: Vec<_> = d.markers.iter().filter(|m| m.role == role).collect();
            if ms.is_empty() {
                continue;
            }
            let color = policy_color(&ms[0].policy);
            for m in &ms {
                let (b, h) = (m.busiest_share, m.prefix_hit_rate);
                chart
                    .draw_series([
                        PathElement::new(
                            vec![(b.min, h.median), (b.max, h.median)],
                            color.stroke_width(2),
                        ),
                        PathElement::new(
                            vec![(b.median, h.min), (b.median, h.max)],
                            color.stroke_width(2),
                        ),
                    ])
                    .map_err(de)?;
            }
            let at =
                |m: &&crate::data::MechMarker| (m.busiest_share.median, m.prefix_hit_rate.median);
            let label = format!("{} ({})", role.as_str(), ms[0].policy);
            match role {
                MechRole::Reference => chart
                    .draw_series(ms.iter().map(|m| {
                        EmptyElement::at(at(m)) + Rectangle::new([(-6, -6), (6, 6)], color.filled())
                    }))
                    .map_err(de)?
                    .label(label)
                    .legend(move |(x, y)| {
                        Rectangle::new([(x - 6, y - 6), (x + 6, y + 6)], color.filled())
                    }),
                MechRole::SpillOn => chart
                    .draw_series(ms.iter().map(|m| Circle::new(at(m), 8, color.filled())))
                    .map_err(de)?
                    .label(label)
                    .legend(move |(x, y)| Circle::new((x, y), 7, color.filled())),
                MechRole::SpillOff => chart
                    .draw_series(
                        ms.iter()
                            .map(|m| TriangleMarker::new(at(m), 10, color.filled())),
                    )
                    .map_err(de)?
                    .label(label)
                    .legend(move |(x, y)| TriangleMarker::new((x, y), 9, color.filled())),
            };
        }
        let anchors: Vec<((i32, i32), String)> = d
            .markers
            .iter()
            .filter(|m| m.role == MechRole::SpillOn)
            .map(|m| {
                let (x, y) =
                    chart.backend_coord(&(m.busiest_share.median, m.prefix_hit_rate.median));
                ((x + 10, y - 8), m.point.clone())
            })
            .collect();
        place_labels(root, anchors, 14.0)?;
        legend(&mut chart, SeriesLabelPosition::LowerRight, 15)?;
        Ok(())
    }
}

/// Draws point labels left-anchored at their anchors, nudging each one up (then down) past
/// labels already placed so that none overlap.
fn place_labels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    labels: Vec<((i32, i32), String)>,
    size: f64,
) -> Result<()> {
    let st = style(size, &INK, HPos::Left, VPos::Bottom);
    let mut placed: Vec<(i32, i32, i32, i32)> = Vec::new();
    for ((x, y), text) in labels {
        let (w, h) = root.estimate_text_size(&text, &st).map_err(de)?;
        let (w, h) = (w as i32, h as i32 + 2);
        let free = |y: i32| {
            placed
                .iter()
                .all(|&(x0, y0, x1, y1)| x + w <= x0 || x >= x1 || y <= y0 || y - h >= y1)
        };
        let y = (0..40)
            .map(|k| {
                if k % 2 == 0 {
                    y - (k / 2) * h
                } else {
                    y + (k / 2 + 1) * h
                }
            })
            .find(|&y| free(y))
            .unwrap_or(y);
        placed.push((x, y - h, x + w, y));
        root.draw(&Rectangle::new(
            [(x - 2, y - h), (x + w + 2, y + 1)],
            WHITE.mix(0.75).filled(),
        ))
        .map_err(de)?;
        root.draw(&Text::new(text, (x, y), st.clone()))
            .map_err(de)?;
    }
    Ok(())
}

/// Group labels under a chart whose x axis counts groups (`i + 0.5` is group `i`'s centre).
fn group_labels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    at: impl Fn(f64) -> (i32, i32),
    labels: &[String],
) -> Result<()> {
    for (i, l) in labels.iter().enumerate() {
        let (x, y) = at(i as f64 + 0.5);
        root.draw(&Text::new(
            l.clone(),
            (x, y + 10),
            style(15.0, &INK, HPos::Center, VPos::Top),
        ))
        .map_err(de)?;
    }
    Ok(())
}

/// Figure 4 ready to draw.
pub struct LadderFigure<'a> {
    /// Its numbers.
    pub data: &'a LadderData,
    /// Title context.
    pub ctx: &'a Context,
}

impl Figure for LadderFigure<'_> {
    fn size(&self) -> (u32, u32) {
        let w = 500 + 260 * self.data.points.len() as u32;
        (w.clamp(1100, 2400), 850)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let mut lines = context_lines(self.ctx, &d.reps.text());
        lines.extend(set_aside_note(&d.not_drawn));
        let body = header(
            root,
            "Knowledge ladder: goodput by what the router knows about the caches",
            &lines,
        )?;
        let n = d.points.len() as f64;
        let top = d.bars.iter().map(|b| b.goodput.max).fold(0.0, f64::max);
        let ymax = if top > 0.0 { top * 1.18 } else { 1.0 };
        let mut chart = ChartBuilder::on(&body)
            .margin(25)
            .x_label_area_size(60)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..n, 0.0..ymax)
            .map_err(de)?;
        quiet_mesh(
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(0)
                .y_desc("goodput, req/s (median; bar: min–max over reps)"),
            15,
            17,
        )
        .draw()
        .map_err(de)?;
        let slot = 0.8 / LADDER.len() as f64;
        for (rung, (policy, label)) in LADDER.iter().enumerate() {
            let bars: Vec<_> = d.bars.iter().filter(|b| b.rung == rung).collect();
            if bars.is_empty() {
                continue;
            }
            let color = policy_color(policy);
            let x_of = |point: &str| {
                let i = d.points.iter().position(|p| p == point).unwrap_or(0) as f64;
                i + 0.1 + slot * rung as f64
            };
            chart
                .draw_series(bars.iter().map(|b| {
                    let x = x_of(&b.point);
                    Rectangle::new(
                        [(x + 0.01, 0.0), (x + slot - 0.01, b.goodput.median)],
                        color.filled(),
                    )
                }))
                .map_err(de)?
                .label(*label)
                .legend(move |(x, y)| {
                    Rectangle::new([(x - 7, y - 7), (x + 7, y + 7)], color.filled())
                });
            for b in &bars {
                let xc = x_of(&b.point) + slot / 2.0;
                let (g, cap) = (b.goodput, slot * 0.2);
                chart
                    .draw_series([
                        PathElement::new(vec![(xc, g.min), (xc, g.max)], INK.stroke_width(2)),
                        PathElement::new(
                            vec![(xc - cap, g.min), (xc + cap, g.min)],
                            INK.stroke_width(2),
                        ),
                        PathElement::new(
                            vec![(xc - cap, g.max), (xc + cap, g.max)],
                            INK.stroke_width(2),
                        ),
                    ])
                    .map_err(de)?;
                chart
                    .draw_series(std::iter::once(Text::new(
                        format!("{:.2}", g.median),
                        (xc, g.max + ymax * 0.01),
                        style(13.0, &INK, HPos::Center, VPos::Bottom),
                    )))
                    .map_err(de)?;
            }
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight, 15)?;
        group_labels(root, |x| chart.backend_coord(&(x, 0.0)), &d.points)
    }
}

/// Figure 5 ready to draw.
pub struct BeliefFigure<'a> {
    /// Its numbers.
    pub data: &'a BeliefData,
    /// Title context.
    pub ctx: &'a Context,
}

impl Figure for BeliefFigure<'_> {
    fn size(&self) -> (u32, u32) {
        // room for four labelled bars per point in the divergence panel
        let points = self
            .data
            .divergence
            .iter()
            .map(|b| b.point.as_str())
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u32;
        ((300 + 180 * points).clamp(1400, 2800), 1250)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let mut lines = context_lines(self.ctx, &d.reps.text());
        lines[2] = format!(
            "requests of all used reps pooled per cell · {}",
            self.ctx.slo_text()
        );
        let body = header(
            root,
            "Belief: how far the router's predicted match is from what the engine reused",
            &lines,
        )?;
        let (_, h) = body.dim_in_pixel();
        let (top, bottom) = body.split_vertically(h * 55 / 100);
        divergence_panel(root, &top, d)?;
        decay_panel(root, &bottom, d)
    }
}

fn panel_title<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    t: &str,
) -> Result<DrawingArea<DB, Shift>> {
    let (w, _) = area.dim_in_pixel();
    area.draw(&Text::new(
        t.to_string(),
        ((w / 2) as i32, 4),
        style(18.0, &INK, HPos::Center, VPos::Top),
    ))
    .map_err(de)?;
    Ok(area.split_vertically(28).1)
}

fn divergence_panel<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    area: &DrawingArea<DB, Shift>,
    d: &BeliefData,
) -> Result<()> {
    let area = panel_title(
        area,
        "(a) Divergence per request, never netted: over-prediction up, under-prediction down",
    )?;
    let mut points: Vec<String> = Vec::new();
    for b in &d.divergence {
        if !points.contains(&b.point) {
            points.push(b.point.clone());
        }
    }
    let over = d
        .divergence
        .iter()
        .filter_map(|b| b.over_tokens_mean)
        .fold(0.0, f64::max);
    let under = d
        .divergence
        .iter()
        .filter_map(|b| b.under_tokens_mean)
        .fold(0.0, f64::max);
    // each side gets at least a third of the other's height so its labels fit
    let side = over.max(under).max(1.0);
    let hi = over.max(side / 3.0) * 1.35;
    let lo = -under.max(side / 3.0) * 1.35;
    let mut chart = ChartBuilder::on(&area)
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..points.len() as f64, lo..hi)
        .map_err(de)?;
    let abs = |v: &f64| format!("{:.0}", v.abs());
    quiet_mesh(
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_label_formatter(&abs)
            .y_desc("mean size, tokens (label: requests / compared)"),
        14,
        16,
    )
    .draw()
    .map_err(de)?;
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, 0.0), (points.len() as f64, 0.0)],
            INK.stroke_width(1),
        )))
        .map_err(de)?;
    let slot = 0.8 / BELIEF_POLICIES.len() as f64;
    for (k, policy) in BELIEF_POLICIES.iter().enumerate() {
        let bars: Vec<_> = d
            .divergence
            .iter()
            .filter(|b| b.policy == *policy)
            .collect();
        if bars.is_empty() {
            continue;
        }
        let color = policy_color(policy);
        let x_of = |p: &str| {
            points.iter().position(|q| q == p).unwrap_or(0) as f64 + 0.1 + slot * k as f64
        };
        chart
            .draw_series(bars.iter().flat_map(|b| {
                let x = x_of(&b.point);
                [
                    Rectangle::new(
                        [
                            (x + 0.01, 0.0),
                            (x + slot - 0.01, b.over_tokens_mean.unwrap_or(0.0)),
                        ],
                        color.filled(),
                    ),
                    Rectangle::new(
                        [
                            (x + 0.01, 0.0),
                            (x + slot - 0.01, -b.under_tokens_mean.unwrap_or(0.0)),
                        ],
                        lighten(color, 0.6).filled(),
                    ),
                ]
            }))
            .map_err(de)?
            .label(*policy)
            .legend(move |(x, y)| Rectangle::new([(x - 7, y - 7), (x + 7, y + 7)], color.filled()));
        chart
            .draw_series(bars.iter().flat_map(|b| {
                let xc = x_of(&b.point) + slot / 2.0;
                [
                    Text::new(
                        format!("{}/{}", b.over_count, b.compared),
                        (xc, b.over_tokens_mean.unwrap_or(0.0) + hi * 0.02),
                        style(11.0, &INK, HPos::Center, VPos::Bottom),
                    ),
                    Text::new(
                        format!("{}/{}", b.under_count, b.compared),
                        (xc, -b.under_tokens_mean.unwrap_or(0.0) + lo * 0.02),
                        style(11.0, &INK, HPos::Center, VPos::Top),
                    ),
                ]
            }))
            .map_err(de)?;
    }
    chart
        .draw_series([
            Text::new(
                "over: predicted more than the engine reused",
                (0.02, hi * 0.97),
                style(13.0, &MUTED, HPos::Left, VPos::Top),
            ),
            Text::new(
                "under: the engine reused more than predicted",
                (0.02, lo * 0.97),
                style(13.0, &MUTED, HPos::Left, VPos::Bottom),
            ),
        ])
        .map_err(de)?;
    legend(&mut chart, SeriesLabelPosition::UpperRight, 14)?;
    group_labels(root, |x| chart.backend_coord(&(x, lo)), &points)
}

fn decay_panel<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    area: &DrawingArea<DB, Shift>,
    d: &BeliefData,
) -> Result<()> {
    let area = panel_title(
        area,
        "(b) Decay: share of prefix-affinity's predicted tokens the engine honoured, by time since the session was last served",
    )?;
    let nb = d.decay.iter().map(|k| k.band + 1).max().unwrap_or(1);
    let mut chart = ChartBuilder::on(&area)
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..nb as f64, 0.0..1.08)
        .map_err(de)?;
    let pct = |v: &f64| format!("{:.0} %", v * 100.0);
    quiet_mesh(
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_label_formatter(&pct)
            .y_desc("honoured share of predicted tokens"),
        14,
        16,
    )
    .draw()
    .map_err(de)?;
    let mut points: Vec<&str> = Vec::new();
    for k in &d.decay {
        if !points.contains(&k.point.as_str()) {
            points.push(&k.point);
        }
    }
    // colour by working set, marker by skew, so a grid's twelve lines stay tellable apart
    let ws_axis = distinct(d.decay.iter().filter_map(|k| k.working_set_ratio));
    let s_axis = distinct(d.decay.iter().filter_map(|k| k.zipf_s));
    for (i, p) in points.iter().enumerate() {
        let first = d
            .decay
            .iter()
            .find(|k| k.point == *p)
            .expect("listed from decay");
        let (color, shape) = match (first.working_set_ratio, first.zipf_s) {
            (Some(ws), Some(s)) => (
                SERIES[ws_axis.iter().position(|v| *v == ws).unwrap_or(0) % SERIES.len()],
                s_axis.iter().position(|v| *v == s).unwrap_or(0),
            ),
            _ => (SERIES[i % SERIES.len()], 0),
        };
        let xy: Vec<(f64, f64)> = d
            .decay
            .iter()
            .filter(|k| k.point == *p)
            .map(|k| (k.band as f64 + 0.5, k.honoured_share))
            .collect();
        chart
            .draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))
            .map_err(de)?
            .label(p.to_string())
            .legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(-10, 0), (10, 0)], color.stroke_width(2))
                    + marker(shape, color)
            });
        chart
            .draw_series(
                xy.iter()
                    .map(|&c| EmptyElement::at(c) + marker(shape, color)),
            )
            .map_err(de)?;
    }
    legend(&mut chart, SeriesLabelPosition::LowerLeft, 14)?;
    let labels: Vec<String> = d
        .band_edges
        .iter()
        .take(nb)
        .map(|(lo, hi)| band_label(*lo, *hi))
        .collect();
    group_labels(root, |x| chart.backend_coord(&(x, 0.0)), &labels)
}

fn distinct(values: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

/// A marker centred on its anchor: circle, triangle, square or diamond by `shape`.
fn marker<DB: DrawingBackend>(
    shape: usize,
    color: RGBColor,
) -> DynElement<'static, DB, (i32, i32)> {
    let style = color.filled();
    match shape % 6 {
        0 => Circle::new((0, 0), 5, style).into_dyn(),
        1 => TriangleMarker::new((0, 0), 7, style).into_dyn(),
        2 => Rectangle::new([(-5, -5), (5, 5)], style).into_dyn(),
        3 => Polygon::new(vec![(0, -7), (7, 0), (0, 7), (-7, 0)], style).into_dyn(),
        4 => Cross::new((0, 0), 6, color.stroke_width(3)).into_dyn(),
        _ => Circle::new((0, 0), 6, color.stroke_width(2)).into_dyn(),
    }
}

/// Figure 6 ready to draw.
pub struct TimelineFigure<'a> {
    /// Its numbers.
    pub data: &'a TimelineData,
    /// Title context.
    pub ctx: &'a Context,
}

impl Figure for TimelineFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (1400, 850)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let r = d.reps();
        let per = match d.rolling_s() {
            Some(w) => format!("per second, centred rolling mean over {} s", num(w)),
            None => "per second".to_string(),
        };
        let banded = r.max > 1
            && d.series
                .iter()
                .any(|s| s.rows.iter().any(|r| r.band.is_some()));
        let reps = if r.max <= 1 {
            format!("1 rep per policy, {per}")
        } else if r.min == r.max {
            format!("median of {} reps per policy, {per}", r.max)
        } else {
            format!("median of {}–{} reps per policy, {per}", r.min, r.max)
        };
        let mut lines = context_lines(self.ctx, &reps);
        lines.push(if banded {
            "band: min–max over repetitions · grey: the faulted replica is down (kill → restart)"
                .into()
        } else {
            "shaded: the faulted replica is down (kill → restart)".into()
        });
        let body = header(
            root,
            "Fault timeline: goodput per second through a replica kill and restart",
            &lines,
        )?;
        let rows = d.series.iter().flat_map(|s| s.rows.iter());
        let t0 = rows.clone().map(|r| r.t_s).fold(f64::INFINITY, f64::min);
        let t1 = rows
            .clone()
            .map(|r| r.t_s)
            .fold(f64::NEG_INFINITY, f64::max);
        let g = rows
            .map(|r| r.band.map_or(r.goodput_rps, |b| b.1.max(r.goodput_rps)))
            .fold(0.0, f64::max);
        let (t0, t1) = if t1 > t0 { (t0, t1) } else { (t0, t0 + 1.0) };
        // one shaded band per distinct outage; the policies it belongs to are named unless
        // every series shares it (the usual case: one kill, one restart)
        let mut outages: Vec<(Outage, Vec<&str>)> = Vec::new();
        for s in &d.series {
            for o in TimelineData::outages(s) {
                match outages.iter_mut().find(|(k, _)| *k == o) {
                    Some((_, who)) => who.push(&s.policy),
                    None => outages.push((o, vec![&s.policy])),
                }
            }
        }
        let mut marks: Vec<Mark> = Vec::new();
        for ((down, up), who) in &outages {
            let whose = if who.len() == d.series.len() {
                String::new()
            } else {
                format!(" ({})", who.join(", "))
            };
            marks.push(Mark::new(*down, format!("kill{whose}"), HPos::Right));
            if let Some(u) = up {
                marks.push(Mark::new(*u, format!("restart{whose}"), HPos::Left));
            }
        }
        let build = |ymax: f64| {
            ChartBuilder::on(&body)
                .margin(25)
                .x_label_area_size(60)
                .y_label_area_size(80)
                .build_cartesian_2d(t0..t1, 0.0..ymax)
                .map_err(de)
        };
        // the x mapping does not depend on the y range, so a first chart places the labels
        // and the real one gets enough headroom for however many label rows that took
        let lanes = {
            let probe = build(1.0)?;
            let (xs, ys) = probe.plotting_area().get_pixel_range();
            let lanes = place_marks(&body, &mut marks, |t| probe.backend_coord(&(t, 0.0)).0, xs)?;
            let plot_h = f64::from((ys.end - ys.start).max(1));
            (lanes, plot_h)
        };
        let (lane_count, plot_h) = lanes;
        let headroom_px = f64::from(MARK_TOP_PX + MARK_LANE_PX * lane_count as i32 + 8);
        let ymax = if g > 0.0 {
            (g * 1.15).max(g / (1.0 - (headroom_px / plot_h).min(0.6)))
        } else {
            1.0
        };
        let mut chart = build(ymax)?;
        quiet_mesh(
            chart
                .configure_mesh()
                .x_desc("time since the load started, s")
                .y_desc("goodput, req/s (requests meeting the SLO)"),
            15,
            17,
        )
        .draw()
        .map_err(de)?;
        for ((down, up), _) in &outages {
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(*down, 0.0), (up.unwrap_or(t1), ymax)],
                    RGBColor(120, 120, 120).mix(0.12).filled(),
                )))
                .map_err(de)?;
        }
        for m in &marks {
            let dx = if matches!(m.anchor, HPos::Right) {
                -6
            } else {
                6
            };
            chart
                .draw_series([DashedPathElement::new(
                    vec![(m.t_s, 0.0), (m.t_s, ymax)],
                    6,
                    4,
                    INK.stroke_width(1),
                )])
                .map_err(de)?;
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((m.t_s, ymax))
                        + Text::new(
                            m.label.clone(),
                            (dx, MARK_TOP_PX + MARK_LANE_PX * m.lane as i32),
                            style(14.0, &INK, m.anchor, VPos::Top),
                        ),
                ))
                .map_err(de)?;
        }
        if banded {
            for s in &d.series {
                let color = policy_color(&s.policy);
                let upper = s.rows.iter().filter_map(|r| r.band.map(|b| (r.t_s, b.1)));
                let lower = s
                    .rows
                    .iter()
                    .rev()
                    .filter_map(|r| r.band.map(|b| (r.t_s, b.0)));
                chart
                    .draw_series(std::iter::once(Polygon::new(
                        upper.chain(lower).collect::<Vec<_>>(),
                        color.mix(0.18).filled(),
                    )))
                    .map_err(de)?;
            }
        }
        for s in &d.series {
            let color = policy_color(&s.policy);
            chart
                .draw_series(LineSeries::new(
                    s.rows.iter().map(|r| (r.t_s, r.goodput_rps)),
                    color.stroke_width(2),
                ))
                .map_err(de)?
                .label(s.policy.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x - 10, y), (x + 10, y)], color.stroke_width(3))
                });
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight, 15)?;
        Ok(())
    }
}

/// Offset of the first row of fault-marker labels below the plot's top edge, px.
const MARK_TOP_PX: i32 = 6;
/// Height of one row of fault-marker labels, px.
const MARK_LANE_PX: i32 = 20;
/// Least horizontal gap between two labels in the same row, px.
const MARK_GAP_PX: i32 = 10;

/// A kill or restart marker on the fault timeline: where, its label, which side of the line
/// the label sits on, and the label row it was given.
struct Mark {
    t_s: f64,
    label: String,
    anchor: HPos,
    lane: usize,
}

impl Mark {
    fn new(t_s: f64, label: String, anchor: HPos) -> Self {
        Mark {
            t_s,
            label,
            anchor,
            lane: 0,
        }
    }
}

/// Gives every marker label a row so that no two labels overlap: each label keeps its
/// preferred side of its line unless that pushes it out of the plot (`plot_x`, pixels), then
/// takes the first row whose labels so far end left of it. Returns the number of rows used.
fn place_marks<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    marks: &mut [Mark],
    to_px: impl Fn(f64) -> i32,
    plot_x: std::ops::Range<i32>,
) -> Result<usize> {
    let mut spans: Vec<(i32, i32, usize)> = Vec::with_capacity(marks.len());
    for (i, m) in marks.iter_mut().enumerate() {
        let (w, _) = area
            .estimate_text_size(&m.label, &style(14.0, &INK, m.anchor, VPos::Top))
            .map_err(de)?;
        let (w, x) = (w as i32, to_px(m.t_s));
        let left_of = (x - 6 - w, x - 6);
        let right_of = (x + 6, x + 6 + w);
        let (span, anchor) = match m.anchor {
            HPos::Right if left_of.0 < plot_x.start => (right_of, HPos::Left),
            HPos::Right => (left_of, HPos::Right),
            _ if right_of.1 > plot_x.end && left_of.0 >= plot_x.start => (left_of, HPos::Right),
            _ => (right_of, HPos::Left),
        };
        m.anchor = anchor;
        spans.push((span.0, span.1, i));
    }
    spans.sort_by_key(|&(l, r, _)| (l, r));
    let mut lane_ends: Vec<i32> = Vec::new();
    for (l, r, i) in spans {
        let lane = match lane_ends.iter().position(|end| *end + MARK_GAP_PX <= l) {
            Some(k) => k,
            None => {
                lane_ends.push(i32::MIN);
                lane_ends.len() - 1
            }
        };
        lane_ends[lane] = r;
        marks[i].lane = lane;
    }
    Ok(lane_ends.len())
}

/// Figure 7 ready to draw.
pub struct LoadCurveFigure<'a> {
    /// Its numbers.
    pub data: &'a LoadCurveData,
    /// Title context.
    pub ctx: &'a Context,
}

/// The knee rule as figure 7's caption states it.
pub fn knee_caption() -> String {
    format!(
        "knee (ring, dashed line): the highest offered load up to which the policy's median SLO attainment stays ≥ {:.0}% — every lower rate meets it too",
        ATTAINMENT_TARGET * 100.0
    )
}

impl Figure for LoadCurveFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (1600, 900)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let mut lines = context_lines(self.ctx, &d.reps.text());
        lines.push(match d.capacity_rps {
            Some(c) => format!(
                "open-loop Poisson arrivals at fractions of the calibrated capacity, {} req/s of model time (= 1.0×); x: offered load in wall req/s, the unit of goodput",
                num(c)
            ),
            None => "open-loop Poisson arrivals; x: offered load in wall req/s, the unit of goodput"
                .into(),
        });
        lines.push(knee_caption());
        lines.extend(set_aside_note(&d.not_drawn));
        let body = header(
            root,
            "Load curve: goodput and SLO attainment against offered load",
            &lines,
        )?;
        let (left, right) = body.split_horizontally(800);
        let all = || d.series.iter().flat_map(|s| s.points.iter());
        let xmax = all()
            .map(|p| p.offered.offered_wall_rps)
            .fold(0.0, f64::max)
            * 1.08;
        let gmax = all().map(|p| p.goodput.max).fold(xmax / 1.08, f64::max) * 1.1;
        // Where the fraction labels go: each distinct offered rate once.
        let mut fractions: Vec<(f64, f64)> = Vec::new();
        for p in all() {
            if let Some(f) = p.offered.load_fraction
                && !fractions
                    .iter()
                    .any(|(x, _)| *x == p.offered.offered_wall_rps)
            {
                fractions.push((p.offered.offered_wall_rps, f));
            }
        }
        let x_desc = "offered load, req/s (wall)";

        // (a) goodput
        let left = panel_title(&left, "(a) Goodput: requests meeting the SLO per second")?;
        let mut chart = ChartBuilder::on(&left)
            .margin(20)
            .x_label_area_size(55)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..xmax, 0.0..gmax)
            .map_err(de)?;
        quiet_mesh(
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc("goodput, req/s (median; bar: min–max over reps)"),
            14,
            16,
        )
        .draw()
        .map_err(de)?;
        chart
            .draw_series([DashedPathElement::new(
                vec![(0.0, 0.0), (xmax.min(gmax), xmax.min(gmax))],
                6,
                4,
                MUTED.stroke_width(1),
            )])
            .map_err(de)?
            .label("goodput = offered load")
            .legend(|(x, y)| {
                DashedPathElement::new(vec![(x - 10, y), (x + 10, y)], 4, 3, MUTED.stroke_width(1))
            });
        self.curves(&mut chart, |p| p.goodput)?;
        legend(&mut chart, SeriesLabelPosition::UpperLeft, 14)?;

        // (b) attainment
        let right = panel_title(&right, "(b) SLO attainment: share of measured requests")?;
        let mut chart = ChartBuilder::on(&right)
            .margin(20)
            .x_label_area_size(55)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..xmax, 0.0..1.05)
            .map_err(de)?;
        let pct = |v: &f64| format!("{:.0} %", v * 100.0);
        quiet_mesh(
            chart
                .configure_mesh()
                .y_label_formatter(&pct)
                .x_desc(x_desc)
                .y_desc("SLO attainment (median; bar: min–max over reps)"),
            14,
            16,
        )
        .draw()
        .map_err(de)?;
        chart
            .draw_series([DashedPathElement::new(
                vec![(0.0, ATTAINMENT_TARGET), (xmax, ATTAINMENT_TARGET)],
                6,
                4,
                INK.stroke_width(1),
            )])
            .map_err(de)?
            .label(format!("target {:.0} %", ATTAINMENT_TARGET * 100.0))
            .legend(|(x, y)| {
                DashedPathElement::new(vec![(x - 10, y), (x + 10, y)], 4, 3, INK.stroke_width(1))
            });
        for s in &d.series {
            if let Some(k) = s.knee_wall_rps {
                let color = policy_color(&s.policy);
                chart
                    .draw_series([DashedPathElement::new(
                        vec![(k, 0.0), (k, 1.05)],
                        5,
                        4,
                        color.stroke_width(2),
                    )])
                    .map_err(de)?;
            }
        }
        self.curves(&mut chart, |p| p.attainment)?;
        chart
            .draw_series(fractions.iter().map(|(x, f)| {
                // as point names write a fraction: at least one decimal
                let f = if (f * 10.0).fract() == 0.0 {
                    format!("{f:.1}")
                } else {
                    num(*f)
                };
                EmptyElement::at((*x, 0.0))
                    + Text::new(
                        format!("{f}× capacity"),
                        (5, -6),
                        style(13.0, &MUTED, HPos::Left, VPos::Bottom),
                    )
            }))
            .map_err(de)?;
        legend(&mut chart, SeriesLabelPosition::LowerLeft, 14)
    }
}

impl LoadCurveFigure<'_> {
    /// Each policy's medians as a line with markers and min–max bars, its knee ringed.
    fn curves<'c, DB: DrawingBackend + 'c>(
        &self,
        chart: &mut ChartContext<'c, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
        value: impl Fn(&crate::data::LoadPoint) -> analysis::stats::Spread,
    ) -> Result<()> {
        for s in &self.data.series {
            let color = policy_color(&s.policy);
            // The marker follows the policy, not the series' position, so a policy keeps its
            // marker whichever others a sweep compared.
            let i = crate::input::policy_rank(&s.policy);
            let xy: Vec<(f64, f64)> = s
                .points
                .iter()
                .map(|p| (p.offered.offered_wall_rps, value(p).median))
                .collect();
            chart
                .draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))
                .map_err(de)?
                .label(s.policy.clone())
                .legend(move |(x, y)| {
                    EmptyElement::at((x, y))
                        + PathElement::new(vec![(-10, 0), (10, 0)], color.stroke_width(2))
                        + marker(i, color)
                });
            chart
                .draw_series(xy.iter().map(|&c| EmptyElement::at(c) + marker(i, color)))
                .map_err(de)?;
            chart
                .draw_series(s.points.iter().map(|p| {
                    let (x, v) = (p.offered.offered_wall_rps, value(p));
                    PathElement::new(vec![(x, v.min), (x, v.max)], color.stroke_width(2))
                }))
                .map_err(de)?;
            if let Some(p) = s
                .points
                .iter()
                .find(|p| Some(p.offered.offered_wall_rps) == s.knee_wall_rps)
            {
                chart
                    .draw_series(std::iter::once(Circle::new(
                        (p.offered.offered_wall_rps, value(p).median),
                        11,
                        color.stroke_width(2),
                    )))
                    .map_err(de)?;
            }
        }
        Ok(())
    }
}

/// Figure 8 ready to draw.
pub struct RoutersFigure<'a> {
    /// Its numbers.
    pub data: &'a RoutersData,
    /// Title context.
    pub ctx: &'a Context,
}

impl Figure for RoutersFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (1600, 900)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let mut lines = context_lines(self.ctx, &d.reps.text());
        lines.push(format!(
            "point {}: N kvroute routers behind HAProxy, every router running the same policy over the same fleet; N = 1: one router behind the same front (or without a front where that was not run)",
            d.point
        ));
        lines.push(
            "line style: the arm (solid: round-robin front; dashed: session-hash front; dotted: + shared decisions, square markers behind round-robin, diamonds behind session-hash;"
                .into(),
        );
        lines.push(
            "long dashes: + shared decisions and loads, crosses behind round-robin, rings behind session-hash)"
                .into(),
        );
        lines.extend(set_aside_note(&d.not_drawn));
        let body = header(
            root,
            "N routers: what each policy keeps when several routers share a fleet",
            &lines,
        )?;
        let (left, right) = body.split_horizontally(800);
        let nmax = d
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.routers))
            .max()
            .unwrap_or(1);
        let xmax = f64::from(nmax).log2().max(1.0);
        let x_of = |n: u32| f64::from(n).log2();
        let n_label = |x: &f64| format!("{}", 2f64.powf(*x).round() as u64);
        let x_desc = "routers N (log scale)";

        let left = panel_title(&left, "(a) Engine prefix-hit rate")?;
        let mut chart = ChartBuilder::on(&left)
            .margin(20)
            .x_label_area_size(55)
            .y_label_area_size(80)
            .build_cartesian_2d(-0.15..xmax + 0.15, 0.0..1.05)
            .map_err(de)?;
        let pct = |v: &f64| format!("{:.0} %", v * 100.0);
        quiet_mesh(
            chart
                .configure_mesh()
                .x_labels(nmax.ilog2() as usize + 1)
                .x_label_formatter(&n_label)
                .y_label_formatter(&pct)
                .x_desc(x_desc)
                .y_desc("prefix-hit rate (median; bar: min–max over reps)"),
            14,
            16,
        )
        .draw()
        .map_err(de)?;
        self.lines(&mut chart, &x_of, |p| p.hit_rate)?;
        legend(&mut chart, SeriesLabelPosition::LowerLeft, 13)?;

        let right = panel_title(&right, "(b) Goodput: requests meeting the SLO per second")?;
        let gmax = d
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.goodput.max))
            .fold(0.0, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(&right)
            .margin(20)
            .x_label_area_size(55)
            .y_label_area_size(80)
            .build_cartesian_2d(-0.15..xmax + 0.15, 0.0..gmax.max(1.0))
            .map_err(de)?;
        quiet_mesh(
            chart
                .configure_mesh()
                .x_labels(nmax.ilog2() as usize + 1)
                .x_label_formatter(&n_label)
                .x_desc(x_desc)
                .y_desc("goodput, req/s (median; bar: min–max over reps)"),
            14,
            16,
        )
        .draw()
        .map_err(de)?;
        self.lines(&mut chart, &x_of, |p| p.goodput)?;
        Ok(())
    }
}

impl RoutersFigure<'_> {
    /// Each series' medians as a line (style by arm) with markers and min–max bars.
    fn lines<'c, DB: DrawingBackend + 'c>(
        &self,
        chart: &mut ChartContext<'c, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
        x_of: &dyn Fn(u32) -> f64,
        value: impl Fn(&crate::data::RoutersPoint) -> analysis::stats::Spread,
    ) -> Result<()> {
        for s in &self.data.series {
            let color = policy_color(&s.policy);
            let xy: Vec<(f64, f64)> = s
                .points
                .iter()
                .map(|p| (x_of(p.routers), value(p).median))
                .collect();
            let label = format!("{} · {}", s.policy, s.arm);
            let arm = s.arm_index;
            let anno = match arm.min(4) {
                0 => chart
                    .draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))
                    .map_err(de)?,
                1 => chart
                    .draw_series([DashedPathElement::new(
                        xy.clone(),
                        9,
                        6,
                        color.stroke_width(2),
                    )])
                    .map_err(de)?,
                4 => chart
                    .draw_series([DashedPathElement::new(
                        xy.clone(),
                        16,
                        4,
                        color.stroke_width(3),
                    )])
                    .map_err(de)?,
                _ => chart
                    .draw_series([DashedPathElement::new(
                        xy.clone(),
                        2,
                        5,
                        color.stroke_width(3),
                    )])
                    .map_err(de)?,
            };
            anno.label(label).legend(move |(x, y)| {
                let line: DynElement<'static, DB, (i32, i32)> = match arm.min(4) {
                    0 => {
                        PathElement::new(vec![(-12, 0), (12, 0)], color.stroke_width(2)).into_dyn()
                    }
                    1 => {
                        DashedPathElement::new(vec![(-12, 0), (12, 0)], 6, 4, color.stroke_width(2))
                            .into_dyn()
                    }
                    4 => DashedPathElement::new(
                        vec![(-12, 0), (12, 0)],
                        10,
                        3,
                        color.stroke_width(3),
                    )
                    .into_dyn(),
                    _ => {
                        DashedPathElement::new(vec![(-12, 0), (12, 0)], 2, 4, color.stroke_width(3))
                            .into_dyn()
                    }
                };
                EmptyElement::at((x, y)) + line + marker(arm, color)
            });
            chart
                .draw_series(xy.iter().map(|&c| EmptyElement::at(c) + marker(arm, color)))
                .map_err(de)?;
            chart
                .draw_series(s.points.iter().map(|p| {
                    let (x, v) = (x_of(p.routers), value(p));
                    PathElement::new(vec![(x, v.min), (x, v.max)], color.stroke_width(2))
                }))
                .map_err(de)?;
        }
        Ok(())
    }
}

/// Which of a trace bar's numbers a panel of figure 9 draws.
type TraceValue = fn(&crate::data::TraceBar) -> analysis::stats::Spread;

/// Figure 9 ready to draw.
pub struct TraceFigure<'a> {
    /// Its numbers.
    pub data: &'a TraceData,
    /// Title context.
    pub ctx: &'a Context,
}

impl Figure for TraceFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (1800, (300 + 52 * self.data.bars.len() as u32).max(850))
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let mut lines = context_lines(self.ctx, &d.reps.text());
        lines.push(format!(
            "point {}: every policy replays the same requests at the trace's own arrival times (open loop); bar: median, whisker: min–max over reps; (overloaded): a repetition's backlog grew through the window",
            d.point
        ));
        lines.extend(set_aside_note(&d.not_drawn));
        let body = header(
            root,
            "Trace replay: what each policy delivers on a production trace",
            &lines,
        )?;
        let (w, _) = body.dim_in_pixel();
        let label_w = 300;
        let (labels, rest) = body.split_horizontally(label_w);
        let panel_w = (w - label_w) / 3;
        let (a, rest) = rest.split_horizontally(panel_w);
        let (b, c) = rest.split_horizontally(panel_w);
        let n = d.bars.len();
        let gmax = d.bars.iter().map(|b| b.goodput.max).fold(0.0, f64::max) * 1.2;
        let panels: [(_, &str, f64, bool, TraceValue); 3] = [
            (a, "(a) Goodput, req/s", gmax.max(1.0), false, |b| b.goodput),
            (b, "(b) SLO attainment", 1.1, true, |b| b.attainment),
            (c, "(c) Engine prefix-hit rate", 1.1, true, |b| b.hit_rate),
        ];
        let mut rows_px: Vec<i32> = Vec::new();
        for (i, (area, title, xmax, share, value)) in panels.into_iter().enumerate() {
            let area = panel_title(&area, title)?;
            let mut chart = ChartBuilder::on(&area)
                .margin(15)
                .x_label_area_size(45)
                .y_label_area_size(0)
                .build_cartesian_2d(0.0..xmax, 0.0..n as f64)
                .map_err(de)?;
            let pct = |v: &f64| format!("{:.0} %", v * 100.0);
            let plain = |v: &f64| num((v * 100.0).round() / 100.0);
            let mut mesh = chart.configure_mesh();
            mesh.disable_y_mesh().y_labels(0);
            if share {
                mesh.x_label_formatter(&pct);
            } else {
                mesh.x_label_formatter(&plain);
            }
            quiet_mesh(&mut mesh, 13, 15).draw().map_err(de)?;
            if i == 1 {
                chart
                    .draw_series([DashedPathElement::new(
                        vec![(ATTAINMENT_TARGET, 0.0), (ATTAINMENT_TARGET, n as f64)],
                        6,
                        4,
                        INK.stroke_width(1),
                    )])
                    .map_err(de)?;
            }
            for (k, bar) in d.bars.iter().enumerate() {
                // the first policy on top
                let y = (n - 1 - k) as f64;
                let v = value(bar);
                let color = policy_color(&bar.policy);
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(0.0, y + 0.18), (v.median, y + 0.82)],
                        color.filled(),
                    )))
                    .map_err(de)?;
                chart
                    .draw_series([
                        PathElement::new(
                            vec![(v.min, y + 0.5), (v.max, y + 0.5)],
                            INK.stroke_width(2),
                        ),
                        PathElement::new(
                            vec![(v.min, y + 0.3), (v.min, y + 0.7)],
                            INK.stroke_width(2),
                        ),
                        PathElement::new(
                            vec![(v.max, y + 0.3), (v.max, y + 0.7)],
                            INK.stroke_width(2),
                        ),
                    ])
                    .map_err(de)?;
                let text = if share {
                    format!("{:.1} %", v.median * 100.0)
                } else {
                    format!("{:.2}", v.median)
                };
                chart
                    .draw_series(std::iter::once(Text::new(
                        text,
                        (v.max + xmax * 0.01, y + 0.5),
                        style(13.0, &INK, HPos::Left, VPos::Center),
                    )))
                    .map_err(de)?;
                if i == 0 {
                    rows_px.push(chart.backend_coord(&(0.0, y + 0.5)).1);
                }
            }
        }
        let (_, oy) = labels.get_base_pixel();
        for (bar, y) in d.bars.iter().zip(rows_px) {
            let name = if bar.overloaded {
                format!("{} (overloaded)", bar.policy)
            } else {
                bar.policy.clone()
            };
            labels
                .draw(&Text::new(
                    name,
                    (label_w as i32 - 10, y - oy),
                    style(15.0, &INK, HPos::Right, VPos::Center),
                ))
                .map_err(de)?;
        }
        Ok(())
    }
}

/// Figure 10 ready to draw.
pub struct CapacityFigure<'a> {
    /// Its numbers.
    pub data: &'a PolicyCapacityData,
}

/// Width of one point's panel in figure 10, px: policy names, bars, labels.
const CAP_NAMES_PX: u32 = 190;
const CAP_BARS_PX: u32 = 400;
const CAP_LABELS_PX: u32 = 230;
/// Height of one policy's bar row in figure 10, px.
const CAP_ROW_PX: u32 = 30;
/// A panel's title, x-axis and margins in figure 10, px.
const CAP_PANEL_EXTRA_PX: u32 = 100;

impl CapacityFigure<'_> {
    fn lines(&self) -> Vec<String> {
        let c = &self.data.context;
        let mut l = capacity_lines(c, WIDE_NOTE_CHARS);
        l.push(format!(
            "bar: median over seeds, whisker: min–max; {b}'s bar outlined and its median dashed across the panel (the reference); label: median req/s, × {b} (ratio of medians) and the report's verdict",
            b = c.baseline
        ));
        l.push(format!(
            "verdicts: separates = seed ranges apart and medians more than {r}% apart; within resolution = ranges apart by less; within spread = ranges overlap; best = the highest median at the point",
            r = num(c.resolution * 100.0)
        ));
        l
    }

    fn rows(&self) -> usize {
        self.data
            .panels
            .iter()
            .map(|p| p.bars.len())
            .max()
            .unwrap_or(1)
    }

    fn panel_px(&self) -> (u32, u32) {
        (
            CAP_NAMES_PX + CAP_BARS_PX + CAP_LABELS_PX,
            CAP_PANEL_EXTRA_PX + CAP_ROW_PX * self.rows() as u32,
        )
    }
}

impl Figure for CapacityFigure<'_> {
    fn size(&self) -> (u32, u32) {
        let (pw, ph) = self.panel_px();
        let cols = self.data.s_values.len() as u32;
        let rows = self.data.ws_values.len() as u32;
        let head = (50 + 21 * self.lines().len() + 8) as u32;
        ((40 + cols * pw).max(1300), (head + rows * ph + 20).max(850))
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        let d = self.data;
        let body = header(
            root,
            "Policy capacity: each policy's own capacity at the SLO, per point",
            &self.lines(),
        )?;
        let (pw, ph) = self.panel_px();
        let ny = d.ws_values.len();
        for p in &d.panels {
            let col = index_of(&d.s_values, p.zipf_s) as i32;
            // the largest working set on top, as in the maps
            let row = (ny - 1 - index_of(&d.ws_values, p.working_set_ratio)) as i32;
            let x0 = 20 + col * pw as i32;
            let y0 = row * ph as i32;
            let area = body.clone().shrink((x0, y0), (pw, ph));
            self.panel(&area, p, row as usize + 1 == ny)?;
        }
        Ok(())
    }
}

impl CapacityFigure<'_> {
    fn panel<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        p: &crate::data::CapacityPanel,
        bottom: bool,
    ) -> Result<()> {
        let title = format!(
            "{} · working set {}× · skew {}",
            p.point,
            num(p.working_set_ratio),
            num(p.zipf_s)
        );
        let area = panel_title(area, &title)?;
        let (names, rest) = area.split_horizontally(CAP_NAMES_PX);
        let (bars, labels) = rest.split_horizontally(CAP_BARS_PX);
        let n = self.rows();
        let xmax = p
            .bars
            .iter()
            .filter_map(|b| b.spread.map(|s| s.max))
            .fold(0.0, f64::max)
            * 1.08;
        let mut chart = ChartBuilder::on(&bars)
            .margin_top(4)
            .margin_bottom(6)
            .margin_left(6)
            .margin_right(10)
            .x_label_area_size(if bottom { 44 } else { 26 })
            .y_label_area_size(0)
            .build_cartesian_2d(0.0..xmax.max(0.1), 0.0..n as f64)
            .map_err(de)?;
        let plain = |v: &f64| num((v * 100.0).round() / 100.0);
        let mut mesh = chart.configure_mesh();
        mesh.disable_y_mesh()
            .y_labels(0)
            .x_labels(5)
            .x_label_formatter(&plain);
        if bottom {
            mesh.x_desc("capacity, req/s (model time)");
        }
        quiet_mesh(&mut mesh, 12, 14).draw().map_err(de)?;
        let reference = p
            .bars
            .iter()
            .find(|b| b.is_reference())
            .and_then(|b| b.spread);
        if let Some(r) = reference {
            chart
                .draw_series([DashedPathElement::new(
                    vec![(r.median, 0.0), (r.median, n as f64)],
                    5,
                    4,
                    INK.stroke_width(1),
                )])
                .map_err(de)?;
        }
        let (_, names_y0) = names.get_base_pixel();
        let (_, labels_y0) = labels.get_base_pixel();
        for (k, b) in p.bars.iter().enumerate() {
            // the first policy on top
            let y = (n - 1 - k) as f64;
            let row_px = chart.backend_coord(&(0.0, y + 0.5)).1;
            if let Some(v) = b.spread {
                let color = policy_color(&b.policy);
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(0.0, y + 0.18), (v.median, y + 0.82)],
                        color.filled(),
                    )))
                    .map_err(de)?;
                if b.is_reference() {
                    chart
                        .draw_series(std::iter::once(Rectangle::new(
                            [(0.0, y + 0.18), (v.median, y + 0.82)],
                            INK.stroke_width(2),
                        )))
                        .map_err(de)?;
                }
                chart
                    .draw_series([
                        PathElement::new(
                            vec![(v.min, y + 0.5), (v.max, y + 0.5)],
                            INK.stroke_width(2),
                        ),
                        PathElement::new(
                            vec![(v.min, y + 0.3), (v.min, y + 0.7)],
                            INK.stroke_width(2),
                        ),
                        PathElement::new(
                            vec![(v.max, y + 0.3), (v.max, y + 0.7)],
                            INK.stroke_width(2),
                        ),
                    ])
                    .map_err(de)?;
            }
            names
                .draw(&Text::new(
                    b.policy.clone(),
                    (CAP_NAMES_PX as i32 - 8, row_px - names_y0),
                    style(14.0, &INK, HPos::Right, VPos::Center),
                ))
                .map_err(de)?;
            let (text, color) = capacity_label(b);
            labels
                .draw(&Text::new(
                    text,
                    (4, row_px - labels_y0),
                    style(13.0, &color, HPos::Left, VPos::Center),
                ))
                .map_err(de)?;
        }
        Ok(())
    }
}

/// A bar's label in figure 10 and its colour (ink where it separates from the reference or is
/// the reference, muted otherwise).
fn capacity_label(b: &crate::data::CapacityBar) -> (String, RGBColor) {
    let Some(s) = b.spread else {
        return ("not bracketed".to_string(), MUTED);
    };
    let best = if b.best { " · best" } else { "" };
    match (b.ratio, b.verdict) {
        (_, None) => (format!("{:.3}  reference{best}", s.median), INK),
        (ratio, Some(v)) => (
            format!(
                "{:.3}  {} {}{best}",
                s.median,
                ratio.map_or_else(|| "—".to_string(), |r| format!("×{r:.3}")),
                v.as_str()
            ),
            if v == CapacityVerdict::Separates {
                INK
            } else {
                MUTED
            },
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(marks: &[Mark], area: &DrawingArea<BitMapBackend, Shift>) -> Vec<(usize, i32, i32)> {
        marks
            .iter()
            .map(|m| {
                let (w, _) = area
                    .estimate_text_size(&m.label, &style(14.0, &INK, m.anchor, VPos::Top))
                    .expect("measurable");
                let x = (m.t_s * 30.0) as i32;
                match m.anchor {
                    HPos::Right => (m.lane, x - 6 - w as i32, x - 6),
                    _ => (m.lane, x + 6, x + 6 + w as i32),
                }
            })
            .collect()
    }

    #[test]
    fn marker_labels_at_close_times_get_separate_rows_and_stay_inside() {
        font::ensure_registered().expect("font");
        let mut buf = vec![0u8; 1400 * 100 * 3];
        let area = BitMapBackend::with_buffer(&mut buf, (1400, 100)).into_drawing_area();
        // two outages a second apart, with restarts at the same instant: the published case
        let mut marks = vec![
            Mark::new(
                13.0,
                "kill (prefix-affinity, prefix-affinity-spill-off)".into(),
                HPos::Right,
            ),
            Mark::new(
                24.0,
                "restart (prefix-affinity, prefix-affinity-spill-off)".into(),
                HPos::Left,
            ),
            Mark::new(14.0, "kill (session-affinity)".into(), HPos::Right),
            Mark::new(24.0, "restart (session-affinity)".into(), HPos::Left),
        ];
        let rows = place_marks(&area, &mut marks, |t| (t * 30.0) as i32, 0..1400).expect("placed");
        assert_eq!(rows, 2);
        let s = spans(&marks, &area);
        for (i, a) in s.iter().enumerate() {
            assert!(a.1 >= 0 && a.2 <= 1400, "label {i} leaves the plot: {a:?}");
            for b in &s[i + 1..] {
                let apart = a.2 + MARK_GAP_PX <= b.1 || b.2 + MARK_GAP_PX <= a.1;
                assert!(
                    a.0 != b.0 || apart,
                    "labels overlap in one row: {a:?} {b:?}"
                );
            }
        }
        // so near the left edge that a left-side label would leave the plot
        let mut edge = vec![Mark::new(0.2, "kill".into(), HPos::Right)];
        place_marks(&area, &mut edge, |t| (t * 30.0) as i32, 0..1400).expect("placed");
        assert!(
            matches!(edge[0].anchor, HPos::Left),
            "flipped inside the plot"
        );
        let e = spans(&edge, &area)[0];
        assert!(e.1 >= 0 && e.2 <= 1400, "edge label leaves the plot: {e:?}");
    }
}
