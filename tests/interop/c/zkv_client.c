/*
 * A zkv client in C, written from docs/protocol.md alone (libzmq + msgpack-c).
 *
 *   zkv_client FRONTEND [PULL_ENDPOINT]
 *
 * FRONTEND is the broker's frontend address (ipc://... or tcp://...).
 * PULL_ENDPOINT is where this client binds its result socket (default
 * tcp://127.0.0.1:*; the concrete address is read back and sent as reply_to).
 * ZKV_TIMEOUT_MS (default 15000) bounds every wait.
 *
 * It runs one fixed scenario and prints one machine-checkable line per step
 * (see tests/test_interop.py); any unexpected answer prints "FAIL ..." and
 * exits 1.  Every wait is a zmq_poll over both sockets with a deadline.
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#define MAX_FRAMES 4
#define MAX_TASKS 64
#define MAX_RANKS 16
#define MAX_DIGESTS 16
#define MAX_REPLIES 16
#define MAXMSGSIZE (64LL * 1024 * 1024)

static void *g_dealer, *g_pull;
static char g_reply_to[512];
static long g_timeout_ms = 15000;
static uint64_t g_gen = 0;       /* the client's cache generation (docs §7.4) */
static uint64_t g_next_task = 1; /* task ids: a counter from 1, never reused */
static uint64_t g_next_req = 1;
static unsigned g_ignored = 0;   /* late, stale, duplicate or undecodable messages */

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    exit(1);
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- msgpack helpers ------------------------------------------------------- */

static void pk_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n); /* strings are msgpack str, never bin (docs §2) */
    msgpack_pack_str_body(pk, s, n);
}

static void pk_kv_uint(msgpack_packer *pk, const char *key, uint64_t value) {
    pk_str(pk, key);
    msgpack_pack_uint64(pk, value);
}

static void pk_kv_str(msgpack_packer *pk, const char *key, const char *value) {
    pk_str(pk, key);
    pk_str(pk, value);
}

static void pk_header(msgpack_packer *pk, uint32_t nfields, const char *kind) {
    msgpack_pack_map(pk, nfields + 2);
    pk_kv_uint(pk, "v", 1);
    pk_kv_str(pk, "kind", kind);
}

/* Packed ids: little-endian int32, as a msgpack bin (docs §5). */
static void pk_ids_packed(msgpack_packer *pk, const char *key, const int32_t *ids, size_t n) {
    unsigned char buf[4 * 64];
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)ids[i];
        buf[4 * i] = u & 0xff;
        buf[4 * i + 1] = (u >> 8) & 0xff;
        buf[4 * i + 2] = (u >> 16) & 0xff;
        buf[4 * i + 3] = (u >> 24) & 0xff;
    }
    pk_str(pk, key);
    msgpack_pack_bin(pk, 4 * n);
    msgpack_pack_bin_body(pk, buf, 4 * n);
}

/* The other accepted form: a msgpack array of ints. */
static void pk_ids_array(msgpack_packer *pk, const char *key, const int32_t *ids, size_t n) {
    pk_str(pk, key);
    msgpack_pack_array(pk, n);
    for (size_t i = 0; i < n; i++) msgpack_pack_uint64(pk, (uint64_t)ids[i]);
}

static const msgpack_object *map_get(const msgpack_object *map, const char *key) {
    if (map->type != MSGPACK_OBJECT_MAP) return NULL;
    size_t n = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && memcmp(k->via.str.ptr, key, n) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

/* A uint field (0..2^53-1); returns 0 if absent or of another type. */
static int get_uint(const msgpack_object *map, const char *key, uint64_t *out) {
    const msgpack_object *o = map_get(map, key);
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER) return 0;
    *out = o->via.u64;
    return 1;
}

static double get_num(const msgpack_object *map, const char *key) {
    const msgpack_object *o = map_get(map, key);
    if (!o) return -1;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) return (double)o->via.u64;
    if (o->type == MSGPACK_OBJECT_FLOAT64 || o->type == MSGPACK_OBJECT_FLOAT32) return o->via.f64;
    return -1;
}

