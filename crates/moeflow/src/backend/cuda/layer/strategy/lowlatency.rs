//! Fixed-capacity low-latency dispatch, the shape of DeepEP's low-latency mode: every buffer,
//! message and GEMM is sized by the capacity `M` tokens per rank, never by the batch, and
//! nothing is read back to the host, so the whole layer is captured once in a CUDA graph (see
//! [`super::super::low_latency`]). Each rank sends every rank one message of `M` rows (`[k
//! local ids | k weights | H bf16]`, ids -1 where the token has no expert there); the receiver
//! lays the rows out `n·M` per local expert (a token reaches an expert at most once) and counts
//! them on the device; the weighted sum per message row goes back as one bf16 row, summed at
//! home in rank order. Over the NVLink transport each way writes straight into the peers'
//! windows from the kernel that makes the rows: the dispatch's pack writes the rows within the
//! batch (with the batch size; the receiver's kernels skip the rest), the combine's weighted
//! sum its rows home, and each raises the receivers' flags, then waits in its last block for
//! the senders' rows, which the arrangement (or the sum at home) reads next. Over NCCL the
//! messages travel whole between a pack and an arrangement. Either way the kernels and their
//! waits are captured in the graph with the rest.

use super::{state_of, DevicePrepareFinalize, Dispatched, Mark, Sent, SharedStart, State};
use crate::backend::cuda::layer::combine::per_token;
use crate::backend::cuda::layer::experts::{CublasPadded, ExpertRows, Form};
use crate::backend::cuda::layer::hopper_gemm::Gather;
use crate::backend::cuda::layer::low_latency::{row_offset, row_stride};
use crate::backend::cuda::layer::{dptr, err, rows, Buffers, CudaMoeLayer};
use crate::comm::Communicator;
use crate::error::Result;
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Fixed-capacity messages to every rank.
pub(in crate::backend::cuda::layer) struct LowLatency;

/// Where the messages landed and where the returned rows come home: the layer's buffers over
/// NCCL, the NVLink window's regions otherwise, with the senders' batch sizes (an int per
/// rank; 0 over NCCL, whose messages arrive whole).
struct Landing {
    recv: u64,
    back: u64,
    batches: u64,
    nvlink: bool,
}

/// Threads of an `ll_arrange` block (a thread per received slot).
const ARRANGE_THREADS: u32 = 256;

