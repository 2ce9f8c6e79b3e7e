// moeflow CUDA kernels of the NVLink transport: rows written straight into peer GPUs' memory
// (a peer window, see peer_window.rs), and sequence flags that say they have landed. Every
// exchange is one kernel: it copies every lane's rows to every rank, bumps each receiver's flag
// for this rank, and its last block then spins until every sender's flag reached this
// exchange's number, with a clock deadline (nvl_push). A strategy's kernel that writes its rows
// into the peers' windows itself ends as the push does (nvl_raise_and_wait). (Compiled after
// the stage files and low_latency.cu.)

// Copies row `s` of `src` to row `r` of `dst`, `units` words of type W, one warp per row: each
// lane loads up to PUSH_BATCH words (bypassing L1) before it stores them, so that many loads are
// in flight per thread while the stores stream to the peer.
#define PUSH_BATCH 8
template <typename W>
__device__ __forceinline__ void push_row(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                         long s, long r, int units, int row_bytes, int lane) {
    const W* __restrict__ from = (const W*)(src + s * row_bytes);
    W* __restrict__ to = (W*)(dst + r * row_bytes);
    for (int c0 = lane; c0 < units; c0 += 32 * PUSH_BATCH) {
        W v[PUSH_BATCH];
#pragma unroll
        for (int u = 0; u < PUSH_BATCH; u++) {
            int c = c0 + 32 * u;
            if (c < units) v[u] = __ldg(from + c);
        }
#pragma unroll
        for (int u = 0; u < PUSH_BATCH; u++) {
            int c = c0 + 32 * u;
            if (c < units) to[c] = v[u];
        }
    }
}

extern "C" {

// One lane of a push: `rows` rows of `row_bytes` bytes from `src` (row r taken from row idx[r]
// when `idx` is set) to `dst`, which may be a peer's memory; when `live` is set, only the first
// min(rows, *live) rows (a count made on the device; `rows` is then the room for them).
struct PushLane {
    u64 src;
    u64 idx;
    u64 dst;
    u64 live;
    unsigned int rows;
    unsigned int row_bytes;
};

__device__ __forceinline__ u64 lane_rows(const PushLane& p) {
    return p.live ? (u64)min((long long)p.rows, (long long)max(*(const int*)p.live, 0)) : (u64)p.rows;
}

// A wait on the peers' flags (NvlWait in nvlink.rs): this rank's `n` flags (one u64 a sender,
// in its window), the count of exchanges received (`received`, a u64), the host word `status`
// (mapped into the device), the deadline in ns of the GPU's global timer, and the stage that a
// timeout reports (0 dispatch, 1 combine).
struct NvlWait {
    u64 flags;
    u64 received;
    u64 status;
    long long timeout_ns;
    int n;
    int stage;
};

// How often a spinning wait reads the host's status word (a read across PCIe, so not at every
// spin): a failure elsewhere stops the wait within this many ns.
#define NVL_STATUS_EVERY_NS 10000ull

// The wait, by one block: its threads share the `n` senders, and for each spin until sender
// src's flag reached this exchange's number (`*received` + 1), polling with relaxed loads and
// acquiring the flag once it is there (so the rows released before it are visible to this
// kernel and the stream's later ones). A sender not there within the deadline sets `*status`
// to (stage + 1) << 16 | (src + 1) and the wait ends; a nonzero `*status` (set by the host on a
// failure elsewhere, or by an earlier timeout) ends every wait.
__device__ void nvl_await(const NvlWait& w) {
    const u64* flags = (const u64*)w.flags;
    volatile unsigned int* status = (volatile unsigned int*)w.status;
    u64 want = *(const u64*)w.received + 1, start, now, checked;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    checked = start;
    bool stopped = false;
    for (int src = threadIdx.x; src < w.n && !stopped; src += blockDim.x) {
        for (unsigned int spins = 1;; spins++) {
            u64 got;
            asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(got) : "l"(flags + src) : "memory");
            if (got >= want) break;
            if ((spins & 63u) == 0) {
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (now - checked > NVL_STATUS_EVERY_NS) {
                    checked = now;
                    stopped = *status != 0;
                }
                if (!stopped && (long long)(now - start) > w.timeout_ns) {
                    atomicCAS((unsigned int*)status, 0u,
                              ((unsigned int)(w.stage + 1) << 16) | (unsigned int)(src + 1));
                    stopped = true;
                }
                if (stopped) break;
            }
        }
        if (!stopped) {
            asm volatile("{ .reg .u64 seen; ld.acquire.sys.global.u64 seen, [%0]; }" ::"l"(flags + src) : "memory");
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *(u64*)w.received = want;
}

// The end of an exchange's sending kernel, after this block's stores to the peers: the block's
// threads meet, then thread 0 counts the block done with a release at GPU scope (no system
// fence a block); the last block to count (its acquire sees every other block's release) raises
// the exchange's number (`*sent` + 1) in each of `flags[0..nflags]` (the receivers' flag of this
// rank) after one fence at system scope, which carries every block's rows with it (fences are
// cumulative), so a receiver that acquires the number also sees the rows. `done` counts
// finished blocks and wraps to 0 at the last one, ready for the next exchange. The last block
// then waits for every sender's rows of this exchange (nvl_await), so the kernel ends when the
// exchange has landed here.
__device__ __forceinline__ void nvl_raise_and_wait(u64* const* flags, int nflags, u64* sent, unsigned int* done,
                                                   const NvlWait& wait) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int before, final_count = gridDim.x * gridDim.y * gridDim.z - 1;
        asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;"
                     : "=r"(before)
                     : "l"(done), "r"(final_count)
                     : "memory");
        last = before == final_count;
        if (last) {
            u64 seq = *sent + 1;
            *sent = seq;
            asm volatile("fence.acq_rel.sys;" ::: "memory");
            for (int f = 0; f < nflags; f++) {
                asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flags[f]), "l"(seq) : "memory");
            }
        }
    }
    __syncthreads();
    if (last) nvl_await(wait);
}

