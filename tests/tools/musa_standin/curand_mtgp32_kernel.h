/* Stand-in (tests/tools/test_musa_frontend.py): clang's CUDA wrapper includes this cuRAND
 * header in every compilation; nothing here uses cuRAND, and no MUSA build has it. */
#ifndef CLLM_MUSA_STANDIN_CURAND_MTGP32_KERNEL_H
#define CLLM_MUSA_STANDIN_CURAND_MTGP32_KERNEL_H
#endif
