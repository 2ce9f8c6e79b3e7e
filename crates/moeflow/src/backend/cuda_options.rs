//! [`CudaOptions`]: how the CUDA layer runs (kernel choices, tile sizes, graphs, streams,
//! NVRTC options), typed and passed to its constructors. The library reads
//! no environment variables: [`CudaOptions::from_vars`] parses `MOEFLOW_*` pairs that a program
//! (the CLI, once, at its edge) hands it.

use crate::error::{MoeError, Result};
use std::str::FromStr;

/// Which kernels run the routed experts' GEMMs on a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertGemm {
    /// moeflow's Hopper wgmma grouped GEMM where it runs (compute capability 9.0) and is the
    /// faster choice for the batch, cuBLAS elsewhere.
    #[default]
    Auto,
    /// cuBLAS: padded to the largest expert at small batches, one GEMM per expert above.
    Cublas,
    /// cuBLAS, every expert padded to the largest: one strided-batched GEMM.
    Padded,
    /// cuBLAS, one GEMM per expert over the side streams.
    Loop,
    /// cuBLAS, one grouped call (`cublasGemmGroupedBatchedEx`).
    Grouped,
    /// The Hopper grouped GEMM at every size, where it runs.
    Hopper,
}

impl ExpertGemm {
    /// Every choice, in the order `--help` lists them.
    pub const ALL: [ExpertGemm; 6] = [
        ExpertGemm::Auto,
        ExpertGemm::Cublas,
        ExpertGemm::Padded,
        ExpertGemm::Loop,
        ExpertGemm::Grouped,
        ExpertGemm::Hopper,
    ];

    /// Its name in options and variables.
    pub fn name(self) -> &'static str {
        match self {
            ExpertGemm::Auto => "auto",
            ExpertGemm::Cublas => "cublas",
            ExpertGemm::Padded => "padded",
            ExpertGemm::Loop => "loop",
            ExpertGemm::Grouped => "grouped",
            ExpertGemm::Hopper => "hopper",
        }
    }

    /// Whether the Hopper grouped GEMM may run.
    pub fn allows_hopper(self) -> bool {
        matches!(self, ExpertGemm::Auto | ExpertGemm::Hopper)
    }

    /// How cuBLAS takes `rows` rows over experts of `counts` rows each (read on the host), when
    /// no GEMM that reads the sizes on the device runs: padded to the largest expert with
    /// [`ExpertGemm::Padded`], or by default when that at most doubles the rows at up to 192
    /// rows an expert; otherwise grouped, in one call ([`ExpertGemm::Grouped`]) or one GEMM per
    /// expert.
    pub fn cublas_layout(self, rows: usize, counts: &[usize]) -> CublasLayout {
        let experts = counts.len().max(1);
        let max = counts.iter().copied().max().unwrap_or(0);
        let padded = match self {
            ExpertGemm::Padded => true,
            ExpertGemm::Auto | ExpertGemm::Cublas => rows / experts <= 192,
            ExpertGemm::Loop | ExpertGemm::Grouped | ExpertGemm::Hopper => false,
        };
        match self {
            _ if padded && max > 0 && experts * max <= 2 * rows => CublasLayout::Padded { cap: max },
            ExpertGemm::Grouped => CublasLayout::Grouped,
            _ => CublasLayout::PerExpert,
        }
    }
}

/// How cuBLAS runs the experts of a batch (see [`ExpertGemm::cublas_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CublasLayout {
    /// Every expert padded to `cap` rows, one strided-batched GEMM.
    Padded {
        /// Rows per expert.
        cap: usize,
    },
    /// The grouped rows in one grouped call.
    Grouped,
    /// The grouped rows, one GEMM per expert over the side streams.
    PerExpert,
}

impl FromStr for ExpertGemm {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|g| g.name() == s).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|g| g.name()).collect();
            MoeError::Config(format!("unknown expert GEMM '{s}' (known: {})", names.join(", ")))
        })
    }
}

