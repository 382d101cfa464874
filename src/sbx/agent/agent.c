/*
 * sbx-agent: the process runner inside a sandbox.
 *
 * It is the sandbox's init (PID 1) and runs every process the host asks for, over one persistent
 * byte stream (a unix socket under gVisor, later a virtio-serial port under QEMU), so running a
 * command does not pay for a `runsc exec` each time. The wire protocol is documented in
 * docs/agent-protocol.md; the constants and message numbers below must stay in step with it and
 * with src/sbx/agent/protocol.py.
 *
 * Design constraints that explain most of the shape of this file:
 *  - It must run in any image (musl, distroless, busybox), so it is one static binary that
 *    touches nothing in the image except what a request names.
 *  - It must never block on the host: the channel is nonblocking and everything large (process
 *    output, file reads, directory listings) is produced only while the outgoing buffer is below a
 *    high-water mark. A slow or absent host makes processes block on their pipes, never makes the
 *    agent's memory grow.
 *  - The host may be killed and reconnect at any moment, so process output stays buffered until the
 *    host acknowledges it (up to a window per stream) and is resent from the offsets the host names.
 *  - It is single-threaded, so switching the effective uid around a file operation is safe.
 *  - TCP tunnels only ever reach 127.0.0.1 inside the sandbox and, unlike processes, end with the
 *    host connection: nothing of them is retained for a reconnect.
 *  - Diagnostics go to stderr and never include arguments, environment values or file contents.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <stddef.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

/* ---- protocol constants (docs/agent-protocol.md) ---------------------------------------- */

#define PROTO_MAGIC "SBXA"
#define PROTO_VERSION 4u               /* 2 TCP tunnels, 3 QUIESCE, 4 raw tunnel connections; older hosts are served */
#define PROTO_MIN_VERSION 1u
#define HDR_LEN 9u                     /* type u8, id u32, length u32 */
#define MAX_PAYLOAD (1u << 20)         /* larger frames are a protocol error: the stream is dropped */
#define CHUNK (64u * 1024u)            /* largest data chunk the agent sends */
#define OUT_WINDOW (1u << 20)          /* unacked output kept per process stream */
#define STDIN_WINDOW (1u << 20)        /* unacked stdin the host may send per process */
#define READ_WINDOW (1u << 20)         /* unacked file-read bytes per READ */
#define OUT_HIGH_WATER (256u * 1024u)  /* stop producing/reading requests above this */
#define OUT_HARD_MAX (16u << 20)       /* a host that never reads its replies is disconnected */
#define STDIN_HARD_MAX (STDIN_WINDOW + MAX_PAYLOAD)
#define TCP_WINDOW (1024u * 1024u)     /* unacked bytes per tunnel and direction */
#define PIPE_BYTES (1 << 20)           /* capacity asked for each process pipe (Linux's pipe-max-size) */
#define TCP_CHUNK (256u * 1024u)       /* largest TCP_DATA chunk: 4x fewer frames and syscalls than CHUNK */
#define TCP_HARD_MAX (TCP_WINDOW + MAX_PAYLOAD)
#define MAX_PROCS 4096u
#define MAX_TUNNELS 1024u
#define RAW_BUF (1024u * 1024u)      /* per raw tunnel and direction: bytes read but not yet written */
#define RAW_MAGIC "SBXT"
#define RAW_HDR_LEN 8u                 /* magic, port u16, reserved u16 (zero) */
#define DIR_BATCH 256

enum {
    /* host -> agent */
    T_HELLO = 0x01,
    T_LIST = 0x02,
    T_SPAWN = 0x03,
    T_RESUME = 0x04,
    T_ACK = 0x05,
    T_STDIN = 0x06,
    T_STDIN_CLOSE = 0x07,
    T_SIGNAL = 0x08,
    T_RESIZE = 0x09,
    T_FORGET = 0x0A,
    T_READ = 0x10,
    T_READ_ACK = 0x11,
    T_WRITE = 0x12,
    T_WRITE_DATA = 0x13,
    T_WRITE_END = 0x14,
    T_REMOVE = 0x15,
    T_LIST_DIR = 0x16,
    T_STAT = 0x17,
    T_CANCEL = 0x18,
    T_TCP_OPEN = 0x20,
    T_TCP_SEND = 0x21,
    T_TCP_ACK = 0x22,
    T_TCP_SHUT_WR = 0x23,
    T_TCP_CLOSE = 0x24,
    T_QUIESCE = 0x30,
    /* agent -> host */
    T_HELLO_OK = 0x81,
    T_OK = 0x82,
    T_ERROR = 0x83,
    T_PROCESSES = 0x84,
    T_SPAWNED = 0x85,
    T_SPAWN_FAILED = 0x86,
    T_OUTPUT = 0x87,
    T_EXITED = 0x88,
    T_STDIN_ACK = 0x89,
    T_READ_OPEN = 0x8A,
    T_DATA = 0x8B,
    T_END = 0x8C,
    T_DIR_ENTRIES = 0x8D,
    T_STAT_OK = 0x8E,
    T_TCP_DATA = 0x8F,
    T_TCP_SEND_ACK = 0x90,
    T_TCP_EOF = 0x91,
    T_TCP_CLOSED = 0x92,
};

enum { STAGE_SETUP = 0, STAGE_EXEC = 1, STAGE_CWD = 2, STAGE_CREDS = 3, STAGE_RLIMIT = 4, STAGE_TTY = 5 };
enum { FT_FILE = 0, FT_DIR = 1, FT_OTHER = 2 };

/* ---- small helpers ------------------------------------------------------------------------ */

static void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logmsg(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("sbx-agent: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        /* Out of memory inside a sandbox is fatal for init anyway; say so clearly. */
        logmsg("out of memory (%zu bytes)", n);
        abort();
    }
    return q;
}

static void set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Growable byte buffer with a consumed prefix, used for the channel and stdin queues. */
struct buf {
    uint8_t *p;
    size_t head, len, cap; /* live bytes are p[head .. head+len) */
};

static void buf_reserve(struct buf *b, size_t extra)
{
    if (b->head + b->len + extra <= b->cap)
        return;
    if (b->head) { /* compact before growing */
        memmove(b->p, b->p + b->head, b->len);
        b->head = 0;
        if (b->len + extra <= b->cap)
            return;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra)
        cap *= 2;
    b->p = xrealloc(b->p, cap);
    b->cap = cap;
}

static void buf_append(struct buf *b, const void *d, size_t n)
{
    buf_reserve(b, n);
    memcpy(b->p + b->head + b->len, d, n);
    b->len += n;
}

static void buf_consume(struct buf *b, size_t n)
{
    b->head += n;
    b->len -= n;
    if (b->len == 0)
        b->head = 0;
}

