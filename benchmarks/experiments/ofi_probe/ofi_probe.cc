// Standalone libfabric (OFI) FI_EP_RDM prototype: info, tagged ping-pong, RMA write, dead-peer test.
// Build: g++ -std=c++17 -O2 -Wall -o ofi_probe ofi_probe.cc $(pkg-config --cflags --libs libfabric)
// Usage: ./ofi_probe [--prov NAME] [--np N] [--test info|perf|kill-recv|kill-send|kill-write]
//                [--progress auto|manual] [--maxsize BYTES] [--iface-node 127.0.0.1]
//   provider also taken from FI_PROVIDER if --prov not given.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#define CHK(x)                                                                                     \
  do {                                                                                             \
    int _r = (int)(x);                                                                             \
    if (_r) {                                                                                      \
      fprintf(stderr, "[r%d] %s:%d %s -> %d (%s)\n", g_rank, __FILE__, __LINE__, #x, _r,           \
              fi_strerror(-_r));                                                                   \
      _exit(2);                                                                                    \
    }                                                                                              \
  } while (0)

static int g_rank = -1, g_np = 2;
static std::string g_dir, g_prov, g_test = "perf", g_progress, g_node;
static size_t g_maxsize = 64ull << 20;
static double g_killwait = 20.0;

static double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// ---------------- file helpers (out-of-band exchange / barrier) ----------------
static void write_file(const std::string& name, const void* data, size_t len) {
  std::string tmp = g_dir + "/." + name + ".tmp", fin = g_dir + "/" + name;
  FILE* f = fopen(tmp.c_str(), "wb");
  fwrite(data, 1, len, f);
  fclose(f);
  rename(tmp.c_str(), fin.c_str());
}
static bool read_file(const std::string& name, std::vector<char>& out) {
  FILE* f = fopen((g_dir + "/" + name).c_str(), "rb");
  if (!f) return false;
  out.clear();
  char b[4096];
  size_t n;
  while ((n = fread(b, 1, sizeof b, f)) > 0) out.insert(out.end(), b, b + n);
  fclose(f);
  return true;
}

// ---------------- fabric state ----------------
struct Ctx {
  fi_context2 fctx;  // must be first: provider may use it (FI_CONTEXT/FI_CONTEXT2 mode)
  volatile int done = 0;
  int err = 0, prov_errno = 0;
  std::string errstr;
  size_t len = 0;
};

static fi_info* fi;
static fid_fabric* fabric;
static fid_domain* domain;
static fid_ep* ep;
static fid_cq* cq;
static fid_av* av;
static fid_mr* mr;
static void* mr_desc = nullptr;
static char* buf;       // [0, 2*maxsize): send half, recv half
static size_t buflen;
static std::vector<fi_addr_t> peers;
static size_t g_chunk;  // min(max_msg_size, ...)

static int progress() {
  fi_cq_tagged_entry e[16];
  ssize_t n = fi_cq_read(cq, e, 16);
  if (n > 0) {
    for (ssize_t i = 0; i < n; i++) {
      Ctx* c = (Ctx*)e[i].op_context;
      if (c) { c->len = e[i].len; c->done = 1; }
    }
    return (int)n;
  }
  if (n == -FI_EAVAIL) {
    fi_cq_err_entry ee;
    memset(&ee, 0, sizeof ee);
    ssize_t r = fi_cq_readerr(cq, &ee, 0);
    if (r == 1) {
      Ctx* c = (Ctx*)ee.op_context;
      const char* ps = fi_cq_strerror(cq, ee.prov_errno, ee.err_data, nullptr, 0);
      fprintf(stderr, "[r%d] CQ error: err=%d (%s) prov_errno=%d (%s) ctx=%p\n", g_rank, ee.err,
              fi_strerror(ee.err), ee.prov_errno, ps ? ps : "", ee.op_context);
      if (c) { c->err = ee.err; c->prov_errno = ee.prov_errno; c->errstr = ps ? ps : ""; c->done = -1; }
    }
    return 1;
  }
  if (n != -FI_EAGAIN) fprintf(stderr, "[r%d] fi_cq_read -> %zd %s\n", g_rank, n, fi_strerror(-n));
  return 0;
}