/// How the fixed-capacity (low-latency) layer multiplies its padded rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LowLatencyGemm {
    /// moeflow's masked GEMM (or the Hopper GEMM for bf16 experts), which reads the counts on
    /// the device and skips empty rows.
    #[default]
    Masked,
    /// cuBLAS over the whole padded layout.
    Padded,
}

/// How the ranks of an expert-parallel layer on GPUs move rows between them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// NCCL grouped send/receive on the device.
    Nccl,
    /// Kernels that write rows straight into the peer GPUs' memory (peer access or CUDA IPC).
    NvLink,
    /// NVLink when every pair of ranks has peer access, else NCCL.
    #[default]
    Auto,
}

impl Transport {
    /// Every transport, in `--help` order.
    pub const ALL: [Transport; 3] = [Transport::Nccl, Transport::NvLink, Transport::Auto];

    /// Name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Nccl => "nccl",
            Transport::NvLink => "nvlink",
            Transport::Auto => "auto",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Transport {
    type Err = MoeError;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| MoeError::Config(format!("unknown transport '{s}' (known: nccl, nvlink, auto)")))
    }
}

/// How the CUDA layer runs. `Default` is the fast choice everywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Kernels of the routed experts' GEMMs.
    pub expert_gemm: ExpertGemm,
    /// Tile height of the Hopper GEMMs, bf16 and fp8 (16, 64 or 128; 16 is the fp8 GEMM's
    /// decode tiles, for which the bf16 GEMM takes 64-row ones); `None`: chosen per batch.
    pub gemm_tile_rows: Option<u32>,
    /// Tile width of the Hopper GEMM's 64-row tiles (224 or 256); `None`: chosen per batch.
    pub gemm_tile_cols: Option<u32>,
    /// Persistent blocks an SM of the fp8 Hopper GEMM's 64-row tiles (1 or 2); `None`: chosen
    /// per batch.
    pub gemm_tile_blocks: Option<u32>,
    /// Small batches on one GPU replay a CUDA graph per batch size.
    pub cuda_graphs: bool,
    /// Up to four tokens on one GPU route in one launch.
    pub fused_route: bool,
    /// The router GEMM runs on the tensor cores at f32 accuracy (three TF32 products a
    /// product, two for a gate of TF32 values such as a checkpoint's bf16 router); off:
    /// the fixed-order router GEMM in deterministic mode, else cuBLAS's f32 GEMM. Deterministic
    /// mode splits its depth into fixed blocks either way; the low-latency graph keeps its
    /// fixed-order router.
    pub router_tf32: bool,
    /// Side streams that run per-expert cuBLAS GEMMs concurrently (at least 1).
    pub gemm_streams: usize,
    /// SMs the side streams' cuBLAS kernels are sized for; `None`: half the GPU's, `Some(0)`:
    /// the whole GPU.
    pub gemm_sm_target: Option<u32>,
    /// The low-latency layer's GEMMs.
    pub low_latency_gemm: LowLatencyGemm,
    /// Extra NVRTC options for the kernels (kernel experiments).
    pub nvrtc_options: Vec<String>,
    /// Bit-identical outputs whatever the EP size, placement and batch: the router GEMM and
    /// the shared expert run kernels with one summation order for any batch, the experts the
    /// Hopper GEMM in fixed tiles, and expert-parallel ranks send each (token, slot)'s expert
    /// row home, where it is weighted and summed in slot order as on one GPU. Needs a Hopper
    /// GPU; the expert-parallel layer dispatches by all-to-all-v.
    pub deterministic: bool,
    /// How expert-parallel ranks move rows between GPUs.
    pub transport: Transport,
    /// W8A8 experts (fp8 weights and activations) multiply on the fp8 tensor cores with the fp8
    /// Hopper GEMM where it runs; off, they take the bf16 GEMMs on the values the codes stand
    /// for.
    pub fp8_gemm: bool,
    /// The fp8 Hopper GEMM's up projection quantizes its activation to fp8 in its epilogue
    /// for the down projection (where the intermediate size is a multiple of 128); off, a
    /// separate pass quantizes the bf16 activation. The codes are the same either way; off
    /// is the default, since the epilogue's 128-column tiles make the up projection slower
    /// than the pass it saves (docs/tuning.md).
    pub fp8_act_epilogue: bool,
    /// Where the fp8 Hopper GEMM's up projection takes its rows from the tokens (one GPU, or
    /// the rows an expert-parallel rank received): `Some(true)` copies them in expert order
    /// first, a pass of their own, so that TMA loads them; `Some(false)` has the GEMM gather
    /// them itself; `None` copies them from [`FP8_ROW_COPY_FROM`] rows an expert on average.
    /// The sums are the same bits either way.
    pub fp8_row_copy: Option<bool>,
    /// Thread blocks (one per SM) the NVLink transport's copy kernel takes.
    pub transport_sms: u32,
    /// All-to-all-v over the NVLink transport plans its dispatch on the device (counts, row
    /// positions and the expert grouping, with no read back to the host) where the Hopper
    /// GEMM runs the experts (bf16 ones in deterministic mode); off, the host plans it.
    pub device_plan: bool,
    /// All-to-all-v's device-planned NVLink dispatch sends the whole batch to every rank, each
    /// rank's rows in one copy-engine transfer (no SMs; the peer copy's rate), in place of the
    /// push kernel's rows for just the tokens a rank serves: `Some(true)` always, `Some(false)`
    /// never, `None` where uniform routing leaves a rank at most one token in ten
    /// ([`CudaOptions::copies_whole_batches`]). Rows a rank does not serve then cross the link
    /// for nothing.
    pub copy_engine_dispatch: Option<bool>,
    /// Count each call's tokens per expert on the device ([`crate::load_stats`]; one small
    /// kernel a call). Off, the load statistics stay empty (to measure what counting costs).
    pub load_stats: bool,
    /// Expert-parallel layers with replicas: a replicated expert shares a rank's batch among
    /// its replicas only when the batch sends it at least `replica_min_rows / ranks` (token,
    /// slot) pairs; otherwise its first replica serves them all, since below about this many
    /// rows its GEMM waits on its weights, and a second replica would read them a second time
    /// ([`crate::placement::ExpertPlacement::shared_replicas`]). 0 always shares.
    pub replica_min_rows: usize,
}

