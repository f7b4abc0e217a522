/*
 * flowlane-probe: decides, inside a pod's own image, whether that image's
 * userland can load the preload library, and places at the path LD_PRELOAD
 * names either the library or a harmless no-op object. Never fatal: it always
 * exits 0, and whatever goes wrong ends in the no-op object (or, at worst, in
 * no file at all, which ld.so reports and ignores).
 *
 * Run by the init containers the injection webhook adds, one per distinct app
 * container image, IN THAT IMAGE (deploy/webhook/src/inject.rs):
 *
 *   flowlane-probe SRC_DIR OUT_DIR [CONTAINER...]
 *
 * SRC_DIR holds libflowlane_preload.so and libflowlane_noop.so (the node's
 * flowlane library directory); OUT_DIR is the pod's emptyDir (subdirectory of
 * this image), mounted in the app containers where LD_PRELOAD points.
 *
 * The decision is the dynamic linker's own: the image's loader is glibc's,
 * every DT_NEEDED library of the preload library is found in the image's
 * library directories, and each of them defines every symbol version the
 * preload library requires from it (ELF version definitions against the
 * library's version needs, GLIBC_2.17 and older for the shipped one). Then the
 * library, else the no-op object (musl, no loader at all, glibc too old, a
 * library missing).
 *
 * An LD_PRELOAD in the image's ENV (this container runs with it) is named in
 * the verdict: the app container's LD_PRELOAD from the pod spec replaces it.
 *
 * The verdict is printed (the container's log) and written to
 * /dev/termination-log (the pod's status shows it: kubectl describe pod), and
 * reported to flowlaned over FLOWLANE_SOCKET (best effort; flowlane status).
 *
 * Static (no libc): built with `gcc -static`, so it runs in any x86_64/arm64
 * image, with or without a libc. Every file it reads belongs to the pod's
 * image: all sizes and offsets are bounds-checked against the file.
 */
#define _GNU_SOURCE
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#define PRELOAD "libflowlane_preload.so"
#define NOOP "libflowlane_noop.so"
#define MAX_FILE (64u << 20)
#define MAX_LIBS 16
#define MAX_VERSIONS 64

#if defined(__x86_64__)
#define GLIBC_LOADER "/lib64/ld-linux-x86-64.so.2"
#define MUSL_LOADER "/lib/ld-musl-x86_64.so.1"
#define MACHINE EM_X86_64
#define MULTIARCH "x86_64-linux-gnu"
#elif defined(__aarch64__)
#define GLIBC_LOADER "/lib/ld-linux-aarch64.so.1"
#define MUSL_LOADER "/lib/ld-musl-aarch64.so.1"
#define MACHINE EM_AARCH64
#define MULTIARCH "aarch64-linux-gnu"
#else
#error "flowlane-probe: unsupported architecture"
#endif

static const char *const LIB_DIRS[] = {
    "/lib/" MULTIARCH, "/usr/lib/" MULTIARCH, "/lib64", "/usr/lib64", "/lib", "/usr/lib",
};

/* A whole ELF file in memory and what its dynamic section says. */
struct elf {
    unsigned char *data;
    size_t len;
    const Elf64_Phdr *ph;
    unsigned phnum;
    size_t strtab, strsz; /* file offset, size */
    uint64_t verdef, verdefnum, verneed, verneednum; /* vaddrs, counts */
    uint64_t needed[MAX_LIBS];
    unsigned nneeded;
};

static char reason[512];

static void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
}

static int in_bounds(const struct elf *e, uint64_t off, uint64_t len) {
    return off <= e->len && len <= e->len - off;
}

