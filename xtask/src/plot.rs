//! The loss curve as a PNG (plotters, bitmap backend; text with a system TrueType font when
//! one is found, else an unlabeled chart).

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow};
use plotters::prelude::*;

/// Common locations of a sans-serif TrueType font on Linux.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Registers the first font found as plotters' "sans-serif"; returns whether one was.
fn register_font() -> bool {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REGISTERED.get_or_init(|| {
        for path in FONT_CANDIDATES.iter().map(PathBuf::from) {
            if let Ok(bytes) = std::fs::read(&path) {
                // plotters keeps the font for the whole process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// Draws `series` (name, (step, loss) points) into a PNG at `path`.
pub fn loss_png(path: &Path, title: &str, series: &[(&str, Vec<(f64, f64)>)]) -> Result<()> {
    let labeled = register_font();
    let points = series.iter().flat_map(|(_, s)| s.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        if y.is_finite() {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
    }
    if x0 > x1 {
        return Err(anyhow!("{}: no finite loss to plot", path.display()));
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if labeled {
        builder.caption(title, ("sans-serif", 22)).x_label_area_size(40).y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, y0..y1).map_err(|e| err(&e))?;
    let mut mesh = chart.configure_mesh();
    if labeled {
        mesh.x_desc("step").y_desc("loss");
    } else {
        mesh.disable_x_mesh().disable_y_mesh().x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| err(&e))?;
    // The first series (this run) is drawn last and thin, on top of wide, pale references, so
    // that identical curves stay visible.
    let colors = [RED, BLUE, GREEN, MAGENTA];
    for (i, (name, s)) in series.iter().enumerate().rev() {
        let color = colors[i % colors.len()];
        let style = if i == 0 { color.stroke_width(2) } else { color.mix(0.35).stroke_width(7) };
        let drawn = chart.draw_series(LineSeries::new(s.iter().copied(), style)).map_err(|e| err(&e))?;
        if labeled {
            drawn.label(*name).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
    }
    if labeled {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
