//! [`ExpertParallel`]: the dispatch and combine of a layout, for experts the caller computes
//! (the shape of DeepEP's `Buffer`). `dispatch` moves each token's rows to the ranks holding its
//! top-k experts and hands this rank's received rows over grouped by local expert, with their
//! counts; `combine` takes the experts' output rows in that order, brings them home and sums
//! them per token, weighted, in slot order (as the layer does, so the result is the same bit for
//! bit on any layout).

use crate::errors::{bad_input, IntoPy};
use crate::options::Options;
use crate::tensors::{HostBuffer, HostData, Imported};
use crate::world::World;
use moeflow::dispatch::{DispatchInput, Local, PrepareFinalize, Prepared};
use moeflow::parallel::StrategyKind;
use moeflow::reduce::WeightedSum;
use moeflow::router::{RouterConfig, TopK};
use moeflow::MoeError;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// The dispatch/combine of one layout on this rank.
#[pyclass(frozen, module = "moeflow._moeflow")]
pub struct ExpertParallel {
    strategy: Box<dyn PrepareFinalize>,
    num_experts: usize,
    hidden: usize,
    local_experts: Vec<usize>,
    world: Option<Py<World>>,
}

/// What `combine` needs of a `dispatch`: the strategy's record of where rows went, and where
/// each grouped row came from.
#[pyclass(frozen, module = "moeflow._moeflow")]
pub struct DispatchHandle {
    prepared: Mutex<Option<Prepared<'static>>>,
    /// `(received row, top-k slot)` of each grouped row, in the order handed out.
    order: Vec<(usize, usize)>,
    /// Tokens this rank gave to dispatch.
    tokens: usize,
}

/// The error for a strategy that does not hand rows over with their routing.
fn unsupported_strategy(name: &str) -> PyErr {
    bad_input(format!(
        "strategy '{name}' does not hand over rows with their routing (it routes after dispatch or packs \
         fixed-capacity batches); the dispatch/combine API takes local, allgather, multicast or all2allv"
    ))
}

impl ExpertParallel {
    fn fail_on_error<T>(&self, result: PyResult<T>, py: Python<'_>) -> PyResult<T> {
        match &self.world {
            Some(w) => w.get().fail_on_error(result, py),
            None => result,
        }
    }

    fn run<T>(&self, f: impl FnOnce() -> moeflow::Result<T>) -> moeflow::Result<T> {
        match &self.world {
            Some(w) => w.get().guard(f),
            None => f(),
        }
    }

    /// Rows of `prepared` grouped by local expert: `(order, counts)`.
    fn group(&self, prepared: &Prepared<'_>) -> (Vec<(usize, usize)>, Vec<i64>) {
        let topk = &prepared.topk;
        let mut entries = Vec::new();
        for r in 0..topk.tokens {
            for j in 0..topk.k {
                let id = topk.ids[r * topk.k + j];
                let slot = match (&prepared.expert_map, usize::try_from(id)) {
                    (_, Err(_)) => None,
                    (Some(map), Ok(id)) => usize::try_from(map[id]).ok(),
                    (None, Ok(id)) => Some(id),
                };
                if let Some(slot) = slot {
                    entries.push((slot, r, j));
                }
            }
        }
        entries.sort_by_key(|&(slot, _, _)| slot);
        let mut counts = vec![0i64; self.local_experts.len()];
        for &(slot, _, _) in &entries {
            counts[slot] += 1;
        }
        (entries.into_iter().map(|(_, r, j)| (r, j)).collect(), counts)
    }
}

#[pymethods]
impl ExpertParallel {
    /// The dispatch/combine of `num_experts` experts over rows of `hidden` values, laid out as
    /// `options` say over `world`'s ranks (none: one rank, every expert local).
    #[new]
    #[pyo3(signature = (num_experts, hidden, options, world=None))]
    fn new(
        py: Python<'_>,
        num_experts: usize,
        hidden: usize,
        options: &Options,
        world: Option<Py<World>>,
    ) -> PyResult<Self> {
        let par = &options.parallel;
        if num_experts == 0 || hidden == 0 {
            return Err(bad_input(format!("num_experts ({num_experts}) and hidden ({hidden}) must be positive")));
        }
        if par.quant != moeflow::quant::QuantConfig::None {
            return Err(bad_input("the dispatch/combine API moves f32 rows; quant must be 'none'"));
        }
        if matches!(par.strategy, StrategyKind::LowLatency | StrategyKind::AllGatherLogits) {
            return Err(unsupported_strategy(par.strategy.name()));
        }
        let placement = Arc::new(par.placement(num_experts).py_err()?);
        let strategy: Box<dyn PrepareFinalize> = match &world {
            None if par.ep != 1 => {
                return Err(bad_input(format!(
                "ep={} needs the ranks of a launched job (torchrun sets RANK and WORLD_SIZE); this process is alone",
                par.ep
            )))
            }
            None => Box::new(Local),
            Some(w) => {
                let w = w.get();
                py.detach(|| w.guard(|| par.build(w.comm.as_ref(), placement.clone()))).py_err()?
            }
        };
        if strategy.routes_after_dispatch()
            || strategy.activation_format() != moeflow::experts::ActivationFormat::Standard
        {
            return Err(unsupported_strategy(strategy.name()));
        }
        let local_experts = strategy.local_experts().unwrap_or_else(|| (0..num_experts).collect());
        Ok(ExpertParallel { strategy, num_experts, hidden, local_experts, world })
    }

