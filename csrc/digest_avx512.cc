// xxh3-128 updates compiled for AVX-512 (see digest_kernel.inc).
#define KVC_TARGET "avx512f"
#define KVC_XXH_VECTOR 3  // XXH_AVX512
#define KVC_KERNEL avx512
#include "digest_kernel.inc"
