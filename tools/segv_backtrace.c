// A debugging aid for the GPU machine, which has no gdb: LD_PRELOAD it into a process to print
// the faulting address and a backtrace (glibc backtrace()) on SIGSEGV or SIGBUS, even in a Rust
// binary, whose runtime installs its own handler (this one keeps its handler in place).
// Build: gcc -O1 -shared -fPIC -o segv_backtrace.so tools/segv_backtrace.c -ldl
// Use: LD_PRELOAD=$PWD/segv_backtrace.so ./test-binary; resolve the binary's +offsets with
// addr2line -f -C -i -e <the unstripped binary> <offset>.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <ucontext.h>

static void handler(int sig, siginfo_t* si, void* uc) {
    char msg[256];
    ucontext_t* u = (ucontext_t*)uc;
    void* pc = (void*)u->uc_mcontext.gregs[REG_RIP];
    Dl_info info;
    const char* lib = "?";
    void* base = 0;
    if (dladdr(pc, &info)) { lib = info.dli_fname; base = info.dli_fbase; }
    int n = snprintf(msg, sizeof msg, "\n*** SIGSEGV addr %p pc %p in %s (+%#lx) tid %d\n", si->si_addr, pc, lib,
                     (unsigned long)((char*)pc - (char*)base), (int)gettid());
    write(2, msg, n);
    void* buf[64];
    int k = backtrace(buf, 64);
    backtrace_symbols_fd(buf, k, 2);
    _exit(139);
}

static int installed = 0;
typedef int (*sigaction_fn)(int, const struct sigaction*, struct sigaction*);

int sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
    static sigaction_fn real = 0;
    if (!real) real = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    if (installed && (sig == SIGSEGV || sig == SIGBUS) && act) return 0;  // keep ours
    return real(sig, act, old);
}

__attribute__((constructor)) static void init(void) {
    static char stack[1 << 16];
    stack_t ss = {.ss_sp = stack, .ss_size = sizeof stack, .ss_flags = 0};
    sigaltstack(&ss, 0);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, 0);
    sigaction(SIGBUS, &sa, 0);
    installed = 1;
}
