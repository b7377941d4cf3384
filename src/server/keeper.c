/* The keeper of keeper.h: a parent that binds, starts the serving process and restarts it
 * when it dies of a signal. It loads no model and touches no device, so what kills a serving
 * process is unlikely to kill it. */
#include "server/keeper.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <poll.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "engine/request.h"
#include "server/custody.h"
#include "server/listen.h"
#include "server/owed.h"

extern char **environ;

/* Serving processes that die before they are ready this many times in a row are not started
 * again: the start itself fails (a restart on the CPU did not help either). */
#define FAILED_STARTS_MAX 5
/* Deaths sooner than this after the start, in a row, make the pauses before restarts grow. */
#define QUICK_DEATH_S 60.0
#define MAX_PAUSE_S 30

static void set_env_int(const char *name, long v)
{
    char s[32];
    snprintf(s, sizeof s, "%ld", v);
    setenv(name, s, 1);
}

/* Starts the serving process; *ready gets the read end of the pipe it writes a byte to once
 * it is ready to serve (so the keeper knows, after its death, whether it ever got there). */
static pid_t start_child(const char *exe, char **argv, int *ready)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) {
        cllm_log(CLLM_LOG_ERROR, "keeper: cannot make a pipe: %s", strerror(errno));
        return -1;
    }
    const int w = fcntl(p[1], F_DUPFD, 3); /* the child's end, handed down across exec */
    const int dup_errno = errno;
    close(p[1]);
    set_env_int(CLLM_KEEPER_ENV_READY, w);
    posix_spawnattr_t attr;
    sigset_t none;
    sigemptyset(&none);
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigmask(&attr, &none); /* the keeper's blocked signals are its own */
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
    pid_t pid = -1;
    int rc = w < 0 ? dup_errno : posix_spawn(&pid, exe, NULL, &attr, argv, environ);
    posix_spawnattr_destroy(&attr);
    if (w >= 0)
        close(w);
    if (rc != 0) {
        cllm_log(CLLM_LOG_ERROR, "keeper: cannot start %s: %s", exe, strerror(rc));
        close(p[0]);
        return -1;
    }
    *ready = p[0];
    return pid;
}

/* The keeper's wait for its serving process to end. */
struct child_watch {
    pid_t pid;
    int sigfd;              /* SIGINT, SIGTERM and SIGCHLD, as a descriptor */
    int ready;              /* the ready pipe's read end, -1 once at its end */
    bool was_ready;         /* the process said it is ready */
    bool on_gpu;            /* ... on a GPU, and did not move to the CPU since */
    int stop_sig;           /* the first SIGINT/SIGTERM that came */
    struct cllm_owed *owed; /* the requests it holds, and those owed to it */
};

/* Takes the signals that came: passes SIGINT/SIGTERM on. Reaps any child that ended: as a
 * container's first process the keeper inherits orphans (a GPU probe whose server died), which
 * would otherwise stay zombies. True, with *status, once the serving process ended. */
static bool take_signals(struct child_watch *w, int *status)
{
    struct signalfd_siginfo si;
    while (read(w->sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
        const int sig = (int)si.ssi_signo;
        if (sig == SIGINT || sig == SIGTERM) {
            if (!w->stop_sig)
                w->stop_sig = sig;
            kill(w->pid, sig);
        }
    }
    for (;;) {
        int st = 0;
        const pid_t got = waitpid(-1, &st, WNOHANG);
        if (got == w->pid) {
            *status = st;
            return true;
        }
        if (got > 0)
            continue;
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0 && errno != ECHILD) {
            cllm_log(CLLM_LOG_ERROR, "keeper: waiting for the serving process: %s",
                     strerror(errno));
            *status = 1 << 8; /* as an exit with status 1 */
            return true;
        }
        return false;
    }
}

/* Reads what the serving process said on its ready pipe (keeper.h, CLLM_KEEPER_READY_*);
 * closes the pipe at its end. */
static void read_ready(struct child_watch *w)
{
    char said[64];
    ssize_t n;
    while ((n = read(w->ready, said, sizeof said)) > 0)
        for (ssize_t i = 0; i < n; i++) {
            if (said[i] == CLLM_KEEPER_READY_CPU || said[i] == CLLM_KEEPER_READY_GPU) {
                w->was_ready = true;
                w->on_gpu = said[i] == CLLM_KEEPER_READY_GPU;
            } else if (said[i] == CLLM_KEEPER_MOVED_TO_CPU) {
                w->on_gpu = false;
            }
        }
    if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        close(w->ready);
        w->ready = -1;
    }
}

/* Runs until the serving process ends; meanwhile it notes when the process is ready and
 * keeps the requests it holds (owed.h). */
