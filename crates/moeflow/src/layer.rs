//! `MoeLayer`, the modular kernel: router → prepare → experts → finalize (+ shared experts).

use crate::backend::cpu::gemm::Segment;
use crate::backend::cpu::packed::PackedStack;
use crate::config::{MoeConfig, MoeWeights};
use crate::dispatch::{DispatchInput, Local, PrepareFinalize};
use crate::error::{check_finite, MoeError, Result};
use crate::experts::{BatchedInput, CpuExperts, ExpertInput, Experts, ReferenceExperts};
use crate::router::{Router, TopK};
use crate::tensor::Tensor;
use crate::DType;
use std::sync::Mutex;
use std::time::Instant;

/// Which expert implementation a layer runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertsKind {
    /// Packed grouped GEMMs on threads (the fast path).
    #[default]
    Cpu,
    /// The f64 reference experts (slow; weights and reduces itself).
    Reference,
}

/// How a layer runs, beyond what the model defines.
pub struct LayerOptions {
    /// Rows given to the experts at a time (`None`: all at once).
    pub chunk_size: Option<usize>,
    /// Expert implementation.
    pub experts: ExpertsKind,
    /// Dispatch/combine strategy.
    pub strategy: Box<dyn PrepareFinalize>,
}

impl Default for LayerOptions {
    fn default() -> Self {
        LayerOptions { chunk_size: None, experts: ExpertsKind::Cpu, strategy: Box::new(Local) }
    }
}

/// Reusable scratch memory, sized by the experts implementation; share one across layers.
#[derive(Debug, Default)]
pub struct Workspace {
    experts: Vec<f32>,
    expert_out: Vec<f32>,
    shared: Vec<f32>,
}

impl Workspace {
    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        4 * (self.experts.capacity() + self.expert_out.capacity() + self.shared.capacity())
    }
}

/// Wall time of each stage of one forward, in seconds.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct StageTimes {
    /// Router GEMM and top-k.
    pub route: f64,
    /// Quantize + dispatch.
    pub prepare: f64,
    /// Permute, expert GEMMs, unpermute.
    pub experts: f64,
    /// Weight-and-reduce + combine.
    pub finalize: f64,
    /// Shared experts.
    pub shared: f64,
}

impl StageTimes {
    /// Sum of the stages.
    pub fn total(&self) -> f64 {
        self.route + self.prepare + self.experts + self.finalize + self.shared
    }
}

/// One MoE block, ready to run.
pub struct MoeLayer {
    config: MoeConfig,
    router: Box<dyn Router>,
    gate: PackedStack,
    gate_bias: Option<Vec<f32>>,
    experts: Box<dyn Experts>,
    strategy: Box<dyn PrepareFinalize>,
    shared: Option<(CpuExperts, Option<Vec<f32>>)>,
    chunk_size: Option<usize>,
    workspace: Mutex<Workspace>,
}

impl MoeLayer {
    /// Validates `weights` against `config` and prepares them (packing for the CPU GEMM).
    pub fn new(config: &MoeConfig, weights: &MoeWeights, options: LayerOptions) -> Result<Self> {
        weights.validate(config)?;
        if options.chunk_size == Some(0) {
            return Err(MoeError::Config("chunk size must be positive".into()));
        }
        let (e, h) = (config.num_experts, config.hidden);
        let router = config.router.build(e, config.top_k, weights.correction_bias.as_ref().map(|b| b.to_f32_vec()))?;
        let local = match options.strategy.local_experts() {
            Some(ids) => weights.experts.select(&ids)?,
            None => weights.experts.clone(),
        };
        let experts: Box<dyn Experts> = match options.experts {
            ExpertsKind::Cpu => Box::new(CpuExperts::new(&local, config.activation)?),
            ExpertsKind::Reference => Box::new(ReferenceExperts::new(&local, config.activation)?),
        };
        let format = options.strategy.activation_format();
        if !experts.supports(format) {
            return Err(MoeError::Config(format!(
                "strategy '{}' produces {format:?} activations, which experts '{}' do not take",
                options.strategy.name(),
                experts.name(),
            )));
        }
        let shared = match &weights.shared {
            None => None,
            Some(s) => Some((CpuExperts::new(&s.mlp, config.activation)?, s.gate.as_ref().map(|g| g.to_f32_vec()))),
        };
        Ok(MoeLayer {
            config: config.clone(),
            router,
            gate: PackedStack::from_tensor(&weights.gate.to_dtype(DType::F32), 1, e, h),
            gate_bias: weights.gate_bias.as_ref().map(|b| b.to_f32_vec()),
            experts,
            strategy: options.strategy,
            shared,
            chunk_size: options.chunk_size,
            workspace: Mutex::new(Workspace::default()),
        })
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// Name of the dispatch strategy.
    pub fn strategy_name(&self) -> &'static str {
        self.strategy.name()
    }

