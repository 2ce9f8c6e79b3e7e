//! `moeflow simulate`: the layer's predicted time per stage for EP sizes, token counts and
//! routings (uniform, Zipf, a recorded load), with and without EPLB, from measured ceilings
//! (`bench --calibrate FILE` on this CPU or one GPU; `h100` and `h200`, the GPU calibrations'
//! files in docs/bench); `--compare` puts bench records beside the prediction (with
//! `--at-pace`, at the pace each record's matmul probe measured, where it and the ceilings have
//! one), `--plot` draws it.

use crate::table::{num, right, Table};
use moeflow::simulate::{placement, predict, Ceilings, Layout, Prediction, Routing, Shapes};
use moeflow::{preset, LoadRecord, MoeError, Result};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Arguments of `moeflow simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// Ceilings: a JSON file from `bench --calibrate`, or `h100` / `h200`
    /// (docs/bench/h100-simulator-ceilings.json, h200-simulator-ceilings.json: the GPU
    /// calibrations' ceilings of 4 x H100 and 2 x H200, NVLink transport).
    #[arg(long, default_value = "h100")]
    ceilings: String,
    /// Layer shape.
    #[arg(long, default_value = "deepseek-v3")]
    preset: String,
    /// Use this many experts instead of the preset's.
    #[arg(long)]
    experts: Option<usize>,
    /// Leave out the shared expert.
    #[arg(long)]
    no_shared_expert: bool,
    /// Bytes per expert weight (2: bf16, 1: fp8, 4: f32).
    #[arg(long, default_value_t = 2.0)]
    weight_bytes: f64,
    /// Bytes per element of a dispatched row (default: 2 on GPUs, 4 on CPU ceilings).
    #[arg(long)]
    row_bytes: Option<f64>,
    /// Tokens per rank, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,128,4096")]
    tokens: Vec<usize>,
    /// EP sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,8,16,32,64,128,256")]
    ep: Vec<usize>,
    /// Ranks per NVLink domain (node); exchanges beyond it take the inter-node link.
    #[arg(long, default_value_t = 8)]
    domain: usize,
    /// Inter-node bandwidth per rank, GB/s (overrides the ceilings').
    #[arg(long)]
    inter_gbps: Option<f64>,
    /// Routing: uniform, zipf:S, or load:FILE (a load record from --record-load).
    #[arg(long, default_value = "uniform")]
    routing: String,
    /// Also predict the layout with EPLB and this many redundant replicas (0: without only).
    #[arg(long, default_value_t = 0)]
    eplb: usize,
    /// Bench JSON records to put beside the prediction (rows of the same tokens and EP).
    #[arg(long)]
    compare: Vec<PathBuf>,
    /// Put the --compare records beside the prediction with EPLB (--eplb R) instead of without.
    #[arg(long)]
    compare_eplb: bool,
    /// Predict each --compare record with the compute rates scaled by its matmul probe's rate
    /// over the calibration's (CPU records; the `pace` column shows the ratio either way).
    #[arg(long)]
    at_pace: bool,
    /// Draw the predicted layer time against EP, one line per token count, as an SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn builtin(name: &str) -> Option<Ceilings> {
    match name {
        "h100" => serde_json::from_str(H100).ok(),
        "h200" => serde_json::from_str(H200).ok(),
        _ => None,
    }
}

/// One H100's ceilings (others for the link), as `bench --backend cuda --calibrate` writes them.
const H100: &str = include_str!("../../../docs/bench/h100-simulator-ceilings.json");

/// One H200's ceilings (two for the link), as `bench --backend cuda --calibrate` writes them.
const H200: &str = include_str!("../../../docs/bench/h200-simulator-ceilings.json");

/// Reads ceilings: a built-in name or a calibration file.
fn ceilings(name: &str) -> Result<Ceilings> {
    if let Some(c) = builtin(name) {
        return Ok(c);
    }
    let text = std::fs::read_to_string(name)
        .map_err(|e| MoeError::Io { context: format!("reading ceilings {name} (or h100, h200)"), source: e })?;
    serde_json::from_str(&text).map_err(|e| MoeError::Json { context: format!("parsing ceilings {name}"), source: e })
}

/// Parses `--routing`.
fn routing(s: &str, experts: usize) -> Result<Routing> {
    if s == "uniform" {
        return Ok(Routing::Uniform);
    }
    if let Some(v) = s.strip_prefix("zipf:") {
        let v: f64 = v.parse().map_err(|_| MoeError::Config(format!("--routing {s}: the exponent is not a number")))?;
        return Ok(Routing::Zipf(v));
    }
    if let Some(path) = s.strip_prefix("load:") {
        let record = LoadRecord::read(Path::new(path))?;
        if record.num_experts != experts {
            return Err(MoeError::Config(format!(
                "{path} counts {} experts, the layer has {experts}",
                record.num_experts
            )));
        }
        return Ok(Routing::Load(record.totals().iter().map(|&c| c as f64).collect()));
    }
    Err(MoeError::Config(format!("--routing {s}: uniform, zipf:S or load:FILE")))
}

/// One token count's predictions: (tokens, per EP: (EP, layer ms, layer ms with EPLB)).
type Line = (usize, Vec<(usize, f64, Option<f64>)>);

/// A measured layer time from bench records, keyed by (tokens, EP).
struct Measured {
    tokens: usize,
    ep: usize,
    ms: f64,
    /// The machine's pace (matmul probe, GFLOP/s) during the measurement, where recorded.
    probe: Option<f64>,
}

fn measured(paths: &[PathBuf]) -> Result<Vec<Measured>> {
    let mut all = Vec::new();
    for p in paths {
        for r in crate::bench::plot::read_records(p)? {
            all.push(Measured { tokens: r.tokens, ep: r.ep, ms: r.ms, probe: r.probe_gflops });
        }
    }
    Ok(all)
}

/// `moeflow simulate`: prints the table (and the comparison), draws the plot.
pub fn run(args: SimulateArgs) -> Result<()> {
    let mut c = ceilings(&args.ceilings)?;
    if let Some(g) = args.inter_gbps {
        c.inter_gbps = g;
    }
    let p = preset::preset(&args.preset)?;
    let mut config = match args.experts {
        Some(n) => p.config.with_num_experts(n)?,
        None => p.config.clone(),
    };
    if args.no_shared_expert {
        config.shared = None;
    }
    let row_bytes = args.row_bytes.unwrap_or(if c.shared_device { 4.0 } else { 2.0 });
    let shapes = Shapes::of(&config, args.weight_bytes, row_bytes);
    let routing = routing(&args.routing, config.num_experts)?;
    if args.ep.contains(&0) || args.tokens.is_empty() || args.ep.is_empty() {
        return Err(MoeError::Config("--ep and --tokens need positive values".into()));
    }
    println!(
        "moeflow simulate: {} ({} experts, top-{}, H {}, I {}{}), routing {}, NVLink domain {} ranks; ceilings: {}",
        p.name,
        config.num_experts,
        config.top_k,
        config.hidden,
        config.inter,
        config.shared.map_or(String::new(), |s| format!(", shared {}", s.inter)),
        args.routing,
        args.domain,
        c.name
    );
    let measured = measured(&args.compare)?;
    if args.compare_eplb && args.eplb == 0 {
        return Err(MoeError::Config("--compare-eplb compares with the EPLB prediction: give --eplb R".into()));
    }
    let mut cols = vec![
        right("EP", 4),
        right("tokens", 7),
        right("router", 8),
        right("permute", 8),
        right("dispatch", 9),
        right("GEMMs", 9),
        right("combine", 9),
        right("shared", 8),
        right("ms", 9),
        right("imbal", 6),
    ];
    if args.eplb > 0 {
        cols.extend([right("EPLB ms", 9), right("imbal", 6), right("gain", 6)]);
    }
    if !measured.is_empty() {
        cols.extend([right("pace", 5), right("predicted", 9), right("measured", 9), right("error", 7)]);
    }
    let table = Table::new(&cols);
    println!("{}", table.header());
    let mut lines: Vec<Line> = Vec::new();
    let mut worst: f64 = 0.0;
    for &t in &args.tokens {
        let mut line = Vec::new();
        for &ep in &args.ep {
            let at = |c: &Ceilings, eplb: Option<usize>| -> Result<Prediction> {
                let placement = placement(&shapes, &routing, ep, args.domain, eplb)?;
                predict(c, &shapes, &routing, &Layout { ep, domain: args.domain, tokens: t, placement })
            };
            let base = at(&c, None)?;
            let mut row = vec![
                ep.to_string(),
                t.to_string(),
                num(base.router, 3),
                num(base.permute, 3),
                num(base.dispatch, 3),
                num(base.gemms, 3),
                num(base.combine, 3),
                num(base.shared, 3),
                num(base.total, 3),
                num(base.imbalance, 2),
            ];
            let eplb = (args.eplb > 0 && ep > 1).then_some(args.eplb);
            let balanced = match eplb {
                Some(r) => Some(at(&c, Some(r))?),
                None => None,
            };
            if args.eplb > 0 {
                match &balanced {
                    Some(b) => row.extend([
                        num(b.total, 3),
                        num(b.imbalance, 2),
                        format!("{:+.0}%", 100.0 * (base.total / b.total - 1.0)),
                    ]),
                    None => row.extend(["-".into(), "-".into(), "-".into()]),
                }
            }
            if !measured.is_empty() {
                match measured.iter().find(|m| m.tokens == t && m.ep == ep) {
                    Some(m) => {
                        // With --at-pace, at the pace the machine ran the record at, where both
                        // know it.
                        let probe = m.probe.unwrap_or(0.0);
                        let paced = c.at_pace(if args.at_pace { probe } else { 0.0 });
                        let predicted = at(&paced, if args.compare_eplb { eplb } else { None })?.total;
                        let err = predicted / m.ms - 1.0;
                        worst = worst.max(err.abs());
                        let pace = if c.probe_gflops > 0.0 && probe > 0.0 {
                            num(probe / c.probe_gflops, 2)
                        } else {
                            "-".into()
                        };
                        row.extend([pace, num(predicted, 3), num(m.ms, 3), format!("{:+.1}%", 100.0 * err)]);
                    }
                    None => row.extend(["-".into(), "-".into(), "-".into(), "-".into()]),
                }
            }
            println!("{}", table.row(&row));
            line.push((ep, base.total, balanced.map(|b| b.total)));
        }
        lines.push((t, line));
    }
    if !measured.is_empty() {
        println!("largest error against the measured rows: {:.1}%", 100.0 * worst);
    }
    if let Some(svg) = &args.plot {
        draw(&lines, svg, &format!("{} predicted, {}", p.name, args.routing))?;
        println!("wrote the plot to {}", svg.display());
    }
    Ok(())
}

/// Layer ms against EP on log axes, one line per token count (dashed: with EPLB).
fn draw(lines: &[Line], out: &Path, title: &str) -> Result<()> {
    let fail = |e: String| MoeError::Config(format!("drawing {}: {e}", out.display()));
    let root = SVGBackend::new(out, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let eps: Vec<f64> = lines.iter().flat_map(|(_, l)| l.iter().map(|p| p.0 as f64)).collect();
    let ms: Vec<f64> = lines.iter().flat_map(|(_, l)| l.iter().flat_map(|p| [Some(p.1), p.2]).flatten()).collect();
    let (x0, x1) = (eps.iter().cloned().fold(f64::MAX, f64::min), eps.iter().cloned().fold(0.0, f64::max));
    let (y0, y1) = (ms.iter().cloned().fold(f64::MAX, f64::min), ms.iter().cloned().fold(0.0, f64::max));
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0..x1.max(x0 * 2.0)).log_scale(), (y0 * 0.8..y1 * 1.25).log_scale())
        .map_err(|e| fail(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("EP ranks")
        .y_desc("predicted layer ms (slowest rank)")
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    for (i, (t, line)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let plain: Vec<(f64, f64)> = line.iter().map(|p| (p.0 as f64, p.1)).collect();
        chart
            .draw_series(LineSeries::new(plain, color.stroke_width(2)))
            .map_err(|e| fail(e.to_string()))?
            .label(format!("{t} tokens per rank"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        let balanced: Vec<(f64, f64)> = line.iter().filter_map(|p| p.2.map(|b| (p.0 as f64, b))).collect();
        if !balanced.is_empty() {
            chart
                .draw_series(balanced.iter().map(|&(x, y)| Circle::new((x, y), 4, color.filled())))
                .map_err(|e| fail(e.to_string()))?
                .label(format!("{t} tokens, with EPLB"))
                .legend(move |(x, y)| Circle::new((x + 9, y), 4, color.filled()));
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    root.present().map_err(|e| fail(e.to_string()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_built_in_ceilings_parse() {
        let h200 = super::builtin("h200").expect("docs/bench/h200-simulator-ceilings.json parses");
        assert!(h200.shared_overlaps && h200.rows_per_rank && h200.gemm_curve.len() >= 2, "{h200:?}");
        let h100 = super::builtin("h100").expect("docs/bench/h100-simulator-ceilings.json parses");
        assert!(h100.shared_overlaps && h100.gemm_curve.len() >= 2, "{h100:?}");
        assert!(super::builtin("a100").is_none());
    }
}
