//! [`Layer`]: one MoE block on this rank, built by the library's one constructor
//! ([`moeflow::parallel::ParallelConfig::rank_layer`]) from a checkpoint or from tensors.

use crate::errors::{bad_input, IntoPy};
use crate::options::{Device, Options};
use crate::tensors::{HostBuffer, HostData, Imported};
use crate::world::World;
use moeflow::config::SharedWeights;
use moeflow::model::Checkpoint;
use moeflow::quant::QuantConfig;
use moeflow::{DType, ExpertWeights, MoeConfig, MoeWeights, RankLayer, RankLayerSpec, Tensor};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;

/// One MoE block on this rank: `forward(hidden [T, H])` → `[T, H]`.
#[pyclass(frozen, module = "moeflow._moeflow")]
pub struct Layer {
    layer: RankLayer,
    config: MoeConfig,
    device: Device,
    world: Option<Py<World>>,
    /// Deadline of [`Layer::synchronize`]'s wait.
    timeout: std::time::Duration,
}

impl Layer {
    fn build(
        py: Python<'_>,
        config: MoeConfig,
        mut weights: MoeWeights,
        device: &str,
        options: &Options,
        world: Option<Py<World>>,
    ) -> PyResult<Layer> {
        let par = &options.parallel;
        if let (Some(format), None) = (par.quant.weight_format(), &weights.experts.quant) {
            weights.experts = weights.experts.quantized(format).py_err()?;
        }
        let default_gpu = world.as_ref().map_or(0, |w| w.get().env.local_rank);
        let device = Device::parse(device, default_gpu)?;
        if let Some(w) = &world {
            let w = w.get();
            if w.gpu != matches!(device, Device::Cuda(_)) {
                return Err(bad_input(format!(
                    "device '{}' on a world of {} ranks: GPU layers take GPU ranks (NCCL), CPU layers TCP ranks",
                    device.name(),
                    if w.gpu { "GPU" } else { "CPU" }
                )));
            }
            if let (true, Device::Cuda(n)) = (w.gpu, device) {
                if n != w.env.local_rank {
                    return Err(bad_input(format!(
                        "device '{}' on rank {}: a GPU rank runs on its LOCAL_RANK's GPU, cuda:{} (pass device=\"cuda\")",
                        device.name(),
                        w.comm.rank(),
                        w.env.local_rank
                    )));
                }
            }
            if w.comm.size() != par.ep {
                return Err(bad_input(format!("ep={} but the world has {} ranks", par.ep, w.comm.size())));
            }
        } else if par.ep != 1 {
            return Err(bad_input(format!(
                "ep={} needs the ranks of a launched job (torchrun sets RANK and WORLD_SIZE); this process is alone",
                par.ep
            )));
        }
        let spec = RankLayerSpec {
            chunk_size: options.chunk_size,
            cuda: options.cuda.clone(),
            ..RankLayerSpec::new(&config, &weights)
        };
        let layer = {
            let world_ref = world.as_ref().map(|w| w.get());
            py.detach(|| match world_ref {
                Some(w) => w.guard(|| par.rank_layer(Some(w.comm.as_ref()), device.experts(), &spec)),
                None => par.rank_layer(None, device.experts(), &spec),
            })
            .py_err()?
        };
        Ok(Layer { layer, config, device, world, timeout: par.timeout })
    }

    /// Runs `call` (the layer on device memory) without holding the GIL, and on a launched
    /// world under its guard, so that a failure on any rank fails every rank's call.
    fn on_device(&self, py: Python<'_>, call: impl FnOnce() -> moeflow::Result<()> + Send) -> PyResult<()> {
        let world = self.world.as_ref().map(|w| w.get());
        let result = py
            .detach(|| match world {
                Some(w) => w.guard(call),
                None => call(),
            })
            .py_err();
        match &self.world {
            Some(w) => w.get().fail_on_error(result, py),
            None => result,
        }
    }
}

/// The optional tensor `name` of `weights`, copied.
fn optional(weights: &Bound<'_, PyDict>, name: &'static str) -> PyResult<Option<Tensor>> {
    match weights.get_item(name)? {
        Some(obj) if !obj.is_none() => Ok(Some(Imported::new(&obj, name)?.to_tensor()?)),
        _ => Ok(None),
    }
}