/* File offset of `len` bytes at virtual address `va`, through PT_LOAD. */
static int va_to_off(const struct elf *e, uint64_t va, uint64_t len, size_t *off) {
    for (unsigned i = 0; i < e->phnum; i++) {
        const Elf64_Phdr *p = &e->ph[i];
        if (p->p_type != PT_LOAD || va < p->p_vaddr || va - p->p_vaddr > p->p_filesz ||
            len > p->p_filesz - (va - p->p_vaddr))
            continue;
        uint64_t o = p->p_offset + (va - p->p_vaddr);
        if (!in_bounds(e, o, len))
            return -1;
        *off = (size_t)o;
        return 0;
    }
    return -1;
}

/* The NUL-terminated string at `idx` of the dynamic string table, or NULL. */
static const char *dynstr(const struct elf *e, uint64_t idx) {
    if (idx >= e->strsz)
        return NULL;
    const char *s = (const char *)e->data + e->strtab + idx;
    return memchr(s, 0, e->strsz - idx) ? s : NULL;
}

static void elf_free(struct elf *e) {
    free(e->data);
    memset(e, 0, sizeof *e);
}

/* Reads and indexes a 64-bit ELF shared object of this machine. */
static int elf_load(const char *path, struct elf *e) {
    memset(e, 0, sizeof *e);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < (off_t)sizeof(Elf64_Ehdr) ||
        (uint64_t)st.st_size > MAX_FILE) {
        close(fd);
        return -1;
    }
    e->len = (size_t)st.st_size;
    e->data = malloc(e->len);
    size_t got = 0;
    while (e->data && got < e->len) {
        ssize_t n = read(fd, e->data + got, e->len - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    if (!e->data || got != e->len)
        goto bad;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)e->data;
    if (memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 || eh->e_ident[EI_CLASS] != ELFCLASS64 ||
        eh->e_ident[EI_DATA] != ELFDATA2LSB || eh->e_machine != MACHINE ||
        eh->e_phentsize != sizeof(Elf64_Phdr) ||
        !in_bounds(e, eh->e_phoff, (uint64_t)eh->e_phnum * sizeof(Elf64_Phdr)) ||
        eh->e_phoff % 8 != 0)
        goto bad;
    e->ph = (const Elf64_Phdr *)(e->data + eh->e_phoff);
    e->phnum = eh->e_phnum;
    const Elf64_Phdr *dyn = NULL;
    for (unsigned i = 0; i < e->phnum; i++)
        if (e->ph[i].p_type == PT_DYNAMIC)
            dyn = &e->ph[i];
    if (!dyn || !in_bounds(e, dyn->p_offset, dyn->p_filesz) || dyn->p_offset % 8 != 0)
        goto bad;
    const Elf64_Dyn *d = (const Elf64_Dyn *)(e->data + dyn->p_offset);
    size_t nd = dyn->p_filesz / sizeof(Elf64_Dyn);
    uint64_t strtab_va = 0;
    int have_strtab = 0;
    for (size_t i = 0; i < nd && d[i].d_tag != DT_NULL; i++) {
        switch (d[i].d_tag) {
        case DT_STRTAB: strtab_va = d[i].d_un.d_ptr; have_strtab = 1; break;
        case DT_STRSZ: e->strsz = d[i].d_un.d_val; break;
        case DT_VERDEF: e->verdef = d[i].d_un.d_ptr; break;
        case DT_VERDEFNUM: e->verdefnum = d[i].d_un.d_val; break;
        case DT_VERNEED: e->verneed = d[i].d_un.d_ptr; break;
        case DT_VERNEEDNUM: e->verneednum = d[i].d_un.d_val; break;
        case DT_NEEDED:
            if (e->nneeded < MAX_LIBS)
                e->needed[e->nneeded++] = d[i].d_un.d_val;
            break;
        }
    }
    if (!have_strtab || va_to_off(e, strtab_va, e->strsz, &e->strtab) != 0)
        goto bad;
    return 0;
bad:
    elf_free(e);
    return -1;
}

/*
 * Calls `each` with the name of every version `lib` defines (its version
 * definitions) until it returns nonzero; returns that value (0: none did).
 */