static void buf_free(struct buf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* Shrink an idle buffer so a burst does not pin memory forever. */
static void buf_trim(struct buf *b)
{
    if (b->len == 0 && b->cap > 64 * 1024)
        buf_free(b);
}

/* Ring of unacknowledged output: bytes [acked, produced) of one stream. Grows up to OUT_WINDOW. */
struct ring {
    uint8_t *p;
    size_t cap, start, len;
};

static void ring_grow(struct ring *r, size_t want)
{
    size_t cap = r->cap ? r->cap : 16 * 1024;
    while (cap < want)
        cap *= 2;
    if (cap > OUT_WINDOW)
        cap = OUT_WINDOW;
    if (cap <= r->cap)
        return;
    uint8_t *np = xrealloc(NULL, cap);
    size_t first = r->len < r->cap - r->start ? r->len : r->cap - r->start;
    if (r->len) {
        memcpy(np, r->p + r->start, first);
        memcpy(np + first, r->p, r->len - first);
    }
    free(r->p);
    r->p = np;
    r->cap = cap;
    r->start = 0;
}

/* Contiguous free space at the write end, growing the ring if that helps. */
static size_t ring_space(struct ring *r, uint8_t **where)
{
    if (r->len == r->cap && r->cap < OUT_WINDOW)
        ring_grow(r, r->cap * 2);
    else if (r->cap == 0)
        ring_grow(r, 16 * 1024);
    if (r->len == r->cap)
        return 0;
    size_t end = (r->start + r->len) % r->cap;
    size_t n = end >= r->start ? r->cap - end : r->start - end;
    *where = r->p + end;
    return n;
}

/* Contiguous bytes starting `off` bytes after the oldest retained byte. */
static size_t ring_peek(const struct ring *r, size_t off, const uint8_t **where)
{
    if (off >= r->len)
        return 0;
    size_t pos = (r->start + off) % r->cap;
    size_t n = r->len - off;
    if (n > r->cap - pos)
        n = r->cap - pos;
    *where = r->p + pos;
    return n;
}

static void ring_consume(struct ring *r, size_t n)
{
    r->start = (r->start + n) % (r->cap ? r->cap : 1);
    r->len -= n;
    if (r->len == 0)
        r->start = 0;
}

/* ---- state ---------------------------------------------------------------------------------- */

struct stream {
    int fd; /* -1 once EOF was seen (or never had one) */
    struct ring ring;
    uint64_t produced, acked, sent;
};

struct proc {
    struct proc *next;
    uint32_t handle;
    pid_t pid;
    int tty;
    int running;
    int exit_code;
    int draining;   /* exited: read what is left in the pipes, then close them */
    int subscribed; /* the host on this connection wants this process's output */
    int exit_sent;  /* EXITED was sent on this connection */
    struct stream out[2];
    int in_fd;
    int in_close; /* close stdin once the queue is written (a terminal gets ^D instead) */
    int tty_hold; /* the terminal master after its output ended, kept open until the exit */
    struct buf in;
    uint64_t in_received, in_written, in_acked;
};

enum { OP_READ, OP_WRITE, OP_LISTDIR };

struct fop {
    struct fop *next;
    uint32_t id;
    int kind;
    int fd;
    DIR *dir;
    uid_t uid;
    gid_t gid;
    uint64_t sent, acked; /* READ: bytes sent and acknowledged; WRITE: bytes written */
    mode_t mode;          /* WRITE: mode of the final file */
    char *path, *tmp;
};

/* A TCP connection to 127.0.0.1:port in the guest, carried for the host (protocol version 2). Bytes
 * from the guest go straight into the channel buffer, so the agent holds none of them: the window
 * (sent - acked) is what bounds the host's buffer, and while it is full the socket is not read and
 * TCP's own flow control stops the guest's writer. Bytes for the guest wait in `out`. */
struct tun {
    struct tun *next;
    uint32_t id;      /* the TCP_OPEN's frame id; every frame of this tunnel carries it */
    int fd;
    int connecting;   /* nonblocking connect in progress: OK or ERROR not sent yet */
    int rd_eof;       /* the guest's end of data was read and TCP_EOF sent */
    int shut_req;     /* the host sent TCP_SHUT_WR: shut the write side once `out` is written */
    int wr_shut;      /* shutdown(SHUT_WR) done */
    struct buf out;   /* host bytes not yet written to the socket */
    uint64_t sent, acked;             /* guest -> host: bytes sent in TCP_DATA, acknowledged */
    uint64_t written, written_acked;  /* host -> guest: bytes written, last TCP_SEND_ACK */
};

/* A raw tunnel (protocol version 4): a connection of its own on the tunnel socket, carrying the bytes of one TCP
 * connection to 127.0.0.1:port unframed, so neither side parses or acknowledges anything per chunk. The host
 * sends RAW_HDR_LEN bytes (RAW_MAGIC, port u16, zero u16), the agent connects and answers errno u32 (0:
 * connected; else it closes), and from then on each direction is a plain copy through a buffer of RAW_BUF bytes
 * that is only refilled once written, so TCP's flow control on both sockets bounds what the agent holds. A
 * half-close is passed on with shutdown(SHUT_WR) once the buffer is written; the tunnel is freed when both
 * directions have ended or either socket fails. Raw tunnels do not depend on the main connection. */
struct raw_dir {
    uint8_t *p;
    size_t head, len;
    int eof;  /* the source read end of file */
    int shut; /* ... and the destination was shut for writing after the last byte */
};

struct rtun {
    struct rtun *next;
    int hfd;          /* the host's connection */
    int gfd;          /* the guest's TCP socket; -1 until the header is in */
    int connecting;
    uint8_t hdr[RAW_HDR_LEN];
    size_t hdr_got;
    struct raw_dir up;   /* guest -> host; its first 4 bytes are the connect answer */
    struct raw_dir down; /* host -> guest */
};

static struct rtun *rtuns;
static unsigned nrtuns;
static int tun_listen_fd = -1;
static const char *tun_listen_path;

static struct proc *procs;
static unsigned nprocs;
static struct fop *fops;
static struct tun *tuns;
static unsigned ntuns;
static uint32_t conn_version; /* the protocol version agreed in HELLO on this connection */
static int listen_fd = -1, conn_fd = -1, sig_fd = -1;
static const char *listen_path;
/* While quiesced the agent holds no host socket (so the sandbox can be checkpointed) and polls for
 * wake_path; when it appears (the host made it, after a restore or a failed checkpoint) it is removed
 * and the agent listens again. */
static char *wake_path;
static int quiescing; /* QUIESCE answered; the connection closes once its output is flushed */
#define WAKE_POLL_MS 2
static int fd_mode; /* --fd: one stream, no listening socket */
static int hello_done;
static struct buf rbuf, obuf;
static unsigned long tmp_counter;
/* The agent's real ids, read once: it only ever changes its effective ids (as_user). */
static uid_t agent_uid;
static gid_t agent_gid;

/* ---- outgoing frames -------------------------------------------------------------------- */

static void put_u8(uint8_t v) { buf_append(&obuf, &v, 1); }
static void put_u32(uint32_t v)
{
    uint8_t b[4] = {(uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v};
    buf_append(&obuf, b, 4);
}
static void put_u64(uint64_t v)
{
    put_u32((uint32_t)(v >> 32));
    put_u32((uint32_t)v);
}
static void put_bytes(const void *d, size_t n)
{
    put_u32((uint32_t)n);
    buf_append(&obuf, d, n);
}
static void put_str(const char *s) { put_bytes(s, strlen(s)); }

/* Frames are built in place: begin writes the header, end patches the length. */
static size_t frame_begin(uint8_t type, uint32_t id)
{
    size_t pos = obuf.len;
    put_u8(type);
    put_u32(id);
    put_u32(0);
    return pos;
}

static void frame_end(size_t pos)
{
    uint32_t n = (uint32_t)(obuf.len - pos - HDR_LEN);
    uint8_t *h = obuf.p + obuf.head + pos + 5;
    h[0] = (uint8_t)(n >> 24);
    h[1] = (uint8_t)(n >> 16);
    h[2] = (uint8_t)(n >> 8);
    h[3] = (uint8_t)n;
}

static int connected(void) { return conn_fd >= 0 && hello_done; }

/* Whether large output may be produced now (the channel's queue is below its high-water mark). */
static int room(void) { return obuf.len < OUT_HIGH_WATER; }

static void send_ok(uint32_t id) { frame_end(frame_begin(T_OK, id)); }

static void send_error(uint32_t id, int err, const char *msg)
{
    size_t f = frame_begin(T_ERROR, id);
    put_u32((uint32_t)err);
    put_str(msg ? msg : strerror(err));
    frame_end(f);
}

/* ---- incoming payload parsing: every length is checked, any short read marks `bad` --------- */

struct rd {
    const uint8_t *p;
    size_t n;
    int bad;
};

static const uint8_t *rd_take(struct rd *r, size_t n)
{
    if (r->bad || r->n < n) {
        r->bad = 1;
        return NULL;
    }
    const uint8_t *p = r->p;
    r->p += n;
    r->n -= n;
    return p;
}
static uint32_t get_u8(struct rd *r)
{
    const uint8_t *p = rd_take(r, 1);
    return p ? p[0] : 0;
}
static uint32_t get_u16(struct rd *r)
{
    const uint8_t *p = rd_take(r, 2);
    return p ? (uint32_t)p[0] << 8 | p[1] : 0;
}
static uint32_t get_u32(struct rd *r)
{
    const uint8_t *p = rd_take(r, 4);
    return p ? (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3] : 0;
}
static uint64_t get_u64(struct rd *r)
{
    uint64_t hi = get_u32(r);
    return hi << 32 | get_u32(r);
}

/* A length-prefixed string copied to a NUL-terminated heap string; embedded NULs are invalid. */
static char *get_str(struct rd *r)
{
    uint32_t n = get_u32(r);
    const uint8_t *p = rd_take(r, n);
    if (!p)
        return NULL;
    if (memchr(p, 0, n)) {
        r->bad = 1;
        return NULL;
    }
    char *s = xrealloc(NULL, (size_t)n + 1);
    memcpy(s, p, n);
    s[n] = 0;
    return s;
}

/* A list of strings as a NULL-terminated vector; each count is bounded by the payload left. */
static char **get_strv(struct rd *r)
{
    uint32_t n = get_u32(r);
    if (r->bad || n > r->n / 4) { /* every string needs at least its 4-byte length */
        r->bad = 1;
        return NULL;
    }
    char **v = xrealloc(NULL, ((size_t)n + 1) * sizeof *v);
    size_t i;
    for (i = 0; i < n; i++) {
        v[i] = get_str(r);
        if (!v[i])
            break;
    }
    v[i] = NULL;
    return v;
}

static void strv_free(char **v)
{
    if (!v)
        return;
    for (char **p = v; *p; p++)
        free(*p);
    free(v);
}

/* ---- credentials for file operations -------------------------------------------------------- */

static gid_t saved_groups[NGROUPS_MAX];
static int saved_ngroups = -1;

/* Switch the effective ids so the kernel checks permissions as the sandbox user would see them. */
static int as_user(uid_t uid, gid_t gid)
{
    if (agent_uid != 0)
        return uid == geteuid() ? 0 : EPERM;
    if (saved_ngroups < 0)
        saved_ngroups = getgroups(NGROUPS_MAX, saved_groups);
    if (setgroups(1, &gid) < 0 || setegid(gid) < 0 || seteuid(uid) < 0) {
        int e = errno;
        seteuid(0);
        setegid(0);
        setgroups(saved_ngroups > 0 ? (size_t)saved_ngroups : 0, saved_groups);
        return e;
    }
    return 0;
}

static void as_root(void)
{
    if (agent_uid != 0)
        return;
    /* uid first: without it we may not change the gid or groups back. */
    if (seteuid(0) < 0 || setegid(0) < 0 ||
        setgroups(saved_ngroups > 0 ? (size_t)saved_ngroups : 0, saved_groups) < 0) {
        logmsg("cannot restore root credentials: %s", strerror(errno));
        abort();
    }
}

/* ---- processes ----------------------------------------------------------------------------- */

static struct proc *proc_find(uint32_t handle)
{
    for (struct proc *p = procs; p; p = p->next)
        if (p->handle == handle)
            return p;
    return NULL;
}

static void close_fd(int *fd)
{
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

/* Stdin is gone (closed, EPIPE or exited): drop the queue and count it as written so the
 * host's window never waits on bytes that will not be delivered. */
static void stdin_discard(struct proc *p)
{
    p->in_written += p->in.len;
    buf_free(&p->in);
    close_fd(&p->in_fd);
}

static void proc_free(struct proc *p)
{
    for (int s = 0; s < 2; s++) {
        close_fd(&p->out[s].fd);
        free(p->out[s].ring.p);
    }
    close_fd(&p->in_fd);
    close_fd(&p->tty_hold);
    buf_free(&p->in);
    free(p);
}

static int exit_code_of(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return 255;
}

/* Reap every child, ours or reparented orphans: as PID 1 nobody else will. */
static void reap(void)
{
    /* SIGCHLD is a standard signal, pending at most once: one read empties the signalfd. */
    struct signalfd_siginfo si;
    ssize_t n = read(sig_fd, &si, sizeof si);
    (void)n; /* waitpid below finds every exit whatever it returned */
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0)
            break;
        for (struct proc *p = procs; p; p = p->next) {
            if (p->pid == pid && p->running) {
                p->running = 0;
                p->exit_code = exit_code_of(status);
                p->draining = 1;
                break;
            }
        }
    }
}

/* What the vfork child needs, prepared by the parent so the child only makes system calls. The
 * child shares the agent's memory until it execs: it writes nothing but `stage` and `err`, and
 * only on failure, right before _exit. */
struct spawn_req {
    int slave;              /* terminal slave, or -1 for pipes */
    int in_fd, out_fd, err_fd; /* the child's ends of the pipes */
    uid_t uid;
    gid_t gid;
    uint32_t nproc, nofile;
    const char *cwd;
    char **argv, **envp;
    char **sh_argv; /* {"/bin/sh", <file>, argv[1..]} for a file without #! (ENOEXEC), as execvp */
    const char *path; /* PATH of envp; glibc's default when it has none */
    int stage, err;   /* set by the child when it fails; stage -1 means it exec'd */
};

/* The child runs on its own stack in the agent's address space; one spawn at a time (the agent
 * is single-threaded and the parent is suspended until exec or exit), so one static stack does. */
static char child_stack[64 * 1024] __attribute__((aligned(64)));

static void child_fail(struct spawn_req *q, int stage, int err) __attribute__((noreturn));
static void child_fail(struct spawn_req *q, int stage, int err)
{
    q->stage = stage;
    q->err = err;
    _exit(127);
}

/* execve, then what execvp does for a file without #!: run it with /bin/sh (errno is then the
 * shell's, as with glibc). */
static void child_exec(struct spawn_req *q, const char *file)
{
    execve(file, q->argv, q->envp);
    if (errno == ENOEXEC) {
        q->sh_argv[1] = (char *)file; /* the parent's array, unused by it until we exec or exit */
        execve(q->sh_argv[0], q->sh_argv, q->envp);
    }
}

/* execvp's search (glibc's, same errors) over the PATH of the requested environment rather than
 * the agent's. It runs after the uid switch and chdir, as execvp did, so permissions are the
 * user's and relative PATH entries are relative to cwd. Returns only on failure, errno set. */
static void child_execvp(struct spawn_req *q)
{
    const char *file = q->argv[0];
    if (!file[0]) {
        errno = ENOENT;
        return;
    }
    if (strchr(file, '/')) {
        child_exec(q, file);
        return;
    }
    size_t flen = strlen(file);
    if (flen > NAME_MAX) {
        errno = ENAMETOOLONG;
        return;
    }
    char buf[PATH_MAX + NAME_MAX + 2];
    int eacces = 0;
    for (const char *p = q->path;;) {
        const char *end = strchrnul(p, ':');
        size_t dlen = (size_t)(end - p);
        if (dlen < PATH_MAX) {
            memcpy(buf, p, dlen);
            buf[dlen] = '/';
            /* An empty entry is the current directory: the bare name. */
            memcpy(buf + dlen + (dlen ? 1 : 0), file, flen + 1);
            child_exec(q, buf);
            switch (errno) {
            case EACCES:
                eacces = 1;
                break;
            case ENOENT: case ESTALE: case ENOTDIR: case ENODEV: case ETIMEDOUT:
                break;
            default:
                return; /* found it, but it cannot run */
            }
        }
        if (!*end)
            break;
        p = end + 1;
    }
    errno = eacces ? EACCES : ENOENT;
}

/* The vfork child. Raw set*id system calls: libc's wrappers may synchronise with threads, and
 * this child is not a thread libc knows. */
static int child_main(void *arg)
{
    struct spawn_req *q = arg;
    /* Undo what the agent changed for itself: ignored signals survive exec, blocked ones too. */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    if (setsid() < 0)
        child_fail(q, STAGE_SETUP, errno);
    if (q->slave >= 0) {
        if (ioctl(q->slave, TIOCSCTTY, 0) < 0)
            child_fail(q, STAGE_TTY, errno);
        if (dup2(q->slave, 0) < 0 || dup2(q->slave, 1) < 0 || dup2(q->slave, 2) < 0)
            child_fail(q, STAGE_TTY, errno);
    } else {
        if (dup2(q->in_fd, 0) < 0 || dup2(q->out_fd, 1) < 0 || dup2(q->err_fd, 2) < 0)
            child_fail(q, STAGE_SETUP, errno);
    }
    /* Every other descriptor of the agent is CLOEXEC, so exec closes them. */
    struct rlimit rl;
    if (q->nproc) {
        rl.rlim_cur = rl.rlim_max = q->nproc;
        if (setrlimit(RLIMIT_NPROC, &rl) < 0)
            child_fail(q, STAGE_RLIMIT, errno);
    }
    if (q->nofile) {
        rl.rlim_cur = rl.rlim_max = q->nofile;
        if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
            child_fail(q, STAGE_RLIMIT, errno);
    }
    if (agent_uid == 0) {
        if (syscall(SYS_setgroups, 1, &q->gid) < 0 || syscall(SYS_setgid, q->gid) < 0 ||
            syscall(SYS_setuid, q->uid) < 0)
            child_fail(q, STAGE_CREDS, errno);
    } else if (q->uid != agent_uid || q->gid != agent_gid) {
        child_fail(q, STAGE_CREDS, EPERM);
    }
    /* After the uid switch, so a directory the user may not enter is refused. */
    if (q->cwd[0] && chdir(q->cwd) < 0)
        child_fail(q, STAGE_CWD, errno);
    /* The umask (022) is inherited: main sets it and the agent never changes it. */
    child_execvp(q);
    child_fail(q, STAGE_EXEC, errno);
}

static int open_pty(int *master, int *slave, uint16_t rows, uint16_t cols)
{
    *master = *slave = -1;
    int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (m < 0)
        return errno;
    char name[128];
    if (grantpt(m) < 0 || unlockpt(m) < 0 || ptsname_r(m, name, sizeof name) != 0) {
        int e = errno;
        close(m);
        return e;
    }
    int s = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (s < 0) {
        int e = errno;
        close(m);
        return e;
    }
    struct winsize ws = {.ws_row = rows, .ws_col = cols};
    ioctl(m, TIOCSWINSZ, &ws);
    *master = m;
    *slave = s;
    return 0;
}

static void spawn_failed(uint32_t id, int stage, int err, const char *what)
{
    char msg[256];
    snprintf(msg, sizeof msg, "%s: %s", what, strerror(err));
    size_t f = frame_begin(T_SPAWN_FAILED, id);
    put_u32((uint32_t)err);
    put_u8((uint8_t)stage);
    put_str(msg);
    frame_end(f);
}

static const char *stage_name(int stage)
{
    switch (stage) {
    case STAGE_EXEC: return "cannot execute the program";
    case STAGE_CWD: return "cannot change to the working directory";
    case STAGE_CREDS: return "cannot switch to the requested uid/gid";
    case STAGE_RLIMIT: return "cannot apply resource limits";
    case STAGE_TTY: return "cannot set up the terminal";
    default: return "cannot start the process";
    }
}

static void do_spawn(uint32_t id, struct rd *r)
{
    uint32_t handle = get_u32(r);
    uid_t uid = get_u32(r);
    gid_t gid = get_u32(r);
    uint16_t rows = (uint16_t)get_u16(r), cols = (uint16_t)get_u16(r);
    uint32_t nproc = get_u32(r), nofile = get_u32(r);
    char *cwd = get_str(r);
    char **argv = get_strv(r);
    char **envp = get_strv(r);
    int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1};
    int master = -1, slave = -1;
    char **sh_argv = NULL;

    if (r->bad || !argv || !argv[0] || !envp) {
        spawn_failed(id, STAGE_SETUP, EINVAL, "malformed SPAWN");
        goto out;
    }
    if (proc_find(handle)) {
        spawn_failed(id, STAGE_SETUP, EEXIST, "handle already in use");
        goto out;
    }
    if (nprocs >= MAX_PROCS) {
        spawn_failed(id, STAGE_SETUP, EAGAIN, "too many processes retained; FORGET exited ones");
        goto out;
    }
    int e = 0;
    if (rows && cols) {
        e = open_pty(&master, &slave, rows, cols);
        if (!e && agent_uid == 0 && fchown(slave, uid, (gid_t)-1) < 0) {
            /* Only cosmetic (mesg, write): the child holds the terminal open already. */
        }
    } else if (pipe2(pin, O_CLOEXEC) < 0 || pipe2(pout, O_CLOEXEC) < 0 || pipe2(perr, O_CLOEXEC) < 0) {
        e = errno;
    }
    if (e) {
        spawn_failed(id, STAGE_SETUP, e, rows && cols ? "cannot open a terminal" : "cannot create pipes");
        goto out;
    }
    if (!(rows && cols)) {
        /* Best effort (a smaller limit keeps the default): under gVisor each fill of a pipe is a round
         * trip between two tasks through the sentry, so the default 64 KiB carried 58-62 MiB/s and 1 MiB
         * 531 MiB/s in 8 KiB writes, 2.4 GiB/s in 1 MiB ones (bench/bench_pipes.py). The sentry
         * allocates a pipe's buffer as it fills, so an idle pipe costs nothing more. */
        (void)fcntl(pin[1], F_SETPIPE_SZ, PIPE_BYTES);
        (void)fcntl(pout[1], F_SETPIPE_SZ, PIPE_BYTES);
        (void)fcntl(perr[1], F_SETPIPE_SZ, PIPE_BYTES);
    }
    size_t argc = 0;
    while (argv[argc])
        argc++;
    sh_argv = xrealloc(NULL, (argc + 2) * sizeof *sh_argv);
    sh_argv[0] = "/bin/sh";
    sh_argv[1] = argv[0];
    memcpy(sh_argv + 2, argv + 1, argc * sizeof *sh_argv); /* argv[1..] and its NULL */
    struct spawn_req q = {
        .slave = slave, .in_fd = pin[0], .out_fd = pout[1], .err_fd = perr[1],
        .uid = uid, .gid = gid, .nproc = nproc, .nofile = nofile,
        .cwd = cwd, .argv = argv, .envp = envp, .sh_argv = sh_argv,
        .path = "/bin:/usr/bin", /* glibc's execvp default when PATH is unset */
        .stage = -1, .err = 0,
    };
    for (char **v = envp; *v; v++) {
        if (!strncmp(*v, "PATH=", 5)) {
            q.path = *v + 5; /* the first one, as getenv finds it */
            break;
        }
    }
    /* vfork semantics: no copy of the agent's address space (costly under gVisor); we resume
     * once the child has exec'd or exited, so its report in q is complete when we read it. */
    pid_t pid = clone(child_main, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &q);
    if (pid < 0) {
        spawn_failed(id, STAGE_SETUP, errno, "cannot fork");
        goto out;
    }
    if (q.stage >= 0) {
        int st;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
            ;
        spawn_failed(id, q.stage, q.err, stage_name(q.stage));
        goto out;
    }
    struct proc *p = xrealloc(NULL, sizeof *p);
    memset(p, 0, sizeof *p);
    p->handle = handle;
    p->pid = pid;
    p->running = 1;
    p->subscribed = 1;
    p->tty_hold = -1;
    if (master >= 0) {
        p->tty = 1;
        p->out[0].fd = master;
        p->out[1].fd = -1;
        p->in_fd = fcntl(master, F_DUPFD_CLOEXEC, 0); /* own fd: stdin and output close separately */
        master = -1;
    } else {
        p->in_fd = pin[1];
        p->out[0].fd = pout[0];
        p->out[1].fd = perr[0];
        pin[1] = pout[0] = perr[0] = -1;
    }
    /* Fresh pipes and terminals have no other status flags, so skip F_GETFL; a terminal's
     * in_fd shares the master's open file description and so its flag. */
    for (int s = 0; s < 2; s++)
        if (p->out[s].fd >= 0)
            fcntl(p->out[s].fd, F_SETFL, O_NONBLOCK);
    if (p->in_fd >= 0 && !p->tty)
        fcntl(p->in_fd, F_SETFL, O_NONBLOCK);
    p->next = procs;
    procs = p;
    nprocs++;
    size_t f = frame_begin(T_SPAWNED, id);
    put_u32((uint32_t)pid);
    frame_end(f);
out:
    close_fd(&pin[0]); close_fd(&pin[1]);
    close_fd(&pout[0]); close_fd(&pout[1]);
    close_fd(&perr[0]); close_fd(&perr[1]);
    close_fd(&master); close_fd(&slave);
    free(sh_argv);
    free(cwd);
    strv_free(argv);
    strv_free(envp);
}

