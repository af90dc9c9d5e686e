/* fuse-floor: the simplest FUSE daemon doing qcowfs's host I/O, the floor every qcowfs figure is
 * measured against (bench.sh: "floor" over /dev/fuse, "floor-ring" over FUSE io_uring).
 *
 * It shows one raw image file as the mounted file: one thread, one io_uring, the image opened
 * O_DIRECT, every READ/WRITE a host read/write on that ring, the reply sent when it completes.
 * Requests are decoded and replies built by libfuse's low-level API (3.14), as in qcowfs.
 *   - /dev/fuse: the ring polls /dev/fuse; each wake-up reads up to 4 requests (qcowfs's kReadBatch)
 *     into 4 KiB-aligned-payload buffers, so a WRITE's data goes to the host without a copy.
 *   - --ring (FUSE over io_uring, Linux 6.14+, fuse.enable_uring=Y): the INIT reply claims
 *     FUSE_OVER_IO_URING (libfuse 3.14 does not know it), then ENTRIES entries per kernel queue
 *     (one queue per possible CPU) are registered with IORING_OP_URING_CMD on the same ring. A
 *     request is laid out as one /dev/fuse-format message ending where the entry's payload begins
 *     and handed to libfuse; its reply (libfuse's writev, rerouted by fuse_session_custom_io) goes
 *     back with COMMIT_AND_FETCH. READ data is read straight into the entry's payload, a WRITE's
 *     is written from there. As in qcowfs, an entry's payload starts on a 2 MiB boundary and
 *     moves to a huge page once the entry carries a READ or WRITE of 256 KiB or more.
 * Reads of at least 1 MiB use 2 MiB-aligned MADV_HUGEPAGE buffers (as qcowfs): one DMA segment.
 *   cc -O2 -o fuse-floor fuse-floor.c $(pkg-config --cflags --libs fuse3 liburing)
 *   fuse-floor [--ring] [--entries N] [--small-pages] [--spin NS] IMAGE MOUNTFILE
 * (foreground; unmount with fusermount3 -u). --entries: per kernel queue (64). --small-pages:
 * entries keep 4 KiB pages whatever they carry. --spin: NS nanoseconds of busy user-space work
 * (a clock_gettime loop, vDSO) before each READ/WRITE's host I/O, to see what a daemon's own
 * per-request CPU costs in throughput (bench/RESULTS.md, the 18:03 section of 2026-12-06).
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 314
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <liburing.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1; glibc 2.36 does not name it */
#endif
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <time.h>
#include <unistd.h>

enum { K_POLL, K_READ, K_WRITE, K_ENTRY };
enum { PREFIX = 4096, MAX_IO = 1 << 20, HUGE = 2 << 20, READ_BATCH = 4 };
enum { POOL_NONE, POOL_HUGE, POOL_REQ };  /* where a buffer goes back to */

struct ctx { int kind; };
struct entry;
struct op { struct ctx c; fuse_req_t req; void *buf, *owned; int pool; struct entry *ent; };
struct entry {  /* a FUSE io_uring queue entry */
  struct ctx c; uint16_t qid; char *mem; struct iovec iov[2]; uint64_t unique; int busy, huge, huge_on_reply;
};
struct ring_cmd { uint64_t flags, commit_id; uint16_t qid; uint8_t pad[6]; };
struct ring_hdr { char in_out[128], op_in[128]; struct { uint64_t flags, commit_id; uint32_t payload_sz, pad; uint64_t r; } ent; };

static struct io_uring ring;
static struct fuse_session *se;
static int fuse_fd, img_fd, use_ring;
static off_t img_size;
static unsigned nentries = 64, huge_min = 256 << 10, small_pages;
static struct entry *entries, *dispatching, *replying;  /* the entry whose request is being handled */
static unsigned nent_total;
static char *cur;                 /* the /dev/fuse buffer the next request is read into */
static char *free_req[64], *free_huge[64];
static int nfree_req, nfree_huge;
static uint64_t init_unique;

