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

/// A tick spacing of 1, 2 or 5 × 10^k that cuts `span` into about `n` intervals.
fn nice_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * magnitude).find(|s| *s >= raw).unwrap_or(10.0 * magnitude)
}

/// The y axis for losses in `lo..=hi`: bounds on whole ticks around them, and the tick.
fn y_axis(lo: f64, hi: f64) -> (f64, f64, f64) {
    let step = nice_step((hi - lo).max(1e-3), 6.0);
    let (a, b) = ((lo / step).floor() * step, (hi / step).ceil() * step);
    (a, if b > a { b } else { a + step }, step)
}

/// Draws `series` (name, (step, loss) points) into a PNG at `path`. Steps are integers on
/// the x axis; the y axis starts and ends on a tick, so every point lies between labelled
/// values.
pub fn loss_png(path: &Path, title: &str, series: &[(String, Vec<(f64, f64)>)]) -> Result<()> {
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
    // The y range widened to whole ticks, so the first (highest) loss is not above the top
    // label.
    let (y0, y1, y_step) = y_axis(y0, y1);
    let y_labels = ((y1 - y0) / y_step).round() as usize + 1;
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    // Integer steps: at most one label per step.
    let x_labels = ((x1 - x0).round() as usize + 1).min(11);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if labeled {
        builder.caption(title, ("sans-serif", 22)).x_label_area_size(40).y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, y0..y1).map_err(|e| err(&e))?;
    let int = |x: &f64| format!("{}", x.round() as i64);
    let decimals = (-y_step.log10().floor()).max(0.0) as usize;
    let y_fmt = |y: &f64| format!("{y:.decimals$}");
    let mut mesh = chart.configure_mesh();
    if labeled {
        mesh.x_desc("step").y_desc("loss").x_labels(x_labels).x_label_formatter(&int);
        mesh.y_labels(y_labels).y_label_formatter(&y_fmt);
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
            drawn
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
    }
    if labeled {
        chart
            .configure_series_labels()
            // Losses fall: the upper right is where the curves are not.
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_y_axis_ends_on_ticks_around_every_loss() {
        for (lo, hi) in [(2.05, 6.263), (6.2, 6.2), (0.0012, 0.0049), (10.5, 11.93)] {
            let (a, b, step) = y_axis(lo, hi);
            assert!(a <= lo && hi <= b, "{lo}..{hi} not inside {a}..{b}");
            for end in [a, b] {
                let ticks = end / step;
                assert!((ticks - ticks.round()).abs() < 1e-9, "{end} is not on a tick of {step}");
            }
            assert!((b - a) / step <= 12.0, "{lo}..{hi}: too many ticks of {step}");
        }
        assert!((nice_step(4.2, 6.0) - 1.0).abs() < 1e-12);
        assert!((nice_step(0.1, 6.0) - 0.02).abs() < 1e-12);
    }

    #[test]
    fn a_plot_is_written_with_integer_steps_and_a_named_reference() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let png = dir.path().join("loss.png");
        let run: Vec<(f64, f64)> = (0..5).map(|s| (s as f64, 6.3 - s as f64 * 0.3)).collect();
        let series = [("this run".to_owned(), run.clone()), ("reference: fsdp4.json".to_owned(), run)];
        loss_png(&png, "train-qwen3: test", &series).expect("plot");
        let bytes = std::fs::read(&png).expect("png");
        assert_eq!(&bytes[1..4], b"PNG");
        let e = loss_png(&png, "x", &[("this run".to_owned(), vec![(0.0, f64::NAN)])])
            .expect_err("nothing finite");
        assert!(e.to_string().contains("no finite loss"), "{e}");
    }
}