static int wait_child(struct child_watch *w)
{
    struct pollfd *p = NULL;
    size_t cap = 0;
    int status = 1 << 8;
    for (;;) {
        const size_t want = 2 + cllm_owed_max_fds(w->owed);
        if (want > cap) {
            struct pollfd *np = realloc(p, want * 2 * sizeof *np);
            if (np) {
                p = np;
                cap = want * 2;
            }
        }
        if (!p) { /* no memory for even the two: a plain wait for the process */
            while (waitpid(w->pid, &status, 0) < 0 && errno == EINTR)
                ;
            break;
        }
        size_t n = 0;
        p[n++] = (struct pollfd){.fd = w->sigfd, .events = POLLIN};
        const bool watch_ready = w->ready >= 0;
        if (watch_ready)
            p[n++] = (struct pollfd){.fd = w->ready, .events = POLLIN};
        int timeout_ms = 1000; /* a SIGCHLD the signal descriptor missed is still seen */
        const size_t first = n;
        n += cllm_owed_poll_fds(w->owed, p + n, cap - n, &timeout_ms);
        if (poll(p, (nfds_t)n, timeout_ms) < 0 && errno != EINTR) {
            cllm_log(CLLM_LOG_ERROR, "keeper: poll: %s", strerror(errno));
            struct timespec pause = {0, 100 * 1000 * 1000};
            nanosleep(&pause, NULL);
        }
        if (watch_ready && p[1].revents) {
            const bool before = w->was_ready;
            read_ready(w);
            if (w->was_ready && !before)
                cllm_owed_child_ready(w->owed);
        }
        cllm_owed_handle(w->owed, p + first, n - first);
        if (take_signals(w, &status))
            break;
    }
    free(p);
    return status;
}

/* Sleeps s seconds unless SIGINT/SIGTERM comes first (then returns it). */
static int pause_unless_stopped(const sigset_t *sigs, double s)
{
    const double until = cllm_now() + s;
    for (double left = s; left > 0; left = until - cllm_now()) {
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        int sig = sigtimedwait(sigs, NULL, &ts);
        if (sig == SIGINT || sig == SIGTERM)
            return sig;
    }
    return 0;
}

/* Seconds to wait before restarting after the n-th death in a row, so that a process that
 * keeps dying is not restarted in a tight loop: 0, 1, 2, 4 ... up to MAX_PAUSE_S. */
static int pause_before_restart(int n)
{
    return n < 2 ? 0 : n > 6 ? MAX_PAUSE_S : 1 << (n - 2); /* (n = 6: 16 s) */
}

static void unset_env(void)
{
    unsetenv(CLLM_KEEPER_ENV_FD);
    unsetenv(CLLM_KEEPER_ENV_READY);
    unsetenv(CLLM_KEEPER_ENV_PID);
    unsetenv(CLLM_KEEPER_ENV_RESTARTS);
    unsetenv(CLLM_KEEPER_ENV_FALLBACK);
    unsetenv(CLLM_KEEPER_ENV_CUSTODY);
}