/// [`CudaOptions::replica_min_rows`]'s default: about the rows per expert where a bf16 expert
/// GEMM's FLOPs take as long as its weights' read on H100 and H200 (see `docs/tuning.md`).
pub const REPLICA_MIN_ROWS: usize = 128;

/// Rows an expert on average from which the fp8 up projection's rows are copied in expert order
/// before it ([`CudaOptions::fp8_row_copy`]): below, the GEMM gathers them itself (see
/// `docs/tuning.md`).
pub const FP8_ROW_COPY_FROM: usize = 128;

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            expert_gemm: ExpertGemm::Auto,
            gemm_tile_rows: None,
            gemm_tile_cols: None,
            gemm_tile_blocks: None,
            cuda_graphs: true,
            fused_route: true,
            router_tf32: true,
            gemm_streams: 4,
            gemm_sm_target: None,
            low_latency_gemm: LowLatencyGemm::Masked,
            nvrtc_options: Vec::new(),
            deterministic: false,
            transport: Transport::Auto,
            fp8_gemm: true,
            fp8_act_epilogue: false,
            fp8_row_copy: None,
            transport_sms: 64,
            device_plan: true,
            copy_engine_dispatch: None,
            load_stats: true,
            replica_min_rows: REPLICA_MIN_ROWS,
        }
    }
}