/* A str field copied into buf (NUL-terminated); "" if absent. */
static const char *get_str(const msgpack_object *map, const char *key, char *buf, size_t cap) {
    const msgpack_object *o = map_get(map, key);
    buf[0] = 0;
    if (o && o->type == MSGPACK_OBJECT_STR) {
        size_t n = o->via.str.size < cap - 1 ? o->via.str.size : cap - 1;
        memcpy(buf, o->via.str.ptr, n);
        buf[n] = 0;
    }
    return buf;
}

static int get_bool(const msgpack_object *map, const char *key) {
    const msgpack_object *o = map_get(map, key);
    return o && o->type == MSGPACK_OBJECT_BOOLEAN && o->via.boolean;
}

/* Decode one frame: a map with v == 1 and a str kind (docs §2), else 0. */
static int decode(msgpack_unpacked *u, const void *data, size_t len, char *kind, size_t kcap) {
    size_t off = 0;
    if (msgpack_unpack_next(u, data, len, &off) != MSGPACK_UNPACK_SUCCESS || off != len) return 0;
    const msgpack_object *root = &u->data;
    uint64_t v;
    if (root->type != MSGPACK_OBJECT_MAP || !get_uint(root, "v", &v) || v != 1) return 0;
    const msgpack_object *k = map_get(root, "kind");
    if (!k || k->type != MSGPACK_OBJECT_STR) return 0;
    get_str(root, "kind", kind, kcap);
    return 1;
}

/* ---- sockets ---------------------------------------------------------------- */

static void send_frames(void *sock, msgpack_sbuffer **bufs, int n) {
    for (int i = 0; i < n; i++)
        if (zmq_send(sock, bufs[i]->data, bufs[i]->size, i + 1 < n ? ZMQ_SNDMORE : 0) < 0)
            fail("send: %s", zmq_strerror(zmq_errno()));
}

static void send_raw(void *sock, const void *data, size_t len) {
    if (zmq_send(sock, data, len, 0) < 0) fail("send: %s", zmq_strerror(zmq_errno()));
}

typedef struct {
    zmq_msg_t parts[MAX_FRAMES];
    int n;
} frames_t;

static int recv_frames(void *sock, frames_t *f) {
    int more = 1;
    f->n = 0;
    while (more) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            return f->n;
        }
        more = zmq_msg_more(&msg);
        if (f->n < MAX_FRAMES) f->parts[f->n++] = msg;
        else zmq_msg_close(&msg); /* more frames than any zkv message: dropped */
    }
    return f->n;
}

static void close_frames(frames_t *f) {
    for (int i = 0; i < f->n; i++) zmq_msg_close(&f->parts[i]);
    f->n = 0;
}

/* ---- tasks and their aggregation (docs §7.4) --------------------------------- */

typedef struct {
    uint64_t id;
    int open;
    int64_t deadline;
    uint64_t world; /* 0 until the first result */
    uint64_t heard; /* bit r: rank r answered */
    uint64_t bytes;
    uint64_t floor; /* g_gen at submit: the task cannot have run at an older generation */
    int has_gen;    /* its generation is known: the gen of its results */
    uint64_t gen;
    char outcome[16]; /* "ok" until a failure; the first failure wins */
    char reason[512];
    int ndigests[MAX_RANKS];
    unsigned char digests[MAX_RANKS][MAX_DIGESTS][16];
} task_t;

static task_t g_tasks[MAX_TASKS];

static task_t *find_task(uint64_t id) {
    for (int i = 0; i < MAX_TASKS; i++)
        if (g_tasks[i].id == id) return &g_tasks[i];
    return NULL;
}

static void close_task(task_t *t, const char *outcome, const char *reason) {
    t->open = 0;
    snprintf(t->outcome, sizeof t->outcome, "%s", outcome);
    if (reason != t->reason) snprintf(t->reason, sizeof t->reason, "%s", reason);
}