// returns 1 ok, -1 error completion, 0 timeout
static int wait_ctx(Ctx& c, double timeout_s) {
  double t0 = now_s();
  while (!c.done) {
    progress();
    if (now_s() - t0 > timeout_s) return 0;
  }
  return c.done;
}

static void barrier(const std::string& tag) {
  char one = 1;
  write_file("bar." + tag + "." + std::to_string(g_rank), &one, 1);
  std::vector<char> d;
  double t0 = now_s();
  for (int r = 0; r < g_np; r++) {
    while (!read_file("bar." + tag + "." + std::to_string(r), d)) {
      progress();  // keep manual-progress providers moving while we wait
      usleep(200);
      if (now_s() - t0 > 60) { fprintf(stderr, "[r%d] barrier %s timeout\n", g_rank, tag.c_str()); _exit(3); }
    }
  }
}

// post with -FI_EAGAIN retry (drive progress while queue is full)
static const ssize_t EAGAIN_STUCK = -100000;  // post kept returning -FI_EAGAIN for the whole timeout
static const char* perr(ssize_t r) { return r == EAGAIN_STUCK ? "-FI_EAGAIN persisted (post never accepted)" : fi_strerror(-r); }
template <class F>
static ssize_t post_retry(F f, double timeout_s = 30) {
  double t0 = now_s();
  for (;;) {
    ssize_t r = f();
    if (r != -FI_EAGAIN) return r;
    progress();
    if (now_s() - t0 > timeout_s) return EAGAIN_STUCK;
  }
}

// message of len bytes split into chunks of g_chunk; ctxs must be sized
static ssize_t tsend(const char* p, size_t len, int peer, uint64_t tag, std::vector<Ctx>& cs) {
  size_t n = std::max<size_t>(1, (len + g_chunk - 1) / g_chunk);
  cs.assign(n, Ctx());
  for (size_t i = 0; i < n; i++) {
    size_t off = i * g_chunk, l = std::min(g_chunk, len - off);
    ssize_t r = post_retry([&] { return fi_tsend(ep, p + off, l, mr_desc, peers[peer], tag, &cs[i]); });
    if (r) return r;
  }
  return 0;
}
static ssize_t trecv(char* p, size_t len, int peer, uint64_t tag, std::vector<Ctx>& cs) {
  size_t n = std::max<size_t>(1, (len + g_chunk - 1) / g_chunk);
  cs.assign(n, Ctx());
  for (size_t i = 0; i < n; i++) {
    size_t off = i * g_chunk, l = std::min(g_chunk, len - off);
    ssize_t r = post_retry([&] { return fi_trecv(ep, p + off, l, mr_desc, peers[peer], tag, 0, &cs[i]); });
    if (r) return r;
  }
  return 0;
}
static int wait_all(std::vector<Ctx>& cs, double timeout_s) {
  for (auto& c : cs) {
    int r = wait_ctx(c, timeout_s);
    if (r != 1) return r;
  }
  return 1;
}

static std::string tostr(const void* v, fi_type t) { return fi_tostr(v, t); }

