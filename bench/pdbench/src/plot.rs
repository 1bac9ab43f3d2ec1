//! Plots of a run (plotters, SVG and PNG): the latency CDF (TTFT and end-to-end) and the TTFT
//! histogram. Text needs a TrueType font, looked up in the usual system places (or `$PDBENCH_FONT`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("no TrueType font found (set PDBENCH_FONT to a .ttf file)")]
    NoFont,
    #[error("drawing {path}: {source}")]
    Draw { path: PathBuf, source: DrawFailed },
}

/// A plotters failure, kept as its message: its error type depends on the drawing backend.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DrawFailed(String);

fn drawn<E: std::fmt::Display>(e: E) -> DrawFailed {
    DrawFailed(e.to_string())
}

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        let env = std::env::var("PDBENCH_FONT").ok();
        let candidates = env.iter().map(String::as_str).chain(FONT_PATHS.iter().copied());
        for p in candidates {
            if let Ok(bytes) = std::fs::read(p) {
                // The registry wants 'static bytes: one font, loaded once per process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// One named series of samples (milliseconds).
#[derive(Debug, Clone, Copy)]
pub struct Series<'a> {
    pub name: &'a str,
    pub samples: &'a [f64],
}

fn sorted(xs: &[f64]) -> Vec<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// The points of an empirical CDF.
pub fn cdf_points(samples: &[f64]) -> Vec<(f64, f64)> {
    let v = sorted(samples);
    let n = v.len() as f64;
    v.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect()
}

/// Counts of samples in `bins` equal bins over [0, max]; returns (bin width, counts).
pub fn histogram(samples: &[f64], bins: usize) -> (f64, Vec<u64>) {
    let v = sorted(samples);
    let max = v.last().copied().unwrap_or(1.0).max(1e-6);
    let width = max / bins as f64;
    let mut counts = vec![0u64; bins];
    for x in v {
        counts[((x / width) as usize).min(bins - 1)] += 1;
    }
    (width, counts)
}

const COLORS: [RGBColor; 4] = [BLUE, RED, GREEN, MAGENTA];

fn draw_cdf<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    series: &[Series],
) -> Result<(), DrawFailed> {
    root.fill(&WHITE).map_err(drawn)?;
    let xmax = series.iter().flat_map(|s| s.samples.iter().copied()).fold(0.0f64, f64::max).max(1e-3) * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..xmax, 0.0..1.0)
        .map_err(drawn)?;
    chart.configure_mesh().x_desc("latency (ms)").y_desc("fraction of requests").draw().map_err(drawn)?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(cdf_points(s.samples), color.stroke_width(2)))
            .map_err(drawn)?
            .label(s.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(drawn)?;
    root.present().map_err(drawn)
}

fn draw_hist<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, title: &str, samples: &[f64]) -> Result<(), DrawFailed> {
    root.fill(&WHITE).map_err(drawn)?;
    let bins = 40;
    let (width, counts) = histogram(samples, bins);
    let ymax = counts.iter().copied().max().unwrap_or(1).max(1) as f64 * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..width * bins as f64, 0.0..ymax)
        .map_err(drawn)?;
    chart.configure_mesh().x_desc("TTFT (ms)").y_desc("requests").draw().map_err(drawn)?;
    chart
        .draw_series(counts.iter().enumerate().map(|(i, &c)| {
            let x0 = i as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width, c as f64)], BLUE.mix(0.6).filled())
        }))
        .map_err(drawn)?;
    root.present().map_err(drawn)
}

/// Writes `{prefix}-cdf.{svg,png}` and `{prefix}-ttft-hist.{svg,png}`; returns the paths.
pub fn write_plots(prefix: &Path, series: &[Series], ttft: &[f64]) -> Result<Vec<PathBuf>, PlotError> {
    if !font_ready() {
        return Err(PlotError::NoFont);
    }
    let name = |suffix: &str| {
        let mut s = prefix.as_os_str().to_owned();
        s.push(suffix);
        PathBuf::from(s)
    };
    let size = (900, 560);
    let mut written = Vec::new();
    let err = |path: &Path, source: DrawFailed| PlotError::Draw { path: path.to_path_buf(), source };
    let p = name("-cdf.svg");
    draw_cdf(SVGBackend::new(&p, size).into_drawing_area(), "Latency CDF", series).map_err(|m| err(&p, m))?;
    written.push(p);
    let p = name("-cdf.png");
    draw_cdf(BitMapBackend::new(&p, size).into_drawing_area(), "Latency CDF", series).map_err(|m| err(&p, m))?;
    written.push(p);
    let p = name("-ttft-hist.svg");
    draw_hist(SVGBackend::new(&p, size).into_drawing_area(), "TTFT histogram", ttft).map_err(|m| err(&p, m))?;
    written.push(p);
    let p = name("-ttft-hist.png");
    draw_hist(BitMapBackend::new(&p, size).into_drawing_area(), "TTFT histogram", ttft).map_err(|m| err(&p, m))?;
    written.push(p);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_and_histogram() {
        let pts = cdf_points(&[3.0, 1.0, 2.0, f64::NAN]);
        assert_eq!(pts, vec![(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]);
        let (w, c) = histogram(&[0.0, 1.0, 9.9, 10.0], 10);
        assert!((w - 1.0).abs() < 1e-12);
        assert_eq!(c.iter().sum::<u64>(), 4);
        assert_eq!((c[0], c[1], c[9]), (1, 1, 2));
    }

    #[test]
    fn writes_svg_and_png() {
        let dir = std::env::temp_dir().join(format!("pdbench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ttft: Vec<f64> = (1..200).map(|i| i as f64 * 0.5).collect();
        let e2e: Vec<f64> = ttft.iter().map(|t| t * 3.0).collect();
        let series = [Series { name: "TTFT", samples: &ttft }, Series { name: "E2E", samples: &e2e }];
        match write_plots(&dir.join("run"), &series, &ttft) {
            Err(PlotError::NoFont) => eprintln!("no font on this machine: plots skipped"),
            other => {
                let files = other.unwrap();
                assert_eq!(files.len(), 4);
                for f in &files {
                    let bytes = std::fs::read(f).unwrap();
                    if f.extension().unwrap() == "png" {
                        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
                    } else {
                        let s = String::from_utf8(bytes).unwrap();
                        assert!(s.contains("<svg") && s.contains("latency (ms)") || s.contains("TTFT (ms)"));
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
