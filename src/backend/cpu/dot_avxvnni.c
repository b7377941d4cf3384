/*
 * The AVX-VNNI kernel family: dot_avx2.c compiled again with -mavxvnni on top of the AVX2
 * flags (CMakeLists.txt: *_avxvnni.c), which turns its int16-pair products into vpdpwssd and
 * its legacy blocks' byte products into vpdpbusd (the comment at its top). Called only after a
 * run-time check for AVX2 + FMA + F16C and AVX-VNNI (matmul.c).
 */
#include "backend/cpu/dot_avx2.c"
