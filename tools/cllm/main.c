/* Placeholder main until the subcommands land in this commit series. */
#include <stdio.h>
int main(void)
{
    return 0;
}