/// The variables [`CudaOptions::from_vars`] reads, with what each sets (for `--help`).
pub const CUDA_VARIABLES: [(&str, &str); 20] = [
    ("MOEFLOW_EXPERT_GEMM", "auto|cublas|padded|loop|grouped|hopper: the routed experts' GEMMs"),
    (
        "MOEFLOW_GEMM_TILE_ROWS",
        "16|64|128: the Hopper GEMMs' tile height, 16 the fp8 decode tiles (default: per batch)",
    ),
    ("MOEFLOW_GEMM_TILE_COLS", "224|256: the width of its 64-row tiles (default: per batch)"),
    ("MOEFLOW_GEMM_TILE_BLOCKS", "1|2: blocks an SM of the fp8 Hopper GEMM's 64-row tiles (default: per batch)"),
    ("MOEFLOW_CUDA_GRAPHS", "0|1: small batches on one GPU replay CUDA graphs (default 1)"),
    ("MOEFLOW_FUSED_ROUTE", "0|1: up to four tokens on one GPU route in one launch (default 1)"),
    ("MOEFLOW_ROUTER_TF32", "0|1: the router GEMM on the tensor cores at f32 accuracy, else cuBLAS f32 (default 1)"),
    ("MOEFLOW_GEMM_STREAMS", "N >= 1: side streams of per-expert cuBLAS GEMMs (default 4)"),
    ("MOEFLOW_GEMM_SM_TARGET", "N: SMs their cuBLAS kernels are sized for (0: all; default half)"),
    ("MOEFLOW_LL_GEMM", "masked|padded: the low-latency layer's GEMMs (default masked)"),
    ("MOEFLOW_NVRTC_OPTIONS", "extra NVRTC options, space-separated"),
    ("MOEFLOW_DETERMINISTIC", "0|1: bit-identical outputs whatever the layout and batch (default 0)"),
    ("MOEFLOW_FP8_GEMM", "0|1: W8A8 experts multiply on the fp8 tensor cores on Hopper (default 1)"),
    ("MOEFLOW_FP8_ACT_EPILOGUE", "0|1: the fp8 up projection quantizes its activation in its epilogue (default 0)"),
    (
        "MOEFLOW_FP8_ROW_COPY",
        "0|1: the fp8 up projection's rows copied in expert order first (default: by rows an expert)",
    ),
    ("MOEFLOW_TRANSPORT_SMS", "1 to 132: SMs of the NVLink transport's copy kernel (default 64)"),
    ("MOEFLOW_DEVICE_PLAN", "0|1: all-to-all-v over NVLink plans its dispatch on the device (default 1)"),
    (
        "MOEFLOW_COPY_ENGINE_DISPATCH",
        "0|1: that dispatch copies whole batches by the copy engines (default: where few tokens miss a rank)",
    ),
    ("MOEFLOW_LOAD_STATS", "0|1: count tokens per expert on the device each call (default 1)"),
    ("MOEFLOW_REPLICA_MIN_ROWS", "N: rows a replicated expert needs before its replicas share a batch (default 128)"),
];

fn bad(key: &str, value: &str, want: &str) -> MoeError {
    MoeError::Config(format!("{key}={value:?}: expected {want}"))
}

fn flag(key: &str, value: &str) -> Result<bool> {
    match value {
        "0" | "false" | "off" => Ok(false),
        "1" | "true" | "on" => Ok(true),
        _ => Err(bad(key, value, "0 or 1")),
    }
}

fn one_of(key: &str, value: &str, allowed: &[u32]) -> Result<u32> {
    value.parse().ok().filter(|v| allowed.contains(v)).ok_or_else(|| {
        let list: Vec<_> = allowed.iter().map(u32::to_string).collect();
        bad(key, value, &list.join(" or "))
    })
}

impl CudaOptions {
    /// Whether the fp8 up projection over `rows` rows of `experts` experts, named by a gather,
    /// takes them copied in expert order ([`CudaOptions::fp8_row_copy`]).
    pub fn copies_fp8_rows(&self, rows: usize, experts: usize) -> bool {
        self.fp8_row_copy.unwrap_or(rows >= FP8_ROW_COPY_FROM * experts.max(1))
    }