static int each_verdef(const struct elf *lib, int (*each)(const char *, void *), void *ctx) {
    uint64_t va = lib->verdef;
    for (uint64_t i = 0; va && i < lib->verdefnum && i < 4096; i++) {
        size_t off, aoff;
        if (va_to_off(lib, va, sizeof(Elf64_Verdef), &off) != 0)
            return 0;
        Elf64_Verdef vd;
        memcpy(&vd, lib->data + off, sizeof vd);
        if (vd.vd_cnt > 0 && va_to_off(lib, va + vd.vd_aux, sizeof(Elf64_Verdaux), &aoff) == 0) {
            Elf64_Verdaux aux;
            memcpy(&aux, lib->data + aoff, sizeof aux);
            const char *s = dynstr(lib, aux.vda_name);
            int r = s ? each(s, ctx) : 0;
            if (r)
                return r;
        }
        if (vd.vd_next == 0)
            break;
        va += vd.vd_next;
    }
    return 0;
}

static int is_named(const char *s, void *name) { return strcmp(s, name) == 0; }

/* Whether `lib` defines version `name`. */
static int defines(const struct elf *lib, const char *name) {
    return each_verdef(lib, is_named, (void *)name);
}

static int newest_glibc(const char *s, void *best) {
    unsigned minor;
    char tail;
    if (sscanf(s, "GLIBC_2.%u%c", &minor, &tail) == 1 && minor > *(unsigned *)best)
        *(unsigned *)best = minor;
    return 0;
}

/* The newest GLIBC_2.N that `libc` defines, as N (0: none). */
static unsigned glibc_minor(const struct elf *libc) {
    unsigned best = 0;
    each_verdef(libc, newest_glibc, &best);
    return best;
}

/*
 * The glibc release `libc` is (2.N as N): the banner it prints when run
 * ("... release version 2.31."), else its newest GLIBC_2.N symbol version
 * (2.31 defines no new one: that says 2.30).
 */
static unsigned glibc_release(const struct elf *libc) {
    static const char banner[] = "release version 2.";
    const unsigned char *p = memmem(libc->data, libc->len, banner, sizeof banner - 1);
    if (p) {
        size_t off = (size_t)(p - libc->data) + sizeof banner - 1;
        unsigned minor = 0, digits = 0;
        while (off < libc->len && digits < 4 && libc->data[off] >= '0' && libc->data[off] <= '9') {
            minor = minor * 10 + (unsigned)(libc->data[off++] - '0');
            digits++;
        }
        if (digits > 0)
            return minor;
    }
    return glibc_minor(libc);
}

/* Finds `soname` in the image's library directories and loads it. */
static int find_lib(const char *soname, struct elf *out) {
    if (strchr(soname, '/'))
        return -1;
    for (size_t i = 0; i < sizeof LIB_DIRS / sizeof LIB_DIRS[0]; i++) {
        char path[512];
        if (snprintf(path, sizeof path, "%s/%s", LIB_DIRS[i], soname) >= (int)sizeof path)
            continue;
        if (elf_load(path, out) == 0)
            return 0;
    }
    return -1;
}

/*
 * Whether the image satisfies every DT_NEEDED and version need of `lib`;
 * on failure `reason` says what is missing. `glibc` gets the image's glibc
 * version (2.N as N) when its libc.so.6 was read.
 */
