//! Stage 2, the permute: the slots sorted by expert on the device (a counting sort: counts,
//! offsets and the slot/row maps), and the token rows copied into expert order (or left for the
//! Hopper GEMM to gather).

use super::hopper_fp8_gemm::Fp8Operand;
use super::{dptr, err, rows, Buffers, CudaMoeLayer};
use crate::error::{MoeError, Result};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

/// Slots a block of the counting sort takes (`SORT_CHUNK` in permute.cu).
const SORT_CHUNK: usize = 1024;

/// Threads of a block of the counting sort (`SORT_THREADS`).
const SORT_THREADS: u32 = 256;

/// Warps of a block of the counting sort (`SORT_WARPS`): each keeps a row of `scatter_chunks`'
/// shared counts.
const SORT_WARPS: usize = SORT_THREADS as usize / 32;

/// Blocks of the counting sort over `slots` slots: one a chunk, at least one.
fn sort_chunks(slots: usize) -> usize {
    slots.div_ceil(SORT_CHUNK).max(1)
}

/// Ints of the counting sort's scratch for `slots` slots over `experts` experts: a ticket
/// (`count_chunks`' last block finds itself by it; zero between launches, so the buffer starts
/// zeroed) and then the per-chunk counts.
pub(super) fn sort_counts_len(slots: usize, experts: usize) -> usize {
    1 + sort_chunks(slots) * experts
}

/// Whether the counting sort of `slots` slots is one chunk, which
/// [`CudaMoeLayer::group_rows`] counts in its own launch, with no
/// [`CudaMoeLayer::count_slots`] before it.
pub(super) fn sorts_in_one_launch(slots: usize) -> bool {
    slots <= SORT_CHUNK
}

/// The per-chunk counts in the counting sort's scratch at `chunk_counts`, after its ticket.
fn chunk_hist(chunk_counts: u64) -> u64 {
    chunk_counts + 4
}

/// Which slots [`CudaMoeLayer::group_rows`] groups: `slots` expert ids at `ids` over
/// `experts` experts (padded to `cap` rows each when `cap > 0`), leaving out expert `skip`,
/// with their per-chunk counts from [`CudaMoeLayer::count_slots`] in the scratch at
/// `chunk_counts` where `counted`.
pub(super) struct Grouping {
    pub(super) ids: u64,
    pub(super) slots: usize,
    pub(super) experts: usize,
    pub(super) chunk_counts: u64,
    /// [`CudaMoeLayer::count_slots`] has counted the slots; else (one chunk at most, see
    /// [`sorts_in_one_launch`]) the grouping counts them and writes the counts itself.
    pub(super) counted: bool,
    pub(super) cap: usize,
    pub(super) skip: i32,
    /// Copy the rows into place (false: the Hopper GEMM gathers them itself).
    pub(super) copy_rows: bool,
}

impl CudaMoeLayer {
    /// Rows of `b.x_bf` into `b.a` grouped by expert (expert `x` from row `offsets[x]`, or
    /// `x · cap` when `cap > 0`), with the slot/row maps; without `copy_rows` only the maps
    /// (the Hopper GEMM then gathers the rows itself); `counted`: as [`Grouping::counted`].
    pub(super) fn permute(&self, b: &Buffers, t: usize, cap: usize, copy_rows: bool, counted: bool) -> Result<()> {
        let (e, k) = (self.config.num_experts, self.config.top_k);
        let g = &self.gpu;
        let pi = |x: &CudaSlice<i32>| dptr(x, g);
        let maps = [pi(&b.row_of_slot), pi(&b.slot_of_row), pi(&b.expert_of_row)];
        let plan = Grouping {
            ids: pi(&b.ids),
            slots: t * k,
            experts: e,
            chunk_counts: pi(&b.chunk_counts),
            counted,
            cap,
            skip: -1,
            copy_rows,
        };
        self.group_rows(&g.stream, &plan, pi(&b.counts), pi(&b.offsets), maps, dptr(&b.x_bf, g), k, dptr(&b.a, g))
    }