static void do_list(uint32_t id)
{
    size_t f = frame_begin(T_PROCESSES, id);
    put_u32(nprocs);
    for (struct proc *p = procs; p; p = p->next) {
        put_u32(p->handle);
        put_u32((uint32_t)p->pid);
        put_u8((uint8_t)(p->running ? 1 : 0));
        put_u8((uint8_t)p->tty);
        put_u32((uint32_t)p->exit_code);
        put_u64(p->out[0].produced);
        put_u64(p->out[1].produced);
        put_u64(p->in_received);
        put_u64(p->in_written);
    }
    frame_end(f);
}

static void do_resume(uint32_t id, struct rd *r)
{
    uint32_t handle = get_u32(r);
    uint64_t off[2];
    off[0] = get_u64(r);
    off[1] = get_u64(r);
    if (r->bad)
        return send_error(id, EINVAL, "malformed RESUME");
    struct proc *p = proc_find(handle);
    if (!p)
        return send_error(id, ENOENT, "no such process handle");
    for (int s = 0; s < 2; s++)
        if (off[s] < p->out[s].acked || off[s] > p->out[s].produced)
            return send_error(id, ERANGE, "offset outside the retained output");
    for (int s = 0; s < 2; s++) {
        struct stream *st = &p->out[s];
        ring_consume(&st->ring, (size_t)(off[s] - st->acked));
        st->acked = st->sent = off[s];
    }
    p->subscribed = 1;
    p->exit_sent = 0;
    send_ok(id);
}

