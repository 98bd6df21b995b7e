/* A C program built against a `tunegen export --format aot` export: it launches one exported
   prefill kernel through the CUDA driver API, twice (16-byte aligned buffers, then buffers
   offset by one element, which take the linker's other specialization), on the inputs run.py
   wrote, and compares each output with the float64 reference run.py wrote.

   Built by run.py with -DTUNEGEN_HEADER='"<kernel>.h"' -DTUNEGEN_ENTRY=<kernel>_default and one
   of -DTUNEGEN_FP16, -DTUNEGEN_BF16, -DTUNEGEN_FP32.

   usage: demo DIR BATCH HEADS_Q HEADS_KV SEQLEN_Q SEQLEN_K HEAD_DIM BLOCK_M SCALE
   DIR holds q.bin, k.bin, v.bin ((batch, heads, seqlen, head_dim), contiguous) and ref.bin
   (float32); the outputs go to out_aligned.bin and out_offset.bin. Prints one line per launch. */
#include <cuda.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include TUNEGEN_HEADER

#if defined(TUNEGEN_FP32)
#define ELEMENT_BYTES 4
#else
#define ELEMENT_BYTES 2
#endif

#define CHECK(call)                                                                     \
  do {                                                                                  \
    CUresult status_ = (call);                                                          \
    if (status_ != CUDA_SUCCESS) {                                                      \
      const char *text_ = "unknown";                                                    \
      cuGetErrorString(status_, &text_);                                                \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, text_);     \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

static void *read_file(const char *dir, const char *name, size_t bytes) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    fprintf(stderr, "cannot open %s\n", path);
    exit(1);
  }
  void *data = malloc(bytes);
  if (fread(data, 1, bytes, f) != bytes) {
    fprintf(stderr, "%s: expected %zu bytes\n", path, bytes);
    exit(1);
  }
  fclose(f);
  return data;
}

static void write_file(const char *dir, const char *name, const void *data, size_t bytes) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (f == NULL || fwrite(data, 1, bytes, f) != bytes) {
    fprintf(stderr, "cannot write %s\n", path);
    exit(1);
  }
  fclose(f);
}

static float element(const void *data, size_t i) {
#if defined(TUNEGEN_FP32)
  return ((const float *)data)[i];
#elif defined(TUNEGEN_BF16)
  uint32_t bits = (uint32_t)((const uint16_t *)data)[i] << 16;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
#else
  uint16_t h = ((const uint16_t *)data)[i];
  int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float value = exponent == 0    ? ldexpf((float)mantissa, -24)
                : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                 : ldexpf((float)(mantissa | 0x400), exponent - 25);
  return (h & 0x8000) ? -value : value;
#endif
}

/* One launch with every tensor `offset` elements into its buffer; returns 0 if the output is
   finite everywhere. */
