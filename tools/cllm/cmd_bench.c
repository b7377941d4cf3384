/* Placeholder: replaced by the benchmark in the next commit. */
#include <stdio.h>

#include "cmd.h"

int cllm_cmd_bench(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "cllm: bench is not implemented yet\n");
    return 2;
}