static void *xalloc(size_t align, size_t n) {
  void *p = aligned_alloc(align, n);
  if (!p) { perror("aligned_alloc"); exit(1); }
  return p;
}
static char *huge_buffer(void) {
  char *p = xalloc(HUGE, HUGE);
  madvise(p, HUGE, MADV_HUGEPAGE);
  return p;
}
/* /dev/fuse request buffers hold up to 1 MiB of WRITE payload: on a huge page, as qcowfs's */
static char *take_req(void) { return nfree_req ? free_req[--nfree_req] : huge_buffer(); }
static char *take_huge(void) { return nfree_huge ? free_huge[--nfree_huge] : huge_buffer(); }
static void give(char *p, int pool) {
  if (pool == POOL_HUGE && nfree_huge < 64) free_huge[nfree_huge++] = p;
  else if (pool == POOL_REQ && nfree_req < 64) free_req[nfree_req++] = p;
  else free(p);
}
static struct io_uring_sqe *sqe_get(void) {
  struct io_uring_sqe *s = io_uring_get_sqe(&ring);
  if (!s) { io_uring_submit(&ring); s = io_uring_get_sqe(&ring); }
  return s;
}

/* ---- FUSE over io_uring ---- */
static void ring_submit(struct entry *e, uint32_t cmd_op, uint64_t commit_id) {
  struct io_uring_sqe *s = sqe_get();
  struct ring_cmd cmd = {.commit_id = commit_id, .qid = e->qid};
  void *raw = s;
  __asm__("" : "+r"(raw));      /* an SQE128: gcc cannot see that the command area follows */
  memset(raw, 0, 2 * sizeof *s);
  s->opcode = IORING_OP_URING_CMD;
  s->fd = fuse_fd;
  s->cmd_op = cmd_op;
  s->addr = (uintptr_t)e->iov;
  s->len = 2;
  memcpy((char *)raw + offsetof(struct io_uring_sqe, cmd), &cmd, sizeof cmd);
  io_uring_sqe_set_data(s, e);
}
static void ring_register(void) {
  unsigned queues = (unsigned)get_nprocs_conf();
  nent_total = queues * nentries;
  entries = calloc(nent_total, sizeof *entries);
  for (unsigned i = 0; i < nent_total; ++i) {
    struct entry *e = &entries[i];
    e->c.kind = K_ENTRY;
    e->qid = (uint16_t)(i / nentries);
    e->mem = (char *)xalloc(HUGE, 2 * HUGE) + HUGE - PREFIX;  /* the payload on a 2 MiB boundary */
    e->iov[0] = (struct iovec){e->mem, sizeof(struct ring_hdr)};
    e->iov[1] = (struct iovec){e->mem + PREFIX, MAX_IO + PREFIX};
    ring_submit(e, 1 /* FUSE_IO_URING_CMD_REGISTER */, 0);
  }
}
static void use_huge(struct entry *e) {  /* the old bytes are not needed: the next touch faults a huge page */
  e->huge = 1;
  e->huge_on_reply = 0;
  madvise(e->mem + PREFIX, HUGE, MADV_DONTNEED);
  madvise(e->mem + PREFIX, HUGE, MADV_HUGEPAGE);
}
static void ring_deliver(struct entry *e, int res) {
  if (res < 0) {
    if (res != -ENOTCONN && res != -ECANCELED) fprintf(stderr, "fuse-floor: ring entry: %s\n", strerror(-res));
    return;  /* the connection is going away, or the ring is refused: /dev/fuse keeps serving */
  }
  struct ring_hdr *h = (struct ring_hdr *)e->mem;
  struct fuse_in_header in;
  memcpy(&in, h->in_out, sizeof in);
  size_t op_bytes = in.len - sizeof in - h->ent.payload_sz;
  char *msg = e->mem + PREFIX - op_bytes - sizeof in;
  memcpy(msg, &in, sizeof in);
  memcpy(msg + sizeof in, h->op_in, op_bytes);
  e->huge_on_reply = 0;
  if (!small_pages && !e->huge) {  /* READ: before its host read; WRITE: once it has replied */
    if (in.opcode == FUSE_READ && ((struct fuse_read_in *)h->op_in)->size >= huge_min) use_huge(e);
    else if (in.opcode == FUSE_WRITE && h->ent.payload_sz >= huge_min) e->huge_on_reply = 1;
  }
  e->unique = in.unique;
  e->busy = 1;
  dispatching = replying = e;
  fuse_session_process_buf(se, &(struct fuse_buf){.mem = msg, .size = in.len});
  dispatching = replying = NULL;
}
/* libfuse's reply path: a reply to a ring request goes into its entry, all else to /dev/fuse. */
static ssize_t floor_writev(int fd, struct iovec *iov, int count, void *ud) {
  struct fuse_out_header out;
  memcpy(&out, iov[0].iov_base, sizeof out);
  struct entry *e = replying;
  if (!e || !e->busy || e->unique != out.unique) {
    if (use_ring && out.unique == init_unique && count == 2 && out.error == 0) {  /* claim the ring */
      struct fuse_init_out arg = {0};
      memcpy(&arg, iov[1].iov_base, iov[1].iov_len < sizeof arg ? iov[1].iov_len : sizeof arg);
      arg.flags |= FUSE_INIT_EXT;
      arg.flags2 |= 1u << 9;  /* FUSE_OVER_IO_URING */
      struct iovec v[2] = {iov[0], {&arg, iov[1].iov_len}};
      return writev(fd, v, 2);
    }
    return writev(fd, iov, count);
  }
  if (e->huge_on_reply) use_huge(e);
  char *dst = e->mem + PREFIX;
  size_t n = 0, total = 0;
  for (int i = 0; i < count; ++i) {
    char *src = iov[i].iov_base;
    size_t len = iov[i].iov_len;
    total += len;
    if (i == 0) { src += sizeof out; len -= sizeof out; }
    if (len && src != dst + n) memcpy(dst + n, src, len);
    n += len;
  }
  memcpy(((struct ring_hdr *)e->mem)->in_out, &out, sizeof out);
  ((struct ring_hdr *)e->mem)->ent.payload_sz = (uint32_t)n;
  e->busy = 0;
  ring_submit(e, 2 /* FUSE_IO_URING_CMD_COMMIT_AND_FETCH */, out.unique);
  return (ssize_t)total;
}
static ssize_t floor_read(int fd, void *buf, size_t len, void *ud) { return read(fd, buf, len); }