/// The tensor `name` of `weights`, copied; an error naming it when it is missing.
fn required(weights: &Bound<'_, PyDict>, name: &'static str) -> PyResult<Tensor> {
    optional(weights, name)?.ok_or_else(|| bad_input(format!("weights: '{name}' is missing")))
}

/// `[E, rows, cols]` stacked from one `[rows, cols]` tensor per expert.
fn stack(list: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Tensor> {
    let mut parts = Vec::new();
    for item in list.try_iter()? {
        parts.push(Imported::new(&item?, name)?.to_tensor()?);
    }
    let first = parts.first().ok_or_else(|| bad_input(format!("weights: '{name}' is an empty list")))?;
    let (shape, dtype) = (first.shape().to_vec(), first.dtype());
    let mut values = Vec::with_capacity(parts.len() * first.elem_count());
    for (e, p) in parts.iter().enumerate() {
        if p.shape() != shape.as_slice() || p.dtype() != dtype {
            return Err(bad_input(format!(
                "weights: {name}[{e}] is {:?} {}, but {name}[0] is {shape:?} {dtype}",
                p.shape(),
                p.dtype()
            )));
        }
        values.extend(p.to_f32_vec());
    }
    let mut full = vec![parts.len()];
    full.extend(&shape);
    Tensor::from_f32_as(&full, &values, dtype).py_err()
}

/// `[E, 2I, H]` from per-expert gate `[I, H]` and up `[I, H]` projections.
fn stack_gate_up(gate: Tensor, up: Tensor) -> PyResult<Tensor> {
    if gate.shape() != up.shape() {
        return Err(bad_input(format!("weights: gate_proj is {:?} but up_proj is {:?}", gate.shape(), up.shape())));
    }
    let s = gate.shape().to_vec();
    let (g, u) = (gate.to_f32_vec(), up.to_f32_vec());
    let per = s[1] * s[2];
    let mut w13 = Vec::with_capacity(2 * g.len());
    for e in 0..s[0] {
        w13.extend_from_slice(&g[e * per..(e + 1) * per]);
        w13.extend_from_slice(&u[e * per..(e + 1) * per]);
    }
    Tensor::from_f32_as(&[s[0], 2 * s[1], s[2]], &w13, gate.dtype()).py_err()
}

/// The routed experts' `w13`: given whole, or stacked from per-expert projections.
fn routed_w13(weights: &Bound<'_, PyDict>) -> PyResult<(Tensor, Tensor)> {
    if let Some(w13) = optional(weights, "w13")? {
        return Ok((w13, required(weights, "w2")?));
    }
    let list = |name: &'static str| -> PyResult<Tensor> {
        let obj = weights.get_item(name)?.ok_or_else(|| {
            bad_input(format!(
                "weights: give 'w13' and 'w2', or 'gate_proj', 'up_proj' and 'down_proj' ('{name}' is missing)"
            ))
        })?;
        stack(&obj, name)
    };
    Ok((stack_gate_up(list("gate_proj")?, list("up_proj")?)?, list("down_proj")?))
}

#[pymethods]
impl Layer {
    /// Loads decoder layer `layer`'s MoE block (default: the first) of the Hugging Face
    /// checkpoint in `model_dir`, as `moeflow run` does: expert weights in `dtype` (`"f32"` or
    /// `"bf16"`), quantized as `options` ask.
    #[staticmethod]
    #[pyo3(signature = (model_dir, layer, dtype, device, options, world=None))]
    fn from_pretrained(
        py: Python<'_>,
        model_dir: PathBuf,
        layer: Option<usize>,
        dtype: &str,
        device: &str,
        options: &Options,
        world: Option<Py<World>>,
    ) -> PyResult<Layer> {
        let dtype: DType = dtype.parse().py_err()?;
        let block = py
            .detach(|| -> moeflow::Result<_> {
                let ckpt = Checkpoint::open(&model_dir)?;
                match options.parallel.quant {
                    QuantConfig::None => ckpt.load_moe_block(layer, dtype),
                    _ => ckpt.load_moe_block_quantized(layer).or_else(|_| ckpt.load_moe_block(layer, dtype)),
                }
            })
            .py_err()?;
        Layer::build(py, block.config, block.weights, device, options, world)
    }

