//! SVG plots of bench records (`bench --plot`, `moeflow plot`): the layer time against tokens on
//! log axes beside its floor and the PyTorch baseline, each token count's stage times as a
//! stacked bar of shares, and with expert parallelism the dispatch + combine rate against the
//! link ceiling. Text goes into the SVG as text elements, so no font files are read.

use moeflow::{MoeError, Result};
use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;
use serde::Deserialize;
use std::path::Path;

/// The fields of a bench record (see [`super::Record`]) that the plots read, plus those that
/// `--torch-baseline` and a link measurement add.
#[derive(Deserialize, Debug, Clone)]
pub struct PlotRecord {
    /// Tokens per DP group.
    pub tokens: usize,
    /// Median layer time, ms.
    pub ms: f64,
    /// The floor at the measured peak rate, ms.
    pub floor_ms: f64,
    /// The floor at the GPU's sustained GEMM rate, ms.
    #[serde(default)]
    pub floor_sustained_ms: Option<f64>,
    /// Median stage times of rank 0, ms.
    pub stages_ms: Stages,
    /// Bytes rank 0 sent per forward (dispatch and combine).
    #[serde(default)]
    pub bytes_moved_per_rank: usize,
    /// Those bytes over rank 0's dispatch and combine time, GB/s.
    #[serde(default)]
    pub comm_gbps: Option<f64>,
    /// The dispatch's bytes over its time, GB/s, where the record has it apart.
    #[serde(default)]
    pub dispatch_gbps: Option<f64>,
    /// The combine's bytes over its time, GB/s, where the record has it apart.
    #[serde(default)]
    pub combine_gbps: Option<f64>,
    /// CPU runs: the matmul probe's rate before the row's runs, GFLOP/s.
    #[serde(default)]
    pub probe_gflops: Option<f64>,
    /// The PyTorch baseline's layer time on the same shapes, ms (`--torch-baseline`).
    #[serde(default)]
    pub torch_ms: Option<f64>,
    /// The PyTorch + NCCL baseline's time with rows per (token, rank serving it), ms (multi-GPU
    /// `--torch-baseline`; `torch_ms` is its rows per (token, slot)).
    #[serde(default)]
    pub torch_per_rank_ms: Option<f64>,
    /// The interconnect's bandwidth per GPU and direction, GB/s, where it was measured.
    #[serde(default)]
    pub link_gbps: Option<f64>,
    /// Preset name.
    #[serde(default)]
    pub preset: String,
    /// Backend name (cpu or cuda).
    #[serde(default)]
    pub backend: String,
    /// Expert-parallel size.
    #[serde(default = "one")]
    pub ep: usize,
    /// Strategy name.
    #[serde(default)]
    pub strategy: String,
}

fn one() -> usize {
    1
}

/// Median stage times, ms, as in [`moeflow::StageTimes`].
#[derive(Deserialize, Debug, Clone, Copy, Default)]
pub struct Stages {
    /// Router GEMM and top-k.
    pub route: f64,
    /// Quantize, permute and dispatch.
    pub prepare: f64,
    /// The experts' GEMMs and activation.
    pub experts: f64,
    /// Collect, weight-and-reduce and combine.
    pub finalize: f64,
    /// The shared expert.
    pub shared: f64,
}

impl Stages {
    /// (name, ms) of each stage, in the layer's order.
    fn named(&self) -> [(&'static str, f64); 5] {
        [
            ("route", self.route),
            ("prepare", self.prepare),
            ("experts", self.experts),
            ("finalize", self.finalize),
            ("shared", self.shared),
        ]
    }
}

/// Colours of the stages, in [`Stages::named`] order.
const STAGE_COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

/// Reads the records of a bench JSON file (an array of records).
pub fn read_records(path: &Path) -> Result<Vec<PlotRecord>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| MoeError::Io { context: format!("reading {}", path.display()), source: e })?;
    serde_json::from_str(&text)
        .map_err(|e| MoeError::Json { context: format!("bench records in {}", path.display()), source: e })
}

