/* What the CUDA emulator (tests/emu/emu.cpp) lets a C test do that a GPU does not: run out of
 * device memory on demand. Only for tests built against the emulator. */
#ifndef CLLM_TESTS_EMU_HOOKS_H
#define CLLM_TESTS_EMU_HOOKS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* From now on every device allocation (cudaMalloc) of n bytes or more fails as out of memory,
 * as a full device would fail it; 0: none. So does instantiating a recorded graph whose
 * nodes need n bytes or more (the emulator counts 1 KiB a node). Safe to call while other
 * threads allocate. */
void emu_refuse_device_bytes(size_t n);
/* How many device allocations have been refused so far, and how many of them were graphs. */
long emu_refused_allocations(void);
long emu_refused_graphs(void);

#ifdef __cplusplus
}
#endif

#endif