/* The bus is at generation g: if that is newer, a move.  It cancels exactly the
   open tasks that ran at an older generation; a task with no result yet stays
   open, its own results will say (docs §7.4). */
static void new_generation(uint64_t g) {
    if (g <= g_gen) return;
    char reason[128];
    snprintf(reason, sizeof reason, "cache generation moved from %" PRIu64 " to %" PRIu64, g_gen, g);
    g_gen = g;
    for (int i = 0; i < MAX_TASKS; i++)
        if (g_tasks[i].id && g_tasks[i].open && g_tasks[i].has_gen && g_tasks[i].gen < g)
            close_task(&g_tasks[i], "cancelled", reason);
}

static void on_result(const msgpack_object *m) {
    uint64_t id, rank, world, gen, bytes = 0;
    char outcome[16], reason[400];
    if (!get_uint(m, "task", &id) || !get_uint(m, "rank", &rank) || !get_uint(m, "world", &world) ||
        !get_uint(m, "gen", &gen)) {
        g_ignored++;
        return;
    }
    task_t *t = find_task(id);
    if (!t || !t->open || gen < t->floor || world == 0 || world > MAX_RANKS || rank >= world) {
        g_ignored++; /* late, stale (not of this task's generation) or malformed */
        return;
    }
    if (gen < g_gen) { /* it ran at a generation the bus has left: what it copied is gone */
        snprintf(reason, sizeof reason, "cache generation moved from %" PRIu64 " to %" PRIu64, gen, g_gen);
        close_task(t, "cancelled", reason);
        return;
    }
    new_generation(gen); /* a newer one: a move, learned from this result */
    if (!t->open) return; /* an earlier rank's result of this task was older */
    if ((t->heard >> rank) & 1) {
        g_ignored++; /* duplicate */
        return;
    }
    t->has_gen = 1;
    t->gen = gen;
    if (!t->world) t->world = world;
    t->heard |= 1ull << rank;
    get_uint(m, "bytes", &bytes);
    t->bytes += bytes;
    get_str(m, "outcome", outcome, sizeof outcome);
    get_str(m, "reason", reason, sizeof reason);
    if (strcmp(outcome, "ok") != 0 && strcmp(t->outcome, "ok") == 0) {
        snprintf(t->outcome, sizeof t->outcome, "%s", outcome);
        snprintf(t->reason, sizeof t->reason, "rank %" PRIu64 ": %s", rank, reason);
    }
    const msgpack_object *d = map_get(m, "digests");
    if (d && d->type == MSGPACK_OBJECT_ARRAY) {
        int n = 0;
        for (uint32_t i = 0; i < d->via.array.size && i < MAX_DIGESTS; i++) {
            const msgpack_object *b = &d->via.array.ptr[i];
            if (b->type == MSGPACK_OBJECT_BIN && b->via.bin.size == 16) memcpy(t->digests[rank][n++], b->via.bin.ptr, 16);
        }
        t->ndigests[rank] = n;
    }
    if (t->heard == ((world >= 64) ? ~0ull : ((1ull << world) - 1))) t->open = 0; /* every rank answered */
}

static void on_outcome(const msgpack_object *m) {
    uint64_t id, gen;
    char outcome[16], reason[400];
    task_t *t = get_uint(m, "task", &id) ? find_task(id) : NULL;
    if (!t || !t->open) g_ignored++;
    else close_task(t, get_str(m, "outcome", outcome, sizeof outcome), get_str(m, "reason", reason, sizeof reason));
    if (get_uint(m, "gen", &gen)) new_generation(gen); /* the task's own generation: one the bus reached */
}

/* ---- replies, kept raw until their request claims them --------------------- */

typedef struct {
    int used;
    int has_req;
    uint64_t req;
    size_t len;
    char *data;
} stored_t;

static stored_t g_replies[MAX_REPLIES];
static char *g_held; /* the frame the last claimed reply was decoded from: its strs point into it */