static void do_ack(struct rd *r)
{
    uint32_t handle = get_u32(r);
    uint32_t s = get_u8(r);
    uint64_t off = get_u64(r);
    struct proc *p = proc_find(handle);
    if (r->bad || s > 1 || !p)
        return; /* acks are advisory; a stale one for a forgotten process is harmless */
    struct stream *st = &p->out[s];
    if (off > st->sent)
        off = st->sent;
    if (off > st->acked) {
        ring_consume(&st->ring, (size_t)(off - st->acked));
        st->acked = off;
    }
    if (st->fd < 0 && st->ring.len == 0) { /* finished and recorded: no need to hold the buffer */
        free(st->ring.p);
        memset(&st->ring, 0, sizeof st->ring);
    }
}

static void do_stdin(struct rd *r)
{
    uint32_t handle = get_u32(r);
    uint64_t off = get_u64(r);
    size_t n = r->n;
    const uint8_t *d = rd_take(r, n);
    if (r->bad)
        return;
    struct proc *p = proc_find(handle);
    if (!p) {
        /* Ack anyway so a host writing to a forgotten process never waits forever. */
        size_t f = frame_begin(T_STDIN_ACK, 0);
        put_u32(handle);
        put_u64(off + n);
        frame_end(f);
        return;
    }
    if (off > p->in_received) {
        logmsg("stdin gap for handle %u; dropped", handle);
        return;
    }
    if (off + n <= p->in_received) {
        p->in_acked = UINT64_MAX; /* resend the current ack: the host lost it */
        return;
    }
    size_t skip = (size_t)(p->in_received - off);
    d += skip;
    n -= skip;
    p->in_received += n;
    if (p->in_fd < 0 || p->in_close) {
        p->in_written += n;
        return;
    }
    if (p->in.len + n > STDIN_HARD_MAX) {
        logmsg("stdin over its window for handle %u; dropped", handle);
        p->in_written += n;
        return;
    }
    buf_append(&p->in, d, n);
}

static void do_stdin_close(uint32_t id, struct rd *r)
{
    uint32_t handle = get_u32(r);
    struct proc *p = proc_find(handle);
    if (r->bad)
        return send_error(id, EINVAL, "malformed STDIN_CLOSE");
    if (!p)
        return send_error(id, ENOENT, "no such process handle");
    p->in_close = 1;
    send_ok(id);
}

static void do_signal(uint32_t id, struct rd *r)
{
    uint32_t handle = get_u32(r);
    uint32_t sig = get_u32(r);
    if (r->bad || sig == 0 || sig >= 65)
        return send_error(id, EINVAL, "malformed SIGNAL");
    struct proc *p = proc_find(handle);
    if (!p)
        return send_error(id, ENOENT, "no such process handle");
    /* The process leads its own group; signalling the group reaches what it started too. An
     * exited leader may still have a group alive, so try even after exit. */
    if (kill(-p->pid, (int)sig) < 0 && p->running && kill(p->pid, (int)sig) < 0 && errno != ESRCH)
        return send_error(id, errno, NULL);
    send_ok(id);
}

static void do_resize(uint32_t id, struct rd *r)
{
    uint32_t handle = get_u32(r);
    struct winsize ws = {.ws_row = (unsigned short)get_u16(r), .ws_col = (unsigned short)get_u16(r)};
    if (r->bad)
        return send_error(id, EINVAL, "malformed RESIZE");
    struct proc *p = proc_find(handle);
    if (!p)
        return send_error(id, ENOENT, "no such process handle");
    int fd = p->out[0].fd >= 0 ? p->out[0].fd : p->in_fd;
    if (!p->tty)
        return send_error(id, ENOTTY, "the process has no terminal");
    if (fd < 0)
        return send_ok(id); /* terminal already gone with the process */
    if (ioctl(fd, TIOCSWINSZ, &ws) < 0)
        return send_error(id, errno, NULL);
    send_ok(id);
}

static void do_forget(uint32_t id, struct rd *r)
{
    uint32_t handle = get_u32(r);
    if (r->bad)
        return send_error(id, EINVAL, "malformed FORGET");
    for (struct proc **pp = &procs; *pp; pp = &(*pp)->next) {
        struct proc *p = *pp;
        if (p->handle != handle)
            continue;
        if (p->running)
            return send_error(id, EBUSY, "the process is still running");
        *pp = p->next;
        nprocs--;
        proc_free(p);
        return send_ok(id);
    }
    send_error(id, ENOENT, "no such process handle");
}

/* ---- files ---------------------------------------------------------------------------------- */

static struct fop *fop_find(uint32_t id)
{
    for (struct fop *o = fops; o; o = o->next)
        if (o->id == id)
            return o;
    return NULL;
}

static void fop_free(struct fop *o)
{
    for (struct fop **pp = &fops; *pp; pp = &(*pp)->next) {
        if (*pp == o) {
            *pp = o->next;
            break;
        }
    }
    close_fd(&o->fd);
    if (o->dir)
        closedir(o->dir);
    if (o->tmp) {
        if (as_user(o->uid, o->gid) == 0) {
            unlink(o->tmp);
            as_root();
        }
    }
    free(o->path);
    free(o->tmp);
    free(o);
}

static struct fop *fop_new(uint32_t id, int kind, uid_t uid, gid_t gid, char *path)
{
    struct fop *o = xrealloc(NULL, sizeof *o);
    memset(o, 0, sizeof *o);
    o->id = id;
    o->kind = kind;
    o->fd = -1;
    o->uid = uid;
    o->gid = gid;
    o->path = path;
    o->next = fops;
    fops = o;
    return o;
}

/* uid, gid and an absolute path: the common head of every file request. */
static char *get_file_head(uint32_t id, struct rd *r, uid_t *uid, gid_t *gid)
{
    *uid = get_u32(r);
    *gid = get_u32(r);
    char *path = get_str(r);
    if (r->bad || !path || path[0] != '/') {
        free(path);
        send_error(id, EINVAL, "malformed request or relative path");
        return NULL;
    }
    return path;
}

/* The start shared by operations that keep state under their request id (READ, WRITE, LIST_DIR):
 * refuse an id in use, then take the user's identity. On failure the error is sent and path freed. */
static int begin_stateful_op(uint32_t id, char *path, uid_t uid, gid_t gid)
{
    if (fop_find(id)) {
        free(path);
        send_error(id, EEXIST, "request id already in use");
        return -1;
    }
    int e = as_user(uid, gid);
    if (e) {
        free(path);
        send_error(id, e, NULL);
        return -1;
    }
    return 0;
}

static void do_read(uint32_t id, struct rd *r)
{
    uid_t uid;
    gid_t gid;
    char *path = get_file_head(id, r, &uid, &gid);
    if (!path)
        return;
    if (begin_stateful_op(id, path, uid, gid) < 0)
        return;
    /* O_NONBLOCK so a FIFO cannot wedge the agent; non-regular files are refused below. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    int e = errno;
    as_root();
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) < 0) {
        e = errno;
        close_fd(&fd);
    }
    if (fd < 0) {
        free(path);
        return send_error(id, e, NULL);
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        free(path);
        return send_error(id, S_ISDIR(st.st_mode) ? EISDIR : EINVAL,
                          S_ISDIR(st.st_mode) ? "is a directory" : "not a regular file");
    }
    fcntl(fd, F_SETFL, 0);
    struct fop *o = fop_new(id, OP_READ, uid, gid, path);
    o->fd = fd;
    size_t f = frame_begin(T_READ_OPEN, id);
    put_u64((uint64_t)st.st_size);
    frame_end(f);
}

static void do_read_ack(uint32_t id, struct rd *r)
{
    uint64_t off = get_u64(r);
    struct fop *o = fop_find(id);
    if (r->bad || !o || o->kind != OP_READ)
        return;
    if (off > o->sent)
        off = o->sent;
    if (off > o->acked)
        o->acked = off;
}

/* mkdir -p of the parents of `path`, as the current effective user. */
static int make_parents(const char *path)
{
    char *p = strdup(path);
    if (!p)
        return ENOMEM;
    int e = 0;
    for (char *s = strchr(p + 1, '/'); s; s = strchr(s + 1, '/')) {
        *s = 0;
        if (mkdir(p, 0755) < 0 && errno != EEXIST) {
            e = errno;
            *s = '/';
            break;
        }
        *s = '/';
    }
    free(p);
    return e;
}

static void do_write(uint32_t id, struct rd *r)
{
    uid_t uid;
    gid_t gid;
    uint32_t mode = get_u32(r);
    char *path = get_file_head(id, r, &uid, &gid);
    if (!path)
        return;
    size_t plen = strlen(path);
    if (plen < 2 || path[plen - 1] == '/') {
        free(path);
        return send_error(id, EISDIR, "the path names a directory");
    }
    if (begin_stateful_op(id, path, uid, gid) < 0)
        return;
    int e = make_parents(path);
    /* The temporary lives beside the target so the final rename is atomic on one filesystem. */
    char *slash = strrchr(path, '/');
    size_t tlen = plen + 64;
    char *tmp = xrealloc(NULL, tlen);
    snprintf(tmp, tlen, "%.*s/.%.180s.sbx-%d-%lu", (int)(slash - path), path, slash + 1, (int)getpid(),
             ++tmp_counter);
    int fd = -1;
    if (!e) {
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0)
            e = errno;
    }
    as_root();
    if (e) {
        free(tmp);
        free(path);
        return send_error(id, e, NULL);
    }
    struct fop *o = fop_new(id, OP_WRITE, uid, gid, path);
    o->fd = fd;
    o->tmp = tmp;
    o->mode = (mode_t)(mode & 07777);
}