    /// Sends this rank's tokens `hidden [T, H]` (float32) to the ranks holding their experts
    /// `topk_ids [T, k]` (int32 or int64) with router weights `topk_weights [T, k]` (float32).
    /// Returns `(handle, rows [N, H], counts [L])`: the rows this rank's `L` local experts
    /// received, grouped by local expert (`local_experts` names them), `counts[e]` rows each.
    /// Collective: every rank calls it, with its own tokens.
    fn dispatch(
        &self,
        py: Python<'_>,
        hidden: &Bound<'_, PyAny>,
        topk_ids: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
    ) -> PyResult<(DispatchHandle, HostBuffer, HostBuffer)> {
        let result = (|| {
            let h = self.hidden;
            let x = Imported::new(hidden, "hidden")?;
            let (t, _) = x.matrix(Some(h), &format!("[T, {h}]"))?;
            let ids = Imported::new(topk_ids, "topk_ids")?;
            let (ti, k) = ids.matrix(None, "[T, k]")?;
            let weights = Imported::new(topk_weights, "topk_weights")?;
            let (tw, kw) = weights.matrix(None, "[T, k]")?;
            if (ti, tw, kw) != (t, t, k) {
                return Err(bad_input(format!(
                    "hidden has {t} tokens, topk_ids is [{ti}, {k}] and topk_weights [{tw}, {kw}]: expected [{t}, k] both"
                )));
            }
            if k == 0 || k > self.num_experts {
                return Err(bad_input(format!("top-k {k} must be in 1..={}", self.num_experts)));
            }
            let topk = TopK { tokens: t, k, ids: ids.ids()?, weights: weights.f32s()?.to_vec() };
            topk.validate(self.num_experts).py_err()?;
            moeflow::error::check_finite("hidden", x.f32s()?).py_err()?;
            moeflow::error::check_finite("topk_weights", &topk.weights).py_err()?;
            let rows = x.f32s()?;
            let router = RouterConfig::Softmax { renormalize: false }.build(self.num_experts, k, None).py_err()?;
            let (prepared, order, counts, grouped) = py
                .detach(|| {
                    self.run(|| {
                        let input = DispatchInput {
                            hidden: rows,
                            hidden_size: h,
                            tokens: t,
                            topk: &topk,
                            logits: &[],
                            router: router.as_ref(),
                            extras: &[],
                            weights_on_input: false,
                            quant: moeflow::quant::QuantConfig::None,
                        };
                        let prepared = self.strategy.prepare(input)?.into_owned();
                        let (order, counts) = self.group(&prepared);
                        let mut grouped = Vec::with_capacity(order.len() * h);
                        for &(r, _) in &order {
                            grouped.extend_from_slice(&prepared.hidden[r * h..(r + 1) * h]);
                        }
                        Ok((prepared, order, counts, grouped))
                    })
                })
                .py_err()?;
            let n = order.len();
            let handle = DispatchHandle { prepared: Mutex::new(Some(prepared)), order, tokens: t };
            let counts_len = counts.len();
            Ok((
                handle,
                HostBuffer::new(HostData::F32(grouped), &[n, h])?,
                HostBuffer::new(HostData::I64(counts), &[counts_len])?,
            ))
        })();
        self.fail_on_error(result, py)
    }

    /// Brings the experts' outputs `expert_out [N, H]` (float32, rows in the order `dispatch`
    /// handed them out) home and sums them per token, weighted by the router weights, in slot
    /// order: returns `[T, H]` for the tokens this rank dispatched. Collective; each handle
    /// combines once.
    fn combine(&self, py: Python<'_>, expert_out: &Bound<'_, PyAny>, handle: &DispatchHandle) -> PyResult<HostBuffer> {
        let result = (|| {
            let h = self.hidden;
            let y = Imported::new(expert_out, "expert_out")?;
            let n = handle.order.len();
            y.matrix(Some(h), &format!("[{n}, {h}] (the rows dispatch handed out)")).and_then(|(rows, _)| {
                if rows == n {
                    Ok(())
                } else {
                    Err(bad_input(format!(
                        "expert_out: expected shape [{n}, {h}] (the rows dispatch handed out), got [{rows}, {h}]"
                    )))
                }
            })?;
            let values = y.f32s()?;
            let prepared = handle
                .prepared
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .ok_or_else(|| bad_input("this dispatch handle was combined already"))?;
            let t = handle.tokens;
            let out = py
                .detach(|| {
                    self.run(|| {
                        let k = prepared.topk.k;
                        // Every (row, slot) this rank did not compute holds -0.0, which the sums
                        // at home leave exact (the combine contract, see moeflow::dispatch).
                        let mut slots = vec![-0.0f32; prepared.topk.tokens * k * h];
                        for (i, &(r, j)) in handle.order.iter().enumerate() {
                            slots[(r * k + j) * h..(r * k + j + 1) * h].copy_from_slice(&values[i * h..(i + 1) * h]);
                        }
                        let mut out = vec![0f32; t * h];
                        self.strategy.finalize(&prepared, &slots, &WeightedSum, &mut out)?;
                        Ok::<_, MoeError>(out)
                    })
                })
                .py_err()?;
            HostBuffer::new(HostData::F32(out), &[t, h])
        })();
        self.fail_on_error(result, py)
    }

    /// The logical expert ids of this rank's local experts, in the order `counts` lists them.
    #[getter]
    fn local_experts(&self) -> Vec<usize> {
        self.local_experts.clone()
    }

    /// The strategy's name.
    #[getter]
    fn strategy(&self) -> &'static str {
        self.strategy.name()
    }
}