// Copies every lane's rows (a warp per row, in 16-byte words where the lane's rows are aligned
// to them), then raises the push's number in the receivers' flags and waits for the senders'
// (nvl_raise_and_wait).
__global__ void nvl_push(const PushLane* lanes, int nlanes, u64* const* flags, int nflags, u64* sent,
                         unsigned int* done, NvlWait wait) {
    int lane = threadIdx.x % 32;
    long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    long warps = (long)gridDim.x * blockDim.x / 32;
    // Each lane's rows are cut into equal consecutive shares, one a warp, and a warp walks its
    // shares of all the lanes together, a row of each in turn: every warp copies to every
    // rank at once, so the rows to a peer (bound by the link) and those to this rank (bound
    // by local memory) overlap on every SM, instead of the warps with local rows finishing
    // early and leaving the link to the others.
    for (long i = 0;; i++) {
        bool more = false;
        for (int l = 0; l < nlanes; l++) {
            const PushLane p = lanes[l];
            const long rows = (long)lane_rows(p);
            const long r = rows * warp / warps + i;
            if (r >= rows * (warp + 1) / warps) continue;
            more = true;
            const unsigned char* src = (const unsigned char*)p.src;
            unsigned char* dst = (unsigned char*)p.dst;
            const int rb = (int)p.row_bytes;
            const bool wide = ((p.src | p.dst | (u64)rb) & 15) == 0, word = ((p.src | p.dst | (u64)rb) & 3) == 0;
            const long s = p.idx ? (long)((const int*)p.idx)[r] : r;
            if (wide) push_row<uint4>(src, dst, s, r, rb / 16, rb, lane);
            else if (word) push_row<unsigned int>(src, dst, s, r, rb / 4, rb, lane);
            else push_row<unsigned char>(src, dst, s, r, rb, rb, lane);
        }
        if (!more) break;
    }
    nvl_raise_and_wait(flags, nflags, sent, done, wait);
}

