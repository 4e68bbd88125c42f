// Portable kernel (any architecture): one lane at a time, left to the auto-vectorizer.
#include <cstdint>

#include "kernel_api.h"

namespace cpu_adam::isa_portable {
#include "scalar_policy.h"
using Vec = Scalar;
using VecBf16 = Scalar;
using VecBf16States = Scalar;
#include "adam_kernel.h"
}  // namespace cpu_adam::isa_portable