    /// The counting sort's first pass: `counts [experts]` = the slots of `ids [slots]` naming
    /// each expert (ids outside `0..experts` name none), and the same per chunk of slots into
    /// the scratch at `chunk_counts` ([`sort_counts_len`] ints, zeroed when allocated), which
    /// [`CudaMoeLayer::group_rows`] reads.
    pub(super) fn count_slots(
        &self,
        s: &CudaStream,
        ids: u64,
        slots: usize,
        experts: usize,
        chunk_counts: u64,
        counts: u64,
    ) -> Result<()> {
        let (si, ei) = (slots as i32, experts as i32);
        let cfg = LaunchConfig {
            grid_dim: (sort_chunks(slots) as u32, 1, 1),
            block_dim: (SORT_THREADS, 1, 1),
            shared_mem_bytes: 4 * experts as u32,
        };
        let hist = chunk_hist(chunk_counts);
        // SAFETY: count_chunks(int*, int, int, int*, int*, int*) reads `slots` ids, writes the
        // per-chunk counts after the ticket in the sort_counts_len(slots, experts) ints of
        // `chunk_counts` (sized so, and zeroed when allocated, by the caller) and the `experts`
        // ints of `counts`, and leaves the ticket at zero; its shared memory holds `experts`
        // ints (at most 1025: 4 KiB).
        unsafe {
            s.launch_builder(&self.k.count)
                .arg(&ids)
                .arg(&si)
                .arg(&ei)
                .arg(&hist)
                .arg(&counts)
                .arg(&chunk_counts)
                .launch(cfg)
                .map_err(|e| err("count_chunks", e))?;
        }
        Ok(())
    }