static void do_write_data(uint32_t id, struct rd *r)
{
    struct fop *o = fop_find(id);
    if (!o || o->kind != OP_WRITE)
        return; /* after an error reply the rest of the stream is ignored */
    const uint8_t *d = r->p;
    size_t n = r->n;
    while (n) {
        ssize_t w = write(o->fd, d, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            send_error(id, errno, NULL);
            fop_free(o);
            return;
        }
        d += w;
        n -= (size_t)w;
        o->sent += (uint64_t)w;
    }
}

static void do_write_end(uint32_t id)
{
    struct fop *o = fop_find(id);
    if (!o || o->kind != OP_WRITE)
        return;
    int e = 0;
    if (fchmod(o->fd, o->mode) < 0 || close(o->fd) < 0)
        e = errno;
    o->fd = -1;
    if (!e && (e = as_user(o->uid, o->gid)) == 0) {
        if (rename(o->tmp, o->path) < 0)
            e = errno;
        else {
            free(o->tmp);
            o->tmp = NULL;
        }
        as_root();
    }
    if (e)
        send_error(id, e, NULL);
    else
        send_ok(id);
    fop_free(o);
}

static void do_remove(uint32_t id, struct rd *r)
{
    uid_t uid;
    gid_t gid;
    char *path = get_file_head(id, r, &uid, &gid);
    if (!path)
        return;
    int e = as_user(uid, gid);
    if (!e) {
        if (unlink(path) < 0) {
            e = errno;
            /* Linux says EISDIR for unlink of a directory; then it must be rmdir. */
            if (e == EISDIR || e == EPERM) {
                struct stat st;
                if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode))
                    e = rmdir(path) < 0 ? errno : 0;
            }
        }
        as_root();
    }
    free(path);
    if (e == EEXIST)
        e = ENOTEMPTY; /* POSIX lets rmdir say either; the host needs one answer */
    if (e)
        send_error(id, e, NULL);
    else
        send_ok(id);
}

static int file_type(mode_t m) { return S_ISDIR(m) ? FT_DIR : S_ISREG(m) ? FT_FILE : FT_OTHER; }

static void do_stat(uint32_t id, struct rd *r)
{
    uid_t uid;
    gid_t gid;
    char *path = get_file_head(id, r, &uid, &gid);
    if (!path)
        return;
    struct stat st;
    int e = as_user(uid, gid);
    if (!e) {
        if (stat(path, &st) < 0)
            e = errno;
        as_root();
    }
    free(path);
    if (e)
        return send_error(id, e, NULL);
    size_t f = frame_begin(T_STAT_OK, id);
    put_u8((uint8_t)file_type(st.st_mode));
    put_u64((uint64_t)st.st_size);
    put_u32((uint32_t)st.st_mode);
    put_u32((uint32_t)st.st_uid);
    put_u32((uint32_t)st.st_gid);
    put_u64((uint64_t)st.st_mtime);
    frame_end(f);
}

static void do_list_dir(uint32_t id, struct rd *r)
{
    uid_t uid;
    gid_t gid;
    char *path = get_file_head(id, r, &uid, &gid);
    if (!path)
        return;
    if (begin_stateful_op(id, path, uid, gid) < 0)
        return;
    DIR *d = opendir(path);
    int e = errno;
    as_root();
    if (!d) {
        free(path);
        return send_error(id, e, NULL);
    }
    /* Entries are produced in batches by pump_files(), so a huge directory is no memory spike. */
    struct fop *o = fop_new(id, OP_LISTDIR, uid, gid, path);
    o->dir = d;
}

static void do_cancel(uint32_t id)
{
    struct fop *o = fop_find(id);
    if (o)
        fop_free(o);
}

/* ---- TCP tunnels (protocol version 2) -------------------------------------------------------- */

static struct tun *tun_find(uint32_t id)
{
    for (struct tun *t = tuns; t; t = t->next)
        if (t->id == id)
            return t;
    return NULL;
}

static void tun_free(struct tun *t)
{
    for (struct tun **pp = &tuns; *pp; pp = &(*pp)->next) {
        if (*pp == t) {
            *pp = t->next;
            ntuns--;
            break;
        }
    }
    close_fd(&t->fd);
    buf_free(&t->out);
    free(t);
}

/* The agent ends the tunnel: err 0 after both directions finished, else why it failed. */
static void tun_close(struct tun *t, int err, const char *msg)
{
    size_t f = frame_begin(T_TCP_CLOSED, t->id);
    put_u32((uint32_t)err);
    put_str(err ? (msg ? msg : strerror(err)) : "");
    frame_end(f);
    tun_free(t);
}

/* Both directions ended: nothing is left to carry, so free the socket now rather than wait for the
 * host's TCP_CLOSE. Returns 1 if `t` was freed. */
static int tun_done(struct tun *t)
{
    if (!t->rd_eof || !t->wr_shut)
        return 0;
    tun_close(t, 0, NULL);
    return 1;
}

static int tun_may_read(const struct tun *t)
{
    return !t->connecting && !t->rd_eof && t->sent - t->acked < TCP_WINDOW && room();
}

/* One chunk from the guest, read straight into a TCP_DATA frame. Returns 1 if `t` was freed. */
static int tun_read(struct tun *t)
{
    if (!tun_may_read(t))
        return 0;
    size_t want = TCP_WINDOW - (size_t)(t->sent - t->acked);
    if (want > TCP_CHUNK)
        want = TCP_CHUNK;
    size_t f = frame_begin(T_TCP_DATA, t->id);
    buf_reserve(&obuf, want);
    ssize_t n;
    do
        n = read(t->fd, obuf.p + obuf.head + obuf.len, want);
    while (n < 0 && errno == EINTR);
    if (n > 0) {
        obuf.len += (size_t)n;
        frame_end(f);
        t->sent += (uint64_t)n;
        return 0;
    }
    obuf.len = f; /* discard the unfinished header */
    if (n < 0 && errno == EAGAIN)
        return 0;
    if (n < 0) {
        tun_close(t, errno, NULL);
        return 1;
    }
    t->rd_eof = 1;
    frame_end(frame_begin(T_TCP_EOF, t->id));
    return tun_done(t);
}

