//! GB/s against block size, one line per backend and one panel per direction, as SVG and PNG.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::Row;
use crate::units::format_size;

/// Where the plots' text gets its glyph metrics (Debian `fonts-dejavu-core`).
const FONT_FILES: [&str; 2] =
    ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf"];
const SIZE: (u32, u32) = (1200, 500);

/// One line of a panel: a backend's (block size, GB/s) points, sorted by size.
type Series = BTreeMap<String, Vec<(u64, f64)>>;

/// Splits rows into panels by op and lines by backend (+ memory kinds beyond DRAM→DRAM, +
/// layout when scattered).
fn panels(rows: &[Row]) -> BTreeMap<String, Series> {
    let mut panels: BTreeMap<String, Series> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.gbps.is_finite() && r.block_size > 0) {
        let mut name = row.backend.clone();
        if !row.mem.is_empty() {
            name = format!("{name} {}", row.mem);
        }
        if row.scatter {
            name.push_str(" scattered");
        }
        panels.entry(row.op.clone()).or_default().entry(name).or_default().push((row.block_size, row.gbps));
    }
    for series in panels.values_mut() {
        for points in series.values_mut() {
            points.sort_by_key(|p| p.0);
        }
    }
    panels
}

/// Writes `<stem>.svg` and `<stem>.png`; returns both paths.
pub fn write(stem: &Path, rows: &[Row], title: &str) -> Result<[PathBuf; 2]> {
    let panels = panels(rows);
    if panels.is_empty() {
        return Err(anyhow!("no rows to plot"));
    }
    let svg = stem.with_extension("svg");
    let png = stem.with_extension("png");
    register_font()?;
    draw(&SVGBackend::new(&svg, SIZE).into_drawing_area(), &panels, title)
        .with_context(|| format!("drawing {}", svg.display()))?;
    draw(&BitMapBackend::new(&png, SIZE).into_drawing_area(), &panels, title)
        .with_context(|| format!("drawing {}", png.display()))?;
    Ok([svg, png])
}

fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *REGISTERED.get_or_init(|| load_font().is_ok()) {
        return Ok(());
    }
    load_font()
}

fn load_font() -> Result<()> {
    let font = FONT_FILES
        .iter()
        .find_map(|path| std::fs::read(path).ok())
        .ok_or_else(|| anyhow!("plots need a TrueType font at {} (Debian: fonts-dejavu-core)", FONT_FILES[0]))?;
    // plotters keeps the font for the process; it wants 'static bytes.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow!("{} is not a usable TrueType font", FONT_FILES[0]))
}

fn draw<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, panels: &BTreeMap<String, Series>, title: &str) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e:?}");
    area.fill(&WHITE).map_err(err)?;
    let area = area.titled(title, ("sans-serif", 22)).map_err(err)?;
    // One colour per backend across panels.
    let names: std::collections::BTreeSet<&String> = panels.values().flat_map(|s| s.keys()).collect();
    let color_of = |name: &String| Palette99::pick(names.iter().position(|n| *n == name).unwrap_or(0)).to_rgba();
    let columns = area.split_evenly((1, panels.len()));
    for (column, (op, series)) in columns.iter().zip(panels) {
        let sizes = series.values().flatten().map(|p| p.0);
        let (lo, hi) = (sizes.clone().min().unwrap_or(1), sizes.max().unwrap_or(1));
        let top = series.values().flatten().map(|p| p.1).fold(0.0, f64::max).max(0.001) * 1.15;
        // Block sizes are powers of two: plot their exponent so every size gets equal room.
        let exponent = |size: u64| f64::from(63 - size.leading_zeros());
        let mut chart = ChartBuilder::on(column)
            .caption(op.to_uppercase(), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(exponent(lo) - 0.3..exponent(hi) + 0.3, 0.0..top)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("block size")
            .y_desc("GB/s")
            .x_labels(((exponent(hi) - exponent(lo)) as usize + 1).min(16))
            .x_label_formatter(&|x| format_size(1u64 << x.round().clamp(0.0, 62.0) as u32))
            .draw()
            .map_err(err)?;
        for (name, points) in series {
            let color = color_of(name);
            let line: Vec<(f64, f64)> = points.iter().map(|&(s, g)| (exponent(s), g)).collect();
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            chart.draw_series(line.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    area.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(backend: &str, op: &str, block_size: u64, gbps: f64) -> Row {
        Row { backend: backend.into(), op: op.into(), block_size, gbps, ..Row::default() }
    }

    #[test]
    fn rows_become_sorted_lines_per_op_and_backend() {
        let rows =
            [row("tcp", "read", 1 << 20, 2.0), row("tcp", "read", 1 << 16, 1.0), row("raw-tcp", "write", 1 << 16, 3.0)];
        let p = panels(&rows);
        assert_eq!(p.len(), 2);
        assert_eq!(p["read"]["tcp"], vec![(1 << 16, 1.0), (1 << 20, 2.0)]);
        assert_eq!(p["write"]["raw-tcp"], vec![(1 << 16, 3.0)]);
    }

    #[test]
    fn writes_an_svg_and_a_png() {
        let dir = std::env::temp_dir().join(format!("xferbench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rows =
            [row("tcp", "read", 1 << 16, 1.0), row("tcp", "read", 1 << 24, 2.5), row("peer", "read", 1 << 20, 1.5)];
        let [svg, png] = write(&dir.join("gbps"), &rows, "test").unwrap();
        let svg_text = std::fs::read_to_string(&svg).unwrap();
        assert!(
            svg_text.starts_with("<svg") && svg_text.contains("peer") && svg_text.contains("64K"),
            "{svg_text:.200}"
        );
        let png_bytes = std::fs::read(&png).unwrap();
        assert_eq!(&png_bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(png_bytes.len() > 5_000, "a real image, {} bytes", png_bytes.len());
        assert!(write(&dir.join("none"), &[], "empty").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
