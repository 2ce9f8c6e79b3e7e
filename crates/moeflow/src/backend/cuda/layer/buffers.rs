//! The layer's scratch memory on the device, one set per layer, grown to the largest batch
//! a call has brought so far.

use super::route::{FUSED_ROUTE_TOKENS, ROUTE_COLS};
use super::{err, graph, low_latency, CudaMoeLayer, EpBuffers};
use crate::error::Result;
use cudarc::driver::CudaSlice;

/// Scratch buffers for up to `tokens` tokens.
pub(super) struct Buffers {
    pub(super) tokens: usize,
    /// Tokens of the batch the current call serves: the rows routed here are its
    /// [`super::strategy::DevicePrepareFinalize::token_window`], and `out` holds all of them.
    pub(super) batch: usize,
    pub(super) x: CudaSlice<f32>,
    pub(super) x_bf: CudaSlice<u16>,
    /// The batch's tokens came in as bf16 and are in `x_bf` alone, for a router that reads them
    /// there ([`CudaMoeLayer::routes_bf16_tokens`]); otherwise `x` holds them (and the route
    /// writes `x_bf`).
    pub(super) tokens_bf16: bool,
    /// The batch's outputs go out as bf16 (their f32 sums rounded), so a TP-sliced layer
    /// all-gathers its shares as bf16.
    pub(super) out_bf16: bool,
    pub(super) logits: CudaSlice<f32>,
    pub(super) ids: CudaSlice<i32>,
    pub(super) weights: CudaSlice<f32>,
    pub(super) counts: CudaSlice<i32>,
    /// The counting sort's counts per chunk of slots (see [`super::permute::sort_counts_len`]).
    pub(super) chunk_counts: CudaSlice<i32>,
    pub(super) offsets: CudaSlice<i32>,
    pub(super) row_of_slot: CudaSlice<i32>,
    pub(super) slot_of_row: CudaSlice<i32>,
    pub(super) expert_of_row: CudaSlice<i32>,
    pub(super) a: CudaSlice<u16>,
    pub(super) h13: CudaSlice<u16>,
    pub(super) act: CudaSlice<u16>,
    pub(super) y: CudaSlice<u16>,
    pub(super) out: CudaSlice<f32>,
    pub(super) ptrs: CudaSlice<u64>,
    /// The fused router's partial dot products and its count of blocks done (see
    /// [`super::route`]).
    pub(super) route_partials: CudaSlice<f32>,
    pub(super) route_done: CudaSlice<i32>,
    /// Shared experts' intermediate, activation and output (they run on a side stream).
    pub(super) sh13: CudaSlice<u16>,
    pub(super) sact: CudaSlice<u16>,
    pub(super) sy: CudaSlice<u16>,
    /// The fp8 codes and scales of an fp8 shared expert's rows, when it runs on the fp8 tensor
    /// cores: its input's (the tokens', `t · hidden` codes), then its activation's.
    pub(super) shared_fp8: Option<super::masked_gemm::Fp8Rows>,
    /// Expert-parallel buffers, grown to the rows this rank sends and receives.
    pub(super) ep: Option<EpBuffers>,
    /// This call's dispatch sent its token rows beside the routing (see
    /// `DevicePrepareFinalize::send_beside_routing`).
    pub(super) rows_sent_early: bool,
    /// Expert-parallel count exchange: this rank's `[E + ranks]`, then every rank's.
    pub(super) exchange: Option<CudaSlice<i32>>,
    /// Expert-parallel: every rank's batch size, exchanged before the routing (see
    /// [`CudaMoeLayer::share_batches`]).
    pub(super) batches: Option<super::expert_parallel::Batches>,
    /// Deterministic mode's shared expert as a one-expert grouped GEMM: its row count and
    /// offset (0).
    pub(super) shared_rows: CudaSlice<i32>,
    /// Deterministic mode's router partial sums, `[H / ROUTER_FIXED_COLS, T, E]`.
    pub(super) router_fixed: Option<CudaSlice<f32>>,
    /// The tensor-core router's partial sums, `[splits, T, E]`, where a batch up to `T` splits
    /// its depth (see `router_tf32::partial_floats`).
    pub(super) router_split: Option<CudaSlice<f32>>,
    /// TP slicing: every TP rank's output share, gathered (see [`super::strategy`]).
    pub(super) tp_gathered: Option<CudaSlice<f32>>,
    /// Low-latency buffers and the captured layer (see [`low_latency`]).
    pub(super) ll: Option<low_latency::LlBuffers>,
    /// One GPU: small batches' graphs and their cuBLAS workspaces (see [`graph`]).
    pub(super) graphs: graph::LocalGraphs,
    /// Whether a graph the caller captured points into these buffers (they are then kept for
    /// the layer's life: see [`super::device_calls`]).
    pub(super) captured: bool,
}

