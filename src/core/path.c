/* Path joining for model folders: the one place that decides how a folder and a name combine. */
#include "core/path.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

char *cllm_path_join(const char *dir, const char *name)
{
    size_t dl = strlen(dir);
    while (dl > 1 && dir[dl - 1] == '/')
        dl--;
    if (dl == 0) {
        dir = ".";
        dl = 1;
    }
    bool slash = dir[dl - 1] != '/';
    size_t nl = strlen(name);
    char *p = malloc(dl + slash + nl + 1);
    if (!p)
        return NULL;
    memcpy(p, dir, dl);
    if (slash)
        p[dl] = '/';
    memcpy(p + dl + slash, name, nl + 1);
    return p;
}
