/* Stand-in for the MUSA SDK's musa_bf16.h (tests/tools/test_musa_frontend.py): its BF16 types
 * are __mt_bfloat16 and __mt_bfloat162, with CUDA's intrinsics' names. */
#ifndef CLLM_MUSA_STANDIN_BF16_H
#define CLLM_MUSA_STANDIN_BF16_H
#include <cuda_bf16.h>

#define __mt_bfloat16 __nv_bfloat16
#define __mt_bfloat162 __nv_bfloat162

#endif
