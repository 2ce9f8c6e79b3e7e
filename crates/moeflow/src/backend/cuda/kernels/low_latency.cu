// moeflow CUDA kernels of the fixed-capacity low-latency expert-parallel layer. Every shape is
// set by the capacity M (tokens per rank), never by the batch, so the whole layer can be
// captured in a CUDA graph. A message row is [k local ids (int) | k weights (float) | pad to
// 16 bytes | H bf16 values], `stride` bytes; rank d's message to rank e is M such rows. Over
// NVLink only the first `batch` rows of a message travel (the sender's batch size, which
// travels with them): the receiver's kernels take the senders' sizes `batches` [n] and treat
// the rest of each message as empty (null `batches`: every row arrived, rows past the batch
// with ids of -1). (Compiled after moe.cu, whose helpers it uses.)

extern "C" {

__device__ __forceinline__ long ll_row_offset(int k) { return ((8L * k + 15) / 16) * 16; }

// At home, one block per (token t < M, destination d): message row (d, t) of `send` gets token
// t when t < *tokens (the batch, read on the device) and rank d serves one of its slots (the
// placement's tables and `shared`, see placed_replica), with its ids local to d (-1 for slots
// served elsewhere) and its weights; otherwise only ids of -1. home_rows[t n + d] = d M + t, or -1
// when token t sent nothing to d; live[d] = the batch (the rows of each message that go).
__global__ void ll_pack(const bf16_t* x, const int* ids, const float* w, const int* tokens, int M, int k, int H,
                        const int* rep_first, const int* rep_count, const int* rep_rank, const int* rep_slot,
                        const int* shared, long stride, unsigned char* send, int* home_rows, int* live) {
    int t = blockIdx.x, d = blockIdx.y, n = gridDim.y, T = *tokens;
    if (t == 0 && threadIdx.x == 0) live[d] = T;
    unsigned char* row = send + ((long)d * M + t) * stride;
    int* rid = (int*)row;
    float* rw = (float*)(row + 4L * k);
    bool any = false;
    for (int j = 0; j < k; j++) {
        int id = t < T ? ids[t * k + j] : -1;
        any |= id >= 0 && rep_rank[placed_replica(rep_first, rep_count, shared, id, t, j)] == d;
    }
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        int id = t < T ? ids[t * k + j] : -1;
        int p = id >= 0 ? placed_replica(rep_first, rep_count, shared, id, t, j) : 0;
        bool here = id >= 0 && rep_rank[p] == d;
        rid[j] = here ? rep_slot[p] : -1;
        rw[j] = here ? w[t * k + j] : 0.0f;
    }
    if (threadIdx.x == 0) home_rows[t * n + d] = any ? d * M + t : -1;
    if (any) copy_row(x + (long)t * H, (bf16_t*)(row + ll_row_offset(k)), H);
}

// Whether message row r (of M a rank) arrived: always without `batches`, else when it lies
// within its sender's batch.
__device__ __forceinline__ bool ll_live(const int* batches, int r, int M) {
    return !batches || r % M < batches[r / M];
}

// Where the experts are, one block of 32 warps per local expert e: the received message rows
// (`tokens` = n M of them, in rank then token order) that arrived and name e get rows
// e cap + 0, 1, ... in that order: row_of_slot[row k + j] for the slot j naming e, counts[e]
// the number of rows. Every other entry of row_of_slot becomes -1, written by block
// (row k + j) % gridDim.x, so no entry is written twice.
__global__ void ll_group(const unsigned char* recv, long stride, int tokens, int k, int cap, const int* batches,
                         int M, int* row_of_slot, int* counts) {
    __shared__ int part[SCAN_WARPS];
    int e = blockIdx.x, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int lo, hi = chunk_of(tokens, w, &lo);
    int c = 0;
    for (int base = lo; base < hi; base += 32) {
        int r = base + lane;
        bool hit = false;
        if (r < hi && ll_live(batches, r, M)) {
            const int* rid = (const int*)(recv + (long)r * stride);
            for (int j = 0; j < k; j++) hit |= rid[j] == e;
        }
        c += __popc(__ballot_sync(0xffffffffu, hit));
    }
    if (lane == 0) part[w] = c;
    __syncthreads();
    int pos = e * cap;
    for (int i = 0; i < w; i++) pos += part[i];
    for (int base = lo; base < hi; base += 32) {
        int r = base + lane;
        int slot = -1;
        if (r < hi) {
            const bool live = ll_live(batches, r, M);
            const int* rid = (const int*)(recv + (long)r * stride);
            for (int j = 0; j < k; j++) {
                const int id = live ? rid[j] : -1;
                if (id == e) slot = j;
                if (id < 0 && ((long)r * k + j) % gridDim.x == e) row_of_slot[(long)r * k + j] = -1;
            }
        }
        unsigned int mask = __ballot_sync(0xffffffffu, slot >= 0);
        if (slot >= 0) row_of_slot[(long)r * k + slot] = pos + __popc(mask & ((1u << lane) - 1u));
        pos += __popc(mask);
    }
    if (threadIdx.x == 0) {
        int total = 0;
        for (int i = 0; i < SCAN_WARPS; i++) total += part[i];
        counts[e] = total;
    }
}

// a[row_of_slot[r k + j]] = the bf16 values of received message row r, for every slot with a
// row; one block per message row.
__global__ void ll_gather(const unsigned char* recv, long stride, int tokens, int k, int H, const int* row_of_slot,
                          bf16_t* a) {
    int r = blockIdx.x;
    if (r >= tokens) return;
    const bf16_t* src = (const bf16_t*)(recv + (long)r * stride + ll_row_offset(k));
    for (int j = 0; j < k; j++) {
        int row = row_of_slot[(long)r * k + j];
        if (row >= 0) copy_row(src, a + (long)row * H, H);
    }
}

// out[h] = the weighted sum of received message row r's expert rows (see ll_combine), by the
// block.
__device__ __forceinline__ void ll_combine_row(const unsigned char* recv, long stride, const bf16_t* y,
                                               const float* b2, const int* row_of_slot, int k, int H, long r,
                                               bf16_t* out) {
    const int* rid = (const int*)(recv + r * stride);
    const float* rw = (const float*)(recv + r * stride + 4L * k);
    weighted_row_bf16(y, b2, row_of_slot + r * k, rid, rw, k, H, out);
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