int cllm_keeper_run(const struct cllm_keeper_config *c)
{
    char err[512];
    int bound;
    if (cllm_listen_open(c->host, c->port, &bound, err, sizeof err) != CLLM_OK) {
        fprintf(stderr, "cllm: %s\n", err);
        return 1;
    }
    /* Handed down across exec (so not close-on-exec), and never as 0-2. */
    int fd = fcntl(bound, F_DUPFD, 3);
    const int dup_errno = errno;
    close(bound);
    /* "cllm" + the command + "--device cpu" + NULL */
    char **argv = calloc((size_t)c->argc + 4, sizeof *argv);
    if (fd < 0 || !argv) {
        fprintf(stderr, "cllm: keeper: %s\n", fd < 0 ? strerror(dup_errno) : "out of memory");
        if (fd >= 0)
            close(fd);
        free(argv);
        return 1;
    }
    int n = 0;
    argv[n++] = "cllm";
    for (int i = 0; i < c->argc; i++)
        argv[n++] = c->argv[i];

    signal(SIGCHLD, SIG_DFL); /* ignored, the serving process would leave no status to wait for */
    /* The keeper holds a copy of every connection a request is answered on (custody.h): as
     * many descriptors as the serving process's connections, and the replays' on top. */
    struct rlimit nofile;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        setrlimit(RLIMIT_NOFILE, &nofile);
    }
    sigset_t sigs, old_mask;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGCHLD);
    sigprocmask(SIG_BLOCK, &sigs, &old_mask);
    set_env_int(CLLM_KEEPER_ENV_FD, fd);
    set_env_int(CLLM_KEEPER_ENV_PID, (long)getpid());

    struct cllm_owed *owed = cllm_owed_new();
    const int sigfd = signalfd(-1, &sigs, SFD_NONBLOCK | SFD_CLOEXEC);
    if (!owed || sigfd < 0)
        fprintf(stderr, "cllm: keeper: %s\n", owed ? strerror(errno) : "out of memory");
    int rc = 1, restarts = 0, failed_starts = 0, quick_deaths = 0;
    bool gpu_retried = false;
    while (owed && sigfd >= 0) {
        set_env_int(CLLM_KEEPER_ENV_RESTARTS, restarts);
        const int custody = cllm_owed_child_start(owed);
        if (custody >= 0)
            set_env_int(CLLM_KEEPER_ENV_CUSTODY, custody);
        else
            unsetenv(CLLM_KEEPER_ENV_CUSTODY);
        struct child_watch w = {.sigfd = sigfd, .ready = -1, .owed = owed};
        w.pid = start_child(c->exe, argv, &w.ready);
        if (custody >= 0)
            close(custody);
        if (w.pid < 0)
            break;
        const double t0 = cllm_now();
        const int status = wait_child(&w);
        if (w.ready >= 0) { /* what it said just before its end */
            read_ready(&w);
            if (w.ready >= 0)
                close(w.ready);
        }
        const bool was_ready = w.was_ready;
        const int stop_sig = w.stop_sig;
        cllm_owed_child_ended(owed, WIFSIGNALED(status) && !stop_sig);
        if (WIFEXITED(status)) { /* a shutdown, or a start that failed: no crash */
            rc = WEXITSTATUS(status);
            break;
        }
        const int sig = WTERMSIG(status);
        if (stop_sig) { /* stopped as asked, before it could take the signal itself */
            rc = sig == stop_sig ? 0 : 128 + sig;
            break;
        }
        const double lived = cllm_now() - t0;
        int deaths_in_a_row; /* of the kind this one is: before ready, or quick after it */
        if (!was_ready) {
            if (++failed_starts >= FAILED_STARTS_MAX) {
                cllm_log(CLLM_LOG_ERROR,
                         "keeper: the serving process died of signal %d (%s) %.1f s after its "
                         "start, before it was ready, %d times in a row: not starting it again",
                         sig, strsignal(sig), lived, failed_starts);
                rc = 1;
                break;
            }
            deaths_in_a_row = failed_starts;
        } else {
            failed_starts = 0;
            quick_deaths = lived < QUICK_DEATH_S ? quick_deaths + 1 : 1;
            deaths_in_a_row = quick_deaths;
        }
        const int pause_s = pause_before_restart(deaths_in_a_row);
        restarts++;
        /* The GPU once more after its first death: what killed the process may not come back
         * (the OOM killer, a fault of the moment), and the CPU is far slower. */
        const bool gpu_again = c->restart_on_cpu && was_ready && w.on_gpu && !gpu_retried;
        const bool on_cpu = c->restart_on_cpu && !gpu_again;
        gpu_retried |= gpu_again;
        char why[256];
        snprintf(why, sizeof why,
                 "the serving process died of signal %d (%s) after %.0f s: restart %d%s", sig,
                 strsignal(sig), lived, restarts,
                 gpu_again ? ", on the GPU once more"
                 : on_cpu  ? ", on the CPU"
                           : "");
        cllm_log(CLLM_LOG_ERROR, "keeper: %s; %s", why,
                 was_ready ? "the requests it was answering go to the next"
                           : "it was not ready yet");
        if (on_cpu && argv[n] == NULL) {
            argv[n] = "--device";
            argv[n + 1] = "cpu";
        }
        if (on_cpu)
            setenv(CLLM_KEEPER_ENV_FALLBACK, why, 1);
        if (pause_s > 0 && pause_unless_stopped(&sigs, pause_s)) {
            rc = 0;
            break;
        }
    }
    cllm_owed_free(owed);
    if (sigfd >= 0)
        close(sigfd);
    unset_env();
    sigprocmask(SIG_SETMASK, &old_mask, NULL);
    close(fd);
    free(argv);
    return rc;
}

static long env_long(const char *name, long fallback)
{
    const char *s = getenv(name);
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : fallback;
    return s && (errno || end == s || *end) ? fallback : v;
}

bool cllm_keeper_child(struct cllm_keeper_child *k)
{
    if (!getenv(CLLM_KEEPER_ENV_FD))
        return false;
    /* -1 where the variable is not a descriptor: the server then says it is no socket */
    long fd = env_long(CLLM_KEEPER_ENV_FD, -1), ready = env_long(CLLM_KEEPER_ENV_READY, -1);
    k->listen_fd = fd > 2 && fd <= 1 << 30 ? (int)fd : -1;
    k->ready_fd = ready > 2 && ready <= 1 << 30 ? (int)ready : -1;
    if (k->ready_fd >= 0) /* a GPU probe started from here must not hold it */
        fcntl(k->ready_fd, F_SETFD, FD_CLOEXEC);
    long n = env_long(CLLM_KEEPER_ENV_RESTARTS, 0);
    k->restarts = n > 0 && n < 1 << 20 ? (int)n : 0;
    const char *why = getenv(CLLM_KEEPER_ENV_FALLBACK);
    snprintf(k->fallback, sizeof k->fallback, "%s", why ? why : "");
    /* A server nobody would restart must not outlive its keeper (and hold its port): it gets
     * SIGTERM, and shuts down as usual, when the keeper dies; if it died already, now. */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != (pid_t)env_long(CLLM_KEEPER_ENV_PID, -1))
        raise(SIGTERM);
    k->custody_fd = cllm_custody_child_fd();
    unset_env();
    return true;
}
