//! A cost model of the layer, stage by stage, for expert-parallel layouts larger than the
//! machines at hand (EP 1 to 256, NVLink domains, inter-node links).
//!
//! Each stage's time on a rank is the longer of its compute at the GEMM rate and its memory
//! traffic at the memory bandwidth, plus a fixed cost per launch; an exchange costs a fixed
//! per-call latency, a per-hop latency, and its bytes over the slower of the links it crosses.
//! The per-rank expert rows follow the routing distribution (uniform, Zipf or a recorded load)
//! and the placement (replicas share an expert's rows equally, as
//! [`crate::placement::ExpertPlacement::replica_for`] spreads them, where it has at least
//! [`Ceilings::replica_min_rows`]). Ranks synchronise at each
//! exchange, so the layer's time is the sum over stages of the slowest rank's stage time.
//!
//! When the ranks share one device (in-process CPU ranks on one machine), their compute
//! stages run on the same cores and add up.

use crate::eplb::{balance, EplbConfig};
use crate::error::{MoeError, Result};
use crate::placement::ExpertPlacement;
use serde::{Deserialize, Serialize};

/// A device's and its links' measured rates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// Name of what was measured (e.g. "H100 SXM, NCCL over NVLink").
    pub name: String,
    /// Sustained GEMM rate of the expert GEMMs, GFLOP/s.
    pub gemm_gflops: f64,
    /// Measured expert GEMM rates by rows per expert `(rows, GFLOP/s)`, increasing in rows:
    /// where given, the rate at a rank's rows per expert is interpolated in log(rows) (and
    /// held constant beyond the ends) instead of `gemm_gflops`.
    #[serde(default)]
    pub gemm_curve: Vec<(f64, f64)>,
    /// GEMM rate of the router's (thin) GEMM, GFLOP/s.
    pub router_gflops: f64,
    /// Memory bandwidth for weight streaming and row copies, GB/s.
    pub mem_gbps: f64,
    /// Fixed cost of one stage launch (kernel or thread fork), microseconds.
    pub launch_us: f64,
    /// Bandwidth per rank inside a fast domain (NVLink; in-process memory on CPU), GB/s.
    pub intra_gbps: f64,
    /// Measured exchange rates inside the domain by bytes per peer `(bytes, GB/s)`, increasing
    /// in bytes: where given, the rate of a message is interpolated in log(bytes) (held
    /// constant beyond the ends) instead of `intra_gbps` (NCCL's rate grows with the message).
    #[serde(default)]
    pub link_curve: Vec<(f64, f64)>,
    /// Latency of one message inside the domain, microseconds.
    pub intra_latency_us: f64,
    /// Bandwidth per rank between domains (InfiniBand), GB/s.
    pub inter_gbps: f64,
    /// Latency of one message between domains, microseconds.
    pub inter_latency_us: f64,
    /// Fixed cost of one collective call (NCCL launch, thread rendezvous), microseconds.
    pub call_us: f64,
    /// The ranks share one device (in-process CPU ranks): their compute adds up.
    pub shared_device: bool,
    /// Ranks sharing one device ([`Ceilings::shared_device`]) computing at once: their expert
    /// GEMM rate by rows per expert `(rows, GFLOP/s)`, every rank's FLOPs over the time they
    /// take together (two ranks' cores and caches contend). Where given, it replaces
    /// `gemm_curve` beyond one rank.
    #[serde(default)]
    pub shared_gemm_curve: Vec<(f64, f64)>,
    /// A token's row travels once to each rank serving any of its slots and comes back summed
    /// (the device layer); otherwise once per (token, slot) both ways (the CPU layer).
    #[serde(default)]
    pub rows_per_rank: bool,
    /// The shared expert runs on a side stream beside the dispatch and the routed GEMMs (the
    /// GPU layer): the layer waits only for what outlasts them, and then adds its output;
    /// otherwise it runs after them.
    #[serde(default)]
    pub shared_overlaps: bool,
    /// Planning the dispatch (EP 2 or more: on the host, the routing read back and the counts
    /// gathered; on the device, the batch sizes' exchange and the plan's kernels) costs this
    /// much per call, microseconds ...
    #[serde(default)]
    pub host_plan_us: f64,
    /// ... and this much per (token, slot) of the rank's batch, nanoseconds.
    #[serde(default)]
    pub host_plan_ns_per_slot: f64,
    /// A replicated expert's replicas share its rows only where it has at least this many
    /// (the GPU layer's [`crate::backend::cuda_options::CudaOptions::replica_min_rows`]);
    /// below it the first replica takes them all. 0: always shared (the CPU layer).
    #[serde(default)]
    pub replica_min_rows: f64,
    /// The machine's pace while these were measured: the rate of `bench`'s dense matmul probe
    /// (on CPU, the f32 matmul `bench` measures before each batch), GFLOP/s; 0: not measured.
    /// A machine whose speed drifts (a shared VM) is predicted at a record's own pace with
    /// [`Ceilings::at_pace`].
    #[serde(default)]
    pub probe_gflops: f64,
}