// The low-latency combine (ll_combine in low_latency.cu) writing its rows straight home: message
// row r = s M + t of the `tokens` = n M received (sender, then token order), when within its
// sender's batch (batches[s]), goes to row rank M + t of region `region` of sender s's window
// (which starts at regions[s nregions + region]), the senders taken in turn (block i: row
// i / n of sender i % n) so that rows to peers and to this rank run side by side; then the
// exchange's flags are raised, and the senders' waited for, as nvl_push does. Blocks per
// message row as combine's per token. Four blocks of 256 threads a SM: the rows' loads of
// ll_combine_row take registers that would otherwise leave room for two.
__global__ void __launch_bounds__(256, 4)
    ll_combine_push(const unsigned char* recv, long stride, const bf16_t* y, const float* b2, const int* row_of_slot,
                    int tokens, int k, int H, const int* batches, int M, int rank, const u64* regions, int nregions,
                    int region, u64* const* flags, int nflags, u64* sent, unsigned int* done, NvlWait wait) {
    const int n = tokens / M;
    for (long i = blockIdx.x; i < tokens; i += gridDim.x) {
        const long r = (i % n) * M + i / n;
        if (!ll_live(batches, (int)r, M)) continue;
        bf16_t* row = (bf16_t*)regions[(r / M) * nregions + region] + ((long)rank * M + r % M) * H;
        ll_combine_row(recv, stride, y, b2, row_of_slot, k, H, r, row);
    }
    nvl_raise_and_wait(flags, nflags, sent, done, wait);
}

// All-to-all-v's return over NVLink: the weighted sum over the slots served here of each
// received token (combine_partial) written straight home. Received row r of the T is rank s's
// row r - starts[s] (starts: n + 1 ints), sent when below counts[s]; its sum goes to row
// rank (starts[s + 1] - starts[s]) + r - starts[s] of region `region` of rank s's window (room
// for s's batch from every rank, in rank order). The rows are taken a rank in turn (block i:
// row i / n of rank i % n, over n times the largest batch), so that the sums going to peers
// (bound by the link) and those staying here (bound by local memory) run side by side rather
// than one rank's after another's. Then the exchange's flags are raised, and the senders'
// waited for, as nvl_push does. Blocks per token as combine's per_token, over n times the
// largest batch; five of 256 threads a SM (48 registers), since the return is bound by local
// memory and the compiler's choice otherwise varies with the module around it (56 registers,
// four blocks, measured slower).
__global__ void __launch_bounds__(256, 5)
    nvl_combine_push(const bf16_t* y, const float* b2, const int* local_ids, const float* w, const int* row_of_slot,
                     int k, int H, const int* starts, const int* counts, int n, int rank, const u64* regions,
                     int nregions, int region, u64* const* flags, int nflags, u64* sent, unsigned int* done,
                     NvlWait wait) {
    long most = 0;
    for (int s = 0; s < n; s++) most = max(most, (long)(starts[s + 1] - starts[s]));
    for (long i = blockIdx.x; i < n * most; i += gridDim.x) {
        const int s = (int)(i % n);
        const long p = i / n;
        if (p >= counts[s]) continue;
        const long r = starts[s] + p, room = starts[s + 1] - starts[s];
        bf16_t* row = (bf16_t*)regions[(long)s * nregions + region] + ((long)rank * room + p) * H;
        weighted_row_bf16(y, b2, row_of_slot + r * k, local_ids + r * k, w + r * k, k, H, row);
    }
    nvl_raise_and_wait(flags, nflags, sent, done, wait);
}

// Deterministic mode's return over NVLink, planned on the device: the down projection stores
// each slot served here as its expert's row, as it is, straight into its home's window, and
// home weights and sums the slots in slot order (the one-GPU combine), so the bits do not
// depend on the layout. A thread per received slot q = r k + j: received row r is rank s's row
// p = r - starts[s] (starts: n + 1 ints), sent when below counts[s], and home token tokens[r]
// of s (p itself where `tokens` is null: whole batches, sent as they lie); where slot j is
// served here (it has a grouped row, row_of_slot[q] >= 0), out_rows[row_of_slot[q]] = the
// address of row token k + j of region `region` of s's window (`regions` as
// nvl_combine_push's).
__global__ void nvl_slot_addresses(const int* row_of_slot, const int* tokens, int k, int H, const int* starts,
                                   const int* counts, int n, const u64* regions, int nregions, int region,
                                   u64* out_rows) {
    const long slots = (long)starts[n] * k;
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < slots; q += (long)gridDim.x * blockDim.x) {
        const long r = q / k;
        int s = 0;
        while (s + 1 < n && starts[s + 1] <= r) s++;
        const long p = r - starts[s];
        if (p >= counts[s]) continue;
        const int row = row_of_slot[q];
        if (row < 0) continue;
        const long token = tokens ? tokens[r] : p;
        out_rows[row] = regions[(long)s * nregions + region] + 2 * (token * k + q % k) * H;
    }
}

