// moeflow CUDA kernels of the fixed-capacity low-latency expert-parallel layer. Every shape is
// set by the capacity M (tokens per rank), never by the batch, so the whole layer can be
// captured in a CUDA graph. A message row is [k local ids (int) | k weights (float) | pad to
// 16 bytes | H bf16 values], `stride` bytes; rank d's message to rank e is M such rows. Over
// NVLink only the first `batch` rows of a message travel (the sender's batch size, which
// travels with them): the receiver's kernels take the senders' sizes `batches` [n] and treat
// the rest of each message as empty (null `batches`: every row arrived, rows past the batch
// with ids of -1). (Compiled after common.cu and the stage files, whose helpers it uses.)

extern "C" {

__device__ __forceinline__ long ll_row_offset(int k) { return ((8L * k + 15) / 16) * 16; }

// One bf16 row of H values from src to dst by `step` threads (a warp's lanes, or a block's),
// this one the `first`-th: 16-byte moves (four loads in flight a thread before their stores)
// when H % 8 == 0.
__device__ __forceinline__ void copy_row_by(const bf16_t* __restrict__ src, bf16_t* __restrict__ dst, int H,
                                            int first, int step) {
    if (H % 8 == 0) {
        const uint4* s4 = (const uint4*)src;
        uint4* d4 = (uint4*)dst;
        int units = H / 8;
        for (int c0 = first; c0 < units; c0 += 4 * step) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                if (c0 + u * step < units) v[u] = s4[c0 + u * step];
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                if (c0 + u * step < units) d4[c0 + u * step] = v[u];
            }
        }
    } else {
        for (int h = first; h < H; h += step) dst[h] = src[h];
    }
}

// Message row (t, d) at `row`, by the block (every thread of it calls this): token t (of the
// batch `T`) with its ids local to rank d (-1 for slots served elsewhere; the placement's
// tables and `shared`, see placed_replica) and its weights, and its values when rank d serves
// one of its slots; only ids of -1 for t >= T. A thread a slot looks its slot up. Returns
// whether token t goes to rank d.
__device__ __forceinline__ bool ll_pack_row(const bf16_t* x, const int* ids, const float* w, int t, int T, int d,
                                            int k, int H, const int* rep_first, const int* rep_count,
                                            const int* rep_rank, const int* rep_slot, const int* shared,
                                            unsigned char* row) {
    int* rid = (int*)row;
    float* rw = (float*)(row + 4L * k);
    bool mine = false;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        int id = t < T ? ids[t * k + j] : -1;
        int p = id >= 0 ? placed_replica(rep_first, rep_count, shared, id, t, j) : 0;
        bool here = id >= 0 && rep_rank[p] == d;
        rid[j] = here ? rep_slot[p] : -1;
        rw[j] = here ? w[t * k + j] : 0.0f;
        mine |= here;
    }
    bool any = __syncthreads_or(mine);
    if (any) copy_row_by(x + (long)t * H, (bf16_t*)(row + ll_row_offset(k)), H, threadIdx.x, blockDim.x);
    return any;
}

// The `el` ints of counts zeroed by the calling block: the send does it for the arrangement
// (ll_arrange counts into them), which runs after it on the same stream.
__device__ __forceinline__ void ll_zero(int* counts, int el) {
    for (int e = threadIdx.x; e < el; e += blockDim.x) counts[e] = 0;
}

// At home, one block per (token t < M, destination d): message row (d, t) of `send` (see
// ll_pack_row; the batch is read on the device at `tokens`); home_rows[t n + d] = d M + t, or
// -1 when token t sent nothing to d; the `el` ints of `counts` zeroed (ll_zero).
__global__ void ll_pack(const bf16_t* x, const int* ids, const float* w, const int* tokens, int M, int k, int H,
                        const int* rep_first, const int* rep_count, const int* rep_rank, const int* rep_slot,
                        const int* shared, long stride, unsigned char* send, int* home_rows, int* counts, int el) {
    int t = blockIdx.x, d = blockIdx.y, n = gridDim.y, T = *tokens;
    if (t == 0 && d == 0) ll_zero(counts, el);
    bool any = ll_pack_row(x, ids, w, t, T, d, k, H, rep_first, rep_count, rep_rank, rep_slot, shared,
                           send + ((long)d * M + t) * stride);
    if (threadIdx.x == 0) home_rows[t * n + d] = any ? d * M + t : -1;
}