/// The layer's shapes, in the units the model counts.
#[derive(Clone, Debug, PartialEq)]
pub struct Shapes {
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub inter: usize,
    /// Routed experts E.
    pub experts: usize,
    /// Experts per token k.
    pub top_k: usize,
    /// Shared expert intermediate size (0: none).
    pub shared_inter: usize,
    /// Bytes per expert weight element.
    pub weight_bytes: f64,
    /// Bytes per element of a dispatched row.
    pub row_bytes: f64,
}

impl Shapes {
    /// The shapes of `config` with `weight_bytes` and `row_bytes` per element.
    pub fn of(config: &crate::MoeConfig, weight_bytes: f64, row_bytes: f64) -> Self {
        Shapes {
            hidden: config.hidden,
            inter: config.inter,
            experts: config.num_experts,
            top_k: config.top_k,
            shared_inter: config.shared.map_or(0, |s| s.inter),
            weight_bytes,
            row_bytes,
        }
    }
}

/// How tokens choose experts: each expert's share of the (token, slot) pairs.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// Every expert alike.
    Uniform,
    /// Expert `e`'s share proportional to `(1 + e)^-S`, capped at `1 / k` (a token takes an
    /// expert once) with the excess spread over the others.
    Zipf(f64),
    /// Shares proportional to a recorded load `[E]`.
    Load(Vec<f64>),
}

impl Routing {
    /// Each expert's share of the (token, slot) pairs `[E]` (summing to 1).
    pub fn shares(&self, experts: usize, top_k: usize) -> Result<Vec<f64>> {
        let raw: Vec<f64> = match self {
            Routing::Uniform => vec![1.0; experts],
            Routing::Zipf(s) => (0..experts).map(|e| (1.0 + e as f64).powf(-s)).collect(),
            Routing::Load(l) => {
                if l.len() != experts {
                    return Err(MoeError::Config(format!("a load of {} experts for {experts}", l.len())));
                }
                l.clone()
            }
        };
        let total: f64 = raw.iter().sum();
        if total <= 0.0 || !total.is_finite() || raw.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(MoeError::Config("routing shares must be finite, non-negative, not all zero".into()));
        }
        let mut shares: Vec<f64> = raw.iter().map(|v| v / total).collect();
        // No expert takes more than 1/k: a token chooses it at most once.
        let cap = 1.0 / top_k.max(1) as f64;
        for _ in 0..experts {
            let excess: f64 = shares.iter().map(|s| (s - cap).max(0.0)).sum();
            if excess <= 1e-12 {
                break;
            }
            let room: f64 = shares.iter().filter(|&&s| s < cap).map(|s| cap - s).sum();
            for s in shares.iter_mut() {
                *s = if *s >= cap { cap } else { *s + excess * (cap - *s) / room.max(1e-300) };
            }
        }
        Ok(shares)
    }
}

/// A layout to predict.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Expert-parallel ranks.
    pub ep: usize,
    /// Ranks per fast domain (NVLink domain, node).
    pub domain: usize,
    /// Tokens each rank brings.
    pub tokens: usize,
    /// Where experts live.
    pub placement: ExpertPlacement,
}

/// Milliseconds per stage of the slowest rank, and per rank in total.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Prediction {
    /// Router GEMM and top-k.
    pub router: f64,
    /// Rows grouped by expert (and copied where the backend copies).
    pub permute: f64,
    /// Rows sent to the ranks of their experts.
    pub dispatch: f64,
    /// The expert GEMMs and activation.
    pub gemms: f64,
    /// Rows sent home, weighted and summed.
    pub combine: f64,
    /// The shared expert (where it overlaps, the part the layer waits for and its sum).
    pub shared: f64,
    /// The layer: the stages' sum.
    pub total: f64,
    /// The busiest rank's expert rows over the mean.
    pub imbalance: f64,
}