static void store_reply(const msgpack_object *m, const void *data, size_t len) {
    for (int i = 0; i < MAX_REPLIES; i++) {
        if (g_replies[i].used) continue;
        g_replies[i].used = 1;
        g_replies[i].has_req = get_uint(m, "req", &g_replies[i].req);
        g_replies[i].len = len;
        g_replies[i].data = malloc(len);
        memcpy(g_replies[i].data, data, len);
        return;
    }
    g_ignored++;
}

/* ---- the one wait: poll both sockets, file everything, expire deadlines ---- */

static void pump(long timeout_ms) {
    zmq_pollitem_t items[2] = {{g_dealer, 0, ZMQ_POLLIN, 0}, {g_pull, 0, ZMQ_POLLIN, 0}};
    if (zmq_poll(items, 2, timeout_ms) < 0) fail("poll: %s", zmq_strerror(zmq_errno()));
    for (int s = 0; s < 2; s++) {
        if (!(items[s].revents & ZMQ_POLLIN)) continue;
        frames_t f;
        for (int batch = 0; batch < 1000 && recv_frames(items[s].socket, &f) > 0; batch++) {
            msgpack_unpacked u;
            char kind[32];
            msgpack_unpacked_init(&u);
            const void *data = zmq_msg_data(&f.parts[0]);
            size_t len = zmq_msg_size(&f.parts[0]);
            if (f.n != 1 || !decode(&u, data, len, kind, sizeof kind)) g_ignored++;
            else if (s == 1 && strcmp(kind, "result") == 0) on_result(&u.data);
            else if (s == 0 && strcmp(kind, "outcome") == 0) on_outcome(&u.data);
            else if (s == 0 && (strcmp(kind, "reply") == 0 || strcmp(kind, "error") == 0)) store_reply(&u.data, data, len);
            else g_ignored++;
            msgpack_unpacked_destroy(&u);
            close_frames(&f);
        }
    }
    int64_t now = now_ms();
    for (int i = 0; i < MAX_TASKS; i++)
        if (g_tasks[i].id && g_tasks[i].open && now >= g_tasks[i].deadline)
            close_task(&g_tasks[i], "timeout", "no outcome before the client's deadline");
}

static task_t *wait_task(uint64_t id) {
    task_t *t = find_task(id);
    while (t->open) {
        long left = (long)(t->deadline - now_ms());
        pump(left > 0 ? left : 0);
    }
    return t;
}

/* Wait for the reply to `req` (or, with req == 0, for an error without req). */
static void wait_reply(uint64_t req, msgpack_unpacked *u, char *kind, size_t kcap, const char *what) {
    int64_t deadline = now_ms() + g_timeout_ms;
    for (;;) {
        for (int i = 0; i < MAX_REPLIES; i++) {
            stored_t *r = &g_replies[i];
            if (!r->used || (req ? !(r->has_req && r->req == req) : r->has_req)) continue;
            msgpack_unpacked_init(u);
            decode(u, r->data, r->len, kind, kcap);
            free(g_held); /* the previous reply's unpacked object is destroyed by now */
            g_held = r->data; /* msgpack-c str/bin objects point into the input buffer */
            r->used = 0;
            return;
        }
        long left = (long)(deadline - now_ms());
        if (left <= 0) fail("%s no reply within %ld ms", what, g_timeout_ms);
        pump(left);
    }
}

/* ---- requests ----------------------------------------------------------------- */

