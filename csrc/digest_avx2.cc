// xxh3-128 updates compiled for AVX2 (see digest_kernel.inc).
#define KVC_TARGET "avx2"
#define KVC_XXH_VECTOR 2  // XXH_AVX2
#define KVC_KERNEL avx2
#include "digest_kernel.inc"