static int image_can_load(const struct elf *lib, unsigned *glibc) {
    for (unsigned i = 0; i < lib->nneeded; i++) {
        const char *soname = dynstr(lib, lib->needed[i]);
        struct elf dep;
        if (!soname || find_lib(soname, &dep) != 0) {
            say("%s not found in the image", soname ? soname : "a needed library");
            return 0;
        }
        if (strcmp(soname, "libc.so.6") == 0)
            *glibc = glibc_release(&dep);
        elf_free(&dep);
    }
    uint64_t va = lib->verneed;
    for (uint64_t i = 0; va && i < lib->verneednum && i < MAX_LIBS; i++) {
        size_t off;
        if (va_to_off(lib, va, sizeof(Elf64_Verneed), &off) != 0) {
            say("the library's version needs are unreadable");
            return 0;
        }
        Elf64_Verneed vn;
        memcpy(&vn, lib->data + off, sizeof vn);
        const char *file = dynstr(lib, vn.vn_file);
        struct elf dep;
        if (!file || find_lib(file, &dep) != 0) {
            say("%s not found in the image", file ? file : "a versioned library");
            return 0;
        }
        uint64_t ava = va + vn.vn_aux;
        for (unsigned j = 0; j < vn.vn_cnt && j < MAX_VERSIONS; j++) {
            size_t aoff;
            if (va_to_off(lib, ava, sizeof(Elf64_Vernaux), &aoff) != 0)
                break;
            Elf64_Vernaux aux;
            memcpy(&aux, lib->data + aoff, sizeof aux);
            const char *ver = dynstr(lib, aux.vna_name);
            if (!ver || !defines(&dep, ver)) {
                say("the image's %s lacks %s", file, ver ? ver : "a needed version");
                elf_free(&dep);
                return 0;
            }
            if (aux.vna_next == 0)
                break;
            ava += aux.vna_next;
        }
        elf_free(&dep);
        if (vn.vn_next == 0)
            break;
        va += vn.vn_next;
    }
    return 1;
}

