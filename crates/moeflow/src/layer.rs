//! `MoeLayer`, the modular kernel: router → prepare → experts → finalize (+ shared experts).

use crate::backend::cpu::dot::Bf16Matmul;
use crate::backend::cpu::gemm::{Rows, Segment};
use crate::backend::cpu::packed::PackedStack;
use crate::config::{MoeConfig, MoeWeights};
use crate::dispatch::{finalize_async, prepare_async, DispatchInput, Local, PrepareFinalize, Prepared};
use crate::error::{check_finite, MoeError, Result};
use crate::experts::{BatchedInput, CpuExperts, ExpertInput, Experts};
use crate::load_stats::LoadStats;
use crate::router::{Router, TopK};
use crate::tensor::Tensor;
use crate::DType;
use std::sync::Mutex;
use std::time::Instant;

pub(crate) mod rebalance;

/// Which expert implementation a layer runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertsKind {
    /// Packed grouped GEMMs on threads (the fast path).
    #[default]
    Cpu,
    /// The f64 reference experts (slow; weights and reduces itself).
    Reference,
    /// bf16 GEMMs on CUDA GPU `device` (feature `cuda`).
    Cuda {
        /// Device ordinal.
        device: usize,
    },
}

/// How a layer runs, beyond what the model defines.
pub struct LayerOptions {
    /// Rows given to the experts at a time (`None`: all at once).
    pub chunk_size: Option<usize>,
    /// Expert implementation.
    pub experts: ExpertsKind,
    /// Dispatch/combine strategy.
    pub strategy: Box<dyn PrepareFinalize>,
    /// Format rows are quantized to before dispatch (the CPU experts then take that input).
    pub quant: crate::quant::QuantConfig,
    /// The experts quantize their input on arrival instead (rows travel unquantized).
    pub defer_input_quant: bool,
    /// Dual-batch overlap: a second instance of the strategy (on its own communicator) for
    /// micro-batch 1, which then runs concurrently with micro-batch 0 so that one's
    /// communication overlaps the other's expert compute.
    pub dual_batch: Option<Box<dyn PrepareFinalize>>,
    /// How the CPU experts multiply bf16 weights (default: `Auto`; f32 weights are unaffected).
    pub bf16_matmul: Bf16Matmul,
    /// Return outputs holding NaN or infinity instead of an error (default: false).
    pub allow_nonfinite: bool,
    /// Keep this rank's expert weights as given beside the packed ones, so that
    /// [`MoeLayer::rebalance`] can send them to other ranks (default: false; costs one more
    /// copy of the rank's experts).
    pub rebalanceable: bool,
}