/* Send {v, kind, req, [timeout_ms], [extra uint]} and wait for its reply. */
static uint64_t request(const char *kind, const char *extra_key, uint64_t extra_value, msgpack_unpacked *u,
                        char *rkind, size_t kcap) {
    uint64_t req = g_next_req++;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    int control = strcmp(kind, "pause") == 0 || strcmp(kind, "clear") == 0 || strcmp(kind, "resume") == 0;
    pk_header(&pk, 1 + (control ? 1 : 0) + (extra_key ? 1 : 0), kind);
    pk_kv_uint(&pk, "req", req);
    if (control) pk_kv_uint(&pk, "timeout_ms", (uint64_t)g_timeout_ms);
    if (extra_key) pk_kv_uint(&pk, extra_key, extra_value);
    msgpack_sbuffer *bufs[1] = {&sb};
    send_frames(g_dealer, bufs, 1);
    msgpack_sbuffer_destroy(&sb);
    wait_reply(req, u, rkind, kcap, kind);
    return req;
}

static void expect_reply(const char *op, msgpack_unpacked *u, const char *kind) {
    char code[64], reason[512], rop[32];
    if (strcmp(kind, "error") == 0)
        fail("%s error code=%s reason=%s", op, get_str(&u->data, "code", code, sizeof code),
             get_str(&u->data, "reason", reason, sizeof reason));
    if (strcmp(kind, "reply") != 0 || strcmp(get_str(&u->data, "op", rop, sizeof rop), op) != 0)
        fail("%s unexpected %s op=%s", op, kind, rop);
}

/* ---- tasks -------------------------------------------------------------------- */

enum ids_form { PACKED, ARRAY };

static uint64_t submit(const char *op, const int32_t *src, size_t nsrc, const int32_t *dst, size_t ndst,
                       const char *tier, int64_t seed, enum ids_form form) {
    uint64_t id = g_next_task++;
    task_t *t = NULL;
    for (int i = 0; i < MAX_TASKS && !t; i++)
        if (!g_tasks[i].id) t = &g_tasks[i];
    if (!t) fail("too many tasks");
    memset(t, 0, sizeof *t);
    t->id = id;
    t->open = 1;
    t->deadline = now_ms() + g_timeout_ms;
    t->floor = g_gen;
    strcpy(t->outcome, "ok");

    msgpack_sbuffer head, body;
    msgpack_packer pk;
    msgpack_sbuffer_init(&head);
    msgpack_packer_init(&pk, &head, msgpack_sbuffer_write);
    pk_header(&pk, 2, "submit");
    pk_kv_uint(&pk, "task", id);
    pk_kv_str(&pk, "reply_to", g_reply_to);

    msgpack_sbuffer_init(&body);
    msgpack_packer_init(&pk, &body, msgpack_sbuffer_write);
    pk_header(&pk, 1 + (src ? 1 : 0) + (dst ? 1 : 0) + (tier ? 1 : 0) + (seed >= 0 ? 1 : 0), "body");
    pk_kv_str(&pk, "op", op);
    if (src) (form == PACKED ? pk_ids_packed : pk_ids_array)(&pk, "src", src, nsrc);
    if (dst) (form == PACKED ? pk_ids_packed : pk_ids_array)(&pk, "dst", dst, ndst);
    if (tier) pk_kv_str(&pk, "tier", tier);
    if (seed >= 0) pk_kv_uint(&pk, "seed", (uint64_t)seed);

    msgpack_sbuffer *bufs[2] = {&head, &body}; /* two frames, no delimiter (docs §3.1) */
    send_frames(g_dealer, bufs, 2);
    msgpack_sbuffer_destroy(&head);
    msgpack_sbuffer_destroy(&body);
    return id;
}

static task_t *run_ok(const char *label, const char *op, const int32_t *src, size_t nsrc, const int32_t *dst,
                      size_t ndst, const char *tier, int64_t seed, enum ids_form form) {
    task_t *t = wait_task(submit(op, src, nsrc, dst, ndst, tier, seed, form));
    if (strcmp(t->outcome, "ok") != 0) fail("%s %s reason=%s", label, t->outcome, t->reason);
    printf("%s ok bytes=%" PRIu64 " ranks=%" PRIu64 "\n", label, t->bytes, t->world);
    fflush(stdout);
    return t;
}

/* A control request on another connection (a controller's): send it, wait for
   its one reply on that socket only; returns the reply's gen. */