/* Write what the host sent, then the half-close it asked for. Returns 1 if `t` was freed. */
static int tun_write(struct tun *t)
{
    if (t->connecting)
        return 0;
    while (t->out.len) {
        ssize_t n = write(t->fd, t->out.p + t->out.head, t->out.len);
        if (n > 0) {
            buf_consume(&t->out, (size_t)n);
            t->written += (uint64_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            break;
        tun_close(t, n < 0 ? errno : EIO, NULL); /* EPIPE, ECONNRESET: the guest side is gone */
        return 1;
    }
    buf_trim(&t->out);
    if (t->shut_req && !t->out.len && !t->wr_shut) {
        if (shutdown(t->fd, SHUT_WR) < 0 && errno != ENOTCONN) {
            tun_close(t, errno, NULL);
            return 1;
        }
        t->wr_shut = 1;
    }
    return tun_done(t);
}

/* poll() reported `ev` for the tunnel's socket. */
static void tun_event(struct tun *t, short ev)
{
    if (t->connecting) {
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(t->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
            err = errno;
        if (err) {
            send_error(t->id, err, NULL);
            tun_free(t);
            return;
        }
        t->connecting = 0;
        send_ok(t->id);
        tun_write(t); /* anything the host sent behind its TCP_OPEN */
        return;
    }
    if ((ev & (POLLIN | POLLHUP | POLLERR)) && tun_may_read(t) && tun_read(t))
        return;
    if (ev & (POLLOUT | POLLHUP | POLLERR))
        tun_write(t);
}

static short tun_poll_events(const struct tun *t)
{
    if (t->connecting)
        return POLLOUT;
    short ev = tun_may_read(t) ? POLLIN : 0;
    if (t->out.len)
        ev |= POLLOUT;
    return ev;
}

static void do_tcp_open(uint32_t id, struct rd *r)
{
    uint32_t port = get_u16(r);
    if (r->bad || r->n || port == 0)
        return send_error(id, EINVAL, "malformed TCP_OPEN (port must be 1-65535)");
    if (tun_find(id))
        return send_error(id, EEXIST, "request id already in use");
    if (ntuns >= MAX_TUNNELS)
        return send_error(id, EMFILE, "too many TCP tunnels open; close some");
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return send_error(id, errno, NULL);
    /* Tunnels reach guest loopback only: the address is fixed here, never taken from the host. */
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr = {.s_addr = htonl(INADDR_LOOPBACK)}};
    int one = 1;
    /* The agent re-chunks the stream; Nagle on top would add delay to small interactive writes. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int connecting = 0;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        if (errno != EINPROGRESS && errno != EINTR) {
            int e = errno;
            close(fd);
            return send_error(id, e, NULL);
        }
        connecting = 1;
    }
    struct tun *t = xrealloc(NULL, sizeof *t);
    memset(t, 0, sizeof *t);
    t->id = id;
    t->fd = fd;
    t->connecting = connecting;
    t->next = tuns;
    tuns = t;
    ntuns++;
    if (!connecting)
        send_ok(id);
}

static void do_tcp_send(uint32_t id, struct rd *r)
{
    struct tun *t = tun_find(id);
    if (!t)
        return; /* the agent closed it; the host learns that from TCP_CLOSED */
    if (t->shut_req)
        return tun_close(t, EPIPE, "data after TCP_SHUT_WR");
    if (t->out.len + r->n > TCP_HARD_MAX)
        return tun_close(t, ENOBUFS, "the host sent more than the window");
    buf_append(&t->out, r->p, r->n);
}

static void do_tcp_ack(uint32_t id, struct rd *r)
{
    uint64_t off = get_u64(r);
    struct tun *t = tun_find(id);
    if (r->bad || !t)
        return;
    if (off > t->sent)
        off = t->sent;
    if (off > t->acked)
        t->acked = off;
}

static void do_tcp_shut_wr(uint32_t id)
{
    struct tun *t = tun_find(id);
    if (t)
        t->shut_req = 1; /* done by tun_write once the queued bytes are written */
}

static void do_tcp_close(uint32_t id)
{
    struct tun *t = tun_find(id);
    if (t)
        tun_free(t);
}

/* Write what TCP_SEND / TCP_SHUT_WR queued, and acknowledge what was written. */
static void pump_tunnels(void)
{
    struct tun *next;
    for (struct tun *t = tuns; t; t = next) {
        next = t->next;
        if ((t->out.len || (t->shut_req && !t->wr_shut)) && tun_write(t))
            continue;
        if (t->written != t->written_acked) {
            size_t f = frame_begin(T_TCP_SEND_ACK, t->id);
            put_u64(t->written);
            frame_end(f);
            t->written_acked = t->written;
        }
    }
}

/* ---- raw tunnels (protocol version 4) -------------------------------------------------------- */

static void rtun_free(struct rtun *t)
{
    for (struct rtun **pp = &rtuns; *pp; pp = &(*pp)->next) {
        if (*pp == t) {
            *pp = t->next;
            nrtuns--;
            break;
        }
    }
    close_fd(&t->hfd);
    close_fd(&t->gfd);
    free(t->up.p);
    free(t->down.p);
    free(t);
}

static void rtun_accept(void)
{
    int fd = accept4(tun_listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0)
        return;
    if (nrtuns >= MAX_TUNNELS) {
        close(fd); /* the host reads end of file before an answer: it counts as refused */
        return;
    }
    struct rtun *t = xrealloc(NULL, sizeof *t);
    memset(t, 0, sizeof *t);
    t->hfd = fd;
    t->gfd = -1;
    t->next = rtuns;
    rtuns = t;
    nrtuns++;
}

/* Queue the connect answer; on an error the tunnel closes once it is written. */
static void rtun_answer(struct rtun *t, int err)
{
    t->up.p = xrealloc(NULL, RAW_BUF);
    t->up.p[0] = (uint8_t)(err >> 24), t->up.p[1] = (uint8_t)(err >> 16);
    t->up.p[2] = (uint8_t)(err >> 8), t->up.p[3] = (uint8_t)err;
    t->up.len = 4;
    if (err) {
        t->up.eof = 1;   /* nothing follows the answer */
        t->down.eof = 1; /* and nothing of the host's is read */
        t->down.shut = 1;
        close_fd(&t->gfd);
    }
}

/* Read the header, then connect. Returns 1 if `t` was freed. */
static int rtun_header(struct rtun *t)
{
    ssize_t n;
    do
        n = read(t->hfd, t->hdr + t->hdr_got, RAW_HDR_LEN - t->hdr_got);
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN)
        return 0;
    if (n <= 0) {
        rtun_free(t);
        return 1;
    }
    t->hdr_got += (size_t)n;
    if (t->hdr_got < RAW_HDR_LEN)
        return 0;
    uint32_t port = (uint32_t)t->hdr[4] << 8 | t->hdr[5];
    if (memcmp(t->hdr, RAW_MAGIC, 4) != 0 || t->hdr[6] || t->hdr[7] || port == 0) {
        rtun_answer(t, EINVAL);
        return 0;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rtun_answer(t, errno);
        return 0;
    }
    /* Guest loopback only, as for TCP_OPEN: the address is fixed here. */
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr = {.s_addr = htonl(INADDR_LOOPBACK)}};
    t->gfd = fd;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        if (errno != EINPROGRESS && errno != EINTR) {
            rtun_answer(t, errno);
            return 0;
        }
        t->connecting = 1;
        return 0;
    }
    rtun_answer(t, 0);
    return 0;
}

/* Move what can be moved from `from` through `d` to `to`, reading at most four buffers per call so that a busy
 * tunnel holds up the rest of the loop (processes, other tunnels) for a few milliseconds at most. One buffer
 * per call cost the sandbox 1.2 s of CPU per GiB against 0.8-1.0 (one poll per MiB more). Returns an errno,
 * or 0. */
static int raw_copy(struct raw_dir *d, int from, int to)
{
    for (int reads = 0;; reads++) {
        while (d->len) {
            ssize_t n = write(to, d->p + d->head, d->len);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0 && errno == EAGAIN)
                return 0;
            if (n <= 0)
                return n < 0 ? errno : EIO;
            d->head += (size_t)n;
            d->len -= (size_t)n;
        }
        d->head = 0;
        if (d->eof) {
            if (!d->shut) {
                if (to >= 0 && shutdown(to, SHUT_WR) < 0 && errno != ENOTCONN)
                    return errno;
                d->shut = 1;
            }
            return 0;
        }
        if (from < 0 || reads == 4)
            return 0;
        if (!d->p)
            d->p = xrealloc(NULL, RAW_BUF); /* host -> guest: only once the host sends something */
        ssize_t n;
        do
            n = read(from, d->p, RAW_BUF);
        while (n < 0 && errno == EINTR);
        if (n < 0 && errno == EAGAIN)
            return 0;
        if (n < 0)
            return errno;
        if (n == 0)
            d->eof = 1;
        d->len = (size_t)n;
    }
}

/* poll() reported `hev` for the host's socket and something for the guest's. Returns 1 if `t` was freed. */
static int rtun_event(struct rtun *t, short hev)
{
    if (t->gfd < 0 && !t->up.p)
        return rtun_header(t);
    if (t->connecting && (hev & (POLLHUP | POLLERR))) {
        rtun_free(t); /* the host gave up waiting (a connect to a full backlog can take minutes) */
        return 1;
    }
    if (t->connecting) {
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(t->gfd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
            err = errno;
        if (err == EINPROGRESS || err == EALREADY)
            return 0;
        t->connecting = 0;
        rtun_answer(t, err);
    }
    if (raw_copy(&t->up, t->gfd, t->hfd) || raw_copy(&t->down, t->hfd, t->gfd) ||
        (t->up.shut && t->down.shut)) {
        rtun_free(t);
        return 1;
    }
    return 0;
}

static void rtun_poll(const struct rtun *t, struct pollfd *h, struct pollfd *g)
{
    *h = (struct pollfd){.fd = -1};
    *g = (struct pollfd){.fd = -1};
    if (t->gfd < 0 && !t->up.p) {
        *h = (struct pollfd){.fd = t->hfd, .events = POLLIN};
        return;
    }
    if (t->connecting) {
        *h = (struct pollfd){.fd = t->hfd, .events = 0}; /* POLLHUP only: the host closed */
        *g = (struct pollfd){.fd = t->gfd, .events = POLLOUT};
        return;
    }
    short he = 0, ge = 0;
    if (t->up.len)
        he |= POLLOUT;
    else if (!t->up.eof)
        ge |= POLLIN;
    if (t->down.len)
        ge |= POLLOUT;
    else if (!t->down.eof)
        he |= POLLIN;
    if (he)
        *h = (struct pollfd){.fd = t->hfd, .events = he};
    if (ge && t->gfd >= 0)
        *g = (struct pollfd){.fd = t->gfd, .events = ge};
}

/* ---- dispatch ------------------------------------------------------------------------------- */

static void do_hello(uint32_t id, struct rd *r)
{
    const uint8_t *magic = rd_take(r, 4);
    uint32_t version = get_u32(r);
    if (r->bad || memcmp(magic, PROTO_MAGIC, 4) != 0)
        return send_error(id, EPROTO, "not an sbx-agent HELLO");
    if (version < PROTO_MIN_VERSION || version > PROTO_VERSION) {
        char msg[96];
        snprintf(msg, sizeof msg, "protocol version %u is not supported; this agent speaks %u to %u", version,
                 PROTO_MIN_VERSION, PROTO_VERSION);
        return send_error(id, EPROTONOSUPPORT, msg);
    }
    hello_done = 1;
    conn_version = version; /* the host's: it may be older than this agent */
    size_t f = frame_begin(T_HELLO_OK, id);
    put_u32(version);
    put_u32((uint32_t)getpid());
    put_u32(MAX_PAYLOAD);
    put_u32(OUT_WINDOW);
    put_u32(STDIN_WINDOW);
    put_u32(READ_WINDOW);
    if (version >= 2)
        put_u32(TCP_WINDOW);
    frame_end(f);
}

/* QUIESCE: stop listening, answer OK, close the connection, then wait for wake_path (see above).
 * Processes keep running meanwhile; their output waits in the rings for the next connection. */
static void do_quiesce(uint32_t id, struct rd *r)
{
    char *path = get_str(r);
    if (r->bad || !path || path[0] != '/') {
        free(path);
        return send_error(id, EINVAL, "malformed QUIESCE: the wake path must be absolute");
    }
    if (fd_mode || listen_fd < 0) {
        free(path);
        return send_error(id, EOPNOTSUPP, "this agent has no listening socket to give up");
    }
    close_fd(&listen_fd);
    unlink(listen_path);
    /* Raw tunnels hold host sockets too; like framed ones they do not survive a checkpoint. */
    if (tun_listen_fd >= 0) {
        close_fd(&tun_listen_fd);
        unlink(tun_listen_path);
    }
    while (rtuns)
        rtun_free(rtuns);
    unlink(path); /* a stale wake file must not end this quiesce at once */
    free(wake_path);
    wake_path = path;
    send_ok(id);
    quiescing = 1; /* the main loop flushes what is queued, the OK last, then closes */
    logmsg("quiescing; then waiting for %s", wake_path);
}

static int listen_on(const char *path);

/* Called every loop while quiesced: listen again once the wake file exists. */
static void check_wake(void)
{
    if (!wake_path || access(wake_path, F_OK) != 0)
        return;
    if (tun_listen_path && tun_listen_fd < 0) {
        tun_listen_fd = listen_on(tun_listen_path);
        if (tun_listen_fd < 0) {
            logmsg("cannot listen again on the tunnel socket after a wake: %s", strerror(errno));
            return; /* retried on the next poll */
        }
    }
    int fd = listen_on(listen_path);
    if (fd < 0) {
        logmsg("cannot listen again after a wake: %s", strerror(errno));
        return; /* retried on the next poll */
    }
    unlink(wake_path);
    free(wake_path);
    wake_path = NULL;
    listen_fd = fd;
    logmsg("woken; listening again");
}

static void dispatch(uint8_t type, uint32_t id, const uint8_t *payload, uint32_t len)
{
    struct rd r = {payload, len, 0};
    if (!hello_done && type != T_HELLO)
        return send_error(id, EPROTO, "send HELLO first");
    if (type >= T_TCP_OPEN && type <= T_TCP_CLOSE && conn_version < 2)
        return send_error(id, ENOSYS, "unknown message type"); /* as a version 1 agent answers */
    if (type == T_QUIESCE && conn_version < 3)
        return send_error(id, ENOSYS, "unknown message type");
    switch (type) {
    case T_HELLO: return do_hello(id, &r);
    case T_LIST: return do_list(id);
    case T_SPAWN: return do_spawn(id, &r);
    case T_RESUME: return do_resume(id, &r);
    case T_ACK: return do_ack(&r);
    case T_STDIN: return do_stdin(&r);
    case T_STDIN_CLOSE: return do_stdin_close(id, &r);
    case T_SIGNAL: return do_signal(id, &r);
    case T_RESIZE: return do_resize(id, &r);
    case T_FORGET: return do_forget(id, &r);
    case T_READ: return do_read(id, &r);
    case T_READ_ACK: return do_read_ack(id, &r);
    case T_WRITE: return do_write(id, &r);
    case T_WRITE_DATA: return do_write_data(id, &r);
    case T_WRITE_END: return do_write_end(id);
    case T_REMOVE: return do_remove(id, &r);
    case T_LIST_DIR: return do_list_dir(id, &r);
    case T_STAT: return do_stat(id, &r);
    case T_CANCEL: return do_cancel(id);
    case T_TCP_OPEN: return do_tcp_open(id, &r);
    case T_TCP_SEND: return do_tcp_send(id, &r);
    case T_TCP_ACK: return do_tcp_ack(id, &r);
    case T_TCP_SHUT_WR: return do_tcp_shut_wr(id);
    case T_TCP_CLOSE: return do_tcp_close(id);
    case T_QUIESCE: return do_quiesce(id, &r);
    default: return send_error(id, ENOSYS, "unknown message type");
    }
}

/* ---- connection lifecycle ------------------------------------------------------------------- */

/* Everything tied to one host connection goes, TCP tunnels included (their sockets are closed);
 * processes and their unacked output stay. */
static void conn_drop(const char *why)
{
    if (conn_fd < 0)
        return;
    logmsg("host connection closed: %s", why);
    quiescing = 0;
    close_fd(&conn_fd);
    hello_done = 0;
    buf_free(&rbuf);
    buf_free(&obuf);
    while (fops)
        fop_free(fops);
    while (tuns)
        tun_free(tuns);
    for (struct proc *p = procs; p; p = p->next) {
        p->subscribed = 0;
        p->exit_sent = 0;
        for (int s = 0; s < 2; s++)
            p->out[s].sent = p->out[s].acked;
    }
    if (fd_mode && getpid() != 1) {
        /* A test or a one-shot stream: nobody can reconnect, so stop. */
        logmsg("channel closed; exiting");
        exit(0);
    }
}

static void conn_accept(void)
{
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0)
        return;
    /* The newest connection wins: that is how a restarted sandboxd takes over. */
    conn_drop("replaced by a new connection");
    conn_fd = fd;
    for (struct proc *p = procs; p; p = p->next)
        p->in_acked = p->in_written; /* the new host learns stdin offsets from LIST */
}

