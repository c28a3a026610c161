/* The cpu-fast kernel for any CPU (on x86-64: SSE2 only). See cpu_fast_train.h. */
#define KERNEL_ENTRY cpu_fast_train_generic
#include "cpu_fast_train.h"
