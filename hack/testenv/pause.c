/*
 * The pod sandbox's process for the test cluster's real kubelets (the image
 * transom.local/pause, built by hack/testenv/images.py with `gcc -static -Os`).
 *
 * It holds the pod's namespaces open and does nothing else: it sleeps in pause(),
 * reaps any child re-parented to it (it is PID 1 when the pod shares its PID
 * namespace, so orphans would otherwise stay zombies), and exits 0 on SIGINT or
 * SIGTERM so that stopping a sandbox is quick and clean.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_terminate(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    /* Signals coalesce: one SIGCHLD may stand for several exits, so reap until none is left.
     * errno is the interrupted code's, and waitpid may change it. */
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static void handle(int sig, void (*handler)(int), int flags) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = handler;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    if (sigaction(sig, &sa, NULL) < 0) {
        perror("sigaction");
        _exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        printf("transom pause 3.10\n");
        return 0;
    }
    if (getpid() != 1) {
        fprintf(stderr, "Warning: pause should be the first process\n");
    }
    handle(SIGINT, on_terminate, 0);
    handle(SIGTERM, on_terminate, 0);
    handle(SIGCHLD, on_child, SA_NOCLDSTOP | SA_RESTART);
    for (;;) {
        pause();
    }
    return 42; /* not reached */
}