// The low-latency dispatch's sending half over NVLink, one block per (token t < M, destination
// d), t = blockIdx.x / n: message row (t, d) (see ll_pack_row) written straight into row
// rank M + t of region 0 of rank d's window (regions[d nregions], see ll_combine_push), for
// the tokens of the batch (`*tokens`) only, and the batch into int `rank` of region 2;
// home_rows[t n + d] = d M + t, or -1 when token t sent nothing to d; the `el` ints of
// `counts` zeroed for the arrangement (ll_arrange); then the exchange's flags raised, and the
// senders' waited for, as nvl_push does.
__global__ void ll_send(const bf16_t* x, const int* ids, const float* w, const int* tokens, int M, int k, int H,
                        const int* rep_first, const int* rep_count, const int* rep_rank, const int* rep_slot,
                        const int* shared, long stride, int rank, const u64* regions, int nregions, int* home_rows,
                        int* counts, int el, u64* const* flags, int nflags, u64* sent, unsigned int* done,
                        NvlWait wait) {
    int n = gridDim.x / M, t = blockIdx.x / n, d = blockIdx.x % n, T = *tokens;
    if (blockIdx.x == 0) ll_zero(counts, el);
    const u64* at = regions + (long)d * nregions;
    if (t == 0 && threadIdx.x == 0) ((int*)at[2])[rank] = T;
    bool any = false;
    if (t < T) {
        unsigned char* row = (unsigned char*)at[0] + ((long)rank * M + t) * stride;
        any = ll_pack_row(x, ids, w, t, T, d, k, H, rep_first, rep_count, rep_rank, rep_slot, shared, row);
    }
    if (threadIdx.x == 0) home_rows[t * n + d] = any ? d * M + t : -1;
    nvl_raise_and_wait(flags, nflags, sent, done, wait);
}

// The first step of all-to-all-v's device plan, a thread per token of the T (ids [T, k]): where
// each slot is served (the placement's tables and `shared`, as placed_replica; local slots
// below 2^20), as
// dest[t k + j] = rank << 20 | local slot there (-1 for no expert), and the ranks the token goes
// to as a bit mask ranks[t]. Where `slot_row` is not null (deterministic mode), slot_row[t k + j]
// = t k + j, the row its expert's output comes home to (nvl_slot_addresses), or -1 for no expert.
__global__ void nvl_plan_slots(const int* ids, int T, int k, const int* rep_first, const int* rep_count,
                               const int* rep_rank, const int* rep_slot, const int* shared, int* dest,
                               unsigned int* ranks, int* slot_row) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        unsigned int m = 0;
        for (int j = 0; j < k; j++) {
            int id = ids[(long)t * k + j], d = -1;
            if (id >= 0) {
                int p = placed_replica(rep_first, rep_count, shared, id, t, j);
                m |= 1u << rep_rank[p];
                d = rep_rank[p] << 20 | rep_slot[p];
            }
            dest[(long)t * k + j] = d;
            if (slot_row) slot_row[(long)t * k + j] = id >= 0 ? t * k + j : -1;
        }
        ranks[t] = m;
    }
}