impl Ceilings {
    /// The expert GEMM rate, GFLOP/s, with `rows` rows per expert.
    pub fn gemm_rate(&self, rows: f64) -> f64 {
        interpolate(&self.gemm_curve, rows).unwrap_or(self.gemm_gflops)
    }

    /// The expert GEMM rate, GFLOP/s, with `rows` rows per expert on each of `ranks` ranks:
    /// [`Ceilings::shared_gemm_curve`]'s where ranks share a device and it is given.
    pub fn gemm_rate_on(&self, rows: f64, ranks: usize) -> f64 {
        match interpolate(&self.shared_gemm_curve, rows) {
            Some(rate) if self.shared_device && ranks > 1 => rate,
            _ => self.gemm_rate(rows),
        }
    }

    /// These ceilings with the compute rates (expert GEMMs, router) scaled to a machine whose
    /// matmul probe now runs at `probe_gflops`, against [`Ceilings::probe_gflops`] when they were
    /// measured; unchanged where either is unknown (0).
    pub fn at_pace(&self, probe_gflops: f64) -> Ceilings {
        if self.probe_gflops <= 0.0 || probe_gflops <= 0.0 {
            return self.clone();
        }
        let f = probe_gflops / self.probe_gflops;
        Ceilings {
            gemm_gflops: self.gemm_gflops * f,
            gemm_curve: self.gemm_curve.iter().map(|&(r, g)| (r, g * f)).collect(),
            shared_gemm_curve: self.shared_gemm_curve.iter().map(|&(r, g)| (r, g * f)).collect(),
            router_gflops: self.router_gflops * f,
            probe_gflops,
            ..self.clone()
        }
    }

    /// The rate inside the domain, GB/s, of messages of `bytes` per peer.
    pub fn intra_rate(&self, bytes: f64) -> f64 {
        interpolate(&self.link_curve, bytes).unwrap_or(self.intra_gbps)
    }
}

/// `curve`'s value at `x`, linear in log(x) between its points, constant beyond its ends
/// (`None` for an empty curve).
fn interpolate(curve: &[(f64, f64)], x: f64) -> Option<f64> {
    let (&(x0, y0), &(x1, y1)) = (curve.first()?, curve.last()?);
    if x <= x0 {
        return Some(y0);
    }
    if x >= x1 {
        return Some(y1);
    }
    let i = curve.iter().position(|&(c, _)| c >= x)?;
    let ((xa, ya), (xb, yb)) = (curve[i - 1], curve[i]);
    Some(ya + (x.ln() - xa.ln()) / (xb.ln() - xa.ln()) * (yb - ya))
}

/// A time from FLOPs at `gflops` and bytes at `gbps`: the longer, in milliseconds.
fn roofline(flops: f64, gflops: f64, bytes: f64, gbps: f64) -> f64 {
    (flops / (gflops * 1e6)).max(bytes / (gbps * 1e6))
}