    /// A layer from `config` (the JSON of a `moeflow::MoeConfig`) and the tensors in `weights`:
    /// `gate [E, H]`, then `w13 [E, 2I, H]` and `w2 [E, H, I]`, or lists `gate_proj`,
    /// `up_proj` (`[I, H]` each) and `down_proj` (`[H, I]`); optional `gate_bias [E]`,
    /// `correction_bias [E]`, `b13 [E, 2I]`, `b2 [E, H]`, and the shared expert's
    /// `shared_w13 [2Is, H]`, `shared_w2 [H, Is]`, `shared_gate [H]` (or `[1, H]`).
    #[staticmethod]
    #[pyo3(signature = (config, weights, device, options, world=None))]
    fn from_weights(
        py: Python<'_>,
        config: &str,
        weights: &Bound<'_, PyDict>,
        device: &str,
        options: &Options,
        world: Option<Py<World>>,
    ) -> PyResult<Layer> {
        let config: MoeConfig =
            serde_json::from_str(config).map_err(|e| bad_input(format!("layer configuration: {e}")))?;
        config.validate().py_err()?;
        let (w13, w2) = routed_w13(weights)?;
        let shared = match optional(weights, "shared_w13")? {
            None => None,
            Some(w13) => {
                let w2 = required(weights, "shared_w2")?;
                let (w13, w2) = (add_expert_dim(w13)?, add_expert_dim(w2)?);
                let gate = optional(weights, "shared_gate")?.map(|g| {
                    let n = g.elem_count();
                    Tensor::from_f32_as(&[n], &g.to_f32_vec(), g.dtype())
                });
                Some(SharedWeights {
                    mlp: ExpertWeights { w13, w2, b13: None, b2: None, quant: None },
                    gate: gate.transpose().py_err()?,
                })
            }
        };
        let weights = MoeWeights {
            gate: required(weights, "gate")?,
            gate_bias: optional(weights, "gate_bias")?,
            correction_bias: optional(weights, "correction_bias")?,
            experts: ExpertWeights {
                w13,
                w2,
                b13: optional(weights, "b13")?,
                b2: optional(weights, "b2")?,
                quant: None,
            },
            shared,
        };
        weights.validate(&config).py_err()?;
        Layer::build(py, config, weights, device, options, world)
    }

    /// `hidden [T, H]` (float32, bfloat16 or float16, contiguous, host memory) → `[T, H]` in
    /// the same dtype. float32 rows are read in place and the result is handed over without a
    /// copy; bfloat16 and float16 rows are widened to float32 (the layer computes in float32)
    /// and the result rounded back. On expert-parallel ranks every rank calls it with its own
    /// tokens (possibly none); an error on one rank fails every rank's call.
    fn forward(&self, py: Python<'_>, hidden: &Bound<'_, PyAny>) -> PyResult<HostBuffer> {
        let result = (|| {
            let x = Imported::new(hidden, "hidden")?;
            let h = self.config.hidden;
            let (t, _) = x.matrix(Some(h), &format!("[T, {h}]"))?;
            let rows = x.floats()?;
            let world = self.world.as_ref().map(|w| w.get());
            let out = py
                .detach(|| {
                    let run = || match &rows {
                        crate::tensors::Floats::F32(v) => self.layer.forward_f32(v, t),
                        other => self.layer.forward_f32(&other.to_f32(), t),
                    };
                    match world {
                        Some(w) => w.guard(run),
                        None => run(),
                    }
                    .map(|out| HostData::floats_like(out, &rows))
                })
                .py_err()?;
            HostBuffer::new(out, &[t, h])
        })();
        match &self.world {
            Some(w) => w.get().fail_on_error(result, py),
            None => result,
        }
    }