/* ---- the operations ---- */
static void floor_init(void *ud, struct fuse_conn_info *conn) {
  conn->max_write = MAX_IO;
  conn->max_background = 128;  /* as qcowfs: fio's QD32 async direct I/O is background requests */
  conn->congestion_threshold = 96;
  conn->want &= ~(unsigned)(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
  conn->want |= conn->capable & (FUSE_CAP_ASYNC_READ | FUSE_CAP_ASYNC_DIO);
}
static void floor_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
  struct stat st = {.st_ino = ino, .st_mode = S_IFREG | 0644, .st_nlink = 1, .st_size = img_size};
  fuse_reply_attr(req, &st, 1.0);
}
static void floor_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
  fi->direct_io = 1;
  fuse_reply_open(req, fi);
}
static void floor_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) { fuse_reply_err(req, 0); }
static void floor_fsync(fuse_req_t req, fuse_ino_t ino, int d, struct fuse_file_info *fi) {
  fuse_reply_err(req, fdatasync(img_fd) ? errno : 0);
}
static long spin_ns;  /* --spin */
static void spin(void) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do clock_gettime(CLOCK_MONOTONIC, &t);
  while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < spin_ns);
}
static void start_io(int kind, fuse_req_t req, void *buf, void *owned, int pool, size_t len, off_t off) {
  if (spin_ns > 0) spin();
  struct op *o = malloc(sizeof *o);
  *o = (struct op){{kind}, req, buf, owned, pool, dispatching};
  struct io_uring_sqe *s = sqe_get();
  if (kind == K_READ) io_uring_prep_read(s, img_fd, buf, (unsigned)len, (uint64_t)off);
  else io_uring_prep_write(s, img_fd, buf, (unsigned)len, (uint64_t)off);
  io_uring_sqe_set_data(s, o);
}
static void floor_read_op(fuse_req_t req, fuse_ino_t ino, size_t n, off_t off, struct fuse_file_info *fi) {
  if (off >= img_size) { fuse_reply_buf(req, NULL, 0); return; }
  if ((off_t)n > img_size - off) n = (size_t)(img_size - off);
  if (dispatching) { start_io(K_READ, req, dispatching->mem + PREFIX, NULL, POOL_NONE, n, off); return; }
  int huge = n >= MAX_IO;
  char *b = huge ? take_huge() : xalloc(PREFIX, (n + 4095) & ~4095ul);
  start_io(K_READ, req, b, b, huge ? POOL_HUGE : POOL_NONE, n, off);
}
static void floor_write_op(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t n, off_t off,
                           struct fuse_file_info *fi) {
  char *owned = NULL;
  if (!dispatching) { owned = cur; cur = NULL; }  /* the payload stays in its request buffer */
  start_io(K_WRITE, req, (void *)buf, owned, POOL_REQ, n, off);
}
static void io_done(struct op *o, int res) {
  replying = o->ent;
  if (res < 0) fuse_reply_err(o->req, -res);
  else if (o->c.kind == K_READ) fuse_reply_buf(o->req, o->buf, (size_t)res);
  else fuse_reply_write(o->req, (size_t)res);
  replying = NULL;
  if (o->owned) give(o->owned, o->pool);
  free(o);
}
static const struct fuse_lowlevel_ops ops = {
  .init = floor_init, .getattr = floor_getattr, .open = floor_open, .read = floor_read_op,
  .write = floor_write_op, .flush = floor_flush, .fsync = floor_fsync,
};