    /// Bytes this rank sent in the last forward (dispatch and combine).
    pub fn bytes_moved(&self) -> usize {
        self.strategy.bytes_moved()
    }

    /// `hidden_states [T, H]` (f32, bf16 or f16) → `[T, H]` f32.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.forward_profiled(hidden)?.0)
    }

    /// As [`MoeLayer::forward`], also returning per-stage times.
    pub fn forward_profiled(&self, hidden: &Tensor) -> Result<(Tensor, StageTimes)> {
        let x = self.check_hidden(hidden)?;
        let tokens = hidden.shape()[0];
        let mut ws = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        let mut times = StageTimes::default();
        let t0 = Instant::now();
        let (topk, logits) = if self.strategy.routes_after_dispatch() {
            let logits = self.logits(&x, tokens);
            crate::error::check_finite("router logits", &logits)?;
            (TopK { tokens: 0, k: self.config.top_k, ids: vec![], weights: vec![] }, logits)
        } else {
            (self.route_f32(&x, tokens)?, Vec::new())
        };
        times.route = t0.elapsed().as_secs_f64();
        let out = self.forward_routed(&x, tokens, &topk, &logits, &mut ws, &mut times)?;
        Ok((Tensor::from_f32(&[tokens, self.config.hidden], out)?, times))
    }

    /// The routing this layer gives `hidden_states [T, H]`.
    pub fn route(&self, hidden: &Tensor) -> Result<TopK> {
        let x = self.check_hidden(hidden)?;
        self.route_f32(&x, hidden.shape()[0])
    }

    /// Runs the layer with a given routing instead of the router (for tests and replays).
    pub fn forward_with_routing(&self, hidden: &Tensor, topk: &TopK) -> Result<Tensor> {
        let x = self.check_hidden(hidden)?;
        let tokens = hidden.shape()[0];
        if topk.tokens != tokens || topk.k != self.config.top_k {
            return Err(MoeError::shape("top-k routing [T, k]", [tokens, self.config.top_k], [topk.tokens, topk.k]));
        }
        topk.validate(self.config.num_experts)?;
        let mut ws = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        if self.strategy.routes_after_dispatch() {
            return Err(MoeError::Config(format!(
                "strategy '{}' routes after dispatch: it cannot take a routing",
                self.strategy.name()
            )));
        }
        let out = self.forward_routed(&x, tokens, topk, &[], &mut ws, &mut StageTimes::default())?;
        Tensor::from_f32(&[tokens, self.config.hidden], out)
    }

    /// Bytes of the scratch memory held after the largest call so far.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.lock().map(|w| w.bytes()).unwrap_or(0)
    }

    fn check_hidden(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        let s = hidden.shape();
        if s.len() != 2 || s[1] != self.config.hidden {
            return Err(MoeError::shape("hidden_states", format!("[T, {}]", self.config.hidden), s));
        }
        if !matches!(hidden.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(MoeError::DType {
                what: "hidden_states".into(),
                expected: "f32, bf16 or f16".into(),
                got: hidden.dtype().to_string(),
            });
        }
        let x = hidden.to_f32_vec();
        check_finite("hidden_states", &x)?;
        Ok(x)
    }

    fn logits(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let e = self.config.num_experts;
        let mut logits = vec![0f32; tokens * e];
        self.gate.gemm(x, self.config.hidden, &[Segment { expert: 0, row_start: 0, rows: tokens }], &mut logits, e);
        if let Some(b) = &self.gate_bias {
            for row in logits.chunks_mut(e) {
                row.iter_mut().zip(b).for_each(|(l, b)| *l += b);
            }
        }
        logits
    }

    fn route_f32(&self, x: &[f32], tokens: usize) -> Result<TopK> {
        self.router.route(&self.logits(x, tokens), tokens)
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_routed(
        &self,
        x: &[f32],
        tokens: usize,
        topk: &TopK,
        logits: &[f32],
        ws: &mut Workspace,
        times: &mut StageTimes,
    ) -> Result<Vec<f32>> {
        let h = self.config.hidden;
        let t = Instant::now();
        let input = DispatchInput {
            hidden: x,
            hidden_size: h,
            tokens,
            topk,
            logits,
            router: self.router.as_ref(),
            extras: &[],
            weights_on_input: self.config.apply_router_weight_on_input,
        };
        let prepared = self.strategy.prepare(input)?;
        times.prepare = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let reduce = self.experts.weight_and_reduce();
        if let Some(layout) = &prepared.batched {
            let rows = layout.counts.len() * layout.capacity;
            ws.expert_out.resize(rows * h, 0.0);
            ws.experts.resize(self.experts.batched_workspace_len(rows), 0.0);
            let input = BatchedInput { hidden: &prepared.hidden, capacity: layout.capacity, counts: &layout.counts };
            self.experts.apply_batched(&input, &mut ws.experts, &mut ws.expert_out)?;
        } else {
            let rows = prepared.topk.tokens;
            let k = prepared.topk.k;
            let out_len = reduce.expert_output_len(rows, k, h);
            ws.expert_out.resize(out_len, 0.0);
            let chunk = self.chunk_size.unwrap_or(rows).max(1);
            let per_row = reduce.expert_output_len(1, k, h);
            ws.experts.resize(self.experts.workspace_len(chunk.min(rows), k), 0.0);
            let map = prepared.expert_map.as_deref();
            let mut start = 0;
            while start < rows {
                let end = (start + chunk).min(rows);
                let input = ExpertInput {
                    hidden: &prepared.hidden[start * h..end * h],
                    tokens: end - start,
                    ids: &prepared.topk.ids[start * k..end * k],
                    weights: &prepared.topk.weights[start * k..end * k],
                    k,
                    expert_map: map,
                    weights_applied: prepared.weights_applied,
                };
                self.experts.apply(&input, &mut ws.experts, &mut ws.expert_out[start * per_row..end * per_row])?;
                start = end;
            }
        }
        times.experts = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut out = vec![0f32; tokens * h];
        self.strategy.finalize(&prepared, &ws.expert_out, reduce, &mut out)?;
        times.finalize = t.elapsed().as_secs_f64();

        let t = Instant::now();
        if let Some((mlp, gate)) = &self.shared {
            let mut y = vec![0f32; tokens * h];
            mlp.dense_forward(x, tokens, &mut ws.shared, &mut y);
            for (ti, (o, yr)) in out.chunks_mut(h).zip(y.chunks(h)).enumerate() {
                let g = gate.as_ref().map_or(1.0, |g| {
                    let z: f32 = x[ti * h..(ti + 1) * h].iter().zip(g).map(|(a, b)| a * b).sum();
                    1.0 / (1.0 + (-z).exp())
                });
                o.iter_mut().zip(yr).for_each(|(o, &v)| *o += g * v);
            }
        }
        times.shared = t.elapsed().as_secs_f64();
        Ok(out)
    }
}