    /// Whether all-to-all-v's device-planned NVLink dispatch over `ranks` ranks at top-`k` sends
    /// whole batches by the copy engines ([`CudaOptions::copy_engine_dispatch`]); by default
    /// where a token misses a given rank with probability (1 - 1/ranks)^k <= 0.1 under uniform
    /// routing (2 ranks at top-4 and more, 4 ranks at top-9 and more), so that the rows sent for
    /// nothing cost less than the copy engines gain over the push kernel (docs/tuning.md).
    pub fn copies_whole_batches(&self, ranks: usize, k: usize) -> bool {
        let miss = (1.0 - 1.0 / ranks.max(1) as f64).powi(k.min(64) as i32);
        self.copy_engine_dispatch.unwrap_or(ranks > 1 && miss <= 0.1)
    }

    /// The options the `MOEFLOW_*` pairs among `vars` set over `self` (other keys are
    /// ignored); a clear error naming the variable when a value is not one it takes.
    pub fn with_vars<K: AsRef<str>, V: AsRef<str>>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> Result<Self> {
        for (k, v) in vars {
            let (key, value) = (k.as_ref(), v.as_ref().trim());
            match key {
                "MOEFLOW_EXPERT_GEMM" => self.expert_gemm = value.parse()?,
                "MOEFLOW_GEMM_TILE_ROWS" => self.gemm_tile_rows = Some(one_of(key, value, &[16, 64, 128])?),
                "MOEFLOW_GEMM_TILE_COLS" => self.gemm_tile_cols = Some(one_of(key, value, &[224, 256])?),
                "MOEFLOW_GEMM_TILE_BLOCKS" => self.gemm_tile_blocks = Some(one_of(key, value, &[1, 2])?),
                "MOEFLOW_CUDA_GRAPHS" => self.cuda_graphs = flag(key, value)?,
                "MOEFLOW_FUSED_ROUTE" => self.fused_route = flag(key, value)?,
                "MOEFLOW_ROUTER_TF32" => self.router_tf32 = flag(key, value)?,
                "MOEFLOW_GEMM_STREAMS" => {
                    self.gemm_streams = value
                        .parse()
                        .ok()
                        .filter(|&n| (1..=64).contains(&n))
                        .ok_or_else(|| bad(key, value, "1 to 64"))?
                }
                "MOEFLOW_GEMM_SM_TARGET" => {
                    self.gemm_sm_target = Some(value.parse().map_err(|_| bad(key, value, "a count of SMs"))?)
                }
                "MOEFLOW_LL_GEMM" => {
                    self.low_latency_gemm = match value {
                        "masked" => LowLatencyGemm::Masked,
                        "padded" => LowLatencyGemm::Padded,
                        _ => return Err(bad(key, value, "masked or padded")),
                    }
                }
                "MOEFLOW_NVRTC_OPTIONS" => self.nvrtc_options = value.split_whitespace().map(str::to_string).collect(),
                "MOEFLOW_DETERMINISTIC" => self.deterministic = flag(key, value)?,
                "MOEFLOW_TRANSPORT_SMS" => {
                    self.transport_sms = value
                        .parse()
                        .ok()
                        .filter(|&n| (1..=132).contains(&n))
                        .ok_or_else(|| bad(key, value, "1 to 132"))?
                }
                "MOEFLOW_DEVICE_PLAN" => self.device_plan = flag(key, value)?,
                "MOEFLOW_COPY_ENGINE_DISPATCH" => self.copy_engine_dispatch = Some(flag(key, value)?),
                "MOEFLOW_FP8_GEMM" => self.fp8_gemm = flag(key, value)?,
                "MOEFLOW_FP8_ACT_EPILOGUE" => self.fp8_act_epilogue = flag(key, value)?,
                "MOEFLOW_FP8_ROW_COPY" => self.fp8_row_copy = Some(flag(key, value)?),
                "MOEFLOW_LOAD_STATS" => self.load_stats = flag(key, value)?,
                "MOEFLOW_REPLICA_MIN_ROWS" => {
                    self.replica_min_rows = value.parse().map_err(|_| bad(key, value, "a count of rows"))?
                }
                _ => {}
            }
        }
        Ok(self)
    }