// The dispatch plan of all-to-all-v from nvl_plan_slots' `dest` and `ranks`, a thread per
// token in blocks of NVL_PLAN_THREADS: each of the T tokens goes once to every rank d in its
// mask, in token order. For the token sent p-th to d: send_idx[d T + p] = the token,
// send_ids[(d T + p) k + j] = slot j's local expert on d (-1 where another rank serves it),
// home_rows[token n + d] = d T + p (-1 for the ranks it skips); sent[d] = the tokens sent to
// d. Each block first counts the tokens before its own that go to each rank (no separate scan
// runs), then places its own by a block-wide scan of ballots. With `dense`, every token goes
// to every rank as its own position (p = the token; the ids of a rank it skips all -1), so the
// batch's rows cross as they lie; home_rows still names only the ranks in its mask. Ranks
// n <= 32.
#define NVL_PLAN_THREADS 256
__global__ void __launch_bounds__(NVL_PLAN_THREADS)
    nvl_plan(const int* __restrict__ dest, const unsigned int* __restrict__ ranks, int T, int k, int n,
             int dense, int* __restrict__ send_idx, int* __restrict__ send_ids, int* __restrict__ home_rows,
             int* __restrict__ sent) {
    constexpr int PLAN_WARPS = NVL_PLAN_THREADS / 32;
    __shared__ int before[32];
    __shared__ int in_warp[PLAN_WARPS][32];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, t0 = blockIdx.x * NVL_PLAN_THREADS;
    const unsigned below = (1u << lane) - 1u;
    // The tokens before this block's going to rank d, counted by lane d of every warp, 32
    // tokens a step.
    int c = 0;
    for (int base = w * 32; base < t0; base += NVL_PLAN_THREADS) {
        const unsigned m = ranks[base + lane];
        for (int d = 0; d < n; d++) {
            const int hits = __popc(__ballot_sync(0xffffffffu, (m >> d) & 1u));
            if (lane == d) c += hits;
        }
    }
    if (lane < n) in_warp[w][lane] = c;
    __syncthreads();
    if (threadIdx.x < n) {
        int b = 0;
        for (int v = 0; v < PLAN_WARPS; v++) b += in_warp[v][threadIdx.x];
        before[threadIdx.x] = b;
    }
    __syncthreads();
    // This block's tokens: each warp's count for each rank, then each token's place.
    const int t = t0 + threadIdx.x;
    const unsigned m = t < T ? ranks[t] : 0u;
    for (int d = 0; d < n; d++) {
        const unsigned b = __ballot_sync(0xffffffffu, (m >> d) & 1u);
        if (lane == 0) in_warp[w][d] = __popc(b);
    }
    __syncthreads();
    for (int d = 0; d < n; d++) {
        const unsigned b = __ballot_sync(0xffffffffu, (m >> d) & 1u);
        int p = before[d] + __popc(b & below);
        for (int v = 0; v < w; v++) p += in_warp[v][d];
        if (t >= T) continue;
        const bool goes = (m >> d) & 1u;
        if (dense) p = t;
        else if (!goes) {
            home_rows[(long)t * n + d] = -1;
            continue;
        }
        const long row = (long)d * T + p;
        send_idx[row] = t;
        home_rows[(long)t * n + d] = goes ? (int)row : -1;
        for (int j = 0; j < k; j++) {
            const int x = dest[(long)t * k + j];
            send_ids[row * k + j] = x >= 0 && (x >> 20) == d ? (x & 0xfffff) : -1;
        }
    }
    // The last block's counts end at the batch's end: the tokens sent to each rank.
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x < n) {
        int total = before[threadIdx.x];
        for (int v = 0; v < PLAN_WARPS; v++) total += in_warp[v][threadIdx.x];
        sent[threadIdx.x] = dense ? T : total;
    }
}

// Where the experts are, after a device-planned dispatch: the local expert of each received
// slot (rows × k ids in the window, rank s's rows from starts[s], the first counts[s] of them
// sent), or el for a slot served elsewhere or a row no rank sent.
__global__ void nvl_landed_ids(const int* ids, const int* counts, const int* starts, int n, int rows, int k, int el,
                               int* local_ids) {
    for (long q = (long)blockIdx.x * blockDim.x + threadIdx.x; q < (long)rows * k; q += (long)gridDim.x * blockDim.x) {
        int r = (int)(q / k), s = 0;
        while (s + 1 < n && r >= starts[s + 1]) s++;
        int id = r - starts[s] < counts[s] ? ids[q] : -1;
        local_ids[q] = id >= 0 && id < el ? id : el;
    }
}

}  // extern "C"