/// Draws the plots of `records` (sorted by tokens) into the SVG file `out`.
pub fn write_svg(records: &[PlotRecord], out: &Path) -> Result<()> {
    // A batch of no tokens has no place on a log axis.
    let mut records: Vec<PlotRecord> = records.iter().filter(|r| r.tokens > 0).cloned().collect();
    if records.is_empty() {
        return Err(MoeError::Config("no bench records of one token or more to plot".into()));
    }
    if let Some(bad) = records.iter().find(|r| !(r.ms.is_finite() && r.ms > 0.0)) {
        return Err(MoeError::Config(format!(
            "the bench record of {} tokens cannot be plotted: its layer time is {} ms",
            bad.tokens, bad.ms
        )));
    }
    records.sort_by_key(|r| r.tokens);
    let expert_parallel = records.iter().any(|r| {
        r.bytes_moved_per_rank > 0 && (r.comm_gbps.is_some() || r.dispatch_gbps.is_some() || r.combine_gbps.is_some())
    });
    let panels = if expert_parallel { 3 } else { 2 };
    let drawing =
        |e: String| MoeError::Io { context: format!("drawing {}", out.display()), source: std::io::Error::other(e) };
    let root = SVGBackend::new(out, (960, 400 * panels as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| drawing(e.to_string()))?;
    let areas = root.split_evenly((panels, 1));
    let title = title(&records[0]);
    latency(&areas[0], &records, &title).map_err(|e| drawing(e.to_string()))?;
    stage_shares(&areas[1], &records).map_err(|e| drawing(e.to_string()))?;
    if expert_parallel {
        comm_rates(&areas[2], &records).map_err(|e| drawing(e.to_string()))?;
    }
    root.present().map_err(|e| drawing(e.to_string()))
}

/// Reads the bench JSON file `json` and draws its plots into `out`.
pub fn plot_json(json: &Path, out: &Path) -> Result<()> {
    write_svg(&read_records(json)?, out)
}

/// The first chart's title: preset, backend and layout.
fn title(r: &PlotRecord) -> String {
    let preset = if r.preset.is_empty() { "layer" } else { &r.preset };
    let backend = if r.backend.is_empty() { String::new() } else { format!(", {}", r.backend) };
    let layout = if r.ep > 1 { format!(", EP {} {}", r.ep, r.strategy) } else { String::new() };
    format!("{preset}{backend}{layout}: layer time")
}

/// A line of a chart: its legend name, its colour, and the value it takes from a record.
type Series = (&'static str, RGBColor, fn(&PlotRecord) -> Option<f64>);

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type Drawn = std::result::Result<(), Box<dyn std::error::Error>>;

/// (min, max) of the positive values in `v`, widened by a margin for a log axis.
fn log_range(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v.filter(|x| x.is_finite() && *x > 0.0).fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if hi <= 0.0 {
        (0.1, 10.0)
    } else {
        (lo / 1.5, hi * 1.5)
    }
}

/// The label of a log axis' mark: 1, 2 and 5 times a power of ten, written short ("0.2", "5",
/// "1000"); nothing for the marks between them, so the labels do not crowd.
fn log_label(v: &f64) -> String {
    let mantissa = v / 10f64.powf(v.log10().floor());
    if ![1.0, 2.0, 5.0, 10.0].iter().any(|m| (mantissa - m).abs() < 1e-3 * m) {
        return String::new();
    }
    let text = format!("{v:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A legend line for a series of colour `color`.
fn legend_line(color: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
}

/// Layer time against tokens (log-log): moeflow, its floors, and PyTorch where it ran.
fn latency(area: &Area, records: &[PlotRecord], title: &str) -> Drawn {
    let xs = log_range(records.iter().map(|r| r.tokens as f64));
    let ys = log_range(
        records
            .iter()
            .flat_map(|r| [Some(r.ms), Some(r.floor_ms), r.floor_sustained_ms, r.torch_ms, r.torch_per_rank_ms])
            .flatten(),
    );
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((xs.0..xs.1).log_scale(), (ys.0..ys.1).log_scale())?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .x_label_formatter(&log_label)
        .y_label_formatter(&log_label)
        .x_desc("tokens")
        .y_desc("ms")
        .draw()?;
    let series: [Series; 5] = [
        ("moeflow", RGBColor(31, 119, 180), |r| Some(r.ms)),
        ("floor", RGBColor(120, 120, 120), |r| Some(r.floor_ms)),
        ("floor at the sustained GEMM rate", RGBColor(188, 189, 34), |r| r.floor_sustained_ms),
        ("PyTorch", RGBColor(214, 39, 40), |r| r.torch_ms),
        ("PyTorch, rows per (token, rank)", RGBColor(255, 127, 14), |r| r.torch_per_rank_ms),
    ];
    for (name, color, value) in series {
        draw_line(&mut chart, name, color, points(records, value))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}

/// One stacked bar per token count: each stage's share of the stages' summed time.
fn stage_shares(area: &Area, records: &[PlotRecord]) -> Drawn {
    let n = records.len();
    let labels: Vec<String> = records.iter().map(|r| r.tokens.to_string()).collect();
    // One segment a token count, and one more on the right for the legend.
    let mut chart = ChartBuilder::on(area)
        .caption("stage times, share of their sum", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((0..n + 1).into_segmented(), 0f64..100f64)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .disable_x_mesh()
        .x_labels(n + 2)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .x_desc("tokens")
        .y_desc("% of stage time")
        .draw()?;
    for (s, color) in STAGE_COLORS.iter().enumerate() {
        let name = Stages::default().named()[s].0;
        let bars = records.iter().enumerate().map(|(i, r)| {
            let named = r.stages_ms.named();
            let sum: f64 = named.iter().map(|(_, ms)| ms.max(0.0)).sum::<f64>().max(1e-12);
            let below: f64 = named[..s].iter().map(|(_, ms)| ms.max(0.0)).sum::<f64>() / sum * 100.0;
            let top = below + named[s].1.max(0.0) / sum * 100.0;
            let mut bar =
                Rectangle::new([(SegmentValue::Exact(i), below), (SegmentValue::Exact(i + 1), top)], color.filled());
            bar.set_margin(0, 0, 12, 12);
            bar
        });
        chart
            .draw_series(bars)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}

/// (tokens, value) of each record that has a positive `value`.
fn points(records: &[PlotRecord], value: fn(&PlotRecord) -> Option<f64>) -> Vec<(f64, f64)> {
    records.iter().filter_map(|r| value(r).filter(|v| *v > 0.0).map(|v| (r.tokens as f64, v))).collect()
}

/// Draws `points` as a line with dots, named `name` in the legend (nothing when empty).
fn draw_line<CT>(
    chart: &mut ChartContext<'_, SVGBackend<'_>, CT>,
    name: &str,
    color: RGBColor,
    points: Vec<(f64, f64)>,
) -> Drawn
where
    CT: CoordTranslate<From = (f64, f64)>,
{
    if points.is_empty() {
        return Ok(());
    }
    chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?.label(name).legend(legend_line(color));
    chart.draw_series(points.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    Ok(())
}

/// The communication rates of rank 0 against tokens: dispatch and combine apart where the
/// records have them, else together; with the link ceiling where it was measured.
fn comm_rates(area: &Area, records: &[PlotRecord]) -> Drawn {
    let apart = records.iter().any(|r| r.dispatch_gbps.is_some() || r.combine_gbps.is_some());
    let series: Vec<Series> = if apart {
        vec![
            ("dispatch", RGBColor(31, 119, 180), |r| r.dispatch_gbps),
            ("combine", RGBColor(255, 127, 14), |r| r.combine_gbps),
        ]
    } else {
        vec![("dispatch + combine", RGBColor(31, 119, 180), |r| r.comm_gbps)]
    };
    let link = records.iter().find_map(|r| r.link_gbps);
    let xs = log_range(records.iter().map(|r| r.tokens as f64));
    let rates = series.iter().flat_map(|(_, _, value)| records.iter().filter_map(value));
    let top = rates.chain(link).fold(1f64, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption("communication: bytes sent per GPU over their time", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((xs.0..xs.1).log_scale(), 0f64..top)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .x_label_formatter(&log_label)
        .x_desc("tokens")
        .y_desc("GB/s")
        .draw()?;
    for (name, color, value) in series {
        draw_line(&mut chart, name, color, points(records, value))?;
    }
    if let Some(l) = link {
        draw_line(&mut chart, "link ceiling", RGBColor(120, 120, 120), vec![(xs.0, l), (xs.1, l)])?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tokens: usize, ms: f64, torch: Option<f64>, comm: Option<f64>) -> PlotRecord {
        PlotRecord {
            tokens,
            ms,
            floor_ms: ms * 0.8,
            floor_sustained_ms: Some(ms * 0.9),
            stages_ms: Stages {
                route: 0.1 * ms,
                prepare: 0.1 * ms,
                experts: 0.6 * ms,
                finalize: 0.1 * ms,
                shared: 0.1 * ms,
            },
            bytes_moved_per_rank: if comm.is_some() { 1 << 20 } else { 0 },
            comm_gbps: comm,
            dispatch_gbps: None,
            combine_gbps: None,
            probe_gflops: None,
            torch_ms: torch,
            torch_per_rank_ms: None,
            link_gbps: comm.map(|_| 400.0),
            preset: "olmoe-1b-7b".into(),
            backend: "cpu".into(),
            ep: if comm.is_some() { 2 } else { 1 },
            strategy: "all2allv".into(),
        }
    }

    fn svg(records: &[PlotRecord], name: &str) -> String {
        let path = std::env::temp_dir().join(format!("moeflow_plot_{}_{name}.svg", std::process::id()));
        write_svg(records, &path).expect("the plot is drawn");
        let text = std::fs::read_to_string(&path).expect("the SVG is written");
        let _ = std::fs::remove_file(&path);
        text
    }

    #[test]
    fn one_rank_plot_names_its_series_and_stages() {
        let records: Vec<_> = [(1, 0.2, 0.6), (32, 1.3, 2.2), (256, 5.0, 8.0)]
            .iter()
            .map(|&(t, ms, torch)| record(t, ms, Some(torch), None))
            .collect();
        let text = svg(&records, "one");
        assert!(text.starts_with("<svg"), "{}", &text[..80.min(text.len())]);
        for name in [
            "moeflow",
            "floor",
            "floor at the sustained GEMM rate",
            "PyTorch",
            "route",
            "prepare",
            "experts",
            "finalize",
            "shared",
        ] {
            assert!(text.contains(&format!(">{name}<")) || text.contains(&format!(">\n{name}\n<")), "no series {name}");
        }
        assert!(text.contains("256"), "the token counts label the bars");
        assert!(
            !text.contains("link ceiling") && !text.contains("dispatch + combine"),
            "no expert-parallel panel at EP 1"
        );
    }

    #[test]
    fn expert_parallel_plot_adds_the_rates_and_the_link_ceiling() {
        let records = vec![record(128, 1.7, None, Some(40.0)), record(4096, 6.6, None, Some(135.0))];
        let text = svg(&records, "ep");
        for name in ["moeflow", "dispatch + combine", "link ceiling"] {
            assert!(text.contains(name), "no series {name}");
        }
        assert!(!text.contains("PyTorch"), "no PyTorch curve without its times");
        assert!(!text.contains(">dispatch<") && !text.contains(">combine<"), "no separate rates without them");
    }

    #[test]
    fn expert_parallel_plot_draws_both_forms_of_the_pytorch_baseline() {
        let mut records = vec![record(128, 1.7, Some(3.3), Some(40.0)), record(4096, 6.6, Some(14.1), Some(135.0))];
        assert!(!svg(&records, "one_form").contains("rows per (token, rank)"), "no per-rank curve without its times");
        for (r, ms) in records.iter_mut().zip([2.9, 9.8]) {
            r.torch_per_rank_ms = Some(ms);
        }
        let text = svg(&records, "both_forms");
        for name in ["PyTorch", "PyTorch, rows per (token, rank)"] {
            assert!(text.contains(&format!(">{name}<")) || text.contains(&format!("\n{name}\n")), "no series {name}");
        }
    }

    #[test]
    fn dispatch_and_combine_rates_are_drawn_apart_where_records_have_them() {
        let mut records = vec![record(128, 1.7, None, Some(40.0)), record(4096, 6.6, None, Some(135.0))];
        for (r, (d, c)) in records.iter_mut().zip([(38.0, 42.0), (142.5, 128.6)]) {
            (r.dispatch_gbps, r.combine_gbps) = (Some(d), Some(c));
        }
        let text = svg(&records, "apart");
        for name in ["dispatch", "combine", "link ceiling"] {
            assert!(text.contains(&format!(">{name}<")) || text.contains(&format!("\n{name}\n")), "no series {name}");
        }
        assert!(!text.contains("dispatch + combine"), "the rates apart replace their sum");
    }

    #[test]
    fn log_axes_label_one_two_and_five_times_powers_of_ten() {
        let labels: Vec<String> =
            [0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 7.0, 10.0, 1000.0, 16384.0].iter().map(log_label).collect();
        assert_eq!(labels, ["0.1", "0.2", "", "0.5", "1", "2", "", "10", "1000", ""]);
    }

    #[test]
    fn bad_records_are_refused_with_a_reason() {
        let err = write_svg(&[], Path::new("/nonexistent/x.svg")).unwrap_err().to_string();
        assert!(err.contains("no bench records"), "{err}");
        let err = write_svg(&[record(4, 1.0, None, None)], Path::new("/nonexistent/x.svg")).unwrap_err().to_string();
        assert!(err.contains("drawing /nonexistent/x.svg"), "{err}");
        let err = write_svg(&[record(0, 1.0, None, None)], Path::new("/nonexistent/x.svg")).unwrap_err().to_string();
        assert!(err.contains("one token or more"), "{err}");
        let err =
            write_svg(&[record(4, f64::NAN, None, None)], Path::new("/nonexistent/x.svg")).unwrap_err().to_string();
        assert!(err.contains("4 tokens") && err.contains("NaN"), "{err}");
    }
}