static void print_info(const fi_info* i) {
  uint64_t caps = i->caps;
  printf("provider      : %s (fabric=%s domain=%s)\n", i->fabric_attr->prov_name, i->fabric_attr->name,
         i->domain_attr->name);
  printf("caps          : tagged=%d rma=%d msg=%d atomic=%d directed_recv=%d rma_event=%d source=%d\n",
         !!(caps & FI_TAGGED), !!(caps & FI_RMA), !!(caps & FI_MSG), !!(caps & FI_ATOMIC),
         !!(caps & FI_DIRECTED_RECV), !!(caps & FI_RMA_EVENT), !!(caps & FI_SOURCE));
  printf("caps (full)   : %s\n", tostr(&caps, FI_TYPE_CAPS).c_str());
  printf("mode          : %s\n", tostr(&i->mode, FI_TYPE_MODE).c_str());
  int mm = i->domain_attr->mr_mode;
  printf("mr_mode       : 0x%x [%s]\n", mm, tostr(&mm, FI_TYPE_MR_MODE).c_str());
  printf("mr_key_size   : %zu\n", i->domain_attr->mr_key_size);
  printf("addr_format   : %s\n", tostr(&i->addr_format, FI_TYPE_ADDR_FORMAT).c_str());
  printf("inject_size   : %zu\n", i->tx_attr->inject_size);
  printf("max_msg_size  : %zu\n", i->ep_attr->max_msg_size);
  printf("tx/rx ctx cnt : ep tx=%zu rx=%zu ; domain max tx=%zu rx=%zu ; ep_cnt=%zu\n",
         i->ep_attr->tx_ctx_cnt, i->ep_attr->rx_ctx_cnt, i->domain_attr->tx_ctx_cnt,
         i->domain_attr->rx_ctx_cnt, i->domain_attr->ep_cnt);
  printf("tx/rx size    : tx=%zu rx=%zu ; cq_cnt=%zu cq_data_size=%zu\n", i->tx_attr->size,
         i->rx_attr->size, i->domain_attr->cq_cnt, i->domain_attr->cq_data_size);
  printf("progress      : data=%s control=%s\n", tostr(&i->domain_attr->data_progress, FI_TYPE_PROGRESS).c_str(),
         tostr(&i->domain_attr->control_progress, FI_TYPE_PROGRESS).c_str());
  printf("threading     : %s\n", tostr(&i->domain_attr->threading, FI_TYPE_THREADING).c_str());
  printf("msg_order     : tx=%s\n", tostr(&i->tx_attr->msg_order, FI_TYPE_MSG_ORDER).c_str());
  printf("resource_mgmt : %d  av_type=%d\n", i->domain_attr->resource_mgmt, i->domain_attr->av_type);
  fflush(stdout);
}

static fi_info* get_info(bool want_rma) {
  fi_info* hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_TAGGED | (want_rma ? (FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE) : 0);
  hints->mode = FI_CONTEXT | FI_CONTEXT2;  // we pass fi_context2 with every op
  // mr_mode bits this app can honour; provider returns the subset it actually requires
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  if (getenv("PROTO_MRMODE")) hints->domain_attr->mr_mode = (int)strtol(getenv("PROTO_MRMODE"), nullptr, 0);
  if (getenv("PROTO_MODE")) hints->mode = strtoull(getenv("PROTO_MODE"), nullptr, 0);
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  if (g_progress == "auto") hints->domain_attr->data_progress = hints->domain_attr->control_progress = FI_PROGRESS_AUTO;
  if (g_progress == "manual") hints->domain_attr->data_progress = hints->domain_attr->control_progress = FI_PROGRESS_MANUAL;
  hints->fabric_attr->prov_name = g_prov.empty() ? nullptr : strdup(g_prov.c_str());
  fi_info* res = nullptr;
  const char* node = g_node.empty() ? nullptr : g_node.c_str();
  int r = fi_getinfo(FI_VERSION(1, 17), node, nullptr, node ? FI_SOURCE : 0, hints, &res);
  fi_freeinfo(hints);
  if (r) {
    if (g_rank <= 0) fprintf(stderr, "fi_getinfo(rma=%d) -> %d %s\n", want_rma, r, fi_strerror(-r));
    return nullptr;
  }
  // prefer loopback domain for socket providers
  fi_info* pick = res;
  for (fi_info* p = res; p; p = p->next)
    if (p->domain_attr->name && !strcmp(p->domain_attr->name, "lo")) { pick = p; break; }
  fi_info* dup = fi_dupinfo(pick);
  fi_freeinfo(res);
  return dup;
}