static void conn_read(void)
{
    buf_reserve(&rbuf, 256 * 1024);
    ssize_t n = read(conn_fd, rbuf.p + rbuf.head + rbuf.len, rbuf.cap - rbuf.head - rbuf.len);
    if (n == 0)
        return conn_drop("end of stream");
    if (n < 0) {
        if (errno != EAGAIN && errno != EINTR)
            conn_drop(strerror(errno));
        return;
    }
    rbuf.len += (size_t)n;
    while (conn_fd >= 0 && rbuf.len >= HDR_LEN) {
        const uint8_t *h = rbuf.p + rbuf.head;
        uint32_t id = (uint32_t)h[1] << 24 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 8 | h[4];
        uint32_t len = (uint32_t)h[5] << 24 | (uint32_t)h[6] << 16 | (uint32_t)h[7] << 8 | h[8];
        if (len > MAX_PAYLOAD)
            return conn_drop("frame over the maximum size (protocol error)");
        if (rbuf.len < HDR_LEN + len)
            break;
        dispatch(h[0], id, h + HDR_LEN, len);
        if (conn_fd >= 0)
            buf_consume(&rbuf, HDR_LEN + len);
    }
    if (conn_fd >= 0)
        buf_trim(&rbuf);
    if (obuf.len > OUT_HARD_MAX)
        conn_drop("host does not read its replies");
}

static void conn_flush(void)
{
    while (conn_fd >= 0 && obuf.len) {
        ssize_t n = write(conn_fd, obuf.p + obuf.head, obuf.len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN)
                conn_drop(strerror(errno));
            return;
        }
        buf_consume(&obuf, (size_t)n);
    }
    buf_trim(&obuf);
}

/* ---- pumping data --------------------------------------------------------------------------- */

/* Pull process output into its ring, never past the window: beyond it the process blocks. */
static void read_stream(struct proc *p, int s)
{
    struct stream *st = &p->out[s];
    while (st->fd >= 0) {
        if (st->ring.len >= OUT_WINDOW)
            return;
        uint8_t *where;
        size_t room = ring_space(&st->ring, &where);
        if (room > OUT_WINDOW - st->ring.len)
            room = OUT_WINDOW - st->ring.len;
        if (room == 0)
            return;
        ssize_t n = read(st->fd, where, room);
        if (n > 0) {
            st->ring.len += (size_t)n;
            st->produced += (uint64_t)n;
            if (!p->draining)
                return; /* one read per wakeup keeps processes fair */
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN && !p->draining)
            return;
        /* EOF, EIO (a terminal whose last holder exited), or nothing left after exit. Closing
         * the last master of a terminal hangs it up, which sends SIGHUP to a process that closed
         * its terminal and is about to exit: hold the master until the process has exited. */
        if (p->tty && p->running && p->tty_hold < 0) {
            p->tty_hold = st->fd;
            st->fd = -1;
        }
        close_fd(&st->fd);
    }
}

static void write_stdin(struct proc *p)
{
    while (p->in_fd >= 0 && p->in.len) {
        ssize_t n = write(p->in_fd, p->in.p + p->in.head, p->in.len);
        if (n > 0) {
            buf_consume(&p->in, (size_t)n);
            p->in_written += (uint64_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return;
        stdin_discard(p); /* EPIPE: the reader is gone */
    }
    buf_trim(&p->in);
    if (p->in_close && p->in.len == 0 && p->in_fd >= 0) {
        /* A terminal has no end of input of its own; its line discipline turns ^D into one.
         * The ^D is not one of the host's bytes, so it is not counted in the stdin offsets. */
        if (p->tty && write(p->in_fd, "\x04", 1) < 0 && errno == EAGAIN)
            return;
        close_fd(&p->in_fd);
    }
}

static void pump_procs(void)
{
    int progress = 1;
    /* Round-robin one chunk per stream so one chatty process cannot starve the others. */
    while (progress && room()) {
        progress = 0;
        for (struct proc *p = procs; p && room(); p = p->next) {
            if (!p->subscribed)
                continue;
            for (int s = 0; s < 2; s++) {
                struct stream *st = &p->out[s];
                const uint8_t *d;
                size_t n = ring_peek(&st->ring, (size_t)(st->sent - st->acked), &d);
                if (n == 0)
                    continue;
                if (n > CHUNK)
                    n = CHUNK;
                size_t f = frame_begin(T_OUTPUT, 0);
                put_u32(p->handle);
                put_u8((uint8_t)s);
                put_u64(st->sent);
                buf_append(&obuf, d, n);
                frame_end(f);
                st->sent += n;
                progress = 1;
            }
        }
    }
    for (struct proc *p = procs; p; p = p->next) {
        if (p->in_acked != p->in_written) {
            size_t f = frame_begin(T_STDIN_ACK, 0);
            put_u32(p->handle);
            put_u64(p->in_written);
            frame_end(f);
            p->in_acked = p->in_written;
        }
        /* EXITED goes last, after every byte of output, so the host can close its record. */
        if (p->subscribed && !p->running && !p->exit_sent && p->out[0].fd < 0 && p->out[1].fd < 0 &&
            p->out[0].sent == p->out[0].produced && p->out[1].sent == p->out[1].produced) {
            size_t f = frame_begin(T_EXITED, 0);
            put_u32(p->handle);
            put_u32((uint32_t)p->exit_code);
            frame_end(f);
            p->exit_sent = 1;
        }
    }
}

/* One batch of directory entries per call to keep frames small; loops while the channel has room. */
static void pump_listdir(struct fop *o)
{
    while (room()) {
        int ce = as_user(o->uid, o->gid);
        if (ce) {
            send_error(o->id, ce, NULL);
            fop_free(o);
            return;
        }
        size_t f = frame_begin(T_DIR_ENTRIES, o->id);
        size_t count_pos = obuf.len;
        put_u32(0);
        uint32_t count = 0;
        struct dirent *de = NULL;
        int dfd = dirfd(o->dir);
        while (count < DIR_BATCH && (errno = 0, de = readdir(o->dir)) != NULL) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
                continue;
            struct stat st;
            /* Follow links (a link to a directory lists as a directory); a dangling link is
             * listed as what it is. */
            if (fstatat(dfd, de->d_name, &st, 0) < 0 &&
                fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
                continue; /* vanished meanwhile */
            put_str(de->d_name);
            put_u8((uint8_t)(S_ISDIR(st.st_mode) ? FT_DIR : FT_FILE));
            put_u64(S_ISREG(st.st_mode) ? (uint64_t)st.st_size : 0);
            count++;
        }
        int e = errno;
        as_root();
        uint8_t *c = obuf.p + obuf.head + count_pos;
        c[0] = (uint8_t)(count >> 24);
        c[1] = (uint8_t)(count >> 16);
        c[2] = (uint8_t)(count >> 8);
        c[3] = (uint8_t)count;
        if (count)
            frame_end(f);
        else
            obuf.len = f;
        if (!de) {
            if (e)
                send_error(o->id, e, NULL);
            else
                frame_end(frame_begin(T_END, o->id));
            fop_free(o);
            return;
        }
    }
}

static void pump_files(void)
{
    struct fop *next;
    for (struct fop *o = fops; o && room(); o = next) {
        next = o->next;
        if (o->kind == OP_READ) {
            while (room() && o->sent - o->acked < READ_WINDOW) {
                size_t f = frame_begin(T_DATA, o->id);
                buf_reserve(&obuf, CHUNK);
                ssize_t n = read(o->fd, obuf.p + obuf.head + obuf.len, CHUNK);
                if (n < 0 && errno == EINTR) {
                    obuf.len = f;
                    continue;
                }
                if (n <= 0) {
                    obuf.len = f; /* discard the unfinished DATA header */
                    if (n < 0)
                        send_error(o->id, errno, NULL);
                    else
                        frame_end(frame_begin(T_END, o->id));
                    fop_free(o);
                    break;
                }
                obuf.len += (size_t)n;
                frame_end(f);
                o->sent += (uint64_t)n;
            }
        } else if (o->kind == OP_LISTDIR) {
            pump_listdir(o);
        }
    }
}

/* Whether pump_files() has work that no descriptor will wake us for. */
static int files_ready(void)
{
    if (!connected() || !room())
        return 0;
    for (struct fop *o = fops; o; o = o->next)
        if (o->kind == OP_LISTDIR || (o->kind == OP_READ && o->sent - o->acked < READ_WINDOW))
            return 1;
    return 0;
}

/* ---- setup and main loop -------------------------------------------------------------------- */

static int listen_on(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        logmsg("socket path too long");
        return -1;
    }
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    unlink(path); /* a stale socket from a previous agent */
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 8) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    /* Best effort: gVisor refuses chmod on a host-backed socket (EPERM); there the host's control
     * directory (mode 0700) is what keeps other users out. */
    (void)chmod(path, 0600);
    return fd;
}