static int launch(const char *dir, const char *out_name, size_t offset, const void *q, const void *k,
                  const void *v, const float *ref, int batch, int heads_q, int heads_kv, int seqlen_q,
                  int seqlen_k, int head_dim, int block_m, float scale) {
  size_t nq = (size_t)batch * heads_q * seqlen_q * head_dim;
  size_t nk = (size_t)batch * heads_kv * seqlen_k * head_dim;
  size_t shift = offset * ELEMENT_BYTES;
  CUdeviceptr dq, dk, dv, dout;
  CHECK(cuMemAlloc(&dq, nq * ELEMENT_BYTES + shift));
  CHECK(cuMemAlloc(&dk, nk * ELEMENT_BYTES + shift));
  CHECK(cuMemAlloc(&dv, nk * ELEMENT_BYTES + shift));
  CHECK(cuMemAlloc(&dout, nq * ELEMENT_BYTES + shift));
  CHECK(cuMemcpyHtoD(dq + shift, q, nq * ELEMENT_BYTES));
  CHECK(cuMemcpyHtoD(dk + shift, k, nk * ELEMENT_BYTES));
  CHECK(cuMemcpyHtoD(dv + shift, v, nk * ELEMENT_BYTES));
  CHECK(cuMemsetD8(dout, 0xff, nq * ELEMENT_BYTES + shift)); /* NaN everywhere until written */

  int sq_n = head_dim, sq_h = seqlen_q * head_dim, sq_b = heads_q * seqlen_q * head_dim;
  int sk_n = head_dim, sk_h = seqlen_k * head_dim, sk_b = heads_kv * seqlen_k * head_dim;
  int n_bh = batch * heads_q, n_m_blocks = (seqlen_q + block_m - 1) / block_m;
  CHECK(TUNEGEN_ENTRY(NULL, dq + shift, dk + shift, dv + shift, dout + shift, (CUdeviceptr)0,
                      scale * 1.4426950408889634f, sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sk_b, sk_h, sk_n,
                      sq_b, sq_h, sq_n, 0, 0, heads_q, n_bh, n_m_blocks, seqlen_q, seqlen_k));
  CHECK(cuCtxSynchronize());

  void *out = malloc(nq * ELEMENT_BYTES);
  CHECK(cuMemcpyDtoH(out, dout + shift, nq * ELEMENT_BYTES));
  double max_abs = 0.0, diff2 = 0.0, ref2 = 0.0;
  size_t nan = 0;
  for (size_t i = 0; i < nq; ++i) {
    float got = element(out, i);
    if (!isfinite(got)) {
      ++nan;
      continue;
    }
    double d = fabs((double)got - (double)ref[i]);
    max_abs = d > max_abs ? d : max_abs;
    diff2 += d * d;
    ref2 += (double)ref[i] * ref[i];
  }
  printf("%s: max_abs_err %.6g rel_err %.6g non_finite %zu\n", out_name, max_abs, sqrt(diff2 / ref2), nan);
  write_file(dir, out_name, out, nq * ELEMENT_BYTES);
  free(out);
  CHECK(cuMemFree(dq));
  CHECK(cuMemFree(dk));
  CHECK(cuMemFree(dv));
  CHECK(cuMemFree(dout));
  return nan != 0;
}

int main(int argc, char **argv) {
  if (argc != 10) {
    fprintf(stderr, "usage: %s DIR BATCH HEADS_Q HEADS_KV SEQLEN_Q SEQLEN_K HEAD_DIM BLOCK_M SCALE\n", argv[0]);
    return 2;
  }
  const char *dir = argv[1];
  int batch = atoi(argv[2]), heads_q = atoi(argv[3]), heads_kv = atoi(argv[4]);
  int seqlen_q = atoi(argv[5]), seqlen_k = atoi(argv[6]), head_dim = atoi(argv[7]), block_m = atoi(argv[8]);
  float scale = (float)atof(argv[9]);
  size_t nq = (size_t)batch * heads_q * seqlen_q * head_dim;
  size_t nk = (size_t)batch * heads_kv * seqlen_k * head_dim;
  void *q = read_file(dir, "q.bin", nq * ELEMENT_BYTES);
  void *k = read_file(dir, "k.bin", nk * ELEMENT_BYTES);
  void *v = read_file(dir, "v.bin", nk * ELEMENT_BYTES);
  float *ref = read_file(dir, "ref.bin", nq * sizeof(float));

  CUdevice device;
  CUcontext context;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&device, 0));
  CHECK(cuDevicePrimaryCtxRetain(&context, device));
  CHECK(cuCtxSetCurrent(context));
  int failed = launch(dir, "out_aligned.bin", 0, q, k, v, ref, batch, heads_q, heads_kv, seqlen_q, seqlen_k,
                      head_dim, block_m, scale);
  failed |= launch(dir, "out_offset.bin", 1, q, k, v, ref, batch, heads_q, heads_kv, seqlen_q, seqlen_k,
                   head_dim, block_m, scale);
  CHECK(cuDevicePrimaryCtxRelease(device));
  free(q);
  free(k);
  free(v);
  free(ref);
  return failed;
}