static void setup() {
  fi = get_info(true);
  if (!fi) fi = get_info(false);
  if (!fi) _exit(4);
  if (g_rank == 0) print_info(fi);
  g_chunk = std::min<size_t>(fi->ep_attr->max_msg_size, 1ull << 40);
  CHK(fi_fabric(fi->fabric_attr, &fabric, nullptr));
  CHK(fi_domain(fabric, fi, &domain, nullptr));
  fi_cq_attr cqa{};
  cqa.format = FI_CQ_FORMAT_TAGGED;
  cqa.wait_obj = FI_WAIT_NONE;  // busy polling
  cqa.size = 0;
  CHK(fi_cq_open(domain, &cqa, &cq, nullptr));
  fi_av_attr ava{};
  ava.type = FI_AV_TABLE;
  CHK(fi_av_open(domain, &ava, &av, nullptr));
  CHK(fi_endpoint(domain, fi, &ep, nullptr));
  CHK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
  CHK(fi_ep_bind(ep, &av->fid, 0));
  CHK(fi_enable(ep));

  // buffer + MR (always register: needed for FI_MR_LOCAL and for RMA target)
  buflen = 2 * g_maxsize;
  buf = (char*)aligned_alloc(4096, buflen);
  memset(buf, g_rank, buflen);
  uint64_t acc = FI_SEND | FI_RECV;
  if (fi->caps & FI_RMA) acc |= FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
  uint64_t req_key = (fi->domain_attr->mr_mode & FI_MR_PROV_KEY) ? 0 : 0x1000 + g_rank;
  CHK(fi_mr_reg(domain, buf, buflen, acc, 0, req_key, 0, &mr, nullptr));
  if (fi->domain_attr->mr_mode & FI_MR_ENDPOINT) {
    CHK(fi_mr_bind(mr, &ep->fid, 0));
    CHK(fi_mr_enable(mr));
  }
  mr_desc = fi_mr_desc(mr);

  // address exchange via files
  char name[256];
  size_t nlen = sizeof name;
  CHK(fi_getname(&ep->fid, name, &nlen));
  write_file("addr." + std::to_string(g_rank), name, nlen);
  peers.assign(g_np, FI_ADDR_UNSPEC);
  std::vector<char> d;
  for (int r = 0; r < g_np; r++) {
    double t0 = now_s();
    while (!read_file("addr." + std::to_string(r), d)) {
      usleep(1000);
      if (now_s() - t0 > 30) { fprintf(stderr, "addr timeout\n"); _exit(3); }
    }
    int n = fi_av_insert(av, d.data(), 1, &peers[r], 0, nullptr);
    if (n != 1) { fprintf(stderr, "[r%d] fi_av_insert -> %d\n", g_rank, n); _exit(2); }
  }
  if (g_rank == 0) {
    char s[256];
    size_t sl = sizeof s;
    fi_av_straddr(av, name, s, &sl);
    printf("ep name       : %zu bytes, straddr=%s\n", nlen, s);
    fflush(stdout);
  }
}

// ---------------- tests ----------------
static void ring_test() {  // every rank: 4 KiB to (r+1), from (r-1)
  size_t len = 4096;
  std::vector<Ctx> rc, sc;
  int to = (g_rank + 1) % g_np, from = (g_rank + g_np - 1) % g_np;
  CHK(trecv(buf + g_maxsize, len, from, 77, rc));
  memset(buf, 0x40 + g_rank, len);
  CHK(tsend(buf, len, to, 77, sc));
  int a = wait_all(sc, 20), b = wait_all(rc, 20);
  bool ok = a == 1 && b == 1 && buf[g_maxsize] == (char)(0x40 + from) && buf[g_maxsize + len - 1] == (char)(0x40 + from);
  printf("[r%d] ring 4KiB from r%d: %s\n", g_rank, from, ok ? "OK" : "FAIL");
  fflush(stdout);
}

static long g_bad = 0;  // data-check mismatches (first/last byte carry an iteration stamp)
static int pp_iters(size_t sz, int n) {  // n ping-pong round trips between rank 0 and 1
  int peer = 1 - g_rank;
  for (int i = 0; i < n; i++) {
    std::vector<Ctx> rc, sc;
    buf[0] = buf[sz - 1] = (char)(i * 3 + g_rank);
    CHK(trecv(buf + g_maxsize, sz, peer, 1, rc));  // pre-post receive
    if (g_rank == 0) {
      CHK(tsend(buf, sz, peer, 1, sc));
      if (wait_all(sc, 30) != 1 || wait_all(rc, 30) != 1) return -1;
    } else {
      if (wait_all(rc, 30) != 1) return -1;
      CHK(tsend(buf, sz, peer, 1, sc));
      if (wait_all(sc, 30) != 1) return -1;
    }
    char want = (char)(i * 3 + peer);
    if (buf[g_maxsize] != want || buf[g_maxsize + sz - 1] != want) g_bad++;
  }
  return 0;
}