impl CudaMoeLayer {
    /// The buffers in `guard`, allocated anew (the small batches' graphs carried over) when
    /// there are none yet or they hold fewer than `tokens` tokens.
    pub(super) fn buffers<'a>(&self, guard: &'a mut Option<Buffers>, tokens: usize) -> Result<&'a mut Buffers> {
        if guard.as_ref().is_none_or(|b| b.tokens < tokens) {
            let graphs = match guard.take() {
                None => graph::LocalGraphs::default(),
                Some(mut old) => {
                    let graphs = std::mem::take(&mut old.graphs).carried_over();
                    if old.captured {
                        // A graph captured by the caller points into them: kept for good.
                        if let Some(calls) = self.calls.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                            calls.keep(old);
                        }
                    }
                    graphs
                }
            };
            let c = &self.config;
            let (t, h, e, i, k) = (tokens.max(1), c.hidden, c.num_experts, c.inter, c.top_k);
            let wide = i.max(c.shared.map_or(0, |s| s.inter));
            let s = &self.gpu.stream;
            // Row buffers hold up to 2 t k rows (the padded layout's limit).
            let wide_rows = crate::memory::bytes(&[2, t, k, 3 * wide + 2 * h], 2);
            let token_rows = crate::memory::bytes(&[t, 3 * h + e + 2 * wide], 4);
            super::super::finite::ensure_device_memory(
                &self.gpu,
                &format!("workspace for {t} tokens"),
                wide_rows + token_rows,
            )?;
            let r = 2 * t * k;
            macro_rules! z {
                ($ty:ty, $n:expr) => {
                    s.alloc_zeros::<$ty>($n).map_err(|e| err("allocating workspace", e))?
                };
            }
            *guard = Some(Buffers {
                tokens: t,
                batch: 0,
                x: z!(f32, t * h),
                x_bf: z!(u16, t * h),
                tokens_bf16: false,
                out_bf16: false,
                logits: z!(f32, t * e),
                ids: z!(i32, t * k),
                weights: z!(f32, t * k),
                counts: z!(i32, e),
                chunk_counts: z!(i32, super::permute::sort_counts_len(t * k, e)),
                offsets: z!(i32, e + 1),
                row_of_slot: z!(i32, t * k),
                slot_of_row: z!(i32, r),
                expert_of_row: z!(i32, r),
                a: z!(u16, r * h),
                h13: z!(u16, r.max(t) * 2 * wide),
                act: z!(u16, r.max(t) * wide),
                y: z!(u16, r.max(t) * h),
                out: z!(f32, t * h),
                ptrs: z!(u64, 3 * e.max(1)),
                route_partials: z!(f32, h.div_ceil(ROUTE_COLS) * FUSED_ROUTE_TOKENS * e),
                route_done: z!(i32, 1),
                sh13: z!(u16, (t * 2 * c.shared.map_or(0, |s| s.inter)).max(1)),
                sact: z!(u16, (t * c.shared.map_or(0, |s| s.inter)).max(1)),
                sy: z!(u16, if c.shared.is_some() { t * h } else { 1 }),
                shared_fp8: match (c.shared, self.shared_fp8_gemm()) {
                    (Some(sc), Some(_)) => Some(super::masked_gemm::Fp8Rows::new(s, t * (h + sc.inter))?),
                    _ => None,
                },
                ep: None,
                rows_sent_early: false,
                exchange: None,
                batches: None,
                shared_rows: z!(i32, 2),
                router_fixed: if self.opts.deterministic {
                    Some(z!(f32, h.div_ceil(super::route::ROUTER_FIXED_COLS) * t * e))
                } else {
                    None
                },
                // Deterministic mode splits the depth its own way (`router_fixed` above) and the
                // low-latency graph keeps its fixed-order router.
                router_split: if self.router_on_tensor_cores() && !self.opts.deterministic && self.capacity().is_none()
                {
                    match super::router_tf32::partial_floats(t, e, h, self.sms) {
                        0 => None,
                        n => Some(z!(f32, n)),
                    }
                } else {
                    None
                },
                tp_gathered: None,
                ll: None,
                graphs,
                captured: false,
            });
        }
        Ok(guard.as_mut().expect("allocated above"))
    }
}