/* ---- the loop ---- */
static void arm_poll(void) {
  static struct ctx poll_ctx = {K_POLL};
  struct io_uring_sqe *s = sqe_get();
  io_uring_prep_poll_add(s, fuse_fd, POLLIN);
  io_uring_sqe_set_data(s, &poll_ctx);
}
/* Reads up to READ_BATCH requests from /dev/fuse; 0 once the filesystem is unmounted. */
static int drain(void) {
  for (int i = 0; i < READ_BATCH; ++i) {
    if (!cur) cur = take_req();
    /* the payload of a WRITE (after its 80 header bytes) starts 4096-aligned */
    char *start = cur + PREFIX - sizeof(struct fuse_in_header) - sizeof(struct fuse_write_in);
    ssize_t n = read(fuse_fd, start, HUGE - PREFIX);
    if (n < 0) {
      if (errno == EAGAIN) return 1;
      if (errno == EINTR || errno == ENOENT) continue;
      return 0;
    }
    struct fuse_in_header *in = (struct fuse_in_header *)start;
    int init = in->opcode == FUSE_INIT;
    if (init) init_unique = in->unique;
    fuse_session_process_buf(se, &(struct fuse_buf){.mem = start, .size = (size_t)n});
    if (init && use_ring) ring_register();
    init_unique = 0;
  }
  return 1;
}

int main(int argc, char **argv) {
  int a = 1;
  for (; a < argc && argv[a][0] == '-' && argv[a][1] == '-'; ++a) {
    if (!strcmp(argv[a], "--ring")) use_ring = 1;
    else if (!strcmp(argv[a], "--entries") && a + 1 < argc) nentries = (unsigned)atoi(argv[++a]);
    else if (!strcmp(argv[a], "--small-pages")) small_pages = 1;
    else if (!strcmp(argv[a], "--spin") && a + 1 < argc) spin_ns = atol(argv[++a]);
    else break;
  }
  if (argc - a != 2) {
    fprintf(stderr, "usage: fuse-floor [--ring] [--entries N] [--small-pages] [--spin NS] IMAGE MOUNTFILE\n");
    return 2;
  }
  img_fd = open(argv[a], O_RDWR | O_DIRECT | O_CLOEXEC);
  if (img_fd < 0) { perror(argv[a]); return 1; }
  img_size = lseek(img_fd, 0, SEEK_END);
  /* as qcowfs: single issuer, completions run when the loop enters the ring */
  struct io_uring_params p = {.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN};
  if (use_ring) p.flags |= IORING_SETUP_SQE128;
  int r = io_uring_queue_init_params(512, &ring, &p);
  if (r < 0) { fprintf(stderr, "io_uring_queue_init: %s\n", strerror(-r)); return 1; }

  char *fargv[] = {argv[0], "-o", "fsname=fuse-floor,default_permissions", NULL};
  struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
  se = fuse_session_new(&args, &ops, sizeof ops, NULL);
  if (!se || fuse_session_mount(se, argv[a + 1]) != 0) return 1;
  fuse_fd = fuse_session_fd(se);
  struct fuse_custom_io io = {.writev = floor_writev, .read = floor_read};
  if (fuse_session_custom_io(se, &io, fuse_fd) != 0) return 1;
  fcntl(fuse_fd, F_SETFL, fcntl(fuse_fd, F_GETFL) | O_NONBLOCK);

  arm_poll();
  for (int live = 1; live;) {
    io_uring_submit_and_wait(&ring, 1);
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&ring, head, cqe) {
      ++seen;
      struct ctx *c = io_uring_cqe_get_data(cqe);
      if (c->kind == K_POLL) {
        if (!drain()) live = 0;
        else arm_poll();
      } else if (c->kind == K_ENTRY) {
        ring_deliver((struct entry *)c, cqe->res);
      } else {
        io_done((struct op *)c, cqe->res);
      }
    }
    io_uring_cq_advance(&ring, seen);
  }
  io_uring_queue_exit(&ring);  /* the kernel stops copying into the entries */
  fuse_session_unmount(se);
  fuse_session_destroy(se);
  return 0;
}