static void pingpong() {
  const size_t sizes[] = {4096, 64 << 10, 1 << 20, 64 << 20};
  int peer = 1 - g_rank;
  for (size_t sz : sizes) {
    if (sz > g_maxsize) continue;
    int iters = sz <= 4096 ? 5000 : sz <= (64 << 10) ? 1000 : sz <= (1 << 20) ? 200 : 20;
    int warm = std::max(2, iters / 20);
    double tw = now_s();
    if (pp_iters(sz, warm)) { fprintf(stderr, "[r%d] pingpong warmup fail\n", g_rank); _exit(5); }
    tw = now_s() - tw;
    // rank 0 picks the iteration count so one size takes <= ~4 s, tells rank 1
    uint64_t* n = (uint64_t*)(buf + 2 * g_maxsize - 8);
    std::vector<Ctx> fc;
    if (g_rank == 0) {
      *n = std::max<uint64_t>(3, std::min<uint64_t>(iters, (uint64_t)(4.0 / (tw / warm))));
      CHK(tsend((char*)n, 8, peer, 2, fc));
    } else {
      CHK(trecv((char*)n, 8, peer, 2, fc));
    }
    if (wait_all(fc, 30) != 1) _exit(5);
    int it = (int)*n;
    double t0 = now_s();
    if (pp_iters(sz, it)) { fprintf(stderr, "[r%d] pingpong fail\n", g_rank); _exit(5); }
    double dt = now_s() - t0;
    if (g_rank == 0)
      printf("tagged pingpong %9zu B: iters=%5d  half-RTT=%10.2f us  bw(one-way)=%8.3f GB/s  datacheck=%s\n", sz, it,
             dt / it / 2 * 1e6, sz * 2.0 * it / dt / 1e9, g_bad ? "FAIL" : "ok");
    fflush(stdout);
  }
}