    /// [`CudaOptions::with_vars`] over the defaults.
    pub fn from_vars<K: AsRef<str>, V: AsRef<str>>(vars: impl IntoIterator<Item = (K, V)>) -> Result<Self> {
        Self::default().with_vars(vars)
    }

    /// One line naming what differs from the defaults ("defaults" when nothing does).
    pub fn describe(&self) -> String {
        let d = CudaOptions::default();
        let mut parts = Vec::new();
        if self.deterministic {
            parts.push("deterministic".to_string());
        }
        if self.expert_gemm != d.expert_gemm {
            parts.push(format!("expert GEMM {}", self.expert_gemm.name()));
        }
        if let Some(r) = self.gemm_tile_rows {
            parts.push(format!("tile rows {r}"));
        }
        if let Some(c) = self.gemm_tile_cols {
            parts.push(format!("tile cols {c}"));
        }
        if let Some(b) = self.gemm_tile_blocks {
            parts.push(format!("{b} fp8 short-tile block(s) an SM"));
        }
        if !self.cuda_graphs {
            parts.push("no graphs".into());
        }
        if !self.fused_route {
            parts.push("unfused router".into());
        }
        if !self.router_tf32 {
            parts.push("router on cuBLAS f32".into());
        }
        if self.gemm_streams != d.gemm_streams {
            parts.push(format!("{} GEMM streams", self.gemm_streams));
        }
        if let Some(t) = self.gemm_sm_target {
            parts.push(format!("SM target {t}"));
        }
        if self.low_latency_gemm != d.low_latency_gemm {
            parts.push("padded low-latency GEMM".into());
        }
        if self.transport != d.transport {
            parts.push(format!("transport {}", self.transport));
        }
        if !self.fp8_gemm {
            parts.push("W8A8 on bf16 GEMMs".into());
        }
        if self.fp8_act_epilogue {
            parts.push("fp8 activation quantized in the up projection's epilogue".into());
        }
        if let Some(copy) = self.fp8_row_copy {
            parts.push(format!("fp8 rows {} in expert order", if copy { "copied" } else { "never copied" }));
        }
        if self.transport_sms != d.transport_sms {
            parts.push(format!("{} transport SMs", self.transport_sms));
        }
        if !self.device_plan {
            parts.push("dispatch planned on the host".into());
        }
        if let Some(copy) = self.copy_engine_dispatch {
            parts.push(format!("whole batches {} by the copy engines", if copy { "copied" } else { "never copied" }));
        }
        if !self.load_stats {
            parts.push("no load statistics".into());
        }
        if self.replica_min_rows != d.replica_min_rows {
            parts.push(format!("replicas shared from {} rows", self.replica_min_rows));
        }
        if !self.nvrtc_options.is_empty() {
            parts.push(format!("NVRTC {}", self.nvrtc_options.join(" ")));
        }
        if parts.is_empty() {
            "defaults".into()
        } else {
            parts.join(", ")
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cublas_takes_the_padded_layout_only_where_it_pays() {
        use super::{CublasLayout as L, ExpertGemm as G};
        // 8 experts, 64 rows: padding to the largest (10) gives 80 rows, under twice 64.
        let even = [8, 8, 8, 8, 8, 8, 6, 10];
        assert_eq!(G::Auto.cublas_layout(64, &even), L::Padded { cap: 10 });
        assert_eq!(G::Cublas.cublas_layout(64, &even), L::Padded { cap: 10 });
        // One hot expert: padding would give 8 · 57 rows, more than twice 64.
        let hot = [57, 1, 1, 1, 1, 1, 1, 1];
        assert_eq!(G::Auto.cublas_layout(64, &hot), L::PerExpert);
        assert_eq!(G::Grouped.cublas_layout(64, &hot), L::Grouped);
        assert_eq!(G::Padded.cublas_layout(64, &hot), L::PerExpert, "padding past twice the rows never runs");
        // Many rows an expert: grouped, whatever the spread, unless padding is asked for.
        assert_eq!(G::Auto.cublas_layout(8 * 400, &[400; 8]), L::PerExpert);
        assert_eq!(G::Padded.cublas_layout(8 * 400, &[400; 8]), L::Padded { cap: 400 });
        assert_eq!(G::Loop.cublas_layout(64, &even), L::PerExpert);
        // No rows at all.
        assert_eq!(G::Auto.cublas_layout(0, &[0; 8]), L::PerExpert);
    }

    use super::*;

    #[test]
    fn every_variable_sets_its_field() {
        let o = CudaOptions::from_vars([
            ("MOEFLOW_EXPERT_GEMM", "cublas"),
            ("MOEFLOW_GEMM_TILE_ROWS", "64"),
            ("MOEFLOW_GEMM_TILE_COLS", "224"),
            ("MOEFLOW_GEMM_TILE_BLOCKS", "2"),
            ("MOEFLOW_CUDA_GRAPHS", "0"),
            ("MOEFLOW_FUSED_ROUTE", "0"),
            ("MOEFLOW_ROUTER_TF32", "0"),
            ("MOEFLOW_GEMM_STREAMS", "2"),
            ("MOEFLOW_GEMM_SM_TARGET", "0"),
            ("MOEFLOW_LL_GEMM", "padded"),
            ("MOEFLOW_NVRTC_OPTIONS", " -lineinfo  -G "),
            ("MOEFLOW_DETERMINISTIC", "1"),
            ("MOEFLOW_TRANSPORT_SMS", "16"),
            ("MOEFLOW_LOAD_STATS", "0"),
            ("MOEFLOW_REPLICA_MIN_ROWS", "0"),
            ("MOEFLOW_DEVICE_PLAN", "0"),
            ("MOEFLOW_COPY_ENGINE_DISPATCH", "1"),
            ("MOEFLOW_FP8_GEMM", "0"),
            ("MOEFLOW_FP8_ACT_EPILOGUE", "1"),
            ("MOEFLOW_FP8_ROW_COPY", "1"),
            ("PATH", "/usr/bin"),
        ])
        .unwrap();
        let want = CudaOptions {
            expert_gemm: ExpertGemm::Cublas,
            gemm_tile_rows: Some(64),
            gemm_tile_cols: Some(224),
            gemm_tile_blocks: Some(2),
            cuda_graphs: false,
            fused_route: false,
            router_tf32: false,
            gemm_streams: 2,
            gemm_sm_target: Some(0),
            low_latency_gemm: LowLatencyGemm::Padded,
            nvrtc_options: vec!["-lineinfo".into(), "-G".into()],
            deterministic: true,
            transport: Transport::Auto,
            fp8_gemm: false,
            fp8_act_epilogue: true,
            fp8_row_copy: Some(true),
            transport_sms: 16,
            device_plan: false,
            copy_engine_dispatch: Some(true),
            load_stats: false,
            replica_min_rows: 0,
        };
        assert_eq!(o, want);
        assert!(o.describe().contains("no load statistics"), "{}", o.describe());
        assert!(o.describe().contains("replicas shared from 0 rows"), "{}", o.describe());
        assert!(o.describe().contains("dispatch planned on the host"), "{}", o.describe());
        assert!(o.describe().contains("whole batches copied by the copy engines"), "{}", o.describe());
        assert!(o.describe().contains("W8A8 on bf16 GEMMs"), "{}", o.describe());
        assert!(o.describe().contains("quantized in the up projection's epilogue"), "{}", o.describe());
        assert!(o.describe().contains("fp8 rows copied in expert order"), "{}", o.describe());
        for (name, _) in CUDA_VARIABLES {
            assert!(
                CudaOptions::from_vars([(name, "surely-not-a-value")]).is_err() || name == "MOEFLOW_NVRTC_OPTIONS",
                "{name} took a bad value"
            );
        }
    }

    #[test]
    fn no_variables_give_the_defaults() {
        let none: [(&str, &str); 0] = [];
        assert_eq!(CudaOptions::from_vars(none).unwrap(), CudaOptions::default());
        assert_eq!(CudaOptions::default().describe(), "defaults");
    }

    #[test]
    fn bad_values_name_their_variable() {
        for (k, v) in [
            ("MOEFLOW_EXPERT_GEMM", "fastest"),
            ("MOEFLOW_GEMM_TILE_ROWS", "96"),
            ("MOEFLOW_GEMM_TILE_COLS", "128"),
            ("MOEFLOW_GEMM_TILE_BLOCKS", "3"),
            ("MOEFLOW_CUDA_GRAPHS", "yes please"),
            ("MOEFLOW_GEMM_STREAMS", "0"),
            ("MOEFLOW_GEMM_SM_TARGET", "-3"),
            ("MOEFLOW_LL_GEMM", "cublas"),
            ("MOEFLOW_FP8_GEMM", "maybe"),
            ("MOEFLOW_TRANSPORT_SMS", "0"),
        ] {
            let e = CudaOptions::from_vars([(k, v)]).unwrap_err().to_string();
            assert!(e.contains(v), "{k}: {e}");
            assert!(e.contains(k) || k == "MOEFLOW_EXPERT_GEMM", "{k}: {e}");
        }
    }

    #[test]
    fn describe_names_what_differs() {
        let o = CudaOptions { cuda_graphs: false, expert_gemm: ExpertGemm::Hopper, ..Default::default() };
        assert_eq!(o.describe(), "expert GEMM hopper, no graphs");
        let d = CudaOptions { deterministic: true, ..Default::default() };
        assert_eq!(d.describe(), "deterministic");
        for g in ExpertGemm::ALL {
            assert_eq!(g.name().parse::<ExpertGemm>().unwrap(), g);
        }
        assert!(ExpertGemm::Auto.allows_hopper() && !ExpertGemm::Cublas.allows_hopper());
    }

    #[test]
    fn fp8_rows_are_copied_from_the_threshold_unless_pinned() {
        let auto = CudaOptions::default();
        assert!(!auto.copies_fp8_rows(FP8_ROW_COPY_FROM * 64 - 1, 64));
        assert!(auto.copies_fp8_rows(FP8_ROW_COPY_FROM * 64, 64));
        assert!(!auto.copies_fp8_rows(0, 0) && auto.copies_fp8_rows(FP8_ROW_COPY_FROM, 0));
        let pinned = |copy| CudaOptions { fp8_row_copy: Some(copy), ..CudaOptions::default() };
        assert!(pinned(true).copies_fp8_rows(1, 64));
        assert!(!pinned(false).copies_fp8_rows(1 << 20, 64));
    }

    #[test]
    fn whole_batches_go_by_copy_engines_where_few_tokens_miss_a_rank_unless_pinned() {
        let auto = CudaOptions::default();
        // (1 - 1/ranks)^k: 2 ranks at top-8 0.004, top-4 0.06, top-3 0.125; 4 ranks at top-8
        // 0.100 (just above), top-9 0.075; 8 ranks at top-8 0.34.
        let picks: Vec<bool> = [(2, 8), (2, 4), (2, 3), (4, 8), (4, 9), (8, 8), (1, 8), (0, 8)]
            .map(|(ranks, k)| auto.copies_whole_batches(ranks, k))
            .into();
        assert_eq!(picks, [true, true, false, false, true, false, false, false]);
        let pinned = |copy| CudaOptions { copy_engine_dispatch: Some(copy), ..CudaOptions::default() };
        assert!(pinned(true).copies_whole_batches(8, 1));
        assert!(!pinned(false).copies_whole_batches(2, 8));
    }

    #[test]
    fn transports_parse_by_name() {
        for t in Transport::ALL {
            assert_eq!(t.name().parse::<Transport>().unwrap(), t);
        }
        let e = "shm".parse::<Transport>().unwrap_err().to_string();
        assert!(e.contains("shm") && e.contains("nvlink"), "{e}");
        let o = CudaOptions { transport: Transport::Nccl, ..CudaOptions::default() };
        assert_eq!(o.describe(), "transport nccl");
    }
}
