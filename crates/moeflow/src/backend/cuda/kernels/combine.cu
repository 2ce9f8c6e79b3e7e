// The combine: each token's expert rows weighted and summed in slot order (one GPU), a rank's
// partial sums of the tokens it served (expert parallel) and their sum at home in rank order,
// the shared expert's output added; and, for routers that weight the input instead (top-1),
// the rows scaled by their weight. (Compiled after common.cu.)

// The weighted rows of one token, in slot order: acc[q] += w_j · (y[rows_j, h] + b2[ids_j, h]) for
// the eight columns h = 8c + q (sum_rows8; H % 8 == 0) or the one column h (sum_rows1), over the
// slots j < k whose row is not -1. `w` null means weight 1; `b2` null means no bias.
// (The rows are taken BATCH at a time, their values loaded before any is summed, so the loads
// overlap; the sums keep slot order. Batches of more than four load the weights with the row
// numbers, a round trip fewer for a decode step's few rows; the throughput kernels' batches of
// four load them as they sum, which keeps their registers, and blocks a SM, as they are.)
template <int BATCH = 4>
__device__ __forceinline__ void sum_rows8(const bf16_t* y, const float* b2, const int* rows, const int* ids,
                                          const float* w, int k, int H, int c, float* acc) {
    constexpr bool early = BATCH > 4;
    for (int j0 = 0; j0 < k; j0 += BATCH) {
        int r[BATCH];
        float wv[BATCH];
        uint4 raw[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; u++) {
            r[u] = j0 + u < k ? rows[j0 + u] : -1;
            if (early) wv[u] = w && j0 + u < k ? w[j0 + u] : 1.0f;
            else if (r[u] >= 0) raw[u] = ((const uint4*)(y + (long)r[u] * H))[c];
        }
        if (early) {
#pragma unroll
            for (int u = 0; u < BATCH; u++)
                if (r[u] >= 0) raw[u] = ((const uint4*)(y + (long)r[u] * H))[c];
        }
#pragma unroll
        for (int u = 0; u < BATCH; u++) {
            if (r[u] < 0) continue;
            float v[8];
            unpack8(raw[u], v);
            const float wj = early ? wv[u] : w ? w[j0 + u] : 1.0f;
            const float* bj = b2 ? b2 + (long)ids[j0 + u] * H + 8 * c : 0;
            for (int q = 0; q < 8; q++) acc[q] += wj * (bj ? v[q] + bj[q] : v[q]);
        }
    }
}
__device__ __forceinline__ float sum_rows1(const bf16_t* y, const float* b2, const int* rows, const int* ids,
                                           const float* w, int k, int H, int h) {
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        if (rows[j] < 0) continue;
        float v = bf16_to_f32(y[(long)rows[j] * H + h]);
        if (b2) v += b2[(long)ids[j] * H + h];
        acc += (w ? w[j] : 1.0f) * v;
    }
    return acc;
}