#if defined(__x86_64__)
#define NATIVE_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define NATIVE_AUDIT_ARCH AUDIT_ARCH_AARCH64
#endif

/* --no-xattr: every extended-attribute call of the agent and of everything it runs answers EOPNOTSUPP,
 * as on a file system without xattr support. gVisor's gofer answers getxattr with EBADF on symlinks and
 * with EACCES on files the caller cannot read, which makes `ls -l` print an error line per symlink; with
 * EOPNOTSUPP programs (ls, cp -a, tar, rsync) carry on silently. Needs no_new_privs (set here), which
 * also stops setuid binaries from gaining privileges: nothing in a sandbox should. */
static int deny_xattrs(void)
{
#ifdef NATIVE_AUDIT_ARCH
#define DENY(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), \
                 BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EOPNOTSUPP & SECCOMP_RET_DATA))
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_AUDIT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        DENY(SYS_getxattr), DENY(SYS_lgetxattr), DENY(SYS_fgetxattr),
        DENY(SYS_setxattr), DENY(SYS_lsetxattr), DENY(SYS_fsetxattr),
        DENY(SYS_listxattr), DENY(SYS_llistxattr), DENY(SYS_flistxattr),
        DENY(SYS_removexattr), DENY(SYS_lremovexattr), DENY(SYS_fremovexattr),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
#undef DENY
    struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
#else
    errno = ENOSYS;
    return -1;
#endif
}

static void usage(void)
{
    fputs("usage: sbx-agent [--no-xattr] --listen SOCKET_PATH [--tunnel-listen SOCKET_PATH] | --fd N\n"
          "Runs processes for the sandbox host over one channel; see docs/agent-protocol.md.\n",
          stderr);
    exit(2);
}

int main(int argc, char **argv)
{
    int fd_arg = -1;
    int no_xattr = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-xattr"))
            no_xattr = 1;
        else if (!strcmp(argv[i], "--listen") && i + 1 < argc)
            listen_path = argv[++i];
        else if (!strcmp(argv[i], "--tunnel-listen") && i + 1 < argc)
            tun_listen_path = argv[++i];
        else if (!strcmp(argv[i], "--fd") && i + 1 < argc)
            fd_arg = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--version")) {
            printf("sbx-agent protocol %u\n", PROTO_VERSION);
            return 0;
        } else
            usage();
    }
    if (!!listen_path == (fd_arg >= 0) || (tun_listen_path && !listen_path))
        usage();
    if (no_xattr && deny_xattrs() < 0) {
        logmsg("cannot install the xattr filter: %s", strerror(errno));
        return 1;
    }

    signal(SIGPIPE, SIG_IGN); /* a vanished host or reader must show up as EPIPE, not kill init */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    sig_fd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sig_fd < 0) {
        logmsg("signalfd: %s", strerror(errno));
        return 1;
    }
    if (getpid() != 1)
        prctl(PR_SET_CHILD_SUBREAPER, 1); /* outside a sandbox, still reap our orphans */
    umask(022); /* also the children's: they inherit it */
    agent_uid = getuid();
    agent_gid = getgid();
    /* Children get 0..2 by dup2; if one of those is our own free slot, dup2 onto itself would
     * keep CLOEXEC, so make sure 0..2 are taken. */
    for (int fd = 0; fd < 3; fd++) {
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0) {
            int pp[2];
            if (pipe(pp) < 0)
                break;
        }
    }

    if (listen_path) {
        /* The tunnel socket first: once the main one accepts, a host may use both. */
        if (tun_listen_path && (tun_listen_fd = listen_on(tun_listen_path)) < 0) {
            logmsg("cannot listen on the tunnel socket: %s", strerror(errno));
            return 1;
        }
        listen_fd = listen_on(listen_path);
        if (listen_fd < 0) {
            logmsg("cannot listen on the socket: %s", strerror(errno));
            return 1;
        }
    } else {
        fd_mode = 1;
        conn_fd = fd_arg;
        fcntl(conn_fd, F_SETFD, FD_CLOEXEC);
        set_nonblock(conn_fd);
    }
    logmsg("ready (protocol %u, pid %d)", PROTO_VERSION, (int)getpid());

    struct pollfd *pfd = NULL;
    size_t pfd_cap = 0;
    for (;;) {
        size_t need = 4 + 3 * (size_t)nprocs + ntuns + 2 * (size_t)nrtuns;
        if (need > pfd_cap) {
            pfd_cap = need * 2;
            pfd = xrealloc(pfd, pfd_cap * sizeof *pfd);
        }
        size_t n = 0;
        pfd[n++] = (struct pollfd){.fd = sig_fd, .events = POLLIN};
        pfd[n++] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
        short ce = (short)((room() ? POLLIN : 0) | (obuf.len ? POLLOUT : 0));
        pfd[n++] = (struct pollfd){.fd = conn_fd, .events = ce};
        for (struct proc *p = procs; p; p = p->next) {
            for (int s = 0; s < 2; s++) {
                int want = p->out[s].fd >= 0 && p->out[s].ring.len < OUT_WINDOW;
                pfd[n++] = (struct pollfd){.fd = want ? p->out[s].fd : -1, .events = POLLIN};
            }
            int in_want = p->in.len || p->in_close;
            pfd[n++] = (struct pollfd){.fd = in_want ? p->in_fd : -1, .events = POLLOUT};
        }
        size_t tun_base = n;
        for (struct tun *t = tuns; t; t = t->next) {
            short ev = tun_poll_events(t);
            pfd[n++] = (struct pollfd){.fd = ev ? t->fd : -1, .events = ev};
        }
        size_t rtun_base = n;
        for (struct rtun *t = rtuns; t; t = t->next, n += 2)
            rtun_poll(t, &pfd[n], &pfd[n + 1]);
        size_t tun_listen_i = n;
        pfd[n++] = (struct pollfd){.fd = tun_listen_fd, .events = POLLIN};
        if (poll(pfd, n, files_ready() ? 0 : wake_path ? WAKE_POLL_MS : -1) < 0) {
            if (errno == EINTR)
                continue;
            logmsg("poll: %s", strerror(errno));
            sleep(1);
            continue;
        }
        /* Tunnels first, while their list is still the one pfd was built from (requests below may
         * open and close tunnels). */
        struct tun *tnext;
        size_t ti = tun_base;
        for (struct tun *t = tuns; t && ti < n; t = tnext, ti++) {
            tnext = t->next;
            if (pfd[ti].revents)
                tun_event(t, pfd[ti].revents);
        }
        /* Raw tunnels are independent of everything else; their list is still the one pfd was built from
         * (it changes only here and in QUIESCE, below). */
        struct rtun *rnext;
        size_t ri = rtun_base;
        for (struct rtun *t = rtuns; t && ri < tun_listen_i; t = rnext, ri += 2) {
            rnext = t->next;
            if (pfd[ri].revents || pfd[ri + 1].revents)
                rtun_event(t, pfd[ri].revents);
        }
        if (pfd[tun_listen_i].revents & POLLIN)
            rtun_accept();
        if (pfd[0].revents)
            reap();
        if (wake_path)
            check_wake();
        if (pfd[1].revents & POLLIN)
            conn_accept();
        else if (conn_fd >= 0 && pfd[2].fd == conn_fd) {
            if (pfd[2].revents & (POLLIN | POLLHUP | POLLERR))
                conn_read();
        }
        /* pfd entries follow the list as it was before dispatch; the list may have changed. */
        size_t i = 3;
        for (struct proc *p = procs; p; p = p->next) {
            for (int s = 0; s < 2; s++) {
                short ev = (i < n && pfd[i].fd == p->out[s].fd) ? pfd[i].revents : 0;
                if (ev || (p->draining && p->out[s].fd >= 0))
                    read_stream(p, s);
                i++;
            }
            if (p->in.len || p->in_close)
                write_stdin(p);
            if (!p->running && p->in_fd >= 0)
                stdin_discard(p);
            if (!p->running)
                close_fd(&p->tty_hold);
            i++;
        }
        if (connected() && !quiescing) {
            pump_tunnels();
            pump_procs();
            pump_files();
        }
        conn_flush();
        if (quiescing && (!obuf.len || conn_fd < 0)) {
            quiescing = 0;
            conn_drop("quiesced");
        }
        if (obuf.len > OUT_HARD_MAX)
            conn_drop("host does not read its replies");
    }
}