static uint64_t ctl_request(void *ctl, const char *kind) {
    static uint64_t next_req = 1;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    pk_header(&pk, 2, kind);
    pk_kv_uint(&pk, "req", next_req++);
    pk_kv_uint(&pk, "timeout_ms", (uint64_t)g_timeout_ms);
    msgpack_sbuffer *bufs[1] = {&sb};
    send_frames(ctl, bufs, 1);
    msgpack_sbuffer_destroy(&sb);
    zmq_pollitem_t item = {ctl, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, g_timeout_ms) <= 0) fail("controller %s no reply within %ld ms", kind, g_timeout_ms);
    frames_t f;
    if (recv_frames(ctl, &f) != 1) fail("controller %s: not one frame", kind);
    msgpack_unpacked u;
    char rkind[32], op[32];
    uint64_t gen = 0;
    msgpack_unpacked_init(&u);
    if (!decode(&u, zmq_msg_data(&f.parts[0]), zmq_msg_size(&f.parts[0]), rkind, sizeof rkind) ||
        strcmp(rkind, "reply") != 0 || strcmp(get_str(&u.data, "op", op, sizeof op), kind) != 0 ||
        !get_uint(&u.data, "gen", &gen))
        fail("controller %s: unexpected answer %s", kind, rkind);
    msgpack_unpacked_destroy(&u);
    close_frames(&f);
    return gen;
}

