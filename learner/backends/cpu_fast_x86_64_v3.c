/* The cpu-fast kernel compiled for x86-64-v3 (AVX2, FMA, BMI2: Haswell, Zen and later); the
 * glue runs it only on a CPU that has them. See cpu_fast_train.h. */
#include "cpu_fast.h"

#if CPU_FAST_HAVE_V3
#pragma GCC target("arch=x86-64-v3")
#define KERNEL_ENTRY cpu_fast_train_x86_64_v3
#include "cpu_fast_train.h"
#else
typedef int cpu_fast_no_v3; /* nothing to build on this compiler or CPU family */
#endif