// Whether message row r (of M a rank) arrived: always without `batches`, else when it lies
// within its sender's batch.
__device__ __forceinline__ bool ll_live(const int* batches, int r, int M) {
    return !batches || r % M < batches[r / M];
}

// The received messages laid out per local expert, a thread per slot: slot i = r k + j of
// message row r (of the `tokens` = n M received, in rank then token order) that arrived and
// names local expert e < el takes row e cap + counts[e]++ of `a` (counts zeroed by the send;
// a message row names an expert at most once, so no expert passes cap rows), in the order the
// increments land. row_of_slot[i] is that row (-1 for every other slot), and either the row's
// values are copied into `a` (the warp copies its slots' rows together) or, with `a` null,
// slot_of_row[row] = i (for a GEMM that gathers the rows from the messages itself). A row's
// products do not depend on where among its expert's rows it sits, so the order changes no
// result; each thread reads its slot's id once, with no pass over the other experts' ids.
__global__ void ll_arrange(const unsigned char* recv, long stride, int tokens, int k, int H, int cap,
                           const int* batches, int M, int el, int* row_of_slot, int* counts, bf16_t* a,
                           int* slot_of_row) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    long r = 0;
    int row = -1;
    if (i < (long)tokens * k) {
        r = i / k;
        const int id = ll_live(batches, (int)r, M) ? ((const int*)(recv + r * stride))[i - r * k] : -1;
        if (id >= 0 && id < el) {
            const int at = atomicAdd(&counts[id], 1);
            if (at < cap) row = id * cap + at;
            if (row >= 0 && !a) slot_of_row[row] = (int)i;
        }
        row_of_slot[i] = row;
    }
    if (!a) return;
    for (unsigned left = __ballot_sync(0xffffffffu, row >= 0); left; left &= left - 1) {
        const int from = __ffs(left) - 1;
        const long src = __shfl_sync(0xffffffffu, r, from);
        const int dst = __shfl_sync(0xffffffffu, row, from);
        copy_row_by((const bf16_t*)(recv + src * stride + ll_row_offset(k)), a + (long)dst * H, H, lane, 32);
    }
}

// out[h] = the weighted sum of received message row r's expert rows (see ll_combine), by the
// block: every slot's row loaded at once up to eight slots (a decode step's few rows wait on
// memory together).
__device__ __forceinline__ void ll_combine_row(const unsigned char* recv, long stride, const bf16_t* y,
                                               const float* b2, const int* row_of_slot, int k, int H, long r,
                                               bf16_t* out) {
    const int* rid = (const int*)(recv + r * stride);
    const float* rw = (const float*)(recv + r * stride + 4L * k);
    weighted_row_bf16<8>(y, b2, row_of_slot + r * k, rid, rw, k, H, out);
}

// part[r, h] = sum over the slots j of message row r that have a row here, in slot order, of
// weight_j * (y[row, h] + b2[local id_j, h]), as bf16 (0 for rows with no slot here), for the
// rows that arrived (the others go back to no one). One block per message row, as combine.
__global__ void ll_combine(const unsigned char* recv, long stride, const bf16_t* y, const float* b2,
                           const int* row_of_slot, int tokens, int k, int H, const int* batches, int M,
                           bf16_t* part) {
    for (long r = blockIdx.x; r < tokens; r += gridDim.x) {
        if (ll_live(batches, (int)r, M)) ll_combine_row(recv, stride, y, b2, row_of_slot, k, H, r, part + r * H);
    }
}

}  // extern "C"
