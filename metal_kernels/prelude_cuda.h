// mlxtune kernel prelude: CUDA (mx.fast.cuda_kernel). Goes in the kernel's header.
#define KEXP(x) expf(x)
#define KLOG(x) logf(x)
#define KTANH(x) tanhf(x)

// Reductions over the 32 lanes of a warp; every lane gets the result.
__device__ inline float ksimd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ inline float ksimd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) {
    float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = x > y ? x : y;
  }
  return x;
}