// Eight floats as eight bf16 in one 16-byte word.
__device__ __forceinline__ uint4 pack8(const float* f) {
    unsigned int o[4];
    for (int j = 0; j < 4; j++) o[j] = (unsigned int)f32_to_bf16(f[2 * j]) | ((unsigned int)f32_to_bf16(f[2 * j + 1]) << 16);
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// out_row[h] = the bf16 weighted sum of one token's rows (sum_rows8 / sum_rows1 over its k
// slots: rows, ids, weights), every column h < H, shared among the threads of the gridDim.y
// blocks of the token (this one the blockIdx.y-th); BATCH as in sum_rows8.
template <int BATCH = 4>
__device__ __forceinline__ void weighted_row_bf16(const bf16_t* y, const float* b2, const int* rows, const int* ids,
                                                  const float* w, int k, int H, bf16_t* out_row) {
    if (H % 8 == 0) {
        for (int c = threadIdx.x + blockIdx.y * blockDim.x; c < H / 8; c += blockDim.x * gridDim.y) {
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            sum_rows8<BATCH>(y, b2, rows, ids, w, k, H, c, acc);
            ((uint4*)out_row)[c] = pack8(acc);
        }
    } else {
        for (int h = threadIdx.x + blockIdx.y * blockDim.x; h < H; h += blockDim.x * gridDim.y) {
            out_row[h] = f32_to_bf16(sum_rows1(y, b2, rows, ids, w, k, H, h));
        }
    }
}

extern "C" {

// out[t, h] = sum_j w[t, j] * (y[row_of_slot[t k + j], h] + b2[ids[t k + j], h]), in slot order,
// then + g_t * ys[t, h] when the shared output `ys` is given (g_t as in add_shared). Blocks
// (x, y) take tokens x, x + gridDim.x, ... and the y-th of gridDim.y interleaved shares of their
// columns (small batches spread a token over several blocks, since one block a token leaves
// the GPU idle); eight columns per thread with 16-byte loads when H % 8 == 0.
__global__ void combine(const bf16_t* y, const float* b2, const int* ids, const float* w, const int* row_of_slot, int T,
                        int k, int H, int weights_applied, const bf16_t* ys, const float* x, const float* gate,
                        float* out) {
    __shared__ float red[32];
    for (long t = blockIdx.x; t < T; t += gridDim.x) {
        float g = ys ? shared_gate(x, gate, t, H, red) : 0.0f;
        const int *rs = row_of_slot + t * k, *id = ids + t * k;
        const float* wt = weights_applied ? 0 : w + t * k;
        if (H % 8 == 0) {
            for (int c = threadIdx.x + blockIdx.y * blockDim.x; c < H / 8; c += blockDim.x * gridDim.y) {
                float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                sum_rows8(y, b2, rs, id, wt, k, H, c, acc);
                if (ys) {
                    float sh[8];
                    unpack8(((const uint4*)(ys + t * H))[c], sh);
                    for (int q = 0; q < 8; q++) acc[q] += g * sh[q];
                }
                float4* o = (float4*)(out + t * H + 8 * c);
                o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
            }
        } else {
            for (int h = threadIdx.x + blockIdx.y * blockDim.x; h < H; h += blockDim.x * gridDim.y) {
                float acc = sum_rows1(y, b2, rs, id, wt, k, H, h);
                if (ys) acc += g * bf16_to_f32(ys[t * H + h]);
                out[t * H + h] = acc;
            }
        }
    }
}

// Expert-parallel, on the rank holding the experts: part[t, h] = sum over the slots of received
// token t whose expert is here (row >= 0) of w * (y[row, h] + b2[expert, h]), in slot order, as
// bf16. One block per token, as combine.
__global__ void combine_partial(const bf16_t* y, const float* b2, const int* local_ids, const float* w,
                                const int* row_of_slot, int T, int k, int H, bf16_t* part) {
    for (long t = blockIdx.x; t < T; t += gridDim.x) {
        weighted_row_bf16(y, b2, row_of_slot + t * k, local_ids + t * k, w + t * k, k, H, part + t * H);
    }
}

}  // extern "C"

// out[t, 8c .. 8c + 7] = acc, plus ys[t, 8c .. 8c + 7] (an ungated shared expert's output)
// first when `ys` is not null.
__device__ __forceinline__ void store_sum8(float* out, const bf16_t* ys, long t, int H, int c, float* acc) {
    if (ys) {
        float sh[8];
        unpack8(((const uint4*)(ys + t * H))[c], sh);
#pragma unroll
        for (int q = 0; q < 8; q++) acc[q] += sh[q];
    }
    float4* o = (float4*)(out + t * H + 8 * c);
    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

// Expert-parallel, at home: out[t, h] = sum over ranks d in rank order of part[rows[t n + d], h]
// (rows -1 where token t sent nothing to d), then + ys[t, h] (an ungated shared expert's
// output) when `ys` is not null, for the first T tokens, or the first *live when `live` is not
// null. A token's columns are shared by `chunks` blocks: gridDim.y (per_token's split) without
// `live`; with it, as many as keep about gridDim.x blocks busy (a graph's grid is set by the
// capacity T, the batch is read here: one token takes gridDim.y blocks, a full batch one each).
// A thread takes TURN of its 8-column groups at a time, their loads in flight together.
template <int TURN>
__device__ __forceinline__ void sum_partials_at(const bf16_t* part, const int* rows, int T, int n, int H,
                                                const int* live, const bf16_t* ys, float* out) {
    int chunks = gridDim.y;
    if (live) {
        T = min(T, *live);
        chunks = max(1, min((int)gridDim.y, (int)gridDim.x / max(T, 1)));
    }
    for (long item = (long)blockIdx.y * gridDim.x + blockIdx.x; item < (long)T * chunks;
         item += (long)gridDim.x * gridDim.y) {
        long t = item / chunks;
        int first = (int)(item % chunks) * blockDim.x + threadIdx.x, step = blockDim.x * chunks;
        const int* rt = rows + t * n;
        if (H % 8 == 0) {
            if constexpr (TURN == 1) {
                for (int c = first; c < H / 8; c += step) {
                    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                    sum_rows8(part, 0, rt, 0, 0, n, H, c, acc);
                    store_sum8(out, ys, t, H, c, acc);
                }
            } else {
                // TURN column groups at a time, the rows of two ranks at a time: every load is
                // issued before any is summed, so they are in flight together. Each column still
                // sums its ranks in rank order.
                for (int c0 = first; c0 < H / 8; c0 += TURN * step) {
                    float acc[TURN][8];
#pragma unroll
                    for (int u = 0; u < TURN; u++)
#pragma unroll
                        for (int q = 0; q < 8; q++) acc[u][q] = 0.0f;
                    for (int d0 = 0; d0 < n; d0 += 2) {
                        int r[2];
                        uint4 raw[TURN][2];
#pragma unroll
                        for (int v = 0; v < 2; v++) r[v] = d0 + v < n ? rt[d0 + v] : -1;
#pragma unroll
                        for (int u = 0; u < TURN; u++)
#pragma unroll
                            for (int v = 0; v < 2; v++)
                                if (r[v] >= 0 && c0 + u * step < H / 8)
                                    raw[u][v] = ((const uint4*)(part + (long)r[v] * H))[c0 + u * step];
#pragma unroll
                        for (int u = 0; u < TURN; u++)
#pragma unroll
                            for (int v = 0; v < 2; v++) {
                                if (r[v] < 0 || c0 + u * step >= H / 8) continue;
                                float f[8];
                                unpack8(raw[u][v], f);
#pragma unroll
                                for (int q = 0; q < 8; q++) acc[u][q] += f[q];
                            }
                    }
#pragma unroll
                    for (int u = 0; u < TURN; u++) {
                        const int c = c0 + u * step;
                        if (c < H / 8) store_sum8(out, ys, t, H, c, acc[u]);
                    }
                }
            }
        } else {
            for (int h = first; h < H; h += step) {
                float acc = sum_rows1(part, 0, rt, 0, 0, n, H, h);
                if (ys) acc += bf16_to_f32(ys[t * H + h]);
                out[t * H + h] = acc;
            }
        }
    }
}

extern "C" {

// sum_partials_at for the batches sized on the host, bound by memory bandwidth: a group at a
// time, which keeps the registers for more blocks a SM.
__global__ void sum_partials(const bf16_t* part, const int* rows, int T, int n, int H, const int* live,
                             const bf16_t* ys, float* out) {
    sum_partials_at<1>(part, rows, T, n, H, live, ys, out);
}

// sum_partials_at for the low-latency batch read on the device (`live`), a few rows a block and
// bound by the loads' latency: four groups at a time.
__global__ void sum_partials_live(const bf16_t* part, const int* rows, int T, int n, int H, const int* live,
                                  const bf16_t* ys, float* out) {
    sum_partials_at<4>(part, rows, T, n, H, live, ys, out);
}

// x[t, :] *= w[t] (router weight applied on the input, top-1).
__global__ void scale_rows_bf16(bf16_t* x, const float* w, int T, int H) {
    long n = (long)T * H;
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < n; idx += (long)gridDim.x * blockDim.x)
        x[idx] = f32_to_bf16(bf16_to_f32(x[idx]) * w[idx / H]);
}

// out[t, :] += g_t * ys[t, :], g_t = sigmoid(x[t] . gate) when gate is given, else 1. One block per token
// (the first *live when `live` is not null).
__global__ void add_shared(float* out, const bf16_t* ys, const float* x, const float* gate, int T, int H,
                           const int* live) {
    int t = blockIdx.x;
    if (t >= T || (live && t >= *live)) return;
    __shared__ float red[32];
    float g = shared_gate(x, gate, t, H, red);
    for (int h = threadIdx.x; h < H; h += blockDim.x) out[(long)t * H + h] += g * bf16_to_f32(ys[(long)t * H + h]);
}

}  // extern "C"