impl DevicePrepareFinalize for LowLatency {
    fn name(&self) -> &'static str {
        "lowlatency"
    }

    /// Over NVLink, the send is one short kernel that writes the peers' windows and waits for
    /// theirs: the shared experts wait for it, then run beside the arrangement.
    fn shared_start(&self, layer: &CudaMoeLayer) -> SharedStart {
        match layer.ep.as_ref().is_some_and(|link| link.writes_windows()) {
            true => SharedStart::AfterSend,
            false => SharedStart::AfterRouting,
        }
    }

    /// Packs the `M` rows (the batch size is read on the device) into one message per rank
    /// and exchanges them.
    fn prepare_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, _t: usize, mark: Mark) -> Result<State> {
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (h, k) = (l.config.hidden, l.config.top_k);
        let (n, m) = (link.comm.size(), link.capacity.expect("a low-latency layer"));
        let stride = row_stride(h, k);
        let g = &l.gpu;
        let s = &g.stream;
        let ll = b.ll.as_ref().expect("allocated by low_latency()");
        let (xb, ids, w, tokens) = (dptr(&b.x_bf, g), dptr(&b.ids, g), dptr(&b.weights, g), dptr(&ll.tokens, g));
        let (send, recv, home_rows) = (dptr(&ll.send, g), dptr(&ll.recv, g), dptr(&ll.home_rows, g));
        // The arrangement's counts, zeroed by the send (the arrangement adds into them).
        let (counts, el_i) = (dptr(&ll.counts, g), link.local as i32);
        let (mi, ki, hi, stride_l) = (m as i32, k as i32, h as i32, stride as i64);
        let placed = link.tables.as_ref().expect("uploaded when the layer was assembled");
        let tables = placed.ptrs(g);
        // Which replicated experts share this batch, counted on the device (null: all).
        let shared = l.replica_shares(placed, ids, tokens, n)?;
        let regions = [n * m * stride, n * m * 2 * h, 4 * n];
        if let Some(at) = l.nvlink(link, &regions)? {
            // One kernel packs the rows within the batch straight into every rank's window, with
            // the batch size, raises the flags and waits for every rank's rows: the pack is part
            // of the dispatch here.
            mark(2)?;
            let rank = link.comm.rank() as i32;
            l.write_window(link, 0, |win| {
                // SAFETY: ll_send(bf16*, int*, float*, int*, int, int, int, int* x5, long, int,
                // u64*, int, int*, int*, int, u64**, int, u64*, unsigned*, NvlWait) over M tokens
                // × n destinations (routing ran on M rows); each row lands inside region 0 of its
                // destination's window (n M rows, sized by the capacity) and the batch inside
                // region 2 (n ints); counts holds el ints; the flags, counters and wait are the
                // link's (see WindowWrite).
                unsafe {
                    let mut p = s.launch_builder(&l.k.ll_send);
                    p.arg(&xb).arg(&ids).arg(&w).arg(&tokens).arg(&mi).arg(&ki).arg(&hi);
                    p.arg(&tables[0]).arg(&tables[1]).arg(&tables[2]).arg(&tables[3]).arg(&shared);
                    p.arg(&stride_l).arg(&rank).arg(&win.regions).arg(&win.nregions).arg(&home_rows);
                    p.arg(&counts).arg(&el_i);
                    p.arg(&win.flags).arg(&win.nflags).arg(&win.sent).arg(&win.done).arg(&win.wait);
                    p.launch(rows(m * n, 128))
                }
                .map(|_| ())
                .map_err(|e| err("ll_send", e))
            })?;
            return Ok(Box::new(Landing { recv: at[0], back: at[1], batches: at[2], nvlink: true }));
        }
        // SAFETY: ll_pack(bf16*, int*, float*, int*, int, int, int, int* x5, long, u8*, int*,
        // int*, int) over M tokens × n destinations of buffers sized for them (routing ran on M
        // rows); the placement's tables cover every expert, and `shared` (when not null) too;
        // counts holds el ints.
        unsafe {
            let mut p = s.launch_builder(&l.k.ll_pack);
            p.arg(&xb).arg(&ids).arg(&w).arg(&tokens).arg(&mi).arg(&ki).arg(&hi);
            p.arg(&tables[0]).arg(&tables[1]).arg(&tables[2]).arg(&tables[3]).arg(&shared);
            p.arg(&stride_l).arg(&send).arg(&home_rows).arg(&counts).arg(&el_i);
            p.launch(LaunchConfig { grid_dim: (m as u32, n as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 })
        }
        .map_err(|e| err("ll_pack", e))?;
        mark(2)?;
        let every = vec![m; n];
        l.exchange_rows(link, "moe low-latency dispatch", &[(send, stride)], &every, &[(recv, stride)], &every)?;
        Ok(Box::new(Landing { recv, back: dptr(&ll.back, g), batches: 0, nvlink: false }))
    }

    /// Lays the received rows out `n·M` per local expert and counts them, on the device (rows
    /// past their sender's batch count as empty).
    fn prepare_finish(
        &self,
        l: &CudaMoeLayer,
        b: &mut Buffers,
        _t: usize,
        st: State,
        mark: Mark,
    ) -> Result<Dispatched> {
        let landing = state_of::<Landing>(st, self.name())?;
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (h, k) = (l.config.hidden, l.config.top_k);
        let (n, el, m) = (link.comm.size(), link.local, link.capacity.expect("a low-latency layer"));
        let (msg, cap, stride) = (n * m, n * m, row_stride(h, k) as i64);
        let g = &l.gpu;
        let s = &g.stream;
        let ll = b.ll.as_ref().expect("allocated by low_latency()");
        let (recv, row_of_slot, counts, a) =
            (landing.recv, dptr(&ll.row_of_slot, g), dptr(&ll.counts, g), dptr(&ll.a, g));
        let (ki, hi, msg_i, cap_i, mi, el_i, batches) =
            (k as i32, h as i32, msg as i32, cap as i32, m as i32, el as i32, landing.batches);
        // Without the masked GEMM's shapes, cuBLAS over the padded layout.
        let imp = l.device_counted(el * cap, el, Form::LowLatency).unwrap_or(&CublasPadded);
        // The Hopper GEMM reads its rows from the received messages (their values start
        // `row_offset` bytes into each), so they are not copied into the padded layout.
        let gather = imp.gathers_received_rows(l).then(|| Gather {
            x: recv + row_offset(k) as u64,
            fp8_scales: None,
            tokens: msg,
            slot_of_row: dptr(&ll.slot_of_row, g),
            k,
            stride: stride as usize / 2,
        });
        let (copy_to, slot_of_row) = match gather {
            Some(gt) => (0u64, gt.slot_of_row),
            None => (a, 0u64),
        };
        // SAFETY: ll_arrange(u8*, long, int, int, int, int, int*, int, int, int*, int*, bf16*,
        // int*) reads the msg received rows (and, when not null, the n senders' batch sizes) once
        // they have landed, a thread per slot; row_of_slot holds msg · k ints, counts el (zeroed
        // by the send before it), and `a` (when not null) el · cap rows, else slot_of_row el ·
        // cap ints.
        unsafe {
            let mut r = s.launch_builder(&l.k.ll_arrange);
            r.arg(&recv).arg(&stride).arg(&msg_i).arg(&ki).arg(&hi).arg(&cap_i);
            r.arg(&batches).arg(&mi).arg(&el_i).arg(&row_of_slot).arg(&counts).arg(&copy_to).arg(&slot_of_row);
            r.launch(rows((msg * k).div_ceil(ARRANGE_THREADS as usize), ARRANGE_THREADS))
        }
        .map_err(|e| err("ll_arrange", e))?;
        mark(3)?;
        let rows = ExpertRows {
            imp,
            a,
            h13: dptr(&ll.h13, g),
            act: dptr(&ll.act, g),
            y: dptr(&ll.y, g),
            expert_of_row: 0,
            experts: el,
            cap,
            rows: el * cap,
            // The n·M tokens that can arrive reach at most min(k, el) of these experts each.
            busy: cap * k.min(el),
            groups: Vec::new(),
            counts,
            offsets: dptr(&ll.offsets, g),
            gather,
            y_rows: None,
        };
        // The batch lives on the device: counted as a full message (as it is over NCCL).
        Ok(Dispatched { rows, sent: Sent::Bytes(l.ll_sent_bytes(m)), state: landing })
    }

    /// The weighted sum per message row, sent back to its rank (over NVLink, written there by the
    /// kernel that sums it, for the rows within the rank's batch).
    fn finalize_begin(&self, l: &CudaMoeLayer, b: &mut Buffers, _t: usize, d: &mut Dispatched) -> Result<()> {
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (h, k) = (l.config.hidden, l.config.top_k);
        let (n, m) = (link.comm.size(), link.capacity.expect("a low-latency layer"));
        let (msg, stride) = (n * m, row_stride(h, k) as i64);
        let g = &l.gpu;
        let ll = b.ll.as_ref().expect("allocated by low_latency()");
        let landing = d.state.downcast_ref::<Landing>().expect("this strategy's state");
        let (recv, row_of_slot, part, back) = (landing.recv, dptr(&ll.row_of_slot, g), dptr(&ll.part, g), landing.back);
        let (b2, y) = (l.w.b2.as_ref().map_or(0u64, |x| dptr(x, g)), d.rows.y);
        let (msg_i, ki, hi, mi, batches) = (msg as i32, k as i32, h as i32, m as i32, landing.batches);
        if landing.nvlink {
            // The weighted rows go straight into their home ranks' windows from the kernel that
            // sums them (no staging rows, no push), as many of each rank's as its batch sent; it
            // then waits for this rank's own rows to come home.
            let rank = link.comm.rank() as i32;
            return l.write_window(link, 1, |w| {
                // SAFETY: ll_combine_push(u8*, long, bf16*, float*, int*, int, int, int, int*,
                // int, int, u64*, int, int, u64**, int, u64*, unsigned*, NvlWait) over the msg
                // received rows (the senders' batch sizes at `batches`); each home row lands
                // inside region 1 of its sender's window (M rows a rank, sized by the capacity);
                // the flags, counters and wait are the link's (see WindowWrite).
                unsafe {
                    let mut c = g.stream.launch_builder(&l.k.ll_combine_push);
                    c.arg(&recv).arg(&stride).arg(&y).arg(&b2).arg(&row_of_slot).arg(&msg_i).arg(&ki).arg(&hi);
                    c.arg(&batches).arg(&mi).arg(&rank).arg(&w.regions).arg(&w.nregions).arg(&1i32);
                    c.arg(&w.flags).arg(&w.nflags).arg(&w.sent).arg(&w.done).arg(&w.wait);
                    c.launch(per_token(msg, h))
                }
                .map(|_| ())
                .map_err(|e| err("ll_combine_push", e))
            });
        }
        // SAFETY: ll_combine(u8*, long, bf16*, float*, int*, int, int, int, int*, int, bf16*) over
        // the msg received rows (and the senders' batch sizes, when not null); their expert rows
        // come from ll_arrange.
        unsafe {
            let mut c = g.stream.launch_builder(&l.k.ll_combine);
            c.arg(&recv).arg(&stride).arg(&y).arg(&b2).arg(&row_of_slot).arg(&msg_i).arg(&ki).arg(&hi);
            c.arg(&batches).arg(&mi).arg(&part);
            c.launch(rows(msg, 256))
        }
        .map_err(|e| err("ll_combine", e))?;
        let every = vec![m; n];
        l.exchange_rows(link, "moe low-latency combine", &[(part, 2 * h)], &every, &[(back, 2 * h)], &every)
    }

    /// Sums each home token's returned rows in rank order into `b.out` (the batch's tokens).
    fn finalize_finish(&self, l: &CudaMoeLayer, b: &mut Buffers, _t: usize, d: Dispatched, mark: Mark) -> Result<()> {
        mark(7)?;
        let landing = state_of::<Landing>(d.state, self.name())?;
        let link = l.ep.as_ref().expect("an expert-parallel layer");
        let (n, m) = (link.comm.size(), link.capacity.expect("a low-latency layer"));
        let g = &l.gpu;
        let ll = b.ll.as_ref().expect("allocated by low_latency()");
        let (home_rows, tokens) = (dptr(&ll.home_rows, g), dptr(&ll.tokens, g));
        l.sum_home_live(b, landing.back, home_rows, m, n, tokens)
    }
}