/* ---- the scenario ---------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FRONTEND [PULL_ENDPOINT]\n", argv[0]);
        return 2;
    }
    const char *frontend = argv[1];
    const char *pull_at = argc > 2 ? argv[2] : "tcp://127.0.0.1:*";
    if (getenv("ZKV_TIMEOUT_MS")) g_timeout_ms = atol(getenv("ZKV_TIMEOUT_MS"));

    void *ctx = zmq_ctx_new();
    int zero = 0;
    int64_t maxmsg = MAXMSGSIZE;
    g_pull = zmq_socket(ctx, ZMQ_PULL);
    g_dealer = zmq_socket(ctx, ZMQ_DEALER);
    void *socks[2] = {g_pull, g_dealer};
    for (int i = 0; i < 2; i++) {
        zmq_setsockopt(socks[i], ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(socks[i], ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    }
    if (zmq_bind(g_pull, pull_at) != 0) fail("bind %s: %s", pull_at, zmq_strerror(zmq_errno()));
    size_t len = sizeof g_reply_to;
    zmq_getsockopt(g_pull, ZMQ_LAST_ENDPOINT, g_reply_to, &len); /* the concrete address */
    if (zmq_connect(g_dealer, frontend) != 0) fail("connect %s: %s", frontend, zmq_strerror(zmq_errno()));
    printf("client c reply_to=%s\n", g_reply_to);

    msgpack_unpacked u;
    char kind[32], state[32], code[64], reason[512];
    uint64_t world = 0, gen = 0, epoch = 0, n = 0;

    /* status: world size, live ranks, generation; wait for the ranks if needed. */
    request("status", NULL, 0, &u, kind, sizeof kind);
    expect_reply("status", &u, kind);
    get_uint(&u.data, "world", &world);
    const msgpack_object *ranks = map_get(&u.data, "ranks");
    uint64_t alive = 0;
    if (ranks && ranks->type == MSGPACK_OBJECT_ARRAY)
        for (uint32_t i = 0; i < ranks->via.array.size; i++) alive += get_bool(&ranks->via.array.ptr[i], "alive");
    if (alive < world) {
        msgpack_unpacked_destroy(&u);
        request("status", "wait_ranks", world, &u, kind, sizeof kind);
        expect_reply("status", &u, kind);
        alive = world;
    }
    get_uint(&u.data, "gen", &g_gen);
    printf("status ok state=%s world=%" PRIu64 " alive=%" PRIu64 " gen=%" PRIu64 "\n",
           get_str(&u.data, "state", state, sizeof state), world, alive, g_gen);
    msgpack_unpacked_destroy(&u);

    request("ping", NULL, 0, &u, kind, sizeof kind);
    expect_reply("ping", &u, kind);
    printf("ping ok\n");
    msgpack_unpacked_destroy(&u);

    /* Fill 4 GPU blocks, hash them, swap them out and back in elsewhere, hash again. */
    int32_t gpu_a[4] = {0, 1, 2, 3}, cpu[4] = {20, 21, 22, 23}, gpu_b[4] = {8, 9, 10, 11};
    run_ok("fill", "fill", NULL, 0, gpu_a, 4, "gpu", 11, PACKED);
    task_t *before = run_ok("checksum", "checksum", gpu_a, 4, NULL, 0, "gpu", -1, PACKED);
    task_t saved = *before;
    run_ok("swap_out", "swap_out", gpu_a, 4, cpu, 4, NULL, -1, PACKED);
    run_ok("swap_in", "swap_in", cpu, 4, gpu_b, 4, NULL, -1, ARRAY); /* the array form of ids */
    task_t *after = run_ok("checksum_after", "checksum", gpu_b, 4, NULL, 0, "gpu", -1, PACKED);
    int identical = 1;
    for (uint64_t r = 0; r < world; r++) {
        if (saved.ndigests[r] != 4 || after->ndigests[r] != 4 ||
            memcmp(saved.digests[r], after->digests[r], 4 * 16) != 0)
            identical = 0;
    }
    if (!identical) fail("roundtrip digests differ");
    printf("roundtrip ok identical=true\n");

    /* A bad block id: every rank answers failed; the first failure is the outcome. */
    int32_t one[1] = {0}, bad[1] = {999};
    task_t *t = wait_task(submit("swap_out", one, 1, bad, 1, NULL, -1, PACKED));
    if (strcmp(t->outcome, "failed") != 0) fail("bad_ids expected failed, got %s", t->outcome);
    printf("bad_ids failed ranks=%" PRIu64 " reason=%s\n", t->world, t->reason);

    /* pause; a task submitted while paused is queued, then cancelled by clear. */
    request("pause", NULL, 0, &u, kind, sizeof kind);
    expect_reply("pause", &u, kind);
    get_uint(&u.data, "epoch", &epoch);
    get_uint(&u.data, "gen", &gen);
    printf("pause ok epoch=%" PRIu64 " gen=%" PRIu64 " state=%s drain_ms=%.3f\n", epoch, gen,
           get_str(&u.data, "state", state, sizeof state), get_num(&u.data, "drain_ms"));
    msgpack_unpacked_destroy(&u);

    uint64_t queued = submit("swap_out", gpu_a, 4, cpu, 4, NULL, -1, PACKED);

    uint64_t before_clear = g_next_task; /* the tasks submitted before the clear request */
    request("clear", NULL, 0, &u, kind, sizeof kind);
    expect_reply("clear", &u, kind);
    get_uint(&u.data, "epoch", &epoch);
    get_uint(&u.data, "gen", &gen);
    uint64_t cancelled = 0, freed = 0;
    get_uint(&u.data, "cancelled", &cancelled);
    get_uint(&u.data, "freed", &freed);
    printf("clear ok epoch=%" PRIu64 " gen=%" PRIu64 " state=%s cancelled=%" PRIu64 " freed=%" PRIu64 "\n", epoch,
           gen, get_str(&u.data, "state", state, sizeof state), cancelled, freed);
    msgpack_unpacked_destroy(&u);
    t = wait_task(queued); /* the broker's outcome message arrives before the clear reply */
    printf("queued %s reason=%s\n", t->outcome, t->reason);
    if (gen > g_gen) { /* our own clear: every task submitted before it is of an older generation (docs §7.4) */
        g_gen = gen;
        for (int i = 0; i < MAX_TASKS; i++)
            if (g_tasks[i].id && g_tasks[i].open && g_tasks[i].id < before_clear)
                close_task(&g_tasks[i], "cancelled", "caches were cleared");
    }

    t = wait_task(submit("swap_out", gpu_a, 4, cpu, 4, NULL, -1, PACKED));
    printf("while_cleared %s\n", t->outcome);

    request("resume", NULL, 0, &u, kind, sizeof kind);
    expect_reply("resume", &u, kind);
    get_uint(&u.data, "epoch", &epoch);
    get_uint(&u.data, "gen", &gen);
    printf("resume ok epoch=%" PRIu64 " gen=%" PRIu64 " state=%s\n", epoch, gen,
           get_str(&u.data, "state", state, sizeof state));
    msgpack_unpacked_destroy(&u);
    new_generation(gen);

    run_ok("after_resume", "swap_out", gpu_a, 4, cpu, 4, NULL, -1, PACKED);

    /* A controller on another connection pauses, clears and resumes.  A task
       queued at the clear ends cancelled; the tasks submitted after the resume
       ran at the new generation, which this connection learns from their
       results: they end ok, none is cancelled (docs §7.4). */
    void *ctl = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(ctl, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_connect(ctl, frontend) != 0) fail("connect %s: %s", frontend, zmq_strerror(zmq_errno()));
    ctl_request(ctl, "pause");
    uint64_t held = submit("swap_out", gpu_a, 4, cpu, 4, NULL, -1, PACKED);
    request("ping", NULL, 0, &u, kind, sizeof kind); /* one connection keeps order: the task is queued now */
    expect_reply("ping", &u, kind);
    msgpack_unpacked_destroy(&u);
    ctl_request(ctl, "clear");
    t = wait_task(held);
    printf("foreign_queued %s\n", t->outcome);
    uint64_t foreign_gen = ctl_request(ctl, "resume");
    zmq_close(ctl);
    uint64_t after_ids[5];
    for (int i = 0; i < 5; i++) after_ids[i] = submit("swap_out", gpu_a, 4, cpu, 4, NULL, -1, PACKED); /* pipelined */
    int ok = 0;
    for (int i = 0; i < 5; i++) {
        t = wait_task(after_ids[i]);
        if (strcmp(t->outcome, "ok") != 0) fail("foreign_after %s reason=%s", t->outcome, t->reason);
        ok += t->has_gen && t->gen == foreign_gen;
    }
    printf("foreign_after ok=%d gen=%" PRIu64 " resumed_gen=%" PRIu64 "\n", ok, g_gen, foreign_gen);

    /* Bad input: not msgpack (an error without req), then a wrong version (an
       error that still echoes the readable req, protocol.md section 8.1). */
    const unsigned char not_msgpack[1] = {0xc1};
    send_raw(g_dealer, not_msgpack, 1);
    wait_reply(0, &u, kind, sizeof kind, "malformed");
    printf("malformed %s code=%s\n", kind, get_str(&u.data, "code", code, sizeof code));
    msgpack_unpacked_destroy(&u);

    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3);
    pk_kv_uint(&pk, "v", 2);
    pk_kv_str(&pk, "kind", "ping");
    uint64_t bad_req = g_next_req++;
    pk_kv_uint(&pk, "req", bad_req);
    send_raw(g_dealer, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
    wait_reply(bad_req, &u, kind, sizeof kind, "bad_version");
    printf("bad_version %s code=%s reason=%s\n", kind, get_str(&u.data, "code", code, sizeof code),
           get_str(&u.data, "reason", reason, sizeof reason));
    msgpack_unpacked_destroy(&u);

    /* The bus still serves after bad input. */
    request("ping", NULL, 0, &u, kind, sizeof kind);
    expect_reply("ping", &u, kind);
    msgpack_unpacked_destroy(&u);
    n = g_next_task - 1;
    printf("done tasks=%" PRIu64 " ignored=%u\n", n, g_ignored);
    fflush(stdout);

    zmq_close(g_dealer);
    zmq_close(g_pull);
    zmq_ctx_term(ctx);
    return 0;
}