    /// `out [tokens, H]` = the layer on `x [tokens, H]`: float32 device addresses on this
    /// layer's GPU (contiguous, the caller checks), ordered on the caller's raw CUDA `stream`
    /// (PyTorch's current stream): no copy through host memory (see
    /// `moeflow::RankLayer::forward_device`).
    fn forward_device(&self, py: Python<'_>, x: u64, out: u64, tokens: usize, stream: u64) -> PyResult<()> {
        self.on_device(py, || self.layer.forward_device(x, out, tokens, stream))
    }

    /// The same on bfloat16 device addresses `x` and `out`: the float32 call's output rounded to
    /// bfloat16, bit for bit (see `moeflow::RankLayer::forward_device_bf16`).
    fn forward_device_bf16(&self, py: Python<'_>, x: u64, out: u64, tokens: usize, stream: u64) -> PyResult<()> {
        self.on_device(py, || self.layer.forward_device_bf16(x, out, tokens, stream))
    }

    /// Waits, up to the layer's timeout, for its calls on device memory that returned without
    /// waiting and for the work on the caller's raw CUDA `stream`, and raises what they found
    /// (non-finite inputs or outputs, device errors); nothing to wait for on a CPU layer.
    fn synchronize(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        py.detach(|| self.layer.synchronize_device(stream, self.timeout)).py_err()
    }

    /// Medians of `iterations` calls of the Rust layer's `forward_device` on device addresses
    /// `x` and `out` (`[tokens, H]` float32) on the raw CUDA `stream`, timed in Rust with no
    /// Python in the loop: `(seconds until the call returns, seconds until the GPU is done)`.
    /// The baseline of the Python call's overhead on a GPU.
    fn rust_forward_device_seconds(
        &self,
        py: Python<'_>,
        x: u64,
        out: u64,
        tokens: usize,
        stream: u64,
        iterations: usize,
    ) -> PyResult<(f64, f64)> {
        py.detach(|| {
            let (mut calls, mut totals) = (Vec::new(), Vec::new());
            for _ in 0..iterations.max(1) {
                let start = std::time::Instant::now();
                self.layer.forward_device(x, out, tokens, stream)?;
                calls.push(start.elapsed().as_secs_f64());
                self.layer.synchronize_device(stream, self.timeout)?;
                totals.push(start.elapsed().as_secs_f64());
            }
            let median = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            Ok((median(calls), median(totals)))
        })
        .py_err()
    }

    /// Median seconds of `iterations` calls of the Rust layer's forward on `hidden` (float32),
    /// timed in Rust with no Python in the loop: the baseline of the Python call's overhead.
    fn rust_forward_seconds(&self, py: Python<'_>, hidden: &Bound<'_, PyAny>, iterations: usize) -> PyResult<f64> {
        let x = Imported::new(hidden, "hidden")?;
        let (t, _) = x.matrix(Some(self.config.hidden), "[T, H]")?;
        let rows = x.f32s()?;
        py.detach(|| {
            let mut times = Vec::with_capacity(iterations.max(1));
            for _ in 0..iterations.max(1) {
                let start = std::time::Instant::now();
                std::hint::black_box(self.layer.forward_f32(rows, t)?);
                times.push(start.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            Ok(times[times.len() / 2])
        })
        .py_err()
    }

    /// One line naming the backend, the path the library chose and why, and the layout.
    fn describe(&self) -> String {
        self.layer.describe().to_string()
    }

    /// The block's configuration as JSON (shapes, router, activation, shared expert).
    fn config_json(&self) -> String {
        serde_json::to_string(&self.config).expect("a MoeConfig serializes")
    }

    /// Hidden size H.
    #[getter]
    fn hidden(&self) -> usize {
        self.config.hidden
    }

    /// The device it runs on (`"cpu"` or `"cuda:N"`).
    #[getter]
    fn device(&self) -> String {
        self.device.name()
    }
}

/// `[rows, cols]` → `[1, rows, cols]` (a one-expert stack); `[1, rows, cols]` stays.
fn add_expert_dim(t: Tensor) -> PyResult<Tensor> {
    match *t.shape() {
        [r, c] => Tensor::from_f32_as(&[1, r, c], &t.to_f32_vec(), t.dtype()).py_err(),
        [1, _, _] => Ok(t),
        ref s => Err(bad_input(format!("weights: a shared expert matrix is [rows, cols], got {s:?}"))),
    }
}
