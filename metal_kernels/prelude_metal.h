// mlxtune kernel prelude: Metal (mx.fast.metal_kernel). Goes in the kernel's header.
// The body-side half (thread and group ids, KSHARED, KBARRIER) is in body_metal.h, because
// mx.fast.metal_kernel declares a thread attribute only when its name appears in the body.
#define KEXP(x) metal::exp(x)
#define KLOG(x) metal::log(x)
#define KTANH(x) metal::precise::tanh(x)

// Reductions over the 32 lanes of a SIMD-group; every lane gets the result.
inline float ksimd_sum(float x) { return metal::simd_sum(x); }
inline float ksimd_max(float x) { return metal::simd_max(x); }
