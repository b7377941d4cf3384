/*
 * The AVX-VNNI family's kernel for packed Q4_K rows: packed_avx2.c compiled again with
 * -mavxvnni on top of the AVX2 flags (CMakeLists.txt: *_avxvnni.c), its sub-blocks' sums made
 * by vpdpbusd (the comment at its top). Called only after the family's run-time check.
 */
#include "backend/cpu/packed_avx2.c"