/* Copies `src` to `dir`/libflowlane_preload.so (temporary name, then rename). */
static int install(const char *src, const char *dir) {
    char tmp[512], dst[512];
    if (snprintf(tmp, sizeof tmp, "%s/.%s.tmp", dir, PRELOAD) >= (int)sizeof tmp ||
        snprintf(dst, sizeof dst, "%s/%s", dir, PRELOAD) >= (int)sizeof dst)
        return -1;
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return -1;
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) {
        close(in);
        return -1;
    }
    char buf[65536];
    int ok = 1;
    for (;;) {
        ssize_t n = read(in, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            ok = 0;
        if (n <= 0)
            break;
        for (ssize_t w = 0; w < n;) {
            ssize_t m = write(out, buf + w, (size_t)(n - w));
            if (m < 0 && errno == EINTR)
                continue;
            if (m <= 0) {
                ok = 0;
                break;
            }
            w += m;
        }
        if (!ok)
            break;
    }
    close(in);
    if (fchmod(out, 0644) != 0 || close(out) != 0)
        ok = 0;
    if (!ok || rename(tmp, dst) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* Appends `s` to `out` as JSON string content (bounded). */
static void json_str(char *out, size_t cap, const char *s) {
    size_t n = strlen(out);
    for (; *s && n + 8 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[n++] = '\\';
            out[n++] = (char)c;
        } else if (c < 0x20 || c >= 0x7f) {
            n += (size_t)snprintf(out + n, cap - n, "\\u%04x", c);
        } else {
            out[n++] = (char)c;
        }
    }
    out[n] = 0;
}

/* Tells flowlaned (one request frame, one answer read; 2 s at most). */
static void report(const char *verdict, const char *libc_desc, int argc, char **argv) {
    const char *sock = getenv("FLOWLANE_SOCKET");
    if (!sock || strlen(sock) >= sizeof(((struct sockaddr_un *)0)->sun_path))
        return;
    char body[4096] = "{\"op\":\"report-injection\",\"verdict\":\"";
    json_str(body, sizeof body, verdict);
    strncat(body, "\",\"libc\":\"", sizeof body - strlen(body) - 1);
    json_str(body, sizeof body, libc_desc);
    strncat(body, "\",\"reason\":\"", sizeof body - strlen(body) - 1);
    json_str(body, sizeof body, reason);
    strncat(body, "\",\"containers\":[", sizeof body - strlen(body) - 1);
    for (int i = 3; i < argc && strlen(body) + 300 < sizeof body; i++) {
        strncat(body, i > 3 ? ",\"" : "\"", sizeof body - strlen(body) - 1);
        json_str(body, sizeof body - 260, argv[i]);
        strncat(body, "\"", sizeof body - strlen(body) - 1);
    }
    strncat(body, "]}", sizeof body - strlen(body) - 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, sock, strlen(sock));
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
        uint32_t len = (uint32_t)strlen(body);
        unsigned char frame[4 + sizeof body];
        frame[0] = (unsigned char)len;
        frame[1] = (unsigned char)(len >> 8);
        frame[2] = (unsigned char)(len >> 16);
        frame[3] = (unsigned char)(len >> 24);
        memcpy(frame + 4, body, len);
        if (send(fd, frame, 4 + len, MSG_NOSIGNAL) == (ssize_t)(4 + len)) {
            unsigned char answer[512];
            (void)!recv(fd, answer, sizeof answer, 0);
        }
    }
    close(fd);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: flowlane-probe SRC_DIR OUT_DIR [CONTAINER...]\n");
        return 0; /* never fatal */
    }
    char lib_path[512], noop_path[512];
    snprintf(lib_path, sizeof lib_path, "%s/%s", argv[1], PRELOAD);
    snprintf(noop_path, sizeof noop_path, "%s/%s", argv[1], NOOP);

    const char *verdict = "tcp";
    char libc_desc[64] = "none";
    unsigned glibc = 0;
    struct stat st;
    if (stat(GLIBC_LOADER, &st) == 0) {
        struct elf lib;
        snprintf(libc_desc, sizeof libc_desc, "glibc");
        if (elf_load(lib_path, &lib) != 0) {
            say("cannot read %s", lib_path);
        } else {
            if (image_can_load(&lib, &glibc)) {
                verdict = "lane";
                say("the image's libraries define every version the library needs");
            }
            elf_free(&lib);
        }
        if (glibc == 0) {
            struct elf libc;
            if (find_lib("libc.so.6", &libc) == 0) {
                glibc = glibc_release(&libc);
                elf_free(&libc);
            }
        }
        if (glibc)
            snprintf(libc_desc, sizeof libc_desc, "glibc 2.%u", glibc);
    } else if (stat(MUSL_LOADER, &st) == 0) {
        snprintf(libc_desc, sizeof libc_desc, "musl");
        say("musl cannot load a glibc library");
    } else {
        say("no dynamic loader: static binaries ignore LD_PRELOAD");
    }

    const char *src = strcmp(verdict, "lane") == 0 ? lib_path : noop_path;
    if (install(src, argv[2]) != 0) {
        verdict = "tcp";
        say("cannot place %s in %s: %s", src, argv[2], strerror(errno));
        /* the library could not be placed: the no-op object then, if it can be */
        if (src == lib_path)
            (void)install(noop_path, argv[2]);
    }
    /*
     * This container runs with the image's own ENV (the webhook sets no
     * LD_PRELOAD here). An LD_PRELOAD there is replaced, for the app, by the
     * pod spec's: say so, the app loses it (docs/deploy.md).
     */
    const char *own = getenv("LD_PRELOAD");
    if (own && *own) {
        size_t n = strlen(reason);
        snprintf(reason + n, sizeof reason - n,
                 "; the image's ENV sets LD_PRELOAD=%.160s, which the pod spec's LD_PRELOAD "
                 "replaces: set it in the pod spec to keep it",
                 own);
    }
    char line[1024];
    snprintf(line, sizeof line, "flowlane: %s (%s): %s\n", verdict, libc_desc, reason);
    fputs(line, stdout);
    fflush(stdout);
    int t = open("/dev/termination-log", O_WRONLY | O_TRUNC | O_CLOEXEC);
    if (t >= 0) {
        (void)!write(t, line, strlen(line));
        close(t);
    }
    report(verdict, libc_desc, argc, argv);
    return 0;
}