/// The predicted layer time of `shapes` under `routing` on `layout` with `c`'s rates.
pub fn predict(c: &Ceilings, shapes: &Shapes, routing: &Routing, layout: &Layout) -> Result<Prediction> {
    let (n, t) = (layout.ep, layout.tokens as f64);
    let (h, i, k) = (shapes.hidden as f64, shapes.inter as f64, shapes.top_k as f64);
    if n == 0 || layout.domain == 0 || layout.placement.ranks() != n || layout.placement.num_experts() != shapes.experts
    {
        return Err(MoeError::Config(format!(
            "simulate: a placement of {} experts on {} ranks for EP {n} with {} experts (domain {})",
            layout.placement.num_experts(),
            layout.placement.ranks(),
            shapes.experts,
            layout.domain
        )));
    }
    let shares = routing.shares(shapes.experts, shapes.top_k)?;
    let slots = n as f64 * t * k;
    // Per rank: expected rows.
    let mut rows = vec![0.0; n];
    // Per rank: each expert replica's expected rows and the chance it receives any.
    let mut replicas: Vec<Vec<(f64, f64)>> = vec![Vec::new(); n];
    let p = &layout.placement;
    for (e, &s) in shares.iter().enumerate() {
        let reps = p.replicas_of(e);
        // Replicas share an expert's rows only where it has enough of them.
        let reps = if slots * s >= c.replica_min_rows { reps } else { &reps[..1] };
        for &ph in reps {
            let q = s / reps.len() as f64;
            // A token picks k different experts, this one with chance k · q (shares are
            // capped at 1 / k): the replica sits unread only if every token passes it by.
            let hit = 1.0 - (1.0 - k * q).clamp(0.0, 1.0).powf(slots / k);
            rows[p.rank_of(ph)] += slots * q;
            replicas[p.rank_of(ph)].push((slots * q, hit));
        }
    }
    let mean = rows.iter().sum::<f64>() / n as f64;
    let busiest = rows.iter().fold(0.0f64, |m, &r| m.max(r));
    // Ranks sharing one device run their compute one after the other.
    let share_factor = if c.shared_device { n as f64 } else { 1.0 };
    let launch = c.launch_us * 1e-3;
    let router = share_factor
        * roofline(2.0 * t * h * shapes.experts as f64, c.router_gflops, 4.0 * h * shapes.experts as f64, c.mem_gbps)
        + launch;
    // The CPU layer copies f32 rows per (token, slot); the device layer reads and writes each
    // token's row once, and beyond one rank plans the dispatch on the host.
    let permuted = if c.rows_per_rank { 2.0 * t * h * shapes.row_bytes } else { t * k * h * 4.0 };
    let plan = if n > 1 { (c.host_plan_us + c.host_plan_ns_per_slot * 1e-3 * t * k) * 1e-3 } else { 0.0 };
    let permute = share_factor * roofline(0.0, 1.0, permuted, c.mem_gbps) + launch + plan;
    let weights = 3.0 * h * i * shapes.weight_bytes;
    let expert_time = |r: usize| {
        // Each expert's GEMM runs at the rate of its own rows: the CPU layer's one after
        // another, and a grouped GEMM's tiles likewise (the curve's rate at r rows is the
        // whole device's with every expert at r rows), so under skew the many small experts
        // cost what their rows allow rather than the mean's rate.
        let gemms: f64 = replicas[r]
            .iter()
            .map(|&(rows_e, hit)| {
                roofline(6.0 * rows_e * h * i, c.gemm_rate_on(rows_e / hit.max(1e-9), n), hit * weights, c.mem_gbps)
            })
            .sum();
        gemms + 3.0 * launch
    };
    let gemms = if c.shared_device {
        (0..n).map(|r| expert_time(r) - 3.0 * launch).sum::<f64>() + 3.0 * launch
    } else {
        (0..n).map(expert_time).fold(0.0, f64::max)
    };
    let shared_alone = if shapes.shared_inter == 0 {
        0.0
    } else {
        let si = shapes.shared_inter as f64;
        share_factor * roofline(6.0 * t * h * si, c.gemm_rate(t), 3.0 * h * si * shapes.weight_bytes, c.mem_gbps)
            + launch
    };
    // An exchange: rows (or outputs) leaving for other ranks, the busiest rank's share arriving.
    // The weighted sum of each token's k rows: the device layer reads them in the row format and
    // writes f32 outputs (one rank too); the CPU layer's f32 rows only after an exchange.
    let summed = if c.rows_per_rank {
        roofline(0.0, 1.0, t * k * h * shapes.row_bytes + t * h * 4.0, c.mem_gbps) + launch
    } else {
        roofline(0.0, 1.0, t * k * h * 4.0, c.mem_gbps)
    };
    let (dispatch, combine) = if n == 1 {
        (0.0, if c.rows_per_rank { summed } else { 0.0 })
    } else {
        let remote = (n - 1) as f64 / n as f64;
        // Rows a rank sends: per (token, slot), or per (token, rank serving it).
        let rows_out = if c.rows_per_rank {
            t * rows.iter().map(|r| 1.0 - (1.0 - r / slots).powf(k)).sum::<f64>() * remote
        } else {
            t * k * remote
        };
        let bytes_out = rows_out * h * shapes.row_bytes;
        let bytes = bytes_out * (busiest / mean.max(1e-300)).max(1.0);
        let inter_peers = n.saturating_sub(layout.domain) as f64 / (n - 1) as f64;
        let intra = c.intra_rate(bytes / (n - 1) as f64);
        let link = (bytes * (1.0 - inter_peers) / (intra * 1e6)).max(bytes * inter_peers / (c.inter_gbps * 1e6));
        let latency = c.intra_latency_us + if inter_peers > 0.0 { c.inter_latency_us } else { 0.0 };
        let one = (2.0 * c.call_us + latency) * 1e-3 + link;
        (one, one + summed)
    };
    // On a side stream the shared expert hides behind the dispatch and the routed GEMMs; the
    // layer then adds its output (f32 rows read twice, written once).
    let shared = if c.shared_overlaps && shapes.shared_inter > 0 {
        (shared_alone - dispatch - gemms).max(0.0) + roofline(0.0, 1.0, 3.0 * t * h * 4.0, c.mem_gbps) + launch
    } else {
        shared_alone
    };
    let total = router + permute + dispatch + gemms + combine + shared;
    Ok(Prediction {
        router,
        permute,
        dispatch,
        gemms,
        combine,
        shared,
        total,
        imbalance: if mean > 0.0 { busiest / mean } else { 1.0 },
    })
}

