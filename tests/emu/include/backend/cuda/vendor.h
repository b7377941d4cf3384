/* Emulator stand-in for src/backend/cuda/vendor.h: the CPU emulator's CUDA names. */
#ifndef CLLM_BACKEND_CUDA_VENDOR_H
#define CLLM_BACKEND_CUDA_VENDOR_H
#include "emu.h"
#endif