    /// The counting sort's second pass (after [`CudaMoeLayer::count_slots`] over the same ids):
    /// offsets from the counts, the slot/row maps (an expert's rows in slot order), and row
    /// `s / k` of `x` copied to row `row_of_slot[s]` of `a` for every slot (slots of expert
    /// `skip` are left out).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn group_rows(
        &self,
        s: &CudaStream,
        p: &Grouping,
        counts: u64,
        offsets: u64,
        maps: [u64; 3],
        x: u64,
        k: usize,
        a: u64,
    ) -> Result<()> {
        if !p.counted && !sorts_in_one_launch(p.slots) {
            return Err(MoeError::Unsupported(format!(
                "grouping {} slots uncounted: one launch counts {SORT_CHUNK} at most",
                p.slots
            )));
        }
        let hist = if p.counted { chunk_hist(p.chunk_counts) } else { 0 };
        let (slots, ei, capi, skip) = (p.slots as i32, p.experts as i32, p.cap as i32, p.skip);
        let [rs, sr, er] = maps;
        let chunks = LaunchConfig {
            grid_dim: (sort_chunks(p.slots) as u32, 1, 1),
            block_dim: (SORT_THREADS, 1, 1),
            shared_mem_bytes: (4 * (SORT_WARPS + 1) * p.experts) as u32,
        };
        let (hi, ki) = (self.config.hidden as i32, k as i32);
        // SAFETY: scatter_chunks(int*, int, int, int*, int*, int, int, int*, int*, int*, int*) and
        // gather_rows(bf16*, int, int*, int, int, bf16*) over buffers the caller sized for `slots`
        // slots, their chunk counts (null: one chunk, counted here into `counts`), `experts`
        // counts, `experts + 1` offsets and the rows the counts give (e · cap <= 2 slots when
        // padded); the shared memory holds (8 + 1) · `experts` ints (at most 1025: 36 KiB).
        unsafe {
            s.launch_builder(&self.k.scatter)
                .arg(&p.ids)
                .arg(&slots)
                .arg(&ei)
                .arg(&hist)
                .arg(&counts)
                .arg(&capi)
                .arg(&skip)
                .arg(&offsets)
                .arg(&rs)
                .arg(&sr)
                .arg(&er)
                .launch(chunks)
                .map_err(|e| err("scatter", e))?;
            if p.copy_rows {
                s.launch_builder(&self.k.gather)
                    .arg(&x)
                    .arg(&hi)
                    .arg(&rs)
                    .arg(&ki)
                    .arg(&slots)
                    .arg(&a)
                    .launch(rows(p.slots, 128))
                    .map_err(|e| err("gather", e))?;
            }
        }
        Ok(())
    }

    /// The fp8 rows a gather names, copied in expert order: for each row r of the `experts`'
    /// (`counts`, `offsets`, read on the device; at most `extent`), `to`'s codes and scales of
    /// row r are `from`'s of token `slot_of_row[r] / k` (rows of `hidden` codes and
    /// ceil(hidden / 128) scales).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gather_fp8_rows(
        &self,
        from: Fp8Operand,
        slot_of_row: u64,
        k: usize,
        [counts, offsets]: [u64; 2],
        experts: usize,
        extent: usize,
        to: Fp8Operand,
    ) -> Result<()> {
        let h = self.config.hidden;
        if !h.is_multiple_of(16) {
            return Err(MoeError::Unsupported(format!("fp8 rows copied 16 bytes at a time (got hidden {h})")));
        }
        if extent == 0 || experts == 0 {
            return Ok(());
        }
        let (hi, gi, ki, ei, ri) = (h as i32, h.div_ceil(128) as i32, k as i32, experts as i32, extent as i32);
        // SAFETY: gather_fp8_rows(u8*, float*, int, int, int*, int, int*, int*, int, int, u8*,
        // float*): `from` holds the tokens' codes and scales that the slots name (hidden % 16 ==
        // 0, so its rows start 16-byte aligned), counts and offsets `experts` ints placing at
        // most `extent` rows, slot_of_row an int a row, and `to` `extent` rows.
        unsafe {
            let mut l = self.gpu.stream.launch_builder(&self.k.gather_fp8);
            l.arg(&from.codes).arg(&from.scales).arg(&hi).arg(&gi).arg(&slot_of_row).arg(&ki);
            l.arg(&counts).arg(&offsets).arg(&ei).arg(&ri).arg(&to.codes).arg(&to.scales);
            l.launch(rows(extent, 128))
        }
        .map(|_| ())
        .map_err(|e| err("gather_fp8_rows", e))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::{sort_counts_len, sorts_in_one_launch, Grouping};
    use crate::backend::cuda::kernel_define;
    use crate::backend::cuda::layer::{dptr, CudaMoeLayer};
    use crate::experts::Activation;
    use crate::router::RouterConfig;
    use crate::{preset, DType};

    /// The counting sort on the CPU: counts, offsets (`e + 1`), and each slot's row (-1 for
    /// expert `skip`, `poison` for ids naming no expert), an expert's rows in slot order.
    pub(in crate::backend::cuda::layer) fn sort(
        ids: &[i32],
        e: usize,
        cap: usize,
        skip: i32,
        poison: i32,
    ) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
        let here = |id: i32| id >= 0 && (id as usize) < e;
        let mut counts = vec![0i32; e];
        for &id in ids.iter().filter(|&&id| here(id)) {
            counts[id as usize] += 1;
        }
        let mut offsets = vec![0i32; e + 1];
        for x in 0..e {
            offsets[x + 1] = offsets[x] + counts[x];
        }
        if cap > 0 {
            offsets = (0..=e).map(|x| (x * cap) as i32).collect();
        }
        let mut next = offsets.clone();
        let row_of_slot = ids
            .iter()
            .map(|&id| match id {
                id if !here(id) => poison,
                id if id == skip => -1,
                id => {
                    next[id as usize] += 1;
                    next[id as usize] - 1
                }
            })
            .collect();
        (counts, offsets, row_of_slot)
    }

    /// The counting sort (`count_chunks`, `scatter_chunks`) against the CPU's on poisoned
    /// outputs: counts, offsets, both maps and each row's expert, rows of an expert in slot
    /// order, rows no slot takes left alone. No slots, one, a chunk's worth and one either side,
    /// many chunks; one expert, a hot expert taking every slot, 129 buckets with the last left
    /// out (an expert-parallel rank's), 1025; ids naming no expert; packed and padded rows;
    /// each sorted twice with every output poisoned before (the counts do not carry over, nor
    /// does the last block's ticket), and a single chunk a third time by the grouping's launch
    /// alone. Needs a GPU; says loudly when it skips.
    #[test]
    fn counting_sort_matches_the_cpu() {
        let name = "counting_sort_matches_the_cpu";
        if crate::backend::cuda::skip_without_gpu(name) {
            return;
        }
        let config = preset::config(64, 16, 8, 2, RouterConfig::Softmax { renormalize: true }, Activation::Silu, None);
        let weights = preset::random_weights(&config, DType::BF16, 3);
        let layer = CudaMoeLayer::new(&config, &weights, &Default::default()).unwrap();
        let s = layer.gpu.stream.clone();
        let g = &layer.gpu;
        let poison = -7i32;
        let mut seed = 0x5eed_u64;
        let mut next = move |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n.max(1)
        };
        let cases: [(usize, usize, i32, &str); 10] = [
            (0, 8, -1, "uniform"),
            (1, 8, -1, "uniform"),
            (1023, 1, -1, "uniform"),
            (1024, 129, 128, "uniform"),
            (1025, 129, 128, "uniform"),
            (5000, 8, -1, "hot"),
            (70_000, 129, 128, "uniform"),
            (70_000, 1025, -1, "uniform"),
            (3000, 256, -1, "strays"),
            (40_000, 64, -1, "skewed"),
        ];
        for (slots, e, skip, kind) in cases {
            for padded in [false, true] {
                let ids: Vec<i32> = (0..slots)
                    .map(|_| match kind {
                        "hot" => 3 % e as i32,
                        "strays" if next(10) == 0 => [-1, e as i32, e as i32 + 5][next(3) as usize],
                        "skewed" => (next(e as u64) * next(e as u64) / e as u64) as i32,
                        _ => next(e as u64) as i32,
                    })
                    .collect();
                // Padded: every expert owns a few rows more than the most any takes.
                let most = sort(&ids, e, 0, skip, poison).0.into_iter().max().unwrap_or(0) as usize;
                let cap = if padded { most + 3 } else { 0 };
                let (counts, offsets, row_of_slot) = sort(&ids, e, cap, skip, poison);
                let extent = if padded { e * cap } else { slots }.max(1);
                let d_ids = s.clone_htod(if slots == 0 { &[0i32][..] } else { &ids[..] }).unwrap();
                let chunk_counts = s.alloc_zeros::<i32>(sort_counts_len(slots, e)).unwrap();
                let mut d_counts = s.clone_htod(&vec![poison; e]).unwrap();
                let mut d_offsets = s.clone_htod(&vec![poison; e + 1]).unwrap();
                let mut d_row_of_slot = s.clone_htod(&vec![poison; slots.max(1)]).unwrap();
                let mut d_slot_of_row = s.clone_htod(&vec![poison; extent]).unwrap();
                let mut d_expert_of_row = s.clone_htod(&vec![poison; extent]).unwrap();
                let p = |x: &cudarc::driver::CudaSlice<i32>| dptr(x, g);
                // Twice through both passes, then (one chunk) the grouping's launch alone.
                let launches = if sorts_in_one_launch(slots) { 3 } else { 2 };
                for launch in 0..launches {
                    let counted = launch < 2;
                    let case = format!(
                        "{slots} slots, {e} experts, {kind}, skip {skip}, cap {cap}, launch {launch}, counted {counted}"
                    );
                    s.memcpy_htod(&vec![poison; e], &mut d_counts).unwrap();
                    s.memcpy_htod(&vec![poison; e + 1], &mut d_offsets).unwrap();
                    s.memcpy_htod(&vec![poison; slots.max(1)], &mut d_row_of_slot).unwrap();
                    s.memcpy_htod(&vec![poison; extent], &mut d_slot_of_row).unwrap();
                    s.memcpy_htod(&vec![poison; extent], &mut d_expert_of_row).unwrap();
                    if counted {
                        layer.count_slots(&s, p(&d_ids), slots, e, p(&chunk_counts), p(&d_counts)).unwrap();
                    }
                    let grouping = Grouping {
                        ids: p(&d_ids),
                        slots,
                        experts: e,
                        chunk_counts: p(&chunk_counts),
                        counted,
                        cap,
                        skip,
                        copy_rows: false,
                    };
                    let maps = [p(&d_row_of_slot), p(&d_slot_of_row), p(&d_expert_of_row)];
                    layer.group_rows(&s, &grouping, p(&d_counts), p(&d_offsets), maps, 0, 1, 0).unwrap();
                    assert_eq!(s.clone_dtoh(&d_counts).unwrap(), counts, "counts, {case}");
                    assert_eq!(s.clone_dtoh(&d_offsets).unwrap(), offsets, "offsets, {case}");
                    assert_eq!(
                        &s.clone_dtoh(&d_row_of_slot).unwrap()[..slots],
                        &row_of_slot[..],
                        "row_of_slot, {case}"
                    );
                    let (slot_of_row, expert_of_row) =
                        (s.clone_dtoh(&d_slot_of_row).unwrap(), s.clone_dtoh(&d_expert_of_row).unwrap());
                    let mut want_slot = vec![poison; extent];
                    let mut want_expert = vec![poison; extent];
                    for (slot, &row) in row_of_slot.iter().enumerate().filter(|(_, &row)| row >= 0) {
                        want_slot[row as usize] = slot as i32;
                        want_expert[row as usize] = ids[slot];
                    }
                    assert_eq!(slot_of_row, want_slot, "slot_of_row, {case}");
                    assert_eq!(expert_of_row, want_expert, "expert_of_row, {case}");
                }
                // More than a chunk cannot be grouped uncounted.
                if !sorts_in_one_launch(slots) {
                    let grouping = Grouping {
                        ids: p(&d_ids),
                        slots,
                        experts: e,
                        chunk_counts: p(&chunk_counts),
                        counted: false,
                        cap,
                        skip,
                        copy_rows: false,
                    };
                    let maps = [p(&d_row_of_slot), p(&d_slot_of_row), p(&d_expert_of_row)];
                    let refused = layer.group_rows(&s, &grouping, p(&d_counts), p(&d_offsets), maps, 0, 1, 0);
                    assert!(refused.is_err(), "{slots} slots grouped uncounted");
                }
            }
        }
        eprintln!("{name}: 10 cases × packed and padded, each twice (one chunk three times), matched");
    }

    /// The counting sort's block constants mirrored from permute.cu hold its values.
    #[test]
    fn sort_constants_mirror_permute_cu() {
        assert_eq!(kernel_define("SORT_CHUNK"), Some(super::SORT_CHUNK as i64));
        assert_eq!(kernel_define("SORT_THREADS"), Some(super::SORT_THREADS as i64));
    }
}
