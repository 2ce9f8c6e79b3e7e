// A profiling aid for the GPU machine, which has no Nsight Systems: a CUPTI injection library
// that records every kernel and memory copy of a process (device, stream, start and end in ns
// of one clock shared by the GPUs) and writes one line each to $KTRACE_OUT at exit:
//   K <device> <stream> <start> <end> <blocks> <threads a block> <kernel name>
//   M <device> <stream> <start> <end> <bytes> <copy kind> memcpy
// Nsight Compute serializes kernels, so it cannot profile ranks that wait for each other; this
// sees them run side by side. tools/gpu/kernel_trace.sh builds it against the machine's CUPTI
// and runs a command under it; tools/gpu/kernel_timeline.py prints the kernels of one layer call.
// KERNEL_RECORD and MEMCPY_RECORD name the newest record structs of the installed CUPTI.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE* out;

static void CUPTIAPI give_buffer(uint8_t** buffer, size_t* size, size_t* max_records) {
    *size = 16 << 20;
    *buffer = (uint8_t*)aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI take_buffer(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
    CUpti_Activity* r = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const KERNEL_RECORD* k = (const KERNEL_RECORD*)r;
            fprintf(out, "K %u %u %llu %llu %u %u %s\n", k->deviceId, k->streamId, (unsigned long long)k->start,
                    (unsigned long long)k->end, k->gridX * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ,
                    k->name);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const MEMCPY_RECORD* m = (const MEMCPY_RECORD*)r;
            fprintf(out, "M %u %u %llu %llu %llu %u memcpy\n", m->deviceId, m->streamId, (unsigned long long)m->start,
                    (unsigned long long)m->end, (unsigned long long)m->bytes, (unsigned)m->copyKind);
        }
    }
    free(buffer);
}

static void finish(void) {
    cuptiActivityFlushAll(1);
    fclose(out);
}

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
int InitializeInjection(void) {
    const char* path = getenv("KTRACE_OUT");
    out = fopen(path ? path : "kernel_trace.txt", "w");
    if (!out) return 0;
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityRegisterCallbacks(give_buffer, take_buffer);
    atexit(finish);
    return 1;
}