impl Default for LayerOptions {
    fn default() -> Self {
        LayerOptions {
            chunk_size: None,
            experts: ExpertsKind::Cpu,
            strategy: Box::new(Local),
            dual_batch: None,
            quant: crate::quant::QuantConfig::None,
            defer_input_quant: false,
            bf16_matmul: Bf16Matmul::Auto,
            allow_nonfinite: false,
            rebalanceable: false,
        }
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
    /// Strategy of micro-batch 1 under dual-batch overlap.
    second: Option<Box<dyn PrepareFinalize>>,
    shared: Option<(CpuExperts, Option<Vec<f32>>)>,
    chunk_size: Option<usize>,
    /// Whether an output holding NaN or infinity is returned instead of refused.
    allow_nonfinite: bool,
    /// One workspace per micro-batch.
    workspace: [Mutex<Workspace>; 2],
    /// Tokens per logical expert of this rank's recent forward calls.
    load: Mutex<LoadStats>,
    /// What [`MoeLayer::rebalance`] rebuilds the experts from (rebalanceable layers only).
    kept: Option<rebalance::KeptExperts>,
}

/// The result of a joined prepare thread.
fn joined<'a>(r: std::thread::Result<Result<Prepared<'a>>>) -> Result<Prepared<'a>> {
    r.unwrap_or_else(|_| Err(MoeError::Config("prepare panicked".into())))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
        let recipe = rebalance::ExpertsRecipe {
            kind: options.experts,
            activation: config.activation,
            quant: options.quant,
            defer_input_quant: options.defer_input_quant,
            bf16_matmul: options.bf16_matmul,
        };
        let experts = recipe.build(&local)?;
        if experts.input_quant() != options.quant {
            return Err(MoeError::Config(format!(
                "experts '{}' do not take {} input; quantized dispatch needs the cpu experts",
                experts.name(),
                options.quant
            )));
        }
        let format = options.strategy.activation_format();
        if !experts.supports(format) {
            return Err(MoeError::Config(format!(
                "strategy '{}' produces {format:?} activations, which experts '{}' do not take",
                options.strategy.name(),
                experts.name(),
            )));
        }
        if let Some(second) = &options.dual_batch {
            if second.local_experts() != options.strategy.local_experts() || second.activation_format() != format {
                return Err(MoeError::Config("the dual-batch strategy must match the main one".into()));
            }
        }
        let shared = match &weights.shared {
            None => None,
            Some(s) => Some((
                CpuExperts::new(&s.mlp, config.activation, options.bf16_matmul)?,
                s.gate.as_ref().map(|g| g.to_f32_vec()),
            )),
        };
        Ok(MoeLayer {
            config: config.clone(),
            router,
            gate: PackedStack::from_tensor(&weights.gate.to_dtype(DType::F32), 1, e, h, Bf16Matmul::Widen),
            gate_bias: weights.gate_bias.as_ref().map(|b| b.to_f32_vec()),
            experts,
            strategy: options.strategy,
            second: options.dual_batch,
            shared,
            chunk_size: options.chunk_size,
            allow_nonfinite: options.allow_nonfinite,
            workspace: Default::default(),
            load: Mutex::new(LoadStats::new(e, crate::load_stats::DEFAULT_WINDOW)),
            kept: options.rebalanceable.then_some(rebalance::KeptExperts { weights: local, recipe }),
        })
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The same layer keeping the load statistics of the last `window` calls (default
    /// [`crate::load_stats::DEFAULT_WINDOW`]).
    pub fn with_load_window(self, window: usize) -> Self {
        *lock(&self.load) = LoadStats::new(self.config.num_experts, window);
        self
    }

    /// Tokens per logical expert of this rank's last forward calls (routed here, wherever
    /// their experts run).
    pub fn load_stats(&self) -> LoadStats {
        lock(&self.load).clone()
    }

    /// Name of the dispatch strategy.
    pub fn strategy_name(&self) -> &'static str {
        self.strategy.name()
    }

    /// `hidden_states [T, H]` (f32, bf16 or f16) → `[T, H]` f32.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.forward_profiled(hidden)?.0)
    }

    /// As [`MoeLayer::forward`], also returning per-stage times (of micro-batch 0 under dual-batch
    /// overlap).
    pub fn forward_profiled(&self, hidden: &Tensor) -> Result<(Tensor, StageTimes)> {
        let x = self.check_hidden(hidden)?;
        let tokens = hidden.shape()[0];
        let (out, times) = self.forward_checked(&x, tokens)?;
        Ok((Tensor::from_f32(&[tokens, self.config.hidden], out)?, times))
    }

    /// `hidden_states [tokens, H]` f32, read in place, → `[tokens, H]` f32: [`MoeLayer::forward`]
    /// for callers that hold the rows in memory of their own (the Python package reads the
    /// caller's array through it without copying).
    pub fn forward_f32(&self, hidden: &[f32], tokens: usize) -> Result<Vec<f32>> {
        let h = self.config.hidden;
        if tokens.checked_mul(h) != Some(hidden.len()) {
            return Err(MoeError::shape(
                "hidden_states",
                format!("[{tokens}, {h}]"),
                format!("{} values", hidden.len()),
            ));
        }
        self.config.check_batch(tokens)?;
        check_finite("hidden_states", hidden)?;
        Ok(self.forward_checked(hidden, tokens)?.0)
    }

    /// The forward of checked rows `x [tokens, H]`, with its stage times.
    fn forward_checked(&self, x: &[f32], tokens: usize) -> Result<(Vec<f32>, StageTimes)> {
        let mut times = StageTimes::default();
        let t0 = Instant::now();
        let (topk, logits) = if self.strategy.routes_after_dispatch() {
            let logits = self.logits(x, tokens);
            crate::error::check_finite("router logits", &logits)?;
            // The strategy routes every rank's tokens after the dispatch; this rank's own
            // routing, for the load statistics, is a top-k over its logits.
            lock(&self.load).record(&self.router.route(&logits, tokens)?.ids);
            (TopK { tokens, k: self.config.top_k, ids: vec![], weights: vec![] }, logits)
        } else {
            let topk = self.route_f32(x, tokens)?;
            lock(&self.load).record(&topk.ids);
            (topk, Vec::new())
        };
        times.route = t0.elapsed().as_secs_f64();
        let out = self.forward_batches(x, tokens, &topk, &logits, &mut times)?;
        self.check_output(&out)?;
        Ok((out, times))
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
        if self.strategy.routes_after_dispatch() {
            return Err(MoeError::Config(format!(
                "strategy '{}' routes after dispatch: it cannot take a routing",
                self.strategy.name()
            )));
        }
        lock(&self.load).record(&topk.ids);
        let out = self.forward_batches(&x, tokens, topk, &[], &mut StageTimes::default())?;
        self.check_output(&out)?;
        Tensor::from_f32(&[tokens, self.config.hidden], out)
    }

    /// One batch, or two micro-batches overlapped (each with its own strategy and workspace):
    /// micro-batch 1's dispatch runs during micro-batch 0's experts, and micro-batch 0's combine
    /// during micro-batch 1's experts.
    fn forward_batches(
        &self,
        x: &[f32],
        tokens: usize,
        topk: &TopK,
        logits: &[f32],
        times: &mut StageTimes,
    ) -> Result<Vec<f32>> {
        let Some(second) = &self.second else {
            let mut ws = lock(&self.workspace[0]);
            return self.forward_routed(self.strategy.as_ref(), &mut ws, x, tokens, topk, logits, times);
        };
        let (h, e) = (self.config.hidden, self.config.num_experts);
        let t0 = tokens.div_ceil(2);
        let (x0, x1) = x.split_at(t0 * h);
        let (k0, k1) = (topk.slice(0, t0), topk.slice(t0, tokens));
        let (l0, l1) = if logits.is_empty() { (logits, logits) } else { logits.split_at(t0 * e) };
        let (mut g0, mut g1) = (lock(&self.workspace[0]), lock(&self.workspace[1]));
        let (ws0, ws1) = (&mut *g0, &mut *g1);
        let (first, second) = (self.strategy.as_ref(), second.as_ref());
        let start = Instant::now();
        let (p0, p1, shared) = std::thread::scope(|s| -> Result<_> {
            let d0 = prepare_async(s, first, self.dispatch_input(x0, t0, &k0, l0));
            let d1 = prepare_async(s, second, self.dispatch_input(x1, tokens - t0, &k1, l1));
            let shared = self.shared_experts(x, tokens, &mut ws0.shared);
            let p0 = joined(d0.join())?;
            times.prepare = start.elapsed().as_secs_f64();
            self.run_experts(&p0, ws0)?;
            Ok((p0, joined(d1.join())?, shared))
        })?;
        times.experts = start.elapsed().as_secs_f64() - times.prepare;
        let reduce = self.experts.weight_and_reduce();
        let (mut out, mut out1) = (vec![0f32; t0 * h], vec![0f32; (tokens - t0) * h]);
        let finalize_start = Instant::now();
        std::thread::scope(|s| -> Result<()> {
            let f0 = finalize_async(s, first, &p0, &ws0.expert_out, reduce, &mut out);
            self.run_experts(&p1, ws1)?;
            second.finalize(&p1, &ws1.expert_out, reduce, &mut out1)?;
            f0.join().unwrap_or_else(|_| Err(MoeError::Config("finalize panicked".into())))
        })?;
        times.finalize = finalize_start.elapsed().as_secs_f64();
        out.extend(out1);
        if let Some(y) = shared {
            out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
        }
        Ok(out)
    }

    /// Bytes this rank sent in the last forward (dispatch and combine, both micro-batches).
    pub fn bytes_moved(&self) -> usize {
        self.strategy.bytes_moved() + self.second.as_ref().map_or(0, |s| s.bytes_moved())
    }

    /// Bytes of the scratch memory held after the largest call so far.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.iter().map(|w| lock(w).bytes()).sum()
    }

    /// Refuses an output holding NaN or infinity unless the options allow it.
    fn check_output(&self, out: &[f32]) -> Result<()> {
        if self.allow_nonfinite {
            return Ok(());
        }
        crate::error::check_output(out, self.config.hidden)
    }

    fn check_hidden(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        let s = hidden.shape();
        if s.len() != 2 || s[1] != self.config.hidden {
            return Err(MoeError::shape("hidden_states", format!("[T, {}]", self.config.hidden), s));
        }
        self.config.check_batch(s[0])?;
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
        // Rows in blocks of 24, so the GEMM has tasks for every thread even with few experts.
        let rows: Vec<Segment> = (0..tokens)
            .step_by(24)
            .map(|row_start| Segment { expert: 0, row_start, rows: 24.min(tokens - row_start) })
            .collect();
        self.gate.gemm(x, Rows::strided(self.config.hidden), &rows, &mut logits, Rows::strided(e));
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

    /// Prepare (shared experts run meanwhile), experts, finalize, for one (micro-)batch.
    #[allow(clippy::too_many_arguments)]
    fn forward_routed(
        &self,
        strategy: &dyn PrepareFinalize,
        ws: &mut Workspace,
        x: &[f32],
        tokens: usize,
        topk: &TopK,
        logits: &[f32],
        times: &mut StageTimes,
    ) -> Result<Vec<f32>> {
        let h = self.config.hidden;
        let t = Instant::now();
        let input = self.dispatch_input(x, tokens, topk, logits);
        let (prepared, shared) = if self.shared.is_none() {
            // Nothing to compute while the dispatch runs, so no thread to start for it (starting
            // one costs a visible share of a one-token forward; docs/tuning.md).
            (strategy.prepare(input), None)
        } else {
            std::thread::scope(|s| {
                let dispatch = prepare_async(s, strategy, input);
                let shared = self.shared_experts(x, tokens, &mut ws.shared);
                times.shared = t.elapsed().as_secs_f64();
                (joined(dispatch.join()), shared)
            })
        };
        let prepared = prepared?;
        times.prepare = t.elapsed().as_secs_f64();

        let t = Instant::now();
        self.run_experts(&prepared, ws)?;
        let reduce = self.experts.weight_and_reduce();
        times.experts = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut out = vec![0f32; tokens * h];
        strategy.finalize(&prepared, &ws.expert_out, reduce, &mut out)?;
        times.finalize = t.elapsed().as_secs_f64();
        if let Some(y) = shared {
            out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
        }
        Ok(out)
    }

    fn dispatch_input<'a>(
        &'a self,
        x: &'a [f32],
        tokens: usize,
        topk: &'a TopK,
        logits: &'a [f32],
    ) -> DispatchInput<'a> {
        DispatchInput {
            hidden: x,
            hidden_size: self.config.hidden,
            tokens,
            topk,
            logits,
            router: self.router.as_ref(),
            extras: &[],
            weights_on_input: self.config.apply_router_weight_on_input,
            quant: if self.experts.defer_input_quant() {
                crate::quant::QuantConfig::None
            } else {
                self.experts.input_quant()
            },
        }
    }

    /// Runs the experts on prepared rows into `ws.expert_out` (standard format in chunks).
    fn run_experts(&self, prepared: &Prepared, ws: &mut Workspace) -> Result<()> {
        let h = self.config.hidden;
        if let Some(layout) = &prepared.batched {
            let rows = layout.counts.len() * layout.capacity;
            ws.expert_out.resize(rows * h, 0.0);
            ws.experts.resize(self.experts.batched_workspace_len(rows), 0.0);
            let input = BatchedInput { hidden: &prepared.hidden, capacity: layout.capacity, counts: &layout.counts };
            return self.experts.apply_batched(&input, &mut ws.experts, &mut ws.expert_out);
        }
        let reduce = self.experts.weight_and_reduce();
        let (rows, k) = (prepared.topk.tokens, prepared.topk.k);
        ws.expert_out.resize(reduce.expert_output_len(rows, k, h), 0.0);
        let chunk = self.chunk_size.unwrap_or(rows).max(1);
        let per_row = reduce.expert_output_len(1, k, h);
        ws.experts.resize(self.experts.workspace_len(chunk.min(rows), k), 0.0);
        let mut start = 0;
        while start < rows {
            let end = (start + chunk).min(rows);
            let input = ExpertInput {
                hidden: &prepared.hidden[start * h..end * h],
                tokens: end - start,
                ids: &prepared.topk.ids[start * k..end * k],
                weights: &prepared.topk.weights[start * k..end * k],
                k,
                expert_map: prepared.expert_map.as_deref(),
                weights_applied: prepared.weights_applied,
            };
            self.experts.apply(&input, &mut ws.experts, &mut ws.expert_out[start * per_row..end * per_row])?;
            start = end;
        }
        Ok(())
    }

    /// Shared experts of `x [tokens, H]`, gated per token when configured.
    fn shared_experts(&self, x: &[f32], tokens: usize, workspace: &mut Vec<f32>) -> Option<Vec<f32>> {
        let (mlp, gate) = self.shared.as_ref()?;
        let h = self.config.hidden;
        let mut y = vec![0f32; tokens * h];
        mlp.dense_forward(x, tokens, workspace, &mut y);
        if let Some(g) = gate {
            for (row, xr) in y.chunks_mut(h).zip(x.chunks(h)) {
                let z: f32 = xr.iter().zip(g).map(|(a, b)| a * b).sum();
                let gate = 1.0 / (1.0 + (-z).exp());
                row.iter_mut().for_each(|v| *v *= gate);
            }
        }
        Some(y)
    }
}
