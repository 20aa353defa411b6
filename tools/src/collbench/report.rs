//! collbench output: the nccl-tests table, the extras table, JSON and the plot.

use std::fmt::Write as _;

use serde::Serialize;

/// Timings of one mode (out-of-place or in-place) of one size.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Mode {
    /// Mean time per operation (µs), as selected by `-a`.
    pub time_us: f64,
    /// Algorithm bandwidth, decimal GB/s.
    pub algbw: f64,
    /// Bus bandwidth, decimal GB/s.
    pub busbw: f64,
    /// Wrong elements found by verification (summed over ranks).
    pub wrong: u64,
    /// Median per-iteration time (max over ranks), µs.
    pub p50_us: f64,
    /// 99th percentile per-iteration time (max over ranks), µs.
    pub p99_us: f64,
}

/// One row: one size.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Bytes (nccl-tests' S).
    pub bytes: u64,
    /// Element count as nccl-tests prints it.
    pub count: u64,
    /// Root (-1 when none).
    pub root: i64,
    /// Algorithm that ran.
    pub algo: String,
    /// Out of place.
    pub oop: Mode,
    /// In place.
    pub ip: Mode,
    /// Median per-iteration time out of place (µs).
    pub p50_us: f64,
    /// 99th percentile per-iteration time out of place (µs).
    pub p99_us: f64,
}

/// One collective's sweep.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Collective name.
    pub collective: String,
    /// Ranks.
    pub nranks: usize,
    /// Transport.
    pub transport: String,
    /// Data type (nccl-tests name).
    pub dtype: String,
    /// Reduction op, or "none".
    pub op: String,
    /// The rows.
    pub rows: Vec<Row>,
}

impl Run {
    /// Average out-of-place and in-place busbw over the rows (nccl-tests' "Avg bus bandwidth").
    pub fn avg_busbw(&self) -> f64 {
        if self.rows.is_empty() {
            return 0.0;
        }
        let sum: f64 = self.rows.iter().map(|r| r.oop.busbw + r.ip.busbw).sum();
        sum / (2 * self.rows.len()) as f64
    }

    /// Wrong elements over all rows.
    pub fn wrong(&self) -> u64 {
        self.rows.iter().map(|r| r.oop.wrong + r.ip.wrong).sum()
    }
}

/// The column header block.
pub fn header() -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#");
    let _ = writeln!(s, "# {:>70}{:>35}", "out-of-place", "in-place");
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
    s
}

fn time(t: f64) -> String {
    if t >= 1e6 {
        format!("{t:7.0}")
    } else if t >= 1e4 {
        format!("{t:7.1}")
    } else {
        format!("{t:7.2}")
    }
}

/// One data row, nccl-tests' columns and nothing else.
pub fn row(r: &Row, dtype: &str, op: &str) -> String {
    format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {}  {:6.2}  {:6.2}  {:>6}  {}  {:6.2}  {:6.2}  {:>6}",
        r.bytes,
        r.count,
        dtype,
        op,
        r.root,
        time(r.oop.time_us),
        r.oop.algbw,
        r.oop.busbw,
        r.oop.wrong,
        time(r.ip.time_us),
        r.ip.algbw,
        r.ip.busbw,
        r.ip.wrong
    )
}

/// The footer of one collective, then the extras table.
pub fn footer(run: &Run) -> String {
    let mut s = String::new();
    let wrong = run.wrong();
    let _ = writeln!(
        s,
        "# Out of bounds values : {} {}",
        wrong,
        if wrong == 0 { "OK" } else { "FAILED" }
    );
    let _ = writeln!(s, "# Avg bus bandwidth    : {:.6} ", run.avg_busbw());
    let _ = writeln!(s, "#");
    let _ = writeln!(s, "# Collective test concluded: {}", run.collective);
    let _ = writeln!(s, "#");
    let _ =
        writeln!(s, "# collbench extras: {} (per-iteration time: max over ranks)", run.collective);
    let _ = writeln!(
        s,
        "# {:>10}  {:>14}  {:>10}  {:>10}  {:>10}  {:>10}",
        "size", "algo", "oop_p50", "oop_p99", "ip_p50", "ip_p99"
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>14}  {:>10}  {:>10}  {:>10}  {:>10}",
        "(B)", "", "(us)", "(us)", "(us)", "(us)"
    );
    for r in &run.rows {
        let _ = writeln!(
            s,
            "# {:>10}  {:>14}  {:>10.2}  {:>10.2}  {:>10.2}  {:>10.2}",
            r.bytes, r.algo, r.oop.p50_us, r.oop.p99_us, r.ip.p50_us, r.ip.p99_us
        );
    }
    s
}

/// The JSON document: `{"runs": [...]}`.
pub fn json(runs: &[Run]) -> String {
    #[derive(Serialize)]
    struct Doc<'a> {
        runs: &'a [Run],
    }
    serde_json::to_string_pretty(&Doc { runs })
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// Plot out-of-place busbw against size, one line per collective and algorithm.
///
/// # Errors
/// A message when the file cannot be drawn or written.
pub fn plot(runs: &[Run], path: &std::path::Path) -> Result<(), String> {
    use plotters::prelude::*;
    let mut series: Vec<(String, Vec<(u64, f64)>)> = Vec::new();
    for run in runs {
        for r in run.rows.iter().filter(|r| r.bytes > 0) {
            let name = format!("{} ({})", run.collective, r.algo);
            match series.iter_mut().find(|(n, _)| *n == name) {
                Some((_, pts)) => pts.push((r.bytes, r.oop.busbw)),
                None => series.push((name, vec![(r.bytes, r.oop.busbw)])),
            }
        }
    }
    let xmin = series.iter().flat_map(|s| s.1.iter().map(|p| p.0)).min().unwrap_or(1).max(1);
    let xmax = series.iter().flat_map(|s| s.1.iter().map(|p| p.0)).max().unwrap_or(2).max(xmin + 1);
    let ymax =
        series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).fold(0.0f64, f64::max).max(0.01) * 1.1;
    let e = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let root = SVGBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let title = runs.first().map_or(String::from("collbench"), |r| {
        format!("collbench busbw, {} ranks, {}", r.nranks, r.transport)
    });
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d((xmin..xmax).log_scale(), 0f64..ymax)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("size (bytes)")
        .y_desc("busbw (GB/s)")
        .draw()
        .map_err(|x| e(&x))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}