/// The placement the simulator assumes: contiguous, or EPLB's for the routing with
/// `redundant` replicas over nodes of `domain` ranks.
pub fn placement(
    shapes: &Shapes,
    routing: &Routing,
    ep: usize,
    domain: usize,
    eplb: Option<usize>,
) -> Result<ExpertPlacement> {
    match eplb {
        None => ExpertPlacement::contiguous(shapes.experts, ep),
        Some(redundant) => {
            let load = routing.shares(shapes.experts, shapes.top_k)?;
            let nodes = if domain < ep && ep.is_multiple_of(domain) { ep / domain } else { 1 };
            let groups = if shapes.experts.is_multiple_of(nodes) { nodes } else { 1 };
            let nodes = if groups == nodes { nodes } else { 1 };
            let per_node = ep / nodes;
            let redundant = redundant.min(shapes.experts * (per_node - 1));
            balance(&load, EplbConfig { ranks: ep, nodes, redundant, groups })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu() -> Ceilings {
        Ceilings {
            name: "test".into(),
            gemm_gflops: 600e3,
            router_gflops: 50e3,
            mem_gbps: 3000.0,
            launch_us: 5.0,
            intra_gbps: 150.0,
            intra_latency_us: 10.0,
            inter_gbps: 40.0,
            inter_latency_us: 20.0,
            call_us: 10.0,
            shared_device: false,
            rows_per_rank: true,
            shared_overlaps: false,
            host_plan_us: 0.0,
            host_plan_ns_per_slot: 0.0,
            replica_min_rows: 0.0,
            probe_gflops: 0.0,
            gemm_curve: Vec::new(),
            shared_gemm_curve: Vec::new(),
            link_curve: Vec::new(),
        }
    }

    #[test]
    fn the_gemm_rate_follows_its_curve() {
        let c = Ceilings { gemm_curve: vec![(1.0, 10.0), (100.0, 110.0)], ..gpu() };
        assert_eq!(c.gemm_rate(0.5), 10.0);
        assert!((c.gemm_rate(10.0) - 60.0).abs() < 1e-9);
        assert_eq!(c.gemm_rate(1e4), 110.0);
        assert_eq!(gpu().gemm_rate(5.0), 600e3);
    }

    fn deepseek() -> Shapes {
        Shapes {
            hidden: 7168,
            inter: 2048,
            experts: 256,
            top_k: 8,
            shared_inter: 2048,
            weight_bytes: 2.0,
            row_bytes: 2.0,
        }
    }

    #[test]
    fn each_expert_takes_the_rate_of_its_own_rows() {
        // A rate that rises with rows per expert: under skew the many small experts run slowly.
        let c = Ceilings { gemm_curve: vec![(1.0, 50e3), (4096.0, 600e3)], ..gpu() };
        let s = deepseek();
        let gemms = |routing: &Routing| {
            let placement = placement(&s, routing, 1, 8, None).unwrap();
            predict(&c, &s, routing, &Layout { ep: 1, domain: 8, tokens: 4096, placement }).unwrap().gemms
        };
        // Uniform routing: every expert has the mean rows (128), so the rate is the mean's.
        let flops = 6.0 * 4096.0 * 8.0 * (s.hidden * s.inter) as f64;
        let at_mean = flops / (c.gemm_rate(128.0) * 1e6) + 3.0 * c.launch_us * 1e-3;
        let uniform = gemms(&Routing::Uniform);
        assert!((uniform - at_mean).abs() < 1e-3 * at_mean, "{uniform} vs {at_mean}");
        // Skewed: the cold experts' small GEMMs cost more than the mean's rate says.
        assert!(gemms(&Routing::Zipf(1.2)) > 1.1 * at_mean);
    }

    #[test]
    fn a_side_stream_hides_the_shared_expert_and_the_host_plan_costs_beyond_one_rank() {
        let s = deepseek();
        let run = |c: &Ceilings, ep: usize, tokens: usize| {
            let placement = placement(&s, &Routing::Uniform, ep, 8, None).unwrap();
            predict(c, &s, &Routing::Uniform, &Layout { ep, domain: 8, tokens, placement }).unwrap()
        };
        let after = gpu();
        let beside = Ceilings { shared_overlaps: true, ..gpu() };
        for ep in [1, 2] {
            let (a, b) = (run(&after, ep, 4096), run(&beside, ep, 4096));
            // Beside the routed GEMMs only its output's sum remains.
            assert!(b.shared < 0.25 * a.shared && b.total < a.total, "EP {ep}: {b:?} vs {a:?}");
            assert_eq!((a.router, a.gemms), (b.router, b.gemms));
        }
        let planned = Ceilings { host_plan_us: 100.0, host_plan_ns_per_slot: 10.0, ..gpu() };
        assert_eq!(run(&planned, 1, 4096).permute, run(&gpu(), 1, 4096).permute);
        let grown = run(&planned, 2, 4096).permute - run(&gpu(), 2, 4096).permute;
        assert!((grown - (0.1 + 10.0 * 4096.0 * 8.0 * 1e-6)).abs() < 1e-9, "{grown}");
    }

    #[test]
    fn a_slower_pace_slows_the_compute_alone() {
        let s = deepseek();
        let run = |c: &Ceilings, tokens: usize| {
            let placement = placement(&s, &Routing::Uniform, 2, 8, None).unwrap();
            predict(c, &s, &Routing::Uniform, &Layout { ep: 2, domain: 8, tokens, placement }).unwrap()
        };
        let c = Ceilings { probe_gflops: 500.0, gemm_curve: vec![(1.0, 100.0), (100.0, 400.0)], ..gpu() };
        let slow = c.at_pace(400.0);
        assert_eq!(slow.gemm_curve, vec![(1.0, 80.0), (100.0, 320.0)]);
        assert_eq!((slow.gemm_gflops, slow.router_gflops), (0.8 * c.gemm_gflops, 0.8 * c.router_gflops));
        let (fast, late) = (run(&c, 4096), run(&slow, 4096));
        assert!(late.gemms > 1.2 * fast.gemms && late.router > fast.router, "{late:?} vs {fast:?}");
        assert_eq!((late.dispatch, late.combine), (fast.dispatch, fast.combine));
        // Unknown paces leave the ceilings as they are.
        assert_eq!(c.at_pace(0.0), c);
        assert_eq!(gpu().at_pace(400.0), gpu());
    }

    #[test]
    fn ranks_sharing_a_device_take_their_own_gemm_curve_beyond_one_rank() {
        let s = deepseek();
        let run = |c: &Ceilings, ep: usize| {
            let placement = placement(&s, &Routing::Uniform, ep, 8, None).unwrap();
            predict(c, &s, &Routing::Uniform, &Layout { ep, domain: 8, tokens: 512, placement }).unwrap().gemms
        };
        let alone = Ceilings { shared_device: true, gemm_curve: vec![(1.0, 400.0), (1e4, 400.0)], ..gpu() };
        let contended = Ceilings { shared_gemm_curve: vec![(1.0, 200.0), (1e4, 200.0)], ..alone.clone() };
        assert_eq!(contended.gemm_rate_on(64.0, 1), 400.0);
        assert_eq!(contended.gemm_rate_on(64.0, 2), 200.0);
        // One rank keeps the one-rank curve; two ranks sharing the device take twice as long.
        assert_eq!(run(&contended, 1), run(&alone, 1));
        let (a, b) = (run(&alone, 2), run(&contended, 2));
        assert!((b / a - 2.0).abs() < 0.05, "{b} vs {a}");
        // Separate devices ignore it.
        let apart = Ceilings { shared_device: false, ..contended.clone() };
        assert_eq!(apart.gemm_rate_on(64.0, 2), 400.0);
        assert_eq!(contended.at_pace(0.0), contended);
    }

    #[test]
    fn replicas_share_only_experts_with_enough_rows() {
        let s = deepseek();
        let hot: Vec<usize> = (0..16).collect();
        let gemms = |c: &Ceilings, replicas: bool, tokens: usize| {
            let p = ExpertPlacement::contiguous(256, 2).unwrap();
            let placement = if replicas { p.with_replicas(&hot).unwrap() } else { p };
            predict(c, &s, &Routing::Uniform, &Layout { ep: 2, domain: 8, tokens, placement }).unwrap().gemms
        };
        let always = gpu();
        let from_128 = Ceilings { replica_min_rows: 128.0, ..gpu() };
        // 128 tokens a rank: 8 rows an expert, weight-bound: shared replicas read 16 more
        // experts on the second rank; unshared, the layout costs what it costs without them.
        assert!(gemms(&always, true, 128) > 1.05 * gemms(&always, false, 128));
        assert_eq!(gemms(&from_128, true, 128), gemms(&from_128, false, 128));
        // 4096 tokens: 256 rows an expert, shared either way.
        assert_eq!(gemms(&from_128, true, 4096), gemms(&always, true, 4096));
    }

    #[test]
    fn a_token_reads_its_k_different_experts() {
        // Memory-bound experts: one token reads exactly k experts' weights (k different picks,
        // not k independent ones, which would hit fewer), and many tokens read every expert.
        let s = Shapes { experts: 16, top_k: 8, shared_inter: 0, ..deepseek() };
        let c = Ceilings { gemm_gflops: 1e12, ..gpu() };
        let run = |tokens: usize| {
            let placement = placement(&s, &Routing::Uniform, 1, 8, None).unwrap();
            predict(&c, &s, &Routing::Uniform, &Layout { ep: 1, domain: 8, tokens, placement }).unwrap().gemms
        };
        let expert = 3.0 * (s.hidden * s.inter) as f64 * s.weight_bytes / (c.mem_gbps * 1e6);
        let launches = 3.0 * c.launch_us * 1e-3;
        let read = |tokens: usize| (run(tokens) - launches) / expert;
        assert!((read(1) - 8.0).abs() < 1e-6, "one token read {} experts", read(1));
        assert!((read(64) - 16.0).abs() < 1e-6, "64 tokens read {} experts", read(64));
    }

    #[test]
    fn shares_sum_to_one_and_respect_the_cap() {
        for r in [Routing::Uniform, Routing::Zipf(1.2), Routing::Zipf(4.0), Routing::Load(vec![5.0; 256])] {
            let s = r.shares(256, 8).unwrap();
            assert!((s.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{r:?}");
            assert!(s.iter().all(|&v| v <= 1.0 / 8.0 + 1e-9), "{r:?}");
        }
        assert!(Routing::Load(vec![1.0; 3]).shares(4, 2).is_err());
        assert!(Routing::Load(vec![0.0; 4]).shares(4, 2).is_err());
    }

    #[test]
    fn skew_slows_the_layer_and_eplb_wins_it_back() {
        let (c, s) = (gpu(), deepseek());
        let run = |routing: &Routing, ep: usize, eplb: Option<usize>| {
            let placement = placement(&s, routing, ep, 8, eplb).unwrap();
            predict(&c, &s, routing, &Layout { ep, domain: 8, tokens: 4096, placement }).unwrap()
        };
        let zipf = Routing::Zipf(1.2);
        for ep in [8, 32, 256] {
            let (flat, skewed, balanced) =
                (run(&Routing::Uniform, ep, None), run(&zipf, ep, None), run(&zipf, ep, Some(ep)));
            assert!(skewed.total > 1.2 * flat.total, "EP {ep}: {} vs {}", skewed.total, flat.total);
            assert!(balanced.total < skewed.total && balanced.imbalance < skewed.imbalance, "EP {ep}");
        }
        // Leaving the NVLink domain costs: the same layout with a slow inter-node link is slower.
        let slow = Ceilings { inter_gbps: 5.0, ..gpu() };
        let placement = placement(&s, &Routing::Uniform, 16, 8, None).unwrap();
        let l = Layout { ep: 16, domain: 8, tokens: 4096, placement };
        assert!(
            predict(&slow, &s, &Routing::Uniform, &l).unwrap().dispatch
                > predict(&c, &s, &Routing::Uniform, &l).unwrap().dispatch
        );
        // One rank moves nothing: its combine is the weighted sum alone.
        let one = run(&Routing::Uniform, 1, None);
        assert_eq!(one.dispatch, 0.0);
        assert!(one.combine > 0.0 && one.combine < run(&Routing::Uniform, 2, None).combine, "{one:?}");
    }
}
