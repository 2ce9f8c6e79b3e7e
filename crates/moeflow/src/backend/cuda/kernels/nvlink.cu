// moeflow CUDA kernels of the NVLink transport: rows written straight into peer GPUs' memory
// (a peer window, see peer_window.rs), and sequence flags that say they have landed. Every
// exchange is one push (copy every lane's rows to every rank, then bump each receiver's flag for
// this rank) and one wait (spin until every sender's flag reached this exchange's number, with a
// clock deadline). (Compiled after moe.cu.)

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
// when `idx` is set) to `dst`, which may be a peer's memory.
struct PushLane {
    u64 src;
    u64 idx;
    u64 dst;
    unsigned int rows;
    unsigned int row_bytes;
};

// Copies every lane's rows (a warp per row, in 16-byte words where the lane's rows are aligned
// to them), then the last block to finish raises this push's number
// (`*sent` + 1) in each of `flags[0..nflags]` (the receivers' flag of this rank) after a system
// fence, so a receiver that sees the number also sees the rows. `done` counts finished blocks
// (left at 0 for the next push).
__global__ void nvl_push(const PushLane* lanes, int nlanes, u64* const* flags, int nflags, u64* sent,
                         unsigned int* done) {
    int lane = threadIdx.x % 32;
    long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    long warps = (long)gridDim.x * blockDim.x / 32;
    // Every lane's rows as one sequence weighted by bytes (plus a fixed cost a row), cut into
    // equal consecutive parts, one a warp: the copies to every rank, this one's included, run
    // at once, and lanes of short rows (ids, weights) do not hold warps idle.
    u64 total = 0;
    for (int l = 0; l < nlanes; l++) total += (u64)lanes[l].rows * (lanes[l].row_bytes + 256);
    u64 lo = total * warp / warps, hi = total * (warp + 1) / warps, base = 0;
    for (int l = 0; l < nlanes && base < hi; l++) {
        PushLane p = lanes[l];
        u64 wt = p.row_bytes + 256, span = (u64)p.rows * wt;
        if (lo < base + span) {
            long r0 = lo > base ? (long)((lo - base + wt - 1) / wt) : 0;
            long r1 = (long)min((u64)p.rows, (hi - base + wt - 1) / wt);
            const unsigned char* src = (const unsigned char*)p.src;
            unsigned char* dst = (unsigned char*)p.dst;
            int rb = (int)p.row_bytes;
            bool wide = ((p.src | p.dst | (u64)rb) & 15) == 0, word = ((p.src | p.dst | (u64)rb) & 3) == 0;
            for (long r = r0; r < r1; r++) {
                long s = p.idx ? (long)((const int*)p.idx)[r] : r;
                if (wide) push_row<uint4>(src, dst, s, r, rb / 16, rb, lane);
                else if (word) push_row<unsigned int>(src, dst, s, r, rb / 4, rb, lane);
                else push_row<unsigned char>(src, dst, s, r, rb, rb, lane);
            }
        }
        base += span;
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int before = atomicAdd(done, 1u);
        if (before == gridDim.x - 1) {
            __threadfence_system();
            u64 seq = *sent + 1;
            *sent = seq;
            *done = 0;
            for (int f = 0; f < nflags; f++) {
                asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flags[f]), "l"(seq) : "memory");
            }
        }
    }
}

// Waits until every one of the `n` senders' flags (this rank's window, `flags[src]`) reached
// this exchange's number (`*received` + 1), one thread per sender. A sender not there within
// `timeout_ns` (the GPU's global timer) sets `*status` to (stage + 1) << 16 | (src + 1) and the
// wait ends; a nonzero `*status` (set by the host on a failure elsewhere, or by an earlier
// timeout) ends every wait at once. `status` is host memory mapped into the device.
__global__ void nvl_wait(const u64* flags, int n, u64* received, long long timeout_ns, volatile unsigned int* status,
                         int stage) {
    u64 want = *received + 1;
    int src = threadIdx.x;
    if (src < n) {
        u64 start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        for (unsigned int spins = 0;; spins++) {
            u64 got;
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(got) : "l"(flags + src) : "memory");
            if (got >= want) break;
            if ((spins & 255u) == 0) {
                if (*status != 0) break;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if ((long long)(now - start) > timeout_ns) {
                    atomicCAS((unsigned int*)status, 0u, ((unsigned int)(stage + 1) << 16) | (unsigned int)(src + 1));
                    break;
                }
            }
        }
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) *received = want;
}

}  // extern "C"