static void rma_test() {
  if (!(fi->caps & FI_RMA)) {
    if (g_rank == 0) printf("RMA           : not offered, skipped\n");
    return;
  }
  // exchange key + addr of rank1's recv half through a tagged message
  struct { uint64_t addr, key; } mine, theirs;
  mine.key = fi_mr_key(mr);
  mine.addr = (fi->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(buf + g_maxsize) : g_maxsize;
  int peer = 1 - g_rank;
  char* kb = buf + 2 * g_maxsize - 64;
  memcpy(kb, &mine, sizeof mine);
  std::vector<Ctx> rc, sc;
  CHK(trecv(kb + 32, sizeof theirs, peer, 3, rc));
  CHK(tsend(kb, sizeof mine, peer, 3, sc));
  if (wait_all(sc, 20) != 1 || wait_all(rc, 20) != 1) { fprintf(stderr, "key xchg fail\n"); _exit(6); }
  memcpy(&theirs, kb + 32, sizeof theirs);
  size_t sz = g_maxsize;
  int iters = 10;
  if (g_rank == 0) {
    printf("RMA key=0x%llx remote addr=0x%llx (virt_addr=%d)\n", (unsigned long long)theirs.key,
           (unsigned long long)theirs.addr, !!(fi->domain_attr->mr_mode & FI_MR_VIRT_ADDR));
    memset(buf, 0x5a, sz);
    double t0 = 0;
    int done = 0;
    for (int i = 0; i < iters + 2; i++) {
      if (i == 2) t0 = now_s();
      size_t n = (sz + g_chunk - 1) / g_chunk;
      std::vector<Ctx> wc(n);
      for (size_t k = 0; k < n; k++) {
        size_t off = k * g_chunk, l = std::min(g_chunk, sz - off);
        ssize_t r = post_retry([&] { return fi_write(ep, buf + off, l, mr_desc, peers[peer], theirs.addr + off, theirs.key, &wc[k]); });
        CHK(r);
      }
      if (wait_all(wc, 30) != 1) { fprintf(stderr, "write fail/timeout\n"); _exit(6); }
      if (i >= 2) done++;
      if (i >= 2 && now_s() - t0 > 5) break;
    }
    double dt = now_s() - t0;
    printf("fi_write %zu B: iters=%d  %.2f ms/op  bw=%.3f GB/s (local completion)\n", sz, done, dt / done * 1e3,
           sz * (double)done / dt / 1e9);
    // notify target; target checks data
    std::vector<Ctx> fc;
    CHK(tsend(kb, 8, peer, 4, fc));
    wait_all(fc, 20);
    std::vector<Ctx> ac;
    CHK(trecv(kb + 16, 8, peer, 5, ac));
    wait_all(ac, 20);
    printf("RMA data check at target: %s\n", kb[16] == 1 ? "OK" : "FAIL");
  } else {
    std::vector<Ctx> fc;
    CHK(trecv(kb + 8, 8, peer, 4, fc));
    if (wait_all(fc, 120) != 1) { fprintf(stderr, "rma done-msg timeout\n"); _exit(6); }
    bool ok = buf[g_maxsize] == 0x5a && buf[g_maxsize + sz - 1] == 0x5a && buf[g_maxsize + sz / 2] == 0x5a;
    kb[0] = ok;
    std::vector<Ctx> ac;
    CHK(tsend(kb, 8, peer, 5, ac));
    wait_all(ac, 20);
  }
  fflush(stdout);
}

// Dead-peer test. Parent kills victim once the survivor wrote "started"; kill time (CLOCK_MONOTONIC) in file "killtime".
static double read_killtime() {
  std::vector<char> d;
  if (!read_file("killtime", d)) return 0;
  return atof(std::string(d.begin(), d.end()).c_str());
}
static void kill_test() {
  // roles: kill-recv: victim=1 (receiver), survivor=0 sends.  kill-send: victim=0 (sender), survivor=1 receives.
  //        kill-write: victim=1 (RMA target), survivor=0 writes.
  bool write = g_test == "kill-write";
  if (write && !(fi->caps & FI_RMA)) { if (g_rank == 0) printf("no RMA\n"); return; }
  int victim = g_test == "kill-send" ? 0 : 1;
  bool i_send = (g_test == "kill-send") ? g_rank == 0 : g_rank == 0;  // rank0 is always the data source
  int peer = 1 - g_rank;
  size_t sz = g_maxsize;
  struct { uint64_t addr, key; } mine, theirs{};
  if (write) {
    mine.key = fi_mr_key(mr);
    mine.addr = (fi->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(buf + g_maxsize) : g_maxsize;
    char* kb = buf + 2 * g_maxsize - 64;
    memcpy(kb, &mine, sizeof mine);
    std::vector<Ctx> rc, sc;
    CHK(trecv(kb + 32, 16, peer, 3, rc));
    CHK(tsend(kb, 16, peer, 3, sc));
    if (wait_all(sc, 20) != 1 || wait_all(rc, 20) != 1) _exit(6);
    memcpy(&theirs, kb + 32, 16);
  }
  double tkill = 0;
  int okops = 0;
  const double limit = g_killwait;  // seconds after kill we wait before declaring "hang"
  bool started_written = false;
  for (int it = 0;; it++) {
    std::vector<Ctx> cs;
    ssize_t pr;
    double tpost = now_s();
    if (i_send) {
      if (write) {
        size_t n = (sz + g_chunk - 1) / g_chunk;
        cs.assign(n, Ctx());
        pr = 0;
        for (size_t k = 0; k < n && !pr; k++) {
          size_t off = k * g_chunk, l = std::min(g_chunk, sz - off);
          pr = post_retry([&] { return fi_write(ep, buf + off, l, mr_desc, peers[peer], theirs.addr + off, theirs.key, &cs[k]); }, 25);
        }
      } else {
        pr = tsend(buf, sz, peer, 9, cs);
      }
    } else {
      pr = trecv(buf + g_maxsize, sz, peer, 9, cs);
    }
    if (g_rank == victim) {  // victim just loops until killed
      if (wait_all(cs, 60) != 1) _exit(7);
      continue;
    }
    if (!tkill) tkill = read_killtime();
    if (pr) {
      double t = now_s();
      if (!tkill) tkill = read_killtime();
      printf("[survivor r%d] post of op #%d failed: %zd (%s), %.3f s after kill\n", g_rank, it, pr,
             perr(pr), tkill ? t - tkill : -1.0);
      break;
    }
    // wait for completion, polling killtime
    int res = 0;
    Ctx* bad = nullptr;
    for (auto& c : cs) {
      for (;;) {
        progress();
        if (c.done) break;
        if (!tkill) tkill = read_killtime();
        if (tkill && now_s() - tkill > limit) break;
        if (!tkill && now_s() - tpost > 60) break;
      }
      if (c.done != 1) { res = c.done; bad = &c; break; }
      res = 1;
    }
    double t = now_s();
    if (!tkill) tkill = read_killtime();
    if (res == 1) {
      okops++;
      if (okops == 3 && !started_written) { char one = 1; write_file("started", &one, 1); started_written = true; }
      if (tkill) printf("[survivor r%d] op #%d completed OK %.3f s after kill\n", g_rank, it, t - tkill);
      if (tkill && t - tkill > limit) break;
      continue;
    }
    if (res == -1) {
      printf("[survivor r%d] op #%d ERROR completion: err=%d (%s) prov_errno=%d (%s), %.3f s after kill\n", g_rank, it,
             bad->err, fi_strerror(bad->err), bad->prov_errno, bad->errstr.c_str(), tkill ? t - tkill : -1.0);
    } else {
      printf("[survivor r%d] op #%d: NO completion %.1f s after kill (hang, bounded by timeout); okops=%d\n", g_rank, it,
             tkill ? t - tkill : -1.0, okops);
    }
    // (1) try fi_cancel on every still-pending piece of the op
    int pend = 0, canc_ret = 0;
    for (auto& c : cs)
      if (!c.done) { pend++; ssize_t cr = fi_cancel(&ep->fid, &c); if (cr) canc_ret = (int)cr; }
    double tc = now_s();
    while (now_s() - tc < 2.0) progress();
    int still = 0, cerr = 0, cok = 0;
    for (auto& c : cs) { if (!c.done) still++; else if (c.done == -1) cerr++; else cok++; }
    printf("[survivor r%d] fi_cancel on %d pending ctx (last ret=%d %s): after 2 s -> %d still pending, %d error-completed (last err=%d %s), %d ok\n",
           g_rank, pend, canc_ret, canc_ret ? fi_strerror(-canc_ret) : "ok", still, cerr, cs.back().err, fi_strerror(cs.back().err), cok);
    // (2) follow-up small op toward the dead peer: is the failure sticky / detected?
    std::vector<Ctx> c2(1);
    double t2 = now_s();
    ssize_t p2 = i_send ? (write ? post_retry([&] { return fi_write(ep, buf, 4096, mr_desc, peers[peer], theirs.addr, theirs.key, &c2[0]); }, 5)
                                 : post_retry([&] { return fi_tsend(ep, buf, 4096, mr_desc, peers[peer], 10, &c2[0]); }, 5))
                        : post_retry([&] { return fi_trecv(ep, buf + g_maxsize, 4096, mr_desc, peers[peer], 10, 0, &c2[0]); }, 5);
    if (p2) printf("[survivor r%d] follow-up 4KiB post -> %zd (%s) after %.3f s\n", g_rank, p2, perr(p2), now_s() - t2);
    else {
      int r2 = wait_ctx(c2[0], 10);
      printf("[survivor r%d] follow-up 4KiB op: %s after %.3f s (err=%d %s prov_errno=%d %s)\n", g_rank,
             r2 == 1 ? "completed OK" : r2 == -1 ? "ERROR completion" : "no completion (timeout 10s)", now_s() - t2,
             c2[0].err, fi_strerror(c2[0].err), c2[0].prov_errno, c2[0].errstr.c_str());
    }
    // (3) can we tear down? (alarm() bounds a hang here)
    double t3 = now_s();
    int cr = fi_close(&ep->fid);
    printf("[survivor r%d] fi_close(ep) -> %d in %.3f s\n", g_rank, cr, now_s() - t3);
    break;
  }
  fflush(stdout);
  // do not fi_close: provider teardown with a dead peer could itself block; just exit
  _exit(0);
}

static int child_main() {
  alarm(g_test == "perf" ? 300 : (unsigned)g_killwait + 60);  // hard safety net
  setup();
  if (g_test == "info") { barrier("end"); _exit(0); }
  barrier("ready");
  if (g_test == "perf") {
    ring_test();
    barrier("ring");
    if (g_rank < 2) {
      pingpong();
      rma_test();
    }
    barrier("end");
  } else {
    if (g_rank < 2) kill_test();
    _exit(0);
  }
  fi_close(&ep->fid);
  fi_close(&mr->fid);
  fi_close(&av->fid);
  fi_close(&cq->fid);
  fi_close(&domain->fid);
  fi_close(&fabric->fid);
  fi_freeinfo(fi);
  _exit(0);
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto next = [&] { return std::string(i + 1 < argc ? argv[++i] : ""); };
    if (a == "--prov") g_prov = next();
    else if (a == "--np") g_np = atoi(next().c_str());
    else if (a == "--test") g_test = next();
    else if (a == "--progress") g_progress = next();
    else if (a == "--maxsize") g_maxsize = strtoull(next().c_str(), nullptr, 0);
    else if (a == "--node") g_node = next();
    else if (a == "--killwait") g_killwait = atof(next().c_str());
    else { fprintf(stderr, "unknown arg %s\n", a.c_str()); return 1; }
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);  // children may die by alarm: keep lines
  if (g_prov.empty() && getenv("FI_PROVIDER")) g_prov = getenv("FI_PROVIDER");
  if (g_np < 2 || g_np > 4) { fprintf(stderr, "np must be 2..4\n"); return 1; }
  char tmpl[] = "/tmp/ofi_probe.XXXXXX";
  if (!mkdtemp(tmpl)) { perror("mkdtemp"); return 1; }
  g_dir = tmpl;
  printf("== prov=%s np=%d test=%s progress=%s dir=%s\n", g_prov.c_str(), g_np, g_test.c_str(),
         g_progress.empty() ? "(unset)" : g_progress.c_str(), g_dir.c_str());
  fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < g_np; r++) {
    pid_t p = fork();
    if (p == 0) { g_rank = r; return child_main(); }
    pids.push_back(p);
  }
  double t0 = now_s(), tlimit = g_test == "perf" ? 280 : g_killwait + 70;
  bool killed = false;
  int victim = g_test == "kill-send" ? 0 : 1;
  int alive = g_np;
  std::vector<int> status(g_np, -1);
  while (alive > 0) {
    for (int r = 0; r < g_np; r++) {
      if (status[r] != -1) continue;
      int st;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        status[r] = st;
        alive--;
        if (WIFSIGNALED(st) && !(killed && r == victim))
          printf("rank %d died by signal %d\n", r, WTERMSIG(st));
        else if (WIFEXITED(st) && WEXITSTATUS(st))
          printf("rank %d exit code %d\n", r, WEXITSTATUS(st));
      }
    }
    if (g_test.rfind("kill", 0) == 0 && !killed) {
      std::vector<char> d;
      if (read_file("started", d)) {
        usleep(20000);  // land mid-transfer of a 64 MiB op
        kill(pids[victim], SIGKILL);
        char s[64];
        int n = snprintf(s, sizeof s, "%.6f", now_s());
        write_file("killtime", s, n);
        killed = true;
        printf("parent: SIGKILLed rank %d\n", victim);
        fflush(stdout);
      }
    }
    if (now_s() - t0 > tlimit) {
      printf("parent: global timeout, killing children\n");
      for (int r = 0; r < g_np; r++)
        if (status[r] == -1) kill(pids[r], SIGKILL);
      tlimit = 1e9;
    }
    usleep(1000);
  }
  return 0;
}
