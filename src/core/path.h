/* File path helpers. */
#ifndef CLLM_CORE_PATH_H
#define CLLM_CORE_PATH_H

/* dir + "/" + name in a malloc'd string (a trailing '/' on dir is not doubled; an empty dir is
 * "."); NULL when out of memory. */
char *cllm_path_join(const char *dir, const char *name);

#endif
